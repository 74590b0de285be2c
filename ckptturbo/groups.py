"""Which process group checkpoint bytes travel on, and as what.

Jobs hand ckptturbo the group they train with, and in a GPU job that is NCCL, which
carries only CUDA tensors. When most of a load's bytes are bound for CUDA tensors and the
job's group speaks NCCL, chunks are worth sending as CUDA tensors over it: one
host-to-device copy on the rank that read a chunk, then the fast links (NVLink,
InfiniBand), and device-to-device copies on the receivers. Otherwise chunks travel as the
host buffers they were read into, on a group that carries host memory: the job's own
when it does (gloo, or the gloo side of "cpu:gloo,cuda:nccl"), else a gloo group over
the same ranks. Saves always get a gloo group of their own, since checkpoint traffic must
never interleave with the training loop's collectives (that is what makes DCP's own async
save hang). Each such group is created once per (group, purpose) and kept by its owner,
since creating one is a collective among its ranks: the caller hands the keeper of those
groups (``ckptturbo.runtime.Runtime``), this module never looks one up.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .retry import seconds_setting

TRANSPORTS = ("auto", "gloo")


class GroupKeeper(Protocol):
    """Whoever keeps the dedicated gloo groups (``Runtime.gloo_group``): one per group and
    purpose, made on first use (a collective over the group's ranks)."""

    def gloo_group(self, group: Any, purpose: str) -> Any:
        """The gloo group over ``group``'s ranks kept for ``purpose``."""

_HOST_BACKENDS = {"gloo", "mpi"}


def check_transport(transport: str) -> None:
    """Refuse a ``transport`` setting that is not one of TRANSPORTS."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def moves_host_buffers(backend: str) -> bool:
    """Whether a group of this backend ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...) carries
    CPU tensors. Unknown backends count as not: a gloo group beside them is always safe."""
    for entry in str(backend).lower().split(","):
        device, _, name = entry.strip().rpartition(":")
        if device == "cpu" or (not device and name in _HOST_BACKENDS):
            return True
    return False


def moves_cuda_tensors(backend: str) -> bool:
    """Whether a group of this backend sends CUDA tensors over NCCL ("nccl", "cuda:nccl",
    or the NCCL side of a mixed "cpu:gloo,cuda:nccl" group)."""
    for entry in str(backend).lower().split(","):
        device, _, name = entry.strip().rpartition(":")
        if name == "nccl" and device in ("", "cuda"):
            return True
    return False


def new_gloo_group(group: Any) -> Any:
    """A new gloo group over the ranks of ``group``; only those ranks take part, and each
    must call this in the same order as its other group creations (runtimes keep the
    groups they make: see ``Runtime.gloo_group``). Its collectives wait for a silent peer
    as long as the environment's CKPTTURBO_COLLECTIVE_TIMEOUT says (seconds), else
    torch's default for new groups."""
    seconds = seconds_setting("COLLECTIVE_TIMEOUT", None, None, ValueError)
    timeout = None if seconds is None else datetime.timedelta(seconds=seconds)
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)


def host_transport_group(group: Any = None, transport: str = "auto", purpose: str = "load", *,
                         keeper: GroupKeeper) -> Any:
    """The group host buffers travel on for a job running on ``group``.

    "auto": the job's group itself when it carries CPU tensors (gloo, or a mixed
    "cpu:gloo,cuda:nccl" group), else a dedicated gloo group over its ranks, kept by
    ``keeper``; "gloo": always a dedicated gloo group, so
    chunks never share the training loop's group.
    """
    check_transport(transport)
    if not dist.is_initialized():
        return group
    if transport == "auto" and moves_host_buffers(dist.get_backend(group)):
        return group
    return keeper.gloo_group(group, purpose)


@dataclass(frozen=True)
class Transport:
    """How one grouped load moves chunks: on ``group`` (None: the default group), in
    buffers on ``device`` ("cpu": host buffers; "cuda": device buffers over NCCL)."""

    kind: str  # "nccl", "job" (the job's group, host buffers) or "gloo" (a gloo group of its own)
    group: Any
    device: torch.device


def transport_kind(backend: str, transport: str, cuda_bytes: int, total_bytes: int) -> str:
    """The choice, as a pure function of the job's backend, the user's ``transport`` and
    where the load's bytes go (summed over every rank, so all ranks choose alike).

    "nccl" when the job's group speaks NCCL and most bytes are bound for CUDA tensors;
    else host buffers on the job's group ("job") when it carries them; else "gloo". The
    ``transport="gloo"`` setting always gives "gloo".
    """
    check_transport(transport)
    if transport == "gloo":
        return "gloo"
    if moves_cuda_tensors(backend) and 2 * cuda_bytes > total_bytes:
        return "nccl"
    return "job" if moves_host_buffers(backend) else "gloo"


def load_transport(keeper: GroupKeeper, group: Any, transport: str, cuda_bytes: int,
                   total_bytes: int) -> Transport:
    """The transport of a grouped load; every rank of ``group`` calls it with its own byte
    counts. Over an NCCL group the counts are summed first (one small all-reduce), so that
    every rank takes the same choice."""
    backend = str(dist.get_backend(group))
    if transport == "auto" and moves_cuda_tensors(backend):
        counts = torch.tensor([cuda_bytes, total_bytes], dtype=torch.int64,
                              device="cpu" if moves_host_buffers(backend) else "cuda")
        dist.all_reduce(counts, group=group)
        cuda_bytes, total_bytes = (int(v) for v in counts.tolist())
    kind = transport_kind(backend, transport, cuda_bytes, total_bytes)
    if kind == "nccl":
        return Transport(kind, group, torch.device("cuda", torch.cuda.current_device()))
    return Transport(kind, host_transport_group(group, transport, keeper=keeper),
                     torch.device("cpu"))
