"""Manifests of versions 1 and 2 in the version 3 form, so that one validation
(``manifest_codec``) reads every version. Pure: a parsed document in, a document out.

Versions 1 and 2 list chunks as {id: size} and spell every piece out, with its start and
its chunk's id; version 3 lists the chunk ids once and names a chunk by its position.
"""
from __future__ import annotations

from typing import Any

from .chunks import validate_chunk_id
from .errors import FormatError
from .manifest_records import nonnegative_ints


def v2_as_v3(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """A version 1 or 2 manifest (chunks as {id: size}, every piece spelt out with its
    start and its chunk's id) in the version 3 form, so one validation reads them all."""
    chunks = doc.get("chunks")
    if not isinstance(chunks, dict):
        raise FormatError(f"{where}: 'chunks' must be an object")
    for cid in chunks:
        validate_chunk_id(cid)
    items = doc.get("items")
    if not isinstance(items, dict):
        raise FormatError(f"{where}: 'items' must be an object")
    ordinal = {cid: i for i, cid in enumerate(chunks)}
    return dict(doc, chunk_ids="".join(chunks), chunk_sizes=list(chunks.values()),
                planner_paths=False,
                items={fqn: _v2_record(fqn, raw, ordinal) for fqn, raw in items.items()})


def _v2_record(fqn: str, raw: Any, ordinal: dict[str, int]) -> list[Any]:
    """A version 2 item record in the version 3 form; its piece starts must tile it."""
    if not isinstance(raw, dict) or raw.get("kind") not in ("tensor", "bytes"):
        raise FormatError(f"malformed item record for {fqn!r}")
    shards = raw.get("shards")
    if not isinstance(shards, list):
        raise FormatError(f"malformed item record for {fqn!r}: 'shards' must be a list")
    rank = len(raw["size"]) if isinstance(raw.get("size"), list) else -1
    counts: list[int] = []
    triples: list[Any] = []
    boxes: list[Any] = []
    for s in shards:
        try:
            offsets, sizes, nbytes = s["offsets"], s["sizes"], s["nbytes"]
            pieces = list(s["pieces"])
        except (KeyError, TypeError) as exc:
            raise FormatError(f"malformed shard record for {fqn}: {exc}") from exc
        if raw["kind"] == "tensor" and not (len(nonnegative_ints(offsets, fqn))
                                            == len(nonnegative_ints(sizes, fqn)) == rank):
            raise FormatError(f"{fqn!r}: shard rank does not match tensor rank {rank}")
        pos = 0
        for p in pieces:
            start, length, cid, offset = _v2_piece(p)
            if start != pos:
                raise FormatError(f"{fqn}: pieces do not tile the shard "
                                  f"(gap or overlap at byte {pos})")
            if cid not in ordinal:
                raise FormatError(f"{fqn!r} names bytes outside chunk {cid}")
            triples += (length, ordinal[cid], offset)
            pos += length
        if pos != nonnegative_ints([nbytes], fqn)[0]:
            raise FormatError(f"{fqn}: pieces cover {pos} of {nbytes} bytes")
        counts.append(len(pieces))
        boxes += offsets
        boxes += sizes
    if raw["kind"] == "bytes":
        if len(shards) != 1:
            raise FormatError(f"object {fqn!r} must have exactly one shard")
        return ["bytes", counts + triples]
    return ["tensor", raw.get("dtype"), raw.get("size"), bool(raw.get("requires_grad", False)),
            boxes, counts + triples]


def _v2_piece(raw: Any) -> tuple[int, int, str, int]:
    """A version 2 piece, [start, length, chunk id, offset in chunk], checked."""
    if not isinstance(raw, (list, tuple)) or len(raw) != 4:
        raise FormatError(f"malformed piece record {raw!r}")
    start, length, cid, offset = raw
    for v in (start, length, offset):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"malformed piece record {raw!r}: negative or non-integer")
    return start, length, validate_chunk_id(cid), offset

