"""Live weight updates of a running vLLM engine (CPU): ckptturbo's weight-transfer backend
beside vLLM's own ``reload_weights``, side by side in one run: ``python -m benchmarks.run
live-update [--size-mb N] [--reps N]``.

A Llama (hidden 1024, intermediate 2816, vocabulary 8192, bfloat16, as many layers as
``--size-mb`` allows; every matrix above ckptturbo's 1 MiB pack threshold) is saved to
one run on SeaweedFS behind the byte-counting proxy, then three updates follow:

* ``tenth``: whole decoder matrices replaced, up to a tenth of the model's bytes (saved
  in full; the rest dedups),
* ``all``: every tensor replaced,
* ``delta``: every tensor with 10% of its elements changed, saved with ``delta_from=``.

Engine A (``load_format="ckptturbo"``, backend ``ckptturbo``) updates with
:func:`ckptturbo.integrations.vllm.update_weights`; the proxy counts what it reads. Engine B
(``load_format="safetensors"``) is vLLM's own way on the same store: the version's
safetensors downloaded with s3fs through the same proxy, then ``reload_weights(weights_path=
..., is_checkpoint_format=True)``; its reload alone from a local copy in the page cache is
reported too, as vLLM's best case. Engine C (``load_format="runai_streamer"``, an
``s3://`` model) is vLLM's object-store path: ``reload_weights`` straight from the store
through the same proxy (only when ``runai-model-streamer-s3`` is installed: extra
``bench-runai``). Reported per update: bytes
from storage against the bytes the save added (the changed chunks: target 1.00x) and
against vLLM's full reload, seconds against vLLM's, and ckptturbo's reading alone
(``ct.load_changes`` in this process) against the download. Checked: after each update
both engines generate the same greedy tokens.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from .measure import now
from .report import Report, fmt_bytes
from .states import MiB
from .storage import environment
from .stream_s3 import Worker

log = logging.getLogger("benchmarks.live_update")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 5, 7, 9], [3, 141, 59, 26, 53]]
# update: (bytes vs changed chunks, bytes vs a full reload, seconds vs vLLM's reload)
TARGETS: dict[str, tuple[float, float | None, float | None]] = {
    "tenth": (1.0, 0.12, 0.3), "all": (1.0, None, 1.0), "delta": (1.0, 0.25, None)}


def llama_config(size_mb: int) -> Any:
    """The issue's model at ~``size_mb`` MiB of bfloat16 weights; below 64 MiB a tiny one
    (the smoke test's)."""
    from transformers import LlamaConfig

    if size_mb < 64:
        hidden, inter, vocab, layers = 128, 256, 512, 2
    else:
        hidden, inter, vocab = 1024, 2816, 8192
        per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2
        layers = max(1, round((size_mb * MiB - 2 * vocab * hidden * 2) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=hidden // 64, max_position_embeddings=256,
                       tie_word_embeddings=False, torch_dtype="bfloat16")


def random_state(cfg: Any, seed: int) -> dict[str, torch.Tensor]:
    """bfloat16 weights of the model's names and shapes (matrices N(0, 0.02), norms
    N(1, 0.02)): every tensor differs between seeds."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {n: t.shape for n, t in LlamaForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=gen) * 0.02
                   + (0 if len(shape) > 1 else 1)).to(torch.bfloat16)
            for name, shape in shapes.items()}


def versions(cfg: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The states in update order: ``base``, then one per measured update."""
    base = random_state(cfg, 0)
    tenth = dict(base)
    fresh = random_state(cfg, 1)
    total = sum(t.nbytes for t in base.values())
    replaced = 0
    for name in (n for n, t in base.items() if n.startswith("model.layers.") and t.dim() > 1):
        if replaced + base[name].nbytes > total // 10:
            continue
        tenth[name] = fresh[name]
        replaced += base[name].nbytes
    changed = random_state(cfg, 2)
    gen = torch.Generator().manual_seed(3)
    delta = {}
    for name, t in changed.items():
        mask = torch.rand(t.shape, generator=gen) < 0.1
        delta[name] = torch.where(mask, (t.float() + 0.01).to(t.dtype), t)
    return {"base": base, "tenth": tenth, "all": changed, "delta": delta}


def write_safetensors(state: dict[str, torch.Tensor], cfg: Any, directory: str) -> int:
    """A model directory vLLM's ``reload_weights(weights_path=...)`` reads: config and one
    safetensors file; its bytes."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    cfg.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    save_file({n: t.contiguous() for n, t in state.items()}, path)
    return os.path.getsize(path)


# --------------------------------------------------------------------------- engine process

def engine_main(kind: str, model: str, extra: str) -> None:
    """A vLLM engine answering one line per command on stdin: ``update <url>`` (ckptturbo)
    or ``reload <dir>`` (vLLM's ``reload_weights``); prints ``RESULT {seconds, tokens,
    report}``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from ckptturbo.integrations import vllm as ctv

    options = json.loads(extra)
    common = {"skip_tokenizer_init": True, "dtype": "bfloat16", "enforce_eager": True,
              "max_model_len": 128, "max_num_seqs": 2, "seed": 0}
    if kind == "ckptturbo":
        llm = LLM(model=model, load_format="ckptturbo", model_loader_extra_config=options,
                  weight_transfer_config={"backend": "ckptturbo"}, **common)
    else:  # "safetensors" (a local directory) or "runai_streamer" (an s3:// model)
        llm = LLM(model=model, load_format=kind, **common)
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)

    def tokens() -> list[list[int]]:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    print("READY " + json.dumps({"tokens": tokens()}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        report: dict[str, Any] = {}
        started = time.perf_counter()
        if command == "update":
            ctv.update_weights(llm, arg, storage_options=options.get("storage_options"))
            seconds = time.perf_counter() - started
            (last,) = llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last)
            report = {"full": last.full, "deltas": last.deltas, "unchanged": last.unchanged}
        else:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": arg,
                                                         "is_checkpoint_format": True})
            seconds = time.perf_counter() - started
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens(), **report}),
              flush=True)


