"""Multi-rank scenarios (real gloo processes): ddp-4r-local, ddp-4r-s3, one-big-replicated,
grouped-load. Rank functions are module-level so that spawned processes can import them."""
from __future__ import annotations

import logging
from typing import Any

import torch.distributed.checkpoint as dcp

from ckptturbo.testing.launcher import run_distributed

from .measure import barrier_time, gather, now, rank_options
from .report import Report
from .states import MiB, digests, mismatches, one_big_state, tensor_nbytes, transformer_state, zero_
from .storage import (
    Backend,
    distcp_bytes_per_rank,
    environment,
    reset_fsspec_caches,
    storage_ceiling,
)

log = logging.getLogger("benchmarks")
SIDES = ("ckptturbo", "DCP")


def _state(kind: str, size: int) -> dict[str, Any]:
    return one_big_state(size) if kind == "one-big" else transformer_state(size)


# --------------------------------------------------------------------------- replicated saves
def _save_rank(rank: int, world: int, be: Backend, state_kind: str, size: int,
               reps: int) -> dict[str, Any]:
    """Every rank holds the same (replicated, DDP-style) state; each side saves it ``reps``
    times, alternating; rank 0 reports times and per-rank bytes."""
    sd = _state(state_kind, size)
    expected = digests(sd)
    out: dict[str, Any] = {side: [] for side in SIDES}
    kept: dict[str, str] = {}
    for rep in range(reps):
        for side in (SIDES if rep % 2 == 0 else tuple(reversed(SIDES))):
            if rank == 0 and side in kept:
                be.remove(kept.pop(side))
            run = be.url(f"{side}-{rep}")
            writer = be.ct_writer(run + "/ckpt") if side == "ckptturbo" else be.dcp_writer(run)
            t0 = barrier_time()
            dcp.save(sd, storage_writer=writer)
            mine = now() - t0
            t1 = barrier_time()
            stats = gather({"seconds": mine, **(writer.last_stats if side == "ckptturbo" else {})})
            kept[side] = run
            if rank != 0:
                continue
            files = be.files(run)
            if side == "ckptturbo":
                per_rank = [s["bytes_written"] for s in stats]
            else:
                per_rank = distcp_bytes_per_rank(files, world)
            sample = {"seconds": t1 - t0, "per_rank_bytes": per_rank,
                      "stored_bytes": sum(files.values()),
                      "rank_seconds": [s["seconds"] for s in stats]}
            if side == "ckptturbo":
                sample["rank_stats"] = stats
            out[side].append(sample)
            log.info("  %-10s rep %d: %.3f s, per-rank MiB %s", side, rep, t1 - t0,
                     [round(b / MiB, 1) for b in per_rank])
    # what was saved loads back exactly, on every rank (ckptturbo; and DCP for reference)
    checks = {}
    for side in SIDES:
        zero_(sd)
        if side == "ckptturbo":
            reader = be.ct_reader(kept[side] + "/ckpt")
        else:
            reader = be.dcp_reader(kept[side])
        dcp.load(sd, storage_reader=reader)
        checks[side] = all(gather(not mismatches(sd, expected)))
    out["checks"] = checks
    out["unique_bytes"] = tensor_nbytes(sd)
    barrier_time()
    if rank == 0:
        for run in kept.values():
            be.remove(run)
    return out


