"""A manifest's bytes: the one canonical JSON form it is written in, with its checksum,
and the reading of every version this ckptturbo reads, every field validated on the way
in (a manifest may be hostile). Pure: bytes in, records out, no I/O (``runs`` reads and
writes the file). Versions 1 and 2 are turned into version 3 by ``manifest_migration``.

``FORMAT_VERSION`` versions the manifest (docs/format.md spells each version out); a
manifest with delta records (``ct.save(..., delta_from=...)``) is written as
``DELTA_VERSION``, so that a release which does not know them refuses it by its version
instead of loading a tensor's base as its value, and every other manifest stays readable
by releases that read version 3.
"""
from __future__ import annotations

import json
import logging
import math
import re
from itertools import chain
from typing import Any

import numpy as np

from .chunks import chunk_id, validate_chunk_id
from .errors import FormatError
from .manifest_migration import v2_as_v3
from .manifest_records import OBJECT_BOX, Boxes, DtypeName, ItemRecord, nonnegative_ints
from .paths import RUN_STORE

FORMAT_NAME = "ckptturbo-manifest"
FORMAT_VERSION = 3
DELTA_VERSION = 4  # version 3 plus delta records
# Version 1 manifests carry no checksum of their own; they are still read (with a warning).
# Versions 1 and 2 spell every piece out (its start, its chunk's id); version 3 is compact.
READABLE_VERSIONS = (1, 2, 3, 4)
CHECKSUM_FIELD = "blake3"
_LIMIT = 1 << 62  # no integer of a manifest reaches this: sums of two fit in int64
_HEX_DIGITS = b"0123456789abcdef"
_INT = re.compile(r"-?[0-9]+")
log = logging.getLogger(__name__)


def encode(*, items: dict[str, ItemRecord], chunks: dict[str, int], planner_data: Any,
           storage_meta: dict[str, Any], created: float, stats: dict[str, Any],
           chunk_store: str, dcp_version: str | None) -> bytes:
    """A manifest's fields in the current version's form, with its checksum."""
    ordinal = {cid: i for i, cid in enumerate(chunks)}
    paths = _planner_paths(planner_data, items)
    records = {}
    version = FORMAT_VERSION
    for fqn, item in items.items():
        records[fqn] = item.to_record(fqn, ordinal)
        if records[fqn][0] == "delta":
            version = DELTA_VERSION
        if paths is not None:
            records[fqn].append(paths[fqn])
    doc = {
        "format": FORMAT_NAME, "version": version, "created": created,
        "chunk_store": chunk_store, "dcp_version": dcp_version,
        "storage_meta": storage_meta, "stats": stats,
        "planner_data": None if paths is not None else _planner_data_to_json(planner_data),
        "planner_paths": paths is not None,
        "chunk_ids": "".join(chunks), "chunk_sizes": list(chunks.values()),
        "items": records,
    }
    return _with_checksum(_canonical(doc))


def decode(data: bytes, where: str) -> dict[str, Any]:
    """The fields of the manifest ``data`` holds (``Manifest``'s), of any readable version,
    every one checked; ``where`` names the manifest in errors."""
    doc = _verified_document(data, where)
    if doc["version"] < 3:
        doc = v2_as_v3(doc, where)
    ids, sizes = _chunk_table(doc, where)
    with_paths = doc.get("planner_paths", False)
    if type(with_paths) is not bool:
        raise FormatError(f"{where}: 'planner_paths' must be true or false")
    items, paths = _decode_items(doc.get("items"), ids, sizes, with_paths,
                                 doc["version"] >= DELTA_VERSION, where)
    store = _typed(doc, "chunk_store", str, RUN_STORE, where)
    created = _typed(doc, "created", (int, float), 0, where)
    planner_data = paths if with_paths else _planner_data_from_json(doc.get("planner_data"))
    chunks = dict(zip(ids, sizes.tolist(), strict=True))  # one size per id (_chunk_table)
    return dict(items=items, chunks=chunks, planner_data=planner_data,
                storage_meta=_typed(doc, "storage_meta", dict, {}, where),
                created=float(created), stats=_typed(doc, "stats", dict, {}, where),
                chunk_store=store, dcp_version=_typed(doc, "dcp_version", str, None, where))


