"""``safe_open`` for any fsspec URL: safetensors' lazy file API, fetching only what is asked.

The contract is ``safetensors.safe_open`` 0.8's: the same arguments (``filename`` as a str
or ``os.PathLike``, ``framework``, ``device``, keyword-only ``backend``), the same methods
(``keys``, ``offset_keys``, ``metadata``, ``get_tensor``, ``get_tensors``, ``get_slice``
with ``get_shape``/``get_dtype``/indexing), every dtype both torch and safetensors know
(F4 as ``float4_e2m1fn_x2``, last dimension halved, as safetensors does), and a handle
that refuses use once its ``with`` block has closed it (slices taken before keep working,
as safetensors' do). Code written against safetensors catches ``SafetensorError`` and
``FileNotFoundError``; the errors below are those and ckptturbo errors at once.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from ..errors import CheckpointNotFound, CkptTurboError, FormatError, MismatchError
from ..prefetch import MemoryBudget
from ..staging import DeviceCopier
from .format import DEFAULT_MAX_HEADER_SIZE, Header, TensorInfo, refuse_pickle_name, torch_layout
from .headers import open_file
from .nextfile import HandleSettings, NextFile, claim, shard_count, start_next
from .readahead import ReadAhead, guess_order, start_read_ahead
from .source import ByteSource, open_store

log = logging.getLogger(__name__)
MiB = 1 << 20
FRAMEWORKS = {"pt": "pt", "torch": "pt", "pytorch": "pt", "np": "numpy", "numpy": "numpy"}
OTHER_FRAMEWORKS = ("tf", "tensorflow", "jax", "flax", "mlx", "paddle")  # safetensors', not ours
BACKENDS = ("mmap", "pread")  # accepted for compatibility: ckptturbo always reads byte ranges
# safetensors maps a bare accelerator name to its device 0 (torch would take the current one)
_INDEXED_DEVICES = ("cuda", "npu", "xpu", "xla", "mlu", "musa", "hpu")


class SafeOpenFormatError(FormatError, SafetensorError):
    """A file, dtype or argument ``safe_open`` cannot serve (also a ``SafetensorError``)."""


class TensorNotFoundError(MismatchError, SafetensorError):
    """The file has no tensor of that name (safetensors raises ``SafetensorError``)."""


class SliceIndexError(MismatchError, IndexError, TypeError, SafetensorError):
    """An index ``get_slice(...)[index]`` cannot apply: safetensors raises torch's
    ``IndexError``/``ValueError``/``TypeError`` (framework "pt") or ``SafetensorError``
    (framework "np"), so this is each of them."""


class HandleClosedError(CkptTurboError, SafetensorError):
    """The handle was used after ``close()`` or the end of its ``with`` block."""


@contextmanager
def _as_safetensors_error() -> Iterator[None]:
    """Give a ckptturbo FormatError the SafetensorError base that callers catch."""
    try:
        yield
    except FormatError as exc:
        if isinstance(exc, SafetensorError):
            raise
        raise SafeOpenFormatError(str(exc)) from exc


class TensorSlice:
    """Lazy view of one tensor, like safetensors' PySafeSlice: indexing along dim 0 fetches
    only the rows asked for (one ranged read); other dims are indexed after the fetch.

    Framework "pt" indexes like torch (as safetensors' default backend does); framework
    "numpy" takes ints, slices and an empty list, with safetensors' errors for the rest.
    """

    def __init__(self, owner: SafeOpen, info: TensorInfo) -> None:
        self._owner = owner
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    def __getitem__(self, index: Any) -> Any:
        owner, info = self._owner, self._info
        if owner.framework == "numpy":
            index = _numpy_index(index, info, owner.name)
        try:
            out = self._select(index)
        except (IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, CkptTurboError):
                raise
            raise SliceIndexError(f"{owner.name}: tensor {info.name!r} of shape "
                                  f"{list(info.shape)}: cannot index with {index!r}: {exc}"
                                  ) from exc
        return owner._deliver(out, info)

    def _select(self, index: Any) -> torch.Tensor:
        info, owner = self._info, self._owner
        idx = index if isinstance(index, tuple) else (index,)
        first = idx[0] if idx else None
        if not info.shape or not isinstance(first, (int, slice)) or isinstance(first, bool):
            return owner._typed(owner._read(info.start, info.end), info)[index]
        rows = owner._layout(info)[1][0]
        row_bytes = info.nbytes // rows if rows else 0
        lead: int | slice  # indexes dim 0 of the rows read: the one row, or the slice's step
        if isinstance(first, int):
            i = first + rows if first < 0 else first
            if not 0 <= i < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 of size {rows}")
            start, stop, lead = i, i + 1, 0
        else:
            start, stop, step = first.indices(rows)
            if step < 1:
                raise ValueError("step must be greater than zero")
            stop = max(start, stop)
            lead = slice(None, None, step)
        raw = owner._read(info.start + start * row_bytes, info.start + stop * row_bytes)
        part = owner._typed(raw, info, rows=stop - start)
        key = (lead, *idx[1:])
        out = part[key]
        if out.numel() < part.numel():
            out = out.clone()  # do not pin the rows that were fetched but not asked for
        return out


def _numpy_index(index: Any, info: TensorInfo, name: str) -> Any:
    """safetensors' numpy slicing rules and messages (its Rust slicer): ints (negative
    from the end), slices, or an empty list; bounds are checked, not clipped. The
    message is safetensors' word for word (callers match on it); the file and tensor
    are added as a note."""
    def fail(message: str) -> SliceIndexError:
        exc = SliceIndexError(message)
        exc.add_note(f"while slicing tensor {info.name!r} of {name}")
        return exc

    if isinstance(index, list):
        if index:
            raise fail("Non empty lists are not implemented")
        index = slice(0, 0)
    items = index if isinstance(index, tuple) else (index,)
    shown, out_of_range = [], None
    for dim, (item, size) in enumerate(zip(items, info.shape, strict=False)):  # may be fewer
        if isinstance(item, slice):
            shown.append(f"{'' if item.start is None else item.start}:"
                         f"{'' if item.stop is None else item.stop}")
            begin = item.start or 0
            stop = size if item.stop is None else item.stop
            if stop > size:
                out_of_range = dim, begin if begin >= size else stop - 1, size
        elif isinstance(item, int) and not isinstance(item, bool):
            i = item + size if item < 0 else item
            if i < 0:
                raise fail(f"Invalid index {item} for dimension {dim} of size {size}")
            shown.append(str(i))
            if i >= size:
                out_of_range = dim, i, size
        else:
            raise fail(f"index {item!r} is not an int or a slice")
    if out_of_range is not None:  # the slicer walks dims from the last: the last fault wins
        dim, asked, size = out_of_range
        raise fail(f"Error during slicing [{', '.join(shown)}] with shape {list(info.shape)}: "
                   f"index {asked} out of bounds for tensor dimension #{dim} of size {size}")
    return index


class SafeOpen:
    """Drop-in for ``safetensors.safe_open`` on any fsspec URL: fetches only what is asked.

    Opening fetches the header (one ranged GET, two for headers over 1 MiB); each
    ``get_tensor`` is one ranged GET (parallel GETs of ``chunk_size`` for large tensors);
    ``get_tensors`` reads the whole data section that way; ``get_slice(name)[a:b]``
    fetches only rows a..b. Small tensors inside the first GET are served from its bytes.

    Opening makes the HEAD and the header GET at once. Remote files are read ahead once
    the ``get_tensor`` calls follow ``keys()`` or the file's order (the first call is the
    first name, or two calls are neighbours): that tensor and the following ones are
    fetched in that order in large ranges, ``streams`` GETs at a time within
    ``memory_limit`` (see :mod:`.readahead`), so ``for k in f.keys(): f.get_tensor(k)``
    streams. A call out of that order stops it. For a shard named
    ``NAME-00001-of-00004.safetensors`` the next shards are then opened and read ahead
    too, within the same ``memory_limit``, for the ``safe_open`` that follows (see
    :mod:`.nextfile`). ``read_ahead=False`` does neither.
    """

    def __init__(self, filename: str | os.PathLike[str], framework: str = "pt",
                 device: str | int | torch.device | None = "cpu",
                 storage_options: dict[str, Any] | None = None, *, backend: str = "mmap",
                 chunk_size: int = 32 * MiB, streams: int = 16,
                 max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                 memory_limit: int = 1 << 30, read_ahead: bool = True) -> None:
        self.name = os.fsdecode(os.fspath(filename))
        self.framework = _framework(framework, self.name)
        if backend not in BACKENDS:
            raise SafeOpenFormatError(f"{self.name}: backend {backend!r} is invalid "
                                      f"(expected one of: {', '.join(map(repr, BACKENDS))})")
        self.device = _device(device, self.framework, self.name)
        self.chunk_size = chunk_size
        self.streams = streams
        self.memory_limit = memory_limit
        self._closed = False
        self._calls: list[str] | None = [] if read_ahead else None  # until an order is known
        self._ahead: ReadAhead | None = None
        self._budget = MemoryBudget(memory_limit)
        self._storage_options = storage_options
        self._settings = HandleSettings(chunk_size, streams, max_header_size, memory_limit,
                                        pinned=self.device.type == "cuda")
        self._next: NextFile | None = None  # the next shard, opened ahead by this handle
        self._next_tried = False
        self._order_of: Callable[[Header], list[str]] = _sorted_names  # the order the calls follow
        self._adopted: tuple[list[str], ReadAhead | None] | None = None  # from the one before
        with _as_safetensors_error():
            refuse_pickle_name(self.name)
        adopted = claim(self.name, self._settings, storage_options) if read_ahead else None
        if adopted is not None:
            assert adopted.file is not None
            self._source, self._file, self._budget = adopted.source, adopted.file, adopted.budget
            self._adopted = adopted.order, adopted.ahead
            self._next, self._next_tried = adopted.next, adopted.next_tried
        else:
            self._source = ByteSource(open_store(self.name, storage_options, streams), None,
                                      part_helpers=streams)
            try:
                with _as_safetensors_error():
                    self._file = open_file(self._source, max_header_size)
            except CheckpointNotFound as exc:  # safetensors' words: callers match on them
                self._source.close()
                raise CheckpointNotFound(f"No such file or directory: {self.name}") from exc
            except BaseException:
                self._source.close()
                raise
        self._entry = self._file.entry

    def _header(self) -> Header:
        if self._closed:
            raise HandleClosedError(f"{self.name}: File is closed (the safe_open handle was used "
                                    "after close() or the end of its with block)")
        return self._file.header

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return _sorted_names(self._header())

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their bytes in the file."""
        return _offset_names(self._header())

    def metadata(self) -> dict[str, str] | None:
        metadata = self._header().metadata
        return None if metadata is None else dict(metadata)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._header().by_name[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.name}: File does not contain tensor {name!r}"
                                      ) from None

    def get_tensor(self, name: str) -> Any:
        info = self._info(name)
        raw = self._ahead_read(info)
        if raw is None:
            raw = self._read(info.start, info.end)
        return self._deliver(self._typed(raw, info), info)

    def _ahead_read(self, info: TensorInfo) -> torch.Tensor | None:
        """The tensor's bytes from the read-ahead, starting it once the calls show an order.
        (Tensors inside the header GET's bytes are served from them, outside any order.)"""
        if self._ahead is not None:
            slot = self._ahead.position(info.name)
            if slot is not None:
                return self._take(slot)
            if not self._file.in_tail(info.end):
                log.debug("%s: %r is out of the read-ahead's order: reading per call",
                          self.name, info.name)
                self._stop_ahead()
                self._calls = None
            return None
        if self._calls is None or (self._source.store.is_local and not self._settings.pinned):
            return None  # a local file on the CPU is read per call: the page cache is ahead
        self._calls.append(info.name)
        guess = guess_order(self._calls, [self.keys(), self.offset_keys()])
        if guess is None:
            if len(self._calls) >= 2:
                self._calls = None  # no order to follow
                self._drop_adopted()
            return None
        self._calls = None
        self._order_of, order = _ORDERS[guess[0]], guess[1]
        if self._adopted is not None and self._adopted[0] == order:
            self._ahead = self._adopted[1]
            self._adopted = None
        else:
            self._drop_adopted()
            self._ahead = start_read_ahead(self._file, order, self._source, self._budget,
                                           self.chunk_size, self.streams, shard_count(self.name),
                                           pinned=self._settings.pinned)
        slot = None if self._ahead is None else self._ahead.position(info.name)
        return None if slot is None else self._take(slot)

    def _take(self, slot: int) -> torch.Tensor:
        """Tensor ``slot`` of the read-ahead. Once all its reads have gone out (before
        waiting: requests free up from then on), the next shard is opened ahead (see
        :mod:`.nextfile`); after the take, it may issue what the released bytes allow."""
        assert self._ahead is not None
        if not self._next_tried and self._ahead.issued_all:
            self._next_tried = True
            self._next = start_next(self.name, self._settings, self._storage_options,
                                    self._budget, self._order_of)
        raw = self._ahead.take(slot)
        if self._next is not None:
            self._next.pump()
        return raw

    def _drop_adopted(self) -> None:
        if self._adopted is not None and self._adopted[1] is not None:
            self._adopted[1].close()
        self._adopted = None

    def _stop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor, in file order, from one read of the data section (on CPU the
        tensors share its buffer, as safetensors' share the file's memory map)."""
        header = self._header()
        if not header.tensors:
            return {}
        raw = self._read(header.data_start, header.tensors[-1].end)
        return {t.name: self._deliver(self._typed(raw[t.start - header.data_start:
                                                      t.end - header.data_start], t), t)
                for t in header.tensors}

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._info(name))

    def _read(self, start: int, end: int) -> torch.Tensor:
        """Bytes [start, end) of the file as a fresh uint8 tensor (pinned when bound for a GPU)."""
        buf = (DeviceCopier.landing(end - start) if self._settings.pinned
               else torch.empty(end - start, dtype=torch.uint8))
        out = buf.numpy()
        f = self._file
        if self._file.in_tail(end):
            assert f.tail is not None  # in_tail: the tail is kept
            lo = start - f.header.data_start
            out[:] = np.frombuffer(f.tail, dtype=np.uint8, count=end - start, offset=lo)
            return buf

        def piece(a: int) -> None:
            b = min(end, a + self.chunk_size)
            out[a - start:b - start] = np.frombuffer(
                self._source.get(self._entry, a, b, cacheable=False), np.uint8)

        pieces = range(start, end, self.chunk_size)
        if len(pieces) > 1:
            self._source.store.map(piece, pieces)
        elif pieces:
            piece(start)  # one GET: no hop to the session's I/O threads
        return buf

    def _layout(self, info: TensorInfo) -> tuple[torch.dtype, tuple[int, ...]]:
        with _as_safetensors_error():
            return torch_layout(info.dtype, info.shape, f"{self.name}: tensor {info.name!r}")

    def _typed(self, raw: torch.Tensor, info: TensorInfo, rows: int | None = None) -> torch.Tensor:
        """The uint8 bytes of a tensor (or of ``rows`` of its first dim) as its torch tensor."""
        dtype, shape = self._layout(info)
        if rows is not None:
            shape = (rows, *shape[1:])
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()  # a view as a wider dtype needs an aligned start
        return raw.view(dtype).reshape(shape)

    def _deliver(self, tensor: torch.Tensor, info: TensorInfo) -> Any:
        if self.framework == "pt":  # from pinned memory the copy runs on the caller's stream
            non_blocking = self.device.type == "cuda" and tensor.is_pinned()
            return tensor.to(self.device, non_blocking=non_blocking)
        try:
            return tensor.numpy()
        except TypeError as exc:
            raise SafeOpenFormatError(f"{self.name}: tensor {info.name!r}: dtype {info.dtype} has "
                                      "no numpy equivalent; open the file with framework='pt'"
                                      ) from exc

    @property
    def stats(self) -> dict[str, int]:
        return self._source.counters()

    def close(self) -> None:
        self._closed = True
        self._stop_ahead()
        self._drop_adopted()
        self._source.close()
        if self._next is not None:
            self._next.orphan()
            self._next = None

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _sorted_names(header: Header) -> list[str]:
    return sorted(header.by_name)


def _offset_names(header: Header) -> list[str]:
    return [t.name for t in header.tensors]


_ORDERS = (_sorted_names, _offset_names)  # the orders calls are followed in: keys(), offset_keys()


def _framework(framework: str, name: str) -> str:
    if framework in FRAMEWORKS:
        return FRAMEWORKS[framework]
    if framework in OTHER_FRAMEWORKS:
        raise SafeOpenFormatError(f"{name}: framework {framework!r} is not supported by "
                                  "ckptturbo.safe_open; use 'pt' or 'numpy'")
    raise SafeOpenFormatError(f"{name}: framework {framework!r} is invalid")


def _device(device: str | int | torch.device | None, framework: str, name: str) -> torch.device:
    """safetensors' ``device``: None or "cpu", an accelerator name with or without an
    index ("cuda" meaning cuda:0), an accelerator index (int); also a torch.device."""
    if device is None:
        device = "cpu"
    if isinstance(device, str) and device in _INDEXED_DEVICES:
        device += ":0"
    try:
        if isinstance(device, bool):
            raise TypeError("a bool is not a device")
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SafeOpenFormatError(f"{name}: device {device!r} is invalid: {exc}") from exc
    if framework != "pt" and parsed.type != "cpu":
        raise SafeOpenFormatError(f"{name}: device {device!r} is not supported for framework "
                                  f"{framework!r} (only 'pt' moves tensors to a device)")
    return parsed


def safe_open(filename: str | os.PathLike[str], framework: str = "pt",
              device: str | int | torch.device | None = "cpu",
              storage_options: dict[str, Any] | None = None, **kwargs: Any) -> SafeOpen:
    """Open one safetensors file at a path, ``os.PathLike`` or URL, like
    ``safetensors.safe_open``."""
    return SafeOpen(filename, framework, device, storage_options, **kwargs)
