"""Loading a sharded safetensors model from S3 through a latency-injecting proxy.

Compares, in one run and on the same objects:
  ckptturbo      ct.stream_safetensors (parallel ranged GETs, bounded prefetch)
  safe_open      ct.safe_open on each shard, ``for k in f.keys(): f.get_tensor(k)``
  naive s3fs     fs.open(file).read() + safetensors.torch.load, one file after another
  s3fs cat       safetensors.torch.load(fs.cat_file(file)) (safetensors.safe_open cannot
                 take a file object, so this is the closest "remote safe_open")
  Run:ai         runai-model-streamer(-s3) SafetensorsStreamer on the same s3:// URLs
  ckptturbo no proxy   straight to SeaweedFS: what loopback S3 gives on this machine at all
  local ckptturbo / local safetensors   the same files from local disk (page cache): the
                 ceiling (safetensors.torch.load of the file's bytes: load_file would only mmap)

SeaweedFS runs on loopback behind ckptturbo.testing's fault proxy (no faults, in a process
of its own), which adds a first-byte delay per request and caps each connection's
bandwidth, like a remote object store; ``--settings`` lists the proxy settings, each
measured in turn (one table each).
Each method runs in a warm process of its own (imports done, one unmeasured load first,
then one load per repetition on request; peak RSS above the process's baseline just
before each load). Repetitions alternate between the methods, in an order that flips
every repetition. Tensors are dropped as they arrive.

Run:ai Model Streamer is a benchmark-only extra (``pip install 'ckptturbo[bench-runai]'``,
or ``--runai-python`` naming an interpreter that has it); without it, its row says why.

    python -m benchmarks.stream_s3                 # ~2 GiB in 4 shards
    python -m benchmarks.stream_s3 --size-mb 256   # quick run
    python -m benchmarks.stream_s3 --size-mb 512 --repeat 5 --settings 20:0,20:30 \
        --methods ckptturbo,safe_open,Run:ai --runai-python /tmp/rmsvenv/bin/python
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

MiB = 1 << 20
METHODS = ["ckptturbo", "safe_open", "naive s3fs", "s3fs cat", "Run:ai", "ckptturbo no proxy",
           "local ckptturbo", "local safetensors"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the model -----------------------------------------------------------------------------

def make_model(directory: str, size_mb: int, shards: int) -> list[str]:
    """LLM-like shards: per layer a few large bf16 matrices and small norms/biases."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    per_shard = size_mb * MiB // shards
    g = torch.Generator().manual_seed(0)
    paths, weight_map = [], {}
    for s in range(shards):
        tensors, used, layer = {}, 0, 0
        while used < per_shard:
            big = min(8 * MiB, per_shard - used) // 2  # bf16 elements
            for name in ("q", "k", "v", "o"):
                if big <= 0:
                    break
                tensors[f"s{s}.l{layer}.{name}"] = torch.randn(big, generator=g).bfloat16()
                used += 2 * big
                big = min(8 * MiB, per_shard - used) // 2
            tensors[f"s{s}.l{layer}.norm"] = torch.randn(4096, generator=g)
            used += 4 * 4096
            layer += 1
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, os.path.join(directory, name))
        weight_map.update(dict.fromkeys(tensors, name))
        paths.append(os.path.join(directory, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return paths


# --- workers (one warm process per method) -------------------------------------------------------

def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def prepare(method: str, spec: dict[str, Any]) -> Any:
    """Imports and settings, before any clock: what a warm process already has."""
    import torch  # noqa: F401

    if method != "Run:ai":
        return None
    options = spec["storage_options"]
    os.environ.update({"AWS_ACCESS_KEY_ID": options["key"],
                       "AWS_SECRET_ACCESS_KEY": options["secret"],
                       "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                       "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                       "RUNAI_STREAMER_CONCURRENCY": str(spec["streams"]),
                       "RUNAI_STREAMER_MEMORY_LIMIT": str(spec["memory_limit"])})
    try:
        from runai_model_streamer import SafetensorsStreamer
        from runai_model_streamer.s3_utils.s3_utils import S3Credentials
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"unavailable": f"runai-model-streamer is not importable ({exc}): "
                               "pip install 'ckptturbo[bench-runai]' or pass --runai-python"}
    return SafetensorsStreamer, S3Credentials


def load(method: str, spec: dict[str, Any], peer: Any) -> dict[str, Any]:
    """Load the model once, one way: seconds, bytes, peak memory above the baseline, CPU.

    Imports are per method: Run:ai's interpreter (``--runai-python``) need not have
    ckptturbo's dependencies."""
    options = spec["storage_options"]
    urls, local = spec["urls"], spec["local_files"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    baseline = _rss("VmRSS")
    cpu0 = time.process_time()
    began = time.perf_counter()
    nbytes, extra = 0, {}
    if method in ("ckptturbo", "ckptturbo no proxy", "local ckptturbo"):
        from ckptturbo.stream import stream_safetensors

        target, opts = {"ckptturbo": (spec["url"], options),
                        "ckptturbo no proxy": (spec["url"], spec["direct_options"]),
                        "local ckptturbo": (os.path.dirname(local[0]), None)}[method]
        stream = stream_safetensors(target, storage_options=opts, streams=spec["streams"],
                                    memory_limit=spec["memory_limit"])
        first = None
        for _, t in stream:
            first = first or time.perf_counter() - began
            nbytes += t.nbytes
        extra = {"peak_bytes_held": stream.stats["peak_bytes_held"], "first_tensor_s": first,
                 "requests": stream.stats["requests"], "setup_s": stream.stats["setup_seconds"]}
    elif method == "safe_open":
        from ckptturbo.stream import safe_open

        for url in urls:
            with safe_open(url, storage_options=options, streams=spec["streams"],
                           memory_limit=spec["memory_limit"]) as f:
                for k in f.keys():
                    nbytes += f.get_tensor(k).nbytes
    elif method in ("naive s3fs", "s3fs cat"):
        import fsspec
        from safetensors.torch import load as st_load

        fs = fsspec.filesystem("s3", **options)
        for url in urls:
            if method == "naive s3fs":
                with fs.open(url, "rb") as f:
                    tensors = st_load(f.read())
            else:
                tensors = st_load(fs.cat_file(url))
            nbytes += sum(t.nbytes for t in tensors.values())
            del tensors
    elif method == "Run:ai":
        streamer_cls, credentials = peer
        creds = credentials(access_key_id=options["key"], secret_access_key=options["secret"],
                            region_name="us-east-1", endpoint=spec["endpoint"])
        try:
            with streamer_cls() as streamer:
                streamer.stream_files(urls, s3_credentials=creds, device="cpu")
                for _, t in streamer.get_tensors():
                    nbytes += t.nbytes
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    elif method == "local safetensors":
        from safetensors.torch import load as st_load

        for path in local:  # read + deserialise: load_file would only mmap, touching nothing
            with open(path, "rb") as f:
                tensors = st_load(f.read())
            nbytes += sum(t.nbytes for t in tensors.values())
            del tensors
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "bytes": nbytes, "peak_mem": _rss("VmHWM") - baseline,
            "cpu_s": time.process_time() - cpu0, **extra}


def serve(method: str, spec: dict[str, Any]) -> None:
    """A warm worker: one unmeasured load, then one load per line read from stdin."""
    peer = prepare(method, spec)
    if isinstance(peer, dict):
        print("RESULT " + json.dumps(peer), flush=True)
        return
    warm = load(method, spec, peer)  # clients, connections, allocator
    if "unavailable" in warm:
        print("RESULT " + json.dumps(warm), flush=True)
        return
    print("READY", flush=True)
    for _ in sys.stdin:
        print("RESULT " + json.dumps(load(method, spec, peer)), flush=True)


class Worker:
    """A warm process loading the model one way, on request."""

    def __init__(self, method: str, spec: dict[str, Any], python: str) -> None:
        paths = (REPO, os.environ.get("PYTHONPATH"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        if method == "Run:ai":
            env["AWS_ENDPOINT_URL"] = spec["endpoint"]
        self.proc = subprocess.Popen([python, "-m", "benchmarks.stream_s3", "--serve", method,
                                      "--spec", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.unavailable: str | None = None
        line = self._line()
        if line is None or not line.startswith("READY"):
            self.unavailable = (json.loads(line[len("RESULT "):]).get("unavailable", line)
                                if line else f"the worker exited ({self.proc.wait()})")
            self.close()

    def _line(self) -> str | None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(("READY", "RESULT ")):
                return line.strip()
        return None

    def run(self) -> dict[str, Any]:
        if self.unavailable:
            return {"unavailable": self.unavailable}
        self.proc.stdin.write("run\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self._line()
        if line is None:
            self.unavailable = f"the worker exited ({self.proc.wait()})"
            return {"unavailable": self.unavailable}
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the driver ---------------------------------------------------------------------------------

def parse_settings(text: str) -> list[tuple[float, float]]:
    """"20:0,20:30" -> [(20 ms, no cap), (20 ms, 30 MB/s per connection)]."""
    out = []
    for item in text.split(","):
        latency, _, cap = item.partition(":")
        out.append((float(latency), float(cap or 0)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="stream safetensors from S3 through a slow link")
    p.add_argument("--size-mb", type=int, default=2048)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--settings", default="20:100",
                   help="proxy settings LATENCY_MS:CAP_MBPS[,...] (cap 0: none), one table each")
    p.add_argument("--streams", type=int, default=32, help="parallel GETs for ckptturbo and Run:ai")
    p.add_argument("--memory-limit-mb", type=int, default=2048)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--runai-python", default=sys.executable,
                   help="the interpreter of Run:ai's worker (one with runai-model-streamer-s3)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--repeat", type=int, default=5,
                   help="measured loads per method, after a warm-up")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, json.loads(args.spec))
        return

    from ckptturbo.store import Store
    from ckptturbo.testing import embedded_s3
    from ckptturbo.testing.proxy_process import ProxyProcess

    os.makedirs(args.out, exist_ok=True)
    methods = args.methods.split(",")
    report: dict[str, Any] = {"args": vars(args), "settings": []}
    with tempfile.TemporaryDirectory(prefix="ckptturbo-bench-") as tmp, embedded_s3.running() as s3:
        print(f"making a {args.size_mb} MiB model in {args.shards} shards ...", flush=True)
        files = make_model(os.path.join(tmp, "model"), args.size_mb, args.shards)
        url = s3.url("bench")
        store = Store(url, s3.storage_options)
        for path in [*files, os.path.join(tmp, "model", "model.safetensors.index.json")]:
            with open(path, "rb") as f:
                store.put(store.join(store.root, os.path.basename(path)), f.read())
        total = sum(os.path.getsize(f) for f in files)
        report["model_bytes"] = total
        for latency_ms, cap in parse_settings(args.settings):
            proxy = ProxyProcess(s3.endpoint, latency_s=latency_ms / 1000, conn_rate=cap * 1e6)
            spec = {"url": url, "urls": [f"{url}/{os.path.basename(f)}" for f in files],
                    "local_files": files,
                    "storage_options": proxy.storage_options(s3.storage_options),
                    "endpoint": proxy.endpoint, "direct_options": s3.storage_options,
                    "streams": args.streams, "memory_limit": args.memory_limit_mb * MiB}
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            workers: dict[str, Worker] = {}
            try:
                for m in methods:
                    print(f"warming up: {m} ...", flush=True)
                    python = args.runai_python if m == "Run:ai" else sys.executable
                    workers[m] = Worker(m, spec, python)
                for attempt in range(args.repeat):  # alternating; the order flips every time
                    for method in (methods if attempt % 2 == 0 else methods[::-1]):
                        remote = not method.startswith("local") and "no proxy" not in method
                        if remote:
                            proxy.control.reset_stats()
                        result = workers[method].run()
                        if remote and "unavailable" not in result:
                            result["proxy"] = proxy.control.stats().to_json()
                        print(f"[{attempt + 1}/{args.repeat}] {method}: "
                              f"{result.get('seconds', result.get('unavailable'))}", flush=True)
                        runs[method].append(result)
            finally:
                for w in workers.values():
                    w.close()
                proxy.stop()
            rows = [(m, median_run(r)) for m, r in runs.items()]
            print_table(rows, total, args, latency_ms, cap)
            report["settings"].append({"latency_ms": latency_ms, "conn_mbps": cap, "median": rows,
                                       "ratios": ratios(rows), "runs": runs})
    with open(os.path.join(args.out, "stream_s3.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "stream_s3.png"))


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (all its fields), with the spread of the times."""
    done = sorted((r for r in results if "seconds" in r), key=lambda r: r["seconds"])
    if not done:
        return results[-1] if results else {"unavailable": "not run"}
    pick = dict(done[len(done) // 2])
    pick["all_seconds"] = [r["seconds"] for r in done]
    return pick


def ratios(rows: list[tuple[str, dict]]) -> dict[str, float]:
    """Ratios of medians: ckptturbo / Run:ai, safe_open / ckptturbo, safe_open / Run:ai."""
    med = {m: r["seconds"] for m, r in rows if "seconds" in r}
    pairs = [("ckptturbo", "Run:ai"), ("safe_open", "ckptturbo"), ("safe_open", "Run:ai")]
    return {f"{a}/{b}": med[a] / med[b] for a, b in pairs if a in med and b in med}


def print_table(rows: list[tuple[str, dict]], total: int, args: argparse.Namespace,
                latency_ms: float, cap: float) -> None:
    naive = next((r["seconds"] for m, r in rows if m == "naive s3fs" and "seconds" in r), None)
    capped = f"{cap:g} MB/s per connection" if cap else "no bandwidth cap"
    print(f"\nmodel: {total / 1e9:.2f} GB in {args.shards} shards; proxy: {latency_ms:g} ms "
          f"first byte per request, {capped}; median of {args.repeat} warm run(s)\n")
    head = (f"{'method':<18} {'median s':>8} {'min-max s':>11} {'GB/s':>7} {'vs naive':>9} "
            f"{'conns':>6} {'peak mem':>10} {'CPU s':>6}")
    print(head)
    print("-" * len(head))
    for method, r in rows:
        if "unavailable" in r:
            print(f"{method:<18} unavailable: {r['unavailable']}")
            continue
        gbps = r["bytes"] / r["seconds"] / 1e9
        ratio = f"{naive / r['seconds']:.2f}x" if naive else "-"
        conns = r.get("proxy", {}).get("peak_in_flight")
        spread = f"{min(r['all_seconds']):.2f}-{max(r['all_seconds']):.2f}"
        print(f"{method:<18} {r['seconds']:>8.2f} {spread:>11} {gbps:>7.3f} {ratio:>9} "
              f"{conns or '-':>6} {r['peak_mem'] / MiB:>6.0f} MiB {r['cpu_s']:>6.1f}")
    for name, value in ratios(rows).items():
        print(f"ratio {name}: {value:.2f}")
    print("\nconns: peak concurrent requests seen by the proxy; peak mem: peak RSS above the "
          "loader's baseline; CPU s: the loader process's CPU time (Run:ai's native threads "
          "included)")


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    settings = report["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        done = [(m, r["seconds"]) for m, r in setting["median"] if "seconds" in r]
        ax.bar([m for m, _ in done], [v for _, v in done])
        cap = f"{setting['conn_mbps']:g} MB/s/conn" if setting["conn_mbps"] else "no cap"
        ax.set_title(f"{setting['latency_ms']:g} ms per request, {cap}")
        ax.set_ylabel("seconds (median)")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
