"""The storage contract: every path and record ckptturbo puts in storage, in one place.

    <run>/.ckptturbo/chunks/<2 hex>/<64 hex>        content-addressed chunks, shared by the run
    <run>/.ckptturbo/pending/<save id>.<rank>       a rank of a save in progress (removed at commit;
                                                    dead once its heartbeat lease expires)
    <run>/.ckptturbo/gc.lock                        a gc in progress (same lease)
    <run>/.ckptturbo/gc.generation                  changes whenever a gc may delete chunks
    <run>/<checkpoint>/manifest.json                JSON, written last: the commit
    <run>/<checkpoint>/.ckptturbo/...               a self-contained checkpoint's own store
                                                    (manifest ``chunk_store`` "."): same layout

A manifest's ``chunk_store`` says where its chunks are: ".." (``RUN_STORE``, the run's
store, shared by its checkpoints), "." (``OWN_STORE``: the checkpoint's own directory, so
it can be copied or moved on its own) or an absolute URL.

``FORMAT_VERSION`` versions the manifest; ``CONTROL_VERSION`` the chunk fan-out and the
control records. The manifest carries everything DCP's ``Metadata`` carries (tensor
shapes, dtypes, shard boxes, planner data), so the reader rebuilds Metadata from JSON and
nothing from storage is ever unpickled. Every field is validated on the way in: a
manifest may be hostile. ``build_manifest`` (pure) turns DCP's Metadata and the ranks'
write results into a manifest; ``catalog`` does the I/O on the control paths; ``lease`` owns the records written there.
"""
from __future__ import annotations

import json
import logging
import math
import posixpath
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from .chunks import chunk_id, validate_chunk_id
from .errors import CheckpointExists, CheckpointNotFound, FormatError, StorageError
from .store import Store

if TYPE_CHECKING:  # torch is imported where tensors are made: `ls` and `inspect` need none
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

FORMAT_NAME = "ckptturbo-manifest"
FORMAT_VERSION = 3
# Version 1 manifests carry no checksum of their own; they are still read (with a warning).
# Versions 1 and 2 spell every piece out (its start, its chunk's id); version 3 is compact.
READABLE_VERSIONS = (1, 2, 3)
CHECKSUM_FIELD = "blake3"
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
_LIMIT = 1 << 62  # no integer of a manifest reaches this: sums of two fit in int64
_HEX = re.compile(r"[0-9a-f]*")
_INT = re.compile(r"-?[0-9]+")
# Reads of an object (chunk or manifest) that fails verification before it is reported
# damaged: damage in transit reads right a later time, damage at rest never does. Two: at 10%
# injected faults one chunk came back corrupted twice in a row in 20 seeds (soak run).
READS_OF_A_DAMAGED_OBJECT = 3
CONTROL_VERSION = 1  # chunk fan-out, pending markers, gc lock and generation
CONTROL_DIR = ".ckptturbo"
CHUNKS_DIR = f"{CONTROL_DIR}/chunks"
PENDING_DIR = f"{CONTROL_DIR}/pending"
GC_LOCK = f"{CONTROL_DIR}/gc.lock"
GC_GENERATION = f"{CONTROL_DIR}/gc.generation"
RUN_STORE = ".."  # manifest ``chunk_store``: the run's store, beside the checkpoint
OWN_STORE = "."  # manifest ``chunk_store``: inside the checkpoint's own directory
log = logging.getLogger(__name__)

# Bytes per element of every dtype torch names, so a manifest is validated without importing
# torch (tests/test_cli.py checks this table against torch's own dtypes).
DTYPE_ITEMSIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "qint8": 1, "quint8": 1, "qint32": 4,
    "quint4x2": 1, "quint2x4": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
    "bits16": 2, "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    **{f"{kind}{bits}": 1 for kind in ("uint", "int") for bits in range(1, 8)},
}


def chunk_relpath(cid: str) -> str:
    """Where a chunk lives under the chunks root (two-level fan-out)."""
    validate_chunk_id(cid)
    return f"{cid[:2]}/{cid}"


