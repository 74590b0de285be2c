"""The peer tier: chunks copied between nodes' memory tiers over the job's gloo group.

A node's memory tier outlives its processes but not the node. So that the loss of one node
costs no read from the object store, each node's chunks of a checkpoint are copied into
``k`` other nodes' memory tiers after the save commits (``replicate``), and a load whose
ranks need chunks their own node lacks gets them from a node that holds them
(``fetch``), before any is read from the durable store.

Why the process group and not a server per node: every rank of every node is already in a
gloo group the session made, so a peer's memory is reachable with no port, address book or
daemon lifetime of its own, and the transfers are scheduled collectively with the rest of
the save or load. The cost: a node's memory is reachable only while its ranks run, which
is when it matters (a recovering job restarts every node's ranks, the holders' with them).

Which chunk goes from which node to which is planned by pure functions (``plan_replicas``,
``plan_fetches``) that every rank computes alike from what the nodes hold; replicas go
from node leader (the lowest rank of each node) to node leader, a load's chunks from the
ranks of a holder node to the rank that needs them, and every chunk is verified against
its BLAKE3 name before it is written into the receiving node's tier.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .agreement import agree, gather
from .chunks import batched, chunk_id
from .errors import CommunicationError, IntegrityError, StorageError
from .runs import RunStore

log = logging.getLogger(__name__)

ROUND_BYTES = 256 << 20  # bytes in flight per exchange round (sent + received, all ranks)


class Nodes:
    """The ranks of a group as the tiers see them: which node each rank is on, and each
    node's leader (its lowest rank), the one that writes for the node's memory tier."""

    def __init__(self, group: Any, node: str, nodes: list[str] | None = None) -> None:
        """``nodes``: every rank's node when a collective the caller made already carried
        them (one round fewer), else they are gathered here."""
        self.group = group
        if group is None:
            self.rank, self.nodes = 0, [node]
        else:
            self.rank = dist.get_rank(group)
            self.nodes = nodes if nodes is not None else gather(group, node)
        self.node = node
        self.order = list(dict.fromkeys(self.nodes))  # nodes in order of their leaders
        self.leaders = {n: self.nodes.index(n) for n in self.order}

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    @property
    def node_leader(self) -> bool:
        return self.leaders[self.node] == self.rank

    def share(self, value: Any, source: int = 0) -> Any:
        """Rank ``source``'s ``value`` (the coordinator's by default), on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, source),
                                   group=self.group)
        return box[0]


@dataclass(frozen=True)
class Copy:
    """One chunk sent from a rank of the group (``source``) to a rank of another node
    (``target``): from node leader to node leader when replicating; in a load, from any
    rank of a holder node to the rank that needs it."""

    cid: str
    nbytes: int
    source: int
    target: int


@dataclass(frozen=True)
class Replicated:
    """What a save's replication did: the copies each chunk now has in memory tiers (at
    most 1 + ``Tiers.replicas``, fewer when there are fewer nodes), and what was sent."""

    copies: int
    chunks_sent: int
    bytes_sent: int


def plan_replicas(chunks: dict[str, int], held: dict[str, set[str]], order: list[str],
                  leaders: dict[str, int], k: int) -> list[Copy]:
    """The copies that give each chunk ``1 + k`` holders (at most one per node).

    A chunk's base is its first holder in ``order``; the missing copies go to the nodes
    after it around the ring, skipping those that hold it already (dedup per tier). A
    chunk no node holds (evicted meanwhile) has nothing to copy."""
    want = min(1 + k, len(order))
    position = {n: i for i, n in enumerate(order)}
    copies = []
    for cid, nbytes in chunks.items():
        holders = [n for n in order if cid in held.get(n, ())]
        if not holders or len(holders) >= want:
            continue
        base = position[holders[0]]
        missing = want - len(holders)
        for step in range(1, len(order)):
            target = order[(base + step) % len(order)]
            if target in holders:
                continue
            copies.append(Copy(cid, nbytes, leaders[order[base]], leaders[target]))
            missing -= 1
            if not missing:
                break
    return copies


