"""Tiered checkpoints across a real network: each node a host of its own (network namespace,
interface, address, host name; ``ckptturbo.testing.netns``), joined by veth pairs to a
bridge where the durable store (SeaweedFS) listens. Replicas and recovered chunks must
cross the hosts' links, a node is named by its host name, and a cut link fails a save in
bounded time without damaging any checkpoint.
"""
from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptturbo as ct
from ckptturbo.testing import embedded_s3, netns
from ckptturbo.testing.launcher import run_distributed

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

GROUP_TIMEOUT = 8.0  # how long a rank waits for a silent peer (the job's group and ckptturbo's)


@pytest.fixture(scope="module")
def hosts():
    with netns.VirtualHosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def store(hosts, tmp_path_factory):
    server = embedded_s3.start(str(tmp_path_factory.mktemp("seaweedfs-net")), address=hosts.gateway)
    yield server
    server.stop()


@pytest.fixture
def bounded(monkeypatch):
    monkeypatch.setenv("CKPTTURBO_COLLECTIVE_TIMEOUT", str(GROUP_TIMEOUT))


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {f"w{rank}": torch.randn(200_000, generator=g),
            "shared": torch.randn(100_000, generator=shared), "step": step}


def _empty(rank: int) -> dict:
    return {f"w{rank}": torch.zeros(200_000), "shared": torch.zeros(100_000), "step": -1}


def _exact(rank: int, out: dict) -> bool:
    want = _state(rank, out["step"])
    return (torch.equal(out[f"w{rank}"], want[f"w{rank}"])
            and torch.equal(out["shared"], want["shared"]))


def _save(rank: int, world: int, run: str, opts: dict, memory: str, steps: int) -> tuple:
    tiers = ct.Tiers(memory=memory, persist_every=2)  # the node: this host's name
    with ct.Session() as s:
        for step in range(1, steps + 1):
            handle = s.save(_state(rank, step), f"{run}/step-{step}", storage_options=opts,
                            tiers=tiers)
            handle.wait()
    return socket.gethostname(), tiers.node_name, handle.replicated.result().bytes_sent


def _recover(rank: int, world: int, run: str, opts: dict, memory: str) -> tuple:
    out = _empty(rank)
    with ct.Session() as s:
        recovered = s.load(out, run, storage_options=opts, tiers=ct.Tiers(memory=memory),
                           strict=False)
    return recovered, _exact(rank, out)


def _received(hosts: netns.VirtualHosts) -> list[int]:
    return [hosts.bytes_received(h) for h in hosts.hosts]


def test_nodes_on_their_own_hosts_replicate_and_recover_over_the_network(hosts, store, tmp_path,
                                                                         bounded):
    """Two hosts of two ranks: each save's replicas cross the hosts' links; host 1, lost
    with its memory and restarted, gets its chunks back from host 0 over its link, 0 bytes
    from the store; with every host's memory lost, the newest durable checkpoint loads."""
    run, opts, memory = store.url(), store.storage_options, str(tmp_path / "mem")
    ranks = hosts.ranks(2)
    before = _received(hosts)
    saved = run_distributed(_save, 4, run, opts, memory, 3, setup=ranks, timeout=240)
    crossed = sum(_received(hosts)) - sum(before)
    assert ([(name, node) for name, node, _ in saved]
            == [(h.name, h.name) for h in hosts.hosts for _ in (0, 1)])
    replica_bytes = saved[0][2]  # the last save's copies, job-wide
    assert replica_bytes > 2 * 200_000 * 4  # both hosts' own shards, at least
    assert crossed > 3 * replica_bytes  # three saves' replicas (and a persist) went over the links
    assert sorted((Path(memory)).iterdir()) == [Path(memory) / h.name for h in hosts.hosts]

    shutil.rmtree(Path(memory) / "host1")  # host 1 is lost with its memory; the job restarts
    before = _received(hosts)
    results = run_distributed(_recover, 4, run, opts, memory, setup=ranks, timeout=240)
    into_host1 = hosts.bytes_received(hosts.hosts[1]) - before[1]
    for rank, (recovered, exact) in enumerate(results):
        assert exact and recovered.url == f"{run}/step-3"  # never persisted: from memory only
        assert recovered.bytes_from_durable == 0 and recovered.manifest_tier == "memory"
        assert (recovered.bytes_from_peers > 0) == (rank in (2, 3))
    assert into_host1 >= sum(r.bytes_from_peers for r, _ in results)  # over host 1's link

    shutil.rmtree(memory)  # every host's memory is lost: the newest durable checkpoint loads
    results = run_distributed(_recover, 4, run, opts, memory, setup=ranks, timeout=240)
    assert all(exact and r.url == f"{run}/step-2" and r.bytes_from_durable > 0
               for r, exact in results)


