"""Run a function in N real processes, joined by a torch.distributed process group or alone.

The one multi-process launcher of the tests and the benchmarks. Tests use real processes
rather than mocks because the failure modes that matter (ordering of point-to-point
operations, dead peers, timeouts) only exist between real processes; they may also expect
ranks to fail and inspect each :class:`RankFailure`. Benchmarks run their ranks the same
way, and measure memory in a fresh process of their own with :func:`run_isolated`.

Everything here is bounded in time: a child that hangs is killed by PID, so a broken test
fails instead of wedging CI, and a broken benchmark reports instead of waiting forever.
"""
from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_GRACE_S = 5.0  # how long stragglers get after the first failure before they are killed


@dataclass
class RankFailure:
    """What went wrong on one rank, returned in place of its result when failures are expected."""

    rank: int
    exitcode: int | None  # None: the process was still alive when it reported the error
    error: BaseException | None  # the exception raised by fn, when it could be pickled
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed (exit code {self.exitcode}):\n{self.traceback}"


class RemoteTraceback(Exception):
    """Carries a child's traceback text as the cause of the exception re-raised in the parent."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def _picklable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return None
    return exc


def _start_context(fn: Callable[..., Any]) -> Any:
    """A forkserver context that has torch and fn's module imported once.

    Children are as clean as with spawn (forked from a fresh server process, never from the
    test process with its threads), but start in a fraction of a second instead of paying
    several seconds of imports each, which on a small CI machine is most of a test's time.
    What spawn would take from the parent at start (environment, cwd, sys.path) the server
    took once at its own start, so :func:`_child` re-applies the parent's current values.
    """
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed"]  # what every child needs and takes seconds
    if fn.__module__ != "__main__":
        preload.append(fn.__module__)
    ctx.set_forkserver_preload(preload)  # takes effect when the server starts (first use)
    return ctx


def _parent_state() -> tuple[dict[str, str], str, list[str]]:
    return dict(os.environ), os.getcwd(), list(sys.path)


@dataclass(frozen=True)
class _ChildSpec:
    """What every child needs besides its rank (one picklable bundle)."""

    fn: Callable[..., Any]
    world_size: int
    backend: str | None  # None: no process group
    init_file: str
    group_timeout: float
    threads: int
    setup: Callable[[int], None] | None
    parent: tuple[dict[str, str], str, list[str]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _child(spec: _ChildSpec, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """Join the group, run fn, report (ok, value) or (error, exc, text) through the pipe.

    The process ends with os._exit so that no atexit handler or destructor of a half-dead
    process group can hang it after it has reported.
    """
    environ, cwd, path = spec.parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    torch.set_num_threads(spec.threads)
    code = 0
    try:
        if spec.setup is not None:
            spec.setup(rank)
        if spec.backend is not None and "nccl" in spec.backend:
            torch.cuda.set_device(rank)
        if spec.backend is not None:
            dist.init_process_group(spec.backend, init_method=f"file://{spec.init_file}",
                                    rank=rank, world_size=spec.world_size,
                                    timeout=datetime.timedelta(seconds=spec.group_timeout))
        value = spec.fn(rank, spec.world_size, *spec.args, **spec.kwargs)
        conn.send(("ok", value))  # before teardown, so a hanging teardown cannot lose it
        if spec.backend is not None:
            # No rank may exit while a peer still sets up its connections to it (gloo then
            # fails that peer's init); after a failure this barrier fails or is killed instead.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        code = 1
        conn.send(("error", _picklable(exc), traceback.format_exc()))
    finally:
        conn.close()
    os._exit(code)


def _collect(procs: list[Any], conns: list[Any], deadline: float,
             grace: float | None) -> dict[int, tuple[Any, ...]]:
    """Read one message per rank until all have reported or died, or until the deadline.

    With a ``grace`` period, the others get only that long after the first failure: they
    are expected to fail too (peer gone) and must not keep a test waiting for the full
    timeout. Without one (failures expected), every rank's own outcome is awaited.
    """
    messages: dict[int, tuple[Any, ...]] = {}
    waiting = dict(enumerate(conns))
    while waiting and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(waiting.values()),
                                                timeout=max(0.0, deadline - time.monotonic()))
        for rank, conn in list(waiting.items()):
            if conn not in ready:
                continue
            try:
                messages[rank] = conn.recv()
            except EOFError:  # died without reporting (os._exit, signal)
                procs[rank].join(timeout=1.0)
                messages[rank] = ("died",)
            del waiting[rank]
            if messages[rank][0] != "ok" and grace is not None:
                deadline = min(deadline, time.monotonic() + grace)
    return messages


def _outcome(rank: int, proc: Any, message: tuple[Any, ...] | None) -> Any:
    if message is None:
        return RankFailure(rank, proc.exitcode, None, "killed: no result before the timeout")
    if message[0] == "ok":
        return message[1]
    if message[0] == "died":
        return RankFailure(rank, proc.exitcode, None, f"process exited with code {proc.exitcode}")
    return RankFailure(rank, proc.exitcode, message[1], message[2])


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    backend: str | None = "gloo", expect_failures: bool = False,
                    threads: int = 1, setup: Callable[[int], None] | None = None,
                    group_timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` fresh processes.

    Each process (as clean as with spawn, see :func:`_start_context`) runs ``setup(rank)``
    when given (benchmarks configure logging there), sets torch to ``threads`` threads and
    joins a ``backend`` process group (rendezvous through a temporary file, which avoids
    races on "free" TCP ports; ``backend=None``: no group, plain isolated processes).
    ``fn`` and ``setup`` must be module-level functions (or picklable callables) and fn's
    return value picklable. The group's collectives wait ``group_timeout`` seconds for a
    silent peer (default: ``timeout``).
    Returns the per-rank return values. If a rank raises, dies, or does not finish within
    ``timeout`` seconds, the remaining processes are killed and the first failure is
    re-raised here (its exception type when picklable, with the child's traceback text as
    the cause). With ``expect_failures=True`` nothing is raised: failed ranks appear in the
    result list as :class:`RankFailure`.
    """
    ctx = _start_context(fn)
    tmpdir = tempfile.mkdtemp(prefix="ckptturbo-dist-")
    spec = _ChildSpec(fn, world_size, backend, os.path.join(tmpdir, "store"),
                      timeout if group_timeout is None else group_timeout, threads,
                      setup, _parent_state(), args, kwargs)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            # Not daemonic: DCP's PROCESS async mode starts a child of its own; stragglers
            # are still killed by PID in the finally block below.
            proc = ctx.Process(target=_child, daemon=False, name=f"rank{rank}",
                               args=(spec, rank, writer))
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        messages = _collect(procs, conns, time.monotonic() + timeout,
                            None if expect_failures else _GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    outcomes = [_outcome(r, p, messages.get(r)) for r, p in enumerate(procs)]
    if not expect_failures:
        _raise_first_failure(outcomes)
    return outcomes


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float = 900,
                 setup: Callable[[int], None] | None = None, **kwargs: Any) -> Any:
    """``fn(0, 1, *args, **kwargs)`` in one fresh process without a process group, with every
    CPU for torch: what a benchmark needs to measure a run's memory from a clean start."""
    return run_distributed(fn, 1, *args, timeout=timeout, backend=None, setup=setup,
                           threads=os.cpu_count() or 1, **kwargs)[0]


