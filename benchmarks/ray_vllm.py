"""Ray Train checkpoints and vLLM model loads: ckptturbo beside the engines' own ways.

Standalone (``python -m benchmarks.ray_vllm ray|vllm|all``); SeaweedFS runs on loopback.

* ``ray``: a 2-worker DDP TorchTrainer whose state (weights + Adam moments) is >= 256 MiB
  checkpoints a few times to S3, once with ckptturbo.integrations.ray_train and once with
  Ray's standard pattern (``torch.save`` into a local directory, then
  ``ray.train.report(checkpoint=Checkpoint.from_directory(...))``, uploaded synchronously,
  by rank 0 alone as Ray's DDP examples do, and by every worker). Reported: seconds the
  training loop is blocked per checkpoint and bytes uploaded, with ratios.
* ``vllm``: a Llama of a few hundred MB in safetensors on S3 behind
  ckptturbo.testing's proxy (20 ms per request): the weights phase of vLLM (CPU)
  (``load_model``: building the model and loading its weights) with
  ``load_format="ckptturbo"``, with ``runai_streamer`` (a benchmark-only extra,
  ``ckptturbo[bench-runai]``, or ``--runai-python``; skipped with a message when absent),
  and by downloading the files then ``load_format="safetensors"`` (download included);
  ``load_format="dummy"`` (random weights, nothing read) gives the floor every way pays,
  and ``ratio_above_dummy_*`` compares the time each spends above it. Each way runs in a
  warm engine process of its own (vLLM imported, one unmeasured engine first), which then
  builds one engine per repetition; repetitions alternate
  between the ways (the order flips each time); medians, spreads and ratios are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.stream_s3 import Worker
from ckptturbo.testing.proxy_process import ProxyProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- Ray Train

def ray_train_fn(config: dict) -> None:
    """Runs in every TorchTrainer worker: train, checkpoint every ``every`` steps."""
    import ray.train
    import torch
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptturbo.integrations import ray_train as rt

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    width = config["width"]
    model = prepare_model(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(2)]))
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    blocked, handles = [], []
    for step in range(1, config["steps"] + 1):
        optim.zero_grad()
        model(torch.randn(8, width)).square().mean().backward()
        optim.step()
        time.sleep(config["step_seconds"])  # the rest of a step (GPU compute, data) frees the CPU
        if step % config["every"]:
            continue
        began = time.perf_counter()
        if config["mode"] == "ckptturbo":
            msd, osd = get_state_dict(model, optim)
            handles.append(rt.save({"model": msd, "optim": osd}, {"step": step},
                                   storage_options=config["storage_options"], gc=False))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = None
                if config["mode"] == "ray-every-worker" or rank == 0:
                    torch.save({"model": model.module.state_dict(), "optim": optim.state_dict()},
                               os.path.join(tmp, f"state-rank{rank}.pt"))
                    checkpoint = Checkpoint.from_directory(tmp)
                ray.train.report({"step": step}, checkpoint=checkpoint)
        blocked.append(time.perf_counter() - began)
    for handle in handles:
        handle.wait(600)
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    with open(os.path.join(config["out"], f"{config['mode']}-rank{rank}.json"), "w") as f:
        json.dump({"blocked": blocked, "state_bytes": state_bytes}, f)


def bench_ray(server: Any, out: str, width: int, steps: int, every: int,
              step_seconds: float) -> dict[str, Any]:
    import fsspec
    import pyarrow.fs
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    arrow = pyarrow.fs.S3FileSystem(access_key=server.key, secret_key=server.secret, scheme="http",
                                    endpoint_override=server.endpoint.split("://", 1)[1],
                                    region="us-east-1")
    fs = fsspec.filesystem("s3", **server.storage_options)
    prefix = server.url("bench-ray").removeprefix("s3://")
    results: dict[str, Any] = {}
    try:
        for mode in ("ckptturbo", "ray-rank0", "ray-every-worker"):
            config = {"mode": mode, "width": width, "steps": steps, "every": every, "out": out,
                      "step_seconds": step_seconds,
                      "storage_options": server.storage_options}
            TorchTrainer(ray_train_fn, train_loop_config=config,
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                         run_config=RunConfig(name=mode, storage_path=prefix,
                                              storage_filesystem=arrow,
                                              checkpoint_config=CheckpointConfig())).fit()
            ranks = []
            for rank in (0, 1):
                with open(os.path.join(out, f"{mode}-rank{rank}.json")) as f:
                    ranks.append(json.load(f))
            # strict=False: pair the checkpoints both ranks reported, as before
            both = zip(ranks[0]["blocked"], ranks[1]["blocked"], strict=False)
            blocked = [max(a, b) for a, b in both]
            results[mode] = {"blocked_s_per_checkpoint": sum(blocked) / len(blocked),
                             "bytes_uploaded": fs.du(f"{prefix}/{mode}"),
                             "state_bytes_per_worker": ranks[0]["state_bytes"],
                             "checkpoints": len(blocked)}
    finally:
        ray.shutdown()
        subprocess.run(["rm", "-rf", temp], check=False)
    for base in ("ray-rank0", "ray-every-worker"):
        results[f"ratio_blocked_vs_{base}"] = (results["ckptturbo"]["blocked_s_per_checkpoint"]
                                               / results[base]["blocked_s_per_checkpoint"])
        results[f"ratio_bytes_vs_{base}"] = (results["ckptturbo"]["bytes_uploaded"]
                                             / results[base]["bytes_uploaded"])
    return results


# --------------------------------------------------------------------------- vLLM

def _tp_environment(tp: int) -> None:
    """vLLM's settings for ``tp`` workers on this machine's CPUs, unless given: at
    tensor-parallel > 1 the engine core and each worker run in processes of their own, and
    on fewer than 4 cores vLLM will not bind 2 workers to one NUMA node by itself, so each
    worker gets a core of its own by hand."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if tp == 1 else "1")
    cores = os.cpu_count() or 1
    if tp > 1 and cores < 4:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(rank % cores) for rank in range(tp)))


