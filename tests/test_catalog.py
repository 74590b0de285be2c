"""Deleting, collecting and the save/gc protocol that keeps committed chunks safe."""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo import catalog, cli, lease, runtime
from ckptturbo.runs import Location
from ckptturbo.store import Store
from ckptturbo.testing.launcher import run_distributed
from tests.waiting import wait_until


def tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 1024, generator=g) for i in range(4)}


def blocked_by_gc_lock(caplog: pytest.LogCaptureFixture, polls: int = 2) -> bool:
    """Wait until a save has found the gc lock fresh ``polls`` times (the debug line
    ``begin_save`` writes before each pause): it is provably waiting for the gc, so that a
    "not done yet" check after it tests the lock, not how fast the machine is. Needs
    ``caplog.set_level(logging.DEBUG, logger="ckptturbo")`` first."""
    def seen() -> bool:
        lines = [r.getMessage() for r in list(caplog.records)]
        return sum("waits for the gc lock" in line for line in lines) >= polls

    return wait_until(seen, timeout=60)


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


def test_gc_leaves_a_chunk_on_its_way_in_alone(tmp_path):
    """A local write's temporary file (a replica arriving in a memory tier holds no save
    marker) is kept while younger than a lease; one older than that was left by a writer
    that died, and goes."""
    run = tmp_path / "run"
    ct.save(tensors(3), str(run / "a")).wait(timeout=60)
    shard = next(p for p in (run / ".ckptturbo" / "chunks").iterdir() if p.is_dir())
    arriving, abandoned = shard / ".tmp-arriving", shard / ".tmp-abandoned"
    arriving.write_bytes(b"x" * 100)
    abandoned.write_bytes(b"y" * 100)
    old = time.time() - lease.pending_lease() - 1
    os.utime(abandoned, (old, old))
    report = catalog.collect_garbage(str(run))
    assert arriving.exists() and not abandoned.exists()
    assert report.deleted == 1 and report.kept_recent == 1
    assert load_equal(str(run / "a"), tensors(3))


def test_gc_refuses_while_a_save_is_pending(tmp_path):
    run = tmp_path / "run"
    ct.save(tensors(1), str(run / "a")).wait(timeout=60)
    marker = run / ".ckptturbo" / "pending" / "some-save"
    marker.write_text(json.dumps({"time": time.time()}))
    with pytest.raises(ct.SaveInProgress, match="in progress"):
        catalog.collect_garbage(str(run))
    marker.write_text(json.dumps({"time": time.time() - lease.MARKER_TTL - 1}))
    catalog.collect_garbage(str(run))  # a stale marker (crashed save) no longer blocks


def test_gcs_of_a_run_in_one_process_take_turns(tmp_path, caplog):
    """A memory tier's evictions after two saves run on two threads of the node leader:
    the second gc waits for the first instead of deleting the same chunks beside it, and
    of removing the lock while the first still deletes (a save starting then would not
    wait for it)."""
    run = tmp_path / "run"
    ct.save(tensors(4), str(run / "a")).wait(timeout=60)
    shard = next(p for p in (run / ".ckptturbo" / "chunks").iterdir() if p.is_dir())
    orphans = [shard / f"{i:064x}" for i in range(2000)]  # chunks no manifest names
    for path in orphans:
        path.write_bytes(b"x")
    reports, errors = [], []

    def gc() -> None:
        try:
            reports.append(catalog.collect_garbage(str(run)))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=gc) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert sorted(r.deleted for r in reports) == [0, len(orphans)]
    assert not any(path.exists() for path in orphans)
    assert not (run / ".ckptturbo" / "gc.lock").exists()
    assert "could not remove" not in caplog.text
    assert load_equal(str(run / "a"), tensors(4))


def test_save_waits_for_running_gc_then_relists(tmp_path, caplog):
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
    index = runtime.index_for(writer.location.run)
    stored = {p.name for p in (run / ".ckptturbo" / "chunks").rglob("*") if p.is_file()}
    assert stored and all(cid in index for cid in stored) and index.generation == "0"
    done = threading.Event()

    def save() -> None:
        dcp.save(sd, storage_writer=writer)
        done.set()

    caplog.set_level(logging.DEBUG, logger="ckptturbo")
    thread = threading.Thread(target=save)
    thread.start()
    assert blocked_by_gc_lock(caplog)
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


