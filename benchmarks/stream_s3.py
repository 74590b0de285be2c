"""Loading a sharded safetensors model from S3 through a latency-injecting proxy.

Compares, in one run and on the same objects:
  ckptturbo      ct.stream_safetensors (parallel ranged GETs, bounded prefetch)
  naive s3fs     fs.open(file).read() + safetensors.torch.load, one file after another
  s3fs cat       safetensors.torch.load(fs.cat_file(file)) (safetensors.safe_open cannot
                 take a file object, so this is the closest "remote safe_open")
  Run:ai         runai-model-streamer(-s3) SafetensorsStreamer on the same s3:// URLs
  ckptturbo no proxy   straight to SeaweedFS: what loopback S3 gives on this machine at all
  local ckptturbo / local safetensors   the same files from local disk (page cache): the
                 ceiling (safetensors.torch.load of the file's bytes: load_file would only mmap)

SeaweedFS runs on loopback behind ckptturbo.testing's fault proxy (no faults, in a process
of its own), which adds a first-byte delay per request and caps each connection's
bandwidth, like a remote object store.
Each method runs in a fresh subprocess (clean memory measurement: peak RSS above the
process's baseline just before loading). Tensors are dropped as they arrive.

    python -m benchmarks.stream_s3                 # ~2 GiB in 4 shards
    python -m benchmarks.stream_s3 --size-mb 256   # quick run
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
METHODS = ["ckptturbo", "naive s3fs", "s3fs cat", "Run:ai", "ckptturbo no proxy", "local ckptturbo",
           "local safetensors"]


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


# --- workers (one per subprocess) -------------------------------------------------------------

def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def worker(method: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Load the model one way; imports happen before the clock and the memory baseline."""
    import torch  # noqa: F401

    options = spec["storage_options"]
    urls, local = spec["urls"], spec["local_files"]
    if method == "Run:ai":
        os.environ.update({"AWS_ENDPOINT_URL": spec["endpoint"], "AWS_ACCESS_KEY_ID": options["key"],
                           "AWS_SECRET_ACCESS_KEY": options["secret"], "AWS_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true",
                           "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                           "RUNAI_STREAMER_CONCURRENCY": str(spec["streams"]),
                           "RUNAI_STREAMER_MEMORY_LIMIT": str(spec["memory_limit"])})
        try:
            from runai_model_streamer import SafetensorsStreamer
            from runai_model_streamer.s3_utils.s3_utils import S3Credentials
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return {"unavailable": f"import failed: {exc}"}
    import fsspec
    from safetensors.torch import load

    from ckptturbo.stream import stream_safetensors

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    baseline = _rss("VmRSS")
    cpu0 = time.process_time()
    began = time.perf_counter()
    nbytes, extra = 0, {}
    if method in ("ckptturbo", "ckptturbo no proxy", "local ckptturbo"):
        target, opts = {"ckptturbo": (spec["url"], options),
                        "ckptturbo no proxy": (spec["url"], spec["direct_options"]),
                        "local ckptturbo": (os.path.dirname(local[0]), None)}[method]
        stream = stream_safetensors(target, storage_options=opts, streams=spec["streams"],
                                    memory_limit=spec["memory_limit"])
        for _, t in stream:
            nbytes += t.nbytes
        extra = {"peak_bytes_held": stream.stats["peak_bytes_held"],
                 "requests": stream.stats["requests"]}
    elif method in ("naive s3fs", "s3fs cat"):
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        for url in urls:
            if method == "naive s3fs":
                with fs.open(url, "rb") as f:
                    tensors = load(f.read())
            else:
                tensors = load(fs.cat_file(url))
            nbytes += sum(t.nbytes for t in tensors.values())
            del tensors
    elif method == "Run:ai":
        creds = S3Credentials(access_key_id=options["key"], secret_access_key=options["secret"],
                              region_name="us-east-1", endpoint=spec["endpoint"])
        try:
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(urls, s3_credentials=creds, device="cpu")
                for _, t in streamer.get_tensors():
                    nbytes += t.nbytes
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    elif method == "local safetensors":
        for path in local:  # read + deserialise: load_file would only mmap, touching nothing
            with open(path, "rb") as f:
                tensors = load(f.read())
            nbytes += sum(t.nbytes for t in tensors.values())
            del tensors
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "bytes": nbytes, "peak_mem": _rss("VmHWM") - baseline,
            "cpu_s": time.process_time() - cpu0, **extra}


# --- the driver ---------------------------------------------------------------------------------