def engine_server(model: str, load_format: str, extra: str, download: str, tp: int = 1) -> None:
    """A warm vLLM process: builds one engine of ``tp`` tensor-parallel workers per line
    read from stdin (after one unmeasured engine) and prints the weights phase of each.
    With ``download`` (a JSON ``[url, storage_options]``) each repetition first downloads
    the files into ``model``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _tp_environment(tp)
    import gc
    import glob
    import resource
    import shutil

    import fsspec
    from vllm import LLM, SamplingParams

    from benchmarks.vllm_timed_worker import TIMED_WORKER

    source = json.loads(download) if download else None
    fs = fsspec.filesystem("s3", **source[1]) if source else None

    def once() -> dict[str, Any]:
        fetched, t0 = 0.0, time.perf_counter()
        if source:
            shutil.rmtree(model, ignore_errors=True)
            fs.get(f"{source[0]}/", model + "/", recursive=True)
            fetched = time.perf_counter() - t0  # the bucket holds the config files too
        began = time.perf_counter()
        llm = LLM(model=model, skip_tokenizer_init=True, load_format=load_format,
                  model_loader_extra_config=json.loads(extra), dtype="float32", enforce_eager=True,
                  max_model_len=128, max_num_seqs=2, seed=0, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None, worker_cls=TIMED_WORKER)
        init = time.perf_counter() - began
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(max_tokens=4, temperature=0.0, detokenize=False),
                           use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
        workers = llm.collective_rpc("timed_load")
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        for ident in {w["ident"] for w in workers if w["ident"]}:
            for segment in glob.glob(os.path.join("/dev/shm", glob.escape(ident) + "-*")):
                os.unlink(segment)
        spans = [w["span"] for w in workers]
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        return {"weights_s": end - start + fetched, "load_model_s": end - start,
                # on measure.now()'s clock; from the download's start where there is one
                "window": [t0 if source else start, end],
                "download_s": fetched, "init_s": init + fetched, "tokens": tokens,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    try:
        once()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print("RESULT " + json.dumps({"unavailable": f"{type(exc).__name__}: {str(exc)[:300]}"}),
              flush=True)
        return
    print("READY", flush=True)
    for _ in sys.stdin:
        print("RESULT " + json.dumps(once()), flush=True)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _tiny_llama(directory: str, hidden: int, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_vllm(server: Any, out: str, hidden: int, layers: int, latency_ms: float, repeat: int,
               runai_python: str) -> dict[str, Any]:
    import fsspec


    hf = os.path.join(out, "llama")
    weight_bytes = _tiny_llama(hf, hidden, layers)
    config_only = os.path.join(out, "llama-config")
    os.makedirs(config_only, exist_ok=True)
    fs = fsspec.filesystem("s3", **server.storage_options)
    url = server.url("bench-vllm")
    for name in os.listdir(hf):
        fs.put_file(os.path.join(hf, name), f"{url}/{name}")
        if name.endswith(".json") and "safetensors" not in name:
            subprocess.run(["cp", os.path.join(hf, name), config_only], check=True)
    results: dict[str, Any] = {"weight_bytes": weight_bytes, "latency_ms": latency_ms,
                               "repeat": repeat}
    with ProxyProcess(server.endpoint, latency_s=latency_ms / 1000, conn_rate=100e6) as proxy:
        options = proxy.storage_options(server.storage_options)
        aws = {"AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ACCESS_KEY_ID": server.key,
               "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        turbo_config = json.dumps({"url": url, "storage_options": options})
        ways = {"ckptturbo": ([config_only, "ckptturbo", turbo_config, ""], sys.executable, {}),
                "runai_streamer": ([url, "runai_streamer", "{}", ""], runai_python, aws),
                "download+safetensors": ([os.path.join(out, "downloaded"), "safetensors", "{}",
                                          json.dumps([url, options])], sys.executable, {}),
                # the floor: builds the model and fills every weight with random values,
                # reading nothing (what every way pays besides moving the bytes)
                "dummy": ([config_only, "dummy", "{}", ""], sys.executable, {})}
        workers = {}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ways}
        try:
            for name, (argv, python, env) in ways.items():
                print(f"warming up: {name} ...", flush=True)
                workers[name] = _EngineWorker(argv, python, env)
            names = list(ways)
            for attempt in range(repeat):
                for name in (names if attempt % 2 == 0 else names[::-1]):
                    run = workers[name].run()
                    print(f"[{attempt + 1}/{repeat}] {name}: {run.get('weights_s', run)}",
                          flush=True)
                    runs[name].append(run)
        finally:
            for w in workers.values():
                w.close()
    for name, rs in runs.items():
        done = [r for r in rs if "weights_s" in r]
        if not done:
            results[name] = rs[-1] if rs else {"unavailable": "not run"}
            continue
        weights = [r["weights_s"] for r in done]
        results[name] = {"weights_s_median": _median(weights), "weights_s": sorted(weights),
                         "peak_rss_bytes": max(r["peak_rss_bytes"] for r in done),
                         "tokens": done[-1]["tokens"]}
    ours = results["ckptturbo"].get("weights_s_median")
    floor = results["dummy"].get("weights_s_median")
    for name in ("runai_streamer", "download+safetensors"):
        theirs = results[name].get("weights_s_median")
        if ours and theirs:
            results[f"ratio_weights_vs_{name}"] = ours / theirs
            if floor is not None and theirs > floor:  # the time spent on the weights' bytes
                results[f"ratio_above_dummy_vs_{name}"] = (ours - floor) / (theirs - floor)
    return results


class _EngineWorker(Worker):
    """A warm vLLM engine process (see :func:`engine_server`); vLLM's log, sent to stderr
    (stdout carries the results), goes to ``log`` when given: why an engine could not
    start is there, beyond the one line its result carries."""

    def __init__(self, argv: list[str], python: str, env: dict[str, str],
                 log: str | None = None) -> None:
        self.unavailable = None
        with open(log or os.devnull, "w") as stderr:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([python, "-m", "benchmarks.ray_vllm", "engine", *argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=stderr, text=True, cwd=REPO,
                                         env=dict(os.environ, PYTHONPATH=REPO, **env,
                                                  VLLM_LOGGING_STREAM="ext://sys.stderr"))
        line = self._line()
        if line is None or not line.startswith("READY"):
            self.unavailable = (json.loads(line[len("RESULT "):]).get("unavailable", line)
                                if line else f"the engine exited ({self.proc.wait()})")
            self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("ray", "vllm", "all"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="bench-out/ray_vllm")
        p.add_argument("--width", type=int, default=4096, help="Ray: 2 Linear(width, width) layers")
        p.add_argument("--steps", type=int, default=6)
        p.add_argument("--every", type=int, default=2)
        p.add_argument("--step-seconds", type=float, default=4.0,
                       help="Ray: time a step spends off the host CPU (simulated by sleeping)")
        p.add_argument("--hidden", type=int, default=512, help="vLLM: Llama hidden size")
        p.add_argument("--layers", type=int, default=8)
        p.add_argument("--latency-ms", type=float, default=20.0)
        p.add_argument("--repeat", type=int, default=5, help="vLLM: measured engines per way")
        p.add_argument("--runai-python", default=sys.executable,
                       help="vLLM: the interpreter of runai_streamer's engine "
                            "(with runai-model-streamer-s3)")
    e = sub.add_parser("engine")
    e.add_argument("model")
    e.add_argument("load_format")
    e.add_argument("extra")
    e.add_argument("download")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel workers of each engine")
    args = parser.parse_args(argv)
    if args.what == "engine":
        engine_server(args.model, args.load_format, args.extra, args.download, args.tp)
        return
    from ckptturbo.testing import embedded_s3

    args.out = os.path.abspath(args.out)  # Ray workers run in a directory of their own
    os.makedirs(args.out, exist_ok=True)
    server = embedded_s3.start(tempfile.mkdtemp(prefix="seaweed"))
    report: dict[str, Any] = {}
    try:
        if args.what in ("ray", "all"):
            report["ray"] = bench_ray(server, args.out, args.width, args.steps, args.every,
                                      args.step_seconds)
        if args.what in ("vllm", "all"):
            report["vllm"] = bench_vllm(server, args.out, args.hidden, args.layers, args.latency_ms,
                                        args.repeat, args.runai_python)
    finally:
        server.stop()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
