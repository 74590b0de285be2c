"""Saves in flight outlive the script's end: interpreter exit and ``destroy_process_group``
wait for them.

A save returns at ``staged`` and commits behind training, with collectives among the ranks
until its manifest is written. Two things at a script's end would lose it. The interpreter's
exit stops the I/O thread pools the uploads run on. And ``destroy_process_group()``, which
torch asks every distributed script to call at its end, shuts down every group, ckptturbo's
own gloo groups included, under the save's commit. So both wait first. Exit waits for every
save in flight, then destroys the gloo groups the runtimes made while the interpreter is
still whole. ``torch.distributed.destroy_process_group`` is wrapped, once, when the
save pipeline is imported (with the package, in a training process), to do the same before
it destroys anything. Both waits are bounded by the saves' own storage deadlines, or by
CKPTTURBO_EXIT_TIMEOUT seconds when set; a save that failed or was given up on is reported
on stderr, since nothing else may look at its handle any more.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from .retry import seconds_setting
from .runtime import open_runtimes

log = logging.getLogger(__name__)

REPORT_EVERY = 10.0  # seconds between "still waiting" lines
# torch's own, for the groups ckptturbo made (captured before guard_saves_in_flight wraps it)
_torch_destroy: Callable[[Any], Any] = distributed_c10d.destroy_process_group


def wait_for_saves_in_flight(moment: str) -> bool:
    """Wait for every runtime's saves in flight (not those of the calling thread), each
    until it ends or the CKPTTURBO_EXIT_TIMEOUT limit passes; ``moment`` names why (for
    the log and stderr). Returns whether every save's thread has ended."""
    me = threading.current_thread()
    flights = [f for r in open_runtimes() for f in r.running() if f.thread is not me]
    if not flights:
        return True
    limit = seconds_setting("EXIT_TIMEOUT", None, None, ValueError)
    deadline = None if limit is None else time.monotonic() + limit
    log.info("waiting %s for %d checkpoint save(s) in flight: %s", moment, len(flights),
             ", ".join(f.handle.url for f in flights))
    for flight in flights:
        handle = flight.handle
        while flight.thread.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            flight.thread.join(REPORT_EVERY if left is None else min(REPORT_EVERY, left))
            if flight.thread.is_alive():
                log.warning("still waiting %s for the save to %s", moment, handle.url)
        if not handle.done():
            sys.stderr.write(f"ckptturbo: gave up {moment} on the save to {handle.url} after "
                             f"CKPTTURBO_EXIT_TIMEOUT={limit}s; it is not committed\n")
        elif handle.durable.exception() is not None:
            sys.stderr.write(f"ckptturbo: the save to {handle.url} failed and is not committed: "
                             f"{handle.durable.exception()}\n")
    return not any(f.thread.is_alive() for f in flights)


def _release_every_group() -> None:
    """Destroy the gloo groups every runtime made (made again on their next use), with
    torch's own ``destroy_process_group``: the wrapped one would wait for the saves again."""
    for runtime in open_runtimes():
        runtime.release_groups(_torch_destroy)


def _wait_at_exit() -> None:
    """Interpreter exit: runs before concurrent.futures refuses new work, which the
    uploads still need. Each save's thread is joined, not only its handle: a daemon thread
    still inside torch when the interpreter finalises aborts the process."""
    if wait_for_saves_in_flight("at exit"):  # one given up on may still be in a collective
        _release_every_group()


def _waiting_for_saves(destroy: Callable[..., Any]) -> Callable[..., Any]:
    """``destroy_process_group`` that first lets the saves in flight commit. Destroying the
    world group (the default, ``None``) also destroys the runtimes' gloo groups first, as
    torch would, so that none is kept, dead, for the next save after ``init_process_group``."""

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> Any:
        wait_for_saves_in_flight("before destroy_process_group")
        if group is None or group is dist.GroupMember.WORLD:
            _release_every_group()
        return destroy(group)

    destroy_process_group.__ckptturbo_waits__ = True  # type: ignore[attr-defined]
    return destroy_process_group


def guard_saves_in_flight() -> None:
    """Install both waits; the save pipeline calls this once, as it is imported. torch's
    ``destroy_process_group`` is wrapped where callers find it (``torch.distributed`` and
    ``torch.distributed.distributed_c10d``); a module that bound the name itself before
    ckptturbo was imported keeps torch's own, and must wait for its saves first
    (``ct.default_session().wait()``)."""
    # threading's exit hooks (not atexit's) run, newest first, before concurrent.futures
    # stops accepting work, which the uploads of a save still need.
    threading._register_atexit(_wait_at_exit)  # type: ignore[attr-defined]
    for module in (dist, distributed_c10d):
        current = module.destroy_process_group
        if not getattr(current, "__ckptturbo_waits__", False):
            module.destroy_process_group = _waiting_for_saves(current)  # type: ignore[attr-defined]