def _ints(values: Any, where: str) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise FormatError(f"{where}: expected a list of integers, got {type(values).__name__}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"{where}: expected non-negative integers, got {v!r}")
    return list(values)


class StoredPiece(NamedTuple):
    """Where bytes [start, start+length) of a shard live: a chunk and an offset in it (a
    tuple: a loading rank makes thousands of them from the manifest's piece lists)."""

    start: int
    length: int
    chunk: str
    offset: int


def dtype_name(dtype: "torch.dtype | str") -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> "torch.dtype":
    """The torch.dtype a manifest names (this imports torch)."""
    import torch

    if isinstance(name, str) and name in _TORCH_DTYPES:
        return _TORCH_DTYPES[name]
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != name:
        raise FormatError(f"unknown dtype {name!r} in manifest")
    _TORCH_DTYPES[str(name)] = dtype
    return dtype


_TORCH_DTYPES: dict[str, Any] = {}  # parse_dtype's answers: a manifest names a few dtypes often


class _DtypeName(str):
    """A dtype as a manifest names it, with its item size: enough to validate a manifest
    and to show it, without torch. ``ItemRecord.dtype`` turns it into a torch.dtype."""

    itemsize: int

    @classmethod
    def parse(cls, name: Any) -> "_DtypeName":
        if not isinstance(name, str):
            raise FormatError(f"unknown dtype {name!r} in manifest")
        itemsize = DTYPE_ITEMSIZES.get(name)
        if itemsize is None:  # a dtype newer than this table: ask torch itself
            itemsize = parse_dtype(name).itemsize
        out = cls(name)
        out.itemsize = itemsize
        return out


@dataclass
class ShardRecord:
    """One stored box of a tensor (or the whole of a bytes object), and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    pieces: list[StoredPiece]

    def check(self, where: str) -> None:
        """Pieces must tile [0, nbytes) exactly, in order: no gaps, no overlaps."""
        pos = 0
        for p in self.pieces:
            if p.start != pos:
                raise FormatError(f"{where}: pieces do not tile the shard (gap or overlap at byte {pos})")
            pos += p.length
        if pos != self.nbytes:
            raise FormatError(f"{where}: pieces cover {pos} of {self.nbytes} bytes")


class _Boxes:
    """The shard boxes of the tensor records of one shape, dtype and ``boxes`` list, parsed
    once: a model's tensors share a few shapes and one sharding (the 186K shards of a 72B
    HSDP manifest have a few dozen distinct lists), and so do DCP's chunk metadata."""

    def __init__(self, ndim: int, flat: tuple[int, ...], where: str) -> None:
        _ints(flat, where)
        step = 2 * ndim
        if (step == 0 and flat) or (step and len(flat) % step):
            raise FormatError(f"{where!r}: {len(flat)} box values do not make boxes of rank {ndim}")
        starts = range(0, len(flat), step) if step else range(1)
        self.offsets = [flat[i:i + ndim] for i in starts]
        self.sizes = [flat[i + ndim:i + step] for i in starts]
        self._position: dict[tuple[int, ...], int] | None = None
        self._chunk_metas: list[Any] | None = None

    def check_fits(self, size: tuple[int, ...], where: str) -> None:
        """Every box lies inside a tensor of ``size``."""
        for offsets, sizes in zip(self.offsets, self.sizes):
            if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
                raise FormatError(f"{where!r}: shard {offsets}+{sizes} exceeds size {size}")

    def nbytes(self, itemsize: int) -> list[int]:
        """The bytes each box holds of a dtype of ``itemsize``."""
        return [math.prod(s) * itemsize for s in self.sizes]

    def position(self, offsets: Sequence[int]) -> int | None:
        """Which box starts at ``offsets`` (None: none)."""
        if self._position is None:
            self._position = {o: j for j, o in enumerate(self.offsets)}
        return self._position.get(tuple(offsets))

    def chunk_metas(self) -> list[Any]:
        """DCP's ChunkStorageMetadata of the boxes, made once (DCP only reads them)."""
        if self._chunk_metas is None:
            import torch
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

            self._chunk_metas = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                 for o, s in zip(self.offsets, self.sizes)]
        return self._chunk_metas


