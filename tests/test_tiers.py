"""Tiered checkpoints (docs/tiers.md): host memory first, the durable store every Nth save.

Real processes, real files, SeaweedFS as the durable store. The memory tier lives under
pytest's tmp_path here (the default, /dev/shm, behaves the same: it is only a directory).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ckptturbo as ct
from ckptturbo.testing.fault_proxy import FaultProxy
from ckptturbo.testing.launcher import run_command, run_distributed

JOB = Path(__file__).parent / "jobs" / "tiered_kill.py"
pytestmark = pytest.mark.timeout(300)


def tiered_state(seed: int, n: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(100, generator=g), "step": seed}


def _empty(n: int = 50_000) -> dict:
    return {"w": torch.zeros(n), "b": torch.zeros(100), "step": -1}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def _memory_names(tiers: ct.Tiers, run: str) -> list[str]:
    return [c.name for c in ct.list_checkpoints(tiers.memory_run(run))]


def _durable_names(run: str, options: dict) -> list[str]:
    return [c.name for c in ct.list_checkpoints(run, storage_options=options)]


def test_memory_only_checkpoint_loads_bit_exact_and_is_not_durable(tmp_path, s3_server):
    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")
    with ct.Session() as s:
        handle = s.save(tiered_state(1), f"{run}/step-1", storage_options=opts, tiers=tiers)
        assert handle.local.result().bytes_written > 0
        assert handle.durable.result() is None and not handle.persisted
        assert not s.exists(f"{run}/step-1", storage_options=opts)
        out = _empty()
        recovered = s.load(out, f"{run}/step-1", storage_options=opts, tiers=tiers)
        assert _same(out, tiered_state(1))
        assert (recovered.manifest_tier, recovered.bytes_from_durable) == ("memory", 0)
        loaded = s.load_state_dict(run, storage_options=opts, tiers=tiers)  # the run: newest
        assert _same(loaded, tiered_state(1))


def test_a_newer_durable_checkpoint_wins_over_memory_though_memory_loads_first(tmp_path,
                                                                              s3_server):
    """Memory holds step-1; another writer (no tiers) put step-2 and step-3 in the durable
    store, and step-3 lost a chunk. The recovery loads step-1 from memory while the
    durable store is listed, then the newest checkpoint that can be assembled: step-2."""
    import fsspec

    from ckptturbo.runs import Location

    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")
    with ct.Session() as s:
        s.save(tiered_state(1), f"{run}/step-1", storage_options=opts, tiers=tiers).wait()
        s.save(tiered_state(2), f"{run}/step-2", storage_options=opts)
        s.save(tiered_state(3), f"{run}/step-3", storage_options=opts)
    own = set(Location(f"{run}/step-3", opts).read_manifest().chunks) - \
        set(Location(f"{run}/step-2", opts).read_manifest().chunks)
    cid = sorted(own)[0]
    fsspec.filesystem("s3", **opts).rm(f"{run}/.ckptturbo/chunks/{cid[:2]}/{cid}")
    assert _memory_names(tiers, run) == ["step-1"]
    with ct.Session() as s:  # a restarted job: nothing of step-3 in a cache of this process
        out = _empty()
        recovered = s.load(out, run, storage_options=opts, tiers=tiers)
        assert _same(out, tiered_state(2))
        assert (recovered.url, recovered.manifest_tier) == (f"{run}/step-2", "durable")


def test_every_nth_save_is_persisted_and_only_those_are_durable(tmp_path, s3_server):
    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=2, node="n0")
    with ct.Session() as s:
        handles = [s.save(tiered_state(i), f"{run}/step-{i}", storage_options=opts, tiers=tiers)
                   for i in range(1, 6)]
        handles.append(s.save(tiered_state(6), f"{run}/step-6", storage_options=opts,
                              tiers=tiers, persist=False))
        handles.append(s.save(tiered_state(6), f"{run}/step-7", storage_options=opts,
                              tiers=tiers, persist=True))  # 7th: on demand; same bytes as step-6
        results = [h.durable.result() for h in handles]
        assert [h.persisted for h in handles] == [False, True, False, True, False, True, True]
        assert [r is not None for r in results] == [h.persisted for h in handles]
        assert _durable_names(run, opts) == ["step-2", "step-4", "step-6", "step-7"]
        assert results[6].bytes_written == 0  # every chunk was in the durable store already
        assert _memory_names(tiers, run) == [f"step-{i}" for i in range(1, 8)]
        out = _empty()
        s.load(out, f"{run}/step-4", storage_options=opts, tiers=tiers)
        assert _same(out, tiered_state(4))


def test_overwrite_false_refuses_a_checkpoint_in_either_tier(tmp_path, s3_server):
    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")
    with ct.Session() as s:
        s.save(tiered_state(1), f"{run}/step-1", storage_options=opts, tiers=tiers).wait()
        with pytest.raises(ct.CheckpointExists):  # in memory only
            s.save(tiered_state(2), f"{run}/step-1", storage_options=opts, tiers=tiers,
                   overwrite=False).wait()
        s.save(tiered_state(3), f"{run}/step-3", storage_options=opts, tiers=tiers,
               persist=True).wait()
        shutil.rmtree(tiers.memory_dir)  # durable only now
        with pytest.raises(ct.CheckpointExists, match="step-3"):
            s.save(tiered_state(4), f"{run}/step-3", storage_options=opts, tiers=tiers,
                   overwrite=False)
        out = _empty()
        s.load(out, f"{run}/step-3", storage_options=opts, tiers=tiers)
        assert _same(out, tiered_state(3))  # left untouched


def test_list_exists_and_delete_see_both_tiers_under_durable_names(tmp_path, s3_server):
    """What adapters list, probe and rotate by durable URL: a checkpoint only in memory is
    listed (its tiers say so), exists, and goes with delete; so does a persisted one from
    both places. A chunk store of its own per checkpoint cannot be tiered."""
    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=2, node="n0")
    with ct.Session() as s:
        for step in (1, 2, 3):
            s.save(tiered_state(step), f"{run}/step-{step}", storage_options=opts, tiers=tiers)
        pending = s.list_checkpoints(run, storage_options=opts, tiers=tiers, wait=False)
        assert pending[-1].name == "step-3" and (pending[-1].pending or pending[-1].tiers)
        listed = s.list_checkpoints(run, storage_options=opts, tiers=tiers)
        assert [(c.name, c.tiers, c.url) for c in listed] == [
            ("step-1", ("memory",), f"{run}/step-1"),
            ("step-2", ("memory", "durable"), f"{run}/step-2"),
            ("step-3", ("memory",), f"{run}/step-3")]
        assert [c.name for c in s.list_checkpoints(run, storage_options=opts)] == ["step-2"]
        assert s.exists(f"{run}/step-1", storage_options=opts, tiers=tiers)
        assert not s.exists(f"{run}/step-1", storage_options=opts)
        s.delete(f"{run}/step-1", storage_options=opts, tiers=tiers)
        s.delete(f"{run}/step-2", storage_options=opts, tiers=tiers)
        assert not s.exists(f"{run}/step-2", storage_options=opts, tiers=tiers)
        listed = s.list_checkpoints(run, storage_options=opts, tiers=tiers)
        assert [c.name for c in listed] == ["step-3"]
        with pytest.raises(ct.CheckpointNotFound, match="step-1"):
            s.delete(f"{run}/step-1", storage_options=opts, tiers=tiers)
        with pytest.raises(ct.CkptTurboError, match="store='.' cannot be combined"):
            s.save(tiered_state(4), f"{run}/step-4", storage_options=opts, tiers=tiers, store=".")


def test_memory_tier_evicts_the_oldest_checkpoints_to_fit_its_budget(tmp_path, s3_server):
    run, opts = s3_server.url(), s3_server.storage_options
    one = 50_000 * 4 + 100 * 4  # tensor bytes of one checkpoint (the pickled step adds a little)
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), memory_bytes=int(2.5 * one), persist_every=0,
                     node="n0")
    with ct.Session() as s:
        for i in range(1, 6):
            s.save(tiered_state(i), f"{run}/step-{i}", storage_options=opts, tiers=tiers).wait()
        assert _memory_names(tiers, run) == ["step-4", "step-5"]
        chunks = Path(tiers.memory_run(run)) / ".ckptturbo" / "chunks"
        assert sum(f.stat().st_size for f in chunks.rglob("*") if f.is_file()) <= tiers.budget()
        tiny = ct.Tiers(memory=tiers.memory, memory_bytes=1, persist_every=0, node="n0")
        s.save(tiered_state(6), f"{run}/step-6", storage_options=opts, tiers=tiny).wait()
        assert _memory_names(tiny, run) == ["step-6"]  # the newest stays, whatever the budget
        out = _empty()
        s.load(out, run, storage_options=opts, tiers=tiny)
        assert _same(out, tiered_state(6))


def test_a_killed_process_recovers_from_memory_then_a_lost_node_from_the_durable_store(
        tmp_path, s3_server):
    run, opts, memory = s3_server.url(), s3_server.storage_options, str(tmp_path / "mem")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent))
    code, output = run_command([sys.executable, str(JOB), run, memory, json.dumps(opts)],
                               timeout=120, env=env)
    assert code == -9 and "local" in output, output
    assert _durable_names(run, opts) == ["step-1"]  # step-2 never reached the durable store
    tiers = ct.Tiers(memory=memory, node="n0")
    with FaultProxy(s3_server.endpoint) as proxy, ct.Session() as s:
        counted = proxy.storage_options(opts)
        out = _empty()
        recovered = s.load(out, run, storage_options=counted, tiers=tiers)
        assert _same(out, tiered_state(2))
        assert (recovered.url, recovered.manifest_tier) == (f"{run}/step-2", "memory")
        assert recovered.bytes_from_durable == 0
        assert proxy.stats().bytes_down < 20_000  # listings and step-1's manifest, no chunk

        shutil.rmtree(memory)  # the node is lost: its host memory with it
        out = _empty()
        recovered = s.load(out, run, storage_options=opts, tiers=tiers)
        assert _same(out, tiered_state(1))
        assert (recovered.url, recovered.manifest_tier) == (f"{run}/step-1", "durable")
        assert recovered.bytes_from_memory == 0 and recovered.bytes_from_durable > 0


def _two_nodes(rank: int, world: int, run: str, opts: dict, memory: str) -> None:
    import torch.distributed as dist

    os.environ["CKPTTURBO_NODE"] = f"node{rank}"  # each rank a "node" with its own memory store
    tiers = ct.Tiers(memory=memory, persist_every=2, replicas=0)
    own = {i: {f"w{rank}": tiered_state(10 * i + rank)["w"]} for i in (1, 2, 3)}
    with ct.Session() as s:
        for i in (1, 2, 3):
            handle = s.save({**own[i], "step": i}, f"{run}/step-{i}", storage_options=opts,
                            tiers=tiers)
            handle.wait()
            nothing_sent = ct.Replicated(copies=1, chunks_sent=0, bytes_sent=0)
            assert handle.replicated.result() == nothing_sent
        # manifests on every node
        assert _memory_names(tiers, run) == ["step-1", "step-2", "step-3"]
        assert not list((Path(tiers.memory_run(run)) / ".ckptturbo" / "pending").glob("*"))
        assert _durable_names(run, opts) == ["step-2"]

        out = {f"w{rank}": torch.zeros(50_000)}
        recovered = s.load(out, run, storage_options=opts, tiers=tiers, strict=False)
        assert recovered.url == f"{run}/step-3" and recovered.bytes_from_durable == 0
        assert recovered.bytes_from_peers == 0  # each rank's chunks are in its node's memory
        assert torch.equal(out[f"w{rank}"], own[3][f"w{rank}"])

        # w0 was written by rank 0 into node 0's memory only: node 1 gets it from there
        out = {"w0": torch.zeros(50_000)}
        recovered = s.load(out, run, storage_options=opts, tiers=tiers, strict=False)
        assert (recovered.url, recovered.bytes_from_durable) == (f"{run}/step-3", 0)
        assert (recovered.bytes_from_peers > 0) == (rank == 1)
        assert torch.equal(out["w0"], tiered_state(30)["w"])

        dist.barrier()
        if rank == 1:
            shutil.rmtree(Path(tiers.memory_dir) / tiers.node_name)  # node 1 is lost
        dist.barrier()
        # without replicas, node 1's shard of step-3 is gone with it: every rank falls back
        # to step-2, the durable one; node 0 still reads its own chunks from memory
        out = {f"w{rank}": torch.zeros(50_000)}
        recovered = s.load(out, run, storage_options=opts, tiers=tiers, strict=False)
        assert recovered.url == f"{run}/step-2", (rank, recovered)
        assert torch.equal(out[f"w{rank}"], own[2][f"w{rank}"])
        assert (recovered.bytes_from_durable > 0) == (rank == 1)
        # node 1 adopted node 0's copy, not the durable one
        assert recovered.manifest_tier == "memory"

        # a chunk the holder cannot read (truncated in node 0's memory): it is sent as zeros,
        # so neither rank waits for the other, and both fail naming the cause
        dist.barrier()
        if rank == 0:
            chunks = Path(tiers.memory_run(run)) / ".ckptturbo" / "chunks"
            path = next(p for p in chunks.rglob("*") if p.is_file() and p.stat().st_size == 200_000
                        and torch.equal(torch.frombuffer(bytearray(p.read_bytes()),
                                                         dtype=torch.float32), own[3]["w0"]))
            path.write_bytes(path.read_bytes()[:1000])
        dist.barrier()
        out = {"w0": torch.zeros(50_000)} if rank == 1 else {}
        with pytest.raises(ct.CkptTurboError) as failed:
            s.load(out, f"{run}/step-3", storage_options=opts, tiers=tiers, strict=False)
        assert "cannot be read" in str(failed.value), str(failed.value)  # the cause, on both


def test_two_nodes_each_hold_their_own_chunks_and_every_manifest(tmp_path, s3_server):
    run_distributed(_two_nodes, 2, s3_server.url(), s3_server.storage_options,
                    str(tmp_path / "mem"), timeout=180)


def _node_of(rank: int) -> str:
    return f"node{rank // 2}"  # two ranks per "node", each node with its own memory store


def _sharded(rank: int, step: int) -> dict:
    """Each rank's own shard plus a replicated tensor (balanced over the ranks on save)."""
    return {f"w{rank}": tiered_state(100 * step + rank, 40_000)["w"],
            "shared": tiered_state(step, 60_000)["w"], "step": step}


