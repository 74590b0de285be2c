"""Accelerate adapter: its ``save_state``/``load_state`` keep ``Accelerator.save_state``/
``load_state``'s contract. In this process (one Accelerator, CPU) for hooks, counters and
errors; 2 real CPU processes under torchrun (gloo) for the distributed save and load, on
local disk and SeaweedFS."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo import catalog  # noqa: E402
from ckptturbo.integrations.accelerate import load_state, save_state  # noqa: E402
from ckptturbo.testing.launcher import run_command  # noqa: E402

SCRIPT = Path(__file__).parent / "integration_scripts" / "accelerate_ddp.py"
sys.path.insert(0, str(SCRIPT.parent))
from accelerate_ddp import Counter  # noqa: E402  the object the script registers


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    yield acc
    # the Accelerator's state is process-wide; the next test (or Trainer) starts afresh
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def prepared(acc: Accelerator, seed: int = 0, out: int = 4):
    """The script's model, optimizer, scheduler and registered counter (same shapes)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, out))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(2):
        acc.backward(model(torch.randn(8, 16)).square().mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return model, opt, sched, counter


def weights(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hooks_iteration_step_and_registered_objects(tmp_path, accelerator):
    """What Accelerator.save_state/load_state do beyond tensors: pre-hooks (a save hook may
    take a model's weights out, a load hook the model), save_iteration, step, custom objects."""
    url = str(tmp_path / "run" / "step-7")
    model, opt, sched, counter = prepared(accelerator)
    side = accelerator.prepare(torch.nn.Linear(3, 3))  # a second model that hooks save themselves
    calls = []

    def save_hook(models, weights_list, output_dir):
        calls.append(("save", len(models), len(weights_list), output_dir))
        weights_list.pop()  # "saved it myself"

    def load_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))
        models.pop()

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    counter.n, accelerator.step = 5, 7
    saved, saved_side = weights(model), weights(side)
    saved_opt, saved_sched = opt.optimizer.state_dict(), sched.state_dict()
    assert accelerator.save_iteration == 0
    save_state(accelerator, url).wait()
    assert accelerator.save_iteration == 1
    assert len(ct.load_state_dict(url)["models"]) == 1  # the hook kept the side model out

    with torch.no_grad():
        for p in [*model.parameters(), *side.parameters()]:
            p.add_(1.0)
    counter.n, accelerator.step = 0, 0
    sched.step()
    load_state(accelerator, url)
    assert calls == [("save", 2, 2, url), ("load", 2, url)]
    for k, v in weights(model).items():
        assert torch.equal(v, saved[k]), k
    assert not torch.equal(side.weight, saved_side["weight"])  # the hook's model: not loaded here
    assert opt.optimizer.state_dict()["state"].keys() == saved_opt["state"].keys()
    assert sched.state_dict() == saved_sched
    assert (counter.n, accelerator.step) == (5, 7)


def test_errors_name_the_url_and_the_cause(tmp_path, accelerator):
    url = str(tmp_path / "run" / "step-1")
    model, opt, sched, counter = prepared(accelerator)
    with pytest.raises(ct.CheckpointNotFound, match="step-1"):
        load_state(accelerator, url)
    save_state(accelerator, url).wait()

    extra = Counter()
    accelerator.register_for_checkpointing(extra)  # one more than the checkpoint holds
    with pytest.raises(ct.MismatchError, match=r"step-1 holds 1 objects registered.*has 2"):
        load_state(accelerator, url)
    accelerator._custom_objects.remove(extra)

    def broken() -> dict:
        raise RuntimeError("cannot export")

    counter.state_dict = broken
    with pytest.raises(ct.CkptTurboError, match="step-2.*cannot export") as err:
        save_state(accelerator, str(tmp_path / "run" / "step-2"))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert [c.name for c in catalog.list_checkpoints(str(tmp_path / "run"))] == ["step-1"]


