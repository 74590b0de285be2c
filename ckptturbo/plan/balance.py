"""Balancing: deal every holder set's bytes out over its ranks, within a chunk of optimal.

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
from bisect import insort
from collections import deque
from dataclasses import dataclass, field

# A safety net only: every repair move provably makes progress, but a pathological
# layout must not stall a save; the plan is valid (if less balanced) when it is reached.
_MAX_REPAIR_MOVES = 20_000


@dataclass
class Group:
    """Everything held by one holder set, and how it has been dealt out so far."""

    holders: tuple[int, ...]
    members: list[int]  # indices into the sorted items (or needs), in key order
    whole: int  # interchangeable whole chunks (writes only)
    pieces: list[tuple[int, int]]  # indivisible (size, member index), largest first
    nbytes: int
    whole_at: dict[int, int] = field(default_factory=dict)  # rank -> whole chunks
    piece_at: list[int] = field(default_factory=list)  # rank of each piece


def balance(groups: list[Group], load: list[int], w: list[float], chunk: int) -> None:
    """Deal every group's bytes out over its holders; see the module docstring for why
    this order and rule are within one chunk of optimal."""
    groups.sort(key=lambda g: (len(g.holders), -g.nbytes, g.holders))
    for g in groups:
        g.whole_at = deal_whole_chunks(g.holders, g.whole, chunk, load, w)
        g.piece_at = deal_pieces(g.holders, g.pieces, load, w)
    if not is_laminar([g.holders for g in groups]):
        Repair(groups, load, w, chunk).run()


def deal_whole_chunks(
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


def deal_pieces(
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


def is_laminar(sets: list[tuple[int, ...]]) -> bool:
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


class Repair:
    """Moves pieces along augmenting paths until no path can lower the most loaded rank
    (guarantee 2 of the module docstring). Needed only for non-laminar families."""

    def __init__(self, groups: list[Group], load: list[int], w: list[float], chunk: int):
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
        for (gi, src, dst), (size, pi) in zip(path, picks, strict=True):
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