def _read_seconds(served_url: str, url: str, options: dict[str, Any]) -> float:
    """Seconds ``ct.load_changes`` takes alone for the update from ``served_url`` to
    ``url`` (what the engine's update spends reading, verifying and decoding)."""
    import ckptturbo as ct

    served = {n: v.key for n, v in ct.tensor_versions(served_url, storage_options=options)
              .items()}
    started = now()
    for _ in ct.load_changes(url, served, storage_options=options):
        pass
    return now() - started


class _Engine(Worker):
    """An engine process (see :func:`engine_main`), asked one command at a time."""

    def __init__(self, kind: str, model: str, extra: dict[str, Any], scratch: str,
                 env_extra: dict[str, str] | None = None) -> None:
        import subprocess

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (REPO, os.environ.get("PYTHONPATH")) if p), TMPDIR=scratch,
            **(env_extra or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.live_update", kind,
                                      model, json.dumps(extra)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.unavailable = None
        line = self._line()
        if line is None or not line.startswith("READY"):
            raise RuntimeError(f"the {kind} engine did not start ({self.proc.wait()})")
        self.tokens = json.loads(line[len("READY "):])["tokens"]

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self._line()
        if line is None:
            raise RuntimeError(f"the engine exited ({self.proc.wait()}) on {command!r}")
        return json.loads(line[len("RESULT "):])


# --------------------------------------------------------------------------- the scenario

def _store_versions(be: Any, cfg: Any, run: str, work: str) -> dict[str, dict[str, Any]]:
    """Each version saved with ckptturbo (the delta one over the previous save) and as
    safetensors, both on the store (the safetensors through the server itself, not the
    counting proxy) and in a local directory: ``{version: {written, local, remote}}``."""
    import s3fs

    import ckptturbo as ct

    direct = s3fs.S3FileSystem(skip_instance_cache=True, **be.direct_options)
    stored: dict[str, dict[str, Any]] = {}
    previous = None
    for name, state in versions(cfg).items():
        url = f"{run}/{name}"
        durable = ct.save(state, url, storage_options=be.storage_options,
                          delta_from=previous if name == "delta" else None).wait()
        local = os.path.join(work, f"st-{name}")
        write_safetensors(state, cfg, local)
        remote = f"{run}-safetensors/{name}"
        for file in os.listdir(local):
            direct.put_file(os.path.join(local, file), f"{remote}/{file}")
        stored[name] = {"written": durable.bytes_written, "local": local, "remote": remote,
                        "model_bytes": sum(t.nbytes for t in state.values())}
        previous = url
    return stored


def _runai_env(be: Any) -> dict[str, str] | None:
    """The environment in which vLLM's ``runai_streamer`` reads the store through the
    counting proxy; None when its S3 client is not installed (extra ``bench-runai``)."""
    import importlib.util

    if importlib.util.find_spec("runai_model_streamer_s3") is None:
        return None
    options = be.storage_options
    return {"AWS_ENDPOINT_URL": options["client_kwargs"]["endpoint_url"],
            "AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


def _download(be: Any, remote: str, local: str) -> float:
    """Seconds to copy ``remote`` into ``local`` through the counting proxy (s3fs)."""
    import s3fs

    shutil.rmtree(local, ignore_errors=True)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **be.storage_options)
    started = now()
    fs.get(f"{remote}/", local + "/", recursive=True)
    return now() - started


def _one_rep(be: Any, cfg: Any, run: str, work: str, config_dir: str) -> tuple[dict, bool]:
    """Every update once, both ways; the samples and whether the engines agreed."""
    stored = _store_versions(be, cfg, run, work)
    log.info("model %s; saves wrote %s", fmt_bytes(stored["base"]["model_bytes"]),
             {k: fmt_bytes(v["written"]) for k, v in stored.items()})
    scratch = os.path.join(work, "tmp")
    os.makedirs(scratch, exist_ok=True)
    ours = _Engine("ckptturbo", config_dir, {"url": f"{run}/base",
                                              "storage_options": be.storage_options}, scratch)
    theirs = _Engine("safetensors", stored["base"]["local"], {}, scratch)
    runai_env = _runai_env(be)
    runai = (None if runai_env is None else
             _Engine("runai_streamer", stored["base"]["remote"], {}, scratch, runai_env))
    samples, agree, served = {}, ours.tokens == theirs.tokens, "base"
    try:
        for name in TARGETS:
            be.proxy.reset_stats()
            got = ours.ask(f"update {run}/{name}")
            fetched = be.proxy.stats().bytes_down
            be.proxy.reset_stats()
            downloaded = os.path.join(work, "downloaded")
            download_s = _download(be, stored[name]["remote"], downloaded)
            reload = theirs.ask(f"reload {downloaded}")
            peer_bytes = be.proxy.stats().bytes_down
            cached = theirs.ask(f"reload {stored[name]['local']}")
            streamed: dict[str, Any] = {}
            if runai is not None:  # vLLM's own object-store path: reload_weights from s3://
                be.proxy.reset_stats()
                streamed = runai.ask(f"reload {stored[name]['remote']}")
                streamed["bytes"] = be.proxy.stats().bytes_down
            read_s = _read_seconds(f"{run}/{served}", f"{run}/{name}", be.storage_options)
            served = name
            same = (got["tokens"] == reload["tokens"] == cached["tokens"]
                    and streamed.get("tokens", got["tokens"]) == got["tokens"])
            agree &= same
            samples[name] = {
                "bytes": fetched, "seconds": got["seconds"], "read_seconds": read_s,
                "changed_chunk_bytes": stored[name]["written"], "peer_bytes": peer_bytes,
                "model_bytes": stored[name]["model_bytes"], "download_seconds": download_s,
                "peer_seconds": download_s + reload["seconds"],
                "cached_reload_seconds": cached["seconds"], "same_tokens": same,
                "runai_seconds": streamed.get("seconds"), "runai_bytes": streamed.get("bytes"),
                "tensors": {k: got[k] for k in ("full", "deltas", "unchanged")}}
            log.info("%s: ckptturbo %s in %.3f s (%s; reading alone %.3f s); vLLM download "
                     "%.3f s + reload %.3f s; reload from the page cache %.3f s", name,
                     fmt_bytes(fetched), got["seconds"], samples[name]["tensors"], read_s,
                     download_s, reload["seconds"], cached["seconds"])
    finally:
        ours.close()
        theirs.close()
        if runai is not None:
            runai.close()
    return samples, agree


def scenario(args: Any) -> Report:
    cfg = llama_config(args.size_mb)
    report = Report("live-update", {"size_mb": args.size_mb, "reps": args.reps,
                                    "layers": cfg.num_hidden_layers,
                                    "hidden": cfg.hidden_size, "dtype": "bfloat16"})
    work = tempfile.mkdtemp(prefix="ckptturbo-bench-live-", dir=args.workdir)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in TARGETS}
    agree = True
    try:
        with environment("s3", args.workdir, args.conn_mbps) as env:
            config_dir = os.path.join(work, "config")
            cfg.save_pretrained(config_dir)
            for rep in range(args.reps):
                run = env.backend.url(f"live-{rep}")
                got, same = _one_rep(env.backend, cfg, run, work, config_dir)
                agree &= same
                for name, sample in got.items():
                    samples[name].append(sample)
                env.backend.remove(run)
                env.backend.remove(f"{run}-safetensors")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.raw["samples"] = samples
    _compare(report, samples)
    report.check("updated engine generates what vLLM's reloaded engine does", agree)
    report.note("peers: vLLM's reload_weights through runai_streamer from the same store "
                "(when its S3 client, extra bench-runai, is installed), and after an s3fs "
                "download of the same version's safetensors through the same proxy; 'page "
                "cache' rows: the reload alone from a local copy, its best case. The bytes "
                "target allows 2% for the manifest")
    return report


