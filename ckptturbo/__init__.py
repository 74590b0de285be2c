"""ckptturbo: checkpoint I/O for distributed PyTorch at the speed of the hardware.

The public names are imported on first use (PEP 562), so ``import ckptturbo`` and the
commands that need no tensors (``ckptturbo --version``, ``ls``, ``inspect``) do not pay
for importing torch. Add a public name with one line in ``_PUBLIC``.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_PUBLIC = {
    "TurboWriter": ".writer",
    "TurboReader": ".reader",
    "save": ".api",
    "load": ".api",
    "load_state_dict": ".api",
    "delete": ".api",
    "exists": ".api",
    "list_checkpoints": ".api",
    "Session": ".session",
    "default_session": ".session",
    "SaveHandle": ".staging",
    "SaveSummary": ".staging",
    "safe_open": ".stream",
    "stream_safetensors": ".stream",
    "CkptTurboError": ".errors",
    "CheckpointExists": ".errors",
    "CheckpointNotFound": ".errors",
    "CommunicationError": ".errors",
    "FormatError": ".errors",
    "IntegrityError": ".errors",
    "MismatchError": ".errors",
    "PlanError": ".errors",
    "ReplicaMismatchError": ".errors",
    "SaveInProgress": ".errors",
    "StorageAuthError": ".errors",
    "StorageError": ".errors",
    "UnsupportedStateError": ".errors",
}

__all__ = list(_PUBLIC)

# A library does not decide where its log records go: without this, Python's last-resort
# handler prints our warnings to stderr of applications that configured no logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
