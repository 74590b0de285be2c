"""Chain (pipelined) broadcast of byte ranges over a torch.distributed group.

On load each storage chunk is read once, by the head of a *chain* of ranks, and forwarded
hop by hop in pieces: while rank k sends piece i to rank k+1 it receives piece i+1 from
rank k-1. A chunk of S bytes then reaches L ranks in about S/bw + (L-1)*piece/bw instead
of (L-1)*S/bw for the root sending to everyone, and every link carries each byte once.
Many chains (one per chunk, different heads and orders) run at once to keep all links busy.

The schedule (who sends which piece to whom, at which step) is ``broadcast_schedule``'s,
a pure function of the transfer list: :func:`~ckptturbo.broadcast_schedule.schedule`
computes every rank's parts once, on a coordinator (``run_parts``);
:meth:`ChainBroadcaster.run` is the convenience for callers that have the full list on
every rank (it extracts this rank's parts itself). Each rank loops over steps: post the
step's sends and receives as one batch (``batch_isend_irecv``: one NCCL group, or
independent gloo operations), then do local work while they fly (call sinks of finished
transfers, pull the next pieces from sources), then wait for the batch. Sources are
therefore read one piece ahead of the wire: piece 0 is on its way before the source has
produced piece 1.

Deadlock freedom. (1) For every send posted at step s the peer posts the matching receive
at the same step s, and every rank posts its operations in (step, tid) order, so each
ordered pair of ranks sees the same sequence on both ends, with or without tags (NCCL has
none). (2) The operations of one step are one batch, so none waits behind another of the
same step, and a step depends only on earlier steps (a rank forwards a piece one step after
receiving it; the head's pieces come from local storage). (3) By induction on the step,
every rank posts and completes every step: there is no cycle to wait on, whatever the
directions of the chains; ranks need not be in the same step, only neighbours meet.
Posting all receives of a window first and the sends after would do for gloo but not for
NCCL, which runs operations on a stream in posting order: if A and B head chains through
each other, A's receive for B's chain and B's receive for A's chain each queue in front of
the send the other waits for.

Memory per rank: at most ``max_inflight`` buffers of a transfer's size (assembled bytes,
forwarded from in place) plus one source piece being copied in. Pieces are cut at fixed
``piece_size`` offsets of the transfer whatever sizes the source yields: the head copies
what the source yields into its own assembly buffer (it needs one for its sink anyway) and
sends slices of it, so the wire format never depends on how storage returned the bytes.
A source that yields the whole transfer as one tensor on ``device`` is sent from directly.

Buffer ownership (the contract every client follows). A *source* yields tensors the
broadcaster only reads: they must stay unchanged until the transfer's sink has been
called, and a source that yields the whole transfer as one tensor on ``device`` gets that
very tensor back in its sink. A receiving rank assembles a transfer in a buffer of its
own, or in the one ``buffers(t)`` names (the transfer's final destination, so that no
copy follows; the broadcaster writes the received bytes into it and sends from it, nothing
else). A *sink* receives the whole transfer in one buffer and owns it from then on: the
broadcaster drops every reference before the call returns and never reuses the memory,
so a sink may keep the buffer (no copy) or let it go. What the sink keeps counts against
the client's memory bound, not the broadcaster's.

Failures: every wait has a deadline of ``timeout`` seconds from when it starts; a dead or
stuck peer makes the others raise :class:`~ckptturbo.errors.CommunicationError` naming the
transfer and the peer. Ranks that pass different plans or settings all raise
:class:`~ckptturbo.errors.PlanError` before any piece moves (one all-reduce of a digest). The head
may block on its source between steps, so ``timeout`` must exceed the slowest piece read.
Exceptions from ``source`` and ``sink`` propagate unchanged on the rank that raised them.
Transfers without communication (a chain of one rank, or zero bytes) are done after the
chains, since peers wait on the chains and nobody waits on them.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .broadcast_schedule import (
    LOCAL,
    NONE,
    Part,
    Transfer,
    needs_communication,
    npieces,
    own_parts,
    plan_digest,
    validate,
    validate_parts,
)
from .errors import CommunicationError, IntegrityError, PlanError

logger = logging.getLogger(__name__)

Source = Callable[["Part"], Iterator[torch.Tensor]]
"""Yields a head's bytes of a transfer; the tensors must stay unchanged until its sink runs."""
Sink = Callable[["Part", torch.Tensor], None]
"""Receives a complete transfer; it owns the buffer from then on (see the module docstring)."""
Buffers = Callable[["Part"], "torch.Tensor | None"]
"""Where a receiving rank assembles a transfer (its destination), or None for a buffer of our
own."""