def _save_on_nodes(rank: int, world: int, run: str, opts: dict, memory: str, steps: int) -> list:
    os.environ["CKPTTURBO_NODE"] = _node_of(rank)
    tiers = ct.Tiers(memory=memory, persist_every=2)  # replicas=1
    done = []
    with ct.Session() as s:
        for step in range(1, steps + 1):
            handle = s.save(_sharded(rank, step), f"{run}/step-{step}", storage_options=opts,
                            tiers=tiers)
            handle.staged.result()
            handle.wait()
            done.append((handle.persisted, handle.replicated.result()))
    chunks = Path(tiers.memory_run(run)) / ".ckptturbo" / "chunks"
    held = sum(f.stat().st_size for f in chunks.rglob("*") if f.is_file())
    return [done, held]


def _recover_on_nodes(rank: int, world: int, run: str, opts: dict, memory: str) -> tuple:
    os.environ["CKPTTURBO_NODE"] = _node_of(rank)
    tiers = ct.Tiers(memory=memory, persist_every=2)
    out = {f"w{rank}": torch.zeros(40_000), "shared": torch.zeros(60_000), "step": -1}
    with ct.Session() as s:
        recovered = s.load(out, run, storage_options=opts, tiers=tiers, strict=False)
    return recovered, torch.equal(out[f"w{rank}"], _sharded(rank, out["step"])[f"w{rank}"]) and \
        torch.equal(out["shared"], _sharded(rank, out["step"])["shared"])


