"""The session that owns a process's checkpoint I/O, and the contract it keeps for the host.

A save that returned ``staged`` is committed even when the process ends right after (local
disk and S3, one process and 2 gloo ranks); a save in flight is visible to the rest of the
process (loads, ``exists``, listings and deletes wait for it, across sessions); a closed
session leaves no thread running; and only Exceptions of ckptturbo's hierarchy come out.
CI runs a few exit trials per case; ``CKPTTURBO_SOAK=1`` runs 20.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckptturbo as ct
from ckptturbo.testing.fault_proxy import FaultProxy
from ckptturbo.testing.launcher import run_command

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from save_and_exit import state_of  # noqa: E402

JOB = Path(__file__).parent / "jobs" / "save_and_exit.py"
SOAK = bool(os.environ.get("CKPTTURBO_SOAK"))
EXIT_TRIALS = 20 if SOAK else 2
pytestmark = pytest.mark.timeout(3600 if SOAK else 600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_and_exit(url: str, seed: int, options: dict | None, ranks: int, logs: Path,
                   end: str = "exit") -> str:
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--log-dir", str(logs)]
    cmd = [*launcher, str(JOB), url, str(seed)] + ([json.dumps(options)] if options else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent),
               SAVE_AND_EXIT_END=end)
    code, output = run_command(cmd, timeout=300, env=env)
    assert code == 0, output
    assert output.count("staged") >= ranks, output
    return output


def _loads_bit_exact(url: str, seed: int, options: dict | None) -> None:
    expected = state_of(seed)
    out = {"w": torch.zeros_like(expected["w"]), "b": torch.zeros_like(expected["b"]), "step": -1}
    ct.load(out, url, storage_options=options)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])
    assert out["step"] == seed


def _run_url(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict | None]:
    if store == "local":
        return str(tmp_path / "run"), None
    server = request.getfixturevalue("s3_server")
    return server.url(), server.storage_options


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_process_ending_right_after_staged_still_commits_its_save(store, ranks, tmp_path,
                                                                    request):
    run, options = _run_url(store, tmp_path, request)
    trials = EXIT_TRIALS if ranks == 1 or SOAK else 1
    for seed in range(trials):
        _save_and_exit(f"{run}/step-{seed}", seed, options, ranks, tmp_path / "logs")
        _loads_bit_exact(f"{run}/step-{seed}", seed, options)
    assert [c.name for c in ct.list_checkpoints(run, storage_options=options)] == \
        [f"step-{seed}" for seed in range(trials)]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_destroy_process_group_right_after_staged_waits_for_the_save(store, tmp_path, request):
    """torch asks a script to end with destroy_process_group(), which shuts down every group,
    ckptturbo's too: it waits for the saves in flight first."""
    run, options = _run_url(store, tmp_path, request)
    output = _save_and_exit(f"{run}/step-7", 7, options, 2, tmp_path / "logs", end="destroy")
    assert output.count("the group was destroyed after the save was durable") == 2, output
    _loads_bit_exact(f"{run}/step-7", 7, options)


def test_a_save_under_a_group_destroyed_unwaited_is_reported_as_it_ended(slow_s3, tmp_path):
    """A module that bound torch's own destroy_process_group before ckptturbo was imported
    does not wait, and the save (still uploading to the slow store) goes on under groups torch
    has shut down and forgotten. Whether it commits depends on torch (gloo's groups keep
    working here; NCCL's are aborted): either way what stderr says is what happened."""
    run, options = slow_s3
    url = f"{run}/step-1"
    output = _save_and_exit(url, 1, options, 2, tmp_path / "logs", end="torch-destroy")
    if ct.exists(url, storage_options=options):
        assert "ckptturbo: the save" not in output, output
        _loads_bit_exact(url, 1, options)
    else:
        assert output.count(f"ckptturbo: the save to {url} failed and is not committed: the "
                            "process group was destroyed (destroy_process_group) while saving"
                            ) == 2, output


def test_a_save_failing_at_exit_is_reported_on_stderr(s3_server, tmp_path):
    url = "s3://no-such-bucket-for-ckptturbo/run/step-1"  # staging succeeds, the upload cannot
    output = _save_and_exit(url, 1, s3_server.storage_options, 1, tmp_path / "logs")
    assert f"ckptturbo: the save to {url} failed and is not committed" in output
    assert "no-such-bucket-for-ckptturbo does not exist" in output


