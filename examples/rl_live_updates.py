"""An RL-style loop on CPU: a trainer saves its policy every few steps and a running vLLM
engine moves to each new checkpoint without a restart, reading only what changed.

    python examples/rl_live_updates.py                      # a run in a temp dir
    python examples/rl_live_updates.py --url s3://bucket/run --storage-options '{...}'

The policy is a tiny Llama built from a config (transformers, no download). The trainer
keeps float32 master weights and saves the bfloat16 weights the engine serves, each save
a delta of the previous one (``ct.save(..., delta_from=previous)``): with a small learning
rate most bfloat16 elements keep their bits from one save to the next, so each tensor is
stored as its changed elements, and tensors the step did not train (the frozen lower
layers) are not stored again at all. The engine (``load_format="ckptturbo"``,
``weight_transfer_config={"backend": "ckptturbo"}``) updates after each save with
:func:`ckptturbo.integrations.vllm.update_weights` and generates greedily; each update is
logged with the bytes it read, its seconds and the tensors it changed (read whole, or as
deltas). Bytes read are the engine process's file reads (``/proc/self/io``), so they are
measured for a local run; behind an object store, count them at the store (the
benchmark ``python -m benchmarks.run live-update`` puts a byte-counting proxy there).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from typing import Any

import torch

import ckptturbo as ct

log = logging.getLogger("rl_live_updates")

PROMPTS = [[1, 5, 7, 9], [3, 141, 59, 26, 53]]


def build_policy(config_dir: str, hidden: int, layers: int) -> torch.nn.Module:
    """A tiny Llama (head size 64, which vLLM's CPU attention supports); its config (all the
    engine needs locally) is written to ``config_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    cfg.save_pretrained(config_dir)
    model.generation_config.save_pretrained(config_dir)
    for layer in model.model.layers[: layers // 2]:  # the lower half stays frozen
        layer.requires_grad_(False)
    return model


def served_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the engine serves: bfloat16 copies of the trainer's float32 masters."""
    return {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer,
               batch: torch.Tensor) -> float:
    """One step of next-token prediction on ``batch`` (a stand-in for a policy update)."""
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss)


def file_bytes_read() -> int | None:
    """Bytes this process has read from files so far (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return None


def last_update(llm: Any) -> Any:
    """The worker's report of its last update (what it read whole, as deltas, or skipped)."""
    (report,) = llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last)
    return report


def start_engine(config_dir: str, url: str, storage_options: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # last_update's function
    from vllm import LLM

    return LLM(model=config_dir, skip_tokenizer_init=True, load_format="ckptturbo",
               model_loader_extra_config={"url": url, "storage_options": storage_options},
               weight_transfer_config={"backend": "ckptturbo"}, dtype="bfloat16",
               enforce_eager=True, max_model_len=128, max_num_seqs=2, seed=0)


def generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(url: str, storage_options: dict[str, Any], steps: int, every: int, hidden: int,
        layers: int, lr: float, workdir: str) -> list[dict[str, Any]]:
    """Train ``steps`` steps, save and update the engine every ``every``; one record per
    update (also logged)."""
    from ckptturbo.integrations import vllm as ctv

    config_dir = os.path.join(workdir, "policy-config")
    model = build_policy(config_dir, hidden, layers)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    batch = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    previous = f"{url.rstrip('/')}/step-0"
    ct.save(served_state(model), previous, storage_options=storage_options).wait()
    llm = start_engine(config_dir, previous, storage_options)
    log.info("engine serving %s: %s", previous, generate(llm))
    records = []
    for step in range(1, steps + 1):
        loss = train_step(model, optim, batch)
        if step % every:
            continue
        checkpoint = f"{url.rstrip('/')}/step-{step}"
        ct.save(served_state(model), checkpoint, storage_options=storage_options,
                delta_from=previous).wait()
        read_before = file_bytes_read()
        started = time.perf_counter()
        ctv.update_weights(llm, checkpoint, storage_options=storage_options,
                           weight_version=f"step-{step}")
        seconds = time.perf_counter() - started
        read_after = file_bytes_read()
        report = last_update(llm)
        record = {"step": step, "loss": loss, "seconds": seconds,
                  "bytes_read": (None if read_before is None or read_after is None
                                 or "://" in url else read_after - read_before),
                  "full": report.full, "deltas": report.deltas, "unchanged": report.unchanged,
                  "version": llm.get_weight_version(), "tokens": generate(llm)}
        records.append(record)
        log.info("step %d (loss %.3f): update to %s in %.2fs, %s bytes read, tensors: %d "
                 "whole, %d as deltas, %d unchanged; greedy %s", step, loss, checkpoint,
                 seconds, record["bytes_read"], report.full, report.deltas, report.unchanged,
                 record["tokens"])
        previous = checkpoint
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="the run (default: a temp dir)")
    parser.add_argument("--storage-options", default="{}", help="fsspec options, JSON")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="save and update every N steps")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default=None, help="write the update records here (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="rl-live-") as workdir:
        url = args.url or os.path.join(workdir, "run")
        records = run(url, json.loads(args.storage_options), args.steps, args.every,
                      args.hidden, args.layers, args.lr, workdir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
