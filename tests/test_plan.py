"""Write and read plans: exact coverage, chunk alignment, balance against the true optimum.

The balance checks compare with the exact fractional optimum, found independently of
ckptturbo.plan by enumerating every subset T of ranks (max of B(T) / W(T)), so the
tests also cover holder families for which plan.py proves nothing a priori.
"""
from __future__ import annotations

import random
from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptturbo.errors import PlanError
from ckptturbo.plan import (
    ByteRange,
    ChainAssignment,
    PlanItem,
    ReadNeed,
    plan_reads,
    plan_stats,
    plan_writes,
)

MiB = 1 << 20
SETTINGS = settings(max_examples=200, deadline=None)
WEIGHTS = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])


# ---------------------------------------------------------------- helpers


def exact_optimum(groups: list[tuple[int, tuple[int, ...]]], weights: list[float]) -> float:
    """max over every non-empty set T of ranks of (bytes held only within T) / W(T)."""
    n, best = len(weights), 0.0
    for mask in range(1, 1 << n):
        inside = sum(b for b, hs in groups if all(mask >> q & 1 for q in hs))
        best = max(best, inside / sum(weights[q] for q in range(n) if mask >> q & 1))
    return best


def makespan(per_rank: list[int], weights: list[float]) -> float:
    return max(b / w for b, w in zip(per_rank, weights, strict=True))


def check_write_plan(items: list[PlanItem], plan: list[list[ByteRange]], n: int,
                     chunk: int) -> None:
    """Every byte once, only on holders, chunk-aligned, adjacent same-rank ranges merged."""
    assert len(plan) == n
    by_key = {it.key: it for it in items}
    cover = defaultdict(list)
    for rank, ranges in enumerate(plan):
        assert ranges == sorted(ranges, key=lambda r: (r.key, r.start))
        for r in ranges:
            it = by_key[r.key]
            assert rank in it.holders
            assert 0 <= r.start <= r.end <= it.nbytes
            assert r.start % chunk == 0
            assert r.end % chunk == 0 or r.end == it.nbytes
            cover[r.key].append((r.start, r.end, rank))
    assert set(cover) == set(by_key)
    for key, spans in cover.items():
        spans.sort()
        if by_key[key].nbytes == 0:
            assert [s[:2] for s in spans] == [(0, 0)]
            continue
        assert spans[0][0] == 0 and spans[-1][1] == by_key[key].nbytes
        for (s0, e0, r0), (s1, e1, r1) in pairwise(spans):
            assert s0 < e0 == s1 < e1
            assert r0 != r1, "adjacent ranges on one rank must be merged"


def per_rank_bytes(plan: list[list[ByteRange]]) -> list[int]:
    return [sum(r.end - r.start for r in ranges) for ranges in plan]


def whole_item_greedy(items: list[PlanItem], n: int) -> list[int]:
    """DCP's dedup_save_plans: each whole item to its least loaded holder."""
    load = [0] * n
    for it in items:
        q = min(it.holders, key=load.__getitem__)
        load[q] += it.nbytes
    return load


# ---------------------------------------------------------------- strategies


@st.composite
def laminar_family(draw, ranks: list[int]) -> list[tuple[int, ...]]:
    """The blocks of a random recursive partition of `ranks`: nested or disjoint."""
    family = [tuple(ranks)]
    if len(ranks) > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, len(ranks) - 1), max_size=2)))
        for a, b in pairwise([0, *cuts, len(ranks)]):
            family += draw(laminar_family(ranks[a:b]))
    return family


@st.composite
def holder_family(draw, n: int, laminar: bool) -> list[tuple[int, ...]]:
    if laminar:
        ranks = draw(st.permutations(range(n)))
        return [tuple(sorted(s)) for s in draw(laminar_family(list(ranks)))]
    sets = st.sets(st.integers(0, n - 1), min_size=1).map(lambda s: tuple(sorted(s)))
    return draw(st.lists(sets, min_size=1, max_size=5))


@st.composite
def write_problems(draw, laminar: bool):
    n = draw(st.integers(1, 6))
    chunk = draw(st.integers(1, 8))
    family = draw(holder_family(n, laminar))
    sizes = draw(st.lists(st.integers(0, 40), max_size=10))
    items = [PlanItem(f"item{i}", size, draw(st.sampled_from(family)))
             for i, size in enumerate(sizes)]
    weights = draw(st.none() | st.lists(WEIGHTS, min_size=n, max_size=n))
    return items, n, chunk, weights


