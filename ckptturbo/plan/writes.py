"""Write plans: which holder writes which chunk-aligned byte range of every item.

Pure: every rank computes the same plan from the same inputs (see ``balance`` for the
algorithm and its bound; ``plan_stats`` measures a plan against that bound).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from ..errors import PlanError
from .balance import Group, balance
from .checks import check_size, check_weights, group_members

# small last pieces go out in bundles of up to 1/BUNDLE_FRACTION of a group's granularity
BUNDLE_FRACTION = 8


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One item of a save: `nbytes` bytes held identically by every rank in `holders`."""

    key: str
    nbytes: int
    holders: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes [start, end) of the item named `key`."""

    key: str
    start: int
    end: int


def plan_writes(
    items: Sequence[PlanItem],
    world_size: int,
    *,
    chunk_size: int,
    weights: Sequence[float] | None = None,
) -> list[list[ByteRange]]:
    """Return, for every rank 0..world_size-1, the byte ranges it writes.

    Every byte of every item goes to exactly one of its holders; range boundaries are
    multiples of `chunk_size` from the item's start (or the item's end), so whoever
    writes a range cuts exactly the content-addressed chunks anyone else would; adjacent
    ranges of one item on one rank are merged; a zero-byte item becomes one empty range
    on one holder so that it is still recorded. The result does not depend on the order
    of `items`. Each rank's list is sorted by (key, start). The balance guarantee and
    its proof are in the module docstring.
    """
    w = check_weights(weights, world_size)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise PlanError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    ordered = _sorted_items(items)
    load = [0] * world_size
    out: list[list[list]] = [[] for _ in range(world_size)]
    groups = []
    holders_of = [tuple(it.holders) for it in ordered]
    keys = [it.key for it in ordered]
    bundles: list[list[tuple[int, int]]] = []
    for holders, members in group_members(holders_of, "item", keys, world_size).items():
        if len(holders) == 1:
            for i in members:
                out[holders[0]].append([ordered[i].key, 0, ordered[i].nbytes])
                load[holders[0]] += ordered[i].nbytes
        else:
            groups.append(_write_group(holders, members, ordered, chunk_size, bundles))
    balance(groups, load, w, chunk_size)
    for g in groups:
        _emit_group(g, ordered, chunk_size, bundles, out)
    return [
        [ByteRange(k, s, e) for k, s, e in sorted(ranges, key=lambda x: (x[0], x[1]))]
        for ranges in out
    ]

def plan_stats(
    items: Sequence[PlanItem],
    plan: Sequence[Sequence[ByteRange]],
    world_size: int,
    weights: Sequence[float] | None = None,
) -> dict:
    """Summarise a write plan: how much each rank writes and how close to optimal that is.

    total_bytes counts every replica (what ranks hold), unique_bytes what storage sees.
    makespan is max_r bytes_r / w_r and lower_bound the bound of the module docstring,
    so makespan / lower_bound measures how far the plan can be from the best possible.
    """
    w = check_weights(weights, world_size)
    per_rank = [sum(r.end - r.start for r in ranges) for ranges in plan]
    unique = sum(it.nbytes for it in items)
    makespan = max((b / wr for b, wr in zip(per_rank, w, strict=True)), default=0.0)
    bound = _write_lower_bound(items, plan, per_rank, w)
    mean = unique / world_size
    return {
        "world_size": world_size,
        "items": len(items),
        "total_bytes": sum(it.nbytes * len(it.holders) for it in items),
        "unique_bytes": unique,
        "per_rank_bytes": per_rank,
        "max_bytes": max(per_rank, default=0),
        "mean_bytes": mean,
        "max_mean_ratio": max(per_rank, default=0) / mean if mean else 1.0,
        "makespan": makespan,
        "lower_bound": bound,
        "makespan_over_bound": makespan / bound if bound else 1.0,
    }

def _sorted_items(items: Sequence[PlanItem]) -> list[PlanItem]:
    ordered = sorted(items, key=lambda it: it.key)
    for a, b in pairwise(ordered):
        if a.key == b.key:
            raise PlanError(f"duplicate item key {a.key!r}")
    for it in ordered:
        check_size(f"item {it.key!r}", it.nbytes)
    return ordered


def _write_group(
    holders: tuple[int, ...], members: list[int], ordered: list[PlanItem], chunk: int,
    bundles: list[list[tuple[int, int]]],
) -> Group:
    """Split a holder set's items into whole chunks and indivisible last pieces.

    Small last pieces (biases, norms, optimizer steps) go out in bundles, in key order:
    dealt one by one, they would spread over as many ranks as the world has, each rank
    would pack its own tiny chunk, and the number of chunks, the manifest and every rank's
    load plan would grow with the world. A bundle holds up to 1/``BUNDLE_FRACTION`` of the
    granularity the group has anyway: a chunk when it has whole chunks (which the world
    size does not change), else the larger of a holder's fair share and its largest piece,
    so a small state stays as finely balanced as before. Bundles are no larger than a
    chunk, which keeps the balance bound. A group piece is (size, bundle index)."""
    whole, small, total = 0, [], 0
    for i in members:
        n = ordered[i].nbytes
        total += n
        whole += n // chunk
        if n % chunk or n == 0:
            small.append((n % chunk, i))
    largest = max((size for size, _ in small), default=0)
    scale = chunk if whole else min(chunk, max(total // len(holders), largest))
    limit = scale // BUNDLE_FRACTION
    pieces: list[tuple[int, int]] = []
    open_bundle: list[tuple[int, int]] = []
    open_bytes = 0
    for size, i in small:  # members, hence pieces, in key order
        if size >= limit:
            pieces.append((size, len(bundles)))
            bundles.append([(size, i)])
            continue
        if open_bundle and open_bytes + size > limit:
            pieces.append((open_bytes, len(bundles)))
            bundles.append(open_bundle)
            open_bundle, open_bytes = [], 0
        open_bundle.append((size, i))
        open_bytes += size
    if open_bundle:
        pieces.append((open_bytes, len(bundles)))
        bundles.append(open_bundle)
    pieces.sort(key=lambda p: (-p[0], p[1]))
    return Group(holders, members, whole, pieces, total)


def _emit_group(g: Group, ordered: list[PlanItem], chunk: int,
                bundles: list[list[tuple[int, int]]], out: list[list[list]]) -> None:
    """Turn a group's chunk counts and piece owners into ranges: holders in rank order
    take consecutive runs of the group's whole chunks (items in key order), so each
    holder gets at most one range per item from them; a last piece on the rank that
    wrote the item's last whole chunk extends that range."""
    last: dict[int, tuple[int, list]] = {}  # item index -> (rank, range ending its whole chunks)
    members = iter(g.members)
    i, done = -1, 0  # current item, and its whole chunks already handed out
    for rank, count in sorted(g.whole_at.items()):
        while count:
            if i < 0 or done == ordered[i].nbytes // chunk:
                i, done = next(members), 0
                continue
            take = min(count, ordered[i].nbytes // chunk - done)
            rng = [ordered[i].key, done * chunk, (done + take) * chunk]
            out[rank].append(rng)
            done += take
            count -= take
            if done == ordered[i].nbytes // chunk:
                last[i] = (rank, rng)
    for (_, b), rank in zip(g.pieces, g.piece_at, strict=True):
        for size, i in bundles[b]:
            end = ordered[i].nbytes
            prev = last.get(i)
            if prev is not None and prev[0] == rank:
                prev[1][2] = end
            else:
                out[rank].append([ordered[i].key, end - size, end])


def _write_lower_bound(
    items: Sequence[PlanItem],
    plan: Sequence[Sequence[ByteRange]],
    per_rank: list[int],
    w: list[float],
) -> float:
    """max over candidate sets T of B(T) / W(T): the world, every distinct holder set,
    and the closure of the most loaded rank (the set the repair's certificate uses)."""
    set_bytes: dict[tuple[int, ...], int] = {}
    for it in items:
        key = tuple(it.holders)
        set_bytes[key] = set_bytes.get(key, 0) + it.nbytes
    bound = sum(set_bytes.values()) / sum(w)
    containing: dict[int, list[tuple[int, ...]]] = {}
    for s in set_bytes:
        for q in s:
            containing.setdefault(q, []).append(s)
    as_set = {s: frozenset(s) for s in set_bytes}
    inside = dict.fromkeys(set_bytes, 0)
    for g, b in set_bytes.items():
        for s in containing[g[0]]:
            if len(s) >= len(g) and as_set[s].issuperset(g):
                inside[s] += b
    for s, b in inside.items():
        bound = max(bound, b / sum(w[q] for q in s))
    if per_rank:
        closure = _closure(items, plan, per_rank, w)
        held = sum(b for s, b in set_bytes.items() if closure.issuperset(s))
        bound = max(bound, held / sum(w[q] for q in closure))
    return bound


def _closure(
    items: Sequence[PlanItem],
    plan: Sequence[Sequence[ByteRange]],
    per_rank: list[int],
    w: list[float],
) -> frozenset[int]:
    """Ranks reachable from the most loaded rank by "u -> every holder of an item that
    u writes bytes of": everything written there is held there."""
    holders = {it.key: tuple(it.holders) for it in items}
    start = max(range(len(per_rank)), key=lambda q: (per_rank[q] / w[q], -q))
    reached, queue, seen = {start}, deque([start]), set()
    while queue:
        for rng in plan[queue.popleft()]:
            hs = holders[rng.key]
            if rng.end > rng.start and hs not in seen:
                seen.add(hs)
                fresh = [q for q in hs if q not in reached]
                reached.update(fresh)
                queue.extend(fresh)
    return frozenset(reached)
