"""transformers Trainer with ckptturbo: a tiny GPT-2 built from a config (no downloads).

What is checked is the Trainer's own checkpoint contract: exact resume, ``save_total_limit``
after a resume (decided from storage), ``load_best_model_at_end`` (the same checkpoints
kept and the same final weights as the Trainer with its own checkpoints), resume of the
newest checkpoint in storage, the Trainer's error when there is nothing to resume from,
an output directory that lists only the kept checkpoints, the Trainer's callback list, and
otherwise only ckptturbo errors leaving the adapter.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo import catalog  # noqa: E402
from ckptturbo.integrations.transformers import TurboCheckpointCallback, TurboTrainer  # noqa: E402
from ckptturbo.paths import OWN_STORE  # noqa: E402
from ckptturbo.runs import Location  # noqa: E402
from tests.training_state import assert_same_model_and_optimizer  # noqa: E402

# eval score by global step (lower is better): the best checkpoint is step 4
SCORES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5, 10: 1.5, 12: 2.0}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def make_trainer(out: str, seed: int, cls=TurboTrainer, max_steps: int = 6, best: bool = False,
                 save_steps: int = 2, **turbo) -> Trainer:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2, use_cache=False))
    extra = {}
    if best:
        extra = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                     metric_for_best_model="score", greater_is_better=False,
                     per_device_eval_batch_size=8)
    args = TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=save_steps,
                             save_total_limit=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, seed=0,
                             report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
                             dataloader_num_workers=0, **extra)
    holder: dict = {}
    kwargs = dict(model=model, args=args, train_dataset=Tokens(), callbacks=[StepCounter()])
    if best:  # a score that depends only on the step, so which checkpoint is best is known
        kwargs.update(eval_dataset=Tokens(8),
                      compute_metrics=lambda _: {"score": SCORES[holder["t"].state.global_step]},
                      preprocess_logits_for_metrics=lambda logits, labels: logits[..., :1])
    trainer = holder["t"] = cls(**kwargs, **turbo)
    return trainer


def steps_run(trainer: Trainer) -> list[int]:
    callbacks = trainer.callback_handler.callbacks
    return next(cb for cb in callbacks if isinstance(cb, StepCounter)).steps


def training_state(trainer: Trainer) -> dict:
    return {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optim": trainer.optimizer.state_dict(), "sched": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step}


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 6
    assert_same_model_and_optimizer(a["model"], b["model"], a["optim"], b["optim"])
    assert a["sched"] == b["sched"]


def names(root: str, opts: dict | None = None) -> list[str]:
    return sorted((c.name for c in catalog.list_checkpoints(root, opts)),
                  key=lambda n: int(n.split("-")[1]))


def model_of(url: str, opts: dict | None = None) -> dict:
    return ct.load_state_dict(url, storage_options=opts)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_async_checkpoints_limit_and_exact_resume_local(tmp_path):
    out = str(tmp_path / "out")
    a = make_trainer(out, seed=0)
    a.train()
    assert names(out) == ["checkpoint-4", "checkpoint-6"]  # save_steps=2, save_total_limit=2
    assert catalog.collect_garbage(out, dry_run=True).deleted == 0
    # different init: everything must come from the checkpoint
    b = make_trainer(str(tmp_path / "out_b"), seed=1)
    b.train(resume_from_checkpoint=f"{out}/checkpoint-4")
    assert_same(training_state(a), training_state(b))


def test_limit_holds_after_resume(tmp_path):
    """A resumed Trainer rotates what storage holds, not only what it saved itself."""
    out = str(tmp_path / "out")
    make_trainer(out, seed=0, max_steps=6).train()
    assert names(out) == ["checkpoint-4", "checkpoint-6"]
    b = make_trainer(out, seed=0, max_steps=10)
    b.train(resume_from_checkpoint=True)
    assert steps_run(b) == [7, 8, 9, 10]
    assert names(out) == ["checkpoint-8", "checkpoint-10"]
    assert catalog.collect_garbage(out, dry_run=True).deleted == 0  # chunks of removed ones freed


def test_best_model_and_limit_as_the_trainer_does(tmp_path):
    """Same checkpoints kept and same final (best) weights as the Trainer with its own files."""
    ref = make_trainer(str(tmp_path / "ref"), seed=0, cls=Trainer, max_steps=8, best=True)
    ref.train()
    assert ref.state.best_model_checkpoint == str(tmp_path / "ref" / "checkpoint-4")
    kept_by_hf = sorted(p.name for p in (tmp_path / "ref").glob("checkpoint-*"))

    out = str(tmp_path / "out")
    t = make_trainer(out, seed=0, max_steps=8, best=True)
    t.train()
    # the best survives the limit
    assert names(out) == ["checkpoint-4", "checkpoint-8"] == kept_by_hf
    assert t.state.best_model_checkpoint == f"{out}/checkpoint-4"
    final = {k: v.clone() for k, v in t.model.state_dict().items()}
    # the best one was loaded at the end
    assert_same_weights(final, model_of(f"{out}/checkpoint-4"))
    assert_same_weights(final, dict(ref.model.state_dict()))
    last = model_of(f"{out}/checkpoint-8")
    assert not torch.equal(final["lm_head.weight"], last["lm_head.weight"])


def test_best_model_kept_and_loaded_after_resume_s3(tmp_path, s3_server):
    """On s3:// the Trainer cannot see the best checkpoint recorded in the resumed state (not
    a local directory); the adapter finds it in storage, keeps it under the limit and loads it."""
    root, opts = s3_server.url("best"), s3_server.storage_options
    make_trainer(str(tmp_path / "a"), seed=0, max_steps=6, best=True,
                 turbo_url=root, turbo_storage_options=opts).train()
    assert names(root, opts) == ["checkpoint-4", "checkpoint-6"]
    b = make_trainer(str(tmp_path / "b"), seed=0, max_steps=12, best=True,
                     turbo_url=root, turbo_storage_options=opts)
    b.train(resume_from_checkpoint=True)
    assert steps_run(b)[0] == 7
    assert names(root, opts) == ["checkpoint-4", "checkpoint-12"]
    assert b.state.best_model_checkpoint == f"{root}/checkpoint-4"
    assert_same_weights(dict(b.model.state_dict()), model_of(f"{root}/checkpoint-4", opts))


def test_tiers_rotate_both_places_and_resume_from_memory_s3(tmp_path, s3_server):
    """With tiers every checkpoint commits to host memory and every second one reaches the
    bucket; ``save_total_limit`` counts both places and a rotated checkpoint leaves both (its
    chunks in memory are freed); a resume from a checkpoint only in memory is exact, and
    ``resume_from_checkpoint=True`` finds the newest in either place."""
    root, opts = s3_server.url("tiers"), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=2, node="n0")

    def trainer(name: str, seed: int, max_steps: int) -> Trainer:
        return make_trainer(str(tmp_path / name), seed=seed, max_steps=max_steps, turbo_url=root,
                            turbo_storage_options=opts, turbo_tiers=tiers)

    a = trainer("a", seed=0, max_steps=8)
    a.train()  # saves 2 (memory), 4 (both), 6 (memory), 8 (both); the limit of 2 drops 2 and 4
    listed = ct.list_checkpoints(root, storage_options=opts, tiers=tiers)
    assert [(c.name, c.tiers) for c in listed] == [("checkpoint-6", ("memory",)),
                                                   ("checkpoint-8", ("memory", "durable"))]
    assert names(root, opts) == ["checkpoint-8"]
    assert catalog.collect_garbage(tiers.memory_run(root), dry_run=True).deleted == 0  # freed

    b = trainer("b", seed=1, max_steps=8)
    b.train(resume_from_checkpoint=f"{root}/checkpoint-6")  # in memory only
    assert steps_run(b) == [7, 8]
    want, got = training_state(a), training_state(b)
    assert got["step"] == want["step"] == 8 and got["sched"] == want["sched"]
    assert_same_model_and_optimizer(want["model"], got["model"], want["optim"], got["optim"])
    c = trainer("c", seed=1, max_steps=10)
    c.train(resume_from_checkpoint=True)  # the newest in either place: checkpoint-8
    assert steps_run(c) == [9, 10]


def test_callback_alone_limit_and_best(tmp_path):
    """The callback on a plain Trainer: the same rotation, and the best model loaded at the end."""
    out = str(tmp_path / "out")
    t = make_trainer(out, seed=0, cls=Trainer, max_steps=8, best=True)
    t.add_callback(TurboCheckpointCallback())
    t.train()
    # the Trainer wrote nothing
    assert not list((tmp_path / "out").glob("checkpoint-*/model.safetensors"))
    assert names(out) == ["checkpoint-4", "checkpoint-8"]
    assert t.state.best_model_checkpoint == f"{out}/checkpoint-4"
    assert_same_weights(dict(t.model.state_dict()), model_of(f"{out}/checkpoint-4"))


def test_resume_latest_from_s3(tmp_path, s3_server):
    root = s3_server.url("trainer")
    opts = s3_server.storage_options
    a = make_trainer(str(tmp_path / "out"), seed=0, turbo_url=root, turbo_storage_options=opts)
    a.train()
    assert names(root, opts) == ["checkpoint-4", "checkpoint-6"]
    # drop step 6 so the newest is step 4 (resumed exactly at max_steps, the run here took one
    # more step); resume_from_checkpoint=True must pick checkpoint-4
    ct.delete(f"{root}/checkpoint-6", storage_options=opts)
    b = make_trainer(str(tmp_path / "out_b"), seed=1, turbo_url=root, turbo_storage_options=opts)
    b.train(resume_from_checkpoint=True)
    assert_same(training_state(a), training_state(b))


def test_resume_reads_a_save_still_in_flight_s3(tmp_path, s3_server):
    """resume_from_checkpoint=True right after a save returned (staged, not yet durable) in the
    same process resumes from that save: the listing waits for it."""
    root, opts = s3_server.url("inflight"), s3_server.storage_options
    a = make_trainer(str(tmp_path / "a"), seed=0, max_steps=4, turbo_url=root,
                     turbo_storage_options=opts)
    a.train()
    b = make_trainer(str(tmp_path / "b"), seed=1, max_steps=8, turbo_url=root,
                     turbo_storage_options=opts)
    a.state.global_step = 6
    a.args.save_total_limit = None  # no rotation: its listing would wait for the save
    handle = a.turbo.save(a.args, a.state, model=a.model, optimizer=a.optimizer,
                          lr_scheduler=a.lr_scheduler)
    b.train(resume_from_checkpoint=True)
    assert handle.done()
    assert steps_run(b) == [7, 8]


def test_nothing_to_resume_from_raises_the_trainers_error(tmp_path, s3_server):
    """``resume_from_checkpoint=True`` with no checkpoint: the Trainer's ValueError, word for
    word, with the run in the output directory or on s3:// (code written against the Trainer
    catches it to start afresh)."""
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    with pytest.raises(ValueError) as want:
        make_trainer(str(ref_out), seed=0, cls=Trainer).train(resume_from_checkpoint=True)
    runs = {"output_dir": {}, "s3": dict(turbo_url=s3_server.url("empty"),
                                         turbo_storage_options=s3_server.storage_options)}
    for where, turbo in runs.items():
        with pytest.raises(ValueError) as got:
            make_trainer(str(out), seed=0, **turbo).train(resume_from_checkpoint=True)
        assert type(got.value) is type(want.value), where
        assert str(got.value) == str(want.value).replace(str(ref_out), str(out)), where
        assert str(got.value) == f"No valid checkpoint found in output directory ({out})"


@pytest.mark.parametrize("store", [None, "run", "url"])
def test_output_dir_lists_only_the_kept_checkpoints(tmp_path, store):
    """After rotation the output directory lists the kept ``checkpoint-<step>`` directories
    and nothing else (the shared store of ``store="run"`` aside), 20 runs in a row: no
    rotated checkpoint's directory comes back (a gc of it in flight once wrote its gc
    generation into it after the delete)."""
    turbo = {"turbo_store": str(tmp_path / "chunks")} if store == "url" else {"turbo_store": store}
    extra = [".ckptturbo"] if store == "run" else []
    leftovers = []
    for i in range(20):
        out = tmp_path / f"out{i}"
        make_trainer(str(out), seed=0, max_steps=6, save_steps=1, **turbo).train()
        listed = sorted(p.name for p in out.iterdir())
        if listed != sorted(["checkpoint-5", "checkpoint-6", *extra]):
            leftovers.append((i, listed))
    assert leftovers == []
    assert names(str(out)) == ["checkpoint-5", "checkpoint-6"]


def test_gc_that_listed_a_rotated_checkpoint_leaves_it_gone(tmp_path):
    """The order that left ``checkpoint-N/.ckptturbo/gc.generation`` behind: the adapter's
    background gc of the run lists a self-contained checkpoint, rotation deletes it, and the
    gc then takes that checkpoint's lock, which wrote its directory back. Forced here."""
    out = tmp_path / "out"
    make_trainer(str(out), seed=0, max_steps=4).train()
    listed = [url for url, _ in catalog.committed(str(out), None, None)]  # the gc's listing
    ct.delete(f"{out}/checkpoint-2")  # a rotation, meanwhile
    gone = Location(f"{out}/checkpoint-2", None, OWN_STORE)
    assert str(gone.url) in listed
    assert catalog.collect_checkpoint(gone).deleted == 0  # the gc goes on with what it listed
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]