def _canonical(doc: dict[str, Any]) -> bytes:
    """The one serialisation a manifest is written in and its checksum is taken over."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


_CHECKSUM_PREFIX = b'{"' + CHECKSUM_FIELD.encode() + b'":"'


def _with_checksum(body: bytes) -> bytes:
    """A canonical document with its checksum added, without serialising it again: the
    checksum field sorts first among the manifest's keys, so it goes right after "{"."""
    return _CHECKSUM_PREFIX + chunk_id(body).encode() + b'",' + body[1:]


def _checksum_of_bytes_holds(data: bytes, doc: dict[str, Any]) -> bool:
    """The quick check: the stored bytes are exactly what ``_with_checksum`` wrote, and the
    checksum matches the bytes after it (no second serialisation). False when the file is
    laid out otherwise; then the parsed document is checked (``_check_checksum``)."""
    stored = doc.get(CHECKSUM_FIELD)
    if not isinstance(stored, str) or not data.startswith(_CHECKSUM_PREFIX):
        return False
    head = len(_CHECKSUM_PREFIX) + len(stored)
    if data[len(_CHECKSUM_PREFIX):head] != stored.encode() or data[head:head + 2] != b'",':
        return False
    return chunk_id(b"{" + data[head + 2:]) == stored


def _check_checksum(doc: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose content differs from what was committed, before any of
    its offsets is trusted: chunks are verified by their ids, but a flipped digit in a
    piece offset would otherwise put verified bytes in the wrong place.

    The checksum covers the parsed document re-serialised canonically, so it catches
    every change of meaning (a digit, a key, a name) whether it happened at rest or in
    transit; changes that parse to the same document (whitespace) are harmless.
    """
    stored = doc.pop(CHECKSUM_FIELD, None)
    if doc["version"] == 1:
        log.warning("%s is a version 1 manifest without a checksum: its offsets cannot be "
                    "verified (re-save to upgrade)", where)
        return
    if not isinstance(stored, str):
        raise FormatError(f"{where} has no {CHECKSUM_FIELD!r} checksum; refusing to trust it")
    actual = chunk_id(_canonical(doc))
    if actual != stored:
        raise FormatError(f"{where} is corrupted: its content hashes to {actual[:16]}..., "
                          f"the checksum it was committed with is {stored[:16]}...")


def _verified_document(data: bytes, where: str) -> dict[str, Any]:
    """The parsed manifest, of a version this reads, its checksum verified and removed."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a ckptturbo manifest")
    version = doc.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatError(f"{where} has format version {version!r}; "
                          f"this ckptturbo reads versions {READABLE_VERSIONS}")
    if not _checksum_of_bytes_holds(data, doc):
        _check_checksum(doc, where)
    doc.pop(CHECKSUM_FIELD, None)
    return doc


def _only_hex_digits(text: str) -> bool:
    """Whether ``text`` holds lowercase hex digits alone: a byte table deletes them all in
    1.2 ms for the 5 MB of a 72B model's chunk ids, where a regular expression took 18."""
    try:
        return not text.encode("ascii").translate(None, _HEX_DIGITS)
    except UnicodeEncodeError:
        return False


def _chunk_table(doc: dict[str, Any], where: str) -> tuple[list[str], np.ndarray]:
    """The chunk ids (a piece names its chunk by its position here) and their sizes."""
    joined, sizes = doc.get("chunk_ids"), doc.get("chunk_sizes")
    if not isinstance(joined, str) or not isinstance(sizes, list) or len(joined) != 64 * len(sizes):
        raise FormatError(f"{where}: 'chunk_ids' must hold 64 hex digits per entry of "
                          "'chunk_sizes'")
    ids = [joined[i:i + 64] for i in range(0, len(joined), 64)]
    if not _only_hex_digits(joined):
        for cid in ids:
            validate_chunk_id(cid)  # raises, naming the first id that is not one
    if len(set(ids)) != len(ids):
        raise FormatError(f"{where}: a chunk id is listed twice in 'chunk_ids'")
    return ids, _int_array(sizes, f"{where}: 'chunk_sizes'")