def test_a_lost_node_recovers_from_its_peers_replicas_without_reading_the_durable_store(
        tmp_path, s3_server):
    """Two nodes of two ranks: each save copies each node's chunks into the other node's
    memory; a node lost and restarted gets them back from there, 0 bytes from the store;
    with every node lost, the newest durable checkpoint loads."""
    run, opts, memory = s3_server.url(), s3_server.storage_options, str(tmp_path / "mem")
    saved = run_distributed(_save_on_nodes, 4, run, opts, memory, 3, timeout=240)
    for done, _ in saved:
        assert [p for p, _ in done] == [False, True, False]
        assert all(r.copies == 2 and r.chunks_sent > 0 for _, r in done)  # 1 + 1 replica each
    shard_bytes = 40_000 * 4  # each rank's own shard per step; "shared" is spread over the ranks
    per_node_unique = 3 * (2 * shard_bytes + 60_000 * 4 // 2)
    held = [h for _, h in saved]
    assert held[0] == held[1] and held[2] == held[3]  # ranks of a node share its tier
    assert all(per_node_unique * 1.5 < h <= 2 * per_node_unique * 1.1 for h in held)  # <= (1 + k) x

    shutil.rmtree(Path(memory) / "node1")  # node 1 is lost with its memory; the job restarts
    results = run_distributed(_recover_on_nodes, 4, run, opts, memory, timeout=240)
    for rank, (recovered, exact) in enumerate(results):
        assert exact and recovered.url == f"{run}/step-3"  # never persisted: from memory only
        assert recovered.bytes_from_durable == 0 and recovered.manifest_tier == "memory"
        assert (recovered.bytes_from_peers > 0) == (rank in (2, 3))  # node 1's ranks received
    assert (Path(memory) / "node1").is_dir()  # the restarted node holds its chunks again

    shutil.rmtree(memory)  # every node is lost: the newest durable checkpoint loads
    results = run_distributed(_recover_on_nodes, 4, run, opts, memory, timeout=240)
    for recovered, exact in results:
        assert exact and recovered.url == f"{run}/step-2" and recovered.bytes_from_durable > 0


def _recover_or_fail(rank: int, world: int, run: str, opts: dict, memory: str) -> str:
    try:
        _recover_on_nodes(rank, world, run, opts, memory)
    except Exception as exc:  # noqa: BLE001 - the test reads every rank's failure
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_chunk_damaged_in_a_peers_memory_fails_the_recovery_on_every_rank_when_received(
        tmp_path, s3_server):
    """The lost node's chunks come from node 0's memory, where every chunk was damaged at
    rest: the rank that receives them refuses the first one by its hash as it arrives
    (each chunk is checked as soon as it is in, while later ones are on the wire), and
    every rank fails with that error."""
    run, opts, memory = s3_server.url(), s3_server.storage_options, str(tmp_path / "mem")
    run_distributed(_save_on_nodes, 4, run, opts, memory, 3, timeout=240)
    shutil.rmtree(Path(memory) / "node1")
    chunks = Path(ct.Tiers(memory=memory, node="node0").memory_run(run)) / ".ckptturbo" / "chunks"
    damaged = 0
    for path in (f for f in chunks.rglob("*") if f.is_file()):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        damaged += 1
    assert damaged > 0
    outcomes = run_distributed(_recover_or_fail, 4, run, opts, memory, timeout=240)
    # node 1's rank that received it names the chunk, the node and the cause; every rank
    # raises that one failure (the load's rounds share it), none waits for a timeout
    receipt = re.compile(r"copying the chunks of loading \S+/step-3 failed on rank [23]: "
                         r"IntegrityError: chunk [0-9a-f]{64} received from node 'node0' "
                         r"\(rank [01]\) does not hash to its name")
    assert all(receipt.search(o) for o in outcomes), outcomes


def test_peer_plans_place_copies_on_other_nodes_and_spread_uploads():
    from ckptturbo.peers import Copy, plan_fetches, plan_replicas, rounds, spread

    a, b, c = "a" * 64, "b" * 64, "c" * 64
    order, leaders = ["n0", "n1", "n2"], {"n0": 0, "n1": 2, "n2": 4}
    chunks = {a: 10, b: 20, c: 30}
    held = {"n0": {a}, "n1": {b}, "n2": {c, a}}
    assert plan_replicas(chunks, held, order, leaders, 1) == [Copy(b, 20, 2, 4), Copy(c, 30, 4, 0)]
    two = plan_replicas(chunks, held, order, leaders, 2)  # a: n0, n2 hold it, n1 gets the third
    assert Copy(a, 10, 0, 2) in two and len(two) == 5
    assert all(leaders[n] != c.target for c in two for n in order if c.cid in held[n])
    assert plan_replicas(chunks, held, order, leaders, 5) == two  # capped at one copy per node
    assert plan_replicas(chunks, {"n0": {a}}, ["n0"], {"n0": 0}, 1) == []  # one node: nowhere

    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    lacking = {3: {a, c}, 2: {c}, 0: set()}  # each chunk once per node, to its lowest needer
    assert plan_fetches(chunks, lacking, nodes, held) == [Copy(a, 10, 0, 3), Copy(c, 30, 4, 2)]
    assert plan_fetches({**chunks, "d" * 64: 1}, {2: {"d" * 64}}, nodes, held) == []  # durable
    both = plan_fetches(chunks, {0: {b}, 4: {b}, 5: {a}}, nodes, {"n0": {a}, "n1": {b}})
    # a node's ranks share sending
    assert both == [Copy(b, 20, 2, 0), Copy(a, 10, 0, 5), Copy(b, 20, 3, 4)]
    share = spread(chunks, held)
    assert sorted(x for v in share.values() for x in v) == sorted(chunks)  # each chunk once
    assert share["n0"] == [a] and share["n1"] == [b] and share["n2"] == [c]
    assert [len(r) for r in rounds([Copy(a, 10, 0, 2)] * 5, budget=25)] == [2, 2, 1]


def test_tiers_cli_lists_which_tiers_hold_each_checkpoint_and_collects_per_tier(tmp_path, capsys):
    from ckptturbo.cli import main

    run, memory = str(tmp_path / "run"), str(tmp_path / "mem")
    tiers = ct.Tiers(memory=memory, persist_every=2, node="n0")
    with ct.Session() as s:
        for i in (1, 2, 3):
            s.save(tiered_state(i, 1000), f"{run}/step-{i}", tiers=tiers).wait()
    capsys.readouterr()
    assert main(["ls", run, "--tiers", "--memory", memory, "--node", "n0", "--json"]) == 0
    listed = {c["name"]: c["tiers"] for c in json.loads(capsys.readouterr().out)}
    assert listed == {"step-1": ["memory"], "step-2": ["memory", "durable"], "step-3": ["memory"]}
    ct.delete(f"{tiers.memory_run(run)}/step-1")
    assert main(["gc", run, "--tier", "memory", "--memory", memory, "--node", "n0"]) == 0
    assert "deleted 1 unreferenced chunks" in capsys.readouterr().out
    assert main(["gc", run]) == 0
    assert "deleted 0 unreferenced chunks" in capsys.readouterr().out


def test_a_persist_runs_behind_the_next_save(tmp_path, s3_server):
    run = s3_server.url()
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")
    with FaultProxy(s3_server.endpoint, latency_s=0.3) as proxy, ct.Session() as s:
        slow = proxy.storage_options(s3_server.storage_options)
        first = s.save(tiered_state(1), f"{run}/step-1", storage_options=slow, tiers=tiers,
                       persist=True)
        first.local.result()
        second = s.save(tiered_state(2), f"{run}/step-2", storage_options=slow, tiers=tiers)
        second.local.result()  # committed to memory while the first persist still uploads
        assert not first.durable.done()
        assert first.wait() is not None and second.wait() is None
        assert _durable_names(run, slow) == ["step-1"]


def test_persists_queue_within_the_memory_budget_and_a_save_over_it_waits(tmp_path, s3_server):
    """A checkpoint being persisted cannot be evicted. Within the budget, persisted saves
    queue behind a slow store without a stall; once the tier is over its budget, the next
    save waits for the persist that pins a checkpoint instead of growing the tier."""
    run = s3_server.url()
    roomy = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=1, node="n0")
    tight = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=1, node="n0", memory_bytes=1)
    with FaultProxy(s3_server.endpoint, latency_s=0.3) as proxy, ct.Session() as s:
        slow = proxy.storage_options(s3_server.storage_options)
        for tiers, step in ((roomy, 1), (tight, 3)):
            first = s.save(tiered_state(step), f"{run}/step-{step}", storage_options=slow,
                           tiers=tiers)
            first.local.result()
            assert not first.durable.done()  # the persist takes a few round trips of 0.3 s
            second = s.save(tiered_state(step + 1), f"{run}/step-{step + 1}", storage_options=slow,
                            tiers=tiers)
            assert first.durable.done() == (tiers is tight)
            assert first.wait() is not None and second.wait() is not None
        assert _durable_names(run, slow) == ["step-1", "step-2", "step-3", "step-4"]


