"""transformers Trainer with ckptturbo:
``python examples/transformers_example.py [--url DIR|s3://...] [--cuda]``.

``TurboTrainer`` (or ``TurboTrainerMixin`` in front of your own Trainer subclass) makes the
checkpoints that ``save_steps`` asks for async ckptturbo checkpoints and resumes from them
with ``train(resume_from_checkpoint=url or True)``. A tiny GPT-2 is built from a config:
nothing is downloaded.
"""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from ckptturbo.integrations.transformers import TurboTrainer


class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(0, 128, (64, 32))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(url: str, cuda: bool, max_steps: int) -> TurboTrainer:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    args = TrainingArguments(output_dir=".demo/transformers-out", max_steps=max_steps, save_steps=5,
                             save_total_limit=2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=not cuda)
    # the switch: TurboTrainer where a Trainer was
    return TurboTrainer(model=model, args=args, train_dataset=Tokens(), turbo_url=url)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=".demo/transformers")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    trainer(args.url, args.cuda, 10).train()
    # resumes from the newest ckptturbo checkpoint
    trainer(args.url, args.cuda, 15).train(resume_from_checkpoint=True)
    # save_total_limit=2 holds across the resume: checkpoint-10 and checkpoint-15 are left


if __name__ == "__main__":
    main()
