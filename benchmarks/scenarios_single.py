"""One-process scenarios: local-1p, s3-1p, incremental, async-stall."""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptturbo.testing.launcher import run_isolated

from .measure import RssSampler, alternate, now, rank_setup
from .report import Report
from .states import MiB, digests, mismatches, tensor_nbytes, transformer_state, zero_, zeros_like
from .storage import environment, reset_fsspec_caches, storage_ceiling

log = logging.getLogger("benchmarks")


# --------------------------------------------------------------------------- local-1p, s3-1p
def one_process(args: Any, kind: str) -> Report:
    """Save and load one state in one process: ckptturbo vs DCP on the same storage."""
    name = f"{kind}-1p"
    size = args.size_mb * MiB
    report = Report(name, {"size_mb": args.size_mb, "reps": args.reps})
    with environment(kind, args.workdir, args.conn_mbps) as env:
        be = env.backend
        sd = transformer_state(size)
        expected = digests(sd)
        unique = tensor_nbytes(sd)
        report.raw["state"] = {"tensors": len(sd), "bytes": unique}
        log.info("%s: %d tensors, %.0f MiB", name, len(sd), unique / MiB)
        kept: dict[str, str] = {}

        def ct_save(rep: int) -> dict[str, Any]:
            be.remove(kept.pop("ckptturbo", "") or be.url("none"))
            run = be.url(f"ct-{rep}")
            writer = be.ct_writer(run + "/ckpt")
            t = now()
            dcp.save(sd, storage_writer=writer)
            seconds = now() - t
            kept["ckptturbo"] = run
            return {"seconds": seconds, **{k: v for k, v in writer.last_stats.items()}}

        def dcp_save(rep: int) -> dict[str, Any]:
            be.remove(kept.pop("DCP", "") or be.url("none"))
            url = be.url(f"dcp-{rep}")
            t = now()
            dcp.save(sd, storage_writer=be.dcp_writer(url))
            seconds = now() - t
            kept["DCP"] = url
            return {"seconds": seconds, "bytes_written": sum(be.files(url).values())}

        saves = alternate(args.reps, {"ckptturbo": ct_save, "DCP": dcp_save})
        dest = zeros_like(sd)

        def loader(side: str, cold: bool):
            def load(rep: int) -> dict[str, Any]:
                zero_(dest)
                reset_fsspec_caches()
                url = kept[side]
                if cold:
                    be.make_cold(url)
                if side == "ckptturbo":
                    reader = be.ct_reader(url + "/ckpt")
                else:
                    reader = be.dcp_reader(url)
                served = be.served()
                t = now()
                dcp.load(dest, storage_reader=reader)
                seconds = now() - t
                out = {"seconds": seconds}
                if served is not None:
                    out["bytes_served"] = be.served() - served
                if side == "ckptturbo":
                    out["bytes_from_storage"] = reader.bytes_from_storage
                bad = mismatches(dest, expected)
                out["correct"] = not bad
                if bad:
                    log.error("%s load of %s differs in %s", side, url, bad[:5])
                return out
            return load

        loads = alternate(args.reps, {"ckptturbo": loader("ckptturbo", False),
                                      "DCP": loader("DCP", False)})
        report.raw.update(saves=saves, loads=loads)
        peer = be.peer_name
        fast = {"local": 1.0, "s3": 0.5}[kind]
        report.compare("save time", saves["ckptturbo"]["best"]["seconds"],
                       saves["DCP"]["best"]["seconds"], "s", peer_name=peer, target=fast)
        report.compare("load time" + (" (page cache warm)" if kind == "local" else ""),
                       loads["ckptturbo"]["best"]["seconds"], loads["DCP"]["best"]["seconds"], "s",
                       peer_name=peer, target=fast)
        if kind == "local":
            cold = alternate(args.reps, {"ckptturbo": loader("ckptturbo", True),
                                         "DCP": loader("DCP", True)})
            report.raw["loads_cold"] = cold
            report.compare("load time (page cache evicted)", cold["ckptturbo"]["best"]["seconds"],
                           cold["DCP"]["best"]["seconds"], "s", peer_name=peer, target=1.0)
            report.note("warm loads copy from the page cache (memory-bound); cold loads evict the "
                        "checkpoint files with posix_fadvise(DONTNEED) first (the VM's host may "
                        "still cache them)")
            all_loads = [loads, cold]
        else:
            ceiling = storage_ceiling(be, min(256 * MiB, max(32 * MiB, size)))
            report.raw["storage_ceiling"] = ceiling
            put_s, get_s = unique / ceiling["put_bytes_per_s"], unique / ceiling["get_bytes_per_s"]
            report.compare("save time vs raw parallel PUT of same bytes",
                           saves["ckptturbo"]["best"]["seconds"], put_s, "s",
                           peer_name="s3fs 8x16MiB PUT")
            report.compare("load time vs raw parallel GET of same bytes",
                           loads["ckptturbo"]["best"]["seconds"], get_s, "s",
                           peer_name="s3fs 8x16MiB GET")
            report.note("storage ceiling measured in this run: "
                        f"PUT {ceiling['put_bytes_per_s'] / MiB:.0f} MiB/s, "
                        f"GET {ceiling['get_bytes_per_s'] / MiB:.0f} MiB/s; DCP save "
                        f"{saves['DCP']['best']['seconds'] / put_s:.2f}x and load "
                        f"{loads['DCP']['best']['seconds'] / get_s:.2f}x the raw time")
            report.compare("bytes served by storage per load",
                           loads["ckptturbo"]["best"]["bytes_served"],
                           loads["DCP"]["best"]["bytes_served"], "bytes", peer_name=peer,
                           note="counted by a loopback proxy in front of SeaweedFS")
            all_loads = [loads]
        report.compare("bytes written per save", saves["ckptturbo"]["best"]["bytes_written"],
                       saves["DCP"]["best"]["bytes_written"], "bytes", peer_name=peer)
        report.check("ckptturbo load equals saved state",
                     all(s["correct"] for ls in all_loads for s in ls["ckptturbo"]["samples"]))
        report.check("DCP load equals saved state",
                     all(s["correct"] for ls in all_loads for s in ls["DCP"]["samples"]))
    return report


