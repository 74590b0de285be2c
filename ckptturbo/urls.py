"""URL spelling: the one place that decides when two URLs name the same location.

A save to ``run/step-1`` and a load of ``file:///abs/run/step-1/`` must be known to be the
same checkpoint (read-your-writes, the wait at exit, a run's memory tier), so every module
that compares or keys by location, or takes a checkpoint's run, asks here instead of
trimming slashes itself.
"""
from __future__ import annotations

import os
from typing import Any

import fsspec

from .errors import CkptTurboError


def url_key(url: Any) -> str:
    """One spelling per location: local paths absolute with ``file://``, ``s3a`` as ``s3``,
    no trailing slash."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else str(url)
    protocol = fsspec.utils.get_protocol(text)
    if protocol in ("file", "local"):
        path = text.split("://", 1)[1] if "://" in text else text
        return "file://" + os.path.abspath(os.path.expanduser(path)).rstrip("/")
    if protocol == "s3a":
        text = "s3" + text[3:]
    return text.rstrip("/")


def covers(key: str, target: str, under: bool) -> bool:
    """Whether location ``key`` is ``target`` or, with ``under``, below it (both url_keys)."""
    return key == target or (under and key.startswith(target + "/"))


def options_key(options: dict[str, Any] | None) -> str:
    """One spelling of a dict of options (storage options, writer settings), for the keys
    that tell two stores, endpoints or writers apart; None is no options."""
    return repr(sorted((options or {}).items()))


def parent_url(url: Any) -> str:
    """The URL one level up (a checkpoint's run); a URL without a ``/`` is its own."""
    return str(url).rstrip("/").rsplit("/", 1)[0]


def split_checkpoint(url: str) -> tuple[str, str]:
    """(run URL, checkpoint name) of a checkpoint URL."""
    run, _, name = str(url).rstrip("/").rpartition("/")
    if not run or not name:
        raise CkptTurboError(f"checkpoint URL {url!r} needs a run above it, "
                             "e.g. s3://bucket/run/step-100")
    return run, name