def _decode_items(raw: Any, ids: list[str], table: np.ndarray, with_paths: bool,
                  with_deltas: bool, where: str
                  ) -> tuple[dict[str, ItemRecord], dict[str, tuple] | None]:
    """The items of a version 3 manifest (``with_deltas``: or 4), every field checked
    (pieces all at once, in ``_check_pieces``), and the planner data of their paths when
    ``with_paths``."""
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: 'items' must be an object")
    shapes: dict[tuple, tuple] = {}
    items: dict[str, ItemRecord] = {}
    paths: dict[str, tuple] = {}
    want: list[int] = []
    stored: list[tuple[list[int], int]] = []  # each item's pieces list and its shard count
    for fqn, rec in raw.items():
        if with_paths:
            if not isinstance(rec, list) or not rec:
                raise FormatError(f"malformed item record for {fqn!r}")
            paths[fqn] = _path_of(fqn, rec[-1])
            rec = rec[:-1]
        items[fqn], shard_bytes, pieces = _item_of(fqn, rec, shapes, ids, with_deltas)
        want += shard_bytes
        stored.append((pieces, len(shard_bytes)))
    _check_pieces(list(items), stored, want, table, where)
    return items, (paths if with_paths else None)


def _item_of(fqn: str, rec: Any, shapes: dict[tuple, tuple], ids: list[str],
             with_deltas: bool) -> tuple[ItemRecord, list[int], list[int]]:
    """One item record, checked on its own, the bytes each of its shards must hold
    (-1: an object's, any number) and its pieces list, as stored. Records of the same
    dtype, size and boxes share one check and one parse (``shapes``)."""
    kind = rec[0] if isinstance(rec, list) and rec else None
    deltas: tuple[int, ...] = ()
    if kind == "delta" and with_deltas and len(rec) == 7:
        deltas = tuple(nonnegative_ints(rec[6], f"{fqn!r}: delta lengths"))
        rec, kind = ["tensor", *rec[1:6]], "tensor"
        if not deltas or sum(deltas) >= _LIMIT:
            raise FormatError(f"{fqn!r}: a delta record needs payloads of sane lengths")
    if kind == "bytes" and len(rec) == 2:
        boxes, pieces, dtype, size, grad, want = OBJECT_BOX, rec[1], None, None, False, [-1]
    elif kind == "tensor" and len(rec) == 6:
        _, name, raw_size, grad, flat, pieces = rec
        try:
            key = (name, tuple(raw_size), grad, tuple(flat))
            shape = shapes.get(key)
        except TypeError:  # not lists, or something unhashable in them
            raise FormatError(f"malformed item record for {fqn!r}") from None
        if shape is None:
            shape = shapes[key] = _tensor_shape(fqn, name, raw_size, grad, key[3])
        dtype, size, boxes, want = shape
        if deltas:
            if len(boxes.offsets) != 1 or any(boxes.offsets[0]) or boxes.sizes[0] != size:
                raise FormatError(f"{fqn!r}: a delta record has one shard, the whole tensor")
            want = [want[0] + sum(deltas)]
    else:
        raise FormatError(f"malformed item record for {fqn!r}")
    count = len(boxes.offsets)
    try:
        total = sum(pieces[:count]) if isinstance(pieces, list) else -1
    except TypeError:
        total = -1
    if not isinstance(pieces, list) or len(pieces) != count + 3 * total:
        raise FormatError(f"{fqn!r}: malformed pieces list")
    return ItemRecord.stored(kind, dtype, size, grad, boxes, pieces, ids, deltas), want, pieces


def _tensor_shape(fqn: str, name: Any, raw_size: Any, grad: Any,
                  flat: tuple) -> tuple[DtypeName, tuple[int, ...], Boxes, list[int]]:
    """A tensor record's dtype, size and boxes, checked, and the bytes of each box."""
    dtype = DtypeName.parse(name)
    size = tuple(nonnegative_ints(raw_size, fqn))
    if type(grad) is not bool:
        raise FormatError(f"{fqn!r}: requires_grad must be true or false")
    if math.prod(size) * dtype.itemsize >= _LIMIT:
        raise FormatError(f"{fqn!r}: size {size} is too large")
    boxes = Boxes(len(size), flat, fqn)
    boxes.check_fits(size, fqn)
    return dtype, size, boxes, boxes.nbytes(dtype.itemsize)


