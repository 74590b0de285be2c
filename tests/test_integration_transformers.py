"""transformers Trainer with ckptturbo: a tiny GPT-2 built from a config (no downloads)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo import catalog  # noqa: E402
from ckptturbo.integrations.transformers import TurboTrainer  # noqa: E402
from tests.training_state import assert_same_model_and_optimizer  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out: str, seed: int, **turbo) -> TurboTrainer:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, max_steps=6, save_steps=2, save_total_limit=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, seed=0, report_to=[],
                             use_cpu=True, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    return TurboTrainer(model=model, args=args, train_dataset=Tokens(), **turbo)


def training_state(trainer: TurboTrainer) -> dict:
    return {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optim": trainer.optimizer.state_dict(), "sched": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step}


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 6
    assert_same_model_and_optimizer(a["model"], b["model"], a["optim"], b["optim"])
    assert a["sched"] == b["sched"]


def test_async_checkpoints_limit_and_exact_resume_local(tmp_path):
    out = str(tmp_path / "out")
    a = make_trainer(out, seed=0)
    a.train()
    names = [c.name for c in catalog.list_checkpoints(out)]
    assert names == ["checkpoint-4", "checkpoint-6"]  # save_steps=2, save_total_limit=2
    assert catalog.collect_garbage(out, dry_run=True).deleted == 0
    b = make_trainer(str(tmp_path / "out_b"), seed=1)  # different init: everything must come from the checkpoint
    b.train(resume_from_checkpoint=f"{out}/checkpoint-4")
    assert_same(training_state(a), training_state(b))


def test_resume_latest_from_s3(tmp_path, s3_server):
    root = s3_server.url("trainer")
    opts = s3_server.storage_options
    a = make_trainer(str(tmp_path / "out"), seed=0, turbo_url=root, turbo_storage_options=opts)
    a.train()
    assert [c.name for c in catalog.list_checkpoints(root, opts)] == ["checkpoint-4", "checkpoint-6"]
    # drop step 6 so the newest is step 4 (resumed exactly at max_steps, the run here took one
    # more step); resume_from_checkpoint=True must pick checkpoint-4
    ct.delete(f"{root}/checkpoint-6", storage_options=opts)
    b = make_trainer(str(tmp_path / "out_b"), seed=1, turbo_url=root, turbo_storage_options=opts)
    b.train(resume_from_checkpoint=True)
    assert_same(training_state(a), training_state(b))
