"""Tiered checkpoints on several "nodes": recovery of a lost node from its peers' memory vs a
load from the durable store, the stall of memory-tier saves every step, host memory used.

    python -m benchmarks.run tiers [--size-mb 1024] [--ranks 8] [--reps 2]
    python -m benchmarks.tiers_recovery --size-mb 1024 --nodes 4 --ranks-per-node 2

Each "node" is a group of rank processes with a memory tier of its own (a directory named
for the node under one scratch directory; ``CKPTTURBO_NODE`` tells the ranks which). The
durable store is SeaweedFS behind the benchmarks' proxy (20 ms before each answer, 50 MB/s
per connection). The state is sharded: each rank holds ``size / ranks`` of its own.

1. One job saves a checkpoint every step of a loop whose step (a sleep) is 3x the copy
   time, with ``Tiers(replicas=1, persist_every=0)`` and a budget per node of 2.5
   checkpoints (its shards and one other node's replicas each); the last save is persisted
   (``persist=True``). The stall (``ct.save`` until ``staged``) is compared with a bare copy
   of the rank's state; the memory each node's tier holds with (1 + k) x its own shards.
2. A second job (every node restarted) warms up with one load of each kind, then loses
   node 1's memory before each repetition and loads the newest checkpoint with ``tiers=``
   (from memory, node 1's chunks from its peers), alternating with a load of the same
   checkpoint from the durable store alone (``ct.load`` without tiers: the TurboReader).
   Both bit-exact; bytes from the durable store counted. In turn with both, the link
   probe: node 1's bytes copied raw over gloo into its ranks, what its link attains
   (``_link_probe``; the cluster benchmark reports the recovery against it).
3. A third job after every node's memory is lost: the newest durable checkpoint loads,
   bit-exact, and the checkpoints that were only in memory are not in the durable store.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ckptturbo.testing import embedded_s3
from ckptturbo.testing.launcher import run_distributed
from ckptturbo.testing.proxy_process import ProxyProcess

from .measure import barrier_time, gather, now, rank_options
from .report import Report
from .states import MiB, digests, mismatches, zero_

log = logging.getLogger("benchmarks")
STEPS = 4
TENSORS_PER_RANK = 8
PROBE_PIECE = 2 * MiB  # the link probe's message size: the cluster miniature's chunk size at
# its default scale (Profile.chunk_size); a recovery's own chunks may be larger (8 MiB at 512 MiB)


def _node(rank: int, per_node: int) -> str:
    return f"node{rank // per_node}"


def _shard(rank: int, nbytes: int, step: int) -> dict[str, Any]:
    """This rank's own state at ``step`` (distinct on every rank and step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = max(1, nbytes // 4 // TENSORS_PER_RANK)
    return {f"r{rank}.t{i}": torch.randn(n, generator=g) for i in range(TENSORS_PER_RANK)}


def _tiers(memory: str, node_bytes: int | None = None) -> Any:
    """The benchmark's tiers: one replica, persists on demand; a node's budget of
    ``node_bytes`` keeps two checkpoints (own shards and one node's replicas each)."""
    import ckptturbo as ct

    budget = None if node_bytes is None else int(2.5 * 2 * node_bytes)
    return ct.Tiers(memory=memory, memory_bytes=budget, persist_every=0, replicas=1)


def _held_bytes(memory: str, node: str) -> int:
    return sum(f.stat().st_size for f in (Path(memory) / node).rglob("*")
               if f.is_file() and "/chunks/" in str(f))


def _save_job(rank: int, world: int, run: str, opts: dict, memory: str, per_node: int,
              nbytes: int) -> dict[str, Any]:
    """Phase 1: a tiered save every step; stall vs copy; the last save persisted."""
    import ckptturbo as ct

    os.environ["CKPTTURBO_NODE"] = _node(rank, per_node)
    tiers = _tiers(memory, nbytes * per_node)
    copies = []
    state = _shard(rank, nbytes, 1)
    for _ in range(3):
        t0 = now()
        _ = {k: v.clone() for k, v in state.items()}
        copies.append(now() - t0)
    copy = statistics.median(copies)
    stalls, replicated = [], []
    with ct.Session() as s:
        handles = []
        for step in range(1, STEPS + 1):
            state = _shard(rank, nbytes, step)  # after the previous save's `staged`: may change
            barrier_time()
            t0 = now()
            h = s.save(state, f"{run}/step-{step}", storage_options=opts, tiers=tiers,
                       persist=step == STEPS)
            h.staged.result()
            stalls.append(now() - t0)
            handles.append(h)
            time.sleep(3 * copy)  # the training step
        for h in handles:
            h.wait()
            replicated.append(h.replicated.result().bytes_sent)
    barrier_time()
    held = None
    if rank % per_node == 0:
        retained = len(ct.list_checkpoints(tiers.memory_run(run)))
        held = (_held_bytes(memory, _node(rank, per_node)), retained)
    return {"copy": copy, "stalls": stalls, "held": gather(held), "replicated": replicated}


