"""The session: the public operations over a runtime.

``ct.save``/``ct.load``/``ct.load_state_dict``/``ct.delete``/``ct.exists``/
``ct.list_checkpoints``/``ct.tensor_versions``/``ct.load_changes`` are the methods of
:func:`default_session`. A :class:`Session` is a :class:`~ckptturbo.runtime.Runtime`
(the owner of the process's I/O state: pools, groups, saves in flight, the wait at exit)
with those operations on top; each method is the operation of ``ckptturbo.operations``
that bears its name, run on this session.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import operations, runtime


def _method(operation: Callable[..., Any]) -> Callable[..., Any]:
    """``operation`` as a method: its first argument (the session) is ``self``; the
    signature and docstring are the operation's."""

    @functools.wraps(operation)
    def method(self: Session, *args: Any, **kwargs: Any) -> Any:
        return operation(self, *args, **kwargs)

    return method


class Session(runtime.Runtime):
    """Owns the checkpoint I/O of a process, or of one component of it.

    A component that must leave nothing running when it is done (a framework plugin's
    ``teardown``) makes its own session and closes it. ``close()`` waits for the session's
    saves and stops its threads; the session stays usable and makes them again on its next
    use.

    Guarantees that hold across every session of the process: a load, ``exists``, listing
    or delete of a location with a save in flight waits for that save first; interpreter
    exit and ``torch.distributed.destroy_process_group`` wait for every save in flight to
    become durable or fail (``ckptturbo.shutdown``).
    """

    save = _method(operations.save)
    load = _method(operations.load)
    load_state_dict = _method(operations.load_state_dict)
    delete = _method(operations.delete)
    exists = _method(operations.exists)
    list_checkpoints = _method(operations.list_checkpoints)
    collect_garbage = _method(operations.collect_garbage)
    tensor_versions = _method(operations.tensor_versions)
    load_changes = _method(operations.load_changes)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ckptturbo.Session: {len(self.saves_in_flight())} saves in flight>"


runtime.use_default_kind(Session)


def default_session() -> Session:
    """The session behind ``ct.save``, ``ct.load`` and the other module-level functions."""
    found = runtime.default_runtime()
    assert isinstance(found, Session)  # use_default_kind above
    return found

