"""ckptturbo: checkpoint I/O for distributed PyTorch at the speed of the hardware."""
from .api import delete, exists, list_checkpoints, load, load_state_dict, save
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
    UnsupportedStateError,
)
from .reader import TurboReader
from .session import Session, default_session
from .staging import SaveHandle, SaveSummary
from .stream import safe_open, stream_safetensors
from .writer import TurboWriter

__version__ = "0.1.0"

__all__ = [
    "TurboWriter", "TurboReader", "save", "load", "load_state_dict", "delete", "exists", "list_checkpoints",
    "Session", "default_session", "SaveHandle", "SaveSummary",
    "safe_open", "stream_safetensors",
    "CkptTurboError", "CheckpointExists", "CheckpointNotFound", "CommunicationError", "FormatError",
    "IntegrityError", "MismatchError", "PlanError", "ReplicaMismatchError", "SaveInProgress",
    "StorageAuthError", "StorageError", "UnsupportedStateError",
]