def plan_fetches(chunks: dict[str, int], lacking: dict[int, set[str]], nodes: list[str],
                 held: dict[str, set[str]]) -> list[Copy]:
    """The copies that bring each rank the chunks it needs (``lacking``, by rank) and its
    node's tier (``nodes``: each rank's node) lacks. A chunk goes once per node, to the
    lowest rank of the node that needs it: that rank loads it from the received bytes and
    keeps it in the node's tier, where the node's other ranks read it. Each comes from the
    holder node that has sent the fewest bytes so far, sent by that node's rank that has
    sent the fewest (every rank of a node can read its tier: a node's ranks share the
    reading and sending); one no other node holds is left to the durable store."""
    target: dict[tuple[str, str], int] = {}
    for rank in sorted(lacking):
        for cid in lacking[rank]:
            target.setdefault((nodes[rank], cid), rank)
    ranks_of: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(rank)
    load = {n: 0 for n in held}
    sent = [0] * len(nodes)
    copies = []
    for (node, cid), rank in sorted(target.items()):
        source = _least_loaded([n for n in sorted(held) if n != node and cid in held[n]],
                               load, chunks[cid])
        if source is not None:
            sender = min(ranks_of[source], key=lambda r: sent[r])
            sent[sender] += chunks[cid]
            copies.append(Copy(cid, chunks[cid], sender, rank))
    return copies