def test_a_model_that_does_not_fit_names_url_and_tensor(tmp_path, accelerator):
    url = str(tmp_path / "run" / "step-1")
    prepared(accelerator)
    save_state(accelerator, url).wait()
    accelerator._models.clear()
    accelerator._optimizers.clear()
    accelerator._schedulers.clear()
    accelerator._custom_objects.clear()
    prepared(accelerator, out=5)  # other output size
    with pytest.raises(ct.MismatchError, match="step-1") as err:  # before any byte is read
        load_state(accelerator, url)
    assert "'models.0.2.bias': shape (5,) in the template, (4,) in the checkpoint" in str(err.value)


def run_two_ranks(tmp_path: Path, url: str, storage_options: dict | None = None,
                  single: str | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "--log-dir", str(tmp_path / "logs"), str(SCRIPT), "--url", url,
           "--out", str(tmp_path / "obs")]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    if single:
        cmd += ["--single", single]
    code, output = run_command(cmd, cwd=tmp_path, timeout=150)
    outcome = "timed out" if code is None else "failed"
    assert code == 0, f"accelerate run {outcome}:\n{output[-4000:]}"
    return [torch.load(tmp_path / f"obs.rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_restored(observed: list[dict]) -> None:
    for rank, obs in enumerate(observed):
        saved, loaded = obs["saved"], obs["loaded"]
        for k in saved["model"]:
            assert torch.equal(saved["model"][k], loaded["model"][k]), (rank, k)
        s, ld = saved["optim"], loaded["optim"]
        assert s["state"].keys() == ld["state"].keys() and len(s["state"]) == 4
        for i in s["state"]:
            for k in s["state"][i]:
                assert torch.equal(s["state"][i][k], ld["state"][i][k]), (rank, i, k)
        assert s["param_groups"] == ld["param_groups"]
        for key in ("sched", "counter", "step", "py_rng", "np_rng"):
            assert saved[key] == loaded[key], (rank, key)
        assert torch.equal(saved["torch_rng"], loaded["torch_rng"]), rank
    # each rank got its own RNG streams back, not rank 0's
    assert observed[0]["loaded"]["py_rng"] != observed[1]["loaded"]["py_rng"]


def test_save_load_local(tmp_path, accelerator):
    """Two processes; they also load a checkpoint one process saved (as Accelerate, the
    process without saved RNG states keeps its own and still gets the model and step)."""
    single = str(tmp_path / "single" / "step-9")
    model, _, _, _ = prepared(accelerator, seed=3)
    accelerator.step = 9
    random.seed(0)
    save_state(accelerator, single).wait()
    url = str(tmp_path / "run" / "step-3")
    observed = run_two_ranks(tmp_path, url, single=single)
    assert_restored(observed)
    assert [c.name for c in catalog.list_checkpoints(str(tmp_path / "run"))] == ["step-3"]
    for rank, obs in enumerate(observed):
        assert obs["single"]["step"] == 9
        for k, v in weights(model).items():
            assert torch.equal(obs["single"]["model"][k], v), (rank, k)
    assert [obs["single"]["rng_kept"] for obs in observed] == [False, True]


def test_save_load_s3(tmp_path, s3_server):
    run = s3_server.url("accelerate")
    assert_restored(run_two_ranks(tmp_path, f"{run}/step-3", s3_server.storage_options))
    assert [c.name for c in catalog.list_checkpoints(run, s3_server.storage_options)] == ["step-3"]


def test_tiered_save_state_lands_in_host_memory_and_loads_from_it(tmp_path, accelerator, s3_server):
    """``tiers=`` passes through: a save_state that is not persisted is in the memory tier
    only, and load_state with the same tiers restores it from there."""
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")
    url = s3_server.url("accelerate-tiers") + "/step-1"
    opts = s3_server.storage_options
    model, _, _, counter = prepared(accelerator, seed=5)
    saved, counter.n = weights(model), 7
    handle = save_state(accelerator, url, storage_options=opts, tiers=tiers)
    assert isinstance(handle, ct.TieredSaveHandle)
    assert handle.wait() is None and not handle.persisted
    assert not ct.exists(url, storage_options=opts)  # memory only: never reported durable
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    counter.n = 0
    load_state(accelerator, url, storage_options=opts, tiers=tiers)
    assert all(torch.equal(v, weights(model)[k]) for k, v in saved.items())
    assert counter.n == 7
