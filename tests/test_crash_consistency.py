"""Kill a checkpointing job at a random moment; what is left must be committed or invisible.

A real 2-rank gloo job (torch.distributed.run, tests/jobs/save_loop.py) saves a checkpoint
every step; the test SIGKILLs the whole job, or one rank, a random delay (drawn from a seeded
generator) after its first commit, then checks what a restarted job would see: every checkpoint `ls`
lists loads bit-exact (its state is a pure function of its step), a step directory without a
manifest cannot be loaded, and, once the dead job's pending markers have outlived their
short lease, gc removes exactly the orphaned chunks (those no committed manifest names) and
every committed checkpoint still loads bit-exact. A gc killed at a random moment leaves
every committed checkpoint intact and a second gc completes; a gc looping beside a save
never deletes a chunk that save relies on.
CI runs a few trials per store; ``CKPTTURBO_SOAK=1`` runs 50 on local disk and 20 on S3.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptturbo as ct
from ckptturbo import catalog
from ckptturbo.errors import SaveInProgress
from ckptturbo.lease import LEASE_ENV
from ckptturbo.runs import Location, RunStore

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from save_loop import state_of  # noqa: E402

JOB = Path(__file__).parent / "jobs" / "save_loop.py"
SOAK = bool(os.environ.get("CKPTTURBO_SOAK"))
TRIALS = {"local": 50 if SOAK else 3, "s3": 20 if SOAK else 2}
GC_TRIALS = {"local": 20 if SOAK else 2, "s3": 10 if SOAK else 1}
pytestmark = pytest.mark.timeout(3600 if SOAK else 600)  # 50 killed jobs take ~11 min
LEASE = 2.0  # the jobs' pending-marker lease: a dead job holds gc back this long


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _run_and_kill(run: str, options: dict | None, delay: float, victim: str, logs: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--log-dir", str(logs),
           str(JOB), run, "100"]
    if options:
        cmd.append(json.dumps(options))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent),
               **{LEASE_ENV: str(LEASE)})
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, env=env)
    lines: list[str] = []
    first_commit = threading.Event()

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("committed"):
                first_commit.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:  # the random moment is counted from the first commit (start-up time varies)
        first_commit.wait(120)
        time.sleep(delay)  # workload: the random moment of the crash
        if victim == "job":  # the launcher starts each worker in a session of its own
            _kill_all(job.pid)
        else:  # one rank dies; the launcher must bring the rest down, not hang
            workers = _children(job.pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
        job.wait(timeout=120)
        reader.join(30)
    finally:
        if job.poll() is None:
            _kill_all(job.pid)
            job.wait()
    return "".join(lines)


def _kill_all(launcher: int) -> None:
    """SIGKILL every worker's process group, then the launcher's (a whole node dies)."""
    for pid in _children(launcher) + [launcher]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _check_visible_state(run: str, options: dict | None) -> list[str]:
    committed = catalog.list_checkpoints(run, options)
    for info in committed:
        step = int(info.name.split("-")[1])
        expected = state_of(step)
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
               for k, v in expected.items()}
        ct.load(out, info.url, storage_options=options)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(out[key], value), f"{info.url}: {key} differs"
            else:
                assert out[key] == value, f"{info.url}: {key} differs"
    names = {c.name for c in committed}
    for step in range(1, 101):  # an interrupted step is invisible to load
        if f"step-{step}" not in names:
            with pytest.raises(ct.CheckpointNotFound):
                ct.load({"step": 0}, f"{run}/step-{step}", storage_options=options, strict=False)
            break
    return sorted(names)


def _runs(store: str, tmp_path: Path,
          request: pytest.FixtureRequest) -> tuple[Callable[[str], str], dict | None]:
    """Where a test's runs go: a function naming a fresh run on ``store``, and its options."""
    if store == "local":
        return (lambda name: str(tmp_path / name)), None
    server = request.getfixturevalue("s3_server")
    return server.url, server.storage_options


@pytest.mark.parametrize("store", ["local", "s3"])
def test_killed_jobs_leave_only_verifiable_checkpoints(store, tmp_path, request, monkeypatch):
    # gc leaves a temporary chunk file (a write in progress) alone for its own process's
    # lease: the jobs' lease here too, or a killed writer's files would outlive the test
    monkeypatch.setenv(LEASE_ENV, str(LEASE))
    rng = random.Random(20261122)
    run_url, options = _runs(store, tmp_path, request)
    seen_committed = 0
    for trial in range(TRIALS[store]):
        run = run_url(f"crash-{trial}")
        victim = "job" if trial % 2 == 0 else "rank"
        out = _run_and_kill(run, options, delay=rng.uniform(0.0, 4.0), victim=victim,
                            logs=tmp_path / "logs")
        names = _check_visible_state(run, options)
        seen_committed += len(names)
        # not a wait for an event but the protocol's timeout, counted from the kill: after
        # it every marker and temporary file the dead ranks left is older than their lease
        time.sleep(LEASE)
        _gc_and_check(run, options)
        assert _check_visible_state(run, options) == names
        # a restarted job saves again next to whatever the crash left, and gc keeps every
        # committed checkpoint loadable
        ct.save(state_of(999), f"{run}/step-999", storage_options=options,
                chunk_size=256 << 10, pack_threshold=64 << 10).wait(timeout=120)
        assert "step-999" in _check_visible_state(run, options), out[-2000:]
    assert seen_committed > 0  # the delays let some saves commit before the kill


