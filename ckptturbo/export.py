"""Convert a checkpoint into files other tools read: safetensors, or a plain DCP directory.

Inference servers and converters do not read chunk stores. Tensors are loaded at their
global shapes, so the result does not depend on the world size that saved them.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from . import __version__
from .api import load as ct_load
from .errors import FormatError, StorageError, names_preview
from .manifest import Manifest
from .runs import Location
from .runtime import default_runtime

log = logging.getLogger(__name__)


def load_plain(url: str, storage_options: dict[str, Any] | None, manifest: Manifest,
               names: Sequence[str], allow_pickle: bool = False) -> dict[str, Any]:
    """Full CPU tensors (and objects) for ``names``, keyed by their flat names.

    Loading into fresh tensors of the manifest's global shapes makes the reader assemble
    every shard, so the result is independent of the world size that saved it.
    """
    sd: dict[str, Any] = {}
    for name in names:
        item = manifest.items[name]
        sd[name] = torch.empty(item.size or (), dtype=item.dtype) if item.kind == "tensor" else None
    ct_load(sd, url, storage_options=storage_options, strict=False, allow_pickle=allow_pickle)
    return sd


def shard_groups(manifest: Manifest, names: Sequence[str],
                 max_bytes: int | None) -> list[list[str]]:
    """Tensors in name order, cut into groups of at most max_bytes (a bigger tensor alone)."""
    if max_bytes is None:
        return [list(names)] if names else []
    groups: list[list[str]] = []
    size = 0
    for name in names:
        nbytes = sum(s.nbytes for s in manifest.items[name].shards)
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


SAFETENSORS_SUFFIX = ".safetensors"


def export_format(dest: str, requested: str | None) -> str:
    """The format an export writes: the ``requested`` one (--format), else what ``dest``
    names (a ``.safetensors`` file), so ``export run/step-7 out.safetensors`` needs no flag."""
    if requested is not None:
        return requested
    if dest.rstrip("/").endswith(SAFETENSORS_SUFFIX):
        return "safetensors"
    raise FormatError(f"cannot tell which format to export to {dest!r}: name a "
                      f"{SAFETENSORS_SUFFIX} file, or pass --format safetensors (files in that "
                      "directory) or --format dcp")


def safetensors_target(dest: str) -> tuple[str, str]:
    """The directory and the file stem an export writes to: ``dir/name.safetensors`` is the
    file itself (``name-00001-of-0000N.safetensors`` and ``name.safetensors.index.json``
    beside it when sharded); any other ``dest`` is a directory that gets ``model.*`` files
    as Hugging Face names them."""
    dest = dest.rstrip("/")
    if not dest.endswith(SAFETENSORS_SUFFIX):
        return dest, "model"
    parent, _, name = dest.rpartition("/")
    if not parent and dest.startswith("/"):
        parent = "/"
    return parent or ".", name[:-len(SAFETENSORS_SUFFIX)]


def export_safetensors(ckpt: str, dest_url: str, storage_options: dict[str, Any] | None = None,
                       *, max_shard_size: int | None = None) -> tuple[int, list[str]]:
    """One file (or HF-style shards plus index) that any safetensors reader opens; returns
    the number of tensors and the files written.

    ``dest_url``: a directory, or a ``.safetensors`` file (see :func:`safetensors_target`).
    Shards are loaded and written one at a time, so ``max_shard_size`` also bounds memory.
    """
    from safetensors.torch import save as st_save

    manifest = Location(ckpt, storage_options).read_manifest()
    tensors = sorted(n for n, i in manifest.items.items() if i.kind == "tensor")
    for name in sorted(n for n, i in manifest.items.items() if i.kind == "bytes"):
        log.warning("skipping object %r: safetensors holds tensors only (use --format dcp)", name)
    groups = shard_groups(manifest, tensors, max_shard_size)
    if not groups:
        raise FormatError(f"{ckpt} holds no tensors to export")
    directory, stem = safetensors_target(dest_url)
    dest = default_runtime().open_store(directory, storage_options)
    created = datetime.fromtimestamp(manifest.created, timezone.utc).isoformat(timespec="seconds")
    metadata = {"format": "pt", "exported_by": f"ckptturbo {__version__}",
                "source": ckpt, "source_created": created}
    files = ([f"{stem}{SAFETENSORS_SUFFIX}"] if len(groups) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{SAFETENSORS_SUFFIX}"
              for i in range(len(groups))])
    weight_map = {}
    for file, names in zip(files, groups, strict=True):
        sd = load_plain(ckpt, storage_options, manifest, names)
        try:
            data = st_save(sd, metadata=metadata)
        except (ValueError, TypeError, KeyError) as exc:
            raise FormatError(f"cannot write {file} as safetensors: {exc}") from exc
        dest.put(dest.join(dest.root, file), data)
        weight_map.update(dict.fromkeys(names, file))
        log.info("wrote %s (%d tensors, %d bytes)", file, len(names), len(data))
        del sd, data
    if len(files) > 1:
        index = {"metadata": {**metadata, "total_size": sum(
            sum(s.nbytes for s in manifest.items[n].shards) for n in tensors)},
                 "weight_map": weight_map}
        dest.put(dest.join(dest.root, f"{stem}{SAFETENSORS_SUFFIX}.index.json"),
                 json.dumps(index, indent=2, sort_keys=True).encode())
    return len(tensors), files


def export_dcp(ckpt: str, dest: str, storage_options: dict[str, Any] | None = None, *,
               allow_pickle: bool = False) -> int:
    """A plain DCP directory for tools that only know FileSystemReader; returns the number
    of items written.

    Objects are pickles. Those torch's restricted unpickler loads (numbers, strings,
    containers, tensors: an optimizer's step, lr, betas, eps) are exported as the reader
    loads them by default; the others run code when unpickled, so they are exported only
    with ``allow_pickle``, mirroring TurboReader's switch, and skipped (with one warning)
    without it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if "://" in dest and not dest.startswith("file://"):
        raise StorageError(f"--format dcp writes to a local directory, not {dest!r}")
    target = dest.removeprefix("file://")
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot export to {target!r}: {exc.strerror or exc}") from exc
    manifest = Location(ckpt, storage_options).read_manifest()
    sd = _load_exportable(ckpt, storage_options, manifest, allow_pickle)
    with warnings.catch_warnings():
        # one process, no process group: DCP warns that it assumes so; an export means it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(target))
        except (OSError, CheckpointException) as exc:
            raise StorageError(f"cannot export to {target!r}: {exc}") from exc
    return len(sd)


def _load_exportable(ckpt: str, storage_options: dict[str, Any] | None, manifest: Manifest,
                     allow_pickle: bool) -> dict[str, Any]:
    """Every item, but objects the restricted unpickler refuses when pickles are not allowed.

    One load does it when every object is safe (the usual case); otherwise the objects are
    tried one at a time to find those to skip."""
    names = sorted(manifest.items)
    try:
        return load_plain(ckpt, storage_options, manifest, names, allow_pickle)
    except FormatError:
        if allow_pickle:
            raise
    objects = [n for n in names if manifest.items[n].kind == "bytes"]
    sd = load_plain(ckpt, storage_options, manifest, [n for n in names if n not in objects])
    refused = []
    for name in objects:
        try:
            sd.update(load_plain(ckpt, storage_options, manifest, [name]))
        except FormatError:
            refused.append(name)
    log.warning("skipped %d object(s) that torch's restricted unpickler refuses (%s): pass "
                "--allow-pickle to export them (only for checkpoints you trust)", len(refused),
                names_preview(refused))
    return sd