def _link_probe(rank: int, world: int, per_node: int, nbytes: int, buffer: torch.Tensor) -> None:
    """The recovery's link probe: node 1's bytes (``nbytes`` for each of its ranks) sent raw
    over the job's gloo group into node 1's ranks, from the ranks of the node after it
    (node 0 when there are two), as a recovery's copies come from a node that holds node 1's
    replicas: in ``PROBE_PIECE`` messages, every one posted at once, no checkpoint logic,
    hashing or writes. ``buffer``: this rank's ``nbytes``, made and
    touched before the timed window."""
    import torch.distributed as dist

    holder = 2 if world // per_node > 2 else 0
    lost, holders = range(per_node, 2 * per_node), range(holder * per_node, (holder + 1) * per_node)
    if rank in holders:
        peer, post = lost[rank - holders[0]], dist.isend
    elif rank in lost:
        peer, post = holders[rank - lost[0]], dist.irecv
    else:
        return
    work = [post(buffer[at:at + PROBE_PIECE], peer, tag=i)
            for i, at in enumerate(range(0, nbytes, PROBE_PIECE))]
    for w in work:
        w.wait()


def _recover_job(rank: int, world: int, run: str, opts: dict, memory: str, per_node: int,
                 nbytes: int, reps: int) -> dict[str, Any]:
    """Phase 2: node 1's memory lost before each repetition; tiered load vs durable load,
    and the link probe (``_link_probe``) in turn with them."""
    import ckptturbo as ct

    node = _node(rank, per_node)
    os.environ["CKPTTURBO_NODE"] = node
    tiers = _tiers(memory)
    expected = digests(_shard(rank, nbytes, STEPS))
    out = _shard(rank, nbytes, STEPS)
    raw = torch.ones(nbytes, dtype=torch.uint8)
    samples: dict[str, list[dict[str, Any]]] = {"tiers": [], "durable": [], "probe": []}
    sides = ("tiers", "durable", "probe")
    correct = True
    with ct.Session() as s:
        for rep in range(-1, reps):  # rep -1 warms every side up (groups, clients), unmeasured
            for side in sides[rep % 3:] + sides[:rep % 3]:
                barrier_time()
                if side == "probe":
                    t0 = barrier_time()
                    _link_probe(rank, world, per_node, nbytes, raw)
                    t1 = barrier_time()
                    if rep >= 0:
                        samples[side].append({"seconds": t1 - t0, "window": [t0, t1],
                                              "bytes": nbytes * per_node})
                    continue
                if side == "tiers" and rep >= 0 and node == "node1" and rank % per_node == 0:
                    shutil.rmtree(Path(memory) / node, ignore_errors=True)  # the node is lost
                zero_(out)
                t0 = barrier_time()
                if side == "tiers":
                    got = s.load(out, run, storage_options=opts, tiers=tiers, strict=False)
                    from_durable, from_peers = got.bytes_from_durable, got.bytes_from_peers
                    url = got.url
                else:
                    s.load(out, f"{run}/step-{STEPS}", storage_options=opts, strict=False)
                    from_durable, from_peers, url = -1, 0, f"{run}/step-{STEPS}"
                t1 = barrier_time()
                correct &= not mismatches(out, expected) and url.endswith(f"step-{STEPS}")
                stats = gather((from_durable, from_peers))
                if rep < 0:
                    continue
                samples[side].append({"seconds": t1 - t0, "window": [t0, t1],
                                      "bytes_from_durable": sum(d for d, _ in stats),
                                      "bytes_from_peers": sum(p for _, p in stats)})
                if rank == 0:
                    log.info("  %-8s rep %d: %.2f s %s", side, rep, t1 - t0, samples[side][-1])
    return {"samples": samples, "correct": all(gather(correct))}


def _whole_job_lost(rank: int, world: int, run: str, opts: dict, memory: str, per_node: int,
                    nbytes: int) -> dict[str, Any]:
    """Phase 3: every node's memory lost: the newest durable checkpoint, bit-exact."""
    import ckptturbo as ct

    os.environ["CKPTTURBO_NODE"] = _node(rank, per_node)
    out = _shard(rank, nbytes, STEPS)
    zero_(out)
    with ct.Session() as s:
        got = s.load(out, run, storage_options=opts, tiers=_tiers(memory), strict=False)
        durable = [c.name for c in s.list_checkpoints(run, storage_options=opts)]
    exact = not mismatches(out, digests(_shard(rank, nbytes, STEPS)))
    return {"correct": all(gather(exact and got.url.endswith(f"step-{STEPS}"))), "durable": durable}