def _save_across_a_cut(rank: int, world: int, run: str, opts: dict, memory: str,
                       marks: str) -> list:
    """Step 1 saved and replicated; then step 2, across the test's cut of host 1's link:
    each rank reports what the save (or its replication) raised and how long after the
    cut could have come."""
    tiers = ct.Tiers(memory=memory, persist_every=0)
    marks_dir = Path(marks)

    def mark(name: str) -> None:
        (marks_dir / f"{name}-{rank}").touch()

    with ct.Session() as s:
        s.save(_state(rank, 1), f"{run}/step-1", storage_options=opts, tiers=tiers).wait()
        mark("saved")
        while not (marks_dir / "go").exists():
            time.sleep(0.05)
        started = time.monotonic()
        try:
            handle = s.save(_state(rank, 2), f"{run}/step-2", storage_options=opts, tiers=tiers)
            handle.local.result()
            started = time.monotonic()
            mark("local")
            failed = handle.replicated.exception()
            handle.wait()  # a failed replication does not fail the save: it stands in memory
            outcome = None if failed is None else type(failed).__name__
        except ct.CkptTurboError as exc:
            outcome = type(exc).__name__
        return [outcome, time.monotonic() - started]


@pytest.mark.parametrize("when", ["between saves", "during replication"])
def test_a_cut_link_fails_the_save_in_bounded_time_and_no_checkpoint_is_damaged(
        hosts, store, tmp_path, bounded, when):
    """Host 1's link goes down (packets dropped, no connection reset: a failed switch
    port), either between two saves or while the second one's replicas cross a slow link:
    within a bound set by the group's timeout, every rank's save (between saves) or its
    ``replicated`` future (during the replication) holds ckptturbo's CommunicationError.
    Between saves, no tier shows the failed checkpoint; during the replication, each node
    keeps it whole in its own memory. Once the link is back, a
    restarted job recovers the newest checkpoint, bit-exact, from memory."""
    run, opts, memory = store.url(), store.storage_options, str(tmp_path / "mem")
    marks = tmp_path / "marks"
    marks.mkdir()
    host1 = hosts.hosts[1]

    def all_marked(name: str) -> None:
        while len(list(marks.glob(f"{name}-*"))) < 4:
            time.sleep(0.02)

    def cut() -> None:
        all_marked("saved")
        if when == "between saves":
            hosts.cut(host1)
        else:  # about 2 MB of replicas each way: seconds at 4 Mbit/s
            hosts.limit(host1, 4)
        (marks / "go").touch()
        if when == "during replication":
            all_marked("local")
            hosts.cut(host1)

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    try:
        outcomes = run_distributed(_save_across_a_cut, 4, run, opts, memory, str(marks),
                                   setup=hosts.ranks(2), timeout=120, group_timeout=GROUP_TIMEOUT)
    finally:
        cutter.join(timeout=5)
        hosts.heal(host1)
        if when == "during replication":
            hosts.limit(host1, None)
    for error, seconds in outcomes:
        assert error == "CommunicationError" and seconds < 3 * GROUP_TIMEOUT, outcomes
    newest = "step-1" if when == "between saves" else "step-2"
    for node in ("host0", "host1"):
        on_node = ct.Tiers(memory=memory, node=node).memory_run(run)
        names = [c.name for c in ct.list_checkpoints(on_node)]
        assert names[-1] == newest and "step-1" in names, (node, names)
    assert ct.list_checkpoints(run, storage_options=opts) == []  # nothing was persisted

    results = run_distributed(_recover, 4, run, opts, memory, setup=hosts.ranks(2), timeout=240)
    for recovered, exact in results:
        assert exact and recovered.url == f"{run}/{newest}" and recovered.bytes_from_durable == 0


def _recover_or_fail(rank: int, world: int, run: str, opts: dict, memory: str) -> list:
    started = time.monotonic()
    try:
        _recover(rank, world, run, opts, memory)
        outcome = None
    except ct.CkptTurboError as exc:
        outcome = type(exc).__name__
    return [outcome, time.monotonic() - started]