@st.composite
def read_problems(draw, laminar: bool):
    n = draw(st.integers(1, 6))
    family = draw(holder_family(n, laminar))
    sizes = draw(st.lists(st.integers(0, 20), max_size=14))
    needs = [ReadNeed(f"{i:064x}", size, draw(st.sampled_from(family)))
             for i, size in enumerate(sizes)]
    weights = draw(st.none() | st.lists(WEIGHTS, min_size=n, max_size=n))
    return needs, n, weights


# ---------------------------------------------------------------- write plan: properties


@SETTINGS
@given(problem=st.booleans().flatmap(write_problems))
def test_write_plan_covers_every_byte_once_on_holders_chunk_aligned(problem):
    items, n, chunk, weights = problem
    check_write_plan(items, plan_writes(items, n, chunk_size=chunk, weights=weights), n, chunk)


@SETTINGS
@given(problem=st.booleans().flatmap(write_problems))
def test_write_makespan_within_one_chunk_of_fractional_optimum(problem):
    items, n, chunk, weights = problem
    w = weights or [1.0] * n
    plan = plan_writes(items, n, chunk_size=chunk, weights=weights)
    optimum = exact_optimum([(it.nbytes, it.holders) for it in items], w)
    stats = plan_stats(items, plan, n, weights)
    assert stats["lower_bound"] <= optimum + 1e-9  # plan_stats' bound is a true lower bound
    assert makespan(per_rank_bytes(plan), w) <= optimum + chunk / min(w) + 1e-9


@SETTINGS
@given(problem=write_problems(laminar=True))
def test_laminar_unit_weights_strictly_less_than_one_chunk_above_optimum(problem):
    items, n, chunk, _ = problem
    plan = plan_writes(items, n, chunk_size=chunk)
    optimum = exact_optimum([(it.nbytes, it.holders) for it in items], [1.0] * n)
    assert makespan(per_rank_bytes(plan), [1.0] * n) < optimum + chunk + 1e-9
    # for laminar families the distinct holder sets already give the exact optimum
    assert plan_stats(items, plan, n)["lower_bound"] == pytest.approx(optimum)


@SETTINGS
@given(problem=st.booleans().flatmap(write_problems), data=st.data())
def test_write_plan_is_deterministic_and_ignores_item_order(problem, data):
    items, n, chunk, weights = problem
    plan = plan_writes(items, n, chunk_size=chunk, weights=weights)
    assert plan_writes(items, n, chunk_size=chunk, weights=weights) == plan
    shuffled = data.draw(st.permutations(items))
    assert plan_writes(shuffled, n, chunk_size=chunk, weights=weights) == plan


# ---------------------------------------------------------------- write plan: examples


def test_fully_replicated_gib_over_four_ranks_is_balanced():
    sizes = [300, 200, 150, 100, 80, 60, 50, 40, 24, 20]  # MiB, 1 GiB in all
    items = [PlanItem(f"t{i}", s * MiB, (0, 1, 2, 3)) for i, s in enumerate(sizes)]
    plan = plan_writes(items, 4, chunk_size=64 * MiB)
    check_write_plan(items, plan, 4, 64 * MiB)
    assert plan_stats(items, plan, 4)["max_mean_ratio"] <= 1.10


def test_big_replicated_tensor_is_split_where_whole_item_greedy_cannot():
    items = [PlanItem("embedding", 768 * MiB, (0, 1, 2, 3))]
    items += [PlanItem(f"norm{i}", (i + 1) * MiB, (0, 1, 2, 3)) for i in range(6)]
    plan = plan_writes(items, 4, chunk_size=64 * MiB)
    check_write_plan(items, plan, 4, 64 * MiB)
    ours, greedy = max(per_rank_bytes(plan)), max(whole_item_greedy(items, 4))
    assert greedy >= 768 * MiB
    assert ours <= 0.3 * 768 * MiB
    assert ours <= greedy / 3


