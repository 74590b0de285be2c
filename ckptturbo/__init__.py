"""ckptturbo: checkpoint I/O for distributed PyTorch at the speed of the hardware."""
from .api import delete, load, load_state_dict, save
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptTurboError,
    CommunicationError,
    FormatError,
    IntegrityError,
    MismatchError,
    PlanError,
    ReplicaMismatchError,
    SaveInProgress,
    StorageAuthError,
    StorageError,
)
from .reader import TurboReader
from .staging import SaveHandle, SaveSummary
from .stream import safe_open, stream_safetensors
from .writer import TurboWriter

__version__ = "0.1.0"

__all__ = [
    "TurboWriter", "TurboReader", "save", "load", "load_state_dict", "delete", "SaveHandle", "SaveSummary",
    "safe_open", "stream_safetensors",
    "CkptTurboError", "CheckpointExists", "CheckpointNotFound", "CommunicationError", "FormatError",
    "IntegrityError", "MismatchError", "PlanError", "ReplicaMismatchError", "SaveInProgress",
    "StorageAuthError", "StorageError",
]