def run_method(method: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.stream_s3", "--worker", method, "--spec", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"unavailable": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return {"unavailable": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description="stream safetensors from S3 through a slow link")
    p.add_argument("--size-mb", type=int, default=2048)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--conn-mbps", type=float, default=100.0, help="per-connection cap, MB/s")
    p.add_argument("--streams", type=int, default=32, help="parallel GETs for ckptturbo and Run:ai")
    p.add_argument("--memory-limit-mb", type=int, default=2048)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--timeout", type=float, default=900.0, help="per method, seconds")
    p.add_argument("--repeat", type=int, default=1, help="runs per method; the median is shown")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, json.loads(args.spec))), flush=True)
        return

    from ckptturbo.store import Store
    from ckptturbo.testing import embedded_s3
    from ckptturbo.testing.proxy_process import ProxyProcess

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckptturbo-bench-") as tmp, embedded_s3.running() as s3:
        print(f"making a {args.size_mb} MiB model in {args.shards} shards ...", flush=True)
        files = make_model(os.path.join(tmp, "model"), args.size_mb, args.shards)
        url = s3.url("bench")
        store = Store(url, s3.storage_options)
        for path in [*files, os.path.join(tmp, "model", "model.safetensors.index.json")]:
            with open(path, "rb") as f:
                store.put(store.join(store.root, os.path.basename(path)), f.read())
        store.close()
        total = sum(os.path.getsize(f) for f in files)
        proxy = ProxyProcess(s3.endpoint, latency_s=args.latency_ms / 1000,
                             conn_rate=args.conn_mbps * 1e6)
        endpoint = proxy.endpoint
        options = proxy.storage_options(s3.storage_options)
        spec = {"url": url, "urls": [f"{url}/{os.path.basename(f)}" for f in files],
                "local_files": files, "storage_options": options, "endpoint": endpoint,
                "direct_options": s3.storage_options,
                "streams": args.streams, "memory_limit": args.memory_limit_mb * MiB}
        methods = args.methods.split(",")
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        try:
            for attempt in range(args.repeat):  # interleaved, so load changes hit every method
                for method in methods:
                    if runs[method] and "unavailable" in runs[method][-1]:
                        continue
                    remote = not method.startswith("local") and "no proxy" not in method
                    if remote:
                        proxy.control.reset_stats()
                    print(f"[{attempt + 1}/{args.repeat}] {method} ...", flush=True)
                    result = run_method(method, spec, args.timeout)
                    if remote and "unavailable" not in result:
                        result["proxy"] = proxy.control.stats().to_json()
                    runs[method].append(result)
        finally:
            proxy.stop()
        rows = [(m, median_run(r)) for m, r in runs.items()]
        print_table(rows, total, args)
        plot(rows, os.path.join(args.out, "stream_s3.png"), args)
        with open(os.path.join(args.out, "stream_s3.json"), "w") as f:
            json.dump({"args": vars(args), "model_bytes": total, "median": rows, "runs": runs}, f,
                      indent=2)


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (all its fields), with the spread of the times."""
    done = sorted((r for r in results if "seconds" in r), key=lambda r: r["seconds"])
    if not done:
        return results[-1]
    pick = dict(done[len(done) // 2])
    pick["all_seconds"] = [r["seconds"] for r in done]
    return pick


def print_table(rows: list[tuple[str, dict]], total: int, args: argparse.Namespace) -> None:
    naive = next((r["seconds"] for m, r in rows if m == "naive s3fs" and "seconds" in r), None)
    print(f"\nmodel: {total / 1e9:.2f} GB in {args.shards} shards; proxy: {args.latency_ms:g} ms "
          f"first byte per request, {args.conn_mbps:g} MB/s per connection; "
          f"median of {args.repeat} run(s)\n")
    head = (f"{'method':<18} {'seconds':>8} {'GB/s':>7} {'vs naive':>9} {'conns':>6} {'of cap':>7} "
            f"{'peak mem':>10} {'CPU s':>6}")
    print(head)
    print("-" * len(head))
    for method, r in rows:
        if "unavailable" in r:
            print(f"{method:<18} unavailable: {r['unavailable']}")
            continue
        gbps = r["bytes"] / r["seconds"] / 1e9
        ratio = f"{naive / r['seconds']:.2f}x" if naive else "-"
        conns = r.get("proxy", {}).get("peak_in_flight")
        of_cap = f"{gbps * 1e3 / (conns * args.conn_mbps):.0%}" if conns else "-"
        print(f"{method:<18} {r['seconds']:>8.2f} {gbps:>7.3f} {ratio:>9} {conns or '-':>6} "
              f"{of_cap:>7} {r['peak_mem'] / MiB:>6.0f} MiB {r['cpu_s']:>6.1f}")
    print("\nconns: peak concurrent requests seen by the proxy; of cap: GB/s / (conns x per-connection "
          "cap); peak mem: peak RSS above the loader's baseline; CPU s: the loader process's CPU time "
          "(Run:ai's native threads included)")


def plot(rows: list[tuple[str, dict]], path: str, args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    done = [(m, r["bytes"] / r["seconds"] / 1e9) for m, r in rows if "seconds" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([m for m, _ in done], [v for _, v in done],
           color=["tab:gray" if m.startswith("local") or "no proxy" in m else "tab:blue"
                  for m, _ in done])
    ax.set_ylabel("GB/s")
    ax.set_title(f"safetensors load through {args.latency_ms:g} ms / {args.conn_mbps:g} MB/s-per-connection proxy")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