_TAG_MASK = (1 << 31) - 1  # gloo tags are 32-bit; tags only add a check, order is what matches


class _Op(NamedTuple):
    tid: int
    piece: int
    peer: int
    send: bool
    tensor: torch.Tensor

    def describe(self) -> str:
        verb, prep = ("sending", "to") if self.send else ("receiving", "from")
        return f"transfer {self.tid}: {verb} piece {self.piece} {prep} rank {self.peer}"


class _Role:
    """This rank's part in one scheduled transfer, with its buffer and source."""

    def __init__(self, part: Part, piece_size: int) -> None:
        self.transfer = part
        self.step = part.step
        self.piece_size = piece_size
        self.npieces = npieces(part.nbytes, piece_size)
        self.is_head = part.prev == NONE
        self.is_tail = part.next == NONE
        self.alloc_step = part.step - 1  # the head prefills; the others receive piece 0
        self.last_step = part.step + self.npieces - 1 - (1 if self.is_tail else 0)
        self.buffer: torch.Tensor | None = None
        self.filler: _Filler | None = None

    def piece(self, i: int) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer[i * self.piece_size:(i + 1) * self.piece_size]

    def ops(self, step: int) -> list[_Op]:
        """The receive and/or send this member posts at ``step`` (receive first: it is
        for a later piece than the send, and order within a batch does not matter)."""
        p, ops = self.transfer, []
        i = step - (self.step - 1)
        if not self.is_head and 0 <= i < self.npieces:
            ops.append(_Op(p.tid, i, p.prev, False, self.piece(i)))
        i = step - self.step
        if not self.is_tail and 0 <= i < self.npieces:
            ops.append(_Op(p.tid, i, p.next, True, self.piece(i)))
        return ops


class _Filler:
    """Assembles what a source yields into one buffer, on demand, checking its length.

    A source that yields the whole transfer as one tensor on the right device is used as
    the buffer itself: no copy, which matters where memory bandwidth is close to the link's.
    Head buffers are only ever sent from and handed to the sink, never written to.
    """

    def __init__(self, transfer: Part, device: torch.device, source: Source) -> None:
        self.transfer = transfer
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.pieces: Iterator[torch.Tensor] | None = iter(source(transfer))
        self.filled = 0

    def fill(self, upto: int) -> None:
        """Pull pieces until at least ``upto`` bytes are in the buffer (the last pull may
        bring more); once all bytes are in, make sure the source has nothing left."""
        t = self.transfer
        while self.filled < upto:
            assert self.pieces is not None  # dropped only once all bytes are in (upto <= nbytes)
            piece = next(self.pieces, None)
            if piece is None:
                raise IntegrityError(f"transfer {t.tid}: source ended after {self.filled} "
                                     f"of {t.nbytes} bytes")
            self._take(piece)
        if self.filled == t.nbytes and self.pieces is not None:
            for extra in self.pieces:
                self._take(extra)
            self.pieces = None
            if self.buffer is None:  # zero bytes
                self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _take(self, piece: torch.Tensor) -> None:
        t = self.transfer
        if piece.dtype != torch.uint8:
            raise TypeError(f"transfer {t.tid}: source must yield uint8 tensors, got {piece.dtype}")
        flat = piece.reshape(-1)
        end = self.filled + flat.numel()
        if end > t.nbytes:
            raise IntegrityError(f"transfer {t.tid}: source yielded more than {t.nbytes} bytes")
        if self.buffer is None and flat.numel() == t.nbytes and flat.device == self.device:
            self.buffer = flat
        elif flat.numel():
            if self.buffer is None:
                self.buffer = torch.empty(t.nbytes, dtype=torch.uint8, device=self.device)
            self.buffer[self.filled:end].copy_(flat)
        self.filled = end