@pytest.fixture
def slow_s3(s3_server):
    """SeaweedFS behind 0.2 s per request: a save stays in flight for a few seconds."""
    with FaultProxy(s3_server.endpoint, latency_s=0.2) as proxy:
        yield s3_server.url(), proxy.storage_options(s3_server.storage_options)


def test_loads_and_listings_in_the_process_see_a_save_in_flight(slow_s3):
    run, opts = slow_s3
    url = f"{run}/step-1"
    sd = {"w": torch.randn(1000), "step": 1}
    handle = ct.save(sd, url, storage_options=opts)
    handle.staged.result(timeout=60)
    assert not handle.done()  # the slow store keeps it in flight
    pending = ct.list_checkpoints(run, storage_options=opts, wait=False)
    assert [(c.name, c.pending) for c in pending] == [("step-1", True)]
    assert [c.name for c in ct.list_checkpoints(run, storage_options=opts)] == ["step-1"]
    assert handle.done() and handle.durable.exception() is None
    handle = ct.save({**sd, "step": 2}, f"{run}/step-2", storage_options=opts)
    handle.staged.result(timeout=60)
    with ct.Session() as other:  # another session of the process sees it as well
        assert other.exists(f"{run}/step-2", storage_options=opts)
        assert other.load_state_dict(f"{run}/step-2", storage_options=opts)["step"] == 2


def test_deleting_a_save_in_flight_waits_for_it_so_it_cannot_come_back(slow_s3):
    run, opts = slow_s3
    url = f"{run}/step-1"
    handle = ct.save({"w": torch.randn(1000)}, url, storage_options=opts)
    handle.staged.result(timeout=60)
    ct.delete(url, storage_options=opts)
    assert handle.done() and handle.durable.exception() is None
    assert not ct.exists(url, storage_options=opts)
    assert ct.list_checkpoints(run, storage_options=opts) == []
    with pytest.raises(ct.CheckpointNotFound):
        ct.delete(url, storage_options=opts)


def test_deleting_on_local_disk_leaves_no_empty_checkpoint_directory(tmp_path):
    url = tmp_path / "run" / "epoch=0.ckpt"
    ct.save({"w": torch.ones(10)}, url).staged.result(timeout=60)
    ct.delete(url)
    assert not url.exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".ckptturbo"]


def _ckptturbo_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())


def test_a_closed_session_leaves_no_thread_and_stays_usable(tmp_path, s3_server):
    before = set(threading.enumerate())
    sd = {"w": torch.randn(4096), "step": 3}
    session = ct.Session()
    with session:
        session.save(sd, tmp_path / "run" / "a").staged.result(timeout=60)
        session.save(sd, f"{s3_server.url()}/a", storage_options=s3_server.storage_options)
        assert session.load_state_dict(tmp_path / "run" / "a")["step"] == 3
        assert _ckptturbo_threads(before)  # I/O threads while it works
    assert _ckptturbo_threads(before) == []
    session.save(sd, tmp_path / "run" / "b").wait(timeout=60)  # usable again
    session.close()
    assert _ckptturbo_threads(before) == []
    assert ct.load_state_dict(tmp_path / "run" / "b")["step"] == 3


def test_what_cannot_be_saved_is_an_exception_that_names_it(tmp_path):
    url = str(tmp_path / "run" / "a")
    handle = ct.save({"w": torch.ones(3), "lock": threading.Lock()}, url)
    with pytest.raises(ct.UnsupportedStateError, match=r"'lock'.*cannot be serialised") as info:
        handle.staged.result(timeout=60)
    assert isinstance(info.value, Exception) and info.value.__cause__ is not None
    handle = ct.save({"w": torch.empty(3, device="meta")}, url)
    with pytest.raises(ct.UnsupportedStateError, match=r"'w'.*meta tensor"):
        handle.wait(timeout=60)
    assert not ct.exists(url)
    with pytest.raises(ct.CkptTurboError, match="replica_check"):
        ct.save({"w": torch.ones(3)}, url, replica_check="bogus")
    with pytest.raises(ct.CkptTurboError, match="no_such_option"):
        ct.load({"w": torch.ones(3)}, url, no_such_option=1)
