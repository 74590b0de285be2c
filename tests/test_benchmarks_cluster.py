"""The cluster benchmark end to end at a tiny size, and its clean-up when interrupted.

Every default part (the link probe first) runs on a 2-node miniature cluster (network
namespaces, shaped links, the store behind its own link) with 4 MiB and the rates scaled
up 4x, so that it finishes in about a minute or two; its correctness checks must pass (what
the probe and the loads read is what was written, 0 bytes from the store on recovery,
nothing left behind), and each load is set against the probe's attainable time. Timings
and targets are not asserted: at this size fixed costs dominate, and the shared CI cores
are busy (the results say so).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptturbo.testing import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _ours(pid: int) -> list[str]:
    """Namespaces and links that the benchmark process ``pid`` made (netns's naming)."""
    tag = f"ct{pid % 100000}x"
    run = Path("/run/netns")
    names = [p.name for p in run.glob(f"{tag}*")] if run.exists() else []
    return names + [p.name for p in Path("/sys/class/net").glob(f"{tag}*")]


def _gone(pid: int, deadline_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + deadline_s
    while _ours(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _ours(pid)


@pytest.mark.timeout(400)
def test_every_part_runs_on_a_tiny_cluster(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.run", "cluster", "--size-mb", "4", "--reps", "1",
         "--nodes", "2", "--scale", "0.01", "--out", str(tmp_path), "--workdir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=360)
    assert proc.returncode == 0, out[-4000:]
    assert not _gone(proc.pid)
    doc = json.loads((tmp_path / "cluster.json").read_text())
    assert (tmp_path / "cluster.png").stat().st_size > 0
    assert doc["checks"] and doc["checks_passed"], doc["checks"]
    rows = {(r["scenario"], r["side"]) for r in doc["raw"]["rows"]}
    for scenario, side in [("link probe PUT 4r/2n", "botocore 1 MiB x1/rank"),
                           ("link probe GET 4r/2n", "botocore 1 MiB x1/rank"),
                           ("no tc PUT 4r, store's namespace",
                            "SeaweedFS direct, botocore 1 MiB x1/rank"),
                           ("DDP save 4r/2n", "DCP fsspec"),
                           ("whole-state load 4r/2n", "ckptturbo"),
                           ("grouped load 2r/1n", "ckptturbo"), ("grouped load 4r/2n", "ckptturbo"),
                           ("recovery, node lost 4r/2n", "ckptturbo"),
                           ("link probe node link 4r/2n", "raw gloo"),
                           ("durable load 4r/2n", "ckptturbo"),
                           ("stream safetensors 1 process/1n", "ckptturbo"),
                           ("streaming across ranks 4r/2n", "ckptturbo")]:
        assert (scenario, side) in rows, sorted(rows)
    for row in doc["raw"]["rows"]:
        assert row["limit_s"] > 0 and row["median_s"] > 0 and 0 <= row["busy_max"] <= 1
        assert row["valid"] == (row["busy_max"] <= 0.70)
    probe = {r["side"]: r for r in doc["raw"]["rows"] if r["scenario"] == "link probe GET 4r/2n"}
    load = next(r for r in doc["raw"]["rows"]
                if (r["scenario"], r["side"]) == ("whole-state load 4r/2n", "ckptturbo"))
    attainable = load["limit_s"] * probe["botocore 1 MiB x1/rank"]["over_limit"]
    assert load["attainable_s"] == pytest.approx(attainable)
    # the recovery against what raw gloo copies into the lost node attain on its link
    node_link = next(r for r in doc["raw"]["rows"] if r["scenario"] == "link probe node link 4r/2n")
    recovery = next(r for r in doc["raw"]["rows"]
                    if (r["scenario"], r["side"]) == ("recovery, node lost 4r/2n", "ckptturbo"))
    assert recovery["attainable_s"] == pytest.approx(recovery["limit_s"] * node_link["over_limit"])
    by_name = {c["name"]: c for c in doc["comparisons"]}
    assert "whole-state load 4r/2n: time / attainable" in by_name
    assert "recovery, node lost 4r/2n: time / attainable" in by_name
    read = by_name["whole-state load 4r/2n: bytes from storage (ckptturbo's count)"]
    assert read["ratio"] <= 1.001


@pytest.mark.timeout(200)
def test_an_interrupted_run_leaves_nothing_behind(tmp_path):
    """Ctrl-C once the cluster is up and ranks are running: namespaces, links, the store's
    processes and the ranks are all gone afterwards."""
    # Ctrl-C as a terminal delivers it, whatever the test runner's own disposition: one started
    # in the background ignores SIGINT, and a Python child that inherits that never raises
    # KeyboardInterrupt. A session of its own: a run that fails the test is killed whole,
    # ranks and store too, not left to load the machine under the tests after it.
    interruptible = ("import runpy, signal\n"
                     "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                     "runpy.run_module('benchmarks.run', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen(
        [sys.executable, "-c", interruptible, "cluster", "--size-mb", "4", "--reps", "3",
         "--nodes", "2", "--parts", "ddp", "--out", str(tmp_path), "--workdir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    seen = []
    deadline = time.monotonic() + 150
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if "rep 0:" in line or time.monotonic() > deadline:
                break
        assert any("rep 0:" in line for line in seen), "".join(seen[-40:])
        assert _ours(proc.pid), "the cluster should exist while it runs"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert not _gone(proc.pid)
    started = re.compile(r"SeaweedFS \(pid (\d+)\)")
    weed = next(int(m.group(1)) for m in map(started.search, seen) if m)
    stat = Path(f"/proc/{weed}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # gone, or a zombie
