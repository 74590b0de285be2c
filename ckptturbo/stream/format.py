"""A strict parser for the safetensors header, safe on untrusted bytes.

A safetensors file is ``<u64 little-endian n><n bytes of JSON header><data>``. The header
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) plus an optional ``"__metadata__"`` of str -> str.

Files come from object stores and model hubs, so everything is checked before any byte
of data is planned or any buffer is sized from the header: the length is capped (and
checked against the file size) before it is fetched, so a header claiming 10^12 bytes
fails at once without allocating; the JSON must be an object without duplicate keys;
dtypes must be known; every tensor's byte length must equal its element count times its
dtype's size; and the tensors must tile the data section exactly, as the reference Rust
implementation requires. Every fault raises :class:`~ckptturbo.errors.FormatError` naming
the file and the fault. Nothing is ever executed or unpickled.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FormatError

DEFAULT_MAX_HEADER_SIZE = 100_000_000  # the reference implementation's cap
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors dtype name -> (bits per element, torch dtype attribute or None)
DTYPE_BITS: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"),
    "I16": (16, "int16"), "U16": (16, "uint16"), "F16": (16, "float16"),
    "BF16": (16, "bfloat16"), "I32": (32, "int32"), "U32": (32, "uint32"),
    "F32": (32, "float32"), "F64": (64, "float64"), "I64": (64, "int64"),
    "U64": (64, "uint64"), "C64": (64, "complex64"),
    "F8_E4M3": (8, "float8_e4m3fn"), "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    # sub-byte types: F4 values are packed two per byte in torch's float4_e2m1fn_x2 (whose
    # tensors are half as long in the last dim as the header's shape); torch has no F6
    "F4": (4, "float4_e2m1fn_x2"), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def torch_dtype(name: str, source: str = "") -> torch.dtype:
    """The torch dtype whose elements are this safetensors dtype's elements, one for one.

    Packed F4 is refused here: its torch tensor does not have the header's shape (see
    :func:`torch_layout`), and callers of this function reshape by the header's shape.
    """
    dtype = _torch_attr(name, source)
    if DTYPE_BITS[name][0] % 8:
        raise FormatError(f"{source}: dtype {name} packs two values per byte and cannot be "
                          "streamed yet; read it with ckptturbo.safe_open")
    return dtype


def torch_layout(name: str, shape: Sequence[int],
                 source: str = "") -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of the torch tensor that holds a safetensors tensor's bytes.

    Equal to the header's for every byte-sized dtype. F4 becomes ``float4_e2m1fn_x2``,
    two values per element, so the last dimension halves (as safetensors itself does);
    a last dimension that is odd (or a scalar) has no such tensor.
    """
    dtype = _torch_attr(name, source)
    if DTYPE_BITS[name][0] % 8 == 0:
        return dtype, tuple(shape)
    if not shape or shape[-1] % 2:
        raise FormatError(f"{source}: dtype {name} of shape {list(shape)}: torch's "
                          f"{dtype} needs an even last dimension")
    return dtype, (*shape[:-1], shape[-1] // 2)


def _torch_attr(name: str, source: str) -> torch.dtype:
    attr = DTYPE_BITS.get(name, (0, None))[1]
    if attr is None or not hasattr(torch, attr):
        raise FormatError(f"{source}: dtype {name} has no torch equivalent in torch "
                          f"{torch.__version__}")
    return getattr(torch, attr)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry; ``start``/``end`` are absolute offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file (offset) order, metadata, and the layout."""

    source: str
    header_size: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None
    by_name: dict[str, TensorInfo] = field(repr=False, compare=False)

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    @property
    def file_size(self) -> int:
        """Size the file must have: header plus a data section tiled by the tensors."""
        return self.data_start + (self.tensors[-1].end - self.data_start if self.tensors else 0)


def header_length(prefix: bytes, source: str, *, file_size: int | None = None,
                  max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> int:
    """The header length ``n`` from the first 8 bytes, checked before anything is fetched."""
    if len(prefix) < 8:
        _refuse_pickle(prefix, source)
        raise FormatError(f"{source}: too short for a safetensors file ({len(prefix)} bytes)")
    n = int.from_bytes(prefix[:8], "little")
    fault = None
    if n < 2:
        fault = f"header length {n} is too small"
    elif n > max_header_size:
        fault = f"header length {n} exceeds the limit of {max_header_size} bytes"
    elif file_size is not None and 8 + n > file_size:
        fault = f"header length {n} runs past the end of the {file_size}-byte file"
    if fault:
        _refuse_pickle(prefix, source)
        raise FormatError(f"{source}: not a valid safetensors file: {fault}")
    return n


def _refuse_pickle(prefix: bytes, source: str) -> None:
    """Give a pickle or torch.save zip a clearer error than 'bad header length'."""
    if prefix[:1] == b"\x80" or prefix[:4] == b"PK\x03\x04":
        raise FormatError(f"{source}: this is a pickle / torch.save file, not safetensors; "
                          "ckptturbo never unpickles (convert it to safetensors first)")


def refuse_pickle_name(source: str) -> None:
    """Refuse pickle checkpoints by name before any byte is read."""
    if source.lower().rstrip("/").endswith(PICKLE_SUFFIXES):
        raise FormatError(f"{source}: pickle checkpoints (.bin/.pt/.pth/.ckpt/.pkl) are refused: "
                          "loading them can run arbitrary code; convert to safetensors first")


def parse_header(raw: bytes, source: str, *, file_size: int | None = None) -> Header:
    """Validate the ``n`` JSON bytes that follow the length prefix."""
    n = len(raw)
    if not raw.startswith(b"{"):
        raise FormatError(f"{source}: header does not start with '{{'")
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise FormatError(f"{source}: header has duplicate key {exc.args[0]!r}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{source}: header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise FormatError(f"{source}: __metadata__ must map strings to strings")
    data_start = 8 + n
    entries = [_entry(name, value, source) for name, value in doc.items()]
    entries.sort(key=lambda e: (e[3], e[4], e[0]))
    tensors, cursor = [], 0
    for name, dtype, shape, begin, end in entries:
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else "leaves a gap"
            raise FormatError(f"{source}: tensor {name!r}: data_offsets [{begin}, {end}] {what} "
                              f"(expected to start at {cursor})")
        cursor = end
        tensors.append(TensorInfo(name, dtype, shape, data_start + begin, data_start + end))
    if file_size is not None and data_start + cursor != file_size:
        raise FormatError(f"{source}: tensors cover {cursor} data bytes but the file holds "
                          f"{file_size - data_start} after the header")
    return Header(source, n, tuple(tensors), metadata, {t.name: t for t in tensors})


def _entry(name: str, value: Any, source: str) -> tuple[str, str, tuple[int, ...], int, int]:
    where = f"{source}: tensor {name!r}"
    if not isinstance(value, dict) or set(value) != _ENTRY_KEYS:
        raise FormatError(f"{where}: entry must be an object with exactly {sorted(_ENTRY_KEYS)}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise FormatError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or not 0 <= offsets[0] <= offsets[1]):
        raise FormatError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                          f"got {offsets!r}")
    bits = math.prod(shape) * DTYPE_BITS[dtype][0]
    if bits % 8:
        raise FormatError(f"{where}: {shape} elements of {dtype} do not fill whole bytes")
    if bits // 8 != offsets[1] - offsets[0]:
        raise FormatError(f"{where}: shape {shape} of {dtype} needs {bits // 8} bytes but "
                          f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return name, dtype, tuple(shape), offsets[0], offsets[1]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out
