"""The rank and worker jobs of the cluster benchmark (module-level, so that the launcher's
processes can import them). Each timed call is framed by barriers; a sample keeps its
``window`` (perf_counter at both barriers) so that the benchmark can tell how busy the
cores were meanwhile, and the bytes the store's link carried meanwhile."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed.checkpoint as dcp

from . import s3_peers
from .cluster_topology import read_counters
from .measure import barrier_time, gather
from .states import digests, mismatches, tensor_nbytes, transformer_state, zero_
from .storage import fsspec_reader, fsspec_writer

log = logging.getLogger("benchmarks")
CT, DCP_FSSPEC, S3TORCH = "ckptturbo", "DCP fsspec", "s3torchconnector"


def _writer(side: str, url: str, options: dict[str, Any], chunk_size: int) -> Any:
    if side == DCP_FSSPEC:
        return fsspec_writer(url, options)
    return s3_peers.writer(side, url, options, chunk_size)


def _reader(side: str, url: str, options: dict[str, Any]) -> Any:
    if side == DCP_FSSPEC:
        return fsspec_reader(url, options)
    return s3_peers.reader(side, url, options)


def _url(root: str, side: str, rep: int) -> str:
    url = f"{root}/{side.replace(' ', '-')}-{rep + 1}"
    return url + "/ckpt" if side == CT else url


def timed(rank: int, counters: dict[str, str], key: str, fn: Any) -> dict[str, Any]:
    """``fn()`` on every rank between barriers; rank 0 also counts what every link carried
    over the same window (``links``), the store link's ``key`` (what the store sent or
    took in) as ``link_bytes``."""
    before = read_counters(counters) if rank == 0 else {}
    t0 = barrier_time()
    fn()
    t1 = barrier_time()
    after = read_counters(counters) if rank == 0 else {}
    links = {name: after[name] - before[name] for name in after}
    return {"seconds": t1 - t0, "window": [t0, t1], "link_bytes": links.get(key, 0),
            "links": links}


def _load(rank: int, side: str, url: str, reader: Any, sd: dict[str, Any],
          expected: dict[str, str], counters: dict[str, str]) -> tuple[dict[str, Any], bool]:
    """One whole-state load of ``url`` into zeroed ``sd`` through ``reader`` (reset to it):
    the sample, and whether it is exact."""
    zero_(sd)
    sample = timed(rank, counters, "store_out",
                   lambda: dcp.load(sd, storage_reader=reader, checkpoint_id=url))
    exact = not mismatches(sd, expected)
    read = gather(getattr(reader, "bytes_from_storage", None))
    if side == CT:
        sample["bytes_from_storage"] = sum(read)
        sample["read_per_rank"] = read
    return sample, exact


def ddp_rank(rank: int, world: int, opts: dict[str, Any], root: str, size: int, reps: int,
             counters: dict[str, str], sides: tuple[str, ...], chunk_size: int) -> dict[str, Any]:
    """Every rank holds the same state (DDP): each side saves it, then every rank loads the
    whole of it back; one unmeasured round first, then ``reps`` alternating rounds.
    Each side keeps one writer and one reader, reset to each checkpoint, so that its
    clients are made in the unmeasured round, as a job's are by its later checkpoints
    (a process's first save is ``first_save``'s measure). ``chunk_size``: ckptturbo's,
    scaled with the miniature (``Profile.chunk_size``)."""
    s3_peers.peer_environment(opts["client_kwargs"]["endpoint_url"], opts)
    sd = transformer_state(size)
    expected = digests(sd)
    samples: list[dict[str, Any]] = []
    exact = True
    kept = ""
    first = {side: _url(root, side, -1) for side in sides}
    writers = {side: _writer(side, first[side], opts, chunk_size) for side in sides}
    readers = {side: _reader(side, first[side], opts) for side in sides}
    for rep in range(-1, reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            url = _url(root, side, rep)
            saved = timed(rank, counters, "store_in",
                          lambda w=writers[side], u=url: dcp.save(sd, storage_writer=w,
                                                                  checkpoint_id=u))
            loaded, ok = _load(rank, side, url, readers[side], sd, expected, counters)
            exact &= ok
            kept = url if side == CT else kept  # the newest: what the growth part loads
            if rep >= 0 and rank == 0:
                samples.append({"side": side, "rep": rep, "save": saved, "load": loaded})
                log.info("  %-16s rep %d: save %.2f s, load %.2f s", side, rep, saved["seconds"],
                         loaded["seconds"])
    return {"samples": samples, "exact": all(gather(exact)), "unique": tensor_nbytes(sd),
            "ct_url": kept}


def grouped_rank(rank: int, world: int, opts: dict[str, Any], url: str, size: int, reps: int,
                 counters: dict[str, str], save_first: bool, chunk_size: int) -> dict[str, Any]:
    """Every rank loads the whole of ckptturbo's checkpoint ``url`` (saved here first, in
    chunks of ``chunk_size``, when asked); one unmeasured load, then ``reps``."""
    import ckptturbo as ct

    sd = transformer_state(size)
    expected = digests(sd)
    if save_first:
        dcp.save(sd, storage_writer=ct.TurboWriter(url, opts, chunk_size=chunk_size))
    samples, exact = [], True
    reader = _reader(CT, url, opts)  # kept: its clients are made by the unmeasured load
    for rep in range(-1, reps):
        sample, ok = _load(rank, CT, url, reader, sd, expected, counters)
        exact &= ok
        if rep >= 0 and rank == 0:
            samples.append(sample)
            log.info("  %d ranks rep %d: load %.2f s", world, rep, sample["seconds"])
    return {"samples": samples, "exact": all(gather(exact)), "unique": tensor_nbytes(sd)}


def stream_worker_python(scratch: str, netns_name: str, python: str) -> str:
    """An interpreter that runs on a node: a wrapper script that enters the node's
    namespace (``ip netns exec``) before starting ``python``, for stream_s3's workers."""
    path = os.path.join(scratch, f"python-on-{netns_name}")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec ip netns exec {netns_name} {python} "$@"\n')
    os.chmod(path, 0o755)
    return path
