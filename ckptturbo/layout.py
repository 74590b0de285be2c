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
import posixpath
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .chunks import chunk_id, validate_chunk_id
from .errors import CheckpointNotFound, FormatError, StorageError
from .store import Store

if TYPE_CHECKING:  # torch is imported where tensors are made: `ls` and `inspect` need none
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

FORMAT_NAME = "ckptturbo-manifest"
FORMAT_VERSION = 2
# Version 1 manifests carry no checksum of their own; they are still read (with a warning).
READABLE_VERSIONS = (1, 2)
CHECKSUM_FIELD = "blake3"
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
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


@dataclass(frozen=True)
class StoredPiece:
    """Where bytes [start, start+length) of a shard live: a chunk and an offset in it."""

    start: int
    length: int
    chunk: str
    offset: int

    def to_json(self) -> list:
        return [self.start, self.length, self.chunk, self.offset]

    @classmethod
    def from_json(cls, raw: Sequence) -> "StoredPiece":
        if not isinstance(raw, (list, tuple)) or len(raw) != 4:
            raise FormatError(f"malformed piece record {raw!r}")
        start, length, cid, offset = raw
        for v in (start, length, offset):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise FormatError(f"malformed piece record {raw!r}: negative or non-integer")
        return cls(start, length, validate_chunk_id(cid), offset)


def dtype_name(dtype: "torch.dtype | str") -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> "torch.dtype":
    """The torch.dtype a manifest names (this imports torch)."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != name:
        raise FormatError(f"unknown dtype {name!r} in manifest")
    return dtype


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


class _LazyDtype:
    """``ItemRecord.dtype``: kept as its name until first read, then a torch.dtype."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self.attr)
        if isinstance(value, str):
            value = obj.__dict__[self.attr] = parse_dtype(value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.attr] = value


