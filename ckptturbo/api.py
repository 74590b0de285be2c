"""ct.save / ct.load / ct.load_state_dict / ct.delete / ct.exists / ct.list_checkpoints /
ct.collect_garbage / ct.tensor_versions / ct.load_changes: the operations of
``ckptturbo.operations`` run on the process's default session. Their signatures and
docstrings are the operations' own (written once, there)."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from . import operations
from .session import default_session


def _on_the_default_session(operation: Callable[..., Any]) -> Callable[..., Any]:
    """``operation`` without its first argument (the session): it runs on the default one."""

    @functools.wraps(operation)
    def function(*args: Any, **kwargs: Any) -> Any:
        return operation(default_session(), *args, **kwargs)

    signature = inspect.signature(operation)
    function.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:])
    del function.__wrapped__  # help() and inspect show the signature above
    return function


save = _on_the_default_session(operations.save)
load = _on_the_default_session(operations.load)
load_state_dict = _on_the_default_session(operations.load_state_dict)
delete = _on_the_default_session(operations.delete)
exists = _on_the_default_session(operations.exists)
list_checkpoints = _on_the_default_session(operations.list_checkpoints)
collect_garbage = _on_the_default_session(operations.collect_garbage)
tensor_versions = _on_the_default_session(operations.tensor_versions)
load_changes = _on_the_default_session(operations.load_changes)
