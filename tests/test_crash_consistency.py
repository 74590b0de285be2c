"""Kill a checkpointing job at a random moment; what is left must be committed or invisible.

A real 2-rank gloo job (torch.distributed.run, tests/jobs/save_loop.py) saves a checkpoint
every step; the test SIGKILLs the whole job, or one rank, after a random delay drawn from a
seeded generator, then checks what a restarted job would see: every checkpoint `ls` lists
loads bit-exact (its state is a pure function of its step), a step directory without a
manifest cannot be loaded, and a later save and gc leave every committed checkpoint intact.
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
import time
from pathlib import Path

import pytest
import torch

import ckptturbo as ct
from ckptturbo import catalog

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from save_loop import state_of  # noqa: E402

JOB = Path(__file__).parent / "jobs" / "save_loop.py"
SOAK = bool(os.environ.get("CKPTTURBO_SOAK"))
TRIALS = {"local": 50 if SOAK else 3, "s3": 20 if SOAK else 2}


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


def _run_and_kill(run: str, options: dict | None, delay: float, victim: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(JOB), run, "100"]
    if options:
        cmd.append(json.dumps(options))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent))
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, env=env)
    try:
        time.sleep(delay)
        if victim == "job":
            os.killpg(job.pid, signal.SIGKILL)
        else:  # one rank dies; the launcher must bring the rest down, not hang
            workers = _children(job.pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return out


def _check_visible_state(run: str, options: dict | None) -> list[str]:
    committed = catalog.list_checkpoints(run, options)
    for info in committed:
        step = int(info.name.split("-")[1])
        expected = state_of(step)
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in expected.items()}
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


@pytest.mark.parametrize("store", ["local", "s3"])
def test_killed_jobs_leave_only_verifiable_checkpoints(store, tmp_path, request):
    rng = random.Random(20261122)
    options = None
    if store == "s3":
        server = request.getfixturevalue("s3_server")
        options = server.storage_options
    seen_committed = 0
    for trial in range(TRIALS[store]):
        run = str(tmp_path / f"run-{trial}") if store == "local" else server.url(f"crash-{trial}")
        victim = "job" if trial % 2 == 0 else "rank"
        out = _run_and_kill(run, options, delay=rng.uniform(3.0, 9.0), victim=victim)
        names = _check_visible_state(run, options)
        seen_committed += len(names)
        # a restarted job saves again next to whatever the crash left, and gc keeps every
        # committed checkpoint loadable
        ct.save(state_of(999), f"{run}/step-999", storage_options=options,
                chunk_size=256 << 10, pack_threshold=64 << 10).wait(timeout=120)
        assert f"step-999" in _check_visible_state(run, options), out[-2000:]
    assert seen_committed > 0  # the delays let some saves commit before the kill