def run_command(cmd: list[str], *, timeout: float, cwd: str | os.PathLike | None = None,
                env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run a command (a framework's own launcher, say) in a session of its own, stdout and
    stderr together: its return code and output. On timeout the whole session (the
    launcher's workers too) is killed by its process group id and the code is None."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    return proc.returncode, output


def _raise_first_failure(outcomes: list[Any]) -> None:
    failures = [o for o in outcomes if isinstance(o, RankFailure)]
    if not failures:
        return
    # A rank that raised its own exception explains more than one that was killed after it,
    # and more than one whose group broke because a peer died (the peer's error is the cause).
    first = next((f for f in failures if f.error is not None and not _fallout(f)),
                 next((f for f in failures if f.error is not None), failures[0]))
    others = "".join(f"\nalso rank {f.rank}: {f.traceback.strip().splitlines()[-1]}"
                     for f in failures if f is not first and f.traceback.strip())
    cause = RemoteTraceback(str(first) + others)
    if first.error is not None:
        raise first.error from cause
    raise RuntimeError(f"rank {first.rank} failed") from cause


def _fallout(failure: RankFailure) -> bool:
    """Whether a rank's error is its process group breaking (a peer's connection closed
    or lost), which another rank's own failure causes."""
    error = failure.error
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(s in str(error) for s in ("Connection closed by peer", "connectFullMesh",
                                          "Connection reset by peer")))
