"""Lightning with ckptturbo: ``python examples/lightning_example.py [--dir DIR|s3://...] [--cuda]``.

The only change to a Lightning script is ``plugins=[TurboCheckpointIO()]``: checkpoints are
async (training goes on once they are in host memory), deduplicated across the
checkpoints of one dirpath, and ``fit(ckpt_path=...)`` resumes from them. Outside a
Trainer, ``load_from_checkpoint(Regressor, path)`` stands in for
``Regressor.load_from_checkpoint(path)``, which reads only torch files.
"""
import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptturbo.integrations.lightning import TurboCheckpointIO, load_from_checkpoint


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=".demo/lightning")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    trainer = pl.Trainer(accelerator="cuda" if args.cuda else "cpu", devices=1, max_epochs=3,
                         plugins=[TurboCheckpointIO()],  # <- the switch
                         callbacks=[ModelCheckpoint(dirpath=args.dir, save_top_k=2, monitor="epoch",
                                                    mode="max")],
                         logger=False)
    trainer.fit(Regressor(), data)
    resumed = pl.Trainer(accelerator="cuda" if args.cuda else "cpu", devices=1, max_epochs=4,
                         plugins=[TurboCheckpointIO()], logger=False, enable_checkpointing=False)
    resumed.fit(Regressor(), data, ckpt_path=trainer.checkpoint_callback.best_model_path)
    print("resumed at global step", resumed.global_step)
    # for inference: no Trainer needed
    model = load_from_checkpoint(Regressor, trainer.checkpoint_callback.best_model_path)
    print("loaded for inference:", type(model).__name__, model.net[0].weight.shape)


if __name__ == "__main__":
    main()
