"""Chain broadcast over real gloo processes: exact bytes, exact traffic, bounded failures."""
from __future__ import annotations

import heapq
import os
import pickle
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ckptturbo.broadcast import ChainBroadcaster
from ckptturbo.broadcast_schedule import (
    LOCAL,
    PackedChains,
    Rotations,
    Transfer,
    alloc_step,
    last_step,
    needs_communication,
    npieces,
    own_parts,
    plan_schedule,
    rotated_parts,
    schedule_rotations,
)
from ckptturbo.errors import CommunicationError, IntegrityError, PlanError
from ckptturbo.testing.launcher import RankFailure, run_distributed

PIECE = 64 << 10
# Both directions between the same pair, sizes 0, 1, piece edges, chains of one rank.
TWO_RANK_TRANSFERS = [Transfer(1, 3 * PIECE + 17, (0, 1)), Transfer(2, 1_000_000, (1, 0)),
                      Transfer(3, 0, (0, 1)), Transfer(4, 1, (1, 0)),
                      Transfer(5, 2 * PIECE, (0, 1)), Transfer(6, 12345, (0,)),
                      Transfer(7, 0, (1,)), Transfer(8, PIECE + 1, (1,))]


def pattern(t: Transfer) -> torch.Tensor:
    """The bytes of a transfer: deterministic per tid, so every rank can check them."""
    g = torch.Generator().manual_seed(t.tid)
    return torch.randint(0, 256, (t.nbytes,), dtype=torch.uint8, generator=g)


def uneven_source(t: Transfer) -> Iterator[torch.Tensor]:
    """Yield the pattern in sizes unrelated to the piece size, as storage reads would."""
    data, offset, sizes = pattern(t), 0, [1, 50_001, 3 * PIECE + 7, PIECE]
    while offset < t.nbytes:
        size = sizes[offset % len(sizes)]
        yield data[offset:offset + size]
        offset += size


