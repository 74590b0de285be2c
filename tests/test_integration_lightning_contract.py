"""TurboCheckpointIO keeps the contract of Lightning's TorchCheckpointIO / AsyncCheckpointIO.

Real Lightning Trainers, real files and SeaweedFS; the DDP side is in test_integration_lightning.py.
"""
from __future__ import annotations

import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import AsyncCheckpointIO  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo import catalog  # noqa: E402
from ckptturbo.integrations.lightning import TurboCheckpointIO, load_from_checkpoint  # noqa: E402
from tests.integration_scripts.lightning_ddp import Tiny, data  # noqa: E402

STEPS_PER_EPOCH = 8  # data(): 64 samples, batch size 8


class Ballasted(Tiny):
    """Tiny plus 16 MiB of state, so that a save is still in flight when the next call comes."""

    def __init__(self, width: int = 32) -> None:
        super().__init__(width)
        self.register_buffer("ballast", torch.randn(4 << 20))


class NotATensor:
    """An object torch's weights_only unpickler refuses."""

    def __init__(self, value: int) -> None:
        self.value = value


def make_trainer(root: Path, plugin=None, *, epochs: int = 1, callbacks=(),
                 checkpointing: bool = True) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, default_root_dir=root,
                      plugins=[plugin] if plugin is not None else None, callbacks=list(callbacks),
                      enable_checkpointing=checkpointing, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)


def new_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_remove_of_missing_or_uncommitted_checkpoint_is_a_no_op(tmp_path):
    run = tmp_path / "run"
    io = TurboCheckpointIO()
    io.remove_checkpoint(run / "never-saved.ckpt")  # TorchCheckpointIO ignores it too
    (run / "killed.ckpt").mkdir(parents=True)  # a save whose process died before the commit
    io.remove_checkpoint(run / "killed.ckpt")
    io.teardown()
    assert list(run.glob("*.ckpt")) == []


def test_remove_during_save_waits_for_it_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    saver, remover = TurboCheckpointIO(), TurboCheckpointIO()
    for io in (saver, remover):  # the saving plugin itself, and another one in the process
        saver.save_checkpoint({"state_dict": {"w": torch.randn(4 << 20)}}, run / "a.ckpt")
        io.remove_checkpoint(run / "a.ckpt")
        saver.teardown()
        assert not ct.exists(str(run / "a.ckpt")), (
            "the save in flight resurrected a removed checkpoint")
        assert list(run.glob("*.ckpt")) == []
    remover.teardown()


def test_fit_with_top_k_leaves_only_the_kept_checkpoint(tmp_path):
    run = tmp_path / "run"
    ckpt = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="epoch_metric", mode="max")
    make_trainer(tmp_path, TurboCheckpointIO(), epochs=3, callbacks=[ckpt]).fit(Tiny(), data())
    kept = f"epoch=2-step={3 * STEPS_PER_EPOCH}.ckpt"
    assert [p.name for p in run.glob("*.ckpt")] == [kept]
    assert [c.name for c in catalog.list_checkpoints(str(run))] == [kept]


def test_plain_torch_checkpoint_resumes_and_is_removed(tmp_path):
    """A run that switches to the plugin midway resumes from TorchCheckpointIO's file."""
    run = tmp_path / "run"
    plain = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="epoch_metric", mode="max")
    make_trainer(tmp_path, epochs=1, callbacks=[plain]).fit(Tiny(), data())
    plain_file = run / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    assert plain_file.is_file()
    io = TurboCheckpointIO()
    turbo = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="epoch_metric", mode="max")
    trainer = make_trainer(tmp_path, io, epochs=2, callbacks=[turbo])
    trainer.fit(Tiny(), data(), ckpt_path=plain_file)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH  # resumed after epoch 0, trained epoch 1 only
    new = run / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    assert ct.exists(str(new))
    io.remove_checkpoint(plain_file)
    io.remove_checkpoint(new)
    io.teardown()
    assert list(run.glob("*.ckpt")) == []


def test_plain_torch_file_keeps_weights_only_semantics(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "extra": NotATensor(7)}, path)
    io = TurboCheckpointIO()
    with pytest.raises(ct.CkptTurboError) as caught:
        io.load_checkpoint(path, weights_only=True)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)
    loaded = io.load_checkpoint(path, weights_only=False)
    assert loaded["extra"].value == 7 and torch.equal(loaded["state_dict"]["w"], torch.ones(3))
    io.teardown()


