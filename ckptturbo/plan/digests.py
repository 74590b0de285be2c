"""Ranks with equal local plans: recognised by a digest, planned once.

Every rank of a DDP job, and every replica of an HSDP shard group, makes the same local
save plan. Sent whole from every rank, those plans make the coordinator's work grow with
world x items. Instead each rank names its plan by a digest; the first rank of each digest
sends the plan itself, the others only the digest (``PlanDigest``), and the coordinator
plans each distinct plan once. Pure: no I/O, no collectives.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

DIGEST_BYTES = 16


class PlanDigest:
    """The planner data of a grouped local plan: its ``digest``, whether this rank is the
    one that sends the plan (``sender``: the first rank with that digest), and ``mappings``
    (DCP's flattening of the state dict; sent by the sender only).

    ``local`` is the rank's whole local plan; it never travels (the writer and the
    planner on the rank read their items from it)."""

    __slots__ = ("digest", "sender", "mappings", "local")

    def __init__(self, digest: str, sender: bool, mappings: Any = None, local: Any = None) -> None:
        self.digest = digest
        self.sender = sender
        self.mappings = mappings
        self.local = local

    def __reduce__(self) -> tuple:
        return (PlanDigest, (self.digest, self.sender, self.mappings if self.sender else None))


def plan_digest(items: Iterable[tuple[tuple, tuple]], mappings: Any) -> str:
    """A digest of a local plan: ``items`` gives, for each of its items, the names that
    are its own (its fqn, its kind) and the key of its shape (sizes, offsets, dtype and
    the rest, everything else the coordinator plans with; the planner makes both);
    ``mappings`` is its planner data. Each distinct shape key is described once, as text,
    and items refer to it by number: a model's layers repeat a few shapes, and formatting
    a key is most of a digest's cost. Equal digests mean equal plans."""
    shapes: dict[tuple, int] = {}
    rows = [(*names, shapes.setdefault(key, len(shapes))) for names, key in items]
    described = ["|".join(map(str, key)) for key in shapes]
    h = hashlib.blake2b(pickle.dumps((rows, described, mappings),
                                     protocol=pickle.HIGHEST_PROTOCOL),
                        digest_size=DIGEST_BYTES)
    return h.hexdigest()


def first_ranks(digests: Sequence[str]) -> dict[str, int]:
    """The first rank of each distinct digest (the one that sends its plan)."""
    out: dict[str, int] = {}
    for rank, digest in enumerate(digests):
        out.setdefault(digest, rank)
    return out


def kind_conflict(kinds: Sequence[tuple[bool, str]], what: str) -> str | None:
    """Why the ranks of one save or load cannot plan together, or None. ``kinds``: per
    rank, whether its planner is one of ours (they exchange digests in a collective DCP's
    planners do not make) and its class name. Ours and others cannot mix; any of ours
    (subclasses too) can, as can any of DCP's kind. Checked before any plan is sent, so a
    mixed group fails on every rank instead of waiting for its timeout."""
    ours, name = kinds[0]
    for rank, (theirs, other) in enumerate(kinds):
        if theirs != ours:
            return (f"the ranks of one {what} plan with incompatible planners: rank 0 with "
                    f"{name}, rank {rank} with {other}; every rank must pass one of "
                    f"ckptturbo's planners (ct.save's and ct.load's default) or every rank "
                    f"one of another kind")
    return None


def ranks_by_digest(digests: Sequence[str]) -> dict[str, list[int]]:
    """Every distinct digest and its ranks, ascending, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        out.setdefault(digest, []).append(rank)
    return out
