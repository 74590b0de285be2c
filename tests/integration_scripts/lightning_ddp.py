"""Lightning DDP run (2 CPU processes, gloo) checkpointing through TurboCheckpointIO.

Run by tests/test_integration_lightning.py as a real subprocess; Lightning's own DDP
launcher starts the second rank. Rank 0 writes the final model and optimizer state to
``--out`` so the test can compare runs; every rank writes the names of the threads still
running after ``fit`` to ``--out`` + ``.threads<rank>.json``.
"""
from __future__ import annotations

import argparse
import json
import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptturbo.integrations.lightning import TurboCheckpointIO


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("epoch_metric", float(self.current_epoch), sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--storage-options", default=None, help="JSON fsspec options")
    args = p.parse_args()
    pl.seed_everything(1, workers=True)
    model = Tiny()
    opts = json.loads(args.storage_options) if args.storage_options else None
    ckpt = ModelCheckpoint(dirpath=args.dirpath, save_top_k=args.top_k, monitor="epoch_metric",
                           mode="max")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         plugins=[TurboCheckpointIO(opts)], callbacks=[ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    before = {t.ident for t in threading.enumerate()}
    trainer.fit(model, data(), ckpt_path=args.resume)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    with open(f"{args.out}.threads{trainer.global_rank}.json", "w") as f:
        json.dump(left, f)
    if trainer.is_global_zero:
        torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
                    "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "global_step": trainer.global_step}, args.out)
    # torch's advice for every distributed script: a group left to interpreter finalisation
    # can abort the process at exit
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
