"""Lightning with TurboCheckpointIO: real Trainer, real DDP processes (gloo), real SeaweedFS."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import ckptturbo as ct  # noqa: E402
from ckptturbo import catalog  # noqa: E402
from ckptturbo.integrations.lightning import TurboCheckpointIO  # noqa: E402
from ckptturbo.testing.launcher import run_command  # noqa: E402
from tests.training_state import assert_same_model_and_optimizer  # noqa: E402

SCRIPT = Path(__file__).parent / "integration_scripts" / "lightning_ddp.py"


def run_ddp(tmp_path: Path, dirpath: str, out: Path, *, epochs: int, top_k: int,
            resume: str | None = None, s3=None) -> None:
    """Lightning's own DDP launcher starts rank 1; the whole run is bounded and cleaned up."""
    cmd = [sys.executable, str(SCRIPT), "--dirpath", dirpath, "--out", str(out),
           "--epochs", str(epochs), "--top-k", str(top_k)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if resume:
        cmd += ["--resume", resume]
    if s3 is not None:
        cmd += ["--storage-options", json.dumps(s3.storage_options)]
        # ModelCheckpoint's own fsspec filesystem (exists/isdir on dirpath) reads fsspec's env
        # config.
        env.update(FSSPEC_S3_ENDPOINT_URL=s3.endpoint, FSSPEC_S3_KEY=s3.key,
                   FSSPEC_S3_SECRET=s3.secret)
    code, output = run_command(cmd, cwd=tmp_path, env=env, timeout=240)
    outcome = "timed out" if code is None else "failed"
    assert code == 0, f"Lightning DDP run {outcome}:\n{output[-4000:]}"
    for rank in (0, 1):  # teardown closed the plugin's session on every rank
        left = json.loads(Path(f"{out}.threads{rank}.json").read_text())
        assert not [name for name in left if name.startswith("ckptturbo")], (rank, left)


def assert_same_training_state(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    assert_same_model_and_optimizer(a["model"], b["model"], a["optim"], b["optim"])
    assert a["sched"] == b["sched"]


def test_ddp_fit_top_k_and_resume_identical(tmp_path):
    run = tmp_path / "run"
    run_ddp(tmp_path, str(run), tmp_path / "a.pt", epochs=3, top_k=2)
    kept = [c.name for c in catalog.list_checkpoints(str(run))]
    assert kept == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert sorted(os.listdir(run)) == kept  # removed ones leave nothing; no run store beside them
    # the removed checkpoint's chunks were freed: nothing unreferenced is left
    assert catalog.collect_garbage(str(run), dry_run=True).deleted == 0
    # resume from the epoch-1 checkpoint in a fresh DDP run: same end state as the straight run
    run_ddp(tmp_path, str(tmp_path / "run_b"), tmp_path / "b.pt", epochs=3, top_k=2,
            resume=str(run / "epoch=1-step=8.ckpt"))
    assert_same_training_state(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))


def test_ddp_s3_dirpath_round_trip(tmp_path, s3_server):
    run = s3_server.url("lightning")
    run_ddp(tmp_path, run, tmp_path / "a.pt", epochs=2, top_k=1, s3=s3_server)
    kept = [c.name for c in catalog.list_checkpoints(run, s3_server.storage_options)]
    assert kept == ["epoch=1-step=8.ckpt"]
    assert catalog.collect_garbage(run, s3_server.storage_options, dry_run=True).deleted == 0
    # resuming at max_epochs restores everything and trains no further: state must be exact
    run_ddp(tmp_path, s3_server.url("lightning-b"), tmp_path / "b.pt", epochs=2, top_k=1,
            resume=f"{run}/epoch=1-step=8.ckpt", s3=s3_server)
    assert_same_training_state(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))


def lightning_like_checkpoint() -> dict:
    return {
        "epoch": 3, "global_step": 40, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.0.weight": torch.randn(16, 8), "net.0.bias": torch.randn(16)},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'x'}": {"best_model_score": torch.tensor(0.5),
                                                          "best_k_models": {}}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(40.0),
                                            "exp_avg": torch.ones(16, 8)}},
                              "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999),
                                                "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 3}],
        "hyper_parameters": {"width": 16},
    }