def _check_pieces(names: list[str], stored: list[tuple[list[int], int]], want: list[int],
                  table: np.ndarray, where: str) -> None:
    """Every piece of every item at once: integers, inside its chunk, and the pieces of
    each shard add up to the bytes the shard holds (they tile it: starts are implied)."""
    counts = _int_array(list(chain.from_iterable(raw[:n] for raw, n in stored)), where)
    flat = list(chain.from_iterable(raw[n:] for raw, n in stored))
    length, chunk, offset = _int_array(flat, where).reshape(-1, 3).T
    if sum(flat[0::3]) >= _LIMIT:
        raise FormatError(f"{where}: the pieces add up to more bytes than a checkpoint can hold")
    ceiling = np.append(table, -1)[np.minimum(chunk, len(table))]  # a chunk not listed: -1
    outside = offset + length > ceiling
    if outside.any():
        at = np.cumsum([(len(raw) - n) // 3 for raw, n in stored])
        i = int(np.argmax(outside))
        fqn = names[int(np.searchsorted(at, i, side="right"))]
        raise FormatError(f"{where}: {fqn!r} names bytes outside chunk number {int(chunk[i])}")
    ends = np.cumsum(counts)
    total = np.concatenate(([0], np.cumsum(length)))
    held = total[ends] - total[ends - counts]
    expected = np.array(want, dtype=np.int64)
    wrong = (expected >= 0) & (held != expected)
    if wrong.any():
        s = int(np.argmax(wrong))
        fqn = names[int(np.searchsorted(np.cumsum([n for _, n in stored]), s, side="right"))]
        raise FormatError(f"{where}: {fqn!r}: pieces cover {int(held[s])} of the "
                          f"{int(expected[s])} bytes of a shard")


def _int_array(values: list[Any], where: str) -> np.ndarray:
    """JSON integers as int64, refused unless every one is a non-negative int (no bools,
    floats or strings) below 2**62, so sums of two cannot overflow."""
    if values and set(map(type, values)) != {int}:
        raise FormatError(f"{where}: expected non-negative integers")
    try:
        out = np.array(values, dtype=np.int64)
    except OverflowError:
        raise FormatError(f"{where}: an integer is out of range") from None
    if out.size and (out.min() < 0 or out.max() >= _LIMIT):
        raise FormatError(f"{where}: an integer is negative or out of range")
    return out


def _typed(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any,
           where: str) -> Any:
    """A top-level field of the expected JSON type (absent or null: the default)."""
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FormatError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value



def _planner_data_to_json(data: Any) -> Any:
    """DCP's default planner keeps {flat key: path tuple}; JSON keeps it as lists."""
    if data is None:
        return None
    try:
        json.dumps(data)
    except TypeError as exc:
        raise FormatError(
            f"planner_data of this SavePlanner is not JSON-serialisable: {exc}") from exc
    return data


def _planner_data_from_json(data: Any) -> Any:
    if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        return {k: tuple(v) for k, v in data.items()}
    return data


def _planner_paths(data: Any, items: dict[str, ItemRecord]) -> dict[str, list[int]] | None:
    """DCP's default planner data, {flat key: its path in the nested state dict} where the
    path's elements joined by dots are the key, for exactly the manifest's items, as the
    lengths of the path's elements per item (the keys are not written twice); None when
    the planner data is anything else."""
    if not isinstance(data, dict) or data.keys() != items.keys():
        return None
    out = {}
    for key, path in data.items():
        lengths = _path_lengths(key, path)
        if lengths is None:
            return None
        out[key] = lengths
    return out


def _path_lengths(key: str, path: Any) -> list[int] | None:
    """A path of str and int elements as lengths (an int's as ~length), if ``_path_of``
    gives it back from them."""
    if not isinstance(path, (tuple, list)):
        return None
    lengths = []
    for e in path:
        if type(e) is str:
            lengths.append(len(e))
        elif type(e) is int:
            lengths.append(~len(str(e)))
        else:
            return None
    try:
        return lengths if _path_of(key, lengths) == tuple(path) else None
    except FormatError:
        return None


def _path_of(key: str, lengths: Any) -> tuple[str | int, ...]:
    """The path an item's element lengths cut its key into (dots between the elements)."""
    if not isinstance(lengths, list):
        raise FormatError(f"{key!r}: malformed planner path")
    out: list[str | int] = []
    pos = 0
    for n in lengths:
        if type(n) is not int:
            raise FormatError(f"{key!r}: malformed planner path {lengths!r}")
        if n >= 0:
            out.append(key[pos:pos + n])
        else:
            text = key[pos:pos + ~n]
            if not (_INT.fullmatch(text) and str(int(text)) == text):
                raise FormatError(f"{key!r}: malformed planner path {lengths!r}")
            out.append(int(text))
        pos += (n if n >= 0 else ~n) + 1
    # the lengths add up to the key, and the elements joined by dots are the key
    if pos != len(key) + (1 if lengths else 0) or ".".join(map(str, out)) != key:
        raise FormatError(f"{key!r}: planner path {lengths!r} does not cut the key")
    return tuple(out)