class ChainBroadcaster:
    """Delivers byte ranges along chains of ranks with pipelined point-to-point sends.

    ``piece_size`` trades pipeline fill time (smaller is better) against per-message
    overhead; ``max_inflight`` bounds the transfers (and so the full-size buffers) a rank
    holds at once; ``timeout`` bounds every wait on a peer; ``device`` is where buffers
    live: "cpu" for gloo, "cuda" for NCCL. All ranks must use the same settings.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, piece_size: int = 8 << 20,
                 max_inflight: int = 4, timeout: float = 300.0,
                 device: torch.device | str = "cpu") -> None:
        if piece_size <= 0 or max_inflight <= 0 or timeout <= 0:
            raise ValueError("piece_size, max_inflight and timeout must be positive")
        self.group = group
        self.piece_size = piece_size
        self.max_inflight = max_inflight
        self.timeout = timeout
        self.device = torch.device(device)
        self._device = self.device  # self.device made concrete at each run()
        self.stats: dict[str, float] = {}

    def run(self, transfers: Sequence[Transfer], source: Source, sink: Sink,
            buffers: Buffers | None = None) -> None:
        """Deliver every transfer this rank belongs to; call ``sink`` once for each.

        Every rank calls run() with the same transfers (it computes its own parts of the
        schedule from them; see :meth:`run_parts` for what each call does). On a chain head
        ``source(t)`` yields the bytes as uint8 tensors of any sizes (cut here into
        ``piece_size`` pieces); every member, head included, gets ``sink(t, buffer)`` with
        the whole transfer in one uint8 tensor of ``nbytes`` on ``device``, once it is
        complete, and owns it from then on (see "Buffer ownership" in the module docstring);
        on the head it may be the very tensor the source yielded. On a receiving rank,
        ``buffers(t)`` may name the uint8 tensor of ``nbytes`` on ``device`` to receive
        into (None: one of the broadcaster's own). ``t`` is this rank's :class:`Part`.
        """
        rank, world = self._rank_and_world()
        validate(transfers, world)
        parts = own_parts(transfers, rank, self.piece_size, self.max_inflight)
        chained = any(needs_communication(t) for t in transfers)
        self.run_parts(parts, source, sink, buffers,
                       plan_id=plan_digest(transfers) if chained else None)

    def run_parts(self, parts: Sequence[Part], source: Source, sink: Sink,
                  buffers: Buffers | None = None, *, plan_id: int | None) -> None:
        """Take this rank's ``parts`` (from :func:`schedule`, made with this broadcaster's
        ``piece_size`` and ``max_inflight``) through the step loop; ``source``, ``sink``
        and ``buffers`` as in :meth:`run`. ``plan_id`` names the plan the parts come from,
        the same on every rank: all ranks then check, in one collective, that they run the
        same plan with the same settings. None only when no transfer of the plan
        communicates (then no rank may pass one)."""
        began = time.monotonic()
        self._device = self.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self._device = torch.device("cuda", torch.cuda.current_device())
        rank, world = self._rank_and_world()
        validate_parts(parts, world)
        self.stats = dict.fromkeys(("bytes_sent", "bytes_received", "pieces_sent",
                                    "pieces_received", "transfers", "steps"), 0)
        self.stats["transfers"] = len(parts)
        if plan_id is not None:
            self._check_same_plan(plan_id)
            self._run_chains([p for p in parts if p.step != LOCAL], source, sink, buffers)
        for p in sorted(parts, key=lambda p: p.tid):
            if p.step == LOCAL:
                self._run_local(p, source, sink)
        self.stats["seconds"] = time.monotonic() - began
        logger.debug("rank %d: chain broadcast done: %s", rank, self.stats)

    def _rank_and_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            if self.group is not None:
                raise RuntimeError(
                    "a process group was given but torch.distributed is not initialized")
            return 0, 1
        rank = dist.get_rank(self.group)
        if rank < 0:
            raise ValueError("this process is not a member of the broadcaster's group")
        return rank, dist.get_world_size(self.group)

    def _check_same_plan(self, plan_id: int) -> None:
        """Make sure every rank runs the same plan with the same settings.

        Different plans would pair sends with the wrong receives; one small all-reduce (the
        maximum of the digest and of its negation) turns that misuse into an error on every
        rank, and only then does an all-gather name the ranks that differ. It also
        initialises NCCL communicators on all ranks before the first batched send, which
        NCCL requires.
        """
        digest = hashlib.blake2b(repr((self.piece_size, self.max_inflight, plan_id)).encode(),
                                 digest_size=7).digest()
        mine = int.from_bytes(digest, "little")
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=self._device)
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work, "checking that all ranks run the same transfers", time.monotonic())
        if both[0].item() == -both[1].item() == mine:
            return
        one = torch.tensor([mine], dtype=torch.int64, device=self._device)
        gathered = [torch.empty_like(one) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(gathered, one, group=self.group, async_op=True)
        self._wait(work, "naming the ranks that run other transfers", time.monotonic())
        differ = [r for r, g in enumerate(gathered) if g.item() != mine]
        raise PlanError(f"ranks {differ} called run() with different transfers or settings "
                        f"(piece_size, max_inflight) than rank {dist.get_rank(self.group)}")

    def _run_chains(self, parts: list[Part], source: Source, sink: Sink,
                    buffers: Buffers | None) -> None:
        """The step loop: post a step's batch, do local work while it flies, wait for it."""
        roles = [_Role(p, self.piece_size) for p in parts]
        if not roles:
            return
        by_alloc = sorted(roles, key=lambda r: (r.alloc_step, r.transfer.tid))
        heads = deque(r for r in by_alloc if r.is_head)
        others = deque(r for r in by_alloc if not r.is_head)
        active: list[_Role] = []
        for step in range(min(r.alloc_step for r in roles), max(r.last_step for r in roles) + 2):
            for role in _due(others, step):
                role.buffer = self._receive_buffer(role.transfer, buffers)
                _activate(role, active)
            ops = [op for role in active for op in role.ops(step)]
            works = self._post(ops)
            self._finish(active, step, sink)
            for role in _due(heads, step):
                role.filler = _Filler(role.transfer, self._device, source)
                _activate(role, active)
            self._prefill(active, step)
            self._complete(ops, works)

    def _receive_buffer(self, t: Part, buffers: Buffers | None) -> torch.Tensor:
        given = buffers(t) if buffers is not None else None
        if given is None:
            return torch.empty(t.nbytes, dtype=torch.uint8, device=self._device)
        if given.dtype != torch.uint8 or given.numel() != t.nbytes or given.device != self._device:
            raise ValueError(f"transfer {t.tid}: a receive buffer must be {t.nbytes} uint8 on "
                             f"{self._device}, got {given.numel()} {given.dtype} on {given.device}")
        return given

    def _prefill(self, active: list[_Role], step: int) -> None:
        """Get from the sources the pieces heads send in the next step (overlaps the wire)."""
        for role in active:
            i = step + 1 - role.step
            if role.is_head and 0 <= i < role.npieces:
                assert role.filler is not None
                role.filler.fill(min((i + 1) * self.piece_size, role.transfer.nbytes))
                role.buffer = role.filler.buffer

    @staticmethod
    def _finish(active: list[_Role], step: int, sink: Sink) -> None:
        """Hand transfers whose last operation completed in an earlier step to the sink."""
        for role in [r for r in active if r.last_step < step]:
            active.remove(role)
            buffer, role.buffer, role.filler = role.buffer, None, None
            assert buffer is not None  # its pieces were sent or received from it (see piece)
            sink(role.transfer, buffer)

    def _post(self, ops: list[_Op]) -> list[dist.Work]:
        if not ops:
            return []
        self.stats["steps"] += 1
        try:
            return dist.batch_isend_irecv([
                dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, group=self.group,
                           group_peer=op.peer, tag=op.tid & _TAG_MASK)
                for op in ops])
        except Exception as exc:  # a peer already known to be gone fails at posting time
            what = "; ".join(op.describe() for op in ops)
            raise CommunicationError(f"{what}: could not be posted: {exc}") from exc

    def _complete(self, ops: list[_Op], works: list[dist.Work]) -> None:
        """Wait for one step's batch; NCCL returns one work for the whole batch."""
        started = time.monotonic()
        paired = len(works) == len(ops)
        for k, work in enumerate(works):
            what = ops[k].describe() if paired else "; ".join(op.describe() for op in ops)
            self._wait(work, what, started)
        for op in ops:
            kind = "sent" if op.send else "received"
            self.stats[f"bytes_{kind}"] += op.tensor.numel()
            self.stats[f"pieces_{kind}"] += 1

    def _wait(self, work: dist.Work, what: str, started: float) -> None:
        """Wait until ``timeout`` seconds after ``started``; failures become CommunicationError."""
        remaining = self.timeout - (time.monotonic() - started)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=max(remaining, 1e-3)))
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses, or IO errors
            raise CommunicationError(
                f"{what}: failed or timed out ({self.timeout:g} s): {exc}") from exc
        if done is False:
            raise CommunicationError(f"{what}: timed out after {self.timeout:g} s")

    def _run_local(self, p: Part, source: Source, sink: Sink) -> None:
        """A transfer nobody waits on: chain of one, or zero bytes. No communication."""
        if not p.is_head:
            sink(p, torch.empty(0, dtype=torch.uint8, device=self._device))
            return
        filler = _Filler(p, self._device, source)
        filler.fill(p.nbytes)
        assert filler.buffer is not None
        sink(p, filler.buffer)


def _due(queue: deque[_Role], step: int) -> Iterator[_Role]:
    """Pop the roles (sorted by allocation step) that allocate their buffer at ``step``."""
    while queue and queue[0].alloc_step == step:
        yield queue.popleft()


def _activate(role: _Role, active: list[_Role]) -> None:
    active.append(role)
    active.sort(key=lambda r: r.transfer.tid)  # posting order within a step: by tid
