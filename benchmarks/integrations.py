"""Framework adapters vs the frameworks' own checkpointing, side by side in one run.

    python -m benchmarks.integrations lightning|accelerate|transformers|all [--mib 256] [--out DIR]

* lightning: Lightning DDP, 2 CPU ranks (Lightning's own launcher), a model whose state
  (weights + Adam moments) is ``--mib`` MiB. Time ``trainer.save_checkpoint`` blocks the
  training loop, per checkpoint, for TorchCheckpointIO, AsyncCheckpointIO and
  TurboCheckpointIO. Targets: turbo <= 0.3x torch and <= 0.5x async.
* accelerate: 2 ranks (torchrun), same model: time until ``save_state`` returns,
  ``Accelerator.save_state`` vs ``ckptturbo.integrations.accelerate.save_state``. Target <= 0.3x.
* transformers: one process, a GPT-2 built from a config: wall time of a short run with a
  checkpoint every ``save_steps`` steps, default Trainer vs TurboTrainer.

Writes ``<out>/integrations-<name>.json``. Standalone on purpose (no benchmarks.common).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def _width(mib: int) -> int:
    """Square Linear layers (two of them) whose weights + two Adam moments are ~mib MiB."""
    params = mib * 2**20 / 4 / 3
    return int((params / 2) ** 0.5)


def _model(mib: int) -> torch.nn.Module:
    w = _width(mib)
    return torch.nn.Sequential(torch.nn.Linear(w, w, bias=False), torch.nn.Linear(w, w, bias=False))


# --- Lightning worker -------------------------------------------------------------------
def lightning_worker(io_name: str, mib: int, saves: int, workdir: str, out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from ckptturbo.integrations.lightning import TurboCheckpointIO

    w = _width(mib)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(mib)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.blocked: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx >= 1:  # the first step creates Adam's state
                start = time.perf_counter()
                trainer.save_checkpoint(os.path.join(workdir, f"step-{batch_idx}.ckpt"))
                self.blocked.append(time.perf_counter() - start)

    io = {"torch": TorchCheckpointIO(), "async": AsyncCheckpointIO(TorchCheckpointIO()),
          "turbo": TurboCheckpointIO()}[io_name]
    timer = Timer()
    data = DataLoader(TensorDataset(torch.randn(2 * (saves + 1), w)), batch_size=1)  # 2 ranks
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, plugins=[io],
                         callbacks=[timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(Net(), data)
    total = time.perf_counter() - start  # includes teardown, which waits for pending saves
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({"blocked_s": timer.blocked, "fit_s": total}))


# --- Accelerate worker ------------------------------------------------------------------
def accelerate_worker(mib: int, saves: int, workdir: str, out: str) -> None:
    from accelerate import Accelerator

    from ckptturbo.integrations.accelerate import save_state

    acc = Accelerator(cpu=True)
    model = _model(mib)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(1, _width(mib))
    times: dict[str, list[float]] = {"accelerate": [], "turbo": [], "turbo_durable": []}
    handles = []
    for i in range(saves):
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        acc.wait_for_everyone()
        start = time.perf_counter()
        acc.save_state(os.path.join(workdir, f"native-{i}"))
        times["accelerate"].append(time.perf_counter() - start)
        acc.wait_for_everyone()
        start = time.perf_counter()
        handles.append(save_state(acc, os.path.join(workdir, "turbo", f"step-{i}")))
        times["turbo"].append(time.perf_counter() - start)
        handles[-1].wait()
        times["turbo_durable"].append(time.perf_counter() - start)
    if acc.is_main_process:
        Path(out).write_text(json.dumps(times))
    acc.end_training()


# --- transformers -----------------------------------------------------------------------
def transformers_run(steps: int, save_steps: int, workdir: str) -> dict[str, float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ckptturbo.integrations.transformers import TurboTrainer

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 1024, (steps * 4, 64), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    result = {}
    # each twice, interleaved; the second of each counts (the first pays one-off warm-up)
    for name, cls in (("default", Trainer), ("turbo", TurboTrainer)) * 2:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4,
                                           n_head=4))
        args = TrainingArguments(output_dir=tempfile.mkdtemp(dir=workdir), max_steps=steps,
                                 save_steps=save_steps, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, disable_tqdm=True,
                                 logging_strategy="no")
        trainer = cls(model=model, args=args, train_dataset=Tokens())
        start = time.perf_counter()
        trainer.train()
        result[f"{name}_s"] = time.perf_counter() - start
    result["ratio_turbo_vs_default"] = result["turbo_s"] / result["default_s"]
    return result


# --- drivers ----------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float = 900) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")


def bench_lightning(mib: int, saves: int) -> dict[str, Any]:
    result: dict[str, Any] = {"mib": mib, "saves": saves}
    for io_name in ("torch", "async", "turbo"):
        work = tempfile.mkdtemp(prefix=f"bench-pl-{io_name}-")
        out = os.path.join(work, "result.json")
        try:
            _run([sys.executable, "-m", "benchmarks.integrations", "_lightning_worker", io_name,
                  str(mib), str(saves), work, out])
            raw = json.loads(Path(out).read_text())
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result[io_name] = {"blocked_median_s": statistics.median(raw["blocked_s"]), **raw}
    med = {k: result[k]["blocked_median_s"] for k in ("torch", "async", "turbo")}
    result["ratio_turbo_vs_torch"] = med["turbo"] / med["torch"]
    result["ratio_turbo_vs_async"] = med["turbo"] / med["async"]
    result["targets_met"] = (result["ratio_turbo_vs_torch"] <= 0.3
                             and result["ratio_turbo_vs_async"] <= 0.5)
    return result


def bench_accelerate(mib: int, saves: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="bench-acc-")
    out = os.path.join(work, "result.json")
    try:
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--standalone", "--log-dir", os.path.join(work, "logs"),
              "-m", "benchmarks.integrations", "_accelerate_worker", str(mib), str(saves), work,
              out])
        raw = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in raw.items()}
    return {"mib": mib, "saves": saves, "raw_s": raw, "median_s": med,
            "ratio_turbo_vs_accelerate": med["turbo"] / med["accelerate"],
            "target_met": med["turbo"] / med["accelerate"] <= 0.3}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_lightning_worker":
        io_name, mib, saves, work, out = sys.argv[2:7]
        return lightning_worker(io_name, int(mib), int(saves), work, out)
    if len(sys.argv) > 1 and sys.argv[1] == "_accelerate_worker":
        mib, saves, work, out = sys.argv[2:6]
        return accelerate_worker(int(mib), int(saves), work, out)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=["lightning", "accelerate", "transformers", "all"])
    p.add_argument("--mib", type=int, default=256, help="model state size (weights + Adam moments)")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="transformers: training steps")
    p.add_argument("--save-steps", type=int, default=10,
                   help="transformers: steps between checkpoints")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = ["lightning", "accelerate", "transformers"] if args.which == "all" else [args.which]
    for name in names:
        if name == "lightning":
            result = bench_lightning(args.mib, args.saves)
        elif name == "accelerate":
            result = bench_accelerate(args.mib, args.saves)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-hf-") as work:
                result = transformers_run(args.steps, args.save_steps, work)
        Path(args.out, f"integrations-{name}.json").write_text(json.dumps(result, indent=2))
        flat = {k: v for k, v in result.items() if not isinstance(v, dict)}
        print(name, json.dumps(flat, indent=1))


if __name__ == "__main__":
    main()