@dataclass
class ShardRecord:
    """One stored box of a tensor (or the whole of a bytes object), and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    pieces: list[StoredPiece]

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), "nbytes": self.nbytes,
                "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "ShardRecord":
        try:
            offsets = tuple(_ints(raw["offsets"], where))
            sizes = tuple(_ints(raw["sizes"], where))
            nbytes = _ints([raw["nbytes"]], where)[0]
            pieces = [StoredPiece.from_json(p) for p in raw["pieces"]]
        except (KeyError, TypeError) as exc:
            raise FormatError(f"malformed shard record for {where}: {exc}") from exc
        record = cls(offsets, sizes, nbytes, pieces)
        record.check(where)
        return record

    def check(self, where: str) -> None:
        """Pieces must tile [0, nbytes) exactly, in order: no gaps, no overlaps."""
        pos = 0
        for p in self.pieces:
            if p.start != pos:
                raise FormatError(f"{where}: pieces do not tile the shard (gap or overlap at byte {pos})")
            pos += p.length
        if pos != self.nbytes:
            raise FormatError(f"{where}: pieces cover {pos} of {self.nbytes} bytes")


@dataclass
class ItemRecord:
    """One state-dict entry: a tensor (possibly in several shards) or a serialized object."""

    kind: str
    shards: list[ShardRecord]
    dtype: torch.dtype | None = _LazyDtype()  # type: ignore[assignment]
    size: tuple[int, ...] | None = None
    requires_grad: bool = False

    @property
    def dtype_name(self) -> str | None:
        """The dtype's name ("bfloat16"), read without importing torch."""
        value = self.__dict__.get("_dtype")
        return None if value is None else dtype_name(value)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "shards": [s.to_json() for s in self.shards]}
        if self.kind == "tensor":
            out.update(dtype=dtype_name(self.dtype), size=list(self.size),
                       requires_grad=self.requires_grad)
        return out

    @classmethod
    def from_json(cls, fqn: str, raw: Any) -> "ItemRecord":
        if not isinstance(raw, dict) or raw.get("kind") not in ("tensor", "bytes"):
            raise FormatError(f"malformed item record for {fqn!r}")
        if not isinstance(raw.get("shards"), list):
            raise FormatError(f"malformed item record for {fqn!r}: 'shards' must be a list")
        shards = [ShardRecord.from_json(s, fqn) for s in raw["shards"]]
        if raw["kind"] == "bytes":
            if len(shards) != 1:
                raise FormatError(f"object {fqn!r} must have exactly one shard")
            return cls("bytes", shards)
        size = tuple(_ints(raw.get("size"), fqn))
        dtype = _DtypeName.parse(raw.get("dtype"))
        for s in shards:
            if len(s.offsets) != len(size) or len(s.sizes) != len(size):
                raise FormatError(f"{fqn!r}: shard rank does not match tensor rank {len(size)}")
            if any(o + n > d for o, n, d in zip(s.offsets, s.sizes, size)):
                raise FormatError(f"{fqn!r}: shard {s.offsets}+{s.sizes} exceeds size {size}")
            expected = _numel(s.sizes) * dtype.itemsize
            if s.nbytes != expected:
                raise FormatError(f"{fqn!r}: shard holds {s.nbytes} bytes, shape needs {expected}")
        return cls("tensor", shards, dtype, size, bool(raw.get("requires_grad", False)))


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
        doc = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "created": self.created,
            "chunk_store": self.chunk_store, "dcp_version": self.dcp_version,
            "storage_meta": self.storage_meta, "stats": self.stats,
            "planner_data": _planner_data_to_json(self.planner_data),
            "chunks": self.chunks,
            "items": {fqn: item.to_json() for fqn, item in self.items.items()},
        }
        return _with_checksum(_canonical(doc))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise FormatError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise FormatError(f"{where} is not a ckptturbo manifest")
        if doc.get("version") not in READABLE_VERSIONS:
            raise FormatError(f"{where} has format version {doc.get('version')!r}; "
                              f"this ckptturbo reads versions {READABLE_VERSIONS}")
        if not _checksum_of_bytes_holds(data, doc):
            _check_checksum(doc, where)
        doc.pop(CHECKSUM_FIELD, None)
        chunks = doc.get("chunks")
        if not isinstance(chunks, dict):
            raise FormatError(f"{where}: 'chunks' must be an object")
        for cid, size in chunks.items():
            validate_chunk_id(cid)
            _ints([size], where)
        items_raw = doc.get("items")
        if not isinstance(items_raw, dict):
            raise FormatError(f"{where}: 'items' must be an object")
        items = {fqn: ItemRecord.from_json(fqn, raw) for fqn, raw in items_raw.items()}
        for fqn, item in items.items():
            for shard in item.shards:
                for p in shard.pieces:
                    if p.chunk not in chunks or p.offset + p.length > chunks[p.chunk]:
                        raise FormatError(f"{where}: {fqn!r} names bytes outside chunk {p.chunk}")
        store = _typed(doc, "chunk_store", str, RUN_STORE, where)
        created = _typed(doc, "created", (int, float), 0, where)
        return cls(items=items, chunks={k: int(v) for k, v in chunks.items()},
                   planner_data=_planner_data_from_json(doc.get("planner_data")),
                   storage_meta=_typed(doc, "storage_meta", dict, {}, where),
                   created=float(created), stats=_typed(doc, "stats", dict, {}, where),
                   chunk_store=store, dcp_version=_typed(doc, "dcp_version", str, None, where))

    # --- DCP view
    def to_metadata(self) -> Metadata:
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
            TensorProperties, TensorStorageMetadata)

        sd_meta: dict[str, Any] = {}
        storage_data: dict[MetadataIndex, ShardRecord] = {}
        for fqn, item in self.items.items():
            if item.kind == "bytes":
                sd_meta[fqn] = BytesStorageMetadata()
                storage_data[MetadataIndex(fqn)] = item.shards[0]
                continue
            props = TensorProperties(dtype=item.dtype, requires_grad=item.requires_grad)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                      for s in item.shards]
            sd_meta[fqn] = TensorStorageMetadata(props, torch.Size(item.size), chunks)
            for s in item.shards:
                storage_data[MetadataIndex(fqn, s.offsets)] = s
        meta = StorageMeta(checkpoint_id=self.storage_meta.get("checkpoint_id"),
                           save_id=self.storage_meta.get("save_id"))
        return Metadata(state_dict_metadata=sd_meta, planner_data=self.planner_data,
                        storage_data=storage_data, storage_meta=meta, version=self.dcp_version)

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

    def read_manifest(self) -> Manifest:
        try:
            info = self.store.info(self.manifest_path)
        except CheckpointNotFound as exc:
            raise CheckpointNotFound(
                f"no committed checkpoint at {self.url!r}: {MANIFEST_NAME} is missing "
                "(the save never finished, or the URL is wrong)") from exc
        if info.size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{self.url}/{MANIFEST_NAME} is {info.size} bytes; refusing to read")
        where = f"{self.url}/{MANIFEST_NAME}"
        rereads = 0 if self.store.is_local else READS_OF_A_DAMAGED_OBJECT - 1  # no transit locally
        for _ in range(rereads):
            try:
                return Manifest.from_bytes(self.store.get(self.manifest_path), where)
            except FormatError as exc:
                log.warning("%s: %s; reading it again in case it was damaged in transit", where, exc)
        return Manifest.from_bytes(self.store.get(self.manifest_path), where)

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


def _ints(values: Any, where: str) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise FormatError(f"{where}: expected a list of integers, got {type(values).__name__}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"{where}: expected non-negative integers, got {v!r}")
    return list(values)


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


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
