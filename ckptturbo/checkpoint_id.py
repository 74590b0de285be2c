"""Which checkpoint ids TurboWriter and TurboReader can serve, decided without any I/O.

DCP asks ``validate_checkpoint_id`` when it picks a storage class for a bare
``checkpoint_id``; a class that answers True for every string would claim ids it cannot
open (``"abc://abc.abc"``). The answer here is True exactly when ``Location`` would accept
the id: a local path or an fsspec URL whose every protocol (``simplecache::s3://...``) is
registered and importable, naming a checkpoint under a parent that can hold the run's
chunk store.
"""
from __future__ import annotations

import os
import posixpath
from typing import Any

import fsspec
import fsspec.utils


def servable(checkpoint_id: Any) -> bool:
    """True for ids the classes can serve; never raises, never touches storage."""
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id.strip():
        return False
    *wrappers, target = checkpoint_id.split("::")  # "simplecache::s3://b/run/ckpt"
    # a wrapper is named bare ("simplecache") or with its own options ("simplecache://")
    protocols = [w.split("://", 1)[0] for w in wrappers] + [fsspec.utils.get_protocol(target)]
    try:
        classes = [fsspec.get_filesystem_class(p) for p in protocols]
    except (ValueError, ImportError):  # unknown protocol, or its package is not installed
        return False
    path = str(classes[-1]._strip_protocol(target)).rstrip("/")
    parent = posixpath.dirname(path)
    return bool(path) and bool(parent) and parent != path
