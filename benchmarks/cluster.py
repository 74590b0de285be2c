"""Performance where users are: a cluster in miniature on this machine, every result as a
ratio to its physical limit and to the peers, measured on the same topology in one run.

    python -m benchmarks.run cluster [--size-mb 64] [--reps 5] [--nodes 4]
                                     [--parts probe,ddp,growth,recovery,stream,stream-dist]
                                     [--scale 0.0025]
                                     [--vllm-tp 1,2]

Needs root (network namespaces, ``tc``). The topology (``benchmarks.cluster_topology``):
``--nodes`` nodes of 2 ranks, each a namespace whose link is shaped to the node's fabric
rate with a share for the object store; SeaweedFS and the fault proxy (first-byte latency,
per-connection cap) in a namespace of their own behind the store's link. Parts:

probe     the link probe (benchmarks.cluster_probe): raw parallel botocore PUTs and GETs of
          the DDP save's bytes in 1 MiB objects from every node at once, no checkpoint
          logic: what the store's link attains (its time / limit, the link efficiency),
          then the same requests from the store's namespace (no tc): through the proxy,
          and straight to SeaweedFS. Each save and load is also read against the
          attainable time (its limit times the probe's time / limit)
ddp       8 ranks over 4 nodes hold the same state (DDP): save, then every rank loads the
          whole state; ckptturbo vs DCP's FsspecWriter/Reader vs s3torchconnector's DCP
          writer/reader, alternating, one unmeasured round first
growth    ckptturbo's whole-state load on 2, 4, 8 ranks over 1, 2, 4 nodes
recovery  sharded state with memory tiers: node 1 lost, recovered from its peers' memory,
          vs ckptturbo's load of the same checkpoint from the durable store
stream    ct.stream_safetensors vs Run:ai Model Streamer, one process on node 0
stream-dist
          the same model onto every rank (8 over 4 nodes): ct.stream_safetensors with the
          job's process group vs Run:ai's distributed mode, per node (its default) and
          global (``benchmarks.cluster_stream``)
vllm      (on request, not in the default) vLLM's weights phase on node 0 at each
          tensor-parallel size of --vllm-tp (default 1,2) with load_format="ckptturbo" vs
          "runai_streamer", the construction ("dummy") apart

Every sample's cores' utilisation is measured (/proc/stat, the whole machine, and the
benchmark's own process tree); a result is valid only when every sample behind it was
taken with the cores at most 70% busy. Each sample also keeps how long the deciding link
carried its bytes and how many requests the store had in flight meanwhile.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ckptturbo.testing import netns
from ckptturbo.testing.launcher import run_distributed

from . import cluster_jobs, cluster_stream, stream_s3, tiers_recovery
from . import cluster_probe as probe
from . import cluster_topology as topo
from .cluster_jobs import CT, DCP_FSSPEC, S3TORCH
from .cores import BUSY_LIMIT, CoreSampler
from .measure import now, rank_options, rank_setup
from .report import Report
from .s3_peers import peer_available
from .states import MiB

log = logging.getLogger("benchmarks")
# the default; "vllm" on request
PARTS = ("probe", "ddp", "growth", "recovery", "stream", "stream-dist")
RUNAI = "Run:ai"
FLOOR = "construction (dummy)"  # vLLM's load_format="dummy": builds the model, reads nothing


class Results:
    """Samples by (scenario, side), each with its time, window and cores' busy fraction,
    each scenario's physical limit and the store link (direction) that carries its bulk."""

    def __init__(self, cores: CoreSampler) -> None:
        self.cores = cores
        self.samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.limits: dict[str, topo.Limit] = {}
        self.floors: dict[str, str] = {}  # scenario -> the side that is its construction
        self.links: dict[str, str] = {}  # scenario -> the watched counter of its bulk

    def add(self, scenario: str, side: str, sample: dict[str, Any],
            link: str | None = None) -> None:
        """One sample, with the cores' busy fraction (all, and the benchmark's own) and the
        store's requests in flight over its window; with ``link`` (a watched counter), also
        how long that link took to carry the sample's bulk: the rest of its time is work
        before or after the bytes move."""
        sample = dict(sample, busy=self.cores.busy(*sample["window"]),
                      own=self.cores.own(*sample["window"]))
        if link is not None:
            sample["link_s"] = self.cores.bulk_done(link, *sample["window"])
            self.links[scenario] = link
        sample["in_flight"] = self.cores.mean("in_flight", *sample["window"])
        self.samples.setdefault((scenario, side), []).append(sample)

    def median(self, scenario: str, side: str) -> float | None:
        got = self.samples.get((scenario, side))
        return statistics.median(s["seconds"] for s in got) if got else None

    def valid(self, scenario: str, side: str) -> bool:
        return all(s["busy"] <= BUSY_LIMIT for s in self.samples.get((scenario, side), []))

    def rows(self) -> list[dict[str, Any]]:
        """A row per (scenario, side); where the link probe ran, a save's or load's time is
        also set against the attainable time of its store direction (``over_attainable``)."""
        out = []
        for (scenario, side), got in self.samples.items():
            times = [s["seconds"] for s in got]
            limit = self.limits[scenario]
            median = statistics.median(times)
            out.append({"scenario": scenario, "side": side, "median_s": median, "min_s": min(times),
                        "max_s": max(times), "n": len(times), "limit_s": limit.seconds,
                        "limit_link": limit.link, "over_limit": median / limit.seconds,
                        "busy_max": max(s["busy"] for s in got),
                        "own_max": max(s["own"] for s in got),
                        "link_s": statistics.median(s.get("link_s", float("nan")) for s in got),
                        "in_flight": statistics.median(s["in_flight"] for s in got),
                        "valid": self.valid(scenario, side)})
        attainable = probe.efficiency(out)
        for r in out:
            factor = attainable.get(self.links.get(r["scenario"], ""))
            probed = r["scenario"].startswith((probe.PROBE, probe.CONTROL))
            r["attainable_s"] = (r["limit_s"] * factor if factor and not probed
                                 else float("nan"))
            r["over_attainable"] = r["median_s"] / r["attainable_s"]
        return out