_OBJECT_BOX = _Boxes(0, (), "an object")  # an object's one shard has no box


class ItemRecord:
    """One state-dict entry: a tensor (possibly in several shards) or a serialized object.

    A record read from a manifest keeps its pieces as the manifest lists them (the piece
    count of each shard, then (length, chunk ordinal, offset) per piece), builds its
    ``shards`` when they are first read, and ``shard_at`` builds only the one asked for:
    a loading rank of an HSDP job uses one shard in 64."""

    __slots__ = ("kind", "size", "requires_grad", "_dtype", "_shards", "_boxes", "_pieces",
                 "_ids", "_first", "_position")

    def __init__(self, kind: str, shards: list[ShardRecord] | None, dtype: Any = None,
                 size: tuple[int, ...] | None = None, requires_grad: bool = False) -> None:
        self.kind = kind
        self.size = size
        self.requires_grad = requires_grad
        self._dtype = dtype  # a torch.dtype, or its name until first read
        self._shards = shards
        self._boxes: _Boxes | None = None
        self._pieces: list[int] = []
        self._ids: list[str] = []
        self._first: list[int] | None = None
        self._position: dict[tuple[int, ...], int] | None = None

    @classmethod
    def _stored(cls, kind: str, dtype: Any, size: tuple[int, ...] | None, requires_grad: bool,
                boxes: _Boxes, pieces: list[int], ids: list[str]) -> "ItemRecord":
        """A record as a version 3 manifest holds it (checked by the caller)."""
        item = cls(kind, None, dtype, size, requires_grad)
        item._boxes, item._pieces, item._ids = boxes, pieces, ids
        return item

    @property
    def dtype(self) -> torch.dtype | None:
        if isinstance(self._dtype, str):
            self._dtype = parse_dtype(str(self._dtype))
        return self._dtype

    @property
    def dtype_name(self) -> str | None:
        """The dtype's name ("bfloat16"), read without importing torch."""
        return None if self._dtype is None else dtype_name(self._dtype)

    @property
    def shards(self) -> list[ShardRecord]:
        if self._shards is None:
            self._shards = [self._shard(j) for j in range(len(self._boxes.offsets))]
        return self._shards

    def shard_at(self, offsets: Sequence[int] | None) -> ShardRecord | None:
        """The shard a DCP ``MetadataIndex`` names (an object's by no offsets, a tensor's
        by its offsets), or None."""
        if (self.kind == "bytes") != (offsets is None):
            return None
        if self._shards is None:
            j = self._boxes.position(offsets or ())
            return None if j is None else self._shard(j)
        if self._position is None:
            self._position = {tuple(s.offsets): j for j, s in enumerate(self._shards)}
        j = self._position.get(tuple(offsets or ()))
        return None if j is None else self._shards[j]

    def _shard(self, j: int) -> ShardRecord:
        """Shard ``j`` of a stored record; a piece starts where the one before it ended."""
        raw, ids, count = self._pieces, self._ids, len(self._boxes.offsets)
        if self._first is None:
            self._first = list(accumulate(raw[:count], initial=0))
        at = count + 3 * self._first[j]
        out, pos = [], 0
        for i in range(at, at + 3 * raw[j], 3):
            out.append(StoredPiece(pos, raw[i], ids[raw[i + 1]], raw[i + 2]))
            pos += raw[i]
        return ShardRecord(self._boxes.offsets[j], self._boxes.sizes[j], pos, out)

    def offsets(self) -> list[tuple[int, ...]]:
        """The offsets of the shards, without building them."""
        if self._shards is None:
            return self._boxes.offsets
        return [tuple(s.offsets) for s in self._shards]

    def chunk_metas(self) -> list[Any]:
        """DCP's ChunkStorageMetadata of each shard."""
        if self._shards is None:
            return list(self._boxes.chunk_metas())
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                for s in self._shards]

    def to_record(self, fqn: str, ordinal: dict[str, int]) -> list[Any]:
        """The item as a version 3 manifest spells it (docs/format.md)."""
        counts: list[int] = []
        triples: list[int] = []
        boxes: list[int] = []
        for s in self.shards:
            s.check(fqn)  # the record leaves piece starts out: they follow from the lengths
            counts.append(len(s.pieces))
            for p in s.pieces:
                triples += (p.length, ordinal[p.chunk], p.offset)
            boxes += s.offsets
            boxes += s.sizes
        if self.kind == "bytes":
            return ["bytes", counts + triples]
        return ["tensor", self.dtype_name, list(self.size), bool(self.requires_grad), boxes,
                counts + triples]