def test_gc_lock_delays_durable_but_not_staged(tmp_path, caplog):
    run = tmp_path / "run"
    sd = tensors(4)
    ct.save(sd, str(run / "a")).wait(timeout=60)
    lock = _hold_gc_lock(run)
    caplog.set_level(logging.DEBUG, logger="ckptturbo")
    handle = ct.save(sd, str(run / "b"))
    handle.staged.result(timeout=20)  # the copy does not wait for the gc
    assert blocked_by_gc_lock(caplog)
    assert not handle.durable.done()  # the uploads and the commit do
    assert [p.name for p in (run / ".ckptturbo" / "pending").iterdir()]  # announced itself
    lock.unlink()
    handle.wait(timeout=60)
    assert load_equal(str(run / "b"), sd)
    assert not list((run / ".ckptturbo" / "pending").iterdir())  # the commit cleared it


def test_gc_lock_delays_dcp_async_save_upload_but_not_staging(tmp_path, caplog):
    run = tmp_path / "run"
    sd = tensors(5)
    lock = _hold_gc_lock(run)
    caplog.set_level(logging.DEBUG, logger="ckptturbo")
    response = dcp.async_save(sd, storage_writer=ct.TurboWriter(str(run / "a")))
    response.staging_completion.result(timeout=20)
    assert blocked_by_gc_lock(caplog)
    assert not response.upload_completion.done()
    lock.unlink()
    response.upload_completion.result(timeout=60)
    assert load_equal(str(run / "a"), sd)


def test_fresh_writers_share_the_run_chunk_index_until_a_gc(tmp_path):
    run = tmp_path / "run"
    sd = tensors(6)
    for name in ("a", "b"):  # the documented pattern: a new TurboWriter per dcp.save
        dcp.save(sd, storage_writer=ct.TurboWriter(str(run / name)))
    index = runtime.index_for(ct.TurboWriter(str(run / "c")).location.run)
    assert index.listings == 1
    catalog.collect_garbage(str(run))  # a new gc generation: the next save relists
    dcp.save(sd, storage_writer=ct.TurboWriter(str(run / "c")))
    assert index.listings == 2
    assert Location(str(run / "c")).read_manifest().stats["bytes_written"] == 0
    assert load_equal(str(run / "c"), sd)


def _save_once(rank: int, world: int, url: str, log_dir: str) -> None:
    """One rank's save, its ckptturbo debug log in ``log_dir`` for the test to watch."""
    handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))
    logging.getLogger("ckptturbo").addHandler(handler)
    logging.getLogger("ckptturbo").setLevel(logging.DEBUG)
    dcp.save(tensors(7), storage_writer=ct.TurboWriter(url))


def test_every_rank_announces_and_the_commit_clears_all_markers(tmp_path):
    run = tmp_path / "run"
    lock = _hold_gc_lock(run)
    pending = run / ".ckptturbo" / "pending"
    logs = tmp_path / "logs"
    logs.mkdir()
    done = threading.Event()

    def save() -> None:
        run_distributed(_save_once, 2, str(run / "a"), str(logs), timeout=240)
        done.set()

    def both_blocked() -> bool:  # each rank found the gc lock fresh twice: it waits for it
        texts = [p.read_text() for p in logs.glob("rank*.log")]
        return len(texts) == 2 and all(t.count("waits for the gc lock") >= 2 for t in texts)

    thread = threading.Thread(target=save)
    thread.start()
    assert wait_until(both_blocked, timeout=120, interval=0.2)
    names = sorted(p.name for p in pending.glob("*"))
    assert len(names) == 2 and {n.rsplit(".", 1)[1] for n in names} == {"0", "1"}, names
    assert len({n.rsplit(".", 1)[0] for n in names}) == 1  # one save id, one marker per rank
    assert not done.is_set()
    lock.unlink()
    thread.join(240)
    assert done.is_set() and not list(pending.glob("*"))
    assert load_equal(str(run / "a"), tensors(7))


