"""One host copy per node of the tensors a tensor-parallel vLLM engine serves.

Live updates keep the served checkpoint's tensors in host memory (what a swap reloads the
changed layers from, and what undoes a failed one). Every worker of a tensor-parallel
group holds the same tensors, so private copies would cost the checkpoint's size once
per worker: 8x on an 8-GPU node. Instead the group's first worker writes each tensor
to a file of its own in the node's memory file system (``/dev/shm``), every worker maps
the files (``torch.from_file(shared=True)``: the same pages for all), and once all have
mapped them the first worker unlinks the files: nothing is left behind when the engine
exits or dies, and a tensor's pages are freed when the last worker drops it. A group
whose workers are on several nodes keeps private copies.
"""
from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid
from typing import Any

import torch

from ckptturbo.adapter_support import agree, gather, settle

log = logging.getLogger(__name__)

SHM = "/dev/shm"


def _directory() -> str:
    return SHM if os.path.isdir(SHM) else tempfile.gettempdir()


def share(tensors: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """``tensors`` (equal on every worker of ``group``) backed by one copy per node.

    Collective over ``group`` (vLLM's tensor-parallel gloo ``cpu_group``); alone, or with
    workers on several nodes, the tensors are returned as they are."""
    if group is None or not tensors:
        return tensors
    hosts = gather(group, socket.gethostname())
    if len(set(hosts)) != 1:
        return tensors
    first = torch.distributed.get_rank(group) == 0
    names = sorted(tensors)
    paths = agree(group, "sharing the served tensors", lambda: _write(tensors, names) if first
                  else None)[0]
    assert paths is not None
    try:  # only the outcome travels: each worker keeps its own mappings
        shared = settle(group, "mapping the served tensors",
                        lambda: {name: _map(path, tensors[name])
                                 for name, path in zip(names, paths, strict=True)})
    finally:
        if first:
            for path in paths:
                os.unlink(path)
    # every worker returns once the files are gone: nothing is left for a crash to leak
    agree(group, "unlinking the served tensors' files", lambda: None)
    return shared


def _write(tensors: dict[str, torch.Tensor], names: list[str]) -> list[str]:
    directory, stem = _directory(), f"ckptturbo-vllm-{uuid.uuid4().hex}"
    paths = []
    for i, name in enumerate(names):
        path = os.path.join(directory, f"{stem}-{i}")
        flat = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        flat.view(torch.uint8).numpy().tofile(path)
        paths.append(path)
    return paths


def _map(path: str, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return like
    data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return data.view(like.dtype).reshape(like.shape)
