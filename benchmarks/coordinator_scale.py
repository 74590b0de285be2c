"""The coordinator path of a save and a load at scale: ckptturbo vs DCP's file system writer.

Run from the repository root:
    python -m benchmarks.coordinator_scale [--worlds 256,1024,4096] [--workloads hsdp-72b,ddp-3b]

One process plays every rank of a simulated world and drives the real DCP protocol
methods of both sides with DCP's own planners: ``DefaultSavePlanner`` and
``DefaultLoadPlanner`` with ``TurboWriter``/``TurboReader`` (chained loads, as on an object
store) against ``FileSystemWriter``/``FileSystemReader``. Inputs are fabricated, nothing
is stored but the manifest and DCP's ``.metadata``: state dicts of meta tensors (DTensors
on a ``DeviceMesh`` without a backend for HSDP), and write results as ``write_data`` would
return them (chunks cut by ckptturbo's own layout code, fingerprints with the real keys).

Workloads (Qwen2.5 shapes with AdamW state: weights, exp_avg, exp_avg_sq, step):
    hsdp-72b  Qwen2.5-72B, 3,867 items per rank, 64-rank shard groups x world/64 replicas
    ddp-3b    Qwen2.5-3B, 1,751 items on every rank

Phases, CPU seconds summed over ranks (``time.process_time``): per rank ``local`` (set up,
local plan, storage layer's prepare_local_plan), ``gather`` (pickling each local plan,
unpickling it on the coordinator), ``global`` (planner and storage layer on the
coordinator), ``scatter`` (pickling each rank's plan, unpickling it on the rank),
``intake`` (finish_plan, and turning the plan into the rank's work without I/O),
``results`` (pickling write results, unpickling them on the coordinator), ``finish``
(manifest or .metadata built and written), and on load ``metadata`` (every rank reads
the manifest or .metadata). Ranks whose inputs are identical (the replicas of one shard
position, all DDP ranks but the coordinator) do identical work: it is measured once and
counted for each of them; every rank's own plan and results are measured for every rank,
and so is the storage layer's local step under ckptturbo's own planners, where the one
rank of a group that sends the plan does more than the others.
Bytes: pickled sizes of what each rank sends and receives. "coordinator" = gather +
global + scatter + results + finish of the save, both ends of each exchange (what DCP's
plan cache exists to save); "coordinator rank" = what the coordinator rank itself spends
coordinating a save and a load: unpickling what every rank sends, pickling what it sends
each rank (once for a broadcast), its global planning and the commit.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import hashlib
import json
import math
import os
import pickle
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import ckptturbo as ct
from ckptturbo import replicas, save_plan
from ckptturbo.chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_THRESHOLD, layout_chunks
from ckptturbo.plan.digests import first_ranks
from ckptturbo.planner import TurboLoadPlanner, TurboSavePlanner, grouped_plan, save_digest
from ckptturbo.upload import Entry, place

from .plan_scale import print_table
from .report import Report

SHARD_GROUP = 64
PHASES_SAVE = ("local", "gather", "global", "scatter", "intake", "results", "finish")
PHASES_LOAD = ("metadata", "local", "gather", "global", "scatter", "intake")
COORDINATOR = ("gather", "global", "scatter", "results", "finish")


@dataclasses.dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv: int
    tied: bool


QWEN_72B = Model(80, 8192, 29568, 152064, 1024, False)
QWEN_3B = Model(36, 2048, 11008, 151936, 256, True)
WORKLOADS = {"hsdp-72b": (QWEN_72B, True), "ddp-3b": (QWEN_3B, False)}


def parameters(m: Model) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2 parameter names and shapes."""
    out = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (m.hidden,)),
                (p + "self_attn.q_proj.weight", (m.hidden, m.hidden)),
                (p + "self_attn.q_proj.bias", (m.hidden,)),
                (p + "self_attn.k_proj.weight", (m.kv, m.hidden)),
                (p + "self_attn.k_proj.bias", (m.kv,)),
                (p + "self_attn.v_proj.weight", (m.kv, m.hidden)),
                (p + "self_attn.v_proj.bias", (m.kv,)),
                (p + "self_attn.o_proj.weight", (m.hidden, m.hidden)),
                (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
                (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
                (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
                (p + "post_attention_layernorm.weight", (m.hidden,))]
    out.append(("model.norm.weight", (m.hidden,)))
    if not m.tied:
        out.append(("lm_head.weight", (m.vocab, m.hidden)))
    return out


def state_dict(model: Model, mesh: DeviceMesh | None) -> dict[str, Any]:
    """{"model": params, "optim": AdamW state + param groups}, meta tensors (no memory)."""
    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        if mesh is None:
            return torch.empty(shape, device="meta")
        local = (shape[0] // SHARD_GROUP,) + shape[1:]
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(torch.empty(local, device="meta"), mesh, [Replicate(), Shard(0)],
                                  run_check=False, shape=torch.Size(shape), stride=stride)

    params = parameters(model)
    state = {name: {"step": torch.empty((), device="meta"), "exp_avg": tensor(shape),
                    "exp_avg_sq": tensor(shape)} for name, shape in params}
    group = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
             "fused": None, "decoupled_weight_decay": True, "initial_lr": 1e-4, "max_lr": 3e-4,
             "min_lr": 3e-5, "params": [name for name, _ in params]}
    return {"model": {name: tensor(shape) for name, shape in params},
            "optim": {"state": state, "param_groups": [group]}}


def rank_classes(world: int, sharded: bool) -> list[tuple[int, list[int]]]:
    """(representative, members) of ranks with identical inputs; the coordinator alone."""
    if not sharded:
        return [(0, [0])] + ([(1, list(range(1, world)))] if world > 1 else [])
    out = [(0, [0])]
    for s in range(SHARD_GROUP):
        members = [r for r in range(s, world, SHARD_GROUP) if r != 0]
        if members:
            out.append((members[0], members))
    return out


def states(model: Model, sharded: bool, world: int) -> dict[int, dict]:
    out = {}
    for rep, _ in rank_classes(world, sharded):
        mesh = None
        if sharded:
            mesh = DeviceMesh("cpu", torch.arange(world).reshape(world // SHARD_GROUP, SHARD_GROUP),
                              mesh_dim_names=("replicate", "shard"), _init_backend=False, _rank=rep)
        out[rep] = state_dict(model, mesh)
    return out


def cpu(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - t0


class Ledger:
    """CPU seconds per phase (``planner``: the part spent in DCP's planner methods, the
    same code on both sides), and the bytes ranks receive."""

    def __init__(self) -> None:
        self.cost: Counter[str] = Counter()
        self.planner = 0.0
        self.scatter: list[int] = []  # bytes each rank receives
        self.sent: Counter[str] = Counter()  # bytes sent to the coordinator, per phase
        self.coordinator_rank = 0.0  # the coordinator rank's own part of the exchanges

    def wire(self, phase: str, obj: Any, times: int, to_rank: bool,
             broadcast: bool = False) -> tuple[Any, int]:
        """Pickle on one side, unpickle on the other, counted ``times``. The coordinator
        rank's own part: it unpickles what every rank sends, pickles what it sends each
        rank (once for a ``broadcast``)."""
        blob, t1 = cpu(lambda: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        back, t2 = cpu(lambda: pickle.loads(blob))
        self.cost[phase] += (t1 + t2) * times
        self.coordinator_rank += t1 * (1 if broadcast else times) if to_rank else t2 * times
        if to_rank:
            self.scatter += [len(blob)] * times
        else:
            self.sent[phase] += len(blob) * times
        return back, len(blob)


@dataclasses.dataclass
class Side:
    """One storage layer: how to make its writer and reader, and fake write results."""

    name: str
    writer: Callable[[str], Any]
    reader: Callable[[str], Any]
    results: Callable[[int, Any, list, Any], list[WriteResult]]
    intake_save: Callable[[Any, list], Any]
    intake_load: Callable[[Any, Any], Any]
    grouped: bool = False  # ckptturbo's own planners: one plan per digest


class SimulatedGroupPlanner(TurboSavePlanner):
    """TurboSavePlanner whose digest exchange is played by the harness: ``first`` says
    whether this rank is the first with its digest (the exchange's cost is counted apart)."""

    def __init__(self, first: bool) -> None:
        super().__init__(process_group="simulated")
        self.first = first

    def _is_first(self, digest: str) -> bool:
        return self.first


class SimulatedGroupLoadPlanner(TurboLoadPlanner):
    """TurboLoadPlanner whose digest exchange the harness plays after every class has
    planned: ``create_local_plan`` keeps the digest, and the harness regroups the plan."""

    def __init__(self) -> None:
        super().__init__(process_group="simulated")
        self.digest = ""

    @property
    def local(self) -> Any:
        return self._local

    def _is_first(self, digest: str) -> bool:
        self.digest = digest
        return True


def dcp_results(rank: int, plan: Any, local_items: list, writer: Any) -> list[WriteResult]:
    """What FileSystemWriter.write_data returns: one _StorageInfo per item in one file."""
    out, offset = [], 0
    for item in plan.items:
        n = item.tensor_storage_size() or 100
        out.append(WriteResult(index=item.index, size_in_bytes=n,
                               storage_data=_StorageInfo(f"__{rank}_0.distcp", offset, n)))
        offset += n
    return out


def turbo_results(rank: int, plan: Any, local_items: list, writer: Any) -> list[WriteResult]:
    """What TurboWriter.write_data returns, with chunks cut as Upload cuts them and ids made up."""
    a = plan.storage_data
    items = save_plan.held_items(a, (a.signature, local_items))
    entries = []
    for item, ranges in a.writes(items):
        n = 100 if item.type == WriteItemType.BYTE_IO else save_plan.item_nbytes(item)
        flat = torch.empty(n, dtype=torch.uint8, device="meta")
        entries.append(Entry(item.index, flat, list(ranges or [(0, n)]),
                             "bytes" if item.type == WriteItemType.BYTE_IO else "tensor"))
    spans = [(i, s, e) for i, entry in enumerate(entries) for s, e in entry.ranges if e > s]
    layouts = layout_chunks(spans, DEFAULT_CHUNK_SIZE, DEFAULT_PACK_THRESHOLD)
    ids = [hashlib.blake2b(f"{rank}.{k}".encode(), digest_size=32).hexdigest()
           for k in range(len(layouts))]
    place(entries, ((lay, cid, True) for lay, cid in zip(layouts, ids, strict=True)))
    sizes = {cid: lay.nbytes for lay, cid in zip(layouts, ids, strict=True)}
    prints = replicas.pack((replicas.item_key(i.index), 7) for i in a.replicated_items(items))
    results = save_plan.encode_results(rank, a.marker_id(writer.url), entries, sizes, prints)
    return [WriteResult(index=MetadataIndex(save_plan.RESULTS_FQN),
                        size_in_bytes=sum(sizes.values()), storage_data=results)]


def turbo_intake_save(plan: Any, local_items: list) -> Any:
    a = plan.storage_data
    items = save_plan.held_items(a, (a.signature, local_items))
    return a.writes(items), a.replicated_items(items)


SIDES = {
    "ckptturbo": Side("ckptturbo", lambda url: ct.TurboWriter(url),
                      lambda url: ct.TurboReader(url, broadcast=True), turbo_results,
                      turbo_intake_save,
                      lambda reader, plan: reader.chain_batch(plan.storage_data)),
    "ckptturbo-own": Side("ckptturbo-own", lambda url: ct.TurboWriter(url),
                          lambda url: ct.TurboReader(url, broadcast=True), turbo_results,
                          turbo_intake_save,
                          lambda reader, plan: reader.chain_batch(plan.storage_data),
                          grouped=True),
    "dcp": Side("dcp", lambda url: FileSystemWriter(url), lambda url: FileSystemReader(url),
                dcp_results, lambda plan, items: None, lambda reader, plan: None),
}


class PlanCaches:
    """DCP keeps its plan cache in class attributes of SavePlanner; every simulated rank
    gets its own, and each side its own coordinator's."""

    RANK = ("_cached_save_plan", "_cached_final_save_plan")
    COORDINATOR = ("_cached_all_plans", "_cached_global_plan", "_cached_metadata")

    def __init__(self) -> None:
        self.of: dict[int, dict[str, dict]] = {}
        self.coordinator: dict[str, dict] = {name: {} for name in self.COORDINATOR}

    def use(self, rank: int) -> None:
        mine = self.of.setdefault(rank, {name: {} for name in self.RANK})
        for name, store in {**mine, **self.coordinator}.items():
            setattr(SavePlanner, name, store)


def simulate_save(side: Side, url: str, world: int, sharded: bool, sds: dict[int, dict],
                  caching: bool, caches: PlanCaches, finals: dict[int, Any]) -> Ledger:
    ledger = Ledger()
    classes = rank_classes(world, sharded)
    rep_of = {r: rep for rep, members in classes for r in members}
    planners, writers, local, sent_items = {}, {}, {}, {}
    firsts = (_digest_exchange(ledger, world, rep_of, _save_digests(rep_of, sds)) if side.grouped
              else set())
    plans_of: dict[int, Any] = {}  # rank -> the plan it sends, where not its class's
    for rep, members in classes:
        planner = planners[rep] = (SimulatedGroupPlanner(rep in firsts) if side.grouped else
                                   DefaultSavePlanner(enable_plan_caching=caching))
        writer = writers[rep] = side.writer(url)
        caches.use(rep)

        def planner_step(planner: DefaultSavePlanner, writer: Any, rep: int) -> Any:
            writer.reset(url)
            planner.set_up_planner(state_dict=sds[rep], storage_meta=writer.storage_meta(),
                                   is_coordinator=rep == 0)
            writer.set_up_storage_writer(rep == 0, rank=rep, use_collectives=True)
            return planner.create_local_plan()

        plan, t = cpu(planner_step, planner, writer, rep)
        plan, t2 = cpu(writer.prepare_local_plan, plan)
        others = [r for r in members if (r in firsts) != (rep in firsts)]
        ledger.cost["local"] += t * len(members) + t2 * (len(members) - len(others))
        ledger.planner += t * len(members)
        sent_items[rep] = getattr(planner, "_pending_local_plan", planner.plan).items
        local[rep], _ = ledger.wire("gather", plan, len(members) - len(others), to_rank=False)
        for r in others:  # a sender and the members that are not, or the other way round:
            # the storage layer's part of each measured on its own (a sender's differs)
            mine = grouped_plan(planner.plan, plan.planner_data.digest, r in firsts)
            mine, t2 = cpu(writer.prepare_local_plan, mine)
            ledger.cost["local"] += t2
            plans_of[r], _ = ledger.wire("gather", mine, 1, to_rank=False)
    all_plans = [plans_of.get(r) or local[rep_of[r]] for r in range(world)]
    caches.use(0)
    (central, metadata), t = cpu(lambda: planners[0].create_global_plan(all_plans))
    central, t2 = cpu(lambda: writers[0].prepare_global_plan(central))
    ledger.cost["global"] += t + t2
    ledger.planner += t
    received: dict[int, tuple[Any, int]] = {}
    results = []
    for r in range(world):
        if id(central[r]) not in received:  # the same object (DCP's empty cached plans)
            received[id(central[r])] = ledger.wire("scatter", central[r], 1, to_rank=True)
        else:
            ledger.wire("scatter", central[r], 1, to_rank=True)
        plan = received[id(central[r])][0]
        rep = rep_of[r]
        caches.use(rep)
        SavePlanner._cached_final_save_plan = finals.setdefault(r, {})
        final, t = cpu(planners[rep].finish_plan, plan)
        _, t2 = cpu(lambda final=final, items=sent_items[rep]:
                    side.intake_save(final, items) if final.storage_data else None)
        ledger.cost["intake"] += t + t2
        ledger.planner += t
        back, _ = ledger.wire("results", side.results(r, final, sent_items[rep], writers[rep]), 1,
                              to_rank=False)
        results.append(back)
    _, t = cpu(lambda: writers[0].finish(metadata, results))
    ledger.cost["finish"] += t
    return ledger


def _save_digests(rep_of: dict[int, int], sds: dict[int, dict]) -> dict[int, str]:
    """Each class's save-plan digest, made uncounted (each rank's planner makes and counts
    its own)."""
    digests = {}
    for rep in set(rep_of.values()):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict=sds[rep], is_coordinator=rep == 0)
        digests[rep] = save_digest(planner.create_local_plan())
    return digests


def _digest_exchange(ledger: Ledger, world: int, rep_of: dict[int, int],
                     digests: dict[int, str]) -> set[int]:
    """The planners' one collective, played here: every rank's digest gathered on the
    coordinator, the first rank of each broadcast; returns those ranks."""
    sent = ledger.wire("gather", digests[rep_of[0]], world, to_rank=False)[0]
    everyone = [sent if rep_of[r] == rep_of[0] else digests[rep_of[r]] for r in range(world)]
    firsts, t = cpu(lambda: sorted(first_ranks(everyone).values()))
    ledger.cost["global"] += t
    ledger.wire("scatter", firsts, world, to_rank=True, broadcast=True)
    return set(firsts)


def simulate_load(side: Side, url: str, world: int, sharded: bool, sds: dict[int, dict]) -> Ledger:
    ledger = Ledger()
    classes = rank_classes(world, sharded)
    rep_of = {r: rep for rep, members in classes for r in members}
    first = side.reader(url)
    metadata, t = cpu(first.read_metadata)
    # every rank reads it: the same work, so one time stands for the world's; the median of
    # three, as a single sample multiplied by thousands of ranks carries its noise with it
    again = [cpu(side.reader(url).read_metadata)[1] for _ in range(2)]
    ledger.cost["metadata"] += sorted([t, *again])[1] * world
    planners, readers, local, made = {}, {}, {}, {}

    def planner_step(planner: DefaultLoadPlanner, rep: int) -> Any:
        planner.set_up_planner(sds[rep], metadata, rep == 0)
        return planner.create_local_plan()

    def reader_step(reader: Any, rep: int, plan: Any) -> Any:
        reader.set_up_storage_reader(metadata, rep == 0, rank=rep, use_collectives=True)
        return reader.prepare_local_plan(plan)

    for rep, members in classes:
        planner = planners[rep] = (SimulatedGroupLoadPlanner() if side.grouped
                                   else DefaultLoadPlanner())
        made[rep], t = cpu(planner_step, planner, rep)
        ledger.cost["local"] += t * len(members)
        ledger.planner += t * len(members)
    firsts = set()
    if side.grouped:  # every class has planned: the digest exchange, then each rank's plan
        firsts = _digest_exchange(ledger, world, rep_of,
                                  {rep: planners[rep].digest for rep, _ in classes})
    plans_of: dict[int, Any] = {}  # rank -> the plan it sends, where not its class's
    for rep, members in classes:
        reader = readers[rep] = copy.copy(first)  # shares the parsed manifest, not the state
        plan = made[rep]
        if side.grouped:
            plan = grouped_plan(planners[rep].local, plan.planner_data.digest, rep in firsts)
        plan, t2 = cpu(reader_step, reader, rep, plan)
        others = [r for r in members if (r in firsts) != (rep in firsts)]
        ledger.cost["local"] += t2 * (len(members) - len(others))
        local[rep], _ = ledger.wire("gather", plan, len(members) - len(others), to_rank=False)
        for r in others:  # as on save: a sender's part and the others' measured apart
            mine = grouped_plan(planners[rep].local, plan.planner_data.digest, r in firsts)
            mine, t2 = cpu(reader_step, reader, r, mine)
            ledger.cost["local"] += t2
            plans_of[r], _ = ledger.wire("gather", mine, 1, to_rank=False)
    all_plans = [plans_of.get(r) or local[rep_of[r]] for r in range(world)]
    central, t = cpu(lambda: planners[0].create_global_plan(all_plans))
    central, t2 = cpu(lambda: readers[0].prepare_global_plan(central))
    ledger.cost["global"] += t + t2
    ledger.planner += t
    seen: dict[int, Any] = {}
    for r in range(world):
        obj = central[r]
        times = 1
        if id(obj) in seen:  # one plan object for many ranks (DCP: unchanged local plans)
            ledger.scatter.append(seen[id(obj)][1])
            ledger.cost["scatter"] += seen[id(obj)][2]
            plan = seen[id(obj)][0]
        else:
            before = ledger.cost["scatter"]
            plan, size = ledger.wire("scatter", obj, times, to_rank=True)
            seen[id(obj)] = (plan, size, ledger.cost["scatter"] - before)
        rep = rep_of[r]
        final, t = cpu(planners[rep].finish_plan, plan)
        _, t2 = cpu(side.intake_load, readers[rep], final)
        ledger.cost["intake"] += t + t2
        ledger.planner += t
    return ledger


def run_world(workload: str, world: int, root: str) -> dict[str, Any]:
    model, sharded = WORKLOADS[workload]
    sds = states(model, sharded, world)
    row: dict[str, Any] = {"workload": workload, "ranks": world}
    for name, side in SIDES.items():
        url = os.path.join(root, f"{workload}-{world}-{name}", "ckpt")
        caches = PlanCaches()
        finals: dict[int, Any] = {}
        save = simulate_save(side, url, world, sharded, sds, True, caches, finals)
        again = simulate_save(side, url + "-again", world, sharded, sds, True, caches, finals)
        # fresh meta tensors: DCP's load planner materialises the meta tensors of the state
        # dict it loads into, in place, so a load given the dicts another load used skips that
        load = simulate_load(side, url, world, sharded, states(model, sharded, world))
        meta = os.path.join(url, ".metadata" if name == "dcp" else "manifest.json")
        row[name] = {
            "save": dict(save.cost), "save_again": dict(again.cost), "load": dict(load.cost),
            "total_s": sum(save.cost.values()) + sum(load.cost.values()),
            "planner_s": save.planner + load.planner,
            "coordinator_s": sum(save.cost[p] for p in COORDINATOR),
            "coordinator_again_s": sum(again.cost[p] for p in COORDINATOR),
            "coordinator_rank_s": sum(led.coordinator_rank + led.cost["global"]
                                      + led.cost["finish"] for led in (save, load)),
            "max_plan_bytes": max(save.scatter + load.scatter),
            "max_load_plan_bytes": max(load.scatter), "max_save_plan_bytes": max(save.scatter),
            "scatter_bytes": sum(save.scatter) + sum(load.scatter),
            "gather_bytes": sum(save.sent.values()) + sum(load.sent.values()),
            "results_bytes": save.sent["results"],
            "metadata_bytes": os.path.getsize(meta),
        }
        print(f"  {workload} {world} {name}: save {dict(save.cost)} load {dict(load.cost)}",
              flush=True)
    return row


def exponent(rows: list[dict], side: str, key: str) -> float:
    """Least-squares slope of log(key) against log(ranks)."""
    xs = [math.log(r["ranks"]) for r in rows]
    ys = [math.log(r[side][key]) for r in rows]
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return covariance / sum((x - mx) ** 2 for x in xs)


def summarise(rows: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload in sorted({r["workload"] for r in rows}):
        mine = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["ranks"])
        top = mine[-1]
        t, d, o = top["ckptturbo"], top["dcp"], top["ckptturbo-own"]
        out[workload] = {
            "ranks": top["ranks"],
            "total_ratio": t["total_s"] / d["total_s"],
            "beyond_planner_ratio": ((t["total_s"] - t["planner_s"])
                                     / (d["total_s"] - d["planner_s"])),
            "max_plan_ratio": t["max_plan_bytes"] / d["max_plan_bytes"],
            "scatter_exponent": exponent(mine, "ckptturbo", "scatter_bytes"),
            "dcp_scatter_exponent": exponent(mine, "dcp", "scatter_bytes"),
            "cached_save_ratio": t["coordinator_again_s"] / t["coordinator_s"],
            "manifest_ratio": t["metadata_bytes"] / d["metadata_bytes"],
            "own_total_ratio": o["total_s"] / d["total_s"],
            "own_coordinator_ratio": o["coordinator_s"] / d["coordinator_s"],
            "own_total_exponent": exponent(mine, "ckptturbo-own", "total_s"),
            "own_coordinator_exponent": exponent(mine, "ckptturbo-own", "coordinator_s"),
            "own_coordinator_rank_ratio": o["coordinator_rank_s"] / d["coordinator_rank_s"],
            "own_coordinator_rank_exponent": exponent(mine, "ckptturbo-own",
                                                      "coordinator_rank_s"),
        }
    return out


def scenario(args: Any) -> Report:
    """``python -m benchmarks.run coordinator-scale [--worlds ...]``: the same run as
    ``main``, as a report with its targets."""
    argv = ["--worlds", args.worlds, "--workloads", args.workloads]
    if args.layers:
        argv += ["--layers", str(args.layers)]
    if args.shard_group:
        argv += ["--shard-group", str(args.shard_group)]
    doc = main(argv)
    report = Report("coordinator-scale", {"worlds": args.worlds, "workloads": args.workloads,
                                          "layers": args.layers, "shard_group": args.shard_group})
    report.raw["rows"] = doc["rows"]
    for workload, sm in doc["summary"].items():
        top = max((r for r in doc["rows"] if r["workload"] == workload), key=lambda r: r["ranks"])
        t, d = top["ckptturbo"], top["dcp"]
        at = f"{workload} @ {top['ranks']}"
        report.compare(f"{at}: coordinator path CPU s", t["total_s"], d["total_s"], "s", target=0.5)
        own = top["ckptturbo-own"]
        report.compare(f"{at}: coordinator path CPU s, ckptturbo's own planners", own["total_s"],
                       d["total_s"], "s", target=0.1 if workload.startswith("ddp") else 0.3)
        report.compare(f"{at}: coordinator CPU s, ckptturbo's own planners", own["coordinator_s"],
                       d["coordinator_s"], "s", target=0.1)
        report.compare(f"{at}: the coordinator rank alone (save and load), ckptturbo's own "
                       "planners", own["coordinator_rank_s"], d["coordinator_rank_s"], "s",
                       target=0.1)
        if workload.startswith("ddp"):
            report.compare(f"{workload}: the coordinator rank alone, growth exponent, "
                           "ckptturbo's own planners", sm["own_coordinator_rank_exponent"], 1.0,
                           "x", peer_name="linear (1.0)", target=0.2)
        report.compare(f"{at}: largest per-rank plan", t["max_plan_bytes"], d["max_plan_bytes"],
                       "B", target=1.0)
        report.compare(f"{workload}: scatter bytes growth exponent", sm["scatter_exponent"], 1.0,
                       "x", peer_name="linear (1.0)", target=1.05)
        report.compare(f"{at}: cached save, coordinator CPU s", t["coordinator_again_s"],
                       t["coordinator_s"], "s", peer_name="first save", target=0.1)
        report.compare(f"{at}: manifest bytes", t["metadata_bytes"], d["metadata_bytes"], "B",
                       peer_name="DCP .metadata", target=1.0)
        report.check(f"{workload}: every save committed (manifest and .metadata written)",
                     all(r[side]["metadata_bytes"] > 0 for r in doc["rows"] for side in SIDES
                         if r["workload"] == workload))
        report.check(f"{workload}: each rank's load plan is its own (largest plan does not grow "
                     "with the world)", _flat(doc["rows"], workload, "max_load_plan_bytes"))
    return report


def _flat(rows: list[dict], workload: str, key: str) -> bool:
    """The largest rank's plan grows by less than 10% from the smallest world to the largest."""
    mine = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["ranks"])
    return mine[-1]["ckptturbo"][key] <= 1.1 * mine[0]["ckptturbo"][key]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global SHARD_GROUP  # the workload's shape, set once from the command line
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="256,512,1024", help="comma-separated world sizes")
    parser.add_argument("--workloads", default="hsdp-72b,ddp-3b")
    parser.add_argument("--json", default=None, help="write the rows and the summary here")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    parser.add_argument("--shard-group", type=int, default=SHARD_GROUP,
                        help="HSDP ranks per shard group (world sizes must be multiples)")
    args = parser.parse_args(argv)
    SHARD_GROUP = args.shard_group
    if args.layers is not None:
        for name, (model, sharded) in list(WORKLOADS.items()):
            WORKLOADS[name] = (dataclasses.replace(model, layers=args.layers), sharded)
    if not dist.is_initialized():  # ranks are simulated; TurboReader asks whether a group exists
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # One process holds every rank's objects: Python's cyclic collector would charge each
    # phase for walking a heap thousands of times any real rank's; no phase makes cycles.
    gc.disable()
    rows = []
    with tempfile.TemporaryDirectory(prefix="coordinator-scale-") as root:
        for workload in args.workloads.split(","):
            for world in map(int, args.worlds.split(",")):
                rows.append(run_world(workload, world, os.path.join(root, "run")))
                gc.collect()
    flat = []
    for r in rows:
        for side in SIDES:
            s = r[side]
            flat.append({"workload": r["workload"], "ranks": r["ranks"], "side": side,
                         "save_s": sum(s["save"].values()), "load_s": sum(s["load"].values()),
                         "total_s": s["total_s"], "beyond_s": s["total_s"] - s["planner_s"],
                         "coord_s": s["coordinator_s"],
                         "coord_again_s": s["coordinator_again_s"],
                         "coord_rank_s": s["coordinator_rank_s"],
                         "max_plan_kib": s["max_plan_bytes"] / 1024,
                         "scatter_mib": s["scatter_bytes"] / 2**20,
                         "gather_mib": s["gather_bytes"] / 2**20,
                         "results_mib": s["results_bytes"] / 2**20,
                         "meta_kib": s["metadata_bytes"] / 1024})
    print_table("coordinator path, CPU seconds summed over ranks", flat, [
        ("workload", "workload", ""), ("ranks", "ranks", "d"), ("side", "side", ""),
        ("save s", "save_s", ".1f"), ("load s", "load_s", ".1f"), ("total s", "total_s", ".1f"),
        ("not planner s", "beyond_s", ".1f"),
        ("coord s", "coord_s", ".2f"), ("coord cached s", "coord_again_s", ".2f"),
        ("coord rank s", "coord_rank_s", ".2f"),
        ("max plan KiB", "max_plan_kib", ".1f"), ("scatter MiB", "scatter_mib", ".1f"),
        ("gather MiB", "gather_mib", ".1f"), ("results MiB", "results_mib", ".1f"),
        ("manifest KiB", "meta_kib", ".0f")])
    summary = summarise(rows)
    print("\nratios at the largest world (ckptturbo / DCP unless noted):")
    for workload, s in summary.items():
        print(f"  {workload} @ {s['ranks']}: total {s['total_ratio']:.2f}x (target <= 0.5; "
              f"outside DCP's planner methods {s['beyond_planner_ratio']:.2f}x), "
              f"largest plan {s['max_plan_ratio']:.2f}x (<= 1), scatter growth exponent "
              f"{s['scatter_exponent']:.2f} (DCP {s['dcp_scatter_exponent']:.2f}; <= 1.05), "
              f"cached save / first (coordinator) {s['cached_save_ratio']:.3f} (<= 0.1), "
              f"manifest {s['manifest_ratio']:.2f}x (<= 1)")
        print(f"  {workload} @ {s['ranks']}, ckptturbo with its own planners / DCP: total "
              f"{s['own_total_ratio']:.3f}x, coordinator {s['own_coordinator_ratio']:.3f}x; "
              f"growth exponents: total {s['own_total_exponent']:.2f}, coordinator "
              f"{s['own_coordinator_exponent']:.2f}; the coordinator rank alone (save and "
              f"load) {s['own_coordinator_rank_ratio']:.3f}x, growth exponent "
              f"{s['own_coordinator_rank_exponent']:.2f}")
    doc = {"rows": rows, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
