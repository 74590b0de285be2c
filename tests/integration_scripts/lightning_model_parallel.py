"""Lightning sharded strategies with ckptturbo: TurboModelParallelStrategy (FSDP2 via
configure_model; runs on 2 CPU ranks with gloo) or TurboFSDPStrategy(state_dict_type="sharded")
(CUDA only, as Lightning's FSDPStrategy).

Usage: lightning_model_parallel.py DIRPATH EPOCHS [CKPT] [--strategy model_parallel|fsdp] [--cuda]
       [--tiers MEMORY_DIR]
Rank 0 writes the full final weights to DIRPATH.final.pt.
"""
import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ckptturbo as ct
from ckptturbo.integrations.lightning import TurboFSDPStrategy, TurboModelParallelStrategy


class M(pl.LightningModule):
    def __init__(self, shard_in_configure: bool) -> None:
        super().__init__()
        self.shard_in_configure = shard_in_configure
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def configure_model(self):
        if not self.shard_in_configure:
            return
        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("epochs", type=int)
    p.add_argument("ckpt", nargs="?")
    p.add_argument("--strategy", default="model_parallel", choices=["model_parallel", "fsdp"])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--tiers", help="memory tier directory: every second checkpoint persisted")
    args = p.parse_args()
    tiers = ct.Tiers(memory=args.tiers, persist_every=2, node="n0") if args.tiers else None
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    pl.seed_everything(1)
    devices = max(torch.cuda.device_count(), 1) if args.cuda else 2
    if args.strategy == "fsdp":
        strategy = TurboFSDPStrategy(state_dict_type="sharded", turbo_tiers=tiers)
    else:
        strategy = TurboModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                              turbo_tiers=tiers)
    trainer = pl.Trainer(accelerator="cuda" if args.cuda else "cpu", devices=devices,
                         strategy=strategy, max_epochs=args.epochs,
                         callbacks=[ModelCheckpoint(dirpath=args.dirpath, save_top_k=-1)],
                         logger=False, enable_progress_bar=False)
    trainer.fit(M(shard_in_configure=args.strategy == "model_parallel"), data, ckpt_path=args.ckpt)
    sd = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(sd, args.dirpath + ".final.pt")
    # torch's advice for every distributed script: a group left to interpreter finalisation
    # can abort the process at exit
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
