"""Run one vLLM engine on CPU and record what the vLLM tests compare.

Usage: python integration_vllm_run.py MODEL_DIR LOAD_FORMAT EXTRA_JSON OUT_FILE [TP]

A separate process per engine: vLLM loads its plugins (ckptturbo's entry point among
them) at start, as in `vllm serve`, and two engines never share one process group.
Writes ``{"tokens": [[...]], "weights": {name: tensor}, "seconds": load+init}`` to OUT_FILE.
"""
from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = [[1, 5, 7, 9], [3, 141, 59, 26, 53]]


def main() -> None:
    model_dir, load_format, extra, out = sys.argv[1:5]
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format=load_format,
              model_loader_extra_config=json.loads(extra), dtype="float32", enforce_eager=True,
              max_model_len=128, max_num_seqs=2, seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None)
    seconds = time.perf_counter() - started
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    weights = llm.apply_model(
        lambda model: {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()})
    torch.save({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "weights": weights, "seconds": seconds}, out)


if __name__ == "__main__":
    main()