def _replicated(args: Any, kind: str, name: str, state_kind: str) -> Report:
    size = args.size_mb * MiB
    report = Report(name, {"size_mb": args.size_mb, "ranks": args.ranks, "reps": args.reps})
    with environment(kind, args.workdir, args.conn_mbps) as env:
        be = env.backend
        res = run_distributed(_save_rank, args.ranks, be, state_kind, size, args.reps,
                              **rank_options(args.ranks))[0]
        ceiling = storage_ceiling(be, min(256 * MiB, max(32 * MiB, size))) if kind == "s3" else None
    report.raw.update(res)
    unique = res["unique_bytes"]
    best = {side: min(res[side], key=lambda s: s["seconds"]) for side in SIDES}
    ct_, dc = best["ckptturbo"], best["DCP"]
    peer = be.peer_name

    def spread(per: list[int]) -> tuple[int, float]:
        return max(per), sum(per) / len(per)

    ct_max, ct_mean = spread(ct_["per_rank_bytes"])
    dc_max, dc_mean = spread(dc["per_rank_bytes"])
    if state_kind == "one-big":
        report.compare("max bytes written by one rank", ct_max, dc_max, "bytes", peer_name=peer,
                       target=0.3)
        if size * 3 // 4 < args.ranks * (64 * MiB):
            report.note("the big tensor is smaller than one 64 MiB chunk per rank: ckptturbo "
                        "cannot split it that finely (use the default --size-mb 1024)")
        report.compare("time to durable", ct_["seconds"], dc["seconds"], "s", peer_name=peer)
    else:
        report.compare("total bytes written", sum(ct_["per_rank_bytes"]), unique, "bytes",
                       peer_name="unique bytes", target=1.02)
        report.compare("max/mean bytes per rank", ct_max / ct_mean, 1.0, "x",
                       peer_name="perfect balance", target=1.10)
        report.compare("max bytes written by one rank", ct_max, dc_max, "bytes", peer_name=peer)
        report.compare("time to durable", ct_["seconds"], dc["seconds"], "s", peer_name=peer,
                       target=1.0 if kind == "local" else 0.5)
    if ceiling is not None:
        report.raw["storage_ceiling"] = ceiling
        put_s = unique / ceiling["put_bytes_per_s"]
        report.compare("time to durable vs raw parallel PUT of same bytes", ct_["seconds"], put_s,
                       "s", peer_name="s3fs 8x16MiB PUT")
        report.note("storage ceiling measured in this run: "
                    f"PUT {ceiling['put_bytes_per_s'] / MiB:.0f} MiB/s; "
                    f"DCP took {dc['seconds'] / put_s:.2f}x the raw PUT time")
    report.note(f"DCP: total {sum(dc['per_rank_bytes']) / unique:.3f}x unique, max/mean "
                f"{dc_max / dc_mean:.2f}; "
                f"ckptturbo stored {ct_['stored_bytes'] / unique:.3f}x unique "
                "(chunks + manifest)")
    report.check("ckptturbo load equals saved state (every rank)", res["checks"]["ckptturbo"])
    report.check("DCP load equals saved state (every rank)", res["checks"]["DCP"])
    return report


def ddp_local(args: Any) -> Report:
    return _replicated(args, "local", "ddp-4r-local", "transformer")


def ddp_s3(args: Any) -> Report:
    return _replicated(args, "s3", "ddp-4r-s3", "transformer")


def one_big_replicated(args: Any) -> Report:
    return _replicated(args, "local", "one-big-replicated", "one-big")


# --------------------------------------------------------------------------- grouped load
def _load_rank(rank: int, world: int, backends: dict[str, Backend], size: int, reps: int,
               urls: dict[str, dict[str, str]] | None, sides: tuple[str, ...],
               verify: str = "storage") -> dict[str, Any]:
    """Every rank loads the whole state. Without ``urls`` the group first saves it (both
    sides, every backend, untimed). ``verify``: the TurboReader's setting."""
    sd = transformer_state(size)
    expected = digests(sd)
    if urls is None:
        urls = {}
        for where, be in backends.items():
            urls[where] = {"ckptturbo": be.url("ct") + "/ckpt", "DCP": be.url("dcp")}
            dcp.save(sd, storage_writer=be.ct_writer(urls[where]["ckptturbo"]))
            dcp.save(sd, storage_writer=be.dcp_writer(urls[where]["DCP"]))
    out: dict[str, Any] = {"urls": urls, "unique_bytes": tensor_nbytes(sd)}
    ok = True
    for where, be in backends.items():
        out[where] = {side: [] for side in sides}
        for rep in range(reps):
            for side in (sides if rep % 2 == 0 else tuple(reversed(sides))):
                zero_(sd)
                reset_fsspec_caches()
                url = urls[where][side]
                if side == "ckptturbo":
                    reader = be.ct_reader(url, verify=verify)
                else:
                    reader = be.dcp_reader(url)
                barrier_time()
                served = be.served() if rank == 0 else None
                t0 = barrier_time()
                dcp.load(sd, storage_reader=reader)
                mine = now() - t0
                t1 = barrier_time()
                correct = not mismatches(sd, expected)
                ok &= correct
                stats = gather({"seconds": mine, "correct": correct,
                                "bytes_from_storage": getattr(reader, "bytes_from_storage", None)})
                if rank == 0:
                    sample = {"seconds": t1 - t0, "rank_seconds": [s["seconds"] for s in stats],
                              "correct": all(s["correct"] for s in stats)}
                    if served is not None:
                        sample["bytes_served"] = be.served() - served
                    if side == "ckptturbo":
                        sample["bytes_from_storage"] = sum(s["bytes_from_storage"] for s in stats)
                    out[where][side].append(sample)
                    log.info("  %d ranks %-5s %-10s rep %d: %.3f s %s", world, where, side, rep,
                             t1 - t0, {k: round(v / MiB, 1) for k, v in sample.items()
                                       if k.startswith("bytes")})
    out["correct"] = all(gather(ok))
    return out