def spread(chunks: dict[str, int], held: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each chunk given to one of the nodes holding it, balancing bytes: who uploads what
    when a checkpoint is persisted (replicas must not be uploaded twice)."""
    load = {n: 0 for n in held}
    share: dict[str, list[str]] = {n: [] for n in held}
    for cid in sorted(chunks):
        node = _least_loaded([n for n in sorted(held) if cid in held[n]], load, chunks[cid])
        if node is not None:
            share[node].append(cid)
    return share


def _least_loaded(candidates: list[str], load: dict[str, int], nbytes: int) -> str | None:
    """The candidate with the fewest bytes so far, charged ``nbytes``; None when none."""
    if not candidates:
        return None
    chosen = min(candidates, key=lambda n: load[n])
    load[chosen] += nbytes
    return chosen


def rounds(copies: list[Copy], budget: int = ROUND_BYTES) -> Iterable[list[Copy]]:
    """``copies`` in order, cut into rounds of at most ``budget`` bytes (one copy at least)."""
    return batched(copies, lambda copy: copy.nbytes, budget)


def exchange(nodes: Nodes, copies: list[Copy], read: Callable[[str, int], torch.Tensor],
             write: Callable[[str, memoryview], None], what: str) -> int:
    """Carry out ``copies`` (the same list on every rank): this rank sends what it is the
    source of (``read(cid, nbytes)``: the chunk's bytes, e.g. ``tier_chunk``) and receives,
    verifies and writes what it is the target of. Returns the bytes received here.

    Every round posts all its sends and receives before waiting on any, so no order of
    arrival can deadlock, and ends with one agreement: every rank gets every outcome. Each
    chunk is verified and written as soon as it has arrived, while the later ones are still
    on the wire: after the last byte only the last chunk's check and write remain, not the
    whole round's (hashing and writing 16 MiB take about 9 ms on this machine's cores, an
    eighth of a recovery's transfer). A chunk its source cannot read is sent as zeros, so
    that no receiver waits for it; it fails its check where it arrives and the read's error
    is raised on the source, so a failed read fails every rank at once."""
    received = 0
    for batch in rounds(copies):
        problem: Exception | None = None
        sends = []
        incoming: list[tuple[Copy, torch.Tensor, Any]] = []
        for i, copy in enumerate(batch):
            if copy.source == nodes.rank and copy.nbytes:
                try:
                    buffer = read(copy.cid, copy.nbytes)
                except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                    problem = problem or exc
                    buffer = torch.zeros(copy.nbytes, dtype=torch.uint8)
                sends.append(dist.isend(buffer, dist.get_global_rank(nodes.group, copy.target),
                                        group=nodes.group, tag=i))
        for i, copy in enumerate(batch):
            if copy.target == nodes.rank:
                buffer = torch.empty(copy.nbytes, dtype=torch.uint8)
                work = (dist.irecv(buffer, dist.get_global_rank(nodes.group, copy.source),
                                   group=nodes.group, tag=i) if copy.nbytes else None)
                incoming.append((copy, buffer, work))
        try:
            for copy, buffer, work in incoming:
                if work is not None:
                    work.wait()
                if problem is None:  # the first problem stops the keeping, not the waiting
                    try:
                        _keep(copy, buffer, nodes, write)
                    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                        problem = exc
            for work in sends:
                assert work is not None, "isend/irecv give a Work to a rank of their group"
                work.wait()
        except RuntimeError as exc:  # how a gloo Work reports a peer gone or silent past timeout
            raise CommunicationError(f"copying the chunks of {what}: a peer node stopped sending "
                                     f"or receiving: {exc}") from exc
        agree(nodes.group, f"copying the chunks of {what}", partial(_raise, problem))
        received += sum(copy.nbytes for copy, _, _ in incoming)
    return received


def tier_chunk(run: RunStore, cid: str, nbytes: int) -> torch.Tensor:
    """Chunk ``cid`` of a memory tier (always a local directory) to send, mapped from its
    file instead of read into a buffer: the socket takes the bytes from the tier's pages,
    with no copy before (the receiver verifies them). The mapping is private and only
    read: nothing can reach the file through it."""
    path = run.chunk_path(cid)
    try:
        return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    except RuntimeError as exc:  # missing, or shorter than the manifest says
        raise StorageError(f"chunk {cid} of the memory tier {run.store.url_of(run.chunks_root)} "
                           f"cannot be read: {exc}") from exc


def _raise(problem: Exception | None) -> None:
    if problem is not None:
        raise problem


def _keep(copy: Copy, buffer: torch.Tensor, nodes: Nodes,
          write: Callable[[str, memoryview], None]) -> None:
    view = buffer.numpy().data  # the received bytes, as a memoryview
    if chunk_id(view) != copy.cid:
        raise IntegrityError(f"chunk {copy.cid} received from node {nodes.nodes[copy.source]!r} "
                             f"(rank {copy.source}) does not hash to its name: damaged in transit "
                             "or in that node's memory tier")
    write(copy.cid, view)


def holdings(nodes: Nodes, held_here: Callable[[], set[str]],
             ids: list[str]) -> dict[str, set[str]]:
    """Which of ``ids`` each node's memory tier holds: node leaders report theirs (a bitmap
    over ``ids``), every rank gets every node's."""
    mine = held_bits(held_here(), ids) if nodes.node_leader else None
    return held_by_node(nodes, gather(nodes.group, mine), ids)


def held_bits(have: set[str], ids: list[str]) -> bytes:
    """Which of ``ids`` are in ``have``, one bit each: what a node leader tells the others."""
    return np.packbits(np.fromiter((c in have for c in ids), dtype=bool, count=len(ids))).tobytes()


def held_by_node(nodes: Nodes, bits: list[bytes | None], ids: list[str]) -> dict[str, set[str]]:
    """Every node's holdings from each rank's ``held_bits`` (None from a non-leader)."""
    out: dict[str, set[str]] = {}
    for rank, mine in enumerate(bits):
        if mine is not None:
            flags = np.unpackbits(np.frombuffer(mine, dtype=np.uint8), count=len(ids)).astype(bool)
            out[nodes.nodes[rank]] = {c for c, f in zip(ids, flags, strict=True) if f}
    return out
