"""The benchmark scenarios run end to end at a tiny size, write the JSON the docs quote, and
every correctness check inside them passes (what was loaded equals what was saved).

Performance targets are not asserted here: at 8 MiB fixed costs dominate, and the numbers
of the default sizes are in docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ["local-1p", "s3-1p", "ddp-4r-local"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    work = tmp_path_factory.mktemp("bench-work")
    docs = {}
    for name in SCENARIOS:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.run", name, "--size-mb", "8", "--reps", "1",
             "--out", str(out), "--workdir", str(work)],
            cwd=ROOT, capture_output=True, text=True, timeout=80)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        with open(out / f"{name}.json") as f:
            docs[name] = json.load(f)
        assert (out / f"{name}.png").stat().st_size > 0
    return docs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_report(results, name):
    doc = results[name]
    for key in ("scenario", "params", "date", "machine", "comparisons", "checks", "checks_passed",
                "raw"):
        assert key in doc, key
    assert doc["scenario"] == name
    assert doc["params"]["size_mb"] == 8
    assert doc["checks"] and doc["checks_passed"], doc["checks"]
    for c in doc["comparisons"]:
        assert {"name", "ckptturbo", "peer", "ratio", "target", "met"} <= set(c)
        assert c["ckptturbo"] >= 0 and c["peer"] > 0


@pytest.mark.timeout(240)
def test_byte_accounting(results):
    """Bytes are exact, unlike times: check them even at the tiny size."""
    by_name = {c["name"]: c for c in results["ddp-4r-local"]["comparisons"]}
    assert by_name["total bytes written"]["ratio"] <= 1.02
    assert by_name["max/mean bytes per rank"]["ratio"] <= 1.10
    s3 = {c["name"]: c for c in results["s3-1p"]["comparisons"]}
    served = s3["bytes served by storage per load"]
    assert served["ckptturbo"] >= results["s3-1p"]["raw"]["state"]["bytes"]  # the proxy counted it


@pytest.mark.timeout(300)
def test_coordinator_scale_at_a_tiny_world(tmp_path):
    """The coordinator benchmark end to end at 4 and 8 simulated ranks (2 layers, shard
    groups of 2); its byte counts are exact, so the per-rank plan size is checked here."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "coordinator-scale", "--worlds", "4,8",
         "--layers", "2", "--shard-group", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(tmp_path / "coordinator-scale.json") as f:
        doc = json.load(f)
    assert doc["checks"] and doc["checks_passed"], doc["checks"]
    by_name = {c["name"]: c for c in doc["comparisons"]}
    for workload in ("hsdp-72b", "ddp-3b"):
        assert by_name[f"{workload} @ 8: largest per-rank plan"]["ratio"] <= 1.0
        assert by_name[f"{workload}: scatter bytes growth exponent"]["ckptturbo"] <= 1.05
    rows = doc["raw"]["rows"]
    assert {(r["workload"], r["ranks"]) for r in rows} == {(w, n) for w in ("hsdp-72b", "ddp-3b")
                                                           for n in (4, 8)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module, scenario",
                         [("gpu_load", "gpu-load"), ("gpu_stream", "gpu-stream")])
def test_gpu_benchmarks_check_their_loads_on_the_cpu(tmp_path, module, scenario):
    """The GPU load benchmarks' CPU mode: the same loads, checked bit-exact (CUDA's own run
    is in docs/benchmarks.md)."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--device", "cpu",
                           "--size-mb", "16", "--reps", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / f"{scenario}.json") as f:
        doc = json.load(f)
    assert doc["checks"] == {"bit-exact": True}
    assert [c["peer"] > 0 for c in doc["comparisons"]] == [True] * len(doc["comparisons"])


@pytest.mark.timeout(300)
def test_live_update_at_a_tiny_size(tmp_path):
    """benchmarks/live_update.py end to end with a tiny Llama (tensors below the pack
    threshold, so every update rereads the one pack: ratios to a full reload mean nothing
    here); both engines agree after every update, and an update reads what the save added
    plus the manifest."""
    pytest.importorskip("vllm")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "live-update", "--size-mb", "8", "--reps", "1",
         "--out", str(tmp_path), "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(tmp_path / "live-update.json") as f:
        doc = json.load(f)
    assert doc["checks"] and doc["checks_passed"], doc["checks"]
    assert (tmp_path / "live-update.png").stat().st_size > 0
    by_name = {c["name"]: c for c in doc["comparisons"]}
    for update in ("tenth", "all", "delta"):
        assert 1.0 <= by_name[f"{update}: bytes read / changed chunks"]["ratio"] <= 1.10
    assert doc["raw"]["samples"]["delta"][0]["tensors"]["deltas"] > 0