def test_small_replicated_items_are_bundled_on_few_ranks_whatever_the_world():
    """Tiny items (biases, norms, optimizer steps) of a replicated group go out in bundles:
    the ranks that write them, hence the tiny chunks they pack, do not grow with the
    world, and the plan stays within one chunk of the optimum."""
    chunk = 64 * MiB
    items = [PlanItem(f"w{i:03d}", 96 * MiB, ()) for i in range(64)]
    items += [PlanItem(f"s{i:03d}", 4096, ()) for i in range(600)]

    def small_writers(world: int) -> int:
        held = [PlanItem(it.key, it.nbytes, tuple(range(world))) for it in items]
        plan = plan_writes(held, world, chunk_size=chunk)
        check_write_plan(held, plan, world, chunk)
        stats = plan_stats(held, plan, world)
        assert stats["makespan"] < stats["lower_bound"] + chunk
        return sum(any(r.key.startswith("s") for r in ranges) for ranges in plan)

    few, many = small_writers(64), small_writers(512)
    assert few < 64 and many <= few  # 600 single pieces would take 64 and 512 ranks


def test_weights_scale_the_share_of_each_rank():
    items = [PlanItem("w", 4000, (0, 1, 2))]
    plan = plan_writes(items, 3, chunk_size=10, weights=[1.0, 3.0, 0.5])
    assert per_rank_bytes(plan) == pytest.approx([889, 2667, 444], abs=10)


def test_zero_size_items_are_recorded_once():
    items = [PlanItem("empty", 0, (1, 2)), PlanItem("alone", 0, (3,)), PlanItem("x", 5, (1, 2))]
    plan = plan_writes(items, 4, chunk_size=4)
    check_write_plan(items, plan, 4, 4)
    assert ByteRange("alone", 0, 0) in plan[3]


def test_non_replicated_items_stay_whole_on_their_rank():
    items = [PlanItem(f"s{r}", 100 + r, (r,)) for r in range(3)]
    plan = plan_writes(items, 3, chunk_size=8)
    assert plan == [[ByteRange("s0", 0, 100)], [ByteRange("s1", 0, 101)], [ByteRange("s2", 0, 102)]]


def test_crossing_holder_sets_are_repaired_to_the_optimum():
    # Fewest-holders-first alone splits "a" over ranks 0 and 1, then must put most of "c"
    # on rank 0 although rank 1 could have taken all of "a": a path a:0->1 frees rank 0.
    items = [PlanItem("a", 40, (0, 1)), PlanItem("c", 40, (0, 2)), PlanItem("s", 40, (2,))]
    plan = plan_writes(items, 3, chunk_size=1)
    check_write_plan(items, plan, 3, 1)
    assert per_rank_bytes(plan) == [40, 40, 40]