class _ShardIndex(Mapping):
    """DCP's ``Metadata.storage_data`` of a manifest: MetadataIndex -> ShardRecord, looked
    up in the items instead of copied into a dict of every shard (a rank reads a few)."""

    def __init__(self, items: dict[str, ItemRecord]) -> None:
        self._items = items

    def __getitem__(self, index: Any) -> ShardRecord:
        item = self._items.get(getattr(index, "fqn", None))
        shard = item.shard_at(index.offset) if item is not None else None
        if shard is None:
            raise KeyError(index)
        return shard

    def __iter__(self) -> Iterator[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for fqn, item in self._items.items():
            if item.kind == "bytes":
                yield MetadataIndex(fqn)
            else:
                for offsets in item.offsets():
                    yield MetadataIndex(fqn, offsets)

    def __len__(self) -> int:
        return sum(len(item.offsets()) for item in self._items.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (list(self.items()),)  # pickled as the plain dict it stands for


@dataclass
class Manifest:
    items: dict[str, ItemRecord]
    chunks: dict[str, int]
    planner_data: Any = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)
    chunk_store: str = RUN_STORE
    dcp_version: str | None = None

    # --- serialisation
    def to_bytes(self) -> bytes:
        """The manifest in the current version's form, with its checksum."""
        ordinal = {cid: i for i, cid in enumerate(self.chunks)}
        paths = _planner_paths(self.planner_data, self.items)
        items = {}
        for fqn, item in self.items.items():
            items[fqn] = item.to_record(fqn, ordinal)
            if paths is not None:
                items[fqn].append(paths[fqn])
        doc = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "created": self.created,
            "chunk_store": self.chunk_store, "dcp_version": self.dcp_version,
            "storage_meta": self.storage_meta, "stats": self.stats,
            "planner_data": None if paths is not None else _planner_data_to_json(self.planner_data),
            "planner_paths": paths is not None,
            "chunk_ids": "".join(self.chunks), "chunk_sizes": list(self.chunks.values()),
            "items": items,
        }
        return _with_checksum(_canonical(doc))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        doc = _verified_document(data, where)
        if doc["version"] < 3:
            doc = _v2_as_v3(doc, where)
        ids, sizes = _chunk_table(doc, where)
        with_paths = doc.get("planner_paths", False)
        if type(with_paths) is not bool:
            raise FormatError(f"{where}: 'planner_paths' must be true or false")
        items, paths = _decode_items(doc.get("items"), ids, sizes, with_paths, where)
        store = _typed(doc, "chunk_store", str, RUN_STORE, where)
        created = _typed(doc, "created", (int, float), 0, where)
        planner_data = paths if with_paths else _planner_data_from_json(doc.get("planner_data"))
        return cls(items=items, chunks=dict(zip(ids, sizes.tolist())), planner_data=planner_data,
                   storage_meta=_typed(doc, "storage_meta", dict, {}, where),
                   created=float(created), stats=_typed(doc, "stats", dict, {}, where),
                   chunk_store=store, dcp_version=_typed(doc, "dcp_version", str, None, where))

    # --- DCP view
    def to_metadata(self) -> Metadata:
        """DCP's Metadata; its ``storage_data`` looks shards up in the items when asked."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata)

        sd_meta: dict[str, Any] = {}
        props: dict[tuple[Any, bool], TensorProperties] = {}  # shared: DCP only reads them
        for fqn, item in self.items.items():
            if item.kind == "bytes":
                sd_meta[fqn] = BytesStorageMetadata()
                continue
            key = (item.dtype, item.requires_grad)
            if key not in props:
                props[key] = TensorProperties(dtype=key[0], requires_grad=key[1])
            sd_meta[fqn] = TensorStorageMetadata(props[key], torch.Size(item.size), item.chunk_metas())
        meta = StorageMeta(checkpoint_id=self.storage_meta.get("checkpoint_id"),
                           save_id=self.storage_meta.get("save_id"))
        return Metadata(state_dict_metadata=sd_meta, planner_data=self.planner_data,
                        storage_data=_ShardIndex(self.items), storage_meta=meta,
                        version=self.dcp_version)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for item in self.items.values() for s in item.shards)

    @property
    def unique_bytes(self) -> int:
        return sum(self.chunks.values())


class RunStore:
    """A run's chunk store and its control files: the paths a save and a gc share.

    ``own``: the store of one self-contained checkpoint (``OWN_STORE``), which a delete
    removes whole, control files included (``catalog``)."""

    def __init__(self, store: Store, root: str, *, own: bool = False) -> None:
        self.store = store
        self.root = root.rstrip("/") or "/"
        self.own = own
        self.control_dir = store.join(self.root, CONTROL_DIR)
        self.chunks_root = store.join(self.root, CHUNKS_DIR)
        self.pending_dir = store.join(self.root, PENDING_DIR)
        self.gc_lock = store.join(self.root, GC_LOCK)
        self.gc_generation = store.join(self.root, GC_GENERATION)

    @classmethod
    def for_run(cls, run_url: str, storage_options: dict[str, Any] | None = None, *,
                session: Any = None) -> "RunStore":
        """The chunk store of the run at ``run_url`` (the parent of its checkpoints)."""
        store = Store(run_url, storage_options, session=session)
        return cls(store, store.root)

    @property
    def key(self) -> tuple[str, str]:
        """Names this store across writers: its URL and the options that reach it."""
        return (self.store.url_of(self.chunks_root), repr(sorted(self.store.storage_options.items())))

    def chunk_path(self, cid: str) -> str:
        return self.store.join(self.chunks_root, chunk_relpath(cid))

    def chunk_ids(self) -> set[str]:
        """The ids of the chunks the store holds (one listing)."""
        return {info.path.rsplit("/", 1)[-1] for info in self.store.list_files(self.chunks_root)}

    def pending_path(self, save_id: str, rank: int) -> str:
        return self.store.join(self.pending_dir, f"{save_id}.{rank}")


class Location:
    """Where one checkpoint's manifest and its chunk store are.

    ``store_url``: None or ``RUN_STORE`` for the run's store (the checkpoint's parent),
    ``OWN_STORE`` for a store inside the checkpoint's directory, else the store's URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 store_url: str | None = None, *, session: Any = None) -> None:
        self.url = str(url)
        self.storage_options = storage_options
        self.store = Store(self.url, storage_options, session=session)
        self.path = self.store.root
        parent = posixpath.dirname(self.path)
        if not parent or parent == self.path:
            raise FormatError(f"checkpoint URL {self.url!r} needs a parent directory or bucket "
                              "prefix to hold the chunk store, e.g. s3://bucket/run/step-100")
        self.manifest_path = self.store.join(self.path, MANIFEST_NAME)
        if store_url is None or store_url == RUN_STORE:
            self.run = RunStore(self.store, parent)
            self.chunk_store_ref = RUN_STORE
        elif store_url == OWN_STORE:
            self.run = RunStore(self.store, self.path, own=True)
            self.chunk_store_ref = OWN_STORE
        else:
            self.run = RunStore.for_run(store_url, storage_options, session=session)
            self.chunk_store_ref = str(store_url)
        self.chunk_store = self.run.store
        self.chunks_root = self.run.chunks_root

    @classmethod
    def for_manifest(cls, url: str, storage_options: dict[str, Any] | None,
                     manifest: Manifest, *, session: Any = None) -> "Location":
        """The location a committed manifest points at (its chunk store may be elsewhere)."""
        return cls(url, storage_options, manifest.chunk_store, session=session)

    @property
    def self_contained(self) -> bool:
        """Whether the checkpoint's directory holds its chunks (``OWN_STORE``)."""
        return self.run.own

    def chunk_path(self, cid: str) -> str:
        return self.run.chunk_path(cid)

    def refuse_committed(self) -> None:
        """overwrite=False: raise CheckpointExists when a committed checkpoint is here."""
        if self.store.exists(self.manifest_path):
            raise CheckpointExists(f"Checkpoint already exists at {self.url!r} and overwrite=False "
                                   "(a committed ckptturbo checkpoint); it was left untouched")

    def read_manifest(self) -> Manifest:
        where = f"{self.url}/{MANIFEST_NAME}"
        rereads = 0 if self.store.is_local else READS_OF_A_DAMAGED_OBJECT - 1  # no transit locally
        for _ in range(rereads):
            try:
                return Manifest.from_bytes(self._manifest_bytes(), where)
            except FormatError as exc:
                log.warning("%s: %s; reading it again in case it was damaged in transit", where, exc)
        return Manifest.from_bytes(self._manifest_bytes(), where)

    def _manifest_bytes(self) -> bytes:
        """The manifest in one request, no HEAD first (a round trip per rank and load): a
        read of one byte more than the largest manifest trusted tells a larger one apart."""
        try:
            data = self.store.get(self.manifest_path, 0, MAX_MANIFEST_BYTES + 1)
        except CheckpointNotFound as exc:
            raise CheckpointNotFound(
                f"no committed checkpoint at {self.url!r}: {MANIFEST_NAME} is missing "
                "(the save never finished, or the URL is wrong)") from exc
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"{self.url}/{MANIFEST_NAME} is over {MAX_MANIFEST_BYTES} bytes; "
                              "refusing to read it")
        return data

    def write_manifest(self, manifest: Manifest) -> None:
        self.store.put(self.manifest_path, manifest.to_bytes())


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