def test_every_tier_is_a_chunk_store(tmp_path, s3_server):
    from ckptturbo.chunk_store import ChunkStore
    from ckptturbo.chunks import chunk_id
    from ckptturbo.errors import IntegrityError
    from ckptturbo.persist import copy_chunk
    from ckptturbo.store import Store

    memory = Store(str(tmp_path / "mem"))
    durable = Store(s3_server.url(), s3_server.storage_options)
    assert isinstance(memory, ChunkStore) and isinstance(durable, ChunkStore)
    data = b"x" * 1000
    cid = chunk_id(data)
    memory.put(memory.join(memory.root, cid), data)
    copy_chunk(cid, len(data), memory, memory.join(memory.root, cid), durable,
               durable.join(durable.root, cid))
    assert durable.get(durable.join(durable.root, cid), 10, 20) == data[10:20]
    memory.put(memory.join(memory.root, cid), b"y" * 1000)  # damaged at rest: never copied on
    with pytest.raises(IntegrityError, match="corrupt"):
        copy_chunk(cid, len(data), memory, memory.join(memory.root, cid), durable,
                   durable.join(durable.root, "other"))
    assert not durable.exists(durable.join(durable.root, "other"))


def test_a_memory_manifest_damaged_at_rest_is_refused_by_its_checksum(tmp_path, s3_server):
    run, opts = s3_server.url(), s3_server.storage_options
    tiers = ct.Tiers(memory=str(tmp_path / "mem"), persist_every=0, node="n0")

    def damage(name: str) -> None:
        path = Path(tiers.memory_url(f"{run}/{name}")) / "manifest.json"
        path.write_bytes(path.read_bytes().replace(b'"step"', b'"stap"'))

    with ct.Session() as s:
        s.save(tiered_state(1), f"{run}/step-1", storage_options=opts, tiers=tiers,
               persist=True).wait()
        s.save(tiered_state(2), f"{run}/step-2", storage_options=opts, tiers=tiers).wait()
        damage("step-2")  # only in memory: it cannot be verified, so it is not a candidate
        out = _empty()
        recovered = s.load(out, run, storage_options=opts, tiers=tiers)
        assert recovered.url == f"{run}/step-1" and _same(out, tiered_state(1))
        assert (recovered.manifest_tier, recovered.bytes_from_durable) == ("memory", 0)
        damage("step-1")  # also durable: the durable manifest, the chunks still from memory
        out = _empty()
        recovered = s.load(out, run, storage_options=opts, tiers=tiers)
        assert recovered.url == f"{run}/step-1" and _same(out, tiered_state(1))
        assert (recovered.manifest_tier, recovered.bytes_from_durable) == ("durable", 0)


