"""Nested checkpoint dicts <-> flat DCP state dicts, keeping the nesting exactly.

DCP's own flattening turns every mapping key into a string and drops empty containers,
so a Lightning or optimizer state dict (``{"state": {0: ...}}``, ``"callbacks": {}``)
would not come back as it went in. Here the nesting is kept as a *skeleton*: the same
containers with every leaf replaced by its flat key, stored next to the leaves as one
small object that loads with torch's restricted unpickler.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import torch

from ckptturbo.errors import FormatError, PlanError

SKELETON_KEY = "__ckptturbo_tree__"


def _has_branches(seq: Any) -> bool:
    return any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in seq)


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``{key: tensor or object}`` plus the skeleton under SKELETON_KEY.

    Lists and tuples are walked only when they hold tensors or containers; lists of
    plain values stay one object, as in DCP.
    """
    flat: dict[str, Any] = {}

    def walk(path: tuple, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {"dict": [(k, walk(path + (str(k),), v)) for k, v in value.items()]}
        if isinstance(value, (list, tuple)) and _has_branches(value):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [walk(path + (str(i),), v) for i, v in enumerate(value)]}
        key = ".".join(path)
        if key in flat or key == SKELETON_KEY:
            raise PlanError(f"two entries of the checkpoint flatten to the same key {key!r}; "
                            "rename one of them")
        flat[key] = value
        return {"leaf": key}

    skeleton = walk((), state)
    flat[SKELETON_KEY] = skeleton
    return flat


def unflatten(flat: dict[str, Any], planner_data: Any, where: str) -> dict[str, Any]:
    """Rebuild the nested dict: from our skeleton, else from DCP's {key: path} mapping."""
    skeleton = flat.pop(SKELETON_KEY, None)
    if skeleton is not None:
        return _build(skeleton, flat, where)
    out: dict[str, Any] = {}
    mapping = planner_data if isinstance(planner_data, dict) else {}
    for key, value in flat.items():
        path = mapping.get(key, (key,))
        node: Any = out
        for part, nxt in pairwise(path):
            default: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = default
                node = node[part]
            else:
                node = node.setdefault(part, default)
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = value
    return out


def _build(node: Any, flat: dict[str, Any], where: str) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise FormatError(f"{where}: malformed checkpoint tree node {node!r}")
    (kind, body), = node.items()
    if kind == "leaf":
        if body not in flat:
            raise FormatError(f"{where}: the checkpoint tree names {body!r}, which is not stored")
        return flat[body]
    if kind == "dict":
        return {k: _build(v, flat, where) for k, v in body}
    if kind == "list":
        return [_build(v, flat, where) for v in body]
    if kind == "tuple":
        return tuple(_build(v, flat, where) for v in body)
    raise FormatError(f"{where}: unknown checkpoint tree node kind {kind!r}")