def test_a_link_cut_while_a_lost_node_recovers_fails_the_load_in_bounded_time(
        hosts, store, tmp_path, bounded):
    """Host 1 lost its memory and recovers from host 0 over a slow link that goes down
    mid-transfer: every rank's load raises CommunicationError within a bound set by the
    group's timeout, host 0's tier is untouched, and once the link is back the recovery
    completes, bit-exact, without the durable store (which holds nothing)."""
    run, opts, memory = store.url(), store.storage_options, str(tmp_path / "mem")
    host1 = hosts.hosts[1]
    run_distributed(_save, 4, run, opts, memory, 1, setup=hosts.ranks(2), timeout=240)
    shutil.rmtree(Path(memory) / "host1")
    hosts.limit(host1, 4)  # host 1's ~1.5 MB of chunks: seconds
    base = hosts.bytes_received(host1)

    def cut_mid_transfer() -> None:
        deadline = time.monotonic() + 60
        while hosts.bytes_received(host1) - base < 300_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        hosts.cut(host1)

    cutter = threading.Thread(target=cut_mid_transfer, daemon=True)
    cutter.start()
    try:
        outcomes = run_distributed(_recover_or_fail, 4, run, opts, memory, setup=hosts.ranks(2),
                                   timeout=120, group_timeout=GROUP_TIMEOUT)
    finally:
        cutter.join(timeout=65)
        hosts.heal(host1)
        hosts.limit(host1, None)
    for error, seconds in outcomes:
        assert error == "CommunicationError" and seconds < 4 * GROUP_TIMEOUT, outcomes
    host0_run = ct.Tiers(memory=memory, node="host0").memory_run(run)
    assert [c.name for c in ct.list_checkpoints(host0_run)] == ["step-1"]

    results = run_distributed(_recover, 4, run, opts, memory, setup=hosts.ranks(2), timeout=240)
    for rank, (recovered, exact) in enumerate(results):
        assert exact and recovered.url == f"{run}/step-1" and recovered.bytes_from_durable == 0, (
            rank, recovered)


def _tier_bytes(memory: str) -> int:
    """The bytes in this host's memory tier now; a file renamed or removed between the
    listing and its stat (a chunk's temporary file at its commit, an evicted chunk) is
    not there any more and counts nothing."""
    total = 0
    for f in (Path(memory) / socket.gethostname()).rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except FileNotFoundError:
            continue
    return total


def _save_faster_than_replication(rank: int, world: int, run: str, opts: dict, memory: str,
                                  budget: int, saves: int) -> list:
    """Saves back to back; the most this host's memory tier held after any of them."""
    tiers = ct.Tiers(memory=memory, persist_every=0, memory_bytes=budget)
    peak = 0
    with ct.Session() as s:
        for step in range(1, saves + 1):
            s.save(_state(rank, step), f"{run}/step-{step}", storage_options=opts,
                   tiers=tiers).local.result()
            peak = max(peak, _tier_bytes(memory))
    # the session closed: every replication done, and what had to stay for them evicted
    return [peak, [c.name for c in ct.list_checkpoints(tiers.memory_run(run))]]


def test_saves_faster_than_the_network_keep_the_memory_tier_near_its_budget(hosts, store, tmp_path,
                                                                            bounded):
    """Replication over a 4 Mbit/s link takes seconds and each pins its checkpoint in
    memory, so saves issued back to back would queue replicas without bound; over the
    budget, a save waits for the oldest replication in flight, so the tier never holds
    more than the budget and about two checkpoints; what had to stay for them is evicted
    once they are done, without another save."""
    run, opts, memory = store.url(), store.storage_options, str(tmp_path / "mem")
    checkpoint = 2 * (200_000 + 50_000) * 4  # a host's shards and its peer's replicas
    host1 = hosts.hosts[1]
    hosts.limit(host1, 4)
    try:
        results = run_distributed(_save_faster_than_replication, 2, run, opts, memory, checkpoint,
                                  10, setup=hosts.ranks(1), timeout=240)
    finally:
        hosts.limit(host1, None)
    for peak, kept in results:
        assert peak <= checkpoint + 2.5 * checkpoint, (peak, checkpoint)
        assert kept == ["step-10"]  # evicted once no longer in flight, without another save
