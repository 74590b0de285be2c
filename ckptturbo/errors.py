"""Every failure ckptturbo lets a user see, in one place.

One root class lets callers write ``except ckptturbo.CkptTurboError`` around any call,
while the subclasses keep the cause machine-readable. Messages always name the object
(URL or key), the tensor where there is one, and what went wrong.
"""
from __future__ import annotations

from collections.abc import Sequence


class CkptTurboError(Exception):
    """Root of every error raised by ckptturbo."""


class StorageError(CkptTurboError):
    """An object store or file system operation failed after retries."""


class ShortReadError(StorageError):
    """An object holds fewer bytes than were asked for (truncated at rest, or cut short)."""


class StorageAuthError(StorageError):
    """Credentials are missing, wrong, or lack permission for the URL."""


class CheckpointNotFound(CkptTurboError, FileNotFoundError):
    """No committed checkpoint (no manifest) exists at the URL."""


class ChunksUnavailable(CheckpointNotFound):
    """A checkpoint's manifest is held, but a chunk a rank needs is in no tier that rank
    can read (another node's memory, without a durable copy): a tiered load then tries
    the next older checkpoint."""


class CheckpointExists(CkptTurboError, FileExistsError):
    """A save with ``overwrite=False`` found a committed checkpoint (a manifest) at the URL."""


class IntegrityError(CkptTurboError):
    """Bytes read back do not match the BLAKE3 id they were stored under."""


class FormatError(CkptTurboError, ValueError):
    """A manifest, chunk name or safetensors header is malformed or unsupported."""


class CheckpointKindError(FormatError):
    """The location holds another kind of checkpoint than the one asked for (a ckptturbo
    checkpoint where safetensors were expected): the caller can tell the kinds apart from
    the one listing that found it, without a probe of its own."""


class MismatchError(CkptTurboError, ValueError):
    """The state dict being loaded does not fit the checkpoint (keys, shapes, dtypes)."""


class PlanError(CkptTurboError, ValueError):
    """A write or read plan cannot be built from the inputs given."""


class CommunicationError(CkptTurboError):
    """A peer rank failed or timed out during a collective transfer."""


class SaveInProgress(CkptTurboError):
    """A new save was started while the writer's previous save is not yet durable."""


class UnsupportedStateError(CkptTurboError, TypeError):
    """The state dict holds something that cannot be saved (a meta tensor, an object that
    cannot be pickled)."""


class ReplicaMismatchError(CkptTurboError):
    """Ranks that DCP treats as replicas of an item hold different bytes."""


def names_preview(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` names and how many more: a chunk packed with thousands of small
    tensors must not turn one error or report line into a page."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = [
    "CkptTurboError",
    "StorageError",
    "StorageAuthError",
    "CheckpointNotFound",
    "ChunksUnavailable",
    "CheckpointExists",
    "IntegrityError",
    "FormatError",
    "MismatchError",
    "PlanError",
    "CommunicationError",
    "SaveInProgress",
    "ReplicaMismatchError",
    "UnsupportedStateError",
]