class Checker:
    """A sink that verifies bytes and device, and counts calls (one per transfer per member)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device_type = torch.device(device).type
        self.calls: Counter[int] = Counter()
        self.bad: list[int] = []

    def __call__(self, t: Transfer, buffer: torch.Tensor) -> None:
        self.calls[t.tid] += 1
        if (buffer.dtype != torch.uint8 or buffer.device.type != self.device_type
                or not torch.equal(buffer.cpu(), pattern(t))):
            self.bad.append(t.tid)


def broadcast(transfers: list[Transfer], device: str = "cpu",
              **options: Any) -> tuple[dict[int, int], list[int], dict]:
    """Run one broadcast on this rank; return sink calls per tid, bad tids and stats."""
    checker = Checker(device)
    bc = ChainBroadcaster(piece_size=PIECE, timeout=30, device=device, **options)
    bc.run(transfers, uneven_source, checker)
    return dict(checker.calls), checker.bad, bc.stats


def expected_traffic(transfers: list[Transfer], rank: int) -> tuple[int, int]:
    """Bytes a rank must send and receive: nbytes per hop it takes part in, nothing more."""
    sent = sum(t.nbytes for t in transfers if rank in t.chain[:-1])
    received = sum(t.nbytes for t in transfers if rank in t.chain[1:])
    return sent, received


def check_rank_result(transfers: list[Transfer], rank: int,
                      result: tuple[dict[int, int], list[int], dict]) -> None:
    calls, bad, stats = result
    assert calls == {t.tid: 1 for t in transfers if rank in t.chain}
    assert bad == []
    assert (stats["bytes_sent"], stats["bytes_received"]) == expected_traffic(transfers, rank)


def random_transfers(world: int, count: int, seed: int) -> list[Transfer]:
    """Mixed sizes (0, 1, piece edges, several pieces) and chains of every length and order."""
    rng = random.Random(seed)
    sizes = [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 3, 1_500_000]
    transfers = []
    for tid in range(count):
        chain = rng.sample(range(world), rng.randint(1, world))
        head = tid % world  # every rank heads some chains
        chain = [head] + [r for r in chain if r != head]
        transfers.append(Transfer(1000 + 7 * tid, sizes[tid % len(sizes)], tuple(chain)))
    rng.shuffle(transfers)  # the list order need not be the tid order
    return transfers


def check_two_rank_results(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        check_rank_result(TWO_RANK_TRANSFERS, rank, out["mixed"])
        assert "different transfers or settings" in out["mismatch"]


def check_four_rank_results(results: list[dict[str, Any]]) -> None:
    transfers = random_transfers(4, 28, seed=5)
    chain = Transfer(9, 2_000_000, (2, 0, 3, 1))
    for rank, out in enumerate(results):
        check_rank_result(transfers, rank, out["random"])
        calls, bad, stats, sent_before_last = out["chain"]
        check_rank_result([chain], rank, (calls, bad, stats))
    # The head forwarded pieces before its source produced the last one (reads overlap sends).
    head_sent_before_last = results[2]["chain"][3]
    assert head_sent_before_last and head_sent_before_last[0] > 0


# ---- functions run inside the worker processes (module level, so they pickle) ----

def two_rank_job(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    transfers = TWO_RANK_TRANSFERS
    out = {"mixed": broadcast(transfers, device, max_inflight=2)}
    try:  # settings differ between ranks: every rank must refuse, not mismatch pieces
        broadcast(transfers, device, max_inflight=1 + rank)
    except PlanError as exc:
        out["mismatch"] = str(exc)
    return out


def four_rank_job(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    out = {"random": broadcast(random_transfers(world, 28, seed=5), device, max_inflight=3)}
    # A single 4-rank chain whose source records how far forwarding got before its last piece.
    chain = Transfer(9, 2_000_000, (2, 0, 3, 1))
    bc = ChainBroadcaster(piece_size=PIECE, max_inflight=1, timeout=30, device=device)
    sent_before_last: list[float] = []

    def source(t: Transfer) -> Iterator[torch.Tensor]:
        data = pattern(t)
        for offset in range(0, t.nbytes, PIECE):
            if offset + PIECE >= t.nbytes:
                sent_before_last.append(bc.stats["pieces_sent"])
            yield data[offset:offset + PIECE]

    checker = Checker(device)
    bc.run([chain], source, checker)
    out["chain"] = (dict(checker.calls), checker.bad, bc.stats, sent_before_last)
    return out


def source_fails_job(rank: int, world: int) -> float:
    def source(t: Transfer) -> Iterator[torch.Tensor]:
        yield pattern(t)[:PIECE]
        raise ValueError("storage read failed")

    began = time.monotonic()
    try:
        ChainBroadcaster(piece_size=PIECE, timeout=10).run(
            [Transfer(1, 20 * PIECE, (0, 1, 2))], source, Checker())
    except CommunicationError:
        return time.monotonic() - began
    raise AssertionError("run() should have failed")


def peer_fails_job(rank: int, world: int, timeout: float) -> tuple[float, str]:
    """Pair (0, 1): rank 1 dies mid-run. Pair (2, 3): rank 3 stalls past the timeout."""
    def sink(t: Transfer, buffer: torch.Tensor) -> None:
        if t.tid in (1, 3) and rank == 1:
            os._exit(1)
        if t.tid in (1, 3) and rank == 3:
            time.sleep(1.5 * timeout)  # workload: a peer silent past the timeout

    transfers = [Transfer(1, PIECE, (0, 1)), Transfer(2, 24 << 20, (0, 1)),
                 Transfer(3, PIECE, (2, 3)), Transfer(4, 24 << 20, (2, 3))]
    began = time.monotonic()
    try:
        ChainBroadcaster(piece_size=PIECE, max_inflight=2, timeout=timeout).run(
            transfers, uneven_source, sink)
    except CommunicationError as exc:
        return time.monotonic() - began, str(exc)
    raise AssertionError("run() should have failed")


# ---- tests ----

def test_two_ranks_both_directions_edge_sizes() -> None:
    check_two_rank_results(run_distributed(two_rank_job, 2, timeout=90))


def test_four_ranks_many_concurrent_chains() -> None:
    check_four_rank_results(run_distributed(four_rank_job, 4, timeout=90))


def test_source_error_propagates_and_peers_fail_fast() -> None:
    outcomes = run_distributed(source_fails_job, 3, timeout=60, expect_failures=True)
    assert isinstance(outcomes[0], RankFailure) and isinstance(outcomes[0].error, ValueError)
    for elapsed in outcomes[1:]:
        assert isinstance(elapsed, float) and elapsed < 10 + 2


def test_dead_or_stalled_peer_raises_communication_error_within_timeout() -> None:
    timeout = 3.0
    outcomes = run_distributed(peer_fails_job, 4, timeout, timeout=60, expect_failures=True)
    assert isinstance(outcomes[1], RankFailure) and outcomes[1].exitcode == 1
    dead_elapsed, dead_msg = outcomes[0]
    assert dead_elapsed < timeout + 2 and "transfer 2" in dead_msg and "rank 1" in dead_msg
    stalled_elapsed, stalled_msg = outcomes[2]
    assert timeout / 2 < stalled_elapsed < timeout + 2
    assert "transfer 4" in stalled_msg and "rank 3" in stalled_msg
    assert "rank 2" in outcomes[3][1]  # the stalled rank fails cleanly too once it wakes up


def _receive_into_destinations(rank: int, world: int) -> tuple[bool, bool, str]:
    """Receivers name where transfer 1 goes; the sink gets exactly that tensor, filled."""
    transfers = [Transfer(1, 3 * PIECE + 5, (0, 1, 2)), Transfer(2, PIECE, (0, 1, 2))]
    destination = torch.zeros(3 * PIECE + 5, dtype=torch.uint8)
    got: dict[int, torch.Tensor] = {}
    bc = ChainBroadcaster(piece_size=PIECE, timeout=30)
    bc.run(transfers, uneven_source, lambda t, b: got.__setitem__(t.tid, b),
           lambda t: destination if t.tid == 1 else None)
    same = got[1].data_ptr() == destination.data_ptr()
    exact = (torch.equal(got[1], pattern(transfers[0]))
             and torch.equal(got[2], pattern(transfers[1])))
    refused = ""
    try:  # a buffer of the wrong size is refused before any byte lands in it
        ChainBroadcaster(piece_size=PIECE, timeout=3).run(
            transfers, uneven_source, lambda t, b: None, lambda t: destination[:7])
    except (ValueError, CommunicationError) as exc:  # the head: its receivers gave up
        refused = f"{type(exc).__name__}: {exc}"
    return same, exact, refused


def test_receivers_assemble_in_the_buffers_they_name() -> None:
    head, *receivers = results = run_distributed(_receive_into_destinations, 3, timeout=60)
    assert head[:2] == (False, True)  # the head sends from its source's bytes
    assert all(r[:2] == (True, True) for r in receivers), results
    assert all(r[2].startswith("ValueError") and "must be" in r[2] for r in receivers), results
    assert head[2].startswith("CommunicationError"), results


def test_without_process_group_chains_of_one_work() -> None:
    transfers = [Transfer(2, 3 * PIECE + 1, (0,)), Transfer(1, 0, (0,))]
    checker = Checker()
    bc = ChainBroadcaster(piece_size=PIECE)
    bc.run(transfers, uneven_source, checker)
    assert checker.calls == {1: 1, 2: 1} and checker.bad == []
    assert bc.stats["bytes_sent"] == bc.stats["bytes_received"] == 0
    with pytest.raises(PlanError):
        bc.run([Transfer(1, 10, (0, 1))], uneven_source, checker)


def test_source_yielding_wrong_length_is_an_integrity_error() -> None:
    bc = ChainBroadcaster(piece_size=PIECE)
    with pytest.raises(IntegrityError, match="transfer 3"):
        bc.run([Transfer(3, 100, (0,))], lambda t: iter([torch.zeros(99, dtype=torch.uint8)]),
               Checker())
    with pytest.raises(IntegrityError, match="more than 100"):
        bc.run([Transfer(3, 100, (0,))], lambda t: iter([torch.zeros(101, dtype=torch.uint8)]),
               Checker())


def test_schedule_pipelines_a_chain_and_bounds_buffers() -> None:
    # One chain of 4 ranks, 10 pieces: the tail has everything after 10 + 2 steps, not 3 * 10.
    t = Transfer(0, 10 * PIECE, (0, 1, 2, 3))
    assert plan_schedule([t], PIECE, 4) == {0: 0}
    assert last_step(0, npieces(t.nbytes, PIECE), 3, 4) == 11
    # Many random chains: no rank ever holds more than max_inflight buffers at once.
    transfers = random_transfers(6, 200, seed=1)
    for max_inflight in (1, 3):
        starts = plan_schedule(transfers, PIECE, max_inflight)
        for rank in range(6):
            live = Counter()
            for tr in transfers:
                if tr.tid in starts and rank in tr.chain:
                    pos, n = tr.chain.index(rank), npieces(tr.nbytes, PIECE)
                    # phases: 2s = post of step s, 2s+1 = local work of step s (sinks first)
                    begin = 2 * alloc_step(starts[tr.tid], pos) + (1 if pos == 0 else 0)
                    end = 2 * (last_step(starts[tr.tid], n, pos, len(tr.chain)) + 1) + 1
                    for phase in range(begin, end):
                        live[phase] += 1
            assert max(live.values(), default=0) <= max_inflight


def _rotations(world: int, count: int, seed: int) -> tuple[list[Transfer], list[tuple]]:
    """Transfers as the read plan makes them: each chunk's needers (ascending; some all
    ranks, some evenly spaced, some any), its chain starting at one of them and going
    round the rest; sizes with 0 and 1 byte (transfers that move nothing)."""
    rng = random.Random(seed)
    sets = [tuple(range(world)), tuple(range(1, world, 2)), (2,),
            tuple(sorted(rng.sample(range(world), 3)))]
    sizes = [0, 1, PIECE - 1, PIECE, 5 * PIECE + 3]
    transfers, needers = [], []
    for tid in range(count):
        ranks = sets[rng.randrange(len(sets))]
        at = rng.randrange(len(ranks))
        transfers.append(Transfer(3 * tid + 5, sizes[tid % len(sizes)], ranks[at:] + ranks[:at]))
        needers.append(ranks)
    return transfers, needers


def _as_rotations(transfers: list[Transfer], needers: list[tuple]) -> list[Rotations]:
    """The transfers as the reader's coordinator describes them: per set of needers, each
    transfer's tid, size and the index of its head among them."""
    sets: dict[tuple, list[tuple[int, int, int]]] = {}
    for t, ranks in zip(transfers, needers, strict=True):
        sets.setdefault(ranks, []).append((t.tid, t.nbytes, ranks.index(t.chain[0])))
    return [Rotations(np.asarray(ranks), *np.asarray(rows).T) for ranks, rows in sets.items()]


