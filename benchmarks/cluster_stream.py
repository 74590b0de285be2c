"""Streaming a safetensors model onto every rank of the cluster: ``ct.stream_safetensors``
with the job's process group (each byte read from the store once, forwarded down chains
over the node links) against Run:ai Model Streamer's distributed mode on the same ranks.

Run:ai distributes a load among the processes of one host by default: the ranks of a node
split its files' chunks, each reads its share from the store and broadcasts it to the
node's other ranks (``RUNAI_STREAMER_DIST=1``, needed with gloo; each node namespace has
its own host name, as real nodes do), so every node reads the whole model.
``RUNAI_STREAMER_DIST_GLOBAL=1`` makes one group of all ranks instead, each rank's share
broadcast to all the others: both are measured, the faster is the peer. Every rank must
end up with every tensor; the unmeasured first round checks that it does.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from . import stream_s3
from .cluster_jobs import CT, timed
from .measure import gather

log = logging.getLogger("benchmarks")
RUNAI_NODE = "Run:ai per node"  # its default grouping: the processes of one host
RUNAI_GLOBAL = "Run:ai global"  # RUNAI_STREAMER_DIST_GLOBAL=1
SIDES = (CT, RUNAI_NODE, RUNAI_GLOBAL)


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def _expected(files: list[str]) -> dict[str, str]:
    """Every tensor's digest, read from the local copies the model was uploaded from."""
    from safetensors.torch import load_file

    return {name: _digest(t) for path in files for name, t in load_file(path).items()}


def _consume(side: str, spec: dict[str, Any], peer: Any, check: bool) -> tuple[int, dict]:
    """One load of the whole model on this rank, one way: the bytes it got and, with
    ``check``, every tensor's digest."""
    got: dict[str, str] = {}
    nbytes = 0

    def take(name: str, t: torch.Tensor) -> None:
        nonlocal nbytes
        nbytes += t.nbytes
        if check:
            got[name] = _digest(t)

    if side == CT:
        from ckptturbo.stream import stream_safetensors

        for name, t in stream_safetensors(spec["url"], storage_options=spec["storage_options"],
                                          streams=spec["streams"],
                                          memory_limit=spec["memory_limit"],
                                          process_group=dist.group.WORLD):
            take(name, t)
    else:
        os.environ["RUNAI_STREAMER_DIST"] = "1"  # gloo needs it asked for
        os.environ["RUNAI_STREAMER_DIST_GLOBAL"] = "1" if side == RUNAI_GLOBAL else "0"
        streamer_cls, credentials = peer
        options = spec["storage_options"]
        creds = credentials(access_key_id=options["key"], secret_access_key=options["secret"],
                            region_name="us-east-1", endpoint=spec["endpoint"])
        with streamer_cls() as streamer:
            streamer.stream_files(spec["urls"], s3_credentials=creds, device="cpu",
                                  is_distributed=True)
            for name, t in streamer.get_tensors():
                take(name, t)
    return nbytes, got


def stream_rank(rank: int, world: int, spec: dict[str, Any], reps: int,
                counters: dict[str, str]) -> dict[str, Any]:
    """Every side loads the whole model on every rank: one unmeasured round in which every
    rank checks every tensor (``wrong``: per side, how many tensors some rank got wrong or
    missed, over all ranks), then ``reps`` alternating rounds between barriers."""
    peer = stream_s3.prepare("Run:ai", spec)
    sides = SIDES if not isinstance(peer, dict) else (CT,)
    expected = _expected(spec["local_files"])
    samples, wrong = [], {}
    for rep in range(-1, reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            got: list[tuple[int, dict]] = []
            sample = timed(rank, counters, "store_out",
                            lambda s=side, r=rep, g=got: g.append(_consume(s, spec, peer, r < 0)))
            nbytes, digests = got[0]
            if rep < 0:
                bad = sorted(k for k in expected.keys() | digests.keys()
                             if digests.get(k) != expected.get(k))
                wrong[side] = sum(len(b) for b in gather(bad))
            sample["bytes"] = sum(gather(nbytes))
            if rep >= 0 and rank == 0:
                samples.append({"side": side, **sample})
                log.info("  %-16s rep %d: %.2f s", side, rep, sample["seconds"])
    return {"samples": samples, "wrong": wrong,
            "unavailable": peer.get("unavailable") if isinstance(peer, dict) else None}