# --------------------------------------------------------------------------- the parts
def _options(cluster: topo.Cluster, world: int) -> dict[str, Any]:
    """The benchmarks' rank options, each rank on its node; a part's job may take longer
    than the usual 15 minutes: peers read the whole state on every rank over slow links."""
    return dict(rank_options(world), setup=cluster.ranks(world, rank_setup), timeout=2400)


def part_probe(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> None:
    """The link probe: the DDP save's bytes as raw PUTs, then GETs, from every node at once
    (each variant of ``probe.VARIANTS`` a job); then the controls, the same requests from
    ranks in the store's namespace, where no tc shapes their way."""
    per, nodes = cluster.profile.ranks_per_node, len(cluster.nodes)
    world, store = per * nodes, cluster.store
    nbytes = args.size_mb * MiB // world * world  # what is sent: an equal share per rank
    put, get = probe.names(world, nodes)
    controls = (f"{probe.CONTROL} PUT {world}r, store's namespace",
                f"{probe.CONTROL} GET {world}r, store's namespace")
    for name in (put, controls[0]):
        res.limits[name] = topo.save_limit(cluster.profile, nbytes, nodes)
    for name in (get, controls[1]):
        res.limits[name] = topo.sharded_load_limit(cluster.profile, nbytes, nodes)
    in_store = topo.OnNode((cluster.store_host,), world, rank_setup)
    runs = [(put, get, "", store.endpoint, v, cluster.ranks(world, rank_setup))
            for v in probe.VARIANTS]
    runs += [(*controls, "via the proxy, ", store.endpoint, probe.MANY, in_store),
             (*controls, "via the proxy, ", store.endpoint, probe.WHOLE, in_store),
             (*controls, "SeaweedFS direct, ", store.server_endpoint, probe.MANY, in_store)]
    # a small state cuts some variants alike: each once
    runs = list({(r[0], r[2] + r[4].side(nbytes, world)): r for r in runs}.values())
    exact, nominal = True, cluster.profile.store_rate * nodes
    for k, (put_name, get_name, how, endpoint, variant, setup) in enumerate(runs):
        out = run_distributed(probe.probe_rank, world, endpoint, store.key, store.secret,
                              store.bucket, f"probe/{k}", nbytes, variant, args.reps,
                              cluster.counters(), **dict(_options(cluster, world), setup=setup))[0]
        exact &= out["exact"]
        side = how + out["side"]
        # the controls' bytes cross no watched link (the store namespace's loopback)
        put_link, get_link = (None, None) if how else ("store_in", "store_out")
        for s in out["samples"]:
            res.add(put_name, side, s["put"], put_link)
            res.add(get_name, side, s["get"], get_link)
        for name, phase, direction in ((put_name, "put", "out"), (get_name, "get", "in")):
            samples = [s[phase] for s in out["samples"]]
            report.note(probe.rate_line(f"{name}, {side}", samples, nominal))
            if not how:
                nodes_seen = [probe.per_node(s, nodes, per, direction) for s in samples]
                report.raw.setdefault("probe_nodes", []).append(
                    {"scenario": name, "side": side, "samples": nodes_seen})
                report.note(probe.node_line(f"{name}, {side}", nodes_seen,
                                            cluster.profile.store_rate))
    report.check("probe: every GET returned what was PUT", exact)


def part_ddp(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> str:
    """DDP save and whole-state load, every rank on its node, all sides alternating."""
    world = len(cluster.nodes) * cluster.profile.ranks_per_node
    sides = (CT, DCP_FSSPEC) + (() if peer_available() else (S3TORCH,))
    store = cluster.store
    out = run_distributed(cluster_jobs.ddp_rank, world, store.storage_options, store.url("ddp"),
                          args.size_mb * MiB, args.reps, cluster.counters(), sides,
                          cluster.profile.chunk_size, **_options(cluster, world))[0]
    unique, nodes = out["unique"], len(cluster.nodes)
    save, load = f"DDP save {world}r/{nodes}n", f"whole-state load {world}r/{nodes}n"
    res.limits[save] = topo.save_limit(cluster.profile, unique, nodes)
    res.limits[load] = topo.whole_load_limit(cluster.profile, unique, nodes)
    for s in out["samples"]:
        res.add(save, s["side"], s["save"], "store_in")
        res.add(load, s["side"], s["load"], "store_out")
    ct_loads = [s["load"] for s in out["samples"] if s["side"] == CT]
    ct_saves = [s["save"] for s in out["samples"] if s["side"] == CT]
    report.compare(f"{load}: bytes from storage (ckptturbo's count)",
                   max(s["bytes_from_storage"] for s in ct_loads), unique, "bytes",
                   peer_name="unique bytes", target=1.001)
    report.compare(f"{load}: bytes the store's link sent", max(s["link_bytes"] for s in ct_loads),
                   unique, "bytes", peer_name="unique bytes",
                   note="link counters: TCP/IP and HTTP headers included")
    report.compare(f"{save}: bytes the store's link took in",
                   max(s["link_bytes"] for s in ct_saves), unique, "bytes",
                   peer_name="unique bytes", note="link counters: TCP/IP and HTTP headers included")
    per_node = [[s["links"][f"node{i}_out"] for i in range(nodes)] for s in ct_saves]
    imbalance = max(max(sent) / statistics.fmean(sent) for sent in per_node)
    report.compare(f"{save}: max/mean bytes a node sent", imbalance, 1.0, "x",
                   peer_name="perfect balance")
    per = cluster.profile.ranks_per_node
    read = [[sum(s["read_per_rank"][n * per:(n + 1) * per]) for n in range(nodes)]
            for s in ct_loads]
    report.compare(f"{load}: max/mean bytes a node read from the store",
                   max(max(r) / statistics.fmean(r) for r in read), 1.0, "x",
                   peer_name="perfect balance")
    report.raw["ddp"] = {"unique": unique, "sides": sides}
    report.check("ddp: every side's load equals the saved state on every rank", out["exact"])
    if peer_available():
        report.note(f"s3torchconnector not measured: {peer_available()}")
    return out["ct_url"]


def part_growth(cluster: topo.Cluster, args: Any, res: Results, report: Report, url: str) -> None:
    """ckptturbo's whole-state load on 2, 4, 8 ranks over 1, 2, 4 nodes (one job each)."""
    per = cluster.profile.ranks_per_node
    store = cluster.store
    saved = bool(url)
    url = url or store.url("growth/ckpt")
    exact = True
    for nodes in range(1, len(cluster.nodes) + 1):
        if nodes & (nodes - 1):
            continue  # 1, 2, 4, ... nodes
        world = nodes * per
        out = run_distributed(cluster_jobs.grouped_rank, world, store.storage_options, url,
                              args.size_mb * MiB, args.reps, cluster.counters(), not saved,
                              cluster.profile.chunk_size, **_options(cluster, world))[0]
        saved = True
        name = f"grouped load {world}r/{nodes}n"
        res.limits[name] = topo.whole_load_limit(cluster.profile, out["unique"], nodes)
        for s in out["samples"]:
            res.add(name, CT, s, "store_out")
        exact &= out["exact"]
    report.check("growth: every load equals the saved state on every rank", exact)


def part_recovery(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> None:
    """Tiered saves (tiers_recovery's job) on the cluster, then node 1 lost before each
    repetition: recovery from its peers' memory vs the durable store's load."""
    per, nodes = cluster.profile.ranks_per_node, len(cluster.nodes)
    world = per * nodes
    nbytes = args.size_mb * MiB // world
    store = cluster.store
    memory = tempfile.mkdtemp(prefix="ckptturbo-cluster-mem-",
                              dir="/dev/shm" if os.path.isdir("/dev/shm") else cluster.scratch)
    run, opts = store.url("tiers"), store.storage_options
    try:
        run_distributed(tiers_recovery._save_job, world, run, opts, memory, per, nbytes,
                        **_options(cluster, world))
        out = run_distributed(tiers_recovery._recover_job, world, run, opts, memory, per, nbytes,
                              args.reps, **_options(cluster, world))[0]
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    unique = nbytes * world
    rec, durable = f"recovery, node lost {world}r/{nodes}n", f"durable load {world}r/{nodes}n"
    res.limits[rec] = topo.recovery_limit(cluster.profile, nbytes * per)
    res.limits[durable] = topo.sharded_load_limit(cluster.profile, unique, nodes)
    for s in out["samples"]["tiers"]:
        res.add(rec, CT, s, "node1_in")
    for s in out["samples"]["durable"]:
        res.add(durable, CT, s, "store_out")
    link_probe = f"{probe.PROBE} node link {world}r/{nodes}n"  # the recovery's attainable
    res.limits[link_probe] = res.limits[rec]
    for s in out["samples"]["probe"]:
        res.add(link_probe, "raw gloo", s, "node1_in")
    from_durable = [s["bytes_from_durable"] for s in out["samples"]["tiers"]]
    report.check("recovery: 0 bytes from the durable store", all(b == 0 for b in from_durable),
                 str(from_durable))
    report.check("recovery: recovered and durable loads bit-exact", out["correct"])
    med = res.median
    report.compare(f"{rec} vs {durable}", med(rec, CT), med(durable, CT), "s",
                   peer_name="ckptturbo durable load", target=0.2)


def _upload(store: Any, url: str, directory: str) -> None:
    """Every file of ``directory`` to ``url`` on the store, in parallel (untimed)."""
    from ckptturbo.store import Store

    remote = Store(url, store.storage_options)
    names = sorted(os.listdir(directory))

    def upload(name: str) -> None:
        with open(os.path.join(directory, name), "rb") as f:
            remote.put(remote.join(remote.root, name), f.read())

    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(upload, names))


def _stream_model(cluster: topo.Cluster, args: Any, name: str) -> tuple[int, dict[str, Any]]:
    """A safetensors model of half the state's size in 4 files, made and uploaded as
    ``name`` (untimed): its bytes, and the loaders' spec (``stream_s3``'s workers)."""
    store = cluster.store
    model = os.path.join(cluster.scratch, name)
    files = stream_s3.make_model(model, max(4, args.size_mb // 2), 4)
    url = store.url(name)
    _upload(store, url, model)
    spec = {"url": url, "urls": [f"{url}/{os.path.basename(f)}" for f in files],
            "local_files": files, "storage_options": store.storage_options,
            "endpoint": store.endpoint, "direct_options": store.storage_options,
            "streams": 16, "memory_limit": 1024 * MiB}
    return sum(os.path.getsize(f) for f in files), spec


def part_stream(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> None:
    """ct.stream_safetensors vs Run:ai Model Streamer, one warm process each on node 0."""
    total, spec = _stream_model(cluster, args, "model")
    python = cluster_jobs.stream_worker_python(cluster.scratch, cluster.nodes[0].netns,
                                               sys.executable)
    name = "stream safetensors 1 process/1n"
    res.limits[name] = topo.stream_limit(cluster.profile, total)
    workers = {m: stream_s3.Worker(m, spec, python) for m in (CT, RUNAI)}
    try:
        for rep in range(args.reps):
            for method in ((CT, RUNAI) if rep % 2 == 0 else (RUNAI, CT)):
                t0 = now()
                result = workers[method].run()
                t1 = now()
                if "unavailable" in result:
                    report.note(f"{method} not measured: {result['unavailable']}")
                    continue
                res.add(name, method, {"seconds": result["seconds"], "window": [t0, t1],
                                       "bytes": result["bytes"]}, "store_out")
                log.info("  %-10s rep %d: %.2f s", method, rep, result["seconds"])
    finally:
        for w in workers.values():
            w.close()


def part_stream_dist(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> None:
    """A safetensors model onto every rank: ct.stream_safetensors with the job's group vs
    Run:ai's distributed mode, per node and global, alternating (``cluster_stream``)."""
    total, spec = _stream_model(cluster, args, "model-dist")
    nodes = len(cluster.nodes)
    world = nodes * cluster.profile.ranks_per_node
    out = run_distributed(cluster_stream.stream_rank, world, spec, args.reps, cluster.counters(),
                          **_options(cluster, world))[0]
    name = f"streaming across ranks {world}r/{nodes}n"
    res.limits[name] = topo.whole_load_limit(cluster.profile, total, nodes)
    for s in out["samples"]:
        res.add(name, s["side"], s, "store_out")
    if out["unavailable"]:
        report.note(f"Run:ai's distributed mode not measured: {out['unavailable']}")
    for side, wrong in out["wrong"].items():
        report.check(f"{name}: {side} gave every rank every tensor, bit-exact", wrong == 0,
                     f"{wrong} tensors wrong or missing over all ranks")
        sent = [s["link_bytes"] for s in out["samples"] if s["side"] == side]
        if sent:
            report.compare(f"{name}: bytes the store's link sent, {side}", max(sent), total,
                           "bytes", peer_name="the model's bytes",
                           note="link counters: TCP/IP and HTTP headers included")


def part_vllm(cluster: topo.Cluster, args: Any, res: Results, report: Report) -> None:
    """vLLM's weights phase (``load_model``) on node 0 at each tensor-parallel size of
    ``--vllm-tp``, in warm engine processes (benchmarks.ray_vllm's): ``load_format=
    "ckptturbo"`` vs ``runai_streamer``, and ``dummy`` (builds the model, reads nothing):
    the construction, reported apart. Each engine's workers all run on node 0."""
    from . import ray_vllm

    store = cluster.store
    hf, config_only = (os.path.join(cluster.scratch, d) for d in ("llama", "llama-config"))
    weight_bytes = ray_vllm._tiny_llama(hf, 256, 2)
    os.makedirs(config_only)
    for name in os.listdir(hf):
        if name.endswith(".json") and "safetensors" not in name:
            shutil.copy(os.path.join(hf, name), config_only)
    url = store.url("llama")
    _upload(store, url, hf)
    opts = store.storage_options
    aws = {"AWS_ENDPOINT_URL": store.endpoint, "AWS_ACCESS_KEY_ID": store.key,
           "AWS_SECRET_ACCESS_KEY": store.secret, "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
    ways = {CT: ([config_only, "ckptturbo", json.dumps({"url": url, "storage_options": opts}), ""],
                 {}),
            "runai_streamer": ([url, "runai_streamer", "{}", ""], aws),
            FLOOR: ([config_only, "dummy", "{}", ""], {})}
    python = cluster_jobs.stream_worker_python(cluster.scratch, cluster.nodes[0].netns,
                                               sys.executable)
    # vLLM names its IPC sockets and rendezvous files for the temp dir and leaves them there
    scratch = os.path.join(cluster.scratch, "vllm-tmp")
    os.makedirs(scratch)
    os.makedirs(args.out, exist_ok=True)  # each engine's vLLM log goes there
    for tp in (int(t) for t in args.vllm_tp.split(",") if t):
        name = f"vLLM weights phase TP{tp}/1n"
        # the node's workers need the unique bytes once at least, whatever their number
        res.limits[name] = topo.stream_limit(cluster.profile, weight_bytes)
        res.floors[name] = FLOOR
        _vllm_engines(res, report, args, name, python, weight_bytes,
                      {way: (argv + ["--tp", str(tp)], dict(env, TMPDIR=scratch))
                       for way, (argv, env) in ways.items()})


def _vllm_engines(res: Results, report: Report, args: Any, name: str, python: str,
                  weight_bytes: int, ways: dict[str, tuple[list[str], dict[str, str]]]) -> None:
    """One scenario: every way's warm engine process, the repetitions alternating between
    the ways; a way that cannot run is noted with its reason (its vLLM log beside the
    report), not measured. What the store's link sent during each weights phase is set
    beside the weights' bytes: how many times the node's workers read them."""
    from . import ray_vllm

    logs = {way: os.path.join(args.out, f"vllm-{name.split()[-1].replace('/', '-')}-"
                                        f"{way.split()[0]}.log") for way in ways}
    workers: dict[str, Any] = {}
    missing: dict[str, str] = {}
    try:
        for way, (argv, env) in ways.items():
            workers[way] = ray_vllm._EngineWorker(argv, python, env, logs[way])
        for rep in range(args.reps):
            for way in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
                result = workers[way].run()
                if "weights_s" not in result:
                    missing.setdefault(way, f"{result.get('unavailable', result)} (vLLM's log: "
                                            f"{logs[way]})")
                    continue
                # the weights phase's own window (the workers' clock is now()'s): the cores,
                # the link and the requests in flight while it ran, not while vLLM started
                window = result["window"]
                res.add(name, way, {"seconds": result["weights_s"], "window": window,
                                    "link_bytes": res.cores.counted("store_out", *window)},
                        "store_out")
                log.info("  %-22s %s rep %d: weights phase %.2f s", way, name.split()[-1], rep,
                         result["weights_s"])
    finally:
        for w in workers.values():
            w.close()
    for way, why in missing.items():
        report.note(f"{name}: {way} not measured: {why}")
    for way in (CT, "runai_streamer"):
        sent = [s["link_bytes"] for s in res.samples.get((name, way), [])]
        if sent:
            report.compare(f"{name}: bytes the store's link sent, {way}", max(sent),
                           weight_bytes, "bytes", peer_name="the weights' bytes",
                           note="link counters: TCP/IP and HTTP headers included")
    floor = res.median(name, FLOOR)
    ours, theirs = res.median(name, CT), res.median(name, "runai_streamer")
    if floor is not None and ours is not None and theirs is not None and theirs > floor:
        report.compare(f"{name} above construction vs runai_streamer", ours - floor,
                       theirs - floor, "s", peer_name="runai_streamer above construction")


# --------------------------------------------------------------------------- the report
# the vLLM target is about tensor-parallel 2, where every Run:ai worker reads the whole model
PEER_TARGETS = {"DDP save": 0.8, "whole-state load": 0.3, "stream safetensors": 1.05,
                "streaming across ranks": 0.6, "vLLM weights phase TP2": 0.6}


class ClusterReport(Report):
    """The standard report, plus a table of every (scenario, side) against its physical
    limit and a plot of time / limit, ckptturbo beside each peer."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__("cluster", params)
        self.rows: list[dict[str, Any]] = []

    def table(self) -> str:
        head = (f"{'scenario':<40} {'side':<36} {'median s':>9} {'min-max':>13} "
                f"{'limit s':>8} {'t/limit':>8} {'t/attain':>8} {'link s':>7} {'reqs':>5} "
                f"{'cores':>6} {'ours':>5}  valid  limit's link")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['scenario']:<40} {r['side']:<36} {r['median_s']:>9.2f} "
                         f"{r['min_s']:>6.2f}-{r['max_s']:<6.2f} {r['limit_s']:>8.2f} "
                         f"{r['over_limit']:>8.2f} {_blank(r['over_attainable']):>8} "
                         f"{r['link_s']:>7.2f} {r['in_flight']:>5.1f} "
                         f"{r['busy_max']:>6.0%} {r['own_max']:>5.0%}  "
                         f"{'yes' if r['valid'] else 'NO':<5}  {r['limit_link']}")
        return "\n".join(lines) + "\n\n" + super().table()

    def markdown(self) -> str:
        """The rows and comparisons as Markdown tables (for docs/benchmarks.md)."""
        lines = ["| scenario | side | median s (min-max) | limit s | time / limit | "
                 "time / attainable | link s | requests in flight | cores busy (max) | "
                 "of which ours | valid |", "|---" * 11 + "|"]
        for r in self.rows:
            lines.append(f"| {r['scenario']} | {r['side']} | {r['median_s']:.2f} ({r['min_s']:.2f}-"
                         f"{r['max_s']:.2f}) | {r['limit_s']:.2f} | **{r['over_limit']:.2f}** | "
                         f"{_blank(r['over_attainable'])} | "
                         f"{r['link_s']:.2f} | {r['in_flight']:.1f} | {r['busy_max']:.0%} | "
                         f"{r['own_max']:.0%} | "
                         f"{'yes' if r['valid'] else 'no'} |")
        lines += ["", "| measure | ckptturbo | peer | ratio | target |", "|---|---|---|---|---|"]
        for c in self.comparisons:
            verdict = "ok" if c.met else "MISSED"
            target = "" if c.target is None else f"{c.op} {c.target:g} {verdict}"
            lines.append(f"| {c.name} | {c.ours:.4g} | {c.peer:.4g} ({c.peer_name}) | "
                         f"**{c.ratio:.3f}** | {target} |")
        return "\n".join(lines) + "\n"

    def finish(self, out_dir: str) -> dict[str, Any]:
        doc = super().finish(out_dir)
        with open(os.path.join(out_dir, "cluster.md"), "w") as f:
            f.write(self.markdown())
        return doc

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        scenarios = list(dict.fromkeys(r["scenario"] for r in self.rows))
        # ckptturbo's colours first, then the peers', then the probe's, whichever part ran first
        probing = {r["side"] for r in self.rows
                   if r["scenario"].startswith((probe.PROBE, probe.CONTROL))}
        sides = sorted(dict.fromkeys(r["side"] for r in self.rows),
                       key=lambda s: (s != CT, s in probing))
        most = max((sum(r["scenario"] == sc for r in self.rows) for sc in scenarios), default=1)
        width = 0.8 / most
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(scenarios)), 4.6))
        colours = ["#2a7ab0", "#bbbbbb", "#e69f00", "#8fbc8f", "#9467bd", "#c5b0d5", "#8c564b",
                   "#f7b6d2"]
        labelled: set[str] = set()
        attain_label = "attainable (link probe)"  # once: "_..." is left out of a legend
        for i, scenario in enumerate(scenarios):
            rows = [r for r in self.rows if r["scenario"] == scenario]
            for k, row in enumerate(rows):
                x = i + (k - (len(rows) - 1) / 2) * width
                side = row["side"]
                bar = ax.bar(x, row["over_limit"], width,
                             color=colours[sides.index(side) % len(colours)],
                             hatch="" if row["valid"] else "//", edgecolor="black",
                             linewidth=0.4, label=None if side in labelled else side)
                labelled.add(side)
                ax.annotate(f"{row['over_limit']:.2f}",
                            (bar[0].get_x() + width / 2, row["over_limit"]),
                            ha="center", va="bottom", fontsize=6)
                if side == CT and not math.isnan(row["over_attainable"]):
                    level = row["over_limit"] / row["over_attainable"]
                    ax.hlines(level, i - 0.45, i + 0.45, colors="purple", linestyles=":",
                              label=attain_label)
                    attain_label = "_attainable"
        ax.axhline(1.3, color="red", linestyle="--", linewidth=0.8, label="target 1.3x limit")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(scenarios)))
        ax.set_xticklabels(scenarios, fontsize=7, rotation=15, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("time / physical limit (log)")
        ax.set_title("cluster in miniature (hatched: cores > 70% busy, not valid)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _compare_all(report: ClusterReport, res: Results) -> None:
    """Every ckptturbo result against its limit, and against each peer on the same scenario."""
    report.rows = res.rows()
    for r in report.rows:
        if r["scenario"].startswith(probe.PROBE):
            report.compare(f"{r['scenario']}, {r['side']}: link efficiency", r["limit_s"],
                           r["median_s"], "s", peer_name="probe's time (limit / time)",
                           note="" if r["valid"] else "NOT VALID: cores > 70% busy")
    for scenario, limit in res.limits.items():
        ours = res.median(scenario, CT)
        if ours is None:
            continue
        valid = "" if res.valid(scenario, CT) else "NOT VALID: cores > 70% busy"
        floor = res.floors.get(scenario)
        if floor is None:
            report.compare(f"{scenario}: time / physical limit", ours, limit.seconds, "s",
                           peer_name=f"limit: {limit.link}", target=1.3, note=valid)
            attainable = next((r["attainable_s"] for r in report.rows
                               if r["scenario"] == scenario and r["side"] == CT), math.nan)
            if not math.isnan(attainable):
                report.compare(f"{scenario}: time / attainable", ours, attainable, "s",
                               peer_name="limit x link probe's t/limit", note=valid)
        elif res.median(scenario, floor) is not None:
            report.compare(f"{scenario} above {floor}: time / physical limit",
                           ours - res.median(scenario, floor), limit.seconds, "s",
                           peer_name=f"limit: {limit.link}", target=1.3, note=valid)
        peers = {side: res.median(scenario, side) for (s, side) in res.samples
                 if s == scenario and side not in (CT, floor)}
        target = next((t for prefix, t in PEER_TARGETS.items() if scenario.startswith(prefix)),
                      None)
        best = min(peers, key=lambda side: peers[side]) if peers else None
        for side, theirs in peers.items():
            report.compare(f"{scenario} vs {side}", ours, theirs, "s", peer_name=side,
                           target=target if side == best else None, note=valid)
    growth = sorted((int(s.split()[2].split("r/")[0]), s) for s in res.limits
                    if s.startswith("grouped load"))
    if len(growth) >= 2:
        (few, small), (many, big) = growth[0], growth[-1]
        report.compare(f"grouped load growth {few} -> {many} ranks", res.median(big, CT),
                       res.median(small, CT), "s", peer_name=f"ckptturbo {few} ranks", target=1.25)


def _blank(value: float) -> str:
    """A ratio for the tables, blank where there is none (NaN)."""
    return "" if math.isnan(value) else f"{value:.2f}"


def _keep_partial(out: str, res: Results) -> None:
    """Every row so far, after each part (a run cut short still leaves its numbers)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cluster-partial.json"), "w") as f:
        json.dump({"rows": res.rows(), "limits": {k: v.to_json() for k, v in res.limits.items()}},
                  f, indent=1)


def scenario(args: Any) -> Report:
    """``python -m benchmarks.run cluster``: build the cluster, run the parts, take it down."""
    parts = [p for p in (args.parts or ",".join(PARTS)).split(",") if p]
    unknown = set(parts) - {*PARTS, "vllm"}
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}, vllm")
    profile = topo.PROFILE.scaled(args.scale)
    if args.conn_mbps:  # the per-connection cap in the miniature, instead of the profile's
        profile = replace(profile, conn_scale=args.conn_mbps * topo.MB / profile.conn)
    report = ClusterReport({"size_mb": args.size_mb, "reps": args.reps, "nodes": args.nodes,
                            "parts": parts, "vllm_tp": args.vllm_tp,
                            "profile": profile.describe()})
    why = netns.available()
    if why:
        report.check(f"the cluster could be built ({why})", False)
        return report
    with CoreSampler() as cores:
        res = Results(cores)
        cluster = topo.Cluster(args.nodes, profile, args.workdir)
        cores.watch(cluster.counters(),
                    lambda: {"in_flight": cluster.store.stats()["in_flight"]})
        try:
            url = ""
            for part in parts:
                log.info("part %s", part)
                if part == "probe":
                    part_probe(cluster, args, res, report)
                elif part == "ddp":
                    url = part_ddp(cluster, args, res, report)
                elif part == "growth":
                    part_growth(cluster, args, res, report, url)
                elif part == "recovery":
                    part_recovery(cluster, args, res, report)
                elif part == "stream":
                    part_stream(cluster, args, res, report)
                elif part == "stream-dist":
                    part_stream_dist(cluster, args, res, report)
                else:
                    part_vllm(cluster, args, res, report)
                _keep_partial(args.out, res)
        finally:
            cores.unwatch()
            cluster.close()
        left = cluster.leftovers()
        report.check("nothing left behind (namespaces, links, store processes)", not left,
                     str(left))
    _compare_all(report, res)
    report.raw["rows"] = report.rows
    report.raw["limits"] = {k: v.to_json() for k, v in res.limits.items()}
    report.raw["samples"] = [{"scenario": sc, "side": side, **s}
                             for (sc, side), got in res.samples.items() for s in got]
    if "vllm" not in parts:
        report.note("vLLM weights phase: not measured (part vllm, on request)")
    return report
