"""Two-phase saves: staged then durable, bounded pool, DCP's async_save paths."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptturbo as ct
from ckptturbo.staging import HostBufferPool
from ckptturbo.testing.launcher import run_distributed


def state(seed: int = 0, n: int = 6, rows: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(rows, 1024, generator=g) for i in range(n)} | {
        "step": seed}


def zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]
               for k, v in a.items())


def test_pool_ring_waits_and_reuses_memory():
    pool = HostBufferPool(1000, pin=False)
    a = pool.acquire(600)
    b = pool.acquire(400)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(500, timeout=10)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # full: the third acquire waits
    pool.release(a)
    t.join(5)
    assert got and got[0].offset == 0  # reuses the freed head of the ring
    assert pool.peak_in_use <= 1000
    with pytest.raises(TimeoutError):
        pool.acquire(200, timeout=0.1)
    with pytest.raises(ValueError):
        pool.acquire(2000)
    pool.release(b)
    pool.release(got[0])
    assert pool.in_use == 0


def test_mutating_after_staged_keeps_values_at_call_time(tmp_path):
    sd = state(1)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    handle = ct.save(sd, str(tmp_path / "run" / "a"))
    handle.staged.result(timeout=60)
    for v in sd.values():  # CPU tensors too: they were snapshotted into the pool
        if isinstance(v, torch.Tensor):
            v.fill_(-7.0)
    summary = handle.wait(timeout=60)
    assert summary.bytes_staged >= sum(v.numel() * 4 for v in expected.values()
                                       if isinstance(v, torch.Tensor))
    out = zeros(expected)
    ct.load(out, str(tmp_path / "run" / "a"))
    assert same(expected, out)


def test_pool_smaller_than_state_stages_in_waves(tmp_path):
    sd = state(2, n=8)  # 8 MiB of tensors through a 2 MiB pool with 1 MiB chunks
    handle = ct.save(sd, str(tmp_path / "run" / "a"), pool_bytes=2 << 20, chunk_size=1 << 20)
    summary = handle.wait(timeout=120)
    assert summary.bytes_staged >= 8 << 20  # plus the pickled "step"
    writers = ct.default_session()._kept.values()
    writer = next(w for w in writers if w.url.startswith(str(tmp_path)))
    assert writer._pool.capacity == 2 << 20 and writer._pool.peak_in_use <= 2 << 20
    out = zeros(sd)
    ct.load(out, str(tmp_path / "run" / "a"))
    assert same(sd, out)


def test_back_to_back_saves_wait_or_fail_fast(tmp_path):
    run = tmp_path / "run"
    first, second = state(3), state(4)
    h1 = ct.save(first, str(run / "one"))
    h2 = ct.save(second, str(run / "two"))  # waits for h1 to be durable first
    h2.wait(timeout=120)
    assert h1.done()
    h3 = ct.save(state(5, n=30), str(run / "three"))
    with pytest.raises(ct.SaveInProgress):
        if not h3.done():
            ct.save(state(6), str(run / "four"), wait_previous=False)
        else:
            raise ct.SaveInProgress("the first save finished before the check")
    h3.wait(timeout=120)
    for name, sd in (("one", first), ("two", second)):
        out = zeros(sd)
        ct.load(out, str(run / name))
        assert same(sd, out)


@pytest.mark.parametrize("kind", [AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS])
def test_dcp_async_save_uses_turbo_stager(tmp_path, kind):
    run_distributed(_async_save_rank, 2, str(tmp_path / "run" / "a"), kind, timeout=240)
    sd = state(10)
    out = zeros(sd)
    ct.load(out, str(tmp_path / "run" / "a"))
    assert same(sd, out)


def _async_save_rank(rank: int, world: int, url: str, kind: AsyncCheckpointerType) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    sd = state(10)
    writer = ct.TurboWriter(url)
    assert isinstance(writer, AsyncStager)
    response = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
    staging = getattr(response, "staging_completion", None)
    upload = getattr(response, "upload_completion", response)
    assert staging is not None, "TurboWriter.stage() returns a Future: DCP gives AsyncSaveResponse"
    staging.result(timeout=120)
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.fill_(3.0)
    upload.result(timeout=120)