def test_eviction_and_candidate_plans():
    from ckptturbo.eviction import Held, plan_eviction
    from ckptturbo.recovery import newest_first

    shared, a, b, c = "s" * 64, "a" * 64, "b" * 64, "c" * 64
    held = [Held("step-3", 3.0, {shared: 10, c: 5}), Held("step-1", 1.0, {shared: 10, a: 5}),
            Held("step-2", 2.0, {shared: 10, b: 5})]
    assert plan_eviction(held, 100) == []
    assert plan_eviction(held, 20) == ["step-1"]  # a shared chunk counts once
    assert plan_eviction(held, 0) == ["step-1", "step-2"]  # never the newest
    assert plan_eviction(held, 0, keep=frozenset({"step-1"})) == ["step-2"]  # nor one in flight
    ranks = [{"step-1": 1.0, "step-2": 2.0, "step-3": 3.0}, {"step-2": 2.0, "step-1": 1.0}]
    assert newest_first(ranks) == ["step-3", "step-2", "step-1"]  # any rank's: peers share


def test_evictions_of_one_run_at_once_take_turns(tmp_path):
    """A tiered save evicts after its commit while an earlier one evicts after its
    replication, on another thread: both choose the same oldest checkpoints, and without
    turns the second found them gone (CheckpointNotFound, logged as a failed eviction)."""
    for trial in range(8):
        run = str(tmp_path / f"run-{trial}")
        for step in range(4):
            ct.save({"w": torch.full((1 << 14,), float(step))}, f"{run}/step-{step}").wait()
        failures, results = _evict_at_once(run, 1 << 16, threads=2)
        assert not failures, failures
        assert sorted(name for r in results for name in r.evicted) == [
            "step-0", "step-1", "step-2"]
        assert [c.name for c in ct.list_checkpoints(run)] == ["step-3"]
        assert not any(r.over_budget for r in results)


