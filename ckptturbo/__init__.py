"""ckptturbo: checkpoint I/O for distributed PyTorch at the speed of the hardware.

In the ``ckptturbo`` command the public names are imported on first use (PEP 562), so the
subcommands that need no tensors (``--version``, ``ls``, ``inspect``) do not pay for
importing torch. Everywhere else (a training or serving process) they are imported with
the package: the first ``ct.save`` must stall for its copy only, not for importing DCP.
Add a public name with one line in ``_PUBLIC``.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_PUBLIC = {
    "TurboWriter": ".writer",
    "TurboReader": ".reader",
    "TurboSavePlanner": ".planner",
    "TurboLoadPlanner": ".planner",
    "save": ".api",
    "load": ".api",
    "load_state_dict": ".api",
    "delete": ".api",
    "exists": ".api",
    "list_checkpoints": ".api",
    "collect_garbage": ".api",
    "tensor_versions": ".api",
    "load_changes": ".api",
    "Change": ".changes",
    "TensorVersion": ".manifest_delta",
    "Session": ".session",
    "default_session": ".session",
    "SaveHandle": ".staging",
    "SaveSummary": ".results",
    "Tiers": ".tiers",
    "TieredSaveHandle": ".tiered_save",
    "Recovered": ".recovery",
    "Replicated": ".peers",
    "safe_open": ".stream",
    "stream_safetensors": ".stream",
    "CkptTurboError": ".errors",
    "CheckpointExists": ".errors",
    "CheckpointNotFound": ".errors",
    "ChunksUnavailable": ".errors",
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


def _in_the_command() -> bool:
    """The ``ckptturbo`` console script, or ``python -m ckptturbo.cli`` (whose argv[0] is
    "-m" while the package is imported)."""
    return os.path.basename(sys.argv[0] if sys.argv else "") in ("ckptturbo", "-m")


if not _in_the_command():
    for _name in _PUBLIC:
        __getattr__(_name)
    importlib.import_module(".operations", __name__)  # what the first ct.save runs