def grouped_load(args: Any) -> Report:
    """N ranks each load the full replicated state: storage bytes and time, vs DCP."""
    size = args.size_mb * MiB
    world = args.ranks
    small = max(2, world // 2)
    verify = args.verify
    report = Report("grouped-load", {"size_mb": args.size_mb, "ranks": world, "reps": args.reps,
                                     "verify": verify})
    with (environment("s3", args.workdir, args.conn_mbps) as s3,
          environment("local", args.workdir) as local):
        backends = {"s3": s3.backend, "local": local.backend}
        big = run_distributed(_load_rank, world, backends, size, args.reps, None, SIDES, verify,
                              **rank_options(world))[0]
        few = run_distributed(_load_rank, small, backends, size, args.reps, big["urls"],
                              ("ckptturbo",), verify, **rank_options(small))[0]
        ceiling = storage_ceiling(s3.backend, min(256 * MiB, max(32 * MiB, size)))
    report.raw["storage_ceiling"] = ceiling
    report.raw.update({f"{world}_ranks": big, f"{small}_ranks": few})
    unique = big["unique_bytes"]

    def best(res: dict, where: str, side: str) -> dict:
        return min(res[where][side], key=lambda s: s["seconds"])

    ct_s3, dc_s3 = best(big, "s3", "ckptturbo"), best(big, "s3", "DCP")
    report.compare(f"bytes served by storage, {world} ranks", ct_s3["bytes_served"], unique,
                   "bytes",
                   peer_name="unique bytes", target=1.0 + 0.01,
                   note="loopback proxy count (HTTP headers included)")
    report.compare(f"sum of reader.bytes_from_storage, {world} ranks", ct_s3["bytes_from_storage"],
                   unique, "bytes", peer_name="unique bytes", target=1.0 + 0.001)
    report.compare(f"bytes served by storage, {world} ranks", ct_s3["bytes_served"],
                   dc_s3["bytes_served"], "bytes", peer_name="DCP Fsspec (s3fs)")
    report.compare(f"load time S3, {world} ranks", ct_s3["seconds"], dc_s3["seconds"], "s",
                   peer_name="DCP Fsspec (s3fs)", target=0.5)
    report.compare(f"load time S3, {world} ranks, vs one raw GET of the bytes", ct_s3["seconds"],
                   unique / ceiling["get_bytes_per_s"], "s", peer_name="s3fs 8x16MiB GET")
    ct_l, dc_l = best(big, "local", "ckptturbo"), best(big, "local", "DCP")
    report.compare(f"load time local (warm), {world} ranks", ct_l["seconds"], dc_l["seconds"], "s",
                   peer_name="DCP FileSystem", target=1.0)
    report.compare(f"load time S3, {world} vs {small} ranks", ct_s3["seconds"],
                   best(few, "s3", "ckptturbo")["seconds"], "s",
                   peer_name=f"ckptturbo {small} ranks", target=1.25)
    report.compare(f"load time local, {world} vs {small} ranks", ct_l["seconds"],
                   best(few, "local", "ckptturbo")["seconds"], "s",
                   peer_name=f"ckptturbo {small} ranks")
    report.note(f"DCP served {dc_s3['bytes_served'] / unique:.2f}x the unique bytes on S3")
    report.check("every rank's load equals the saved state", big["correct"] and few["correct"])
    return report
