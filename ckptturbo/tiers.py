"""Tiers: where a tiered checkpoint lives besides its durable URL, and how often it goes there.

A tiered save commits each checkpoint to the node's host memory first (a directory on a
memory file system, /dev/shm by default), copies each node's chunks to ``replicas`` other
nodes' memory, and persists every Nth one to the durable URL.
The memory tier holds the same layout as any run (content-addressed chunks, one manifest
per checkpoint), so everything that reads or checks a run works on it unchanged. This
module is only the options and the names: which directory, which node, which budget.
"""
from __future__ import annotations

import os
import posixpath
import re
import socket
from dataclasses import dataclass

from .chunks import chunk_id
from .errors import CkptTurboError
from .urls import split_checkpoint, url_key

DEFAULT_MEMORY_DIR = "/dev/shm/ckptturbo"
MEMORY_DIR_ENV = "CKPTTURBO_MEMORY_DIR"
MEMORY_BYTES_ENV = "CKPTTURBO_MEMORY_BYTES"
NODE_ENV = "CKPTTURBO_NODE"
DEFAULT_BUDGET_FRACTION = 0.5  # of the memory file system's size


@dataclass(frozen=True)
class Tiers:
    """The tiers of a save or load besides the durable URL.

    Args:
        memory: the host-memory tier's directory (``$CKPTTURBO_MEMORY_DIR``, else
            ``/dev/shm/ckptturbo``). It should be on a memory file system (tmpfs): that is
            what makes it outlive the training process but not the node. Nothing checks it.
        memory_bytes: the node's budget in that directory for this run; after each commit
            to memory the oldest checkpoints are evicted until the run fits
            (``$CKPTTURBO_MEMORY_BYTES``, else half of the file system's size).
        persist_every: persist every Nth save of the run in this session to the durable URL
            (1: all, 0: only those saved with ``persist=True``).
        node: this node's name (``$CKPTTURBO_NODE``, else the host name). Ranks with the
            same name share one memory store; a restarted node must keep its name to find
            its checkpoints again.
        replicas: after each commit to memory, copy each node's chunks into this many
            other nodes' memory tiers (fewer when the job has fewer other nodes), so that
            losing a node costs no read from the durable store. 0: no copies.
    """

    memory: str | None = None
    memory_bytes: int | None = None
    persist_every: int = 1
    node: str | None = None
    replicas: int = 1

    def __post_init__(self) -> None:
        replicas = self.replicas
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise CkptTurboError(f"Tiers.replicas must be an integer >= 0, got {self.replicas!r}")
        if not isinstance(self.persist_every, int) or self.persist_every < 0:
            raise CkptTurboError("Tiers.persist_every must be an integer >= 0, got "
                                 f"{self.persist_every!r}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise CkptTurboError(f"Tiers.memory_bytes must be positive, got {self.memory_bytes!r}")

    @property
    def memory_dir(self) -> str:
        return os.path.abspath(self.memory or os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR)

    @property
    def node_name(self) -> str:
        return _path_name(self.node or os.environ.get(NODE_ENV) or socket.gethostname())

    def budget(self) -> int:
        """The memory tier's byte budget for one run on this node."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        env = os.environ.get(MEMORY_BYTES_ENV)
        if env:
            try:
                return int(env)
            except ValueError:
                raise CkptTurboError(
                    f"{MEMORY_BYTES_ENV}={env!r} is not a number of bytes") from None
        os.makedirs(self.memory_dir, exist_ok=True)
        fs = os.statvfs(self.memory_dir)
        return int(fs.f_blocks * fs.f_frsize * DEFAULT_BUDGET_FRACTION)

    def persists(self, count: int, forced: bool) -> bool:
        """Whether the ``count``-th save (from 1) of a run goes to the durable URL."""
        return forced or (self.persist_every > 0 and count % self.persist_every == 0)

    def memory_run(self, run_url: str) -> str:
        """This node's memory-tier run for a durable run: ``<memory>/<node>/<run>-<hash>``.
        The hash of the durable URL keeps two runs of the same name apart."""
        key = url_key(run_url)
        name = _path_name(posixpath.basename(key) or "run")
        return posixpath.join(self.memory_dir, self.node_name,
                              f"{name}-{chunk_id(key.encode())[:16]}")

    def memory_url(self, checkpoint_url: str) -> str:
        """Where a durable checkpoint URL's copy lives in this node's memory tier."""
        run, name = split_checkpoint(checkpoint_url)
        return posixpath.join(self.memory_run(run), name)


def _path_name(text: str) -> str:
    """``text`` as one safe path component of the memory directory."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