def _compare(report: Report, samples: dict[str, list[dict[str, Any]]]) -> None:
    """The ratios of each update: bytes are exact (the first repetition), times the best."""
    for name, (vs_changed, vs_full, vs_time) in TARGETS.items():
        first = samples[name][0]
        best = {key: min(s[key] for s in samples[name])
                for key in ("seconds", "read_seconds", "peer_seconds", "download_seconds",
                            "cached_reload_seconds")}
        peer = "download + reload_weights"
        report.compare(f"{name}: bytes read / changed chunks", first["bytes"],
                       first["changed_chunk_bytes"], "bytes", peer_name="bytes the save added",
                       target=vs_changed * 1.02)
        report.compare(f"{name}: bytes read / full reload", first["bytes"],
                       first["peer_bytes"], "bytes", peer_name=peer, target=vs_full)
        report.compare(f"{name}: seconds / full reload", best["seconds"],
                       best["peer_seconds"], "s", peer_name=peer, target=vs_time)
        report.compare(f"{name}: reading alone / download", best["read_seconds"],
                       best["download_seconds"], "s", peer_name="s3fs download",
                       note="ct.load_changes in the benchmark's process: read, verified, "
                            "decoded, no swap")
        report.compare(f"{name}: seconds / reload from page cache", best["seconds"],
                       best["cached_reload_seconds"], "s", peer_name="reload_weights (cache)")
        if first.get("runai_seconds") is not None:
            fastest = min(s["runai_seconds"] for s in samples[name])
            report.compare(f"{name}: seconds / runai_streamer reload", best["seconds"], fastest,
                           "s", peer_name="reload_weights via runai_streamer", target=vs_time)
            report.compare(f"{name}: bytes read / runai_streamer reload", first["bytes"],
                           first["runai_bytes"], "bytes",
                           peer_name="reload_weights via runai_streamer")


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2], sys.argv[3])