def test_unreadable_manifest_is_named_not_fatal(tmp_path, caplog):
    run = tmp_path / "run"
    a, b = tensors(8), tensors(9)
    ct.save(a, str(run / "a"), pack_threshold=1024).wait(timeout=60)
    ct.save(b, str(run / "b"), pack_threshold=1024).wait(timeout=60)
    ct.delete(str(run / "a"))  # a's chunks are now orphans
    stored = sorted(p for p in (run / ".ckptturbo" / "chunks").rglob("*") if p.is_file())
    bad = run / "b" / "manifest.json"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    ct.save(a, str(run / "c"), pack_threshold=1024).wait(timeout=60)
    with caplog.at_level("WARNING", logger="ckptturbo.catalog"):
        assert [c.name for c in catalog.list_checkpoints(str(run))] == ["c"]
    assert "b/manifest.json" in caplog.text
    listed = catalog.list_checkpoints(str(run), include_unreadable=True)
    assert [(c.name, c.error is not None) for c in listed] == [("b", True), ("c", False)]
    # gc cannot know what b referenced: it deletes nothing and names b
    with pytest.raises(ct.FormatError, match="deleted nothing.*run/b") as err:
        catalog.collect_garbage(str(run))
    assert isinstance(err.value, ct.CkptTurboError)
    assert sorted(p for p in (run / ".ckptturbo" / "chunks").rglob("*") if p.is_file()) == stored
    assert not (run / ".ckptturbo" / "gc.lock").exists()
    catalog.delete_checkpoint(str(run / "b"))  # rm removes an unreadable manifest
    report = catalog.collect_garbage(str(run))
    assert report.deleted == 4  # b's four tensor chunks; a's are c's again
    assert load_equal(str(run / "c"), a)


def test_gc_skips_checkpoints_deleted_while_it_runs(tmp_path):
    run = tmp_path / "run"
    names = [f"s{i}" for i in range(12)]
    for i, name in enumerate(names):
        ct.save({"x": torch.full((1024,), float(i))}, str(run / name)).wait(timeout=60)
    errors: list[BaseException] = []

    def gc_loop() -> None:
        for _ in range(20):
            try:
                catalog.collect_garbage(str(run))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    thread = threading.Thread(target=gc_loop)
    thread.start()
    for name in names[:-1]:  # deleted between gc's listing and its reads
        ct.delete(str(run / name))
        time.sleep(0.01)  # workload, not a wait: spreads the deletes over the gcs' runs
    thread.join(120)
    assert not errors, errors
    catalog.collect_garbage(str(run))
    assert [c.name for c in catalog.list_checkpoints(str(run))] == ["s11"]
    assert len([p for p in (run / ".ckptturbo" / "chunks").rglob("*") if p.is_file()]) == 1


def test_marker_lease_expires_and_heartbeat_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv(lease.LEASE_ENV, "0.6")
    run_store = catalog.RunStore.for_run(str(tmp_path / "run"))
    marker = tmp_path / "run" / ".ckptturbo" / "pending" / "s1.0"
    catalog.begin_save(run_store, "s1", 0)
    record = json.loads(marker.read_text())
    assert record["lease"] == 0.6
    # two leases after it was written, the heartbeat has rewritten it: only that keeps it fresh
    assert wait_until(lambda: json.loads(marker.read_text())["time"] > record["time"] + 1.2)
    with pytest.raises(ct.SaveInProgress):
        catalog.collect_garbage(str(tmp_path / "run"))
    catalog.uploaded(run_store, "s1", 0)  # last renewal; then it holds for one lease
    assert marker.exists()
    # no beat renews it any more: it expires one lease after that renewal
    assert wait_until(lambda: not lease.marker_is_fresh(marker.read_bytes(), time.time()))
    catalog.collect_garbage(str(tmp_path / "run"))  # expired: a dead save
    catalog.end_save(run_store, "s1", [0])
    assert not marker.exists()