def measure(size_mb: int, nodes: int, per_node: int, reps: int, workdir: str | None,
            latency_ms: float = 20, conn_mbps: float = 50) -> dict[str, Any]:
    world = nodes * per_node
    nbytes = size_mb * MiB // world
    scratch = tempfile.mkdtemp(prefix="ckptturbo-bench-tiers-", dir=workdir)
    server = embedded_s3.start(os.path.join(scratch, "s3"))
    # the memory tiers on a memory file system where there is one, as in production
    memory = tempfile.mkdtemp(prefix="ckptturbo-bench-tiers-",
                              dir="/dev/shm" if os.path.isdir("/dev/shm") else scratch)
    try:
        with ProxyProcess(server.endpoint, latency_s=latency_ms / 1000,
                          conn_rate=conn_mbps * 1e6) as proxy:
            opts = proxy.storage_options(server.storage_options)
            run = server.url("tiers-bench")
            options = rank_options(world)
            log.info("phase 1: %d tiered saves, %d nodes x %d ranks, %d MiB", STEPS, nodes,
                     per_node, size_mb)
            saved = run_distributed(_save_job, world, run, opts, memory, per_node, nbytes,
                                    **options)
            log.info("phase 2: node 1 lost, %d repetitions", reps)
            recovered = run_distributed(_recover_job, world, run, opts, memory, per_node, nbytes,
                                        reps, **options)[0]
            shutil.rmtree(memory)
            log.info("phase 3: every node lost")
            lost = run_distributed(_whole_job_lost, world, run, opts, memory, per_node, nbytes,
                                   **options)[0]
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return {"saved": saved, "recovered": recovered, "lost": lost, "world": world,
            "nbytes_per_rank": nbytes, "nodes": nodes, "per_node": per_node}


def report(result: dict[str, Any], params: dict[str, Any]) -> Report:
    rep = Report("tiers", params)
    rep.raw = result
    samples = result["recovered"]["samples"]
    tiers_s = statistics.median(s["seconds"] for s in samples["tiers"])
    durable_s = statistics.median(s["seconds"] for s in samples["durable"])
    rep.compare("recovery after losing 1 node (s)", tiers_s, durable_s, "s",
                peer_name="load from durable store", target=0.2)
    rep.check("0 bytes from the durable store while a replica survives",
              all(s["bytes_from_durable"] == 0 for s in samples["tiers"]),
              str([s["bytes_from_durable"] for s in samples["tiers"]]))
    rep.check("the lost node's chunks came from its peers",
              all(s["bytes_from_peers"] > 0 for s in samples["tiers"]))
    saved = result["saved"]
    # every rank's stall vs its own copy, the first save (pool set-up) left out
    ratios = [statistics.median(r["stalls"][1:]) / r["copy"] for r in saved]
    copy = statistics.median(r["copy"] for r in saved)
    stall = copy * statistics.median(ratios)
    rep.compare("stall of a memory-tier save every step (s)", stall, copy, "s",
                peer_name="bare copy of the state", target=1.2)
    own = result["nbytes_per_rank"] * result["per_node"]  # a node's shards of one checkpoint
    held, retained = max((h for h in saved[0]["held"] if h is not None), key=lambda h: h[0] / h[1])
    rep.compare("host memory of the fullest node (bytes)", held, 2 * own * retained, "bytes",
                peer_name=f"(1 + k) x own shards x {retained}", target=1.0)
    rep.check("recovered and durable loads bit-exact", result["recovered"]["correct"])
    rep.check("whole-job loss: the newest durable checkpoint, bit-exact", result["lost"]["correct"])
    durable = result["lost"]["durable"]
    rep.check("only the persisted checkpoint is durable", durable == [f"step-{STEPS}"],
              str(durable))
    return rep


def scenario(args: Any) -> Report:
    """``python -m benchmarks.run tiers``: ``--ranks`` ranks as nodes of 2 ranks."""
    per_node = 2
    nodes = max(2, args.ranks // per_node)
    params = {"size_mb": args.size_mb, "nodes": nodes, "ranks_per_node": per_node,
              "reps": args.reps, "proxy": "20 ms, 50 MB/s per connection"}
    return report(measure(args.size_mb, nodes, per_node, args.reps, args.workdir), params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    params = {"size_mb": args.size_mb, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
              "reps": args.reps, "proxy": "20 ms, 50 MB/s per connection"}
    measured = measure(args.size_mb, args.nodes, args.ranks_per_node, args.reps, args.workdir)
    rep = report(measured, params)
    rep.finish(args.out)
    return 0 if rep.checks_passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