def _chunk_table(doc: dict[str, Any], where: str) -> tuple[list[str], np.ndarray]:
    """The chunk ids (a piece names its chunk by its position here) and their sizes."""
    joined, sizes = doc.get("chunk_ids"), doc.get("chunk_sizes")
    if not isinstance(joined, str) or not isinstance(sizes, list) or len(joined) != 64 * len(sizes):
        raise FormatError(f"{where}: 'chunk_ids' must hold 64 hex digits per entry of 'chunk_sizes'")
    ids = [joined[i:i + 64] for i in range(0, len(joined), 64)]
    if not _HEX.fullmatch(joined):
        for cid in ids:
            validate_chunk_id(cid)  # raises, naming the first id that is not one
    if len(set(ids)) != len(ids):
        raise FormatError(f"{where}: a chunk id is listed twice in 'chunk_ids'")
    return ids, _int_array(sizes, f"{where}: 'chunk_sizes'")


def _decode_items(raw: Any, ids: list[str], table: np.ndarray, with_paths: bool,
                  where: str) -> tuple[dict[str, ItemRecord], dict[str, tuple] | None]:
    """The items of a version 3 manifest, every field checked (pieces all at once, in
    ``_check_pieces``), and the planner data of their paths when ``with_paths``."""
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: 'items' must be an object")
    shapes: dict[tuple, tuple] = {}
    items: dict[str, ItemRecord] = {}
    paths: dict[str, tuple] = {}
    want: list[int] = []
    for fqn, rec in raw.items():
        if with_paths:
            if not isinstance(rec, list) or not rec:
                raise FormatError(f"malformed item record for {fqn!r}")
            paths[fqn] = _path_of(fqn, rec[-1])
            rec = rec[:-1]
        items[fqn], shard_bytes = _item_of(fqn, rec, shapes, ids)
        want += shard_bytes
    _check_pieces(items, want, table, where)
    return items, (paths if with_paths else None)