def test_hsdp_mesh_is_within_one_chunk_of_bound():
    world, shards = 64, 16
    rng = random.Random(0)
    groups = [tuple(s + k * shards for k in range(world // shards)) for s in range(shards)]
    items = [PlanItem(f"p{p}@{s}", rng.randrange(1, 200) * MiB, groups[s])
             for p in range(8) for s in range(shards)]
    items += [PlanItem(f"norm{i}", rng.randrange(1, 64) << 10, tuple(range(world)))
              for i in range(50)]
    items += [PlanItem("embed", 1 << 30, tuple(range(world)))]
    plan = plan_writes(items, world, chunk_size=16 * MiB)
    check_write_plan(items, plan, world, 16 * MiB)
    stats = plan_stats(items, plan, world)
    assert stats["makespan"] <= stats["lower_bound"] + 16 * MiB


def test_plan_stats_reports_totals():
    items = [PlanItem("a", 100, (0, 1)), PlanItem("b", 50, (1,))]
    plan = plan_writes(items, 2, chunk_size=10)
    stats = plan_stats(items, plan, 2)
    assert stats["total_bytes"] == 250 and stats["unique_bytes"] == 150
    assert sum(stats["per_rank_bytes"]) == 150
    assert stats["lower_bound"] == 75.0
    assert stats["max_mean_ratio"] == stats["max_bytes"] / 75


@pytest.mark.parametrize("items, world, chunk, weights, message", [
    ([PlanItem("a", 1, (0, 2))], 2, 4, None, "out of range"),
    ([PlanItem("a", 1, (-1, 0))], 2, 4, None, "out of range"),
    ([PlanItem("a", 1, ())], 2, 4, None, "no ranks"),
    ([PlanItem("a", 1, (1, 0))], 2, 4, None, "sorted and unique"),
    ([PlanItem("a", 1, (0, 0))], 2, 4, None, "sorted and unique"),
    ([PlanItem("a", -1, (0,))], 2, 4, None, "non-negative"),
    ([PlanItem("a", 1, (0,)), PlanItem("a", 2, (1,))], 2, 4, None, "duplicate"),
    ([PlanItem("a", 1, (0,))], 2, 0, None, "chunk_size"),
    ([PlanItem("a", 1, (0,))], 2, -4, None, "chunk_size"),
    ([PlanItem("a", 1, (0,))], 2, 4, [1.0, 0.0], "weight of rank 1"),
    ([PlanItem("a", 1, (0,))], 2, 4, [1.0, float("nan")], "weight of rank 1"),
    ([PlanItem("a", 1, (0,))], 2, 4, [1.0], "2 weights|1 weights"),
    ([PlanItem("a", 1, (0,))], 0, 4, None, "world_size"),
])
def test_bad_write_input_raises_plan_error(items, world, chunk, weights, message):
    with pytest.raises(PlanError, match=message):
        plan_writes(items, world, chunk_size=chunk, weights=weights)


# ---------------------------------------------------------------- read plan


@SETTINGS
@given(problem=st.booleans().flatmap(read_problems))
def test_read_plan_one_reader_per_chunk_chain_covers_needers(problem):
    needs, n, weights = problem
    plan = plan_reads(needs, n, weights=weights)
    assert [a.chunk for a in plan] == sorted(nd.chunk for nd in needs)
    by_chunk = {nd.chunk: nd for nd in needs}
    for a in plan:
        need = by_chunk[a.chunk]
        assert a.nbytes == need.nbytes
        assert sorted(a.chain) == list(need.ranks) and len(set(a.chain)) == len(a.chain)
        reader = a.chain[0]
        assert list(a.chain) == [reader, *[q for q in need.ranks if q > reader],
                                 *[q for q in need.ranks if q < reader]]


@SETTINGS
@given(problem=st.booleans().flatmap(read_problems), data=st.data())
def test_read_plan_balanced_and_deterministic(problem, data):
    needs, n, weights = problem
    w = weights or [1.0] * n
    plan = plan_reads(needs, n, weights=weights)
    assert plan_reads(data.draw(st.permutations(needs)), n, weights=weights) == plan
    load = [0] * n
    for a in plan:
        load[a.chain[0]] += a.nbytes
    optimum = exact_optimum([(nd.nbytes, nd.ranks) for nd in needs], w)
    largest = max((nd.nbytes for nd in needs), default=0)
    assert makespan(load, w) <= optimum + largest / min(w) + 1e-9


def test_read_plan_spreads_replicated_chunks_and_rotates_chains():
    needs = [ReadNeed(f"{i:064x}", 10, (0, 1, 2, 3)) for i in range(8)]
    plan = plan_reads(needs, 4)
    readers = [a.chain[0] for a in plan]
    assert sorted(readers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {a.chain for a in plan} == {(0, 1, 2, 3), (1, 2, 3, 0), (2, 3, 0, 1), (3, 0, 1, 2)}
    assert all(isinstance(a, ChainAssignment) for a in plan)


def test_read_chain_continues_cyclically_after_the_reader():
    needs = [ReadNeed("a" * 64, 100, (5,)), ReadNeed("b" * 64, 1, (0, 2, 5, 7))]
    plan = plan_reads(needs, 8)
    # rank 5 already reads 100 bytes, so the other chunk goes to rank 0
    assert plan[0].chain == (5,)
    assert plan[1].chain == (0, 2, 5, 7)
    plan = plan_reads([ReadNeed("b" * 64, 1, (0, 2, 5, 7))], 8, weights=[1, 1, 1, 1, 1, 9, 1, 1])
    assert plan[0].chain == (5, 7, 0, 2)


@pytest.mark.parametrize("needs, message", [
    ([ReadNeed("a" * 64, 1, (0,)), ReadNeed("a" * 64, 1, (1,))], "listed twice"),
    ([ReadNeed("a" * 64, 1, ())], "no ranks"),
    ([ReadNeed("a" * 64, 1, (4,))], "out of range"),
    ([ReadNeed("a" * 64, -2, (0,))], "non-negative"),
])
def test_bad_read_input_raises_plan_error(needs, message):
    with pytest.raises(PlanError, match=message):
        plan_reads(needs, 4)