def test_each_rank_computes_exactly_its_own_parts_from_the_shared_groups() -> None:
    """schedule_rotations (once, on a coordinator) starts every transfer where
    plan_schedule does on the chains themselves, and rotated_parts (each rank, from its
    groups) gives every rank the parts own_parts finds in the whole list, part for part;
    evenly spaced needers travel as three numbers."""
    for world, count, seed in ((7, 90, 4), (12, 200, 9)):
        transfers, needers = _rotations(world, count, seed=seed)
        for max_inflight in (1, 2, 4):
            groups = schedule_rotations(_as_rotations(transfers, needers), world, PIECE,
                                        max_inflight)
            starts = plan_schedule(transfers, PIECE, max_inflight)
            assert {int(t): int(s) for g in groups for t, s in zip(g.tids, g.starts, strict=True)
                    if s != LOCAL} == starts
            assert {(0, 1, world), (1, 2, world // 2), (2, 1, 1)} <= \
                {g.needers for g in groups if isinstance(g.needers, tuple)}
            packed = PackedChains.of(tuple(groups))  # as the coordinator sends them
            for rank in range(world):
                mine = pickle.loads(pickle.dumps(packed)).unpack()  # as a rank receives them
                rows = rotated_parts(mine, rank).tolist()
                assert rows == [[p.tid, p.step, p.prev, p.next]
                                for p in own_parts(transfers, rank, PIECE, max_inflight)]
            # a rank's plan carries the packed groups as one copy of their bytes
            assert len(pickle.dumps(packed)) < len(packed.blob) + 100


def test_rotations_that_no_schedule_can_serve_are_refused() -> None:
    """What validate refuses of a transfer list, schedule_rotations refuses of its sets."""
    def one(needers, heads=(0,), nbytes=(10,), tids=(1,)) -> list[Rotations]:
        return [Rotations(np.asarray(needers), np.asarray(tids), np.asarray(nbytes),
                          np.asarray(heads))]
    for bad, match in ((one((0, 2, 1)), "distinct ranks"), (one((0, 0)), "distinct ranks"),
                       (one((0, 4)), "distinct ranks"), (one(()), "non-empty"),
                       (one((0, 1), heads=(2,)), "head outside"),
                       (one((0, 1), nbytes=(-1,)), "nbytes >= 0"),
                       (one((0, 1)) + one((2, 3)), "duplicate tid")):
        with pytest.raises(PlanError, match=match):
            schedule_rotations(bad, 4, PIECE, 2)


def _heap_schedule(transfers: list[Transfer], max_inflight: int) -> dict[int, int]:
    """The greedy of plan_schedule spelled out: a min-heap of free steps per rank, one
    member at a time (the specification its array form must match)."""
    slots: dict[int, list[int]] = {}
    starts = {}
    for t in sorted(filter(needs_communication, transfers), key=lambda t: t.tid):
        heaps = [slots.setdefault(r, [-1] * max_inflight) for r in t.chain]
        start = max(0, *((h[0] + 1) if p == 0 else (h[0] + 2 - p) for p, h in enumerate(heaps)))
        n = npieces(t.nbytes, PIECE)
        for p, h in enumerate(heaps):
            heapq.heapreplace(h, last_step(start, n, p, len(t.chain)) + 1)
        starts[t.tid] = start
    return starts


def test_schedule_is_the_per_member_greedy_for_any_chains() -> None:
    """plan_schedule's array form starts every transfer where the per-member heap greedy
    does: random chains (some of one rank, some empty), long chains through every rank
    (a whole-state load), any number of buffers."""
    every = [Transfer(tid, (tid % 7 + 1) * PIECE // 3,
                      tuple(int(r) for r in np.roll(np.arange(9), tid))) for tid in range(40)]
    mixed = every[::3] + [Transfer(100 + t.tid, t.nbytes, t.chain)
                          for t in random_transfers(9, 30, seed=7)]
    for transfers in (random_transfers(6, 200, seed=5), random_transfers(3, 50, seed=6), every,
                      mixed):
        for max_inflight in (1, 2, 5):
            assert plan_schedule(transfers, PIECE, max_inflight) == \
                _heap_schedule(transfers, max_inflight)