def _item_of(fqn: str, rec: Any, shapes: dict[tuple, tuple],
             ids: list[str]) -> tuple[ItemRecord, list[int]]:
    """One item record, checked on its own, and the bytes each of its shards must hold
    (-1: an object's, any number). Records of the same dtype, size and boxes share one
    check and one parse (``shapes``)."""
    kind = rec[0] if isinstance(rec, list) and rec else None
    if kind == "bytes" and len(rec) == 2:
        boxes, pieces, dtype, size, grad, want = _OBJECT_BOX, rec[1], None, None, False, [-1]
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
    else:
        raise FormatError(f"malformed item record for {fqn!r}")
    count = len(boxes.offsets)
    try:
        total = sum(pieces[:count]) if isinstance(pieces, list) else -1
    except TypeError:
        total = -1
    if not isinstance(pieces, list) or len(pieces) != count + 3 * total:
        raise FormatError(f"{fqn!r}: malformed pieces list")
    return ItemRecord._stored(kind, dtype, size, grad, boxes, pieces, ids), want


def _tensor_shape(fqn: str, name: Any, raw_size: Any, grad: Any,
                  flat: tuple) -> tuple[_DtypeName, tuple[int, ...], _Boxes, list[int]]:
    """A tensor record's dtype, size and boxes, checked, and the bytes of each box."""
    dtype = _DtypeName.parse(name)
    size = tuple(_ints(raw_size, fqn))
    if type(grad) is not bool:
        raise FormatError(f"{fqn!r}: requires_grad must be true or false")
    if math.prod(size) * dtype.itemsize >= _LIMIT:
        raise FormatError(f"{fqn!r}: size {size} is too large")
    boxes = _Boxes(len(size), flat, fqn)
    boxes.check_fits(size, fqn)
    return dtype, size, boxes, boxes.nbytes(dtype.itemsize)