def assert_equal_tree(a, b, path="") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_equal_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_tree(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def test_plugin_round_trip_is_exact_without_template(tmp_path):
    io = TurboCheckpointIO()
    ckpt = lightning_like_checkpoint()
    path = tmp_path / "run" / "epoch=3-step=40.ckpt"
    io.save_checkpoint(ckpt, path)
    io.teardown()
    assert_equal_tree(ckpt, io.load_checkpoint(path))


def test_plugin_with_run_store_dedups_unchanged_tensors_and_frees_removed(tmp_path):
    io = TurboCheckpointIO(store="run", chunk_size=1 << 16, pack_threshold=1 << 12)
    ckpt = lightning_like_checkpoint()
    ckpt["state_dict"]["frozen"] = torch.randn(256, 1024)  # 1 MiB, unchanged between saves
    run = tmp_path / "run"
    io.save_checkpoint(ckpt, run / "a.ckpt")
    ckpt["state_dict"]["net.0.weight"] = torch.randn(16, 8)
    io.save_checkpoint(ckpt, run / "b.ckpt")
    io.teardown()
    a = ct.TurboReader(str(run / "a.ckpt")).read_manifest()
    b = ct.TurboReader(str(run / "b.ckpt")).read_manifest()
    shared = set(a.chunks) & set(b.chunks)
    assert sum(a.chunks[c] for c in shared) >= 1 << 20
    io.remove_checkpoint(run / "a.ckpt")
    io.teardown()
    assert [c.name for c in catalog.list_checkpoints(str(run))] == ["b.ckpt"]
    assert catalog.collect_garbage(str(run), dry_run=True).deleted == 0
    assert_equal_tree(ckpt, io.load_checkpoint(run / "b.ckpt"))


def test_default_save_leaves_only_checkpoints_in_dirpath(tmp_path):
    io = TurboCheckpointIO()
    run = tmp_path / "run"
    for name in ("a.ckpt", "b.ckpt", "last.ckpt", "last.ckpt"):  # last.ckpt is replaced
        io.save_checkpoint(lightning_like_checkpoint(), run / name)
    io.teardown()
    assert sorted(os.listdir(run)) == ["a.ckpt", "b.ckpt", "last.ckpt"]
    # the replaced version's chunks went with the second save of last.ckpt
    assert catalog.collect_garbage(str(run), dry_run=True).deleted == 0


def test_copied_checkpoint_loads_bit_exact_elsewhere(tmp_path):
    io = TurboCheckpointIO()
    ckpt = lightning_like_checkpoint()
    io.save_checkpoint(ckpt, tmp_path / "run" / "best.ckpt")
    io.teardown()
    shutil.copytree(tmp_path / "run" / "best.ckpt", tmp_path / "elsewhere" / "best.ckpt")
    shutil.rmtree(tmp_path / "run")
    assert_equal_tree(ckpt, io.load_checkpoint(tmp_path / "elsewhere" / "best.ckpt"))


def test_remove_of_self_contained_checkpoint_leaves_nothing(tmp_path):
    io = TurboCheckpointIO()
    run = tmp_path / "run"
    io.save_checkpoint(lightning_like_checkpoint(), run / "a.ckpt")
    io.save_checkpoint(lightning_like_checkpoint(), run / "b.ckpt")
    io.remove_checkpoint(run / "a.ckpt")
    io.teardown()
    assert os.listdir(run) == ["b.ckpt"]
    io.remove_checkpoint(run / "b.ckpt")
    assert os.listdir(run) == []


def test_failed_save_surfaces_on_next_save_or_teardown(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run directory should be")
    io = TurboCheckpointIO()
    with pytest.raises(ct.CkptTurboError):
        io.save_checkpoint(lightning_like_checkpoint(), blocker / "x.ckpt")
        io.teardown()


def test_model_parallel_sharded_save_and_resume(tmp_path):
    """FSDP2-sharded ModelParallelStrategy on 2 CPU ranks: each rank saves its shards; resume is
    exact."""
    script = Path(__file__).parent / "integration_scripts" / "lightning_model_parallel.py"

    def run(*argv: str) -> None:
        proc = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=240)
        assert proc.returncode == 0, proc.stdout[-4000:]

    run(str(tmp_path / "a"), "3")
    ckpt = ct.TurboReader(str(tmp_path / "a" / "epoch=1-step=8.ckpt")).read_manifest()
    # saved as shards, not gathered
    assert any(len(item.shards) == 2 for item in ckpt.items.values())
    run(str(tmp_path / "b"), "3", str(tmp_path / "a" / "epoch=1-step=8.ckpt"))
    a = torch.load(tmp_path / "a.final.pt")
    assert_same_tensors(a, torch.load(tmp_path / "b.final.pt"))
    # tiered (turbo_tiers, every second checkpoint persisted): resume from one only in memory
    mem = str(tmp_path / "mem")
    run(str(tmp_path / "c"), "3", "--tiers", mem)
    listed = catalog.list_checkpoints(str(tmp_path / "c"))
    assert [c.name for c in listed] == ["epoch=1-step=8.ckpt"]
    run(str(tmp_path / "d"), "3", str(tmp_path / "c" / "epoch=0-step=4.ckpt"), "--tiers", mem)
    assert_same_tensors(a, torch.load(tmp_path / "d.final.pt"))


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