@pytest.mark.parametrize("raw", ["abc", "0", "-5", str(lease.MARKER_TTL * 2)])
def test_bad_lease_setting_is_refused(monkeypatch, raw):
    monkeypatch.setenv(lease.LEASE_ENV, raw)
    with pytest.raises(ct.FormatError, match=lease.LEASE_ENV):
        lease.pending_lease()


@pytest.mark.parametrize("record,fresh", [
    ({"time": 1000.0}, True),                            # no lease: MARKER_TTL
    ({"time": 1000.0, "lease": 5}, False),
    ({"time": 1000.0, "lease": 50}, True),
    ({"time": 1000.0, "lease": float("inf")}, True),     # out of range: MARKER_TTL
    ({"time": 1000.0 - lease.MARKER_TTL, "lease": 1e12}, False),
    ({"time": "x"}, False), ([1, 2], False),
])
def test_marker_freshness(record, fresh):
    assert lease.marker_is_fresh(json.dumps(record).encode(), 1010.0) is fresh


def test_cli_ls_marks_the_unreadable_checkpoint_and_lists_the_rest(tmp_path, capsys):
    from ckptturbo import cli

    run = tmp_path / "run"
    for name in ("a", "b"):
        ct.save(tensors(10), str(run / name)).wait(timeout=60)
    truncated = b'{"format": "ckptturbo-manifest", "version": 2, "ite'
    (run / "a" / "manifest.json").write_bytes(truncated)
    assert cli.main(["ls", str(run)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[1][:2] == ["a", "UNREADABLE"] and rows[2][0] == "b"
    assert cli.main(["ls", "--json", str(run)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["error"] is None) for c in listed] == [("a", False), ("b", True)]
    assert "not valid JSON" in listed[0]["error"]


def test_a_save_makes_few_control_requests(s3_server):
    """Issue 23: before its first chunk PUT a save made ~9 sequential small requests (s3fs
    added a HEAD + LIST before reading each absent control object, and a HEAD + LIST after
    the empty chunk listing). Now a run's first save makes: the bucket check (once per
    session and bucket), the marker, gc.lock, then gc.generation and one chunk listing
    side by side; then the chunk, the manifest and the marker's delete (no final renewal
    of a marker written moments ago). A later save skips the bucket check and the
    listing."""
    from ckptturbo.testing.fault_proxy import FaultProxy, with_endpoint

    with ct.Session() as session, FaultProxy(s3_server.endpoint) as proxy:
        options = with_endpoint(s3_server.storage_options, f"http://127.0.0.1:{proxy.port}")
        run = s3_server.url("run")
        counts = []
        for step in range(2):
            proxy.reset_stats()
            session.save({"w": torch.ones(1000) * step}, f"{run}/step-{step}",
                         storage_options=options).wait(60)
            counts.append(proxy.stats().requests)
        out = {"w": torch.zeros(1000)}
        session.load(out, f"{run}/step-1", storage_options=options)
    assert torch.equal(out["w"], torch.ones(1000))
    assert counts == [8, 6], counts


# --- self-contained checkpoints: manifest chunk_store "." ---------------------------------

def _objects(url: str, options: dict | None = None) -> list[str]:
    """Every object stored under a URL, relative to it."""
    store = Store(url, options)
    return [info.path[len(store.root) + 1:] for info in store.list_files(store.root)]


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(run URL, storage options) on a local disk or the embedded S3 server."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    s3 = request.getfixturevalue("s3_server")
    return s3.url(f"self-contained-{uuid.uuid4().hex[:8]}"), s3.storage_options


def test_self_contained_checkpoint_lives_in_its_own_directory(where, capsys):
    run, opts = where
    sd = tensors(0)
    ct.save(sd, f"{run}/a", store=".", storage_options=opts, pack_threshold=1024).wait(timeout=60)
    manifest = Location(f"{run}/a", opts).read_manifest()
    assert manifest.chunk_store == "."
    objects = _objects(run, opts)
    assert {o for o in objects if not o.startswith("a/.ckptturbo/chunks/")} == {
        "a/manifest.json", "a/.ckptturbo/gc.generation"}
    assert {o.rsplit("/", 1)[-1] for o in objects if "/chunks/" in o} == set(manifest.chunks)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    ct.load(out, f"{run}/a", storage_options=opts)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert [c.name for c in catalog.list_checkpoints(run, opts)] == ["a"]
    extra = ["--storage-options", json.dumps(opts)] if opts else []
    assert cli.main(["verify", f"{run}/a", *extra]) == 0
    assert cli.main(["ls", run, *extra]) == 0
    report = catalog.collect_garbage(run, opts)  # nothing to do, and no run store made
    assert report.deleted == 0 and report.referenced == len(manifest.chunks)
    assert not any(o.startswith(".ckptturbo/") for o in _objects(run, opts))
    ct.delete(f"{run}/a", storage_options=opts)
    assert _objects(run, opts) == []
    assert catalog.list_checkpoints(run, opts) == []
    capsys.readouterr()


def test_copied_self_contained_checkpoint_loads_and_verifies(tmp_path):
    sd = tensors(1)
    ct.save(sd, str(tmp_path / "run" / "a"), store=".", pack_threshold=1024).wait(timeout=60)
    shutil.copytree(tmp_path / "run" / "a", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "run")
    assert load_equal(str(tmp_path / "elsewhere" / "copy"), sd)
    assert cli.main(["verify", str(tmp_path / "elsewhere" / "copy")]) == 0
    ct.delete(str(tmp_path / "elsewhere" / "copy"))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_run_mixing_shared_and_self_contained_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    a, b = tensors(2), tensors(3)
    ct.save(a, str(run / "shared"), pack_threshold=1024).wait(timeout=60)
    ct.save(b, str(run / "own"), store=".", pack_threshold=1024).wait(timeout=60)
    ct.save(a, str(run / "gone"), store=".", pack_threshold=1024).wait(timeout=60)
    own_chunks = set(_objects(str(run / "own")))
    ct.delete(str(run / "gone"))
    assert sorted(os.listdir(run)) == [".ckptturbo", "own", "shared"]
    assert [c.name for c in catalog.list_checkpoints(str(run))] == ["shared", "own"]
    assert catalog.collect_garbage(str(run)).deleted == 0
    ct.delete(str(run / "shared"))
    assert catalog.collect_garbage(str(run)).deleted > 0  # the run store's, not "own"'s
    assert set(_objects(str(run / "own"))) == own_chunks
    assert load_equal(str(run / "own"), b)
    assert cli.main(["inspect", str(run / "own")]) == 0
    export = ["export", str(run / "own"), str(tmp_path / "st"), "--format", "safetensors"]
    assert cli.main(export) == 0
    capsys.readouterr()


def test_replacing_a_self_contained_checkpoint_frees_the_old_chunks(tmp_path):
    url = str(tmp_path / "run" / "last")
    for seed in (4, 5):
        ct.save(tensors(seed), url, store=".", pack_threshold=1024).wait(timeout=60)
    manifest = Location(url).read_manifest()
    chunks = {o.rsplit("/", 1)[-1] for o in _objects(url) if "/chunks/" in o}
    assert chunks == set(manifest.chunks)
    assert load_equal(url, tensors(5))


def test_save_after_delete_of_a_self_contained_checkpoint_relists(tmp_path):
    """A delete removes the store's generation with it; the next save mints a new one, so
    the process's index of that store (listed before the delete) is not trusted."""
    url = str(tmp_path / "run" / "a")
    sd = tensors(6)
    ct.save(sd, url, store=".", pack_threshold=1024).wait(timeout=60)
    ct.delete(url)
    ct.save(sd, url, store=".", pack_threshold=1024).wait(timeout=60)
    assert Location(url).read_manifest().stats["bytes_reused"] == 0
    assert cli.main(["verify", url]) == 0
    assert load_equal(url, sd)


def test_delete_of_an_uncommitted_self_contained_save_removes_its_chunks(tmp_path):
    url = str(tmp_path / "run" / "a")
    ct.save(tensors(7), url, store=".", pack_threshold=1024).wait(timeout=60)
    os.remove(tmp_path / "run" / "a" / "manifest.json")  # as if the commit never came
    with pytest.raises(ct.CheckpointNotFound):
        ct.delete(url)
    assert os.listdir(tmp_path / "run") == []