def _check_pieces(items: dict[str, ItemRecord], want: list[int], table: np.ndarray,
                  where: str) -> None:
    """Every piece of every item at once: integers, inside its chunk, and the pieces of
    each shard add up to the bytes the shard holds (they tile it: starts are implied)."""
    stored = [(item._pieces, len(item._boxes.offsets)) for item in items.values()]
    counts = _int_array(list(chain.from_iterable(raw[:n] for raw, n in stored)), where)
    flat = list(chain.from_iterable(raw[n:] for raw, n in stored))
    length, chunk, offset = _int_array(flat, where).reshape(-1, 3).T
    if sum(flat[0::3]) >= _LIMIT:
        raise FormatError(f"{where}: the pieces add up to more bytes than a checkpoint can hold")
    ceiling = np.append(table, -1)[np.minimum(chunk, len(table))]  # a chunk not listed: -1
    outside = offset + length > ceiling
    names = list(items)
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


def _v2_as_v3(doc: dict[str, Any], where: str) -> dict[str, Any]:
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
    return dict(doc, chunk_ids="".join(chunks), chunk_sizes=list(chunks.values()), planner_paths=False,
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
            offsets, sizes, nbytes, pieces = s["offsets"], s["sizes"], s["nbytes"], list(s["pieces"])
        except (KeyError, TypeError) as exc:
            raise FormatError(f"malformed shard record for {fqn}: {exc}") from exc
        if raw["kind"] == "tensor" and not len(_ints(offsets, fqn)) == len(_ints(sizes, fqn)) == rank:
            raise FormatError(f"{fqn!r}: shard rank does not match tensor rank {rank}")
        pos = 0
        for p in pieces:
            start, length, cid, offset = _v2_piece(p)
            if start != pos:
                raise FormatError(f"{fqn}: pieces do not tile the shard (gap or overlap at byte {pos})")
            if cid not in ordinal:
                raise FormatError(f"{fqn!r} names bytes outside chunk {cid}")
            triples += (length, ordinal[cid], offset)
            pos += length
        if pos != _ints([nbytes], fqn)[0]:
            raise FormatError(f"{fqn}: pieces cover {pos} of {nbytes} bytes")
        counts.append(len(pieces))
        boxes += offsets
        boxes += sizes
    if raw["kind"] == "bytes":
        if len(shards) != 1:
            raise FormatError(f"object {fqn!r} must have exactly one shard")
        return ["bytes", counts + triples]
    return ["tensor", raw.get("dtype"), raw.get("size"), bool(raw.get("requires_grad", False)), boxes,
            counts + triples]


def _v2_piece(raw: Any) -> tuple[int, int, str, int]:
    """A version 2 piece, [start, length, chunk id, offset in chunk], checked."""
    if not isinstance(raw, (list, tuple)) or len(raw) != 4:
        raise FormatError(f"malformed piece record {raw!r}")
    start, length, cid, offset = raw
    for v in (start, length, offset):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"malformed piece record {raw!r}: negative or non-integer")
    return start, length, validate_chunk_id(cid), offset


