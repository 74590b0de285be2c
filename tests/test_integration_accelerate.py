"""Accelerate adapter: 2 real CPU processes under torchrun (gloo), local disk and SeaweedFS."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from ckptturbo import catalog  # noqa: E402
from ckptturbo.testing.launcher import run_command  # noqa: E402

SCRIPT = Path(__file__).parent / "integration_scripts" / "accelerate_ddp.py"


def run_two_ranks(tmp_path: Path, url: str, storage_options: dict | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(SCRIPT), "--url", url, "--out", str(tmp_path / "obs")]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    code, output = run_command(cmd, cwd=tmp_path, timeout=150)
    assert code == 0, f"accelerate run {'timed out' if code is None else 'failed'}:\n{output[-4000:]}"
    return [torch.load(tmp_path / f"obs.rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_restored(observed: list[dict]) -> None:
    for rank, obs in enumerate(observed):
        saved, loaded = obs["saved"], obs["loaded"]
        for k in saved["model"]:
            assert torch.equal(saved["model"][k], loaded["model"][k]), (rank, k)
        s, l = saved["optim"], loaded["optim"]
        assert s["state"].keys() == l["state"].keys() and len(s["state"]) == 4
        for i in s["state"]:
            for k in s["state"][i]:
                assert torch.equal(s["state"][i][k], l["state"][i][k]), (rank, i, k)
        assert s["param_groups"] == l["param_groups"]
        for key in ("sched", "counter", "step", "py_rng", "np_rng"):
            assert saved[key] == loaded[key], (rank, key)
        assert torch.equal(saved["torch_rng"], loaded["torch_rng"]), rank
    # each rank got its own RNG streams back, not rank 0's
    assert observed[0]["loaded"]["py_rng"] != observed[1]["loaded"]["py_rng"]


def test_save_load_local(tmp_path):
    url = str(tmp_path / "run" / "step-3")
    assert_restored(run_two_ranks(tmp_path, url))
    assert [c.name for c in catalog.list_checkpoints(str(tmp_path / "run"))] == ["step-3"]


def test_save_load_s3(tmp_path, s3_server):
    run = s3_server.url("accelerate")
    assert_restored(run_two_ranks(tmp_path, f"{run}/step-3", s3_server.storage_options))
    assert [c.name for c in catalog.list_checkpoints(run, s3_server.storage_options)] == ["step-3"]