def _stored_chunks(run: str, options: dict | None) -> set[str]:
    rs = RunStore.for_run(run, options)
    return {info.path.rsplit("/", 1)[-1] for info in rs.store.list_files(rs.chunks_root)}


def _referenced(run: str, options: dict | None) -> set[str]:
    return {cid for info in catalog.list_checkpoints(run, options)
            for cid in Location(info.url, options).read_manifest().chunks}


def _gc_and_check(run: str, options: dict | None) -> None:
    """gc removes every orphaned chunk and nothing a committed manifest names."""
    referenced = _referenced(run, options)
    assert referenced <= _stored_chunks(run, options)
    catalog.collect_garbage(run, options)
    assert _stored_chunks(run, options) == referenced


def _store_with_orphans(run: str, options: dict | None, steps: int = 6, keep: int = 2) -> None:
    for step in range(1, steps + 1):  # small chunks: many objects for gc to delete
        ct.save(state_of(step), f"{run}/step-{step}", storage_options=options,
                chunk_size=16 << 10, pack_threshold=4 << 10).wait(timeout=120)
    for step in range(1, steps - keep + 1):
        ct.delete(f"{run}/step-{step}", storage_options=options)


def _kill_gc(run: str, options: dict | None, rng: random.Random) -> bool:
    """Start `ckptturbo gc` in its own process and SIGKILL it either at a random delay or
    once it has bumped the gc generation (it deletes right after); True when it was
    still running at the kill."""
    cmd = [sys.executable, "-m", "ckptturbo.cli", "gc", run]
    if options:
        cmd += ["--storage-options", json.dumps(options)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), **{LEASE_ENV: str(LEASE)})
    rs = RunStore.for_run(run, options)
    before = catalog.generation(rs)
    gc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    try:
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.5, 6.0))  # workload: a kill at a random moment
        else:
            deadline = time.monotonic() + 60
            while gc.poll() is None and time.monotonic() < deadline:
                if catalog.generation(rs) != before:
                    break
        running = gc.poll() is None
        gc.kill()
    finally:
        gc.wait()
    return running


@pytest.mark.parametrize("store", ["local", "s3"])
def test_killed_gc_leaves_committed_checkpoints_intact(store, tmp_path, request, monkeypatch):
    monkeypatch.setenv(LEASE_ENV, str(LEASE))
    rng = random.Random(20261123)
    run_url, options = _runs(store, tmp_path, request)
    killed_running = 0
    for trial in range(GC_TRIALS[store]):
        run = run_url(f"gc-crash-{trial}")
        _store_with_orphans(run, options)
        assert _stored_chunks(run, options) - _referenced(run, options)  # orphans exist
        killed_running += _kill_gc(run, options, rng)
        names = _check_visible_state(run, options)
        assert names == ["step-5", "step-6"]
        _gc_and_check(run, options)  # a second gc completes (the dead one's lock is overwritten)
        assert _check_visible_state(run, options) == names
        ct.save(state_of(7), f"{run}/step-7", storage_options=options).wait(timeout=120)
        assert _check_visible_state(run, options) == names + ["step-7"]
    assert killed_running > 0  # at least one kill landed while the gc was running


@pytest.mark.parametrize("store", ["local", "s3"])
def test_gc_beside_a_save_never_deletes_its_chunks(store, tmp_path, request, monkeypatch):
    monkeypatch.setenv(LEASE_ENV, "0.6")  # shorter than the save: only the heartbeat holds it
    run_url, options = _runs(store, tmp_path, request)
    run = run_url("gc-beside-save")
    trials = 5 if SOAK else 1
    for trial in range(trials):
        _store_with_orphans(run, options, steps=3, keep=1)  # steps 1-2 orphaned
        # the new save dedups against orphaned chunks (step 2's) and writes new ones
        extra = torch.randn(4 << 20, generator=torch.Generator().manual_seed(trial))
        state = dict(state_of(2), extra=extra)
        refused: list[float] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def gc_loop(stop: threading.Event, refused: list[float],
                    errors: list[BaseException]) -> None:
            while not stop.is_set():
                try:
                    catalog.collect_garbage(run, options)
                except SaveInProgress:
                    refused.append(time.monotonic())
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
                stop.wait(0.02)  # workload: a gc every 20 ms beside the save

        thread = threading.Thread(target=gc_loop, args=(stop, refused, errors))
        thread.start()
        try:
            ct.save(state, f"{run}/trial-{trial}", storage_options=options,
                    chunk_size=64 << 10, pack_threshold=16 << 10).wait(timeout=120)
        finally:
            stop.set()
            thread.join(60)
        assert not errors, errors
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
               for k, v in state.items()}
        ct.load(out, f"{run}/trial-{trial}", storage_options=options)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(out[key], value)
            else:
                assert out[key] == value
        time.sleep(0.7)  # the last marker's final lease (0.6 s): a timeout, not an event
        _gc_and_check(run, options)
        ct.delete(f"{run}/step-3", storage_options=options)
