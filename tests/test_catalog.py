"""Deleting, collecting and the save/gc protocol that keeps committed chunks safe."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo import catalog, chunk_index
from ckptturbo.layout import Location
from ckptturbo.testing.launcher import run_distributed


def tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 1024, generator=g) for i in range(4)}


def load_equal(url: str, sd: dict) -> bool:
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    ct.load(out, url)
    return all(torch.equal(out[k], v) for k, v in sd.items())


def test_delete_then_gc_keeps_chunks_of_other_checkpoints(tmp_path):
    run = tmp_path / "run"
    a = tensors(0)
    b = dict(a, t0=a["t0"] + 1)  # shares t1..t3 with a
    ct.save(a, str(run / "a"), pack_threshold=1024).wait(timeout=60)
    ct.save(b, str(run / "b"), pack_threshold=1024).wait(timeout=60)
    assert [c.name for c in catalog.list_checkpoints(str(run))] == ["a", "b"]
    ct.delete(str(run / "a"))
    assert [c.name for c in catalog.list_checkpoints(str(run))] == ["b"]
    dry = catalog.collect_garbage(str(run), dry_run=True)
    assert dry.deleted == 1 and dry.dry_run
    report = catalog.collect_garbage(str(run))
    assert report.deleted == 1 and report.deleted_bytes == 64 * 1024 * 4
    assert load_equal(str(run / "b"), b)
    with pytest.raises(ct.CheckpointNotFound):
        ct.load({k: torch.zeros_like(v) for k, v in a.items()}, str(run / "a"))


def test_gc_refuses_while_a_save_is_pending(tmp_path):
    run = tmp_path / "run"
    ct.save(tensors(1), str(run / "a")).wait(timeout=60)
    marker = run / ".ckptturbo" / "pending" / "some-save"
    marker.write_text(json.dumps({"time": time.time()}))
    with pytest.raises(ct.SaveInProgress, match="in progress"):
        catalog.collect_garbage(str(run))
    marker.write_text(json.dumps({"time": time.time() - catalog.MARKER_TTL - 1}))
    catalog.collect_garbage(str(run))  # a stale marker (crashed save) no longer blocks


def test_save_waits_for_running_gc_then_relists(tmp_path):
    run = tmp_path / "run"
    sd = tensors(2)
    ct.save(sd, str(run / "a"), pack_threshold=1024).wait(timeout=60)
    ct.delete(str(run / "a"))
    lock = run / ".ckptturbo" / "gc.lock"
    lock.write_text(json.dumps({"time": time.time()}))  # a gc is "running"
    catalog.collect_garbage(str(run), dry_run=True)
    writer = ct.TurboWriter(str(run / "b"), pack_threshold=1024)
    # the run's chunk index (kept across writers) predates the gc: it believes every
    # chunk of "a" exists
    index = chunk_index.index_for(writer.location.run)
    stored = {p.name for p in (run / ".ckptturbo" / "chunks").rglob("*") if p.is_file()}
    assert stored and all(cid in index for cid in stored) and index.generation == "0"
    done = threading.Event()

    def save() -> None:
        dcp.save(sd, storage_writer=writer)
        done.set()

    thread = threading.Thread(target=save)
    thread.start()
    time.sleep(1.0)
    assert not done.is_set()  # blocked by the fresh gc lock
    # the "gc" deletes every chunk and bumps the generation, then releases its lock
    chunks = list((run / ".ckptturbo" / "chunks").rglob("*"))
    for p in chunks:
        if p.is_file():
            p.unlink()
    (run / ".ckptturbo" / "gc.generation").write_text("after-gc")
    lock.unlink()
    thread.join(60)
    assert done.is_set()
    assert load_equal(str(run / "b"), sd)  # the writer relisted and re-uploaded everything


def _save_twice(rank: int, world: int, run: str) -> int:
    writer = ct.TurboWriter(f"{run}/a", chunk_size=64 << 10)
    for name in ("a", "b"):
        writer.reset(f"{run}/{name}")
        dcp.save(tensors(3), storage_writer=writer)
    return writer.plan_cache_hits


def test_plan_is_cached_across_saves_of_the_same_layout(tmp_path):
    hits = run_distributed(_save_twice, 2, str(tmp_path / "run"), timeout=240)
    assert hits[0] == 1  # the coordinator reused its plan for the second save
    sd = tensors(3)
    assert load_equal(str(tmp_path / "run" / "b"), sd)
    manifest = Location(str(tmp_path / "run" / "b")).read_manifest()
    assert manifest.stats["bytes_written"] == 0  # identical content: all chunks reused


def _hold_gc_lock(run):
    lock = run / ".ckptturbo" / "gc.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"time": time.time()}))  # a gc is "running"
    return lock


def test_gc_lock_delays_durable_but_not_staged(tmp_path):
    run = tmp_path / "run"
    sd = tensors(4)
    ct.save(sd, str(run / "a")).wait(timeout=60)
    lock = _hold_gc_lock(run)
    handle = ct.save(sd, str(run / "b"))
    handle.staged.result(timeout=20)  # the copy does not wait for the gc
    time.sleep(1.0)
    assert not handle.durable.done()  # the uploads and the commit do
    assert [p.name for p in (run / ".ckptturbo" / "pending").iterdir()]  # announced itself
    lock.unlink()
    handle.wait(timeout=60)
    assert load_equal(str(run / "b"), sd)
    assert not list((run / ".ckptturbo" / "pending").iterdir())  # the commit cleared it


def test_gc_lock_delays_dcp_async_save_upload_but_not_staging(tmp_path):
    run = tmp_path / "run"
    sd = tensors(5)
    lock = _hold_gc_lock(run)
    response = dcp.async_save(sd, storage_writer=ct.TurboWriter(str(run / "a")))
    response.staging_completion.result(timeout=20)
    time.sleep(1.0)
    assert not response.upload_completion.done()
    lock.unlink()
    response.upload_completion.result(timeout=60)
    assert load_equal(str(run / "a"), sd)


def test_fresh_writers_share_the_run_chunk_index_until_a_gc(tmp_path):
    run = tmp_path / "run"
    sd = tensors(6)
    for name in ("a", "b"):  # the documented pattern: a new TurboWriter per dcp.save
        dcp.save(sd, storage_writer=ct.TurboWriter(str(run / name)))
    index = chunk_index.index_for(ct.TurboWriter(str(run / "c")).location.run)
    assert index.listings == 1
    catalog.collect_garbage(str(run))  # a new gc generation: the next save relists
    dcp.save(sd, storage_writer=ct.TurboWriter(str(run / "c")))
    assert index.listings == 2
    assert Location(str(run / "c")).read_manifest().stats["bytes_written"] == 0
    assert load_equal(str(run / "c"), sd)


def _save_once(rank: int, world: int, url: str) -> None:
    dcp.save(tensors(7), storage_writer=ct.TurboWriter(url))


def test_every_rank_announces_and_the_commit_clears_all_markers(tmp_path):
    run = tmp_path / "run"
    lock = _hold_gc_lock(run)
    pending = run / ".ckptturbo" / "pending"
    done = threading.Event()

    def save() -> None:
        run_distributed(_save_once, 2, str(run / "a"), timeout=240)
        done.set()

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(pending.glob("*"))) < 2:
        time.sleep(0.2)
    names = sorted(p.name for p in pending.glob("*"))
    assert len(names) == 2 and {n.rsplit(".", 1)[1] for n in names} == {"0", "1"}, names
    assert len({n.rsplit(".", 1)[0] for n in names}) == 1  # one save id, one marker per rank
    assert not done.is_set()
    lock.unlink()
    thread.join(240)
    assert done.is_set() and not list(pending.glob("*"))
    assert load_equal(str(run / "a"), tensors(7))
