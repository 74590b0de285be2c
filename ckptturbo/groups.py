"""Which process group checkpoint bytes travel on.

Jobs hand ckptturbo the group they train with, and in a GPU job that is NCCL, which
carries only CUDA tensors. Chunks read from storage are host buffers, and checkpoint
traffic must never interleave with the training loop's collectives (that is what makes
DCP's own async save hang), so bytes move on a gloo group over the same ranks whenever
the job's group cannot carry host memory, and saves always get one of their own. Each
such group is created once per (group, purpose) and kept, since creating one is a
collective among its ranks.
"""
from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

TRANSPORTS = ("auto", "gloo")
_HOST_BACKENDS = {"gloo", "mpi"}

_dedicated: dict[tuple[Any, str], Any] = {}
_lock = threading.Lock()


def moves_host_buffers(backend: str) -> bool:
    """Whether a group of this backend ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...) carries
    CPU tensors. Unknown backends count as not: a gloo group beside them is always safe."""
    for entry in str(backend).lower().split(","):
        device, _, name = entry.strip().rpartition(":")
        if device == "cpu" or (not device and name in _HOST_BACKENDS):
            return True
    return False


def dedicated_gloo_group(group: Any = None, purpose: str = "save") -> Any:
    """A gloo group over the ranks of ``group`` (default: the world), one per purpose.

    Every rank of ``group`` must call it the first time, in the same order as its other
    group creations; only those ranks take part. None outside torch.distributed.
    """
    if not dist.is_initialized():
        return None
    key = (group or dist.group.WORLD, purpose)
    with _lock:
        if key not in _dedicated:
            ranks = dist.get_process_group_ranks(key[0])
            _dedicated[key] = dist.new_group(ranks=ranks, backend="gloo",
                                             use_local_synchronization=True)
        return _dedicated[key]


def host_transport_group(group: Any = None, transport: str = "auto", purpose: str = "load") -> Any:
    """The group host buffers travel on for a job running on ``group``.

    "auto": the job's group itself when it carries CPU tensors (gloo, or a mixed
    "cpu:gloo,cuda:nccl" group), else a dedicated gloo group over its ranks; "gloo": always
    a dedicated gloo group, so chunks never share the training loop's group.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not dist.is_initialized():
        return group
    if transport == "auto" and moves_host_buffers(dist.get_backend(group)):
        return group
    return dedicated_gloo_group(group, purpose)
