"""A state dict flattened as DCP's default planners flatten it, in one walk.

DCP's planners pass every state dict through two walks before they plan:
``flatten_state_dict`` (nested dicts and lists to dotted keys) and
``_flatten_sharded_tensors`` (which rebuilds the whole dict to rewrite a ShardedTensor
nested in another). On a 1,750-tensor state that is 3-4 ms on every rank of every save
and load, most of it the rebuild, which changes nothing where there is no ShardedTensor,
except in one corner: a list that holds a dict with nothing in it (the rebuild pads the
list, so the list's keys change). ``flatten`` walks once and returns DCP's result, or
None where DCP's own walks must run: a ShardedTensor, that corner, a duplicated key (DCP
raises its own error), or DCP's 2.3 key format. Pure: no I/O, no collectives.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint import _version

Flattened = tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]


class _DcpDecides(Exception):
    """The state dict needs DCP's own walks."""


def flatten(state_dict: Mapping[str, Any]) -> Flattened | None:
    """``flatten_state_dict(_flatten_sharded_tensors(state_dict))`` as DCP's load planner
    computes it (and, equally, the save planner's other order), with the same keys in
    the same order and the same mappings; None where DCP's own walks must run."""
    if _version._derived_version == "2_3":
        return None
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}
    try:
        for key, value in state_dict.items():
            _walk(str(key), (str(key),), value, flat, mappings)
    except _DcpDecides:
        return None
    return flat, mappings


def _walk(fqn: str, path: tuple[str | int, ...], value: Any, flat: dict[str, Any],
          mappings: dict[str, tuple[str | int, ...]]) -> int:
    """DCP's ``traverse_state_dict`` from ``value`` at ``path``; returns the leaves it
    found."""
    if isinstance(value, torch.Tensor):
        return _leaf(fqn, path, value, flat, mappings)
    if type(value) is dict or isinstance(value, Mapping):
        return sum(_walk(f"{fqn}.{k}", (*path, str(k)), v, flat, mappings)
                   for k, v in value.items())
    if isinstance(value, list) and not _terminal(value):
        found = 0
        for i, v in enumerate(value):
            n = _walk(f"{fqn}.{i}", (*path, i), v, flat, mappings)
            if n == 0 and isinstance(v, Mapping):  # the rebuild would pad the list
                raise _DcpDecides
            found += n
        return found
    return _leaf(fqn, path, value, flat, mappings)


def _leaf(fqn: str, path: tuple[str | int, ...], value: Any, flat: dict[str, Any],
          mappings: dict[str, tuple[str | int, ...]]) -> int:
    if fqn in flat or isinstance(value, ShardedTensor):
        raise _DcpDecides
    flat[fqn] = value
    mappings[fqn] = path
    return 1


def _terminal(values: list) -> bool:
    """DCP's ``_is_terminal`` of a list: it is one value unless it holds a tensor, a
    mapping, or a list that is not one value itself."""
    for entry in values:
        if isinstance(entry, (torch.Tensor, Mapping)):
            return False
        if isinstance(entry, list) and not _terminal(entry):
            return False
    return True
