"""End-to-end demo: save a small model and its optimizer, save again incrementally, load,
verify, on local disk and on an embedded S3 server (SeaweedFS on loopback).

Run with `make demo`. It prints what it did and exits non-zero if anything differs.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptturbo as ct
from ckptturbo import catalog
from ckptturbo.testing import embedded_s3

log = logging.getLogger("demo")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048,
                                         batch_first=True), num_layers=4)
    for layer in model.layers[:2]:  # fine-tuning: the lower half stays frozen
        layer.requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 16, 512)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": 1}


def same(a: dict, b: dict) -> bool:
    ok = True
    for k, v in a.items():
        if isinstance(v, dict):
            ok &= same(v, b[k])
        elif isinstance(v, torch.Tensor):
            ok &= torch.equal(v, b[k])
        else:
            ok &= v == b[k]
    return bool(ok)


def run_demo(run_url: str, storage_options: dict | None, where: str) -> bool:
    model, optim = build(0)
    train_step(model, optim)
    sd = state(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(sd))
    log.info("[%s] model + AdamW state: %d tensors, %.1f MiB", where, len(list(_tensors(sd))),
             nbytes / 2**20)

    t0 = time.perf_counter()
    handle = ct.save(sd, f"{run_url}/step-1", storage_options=storage_options)
    handle.staged.result()
    stall = time.perf_counter() - t0
    first = handle.wait()
    log.info("[%s] ct.save step-1: training waited %.3f s (staged), durable after %.3f s, "
             "%d bytes written", where, stall, time.perf_counter() - t0, first.bytes_written)

    train_step(model, optim)  # the frozen layers' chunks are reused, not rewritten
    sd2 = state(model, optim)
    writer = ct.TurboWriter(f"{run_url}/step-2", storage_options)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # one process, no process group: DCP warns that it assumes so; the demo means it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd2, storage_writer=writer)
    log.info("[%s] dcp.save(storage_writer=TurboWriter) step-2: %.3f s, %d bytes new, %d reused",
             where, time.perf_counter() - t0, writer.last_stats["bytes_written"],
             writer.last_stats["bytes_reused"])

    fresh_model, fresh_optim = build(1)
    train_step(fresh_model, fresh_optim)  # creates optimizer state to load into
    target = state(fresh_model, fresh_optim)
    t0 = time.perf_counter()
    ct.load(target, f"{run_url}/step-2", storage_options=storage_options)
    set_state_dict(fresh_model, fresh_optim, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    ok = same(sd2, state(fresh_model, fresh_optim))
    log.info("[%s] ct.load step-2 (every chunk BLAKE3-verified): %.3f s, identical: %s",
             where, time.perf_counter() - t0, ok)
    for info in catalog.list_checkpoints(run_url, storage_options):
        log.info("[%s]   %-8s %8.1f MiB logical, %d items", where, info.name,
                 info.total_bytes / 2**20, info.items)
    return ok


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield obj


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ckptturbo").setLevel(logging.WARNING)
    workdir = tempfile.mkdtemp(prefix="ckptturbo-demo-")
    ok = True
    try:
        ok &= run_demo(os.path.join(workdir, "run"), None, "local disk")
        try:
            server = embedded_s3.start(os.path.join(workdir, "s3"))
        except RuntimeError as exc:
            log.info("[s3] skipped: %s", exc)
        else:
            try:
                ok &= run_demo(server.url("demo-run"), server.storage_options,
                               f"s3 {server.endpoint}")
            finally:
                server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("demo %s", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