def _evict_at_once(run: str, budget: int, threads: int) -> tuple[list[Exception], list]:
    """``eviction.evict`` of ``run`` on ``threads`` threads released together: (what
    raised, what returned)."""
    import threading

    from ckptturbo import eviction

    start, failures, results = threading.Barrier(threads), [], []

    def evict() -> None:
        start.wait(timeout=30)
        try:
            results.append(eviction.evict(run, budget))
        except Exception as exc:  # noqa: BLE001 - the test's finding
            failures.append(exc)

    running = [threading.Thread(target=evict) for _ in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join(timeout=60)
    return failures, results


SOAK = bool(os.environ.get("CKPTTURBO_SOAK"))
NODE_KILL_TRIALS = 20 if SOAK else 1


def _save_until_killed(rank: int, world: int, run: str, opts: dict, memory: str, progress: str,
                       kill_after: float, victim: str) -> None:
    """Tiered saves in a loop; the ranks of node ``victim`` die by SIGKILL ``kill_after``
    seconds in (the test then removes its memory); the other node's first rank records each
    step replicated."""
    import signal
    import threading

    os.environ["CKPTTURBO_NODE"] = _node_of(rank)
    if _node_of(rank) == victim:
        threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    tiers = ct.Tiers(memory=memory, persist_every=2)
    with ct.Session() as s:
        for step in range(1, 100_000):  # until node 1 dies and the group breaks
            handle = s.save(_sharded(rank, step), f"{run}/step-{step}", storage_options=opts,
                            tiers=tiers)
            handle.replicated.result()
            if _node_of(rank) != victim and rank % 2 == 0:
                Path(progress).write_text(str(step))


def _verified_tiers(run: str, opts: dict, memory: str) -> tuple[set[str], list[str]]:
    """Names of the checkpoints whose manifest any tier shows, and the problems: a manifest
    that fails its checksum, a durable checkpoint whose chunks are not all there and right."""
    from ckptturbo.cli import main

    names, problems = set(), []
    runs = [(run, opts)] + [(ct.Tiers(memory=memory, node=n).memory_run(run), None)
                            for n in ("node0", "node1") if (Path(memory) / n).is_dir()]
    for where, options in runs:
        try:
            listed = ct.list_checkpoints(where, storage_options=options)
        except ct.CkptTurboError as exc:
            problems.append(f"{where}: {exc}")
            continue
        names |= {c.name for c in listed}
        if where == run:
            problems += [c.name for c in listed if main(["verify", c.url, "--storage-options",
                                                         json.dumps(opts)]) != 0]
    return names, problems


@pytest.mark.parametrize("trial", range(NODE_KILL_TRIALS))
def test_a_node_killed_at_a_random_moment_leaves_every_tier_verifiable(tmp_path, s3_server, trial):
    """kill -9 of a whole node (its two ranks, then its memory; the coordinator's node in odd
    trials) at a random moment of a loop of tiered saves: every manifest in every tier
    verifies, every durable checkpoint is whole, and the restarted job recovers, bit-exact,
    at least the newest checkpoint that was replicated before the kill, without a byte from
    the durable store when that one was only in memory."""
    import random

    from ckptturbo.testing.launcher import RankFailure

    run, opts, memory = s3_server.url(), s3_server.storage_options, str(tmp_path / "mem")
    progress = tmp_path / "progress"
    kill_after = random.Random(trial).uniform(4.0, 9.0)
    victim = f"node{(trial + 1) % 2}"
    outcomes = run_distributed(_save_until_killed, 4, run, opts, memory, str(progress), kill_after,
                               victim, timeout=120, expect_failures=True)
    dead = outcomes[2:] if victim == "node1" else outcomes[:2]
    assert all(isinstance(o, RankFailure) and o.exitcode == -9 for o in dead), dead
    replicated = int(progress.read_text()) if progress.exists() else 0
    shutil.rmtree(Path(memory) / victim, ignore_errors=True)  # with its memory

    names, problems = _verified_tiers(run, opts, memory)
    assert not problems, problems
    results = run_distributed(_recover_on_nodes, 4, run, opts, memory, timeout=180)
    steps = {int(r.url.rsplit("-", 1)[1]) for r, _ in results}
    assert len(steps) == 1 and all(exact for _, exact in results)
    step = steps.pop()
    assert f"step-{step}" in names and step >= replicated, (step, replicated, sorted(names))
    durable = [int(c.name.rsplit("-", 1)[1])
               for c in ct.list_checkpoints(run, storage_options=opts)]
    if step > max(durable, default=0):  # only in memory: node 1's chunks from its peers
        assert all(r.bytes_from_durable == 0 for r, _ in results)