def test_callbacks_are_the_trainers(tmp_path):
    """``callback_handler.callbacks`` lists what a plain Trainer built with the same
    arguments lists (classes, order), before and after training, and popping one works as
    there; the adapter's checkpoints are still taken."""
    def listed(t: Trainer) -> list[type]:
        return [type(cb) for cb in t.callback_handler.callbacks]

    ref = make_trainer(str(tmp_path / "ref"), seed=0, cls=Trainer)
    t = make_trainer(str(tmp_path / "out"), seed=0)
    assert listed(t) == listed(ref)
    assert not any(isinstance(cb, TurboCheckpointCallback) for cb in t.callback_handler.callbacks)
    assert type(t.pop_callback(StepCounter)) is type(ref.pop_callback(StepCounter))
    assert listed(t) == listed(ref)
    t.train()
    assert listed(t) == listed(ref)
    assert names(str(tmp_path / "out")) == ["checkpoint-4", "checkpoint-6"]


def test_errors_are_ckptturbo_errors(tmp_path, s3_server):
    opts = s3_server.storage_options
    t = make_trainer(str(tmp_path / "out"), seed=0, turbo_url=s3_server.url("empty"),
                     turbo_storage_options=opts)
    with pytest.raises(ct.CheckpointNotFound, match="nope"):
        t.train(resume_from_checkpoint=s3_server.url("empty/nope"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    t = make_trainer(str(tmp_path / "out"), seed=0, max_steps=2, turbo_url=str(blocker / "run"))
    with pytest.raises(ct.CkptTurboError) as err:
        t.train()
    assert str(blocker) in str(err.value) and err.value.__cause__ is not None
