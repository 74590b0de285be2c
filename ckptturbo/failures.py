"""What leaves ckptturbo when something fails: always an Exception of its own hierarchy.

DCP wraps every rank's failure in a ``CheckpointException``, which derives from
``BaseException``: ``except Exception`` around a save does not catch it, and the message
names ranks rather than the cause. Callers of ``ct.save``/``ct.load``, of the handles'
futures and of the adapters get ckptturbo's own error instead, with the original kept as
``__cause__``. Classified by type and origin, never by message.
"""
from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CkptTurboError, CommunicationError

_C10D_FILE = distributed_c10d.__file__


def as_ckptturbo_error(exc: BaseException, url: str, action: str) -> BaseException:
    """The error to raise for ``exc`` raised while ``action`` (e.g. "saving") ``url``.

    The first of our own errors found in the exception, its causes, or the ranks' failures
    is returned as it is; failing that, an error raised by a torch.distributed collective (a
    peer died or disconnected, as gloo reports it, a plain RuntimeError; or the application
    destroyed the groups under a save in flight) becomes a CommunicationError; any other
    Exception (or DCP's CheckpointException) becomes a CkptTurboError naming the URL and the
    cause. KeyboardInterrupt and SystemExit pass through unchanged.
    """
    found = list(_related(exc))
    for candidate, _ in found:
        if isinstance(candidate, CkptTurboError):
            return candidate
    for candidate, origin in found:
        if isinstance(candidate, dist.DistError) or origin == _C10D_FILE:
            what = ("the process group was destroyed (destroy_process_group) while"
                    if not dist.is_initialized() else "a peer rank failed or disconnected while")
            error: CkptTurboError = CommunicationError(f"{what} {action} {url}: {candidate}")
            error.__cause__ = candidate
            return error
    if not isinstance(exc, (Exception, CheckpointException)):
        return exc
    root = _root_cause(found)
    error = CkptTurboError(f"{action} {url} failed: {type(root).__name__}: {root}")
    error.__cause__ = root
    return error


@contextlib.contextmanager
def ckptturbo_errors(action: str, url: Any) -> Iterator[None]:
    """Within the block, every failure leaves as :func:`as_ckptturbo_error` makes it.

    A ckptturbo error found inside is raised as it is, its own ``__cause__`` intact (a
    ``raise ... from`` here would overwrite it); a new one carries the original as its
    cause. For ckptturbo's public functions and the adapters' public methods.
    """
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - converted, never swallowed
        error = as_ckptturbo_error(exc, str(url), action)
        if error is exc:
            raise
        raise error  # noqa: B904 - its __cause__ is already the right one


def _root_cause(found: list[tuple[BaseException, str | None]]) -> BaseException:
    """The first failure that is not DCP's wrapper: what actually went wrong on a rank."""
    for candidate, _ in found:
        if not isinstance(candidate, CheckpointException):
            return candidate
    return found[0][0]


def _related(exc: BaseException) -> Iterator[tuple[BaseException, str | None]]:
    """(exception, file of its innermost frame): exc, then (depth first) each rank's
    failure and each cause or context, once each."""
    seen: set[int] = set()
    stack: list[tuple[BaseException, str | None]] = [(exc, _origin(exc))]
    while stack:
        current, origin = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current, origin
        nested: list[tuple[BaseException, str | None]] = []
        if isinstance(current, CheckpointException):
            for _, wrapped in sorted(current.failures.items()):
                inner, summary = wrapped if isinstance(wrapped, tuple) else (wrapped, None)
                nested.append((inner, summary[-1].filename if summary else _origin(inner)))
        nested += [(e, _origin(e)) for e in (current.__cause__, current.__context__)
                   if e is not None]
        stack.extend(reversed(nested))


def _origin(exc: BaseException) -> str | None:
    frames = list(traceback.walk_tb(exc.__traceback__))
    return frames[-1][0].f_code.co_filename if frames else None