def local_1p(args: Any) -> Report:
    return one_process(args, "local")


def s3_1p(args: Any) -> Report:
    return one_process(args, "s3")


# --------------------------------------------------------------------------- incremental
def _changed_keys(sd: dict[str, Any]) -> list[str]:
    """1/8 of the tensors: those of the last eighth of the layers (fine-tuning the top)."""
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("layers.")})
    top = set(layers[len(layers) - max(1, len(layers) // 8):])
    return [k for k in sd if k.startswith("layers.") and int(k.split(".")[1]) in top]


def incremental(args: Any) -> Report:
    """Save, change 1/8 of the tensors, save again into the same run (chunk dedup)."""
    size = args.size_mb * MiB
    kinds = args.storage or ["local", "s3"]
    report = Report("incremental", {"size_mb": args.size_mb, "reps": args.reps, "storage": kinds})
    sd = transformer_state(size)
    changed = _changed_keys(sd)
    changed_bytes = sum(sd[k].numel() * sd[k].element_size() for k in changed)
    total = tensor_nbytes(sd)
    report.raw["state"] = {"tensors": len(sd), "bytes": total, "changed_tensors": len(changed),
                           "changed_bytes": changed_bytes}
    log.info("incremental: %d of %d tensors change (%.1f%% of the bytes)", len(changed), len(sd),
             100 * changed_bytes / total)
    ok = True
    for kind in kinds:
        with environment(kind, args.workdir, args.conn_mbps) as env:
            be = env.backend
            samples = []
            for rep in range(args.reps):
                run = be.url(f"run-{rep}")
                writer = be.ct_writer(run + "/step-1")
                first_digests = digests(sd)
                t = now()
                dcp.save(sd, storage_writer=writer)
                first = now() - t
                s1 = dict(writer.last_stats)
                for k in changed:
                    sd[k].add_(1.0)
                second_digests = digests(sd)
                t = now()
                dcp.save(sd, checkpoint_id=run + "/step-2", storage_writer=writer)
                second = now() - t
                s2 = dict(writer.last_stats)
                samples.append({"first_seconds": first, "second_seconds": second,
                                "first_bytes": s1["bytes_written"],
                                "second_bytes": s2["bytes_written"],
                                "second_reused": s2["bytes_reused"]})
                log.info("  %s rep %d: first %.3f s %d B, second %.3f s %d B", kind, rep, first,
                         s1["bytes_written"], second, s2["bytes_written"])
                if rep == args.reps - 1:  # both checkpoints load back exactly
                    dest = zeros_like(sd)
                    dcp.load(dest, storage_reader=be.ct_reader(run + "/step-1"))
                    ok &= not mismatches(dest, first_digests)
                    zero_(dest)
                    dcp.load(dest, storage_reader=be.ct_reader(run + "/step-2"))
                    ok &= not mismatches(dest, second_digests)
                    del dest
                be.remove(run)
            best = {k: min(s[k] for s in samples) for k in samples[0]}
            report.raw[kind] = {"samples": samples}
            where = "local disk" if kind == "local" else "SeaweedFS"
            report.compare(f"2nd/1st save bytes ({where})", best["second_bytes"],
                           best["first_bytes"], "bytes", peer_name="first save", target=0.15)
            report.compare(f"2nd/1st save time ({where})", best["second_seconds"],
                           best["first_seconds"], "s", peer_name="first save", target=0.3)
    report.note(f"changed: {len(changed)} of {len(sd)} tensors, "
                f"{100 * changed_bytes / total:.1f}% of the bytes")
    report.check("both checkpoints load back exactly", ok)
    return report


# --------------------------------------------------------------------------- async-stall
def _mutate(sd: dict[str, Any]) -> None:
    """A training step: every tensor changes (so the next save writes everything)."""
    for v in sd.values():
        v.add_(1)


def _stall_variant(rank: int, world: int, variant: str, size: int, workdir: str | None,
                   pool_bytes: int | None) -> dict[str, Any]:
    """One variant in a fresh process: two saves (first, then steady state after a step)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    import ckptturbo as ct

    sd = transformer_state(size)
    root = tempfile.mkdtemp(prefix="ckptturbo-bench-stall-", dir=workdir)
    out: dict[str, Any] = {"variant": variant}
    check = True
    try:
        with RssSampler() as mem:
            for phase in ("first", "steady"):
                if phase == "steady":
                    _mutate(sd)
                expected = digests(sd)
                target = os.path.join(root, "run", phase)
                if variant == "bare copy":
                    if phase == "first":
                        dst = {k: torch.empty_like(v) for k, v in sd.items()}
                        for d in dst.values():
                            d.zero_()  # preallocated: pages already faulted in
                    t = now()
                    for k, v in sd.items():
                        dst[k].copy_(v)
                    stall = durable = now() - t
                    check &= not mismatches(dst, expected)
                elif variant == "ct.save":
                    t = now()
                    opts = {} if pool_bytes is None else {"pool_bytes": pool_bytes}
                    handle = ct.save(sd, target, **opts)
                    handle.staged.result()
                    stall = now() - t
                    summary = handle.wait()
                    durable = now() - t
                    out[f"{phase}_summary_seconds"] = summary.seconds
                    writer = next(iter(ct.default_session()._kept.values()))
                    out["pool_bytes"] = writer._pool.capacity if writer._pool is not None else 0
                elif variant == "TurboWriter (sync)":
                    if phase == "first":
                        writer = ct.TurboWriter(target)
                    t = now()
                    dcp.save(sd, checkpoint_id=target, storage_writer=writer)
                    stall = durable = now() - t
                elif variant == "dcp.async_save":
                    t = now()
                    resp = dcp.async_save(sd, storage_writer=FileSystemWriter(target))
                    returned = now() - t
                    if isinstance(resp, AsyncSaveResponse):
                        resp.staging_completion.result()
                        upload = resp.upload_completion
                    else:
                        upload = resp
                    stall = now() - t
                    out[f"{phase}_returned"] = returned
                    upload.result()
                    durable = now() - t
                elif variant == "dcp.save":
                    t = now()
                    dcp.save(sd, storage_writer=FileSystemWriter(target))
                    stall = durable = now() - t
                else:
                    raise ValueError(variant)
                out[f"{phase}_stall"] = stall
                out[f"{phase}_durable"] = durable
        out["peak_extra_rss"] = mem.peak_extra
        if variant != "bare copy":  # outside the sampler: the last checkpoint loads back exactly
            dest = zeros_like(sd)
            if variant.startswith("dcp"):
                from torch.distributed.checkpoint import FileSystemReader
                dcp.load(dest, storage_reader=FileSystemReader(target))
            else:
                dcp.load(dest, storage_reader=ct.TurboReader(target))
            check &= not mismatches(dest, expected)
        out["correct"] = check
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return out


STALL_VARIANTS = ("bare copy", "ct.save", "dcp.async_save", "dcp.save", "TurboWriter (sync)")


def async_stall(args: Any) -> Report:
    """How long the training loop waits for a save, and what it costs in memory."""
    size = args.size_mb * MiB
    report = Report("async-stall", {"size_mb": args.size_mb, "reps": args.reps,
                                    "pool_mb": args.pool_mb})
    pool = args.pool_mb * MiB if args.pool_mb else None
    variants = {v: (lambda rep, v=v: run_isolated(_stall_variant, v, size, args.workdir, pool,
                                                  timeout=600, setup=rank_setup))
                for v in STALL_VARIANTS}
    res = alternate(args.reps, variants, key="steady_stall")
    # durable times: best of the samples independently of stall
    best = {v: r["best"] for v, r in res.items()}
    best_durable = {v: min(s["steady_durable"] for s in r["samples"]) for v, r in res.items()}
    best_first = {v: min(s["first_stall"] for s in r["samples"]) for v, r in res.items()}
    report.raw["variants"] = res
    ct_ = best["ct.save"]
    report.compare("stall, steady state", ct_["steady_stall"], best["bare copy"]["steady_stall"],
                   "s", peer_name="bare copy_ into buffers", target=1.5)
    report.compare("stall, steady state", ct_["steady_stall"],
                   best["dcp.async_save"]["steady_stall"], "s",
                   peer_name="dcp.async_save blocking", target=0.5)
    report.compare("stall, steady state", ct_["steady_stall"], best["dcp.save"]["steady_stall"],
                   "s", peer_name="dcp.save (FileSystem)", target=0.2)
    report.compare("stall, first save", best_first["ct.save"], best_first["dcp.async_save"], "s",
                   peer_name="dcp.async_save blocking")
    report.compare("stall, first save", best_first["ct.save"], best_first["bare copy"], "s",
                   peer_name="bare copy_ (touched)")
    report.compare("time to durable, steady", best_durable["ct.save"],
                   best_durable["TurboWriter (sync)"], "s", peer_name="sync TurboWriter save",
                   target=1.1)
    report.compare("time to durable, steady", best_durable["ct.save"],
                   best_durable["dcp.async_save"], "s", peer_name="dcp.async_save")
    peak = max(s["peak_extra_rss"] for s in res["ct.save"]["samples"])
    pool_bytes = ct_.get("pool_bytes", 0)
    report.compare("peak extra RSS (max of reps)", peak, pool_bytes + 64 * MiB, "bytes",
                   peer_name="pool + 64 MiB", target=1.0)
    report.compare("peak extra RSS", peak,
                   max(s["peak_extra_rss"] for s in res["dcp.async_save"]["samples"]), "bytes",
                   peer_name="dcp.async_save")
    report.raw["pool_bytes"] = pool_bytes
    report.raw["state_bytes"] = size
    report.note(f"ct.save staging pool: {pool_bytes / MiB:.0f} MiB (default: the rank's share, "
                "capped at a quarter of free RAM); every variant runs in a fresh process; "
                "'steady' = second save after every tensor changed, into the same run")
    report.check("every variant's checkpoint loads back exactly",
                 all(s["correct"] for r in res.values() for s in r["samples"]))
    return report