def test_only_ckptturbo_errors_leave_the_plugin(tmp_path):
    io = TurboCheckpointIO()
    with pytest.raises(ct.CheckpointNotFound):
        io.load_checkpoint(tmp_path / "run" / "missing.ckpt")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"neither a torch file nor a ckptturbo checkpoint")
    with pytest.raises(ct.CkptTurboError) as caught:
        io.load_checkpoint(garbage)
    assert caught.value.__cause__ is not None and str(garbage) in str(caught.value)
    with pytest.raises(ct.CkptTurboError) as caught:
        io.save_checkpoint({"state_dict": {}}, tmp_path / "run" / "x.ckpt",
                           storage_options="not a mapping")
    assert isinstance(caught.value.__cause__, TypeError)
    assert "storage_options must be a mapping of fsspec options" in str(caught.value)
    assert not (tmp_path / "run" / "x.ckpt").exists()  # refused before anything is made
    io.teardown()


def test_missing_checkpoint_message_and_no_thread_left_by_a_load(tmp_path):
    """As TorchCheckpointIO: a FileNotFoundError "Checkpoint file not found: <path>" (Lightning's
    tests match it); and a load without teardown (the checkpoint connector's resume_start) leaves
    no thread of the plugin running."""
    path = tmp_path / "run" / "a.ckpt"
    saver = TurboCheckpointIO()
    saver.save_checkpoint({"state_dict": {"w": torch.randn(8)}, "epoch": 3,
                           "pytorch-lightning_version": pl.__version__}, path)
    saver.teardown()
    before = set(threading.enumerate())
    io = TurboCheckpointIO()
    missing = f"Checkpoint file not found: {tmp_path / 'missing.ckpt'}"
    with pytest.raises(FileNotFoundError, match=missing):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    assert io.load_checkpoint(path)["epoch"] == 3
    assert new_threads(before) == []
    trainer = make_trainer(tmp_path, TurboCheckpointIO())
    trainer.strategy.connect(Tiny())
    trainer._checkpoint_connector.resume_start(path)  # loads; no teardown follows
    assert trainer._checkpoint_connector._loaded_checkpoint["epoch"] == 3
    assert new_threads(before) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_load_from_checkpoint_helper(tmp_path, where, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        url, opts = s3.url("lightning-lfc") + "/final.ckpt", s3.storage_options
    else:
        url, opts = str(tmp_path / "run" / "final.ckpt"), None
    model = Tiny(width=24)
    trainer = make_trainer(tmp_path, TurboCheckpointIO(opts), checkpointing=False)
    trainer.fit(model, data())
    trainer.save_checkpoint(url)
    trainer.strategy.checkpoint_io.teardown()
    restored = load_from_checkpoint(Tiny, url, storage_options=opts)
    assert isinstance(restored, Tiny) and restored.hparams.width == 24
    assert_same_weights(model, restored)


def test_model_checkpoint_sees_a_just_saved_name(tmp_path):
    """ModelCheckpoint's collision check (its own fs.exists) must see a save still in flight."""
    run = tmp_path / "run"
    ckpt = ModelCheckpoint(dirpath=run, filename="fixed", save_top_k=-1, monitor="step", mode="max",
                           every_n_train_steps=1)
    make_trainer(tmp_path, TurboCheckpointIO(), callbacks=[ckpt]).fit(Ballasted(), data())
    names = sorted(c.name for c in catalog.list_checkpoints(str(run)))
    expected = sorted(["fixed.ckpt"] + [f"fixed-v{i}.ckpt" for i in range(1, STEPS_PER_EPOCH)])
    assert names == expected, "a save overwrote an earlier checkpoint of the same name"


def test_second_trainer_loads_what_the_first_just_saved(tmp_path):
    path = tmp_path / "run" / "now.ckpt"
    model = Ballasted()
    first = make_trainer(tmp_path, TurboCheckpointIO(), checkpointing=False)
    first.fit(model, data())
    first.save_checkpoint(path)  # returns once staged; the upload goes on
    second = make_trainer(tmp_path, TurboCheckpointIO(), checkpointing=False)
    resumed = Ballasted()
    # already at max_epochs: restores, trains no further
    second.fit(resumed, data(), ckpt_path=path)
    assert second.global_step == STEPS_PER_EPOCH
    assert_same_weights(model, resumed)
    first.strategy.checkpoint_io.teardown()


def test_hpc_resume_picks_the_newest_hpc_checkpoint(tmp_path):
    """Lightning numbers hpc_ckpt_N by listing default_root_dir and resumes the highest N."""
    model = Ballasted()
    trainer = make_trainer(tmp_path, TurboCheckpointIO(), checkpointing=False)
    trainer.fit(model, data())
    for _ in range(12):
        with torch.no_grad():
            model.net[0].weight.add_(1.0)
        # as SIGUSR1 does
        trainer.save_checkpoint(trainer._checkpoint_connector.hpc_save_path(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("hpc_ckpt_*")) == sorted(
        f"hpc_ckpt_{n}.ckpt" for n in range(1, 13))
    resumed = Ballasted()
    resuming = make_trainer(tmp_path, TurboCheckpointIO(), checkpointing=False)
    resuming.fit(resumed, data(), ckpt_path="hpc")
    assert_same_weights(model, resumed)
    trainer.strategy.checkpoint_io.teardown()


def test_async_checkpoint_io_with_top_k_trains_to_the_end(tmp_path):
    """Lightning's AsyncCheckpointIO removes old checkpoints while their saves may be in flight."""
    run = tmp_path / "run"
    before = set(threading.enumerate())
    ckpt = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="step", mode="max",
                           every_n_train_steps=1)
    inner = TurboCheckpointIO()
    trainer = make_trainer(tmp_path, AsyncCheckpointIO(inner), epochs=2, callbacks=[ckpt])
    trainer.fit(Ballasted(), data())
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    kept = catalog.list_checkpoints(str(run))
    assert ckpt.best_model_path.endswith(f"step={2 * STEPS_PER_EPOCH}.ckpt")
    assert Path(ckpt.best_model_path).name in [c.name for c in kept]
    assert sorted(p.name for p in run.glob("*.ckpt")) == sorted(c.name for c in kept)
    # AsyncCheckpointIO.teardown does not call the wrapped plugin's: its own does the rest
    inner.teardown()
    assert new_threads(before) == []


def test_fit_leaves_no_thread_and_the_plugin_is_reusable(tmp_path):
    before = set(threading.enumerate())
    io = TurboCheckpointIO()
    for epochs in (1, 2):  # a second fit after teardown starts the plugin's session again
        run = tmp_path / f"run{epochs}"
        ckpt = ModelCheckpoint(dirpath=run, save_top_k=1, monitor="epoch_metric", mode="max")
        make_trainer(tmp_path, io, epochs=epochs, callbacks=[ckpt]).fit(Tiny(), data())
        assert new_threads(before) == []
        assert [c.name for c in catalog.list_checkpoints(str(run))] == [
            f"epoch={epochs - 1}-step={epochs * STEPS_PER_EPOCH}.ckpt"]


class WeightsPerEpoch(pl.Callback):
    """The module's weights at the end of each training epoch, as a checkpoint then holds them."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.weights[trainer.current_epoch] = {k: v.clone() for k, v in module.state_dict().items()}


def assert_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = module.state_dict()
    assert got.keys() == expected.keys()
    for key in got:
        assert torch.equal(got[key], expected[key]), key


def test_tiers_persist_every_nth_and_resume_from_memory_or_the_path(tmp_path):
    """TurboCheckpointIO(tiers=...): every checkpoint commits to host memory, every second one
    reaches its path too. A new Trainer resumes from either kind by its path; once the
    memory is lost (the node rebooted) the persisted ones still load and the others are
    not found; removing a checkpoint removes it from both places."""
    run, mem = tmp_path / "run", tmp_path / "mem"
    tiers = ct.Tiers(memory=str(mem), persist_every=2, node="n0")
    with pytest.raises(ct.CkptTurboError, match="store='checkpoint' cannot be combined"):
        TurboCheckpointIO(tiers=tiers, store="checkpoint")  # a tier's chunks are its run's
    seen = WeightsPerEpoch()
    every_epoch = ModelCheckpoint(dirpath=run, save_top_k=-1)
    make_trainer(tmp_path, TurboCheckpointIO(tiers=tiers), epochs=4,
                 callbacks=[every_epoch, seen]).fit(Tiny(), data())
    names = [f"epoch={e}-step={(e + 1) * STEPS_PER_EPOCH}.ckpt" for e in range(4)]
    listed = ct.list_checkpoints(str(run), tiers=tiers)
    assert [(c.name, c.tiers) for c in listed] == [
        (n, ("memory",) if e % 2 == 0 else ("memory", "durable")) for e, n in enumerate(names)]
    # the path holds these
    assert [c.name for c in catalog.list_checkpoints(str(run))] == names[1::2]

    for epoch in (2, 3):  # memory only; both
        resumed = Tiny()
        trainer = make_trainer(tmp_path, TurboCheckpointIO(tiers=tiers), epochs=epoch + 1,
                               checkpointing=False)
        trainer.fit(resumed, data(), ckpt_path=run / names[epoch])  # restores, trains no further
        assert trainer.global_step == (epoch + 1) * STEPS_PER_EPOCH
        assert_weights(resumed, seen.weights[epoch])

    io = TurboCheckpointIO(tiers=tiers)
    io.remove_checkpoint(run / names[1])
    listed = ct.list_checkpoints(str(run), tiers=tiers)
    assert [c.name for c in listed] == [names[0], names[2], names[3]]
    assert not (run / names[1]).exists()
    shutil.rmtree(mem)  # the node's memory is lost: what was only there is gone
    with pytest.raises(ct.CheckpointNotFound, match="Checkpoint file not found"):
        io.load_checkpoint(run / names[2])
    state = io.load_checkpoint(run / names[3])["state_dict"]
    assert all(torch.equal(state[k], v) for k, v in seen.weights[3].items())
    io.teardown()
