"""Write and read plans: which rank writes or reads which bytes. Pure functions, no I/O.

Every rank computes the same plan from the same inputs, so nothing here may depend on
hash seeds, set order or the order items arrive in: inputs are sorted by key (or chunk
id) first and every tie is broken by rank number.

The problem, for writes: each item is held, byte for byte, by a set of ranks (its
holders); every byte must be written by exactly one holder, in chunk-aligned ranges, and
the slowest rank should finish as early as possible. With per-rank bandwidth weights
w_r, a rank that writes L_r bytes takes L_r / w_r; we minimise the makespan
M = max_r L_r / w_r. Reads are the same problem with indivisible pieces (whole chunks).

Lower bound. For any set T of ranks, the bytes of items whose holders all lie in T must
be written by ranks of T, so every plan, even one splitting bytes arbitrarily, has
M >= B(T) / W(T), where B(T) is those bytes and W(T) the weights of T. By max-flow /
min-cut the best such bound over all T equals the optimum of the fractional problem.
`plan_stats` evaluates it for the whole world, every distinct holder set, and the
closure set of the plan's most loaded rank (defined below).

Algorithm. Items are grouped by holder set; a group's bytes are whole chunks (which are
interchangeable) plus indivisible pieces (an item's partial last chunk, or a whole small
item). Singleton groups are assigned directly. The other groups are processed fewest
holders first, larger first; each group's pieces go, one at a time in effect, largest
first, to the holder whose level after taking the piece, (L_q + s) / w_q, is lowest.
Whole chunks are dealt arithmetically (a run of k chunks per holder), pieces through one
heap per distinct weight, so the cost is about O(items log holders x distinct weights
+ sum of distinct holder-set sizes), independent of how many chunks an item has (the
repair below adds a search per move, and runs only for non-laminar families).

Guarantee 1, laminar holder families (every two holder sets are nested or disjoint:
DP, FSDP, HSDP, TP x DP with replication along nested mesh dimensions). Let r reach the
makespan M and let S be the last holder set that gave r bytes (if none, M = B({r}) / w_r).
When r took that last piece of s <= chunk bytes, (L_q + s) / w_q >= M for every q in S.
Because smaller sets go first and the family is laminar, everything then on S's ranks
belongs to items held within S, so sum_q L_q + s <= B(S); with L_r = M w_r - s this gives
    M <= (B(S) + (|S| - 1) s) / W(S) <= LB + chunk (|S| - 1) / W(S) < LB + chunk / min(w),
that is, less than one chunk above the fractional optimum with unit weights.

Guarantee 2, any family. The greedy order can then be wrong by far more than a chunk, so
a repair follows: from the most loaded rank r, a breadth-first search walks "rank u ->
every holder of a group with bytes on u"; on reaching a rank v with
(L_v + chunk) / w_v < M, one piece per hop is moved along the path (whole chunks, several
at once, when every hop has them). Each move lowers r and leaves every rank it changes
below M, so the sorted vector of levels decreases lexicographically and the repair ends.
When the search reaches no such v, the reached set T is closed (every item with bytes on
T is held within T) and every v in T has L_v >= M w_v - chunk, which proves the same
bound with T in place of S. Not proven: a path can be unusable when pieces of different
sizes meet on it (partial last chunks), and the repair then stops without the
certificate (as it does, as a safety net, after _MAX_REPAIR_MOVES moves).
tests/test_plan.py checks the bound against the exact optimum, found by enumerating
every subset of ranks, on random families of both kinds. For reads, "chunk" in these
bounds is the largest chunk. Levels are compared as floats, so "exact" means up to
rounding in the last bit.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .errors import PlanError

__all__ = [
    "PlanItem",
    "ByteRange",
    "ReadNeed",
    "ChainAssignment",
    "plan_writes",
    "plan_reads",
    "plan_stats",
]

# A safety net only: every repair move provably makes progress, but a pathological
# layout must not stall a save; the plan is valid (if less balanced) when it is reached.
_MAX_REPAIR_MOVES = 20_000


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


@dataclass(frozen=True, slots=True)
class ReadNeed:
    """A stored chunk and the ranks that need some of its bytes."""

    chunk: str
    nbytes: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChainAssignment:
    """chain[0] reads `chunk` from storage and forwards it to chain[1], which forwards on."""

    chunk: str
    nbytes: int
    chain: tuple[int, ...]


@dataclass
class _Group:
    """Everything held by one holder set, and how it has been dealt out so far."""

    holders: tuple[int, ...]
    members: list[int]  # indices into the sorted items (or needs), in key order
    whole: int  # interchangeable whole chunks (writes only)
    pieces: list[tuple[int, int]]  # indivisible (size, member index), largest first
    nbytes: int
    whole_at: dict[int, int] = field(default_factory=dict)  # rank -> whole chunks
    piece_at: list[int] = field(default_factory=list)  # rank of each piece


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
    w = _check_weights(weights, world_size)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise PlanError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    ordered = _sorted_items(items)
    load = [0] * world_size
    out: list[list[list]] = [[] for _ in range(world_size)]
    groups = []
    holders_of = [tuple(it.holders) for it in ordered]
    keys = [it.key for it in ordered]
    for holders, members in _group_members(holders_of, "item", keys, world_size).items():
        if len(holders) == 1:
            for i in members:
                out[holders[0]].append([ordered[i].key, 0, ordered[i].nbytes])
                load[holders[0]] += ordered[i].nbytes
        else:
            groups.append(_write_group(holders, members, ordered, chunk_size))
    _balance(groups, load, w, chunk_size)
    for g in groups:
        _emit_group(g, ordered, chunk_size, out)
    return [
        [ByteRange(k, s, e) for k, s, e in sorted(ranges, key=lambda x: (x[0], x[1]))]
        for ranges in out
    ]


def plan_reads(
    needs: Sequence[ReadNeed],
    world_size: int,
    *,
    weights: Sequence[float] | None = None,
) -> list[ChainAssignment]:
    """Choose, for every chunk, the one rank that reads it and the chain that forwards it.

    The reader is one of the ranks that need the chunk, chosen by the same balancing as
    `plan_writes` (a chunk is an indivisible piece). The chain is the reader, then the
    other needers above it ascending, then those below it ascending: when many chunks
    have the same needers, readers rotate and so does the rank that ends each chain, so
    forwarding work spreads evenly. The list is sorted by chunk id, independent of the
    order of `needs`; every rank walks it in that order to post its sends and receives.
    Chunk ids must be unique: merge the needers of a chunk used in several places.
    """
    w = _check_weights(weights, world_size)
    ordered = _sorted_needs(needs)
    load = [0] * world_size
    reader = [0] * len(ordered)
    groups = []
    ranks_of = [tuple(n.ranks) for n in ordered]
    ids = [n.chunk for n in ordered]
    for ranks, members in _group_members(ranks_of, "chunk", ids, world_size).items():
        if len(ranks) == 1:
            for i in members:
                reader[i] = ranks[0]
                load[ranks[0]] += ordered[i].nbytes
        else:
            pieces = sorted(((ordered[i].nbytes, i) for i in members), key=lambda p: (-p[0], p[1]))
            groups.append(_Group(ranks, members, 0, pieces, sum(p[0] for p in pieces)))
    largest = max((n.nbytes for n in ordered), default=0)
    _balance(groups, load, w, largest)
    for g in groups:
        for (_, i), rank in zip(g.pieces, g.piece_at):
            reader[i] = rank
    return [
        ChainAssignment(n.chunk, n.nbytes, _chain(reader[i], ranks_of[i]))
        for i, n in enumerate(ordered)
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
    w = _check_weights(weights, world_size)
    per_rank = [sum(r.end - r.start for r in ranges) for ranges in plan]
    unique = sum(it.nbytes for it in items)
    makespan = max((b / wr for b, wr in zip(per_rank, w)), default=0.0)
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


# ---------------------------------------------------------------- input checks


def _check_weights(weights: Sequence[float] | None, world_size: int) -> list[float]:
    if not isinstance(world_size, int) or world_size <= 0:
        raise PlanError(f"world_size must be a positive integer, got {world_size!r}")
    if weights is None:
        return [1.0] * world_size
    if len(weights) != world_size:
        raise PlanError(f"got {len(weights)} weights for world_size {world_size}")
    for rank, x in enumerate(weights):
        if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
            raise PlanError(f"weight of rank {rank} must be finite and positive, got {x!r}")
    return [float(x) for x in weights]


def _check_size(name: str, nbytes: object) -> None:
    if not isinstance(nbytes, int) or nbytes < 0:
        raise PlanError(f"{name}: size must be a non-negative integer, got {nbytes!r}")


def _check_ranks(name: str, ranks: tuple[int, ...], world_size: int) -> None:
    if not ranks:
        raise PlanError(f"{name}: no ranks hold it")
    if not all(isinstance(q, int) for q in ranks):
        raise PlanError(f"{name}: ranks must be integers, got {ranks!r}")
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        raise PlanError(f"{name}: ranks must be sorted and unique, got {ranks!r}")
    if ranks[0] < 0 or ranks[-1] >= world_size:
        raise PlanError(f"{name}: rank out of range for world_size {world_size}: {ranks!r}")


def _sorted_items(items: Sequence[PlanItem]) -> list[PlanItem]:
    ordered = sorted(items, key=lambda it: it.key)
    for a, b in zip(ordered, ordered[1:]):
        if a.key == b.key:
            raise PlanError(f"duplicate item key {a.key!r}")
    for it in ordered:
        _check_size(f"item {it.key!r}", it.nbytes)
    return ordered


def _sorted_needs(needs: Sequence[ReadNeed]) -> list[ReadNeed]:
    ordered = sorted(needs, key=lambda n: n.chunk)
    for a, b in zip(ordered, ordered[1:]):
        if a.chunk == b.chunk:
            raise PlanError(f"chunk {a.chunk!r} is listed twice: merge its ranks into one need")
    for n in ordered:
        _check_size(f"chunk {n.chunk!r}", n.nbytes)
    return ordered


def _group_members(
    ranks_of: list[tuple[int, ...]], what: str, ids: list[str], world_size: int
) -> dict[tuple[int, ...], list[int]]:
    """Indices of the entries of each distinct rank set, checking each set only once
    (a fully replicated item's holders are world_size long, and there may be thousands)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ranks in enumerate(ranks_of):
        groups.setdefault(ranks, []).append(i)
    for ranks, members in groups.items():
        _check_ranks(f"{what} {ids[members[0]]!r}", ranks, world_size)
    return groups


# ---------------------------------------------------------------- balancing


def _write_group(
    holders: tuple[int, ...], members: list[int], ordered: list[PlanItem], chunk: int
) -> _Group:
    """Split a holder set's items into whole chunks and indivisible last pieces."""
    whole, pieces, total = 0, [], 0
    for i in members:
        n = ordered[i].nbytes
        total += n
        whole += n // chunk
        if n % chunk or n == 0:
            pieces.append((n % chunk, i))
    pieces.sort(key=lambda p: (-p[0], p[1]))
    return _Group(holders, members, whole, pieces, total)


def _balance(groups: list[_Group], load: list[int], w: list[float], chunk: int) -> None:
    """Deal every group's bytes out over its holders; see the module docstring for why
    this order and rule are within one chunk of optimal."""
    groups.sort(key=lambda g: (len(g.holders), -g.nbytes, g.holders))
    for g in groups:
        g.whole_at = _deal_whole_chunks(g.holders, g.whole, chunk, load, w)
        g.piece_at = _deal_pieces(g.holders, g.pieces, load, w)
    if not _is_laminar([g.holders for g in groups]):
        _Repair(groups, load, w, chunk).run()


def _deal_whole_chunks(
    holders: tuple[int, ...], count: int, chunk: int, load: list[int], w: list[float]
) -> dict[int, int]:
    """Give `count` chunks as if one at a time, each to the holder whose level after
    taking it is lowest (ties: lower rank), but in O(h log h) for h holders: the
    continuous water level says how many chunks each holder takes, and a heap settles
    the fewer than h chunks that rounding down leaves over."""
    if count == 0:
        return {}
    order = sorted(holders, key=lambda q: (load[q] / w[q], q))
    budget, level, sum_w, sum_load = count * chunk, 0.0, 0.0, 0
    for i, q in enumerate(order):
        sum_w += w[q]
        sum_load += load[q]
        level = (budget + sum_load) / sum_w
        if i + 1 == len(order) or level <= load[order[i + 1]] / w[order[i + 1]]:
            break
    taken = {q: max(0, int((level * w[q] - load[q]) // chunk)) for q in holders}
    given = sum(taken.values())
    if given > count:  # float rounding overshot: take back the highest last chunks
        heap = [(-(load[q] + k * chunk) / w[q], -q) for q, k in taken.items() if k]
        heapq.heapify(heap)
        for _ in range(given - count):
            _, negq = heapq.heappop(heap)
            q = -negq
            taken[q] -= 1
            if taken[q]:
                heapq.heappush(heap, (-(load[q] + taken[q] * chunk) / w[q], negq))
    else:
        heap = [((load[q] + (k + 1) * chunk) / w[q], q) for q, k in taken.items()]
        heapq.heapify(heap)
        for _ in range(count - given):
            q = heap[0][1]
            taken[q] += 1
            heapq.heapreplace(heap, ((load[q] + (taken[q] + 1) * chunk) / w[q], q))
    for q, k in taken.items():
        load[q] += k * chunk
    return {q: k for q, k in taken.items() if k}


def _deal_pieces(
    holders: tuple[int, ...], pieces: list[tuple[int, int]], load: list[int], w: list[float]
) -> list[int]:
    """Give each piece, in the order given, to the holder whose level after taking it
    is lowest (ties: lower rank). Among holders of equal weight that is the least
    loaded one, so one heap per distinct weight finds it without scanning all holders
    (weights come from a few bandwidth classes, so there are few heaps)."""
    if not pieces:
        return []
    by_weight: dict[float, list[tuple[int, int]]] = {}
    for q in holders:
        by_weight.setdefault(w[q], []).append((load[q], q))
    classes = sorted(by_weight.items())
    for _, heap in classes:
        heapq.heapify(heap)
    owners = []
    for size, _ in pieces:
        heap = classes[0][1]
        if len(classes) > 1:
            heap = min(classes, key=lambda c: ((c[1][0][0] + size) / c[0], c[1][0][1]))[1]
        held, q = heap[0]
        heapq.heapreplace(heap, (held + size, q))
        load[q] = held + size
        owners.append(q)
    return owners


def _is_laminar(sets: list[tuple[int, ...]]) -> bool:
    """True when every two sets are nested or disjoint. Larger sets first: each set's
    ranks must then all sit directly inside one same earlier set (or in none)."""
    owner: dict[int, int] = {}
    for idx, ranks in sorted(enumerate(sets), key=lambda t: (-len(t[1]), t[0])):
        first = owner.get(ranks[0], -1)
        if any(owner.get(q, -1) != first for q in ranks):
            return False
        for q in ranks:
            owner[q] = idx
    return True


class _Repair:
    """Moves pieces along augmenting paths until no path can lower the most loaded rank
    (guarantee 2 of the module docstring). Needed only for non-laminar families."""

    def __init__(self, groups: list[_Group], load: list[int], w: list[float], chunk: int):
        self.groups, self.load, self.w, self.chunk = groups, load, w, chunk
        # Per group: rank -> indices of its non-empty pieces there, largest first.
        self.held: list[dict[int, list[int]]] = []
        # Per rank: the groups with bytes on it (a dict as an insertion-ordered set).
        self.on: list[dict[int, None]] = [{} for _ in load]
        for gi, g in enumerate(groups):
            held: dict[int, list[int]] = {}
            for pi, q in enumerate(g.piece_at):
                if g.pieces[pi][0]:
                    held.setdefault(q, []).append(pi)
            self.held.append(held)
            for q in [*held, *g.whole_at]:
                self.on[q][gi] = None

    def run(self) -> None:
        for _ in range(_MAX_REPAIR_MOVES):
            if not self._improve():
                return

    def _improve(self) -> bool:
        """One breadth-first search from the most loaded rank; True if it moved bytes."""
        load, w = self.load, self.w
        r = max(range(len(load)), key=lambda q: (load[q] / w[q], -q))
        top = load[r] / w[r]
        parent: dict[int, tuple[int, int] | None] = {r: None}
        expanded: set[int] = set()
        queue = deque([r])
        while queue:
            u = queue.popleft()
            for gi in sorted(self.on[u]):
                if gi in expanded:
                    continue
                expanded.add(gi)
                for v in self.groups[gi].holders:
                    if v in parent:
                        continue
                    parent[v] = (u, gi)
                    if (load[v] + self.chunk) / w[v] < top and self._shift(_path(parent, v), top):
                        return True
                    queue.append(v)
        return False

    def _shift(self, path: list[tuple[int, int, int]], top: float) -> bool:
        """Move one piece per hop (gi, src, dst) of `path`, if sizes allow every rank on
        it to end below `top` or unchanged; pick from the end, largest that fits."""
        picks: list[tuple[int, int]] = []
        passes_on: int | None = None  # bytes the current hop's receiver gives away
        for gi, src, dst in reversed(path):
            if passes_on is None:
                pick = self._largest(gi, src, math.inf, math.inf)
            else:
                slack = top * self.w[dst] - self.load[dst] + passes_on
                pick = self._largest(gi, src, passes_on, slack)
            if pick is None:
                return False
            picks.append(pick)
            passes_on = pick[0]
        picks.reverse()
        count = 1
        if all(pi < 0 for _, pi in picks):  # whole chunks only: move a run at once
            count = self._run_length(path, top)
        for (gi, src, dst), (size, pi) in zip(path, picks):
            self._move(gi, src, dst, pi, count if pi < 0 else 1, size)
        return True

    def _largest(self, gi: int, src: int, at_most: float, below: float) -> tuple[int, int] | None:
        """The largest piece of group gi on src whose size s has s <= at_most or
        s < below, as (size, piece index), with index -1 for a whole chunk."""
        g = self.groups[gi]
        if g.whole_at.get(src, 0) and (self.chunk <= at_most or self.chunk < below):
            return self.chunk, -1
        for pi in self.held[gi].get(src, ()):
            size = g.pieces[pi][0]
            if size <= at_most or size < below:
                return size, pi
        return None

    def _run_length(self, path: list[tuple[int, int, int]], top: float) -> int:
        """How many whole chunks to push along an all-whole-chunk path: as many as the
        path has, but no more than bring its two ends level."""
        w, r, v = self.w, path[0][1], path[-1][2]
        avail = min(self.groups[gi].whole_at[src] for gi, src, _ in path)
        level = (top - self.load[v] / w[v]) / (self.chunk * (1 / w[v] + 1 / w[r]))
        return max(1, min(avail, int(level)))

    def _move(self, gi: int, src: int, dst: int, pi: int, count: int, size: int) -> None:
        g, held = self.groups[gi], self.held[gi]
        if pi < 0:
            g.whole_at[src] -= count
            if not g.whole_at[src]:
                del g.whole_at[src]
            g.whole_at[dst] = g.whole_at.get(dst, 0) + count
        else:
            held[src].remove(pi)
            if not held[src]:
                del held[src]
            insort(held.setdefault(dst, []), pi)
            g.piece_at[pi] = dst
        if src not in held and src not in g.whole_at:
            del self.on[src][gi]
        self.on[dst][gi] = None
        self.load[src] -= count * size
        self.load[dst] += count * size


def _path(parent: dict[int, tuple[int, int] | None], v: int) -> list[tuple[int, int, int]]:
    """The hops (group, from, to) of the search tree from its root to v."""
    hops = []
    step = parent[v]
    while step is not None:
        u, gi = step
        hops.append((gi, u, v))
        v, step = u, parent[u]
    hops.reverse()
    return hops


# ---------------------------------------------------------------- output


def _emit_group(g: _Group, ordered: list[PlanItem], chunk: int, out: list[list[list]]) -> None:
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
    for (size, i), rank in zip(g.pieces, g.piece_at):
        end = ordered[i].nbytes
        prev = last.get(i)
        if prev is not None and prev[0] == rank:
            prev[1][2] = end
        else:
            out[rank].append([ordered[i].key, end - size, end])


def _chain(reader: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The reader, then the needers above it ascending, then those below it ascending
    (a rotation of the sorted needers: slices, since a chain can be world_size long)."""
    at = bisect_left(ranks, reader)
    return ranks[at:] + ranks[:at]


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
