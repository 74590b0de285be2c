"""Ray Train with the real engine: a 2-worker TorchTrainer (gloo) on a local Ray instance,
checkpointing through ckptturbo.integrations.ray_train into the embedded SeaweedFS.

One run trains without interruption; a second is killed after a checkpoint (a worker
process exits), Ray restarts the workers, they restore from the latest checkpoint with a
grouped load, and the run must end in exactly the first run's state.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

ray = pytest.importorskip("ray")
pyarrow_fs = pytest.importorskip("pyarrow.fs")

import fsspec  # noqa: E402

from ckptturbo.integrations import ray_train as rt  # noqa: E402
from ckptturbo.manifest import Manifest  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS, EVERY, KEEP = 10, 2, 2


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    # the controller collects reports (and deletes checkpoints past num_to_keep) when it
    # polls the workers, every 2 s by default: longer than this short run's save interval
    env = {"PYTHONPATH": TESTS, "RAY_AUTH_MODE": "disabled",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": env})
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _arrow_fs(server):
    host = server.endpoint.split("://", 1)[1]
    return pyarrow_fs.S3FileSystem(access_key=server.key, secret_key=server.secret,
                                   endpoint_override=host, scheme="http", region="us-east-1")


def _fit(server, prefix: str, name: str, out: str, kill_at: int | None = None,
         tiers: dict | None = None):
    from integration_ray_workload import train_fn
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.makedirs(out, exist_ok=True)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"out": out, "storage_options": server.storage_options,
                           "steps": STEPS, "every": EVERY, "kill_at": kill_at,
                           "step_s": 0.5, "tiers": tiers},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=prefix, storage_filesystem=_arrow_fs(server),
                             checkpoint_config=CheckpointConfig(num_to_keep=KEEP),
                             failure_config=FailureConfig(max_failures=1 if kill_at else 0)))
    return trainer.fit()


def _saves(out: str) -> list[dict]:
    rows = []
    for rank in (0, 1):
        with open(os.path.join(out, f"saves-rank{rank}.jsonl")) as f:
            rows += [dict(json.loads(line), rank=rank) for line in f]
    return rows


def _manifest(fs, url: str) -> Manifest:
    with fs.open(f"{url}/manifest.json", "rb") as f:
        return Manifest.from_bytes(f.read(), url)


def _chunk_objects(fs, run: str) -> dict[str, int]:
    found = fs.find(f"{run}/.ckptturbo/chunks", detail=True)
    return {p.rsplit("/", 1)[-1]: info["size"] for p, info in found.items()}


def test_train_kill_restore_dedup_and_gc(s3_server, local_ray, tmp_path):
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    prefix = s3_server.url("ray").removeprefix("s3://")

    # --- a run that never stops
    out_a = str(tmp_path / "a")
    result_a = _fit(s3_server, prefix, "steady", out_a)
    assert result_a.error is None
    run_a = f"s3://{prefix}/steady"
    saves = _saves(out_a)
    assert sorted({r["step"] for r in saves}) == list(range(EVERY, STEPS + 1, EVERY))

    # Ray kept the last KEEP checkpoints; the others are gone (manifest and all)
    reported = rt.checkpoint_url(result_a.checkpoint)
    last_url = saves[-1]["url"]
    assert reported == last_url
    committed = [u for u in sorted({r["url"] for r in saves}) if fs.exists(f"{u}/manifest.json")]
    assert len(committed) == KEEP and last_url in committed

    # every unique byte of a checkpoint went to storage once across the two workers:
    # written by one of them (or found already stored), never by both
    for url in committed:
        manifest = _manifest(fs, url)
        unique = sum(manifest.chunks.values())
        rows = [r for r in saves if r["url"] == url]
        assert len(rows) == 2
        assert sum(r["bytes_written"] + r["bytes_reused"] for r in rows) == unique, url
        assert manifest.stats["bytes_written"] + manifest.stats["bytes_reused"] == unique
    first = [r for r in saves if r["step"] == EVERY]
    # the 2 workers' states are replicas: one copy is written (what the tensors add to it
    # is the scalars and the pickled param_groups; a second copy would double the sum)
    tensors = _tensor_bytes()
    assert tensors <= sum(r["bytes_written"] for r in first) < 1.05 * tensors

    # chunks of deleted checkpoints were freed during the run (rank 0 collects after each
    # durable save), and a final gc leaves exactly the chunks the kept checkpoints name
    written_chunks = sum(r["chunks_written"] for r in saves)
    before = _chunk_objects(fs, run_a)
    assert len(before) < written_chunks
    rt.collect_garbage(run_a, s3_server.storage_options)
    after = _chunk_objects(fs, run_a)
    kept = {}
    for url in committed:
        kept.update(_manifest(fs, url).chunks)
    assert after == kept

    # --- a run killed after the checkpoint of step 4, restored by Ray
    out_b = str(tmp_path / "b")
    result_b = _fit(s3_server, prefix, "killed", out_b, kill_at=5)
    assert result_b.error is None
    assert os.path.exists(os.path.join(out_b, "killed"))
    for rank in (0, 1):
        with open(os.path.join(out_b, f"restored-rank{rank}.json")) as f:
            restored = json.load(f)
        assert restored["step"] == 4
        assert restored["url"].startswith(f"s3://{prefix}/killed/checkpoint_")
    final_a = torch.load(os.path.join(out_a, "final-model.pt"))
    assert_same_model(final_a, torch.load(os.path.join(out_b, "final-model.pt")))

    # --- a tiered run (every second save persisted) killed after the checkpoint of step 6,
    # which is only in host memory: Ray's latest is step 4, the tiers restore step 6
    out_c = str(tmp_path / "c")
    tiers = {"memory": str(tmp_path / "mem"), "persist_every": 2, "node": "n0"}
    result_c = _fit(s3_server, prefix, "tiered", out_c, kill_at=7, tiers=tiers)
    assert result_c.error is None
    for rank in (0, 1):
        with open(os.path.join(out_c, f"restored-rank{rank}.json")) as f:
            restored = json.load(f)
        assert restored["step"] == 6
        assert restored["url"].startswith(f"s3://{prefix}/tiered/checkpoint_")
        assert not fs.exists(f"{restored['url']}/manifest.json")  # it never reached the bucket
    assert fs.exists(f"{rt.checkpoint_url(result_c.checkpoint)}/manifest.json")  # Ray's are durable
    assert_same_model(final_a, torch.load(os.path.join(out_c, "final-model.pt")))


def assert_same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _tensor_bytes() -> int:
    """Bytes of one worker's parameters and Adam moments (the scalars come on top)."""
    from integration_ray_workload import _model

    return 3 * sum(p.numel() * p.element_size() for p in _model().parameters())
