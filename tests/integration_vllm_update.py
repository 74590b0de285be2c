"""Run one vLLM engine on CPU through a scripted series of live weight updates.

Usage: python integration_vllm_update.py SPEC_JSON OUT_FILE

SPEC: ``{"model": dir, "load_format": str, "extra": {...}, "tp": int, "control": port|null,
"steps": [{"url": str, "storage_options": {...}, "cache_dir": str|null, "outage": str|null,
"raw": {...}|null}]}``.
``raw`` sends that ``update_info`` dict as is (a malformed request); ``outage`` switches the
byte-counting proxy (``control`` is its port) to that outage for the step; ``retry_for``
repeats a failing update until it succeeds or that many seconds have passed (a store
that refused requests is treated as down for a while: a caller's loop retries).

Writes ``{"loaded": record, "steps": [record, ...]}`` to OUT_FILE, where a record is
``{"error": str|None, "bytes": int, "seconds": float, "version": str, "tokens": [[...]],
"logprobs": [[{token: logprob}]], "weights": {name: tensor}}``: greedy tokens, their top
logprobs and the visible parameters after the step (vLLM's CPU kernels repack linear
weights, whose parameters are then empty), to compare with a fresh engine's and with the
previous step's.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PROMPTS = [[1, 5, 7, 9], [3, 141, 59, 26, 53]]


def parameters(model: Any) -> dict[str, Any]:
    """A worker's visible parameters (by reference: TP workers import this module)."""
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    out = sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # TP workers unpickle apply_model's function by its module's name, which __main__ is not
    import integration_vllm_update as importable
    import torch
    from vllm import LLM, SamplingParams

    from ckptturbo.integrations import vllm as ctv
    from ckptturbo.testing.proxy_process import ProxyControl

    control = ProxyControl(spec["control"]) if spec.get("control") else None
    tp = int(spec.get("tp", 1))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, load_format=spec["load_format"],
              model_loader_extra_config=spec.get("extra") or {}, dtype="float32",
              enforce_eager=True, max_model_len=128, max_num_seqs=2, seed=0,
              tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              weight_transfer_config={"backend": "ckptturbo"})
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, logprobs=3)

    def record(error: str | None, fetched: int, seconds: float) -> dict[str, Any]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        (weights, *_) = llm.apply_model(importable.parameters)
        return {"error": error, "bytes": fetched, "seconds": seconds,
                "version": llm.get_weight_version(),
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "logprobs": [[{t: lp.logprob for t, lp in position.items()}
                              for position in o.outputs[0].logprobs or []] for o in outputs],
                "weights": weights}

    result: dict[str, Any] = {"loaded": record(None, 0, 0.0), "steps": []}
    for step in spec["steps"]:
        if control is not None:
            control.reset_stats()
            if step.get("outage"):
                control.set_outage(step["outage"])
        started = time.perf_counter()
        error = None
        try:
            if step.get("raw") is not None:
                llm.start_weight_update()
                try:
                    llm.update_weights({"update_info": step["raw"]})
                finally:
                    try:
                        llm.finish_weight_update()
                    except Exception:  # noqa: BLE001 - the failed update ended the session
                        pass
            else:
                deadline = time.monotonic() + float(step.get("retry_for", 0))
                while True:
                    try:
                        ctv.update_weights(llm, step["url"],
                                           storage_options=step.get("storage_options"),
                                           cache_dir=step.get("cache_dir"))
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
        except Exception as exc:  # noqa: BLE001 - recorded: the test checks it
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        fetched = 0
        if control is not None:
            fetched = control.stats().bytes_down
            control.set_outage("none")
        result["steps"].append(record(error, fetched, seconds))
    torch.save(result, out)


if __name__ == "__main__":
    main()
