"""Lightning ModelParallelStrategy (FSDP2 over 2 CPU ranks, gloo) with TurboModelParallelStrategy.

argv: dirpath max_epochs [ckpt_path]. Rank 0 writes the full final weights to <dirpath>.final.pt.
"""
import sys, torch, lightning.pytorch as pl
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.callbacks import ModelCheckpoint
from ckptturbo.integrations.lightning import TurboModelParallelStrategy
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    def configure_model(self):
        for m in self.net: 
            if isinstance(m, torch.nn.Linear): fully_shard(m, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
    def training_step(self, b, i):
        x, y = b; return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self): return torch.optim.Adam(self.parameters(), lr=1e-2)
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
pl.seed_everything(1)
t = pl.Trainer(accelerator="cpu", devices=2, strategy=TurboModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), max_epochs=int(sys.argv[2]),
  callbacks=[ModelCheckpoint(dirpath=sys.argv[1], save_top_k=-1)], logger=False, enable_progress_bar=False)
t.fit(M(), dl, ckpt_path=sys.argv[3] if len(sys.argv) > 3 else None)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
sd = get_model_state_dict(t.lightning_module.net, options=StateDictOptions(full_state_dict=True))
if t.is_global_zero: torch.save(sd, sys.argv[1] + ".final.pt")