def _typed(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any,
           where: str) -> Any:
    """A top-level field of the expected JSON type (absent or null: the default)."""
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FormatError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


@dataclass
class ShardPart:
    """What one rank stored of one shard: a DCP WriteResult's ``storage_data``."""

    kind: str
    nbytes: int
    pieces: list[StoredPiece]
    chunk_sizes: dict[str, int]
    written: int = 0
    reused: int = 0


def build_manifest(metadata: Metadata, parts: dict[MetadataIndex, list[ShardPart]], *,
                   url: str, save_id: str, chunk_store_ref: str, world_size: int) -> Manifest:
    """The manifest of a save, from DCP's Metadata and what every rank stored (pure)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    chunks: dict[str, int] = {}
    items: dict[str, ItemRecord] = {}
    written = reused = 0
    for fqn, md in metadata.state_dict_metadata.items():
        is_bytes = isinstance(md, BytesStorageMetadata)
        boxes = [((), ())] if is_bytes else [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        shards = []
        for offsets, sizes in boxes:
            index = MetadataIndex(fqn) if is_bytes else MetadataIndex(fqn, offsets)
            shard, w, r = _merge(parts.get(index, []), fqn, offsets, sizes, chunks)
            shards.append(shard)
            written, reused = written + w, reused + r
        items[fqn] = ItemRecord("bytes", shards) if is_bytes else ItemRecord(
            "tensor", shards, md.properties.dtype, tuple(md.size), bool(md.properties.requires_grad))
    return Manifest(
        items=items, chunks=chunks, planner_data=metadata.planner_data,
        storage_meta={"checkpoint_id": url, "save_id": save_id},
        stats={"bytes_written": written, "bytes_reused": reused, "world_size": world_size},
        chunk_store=chunk_store_ref, dcp_version=metadata.version)


def _merge(plist: list[ShardPart], fqn: str, offsets: tuple, sizes: tuple,
           chunks: dict[str, int]) -> tuple[ShardRecord, int, int]:
    """One shard from the parts its writers stored; the pieces must tile it exactly."""
    if not plist:
        raise StorageError(f"no rank wrote {fqn!r} at offset {offsets}: the save is incomplete")
    pieces = sorted((piece for p in plist for piece in p.pieces), key=lambda p: p.start)
    for p in plist:
        chunks.update(p.chunk_sizes)
    record = ShardRecord(offsets, sizes, plist[0].nbytes, pieces)
    record.check(fqn)
    return record, sum(p.written for p in plist), sum(p.reused for p in plist)


def _planner_data_to_json(data: Any) -> Any:
    """DCP's default planner keeps {flat key: path tuple}; JSON keeps it as lists."""
    if data is None:
        return None
    try:
        json.dumps(data)
    except TypeError as exc:
        raise FormatError(f"planner_data of this SavePlanner is not JSON-serialisable: {exc}") from exc
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
