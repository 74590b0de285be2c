"""``safe_open`` for any fsspec URL: safetensors' lazy file API, fetching only what is asked."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import FormatError, MismatchError
from .format import DEFAULT_MAX_HEADER_SIZE, TensorInfo, refuse_pickle_name, torch_dtype
from .headers import HEADER_PROBE, fetch_header
from .source import ByteSource, FileEntry, open_store

MiB = 1 << 20


class TensorSlice:
    """Lazy view of one tensor, like safetensors' PySafeSlice: indexing along dim 0 fetches
    only the rows asked for (one ranged read); other dims are indexed after the fetch."""

    def __init__(self, owner: SafeOpen, info: TensorInfo) -> None:
        self._owner = owner
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        info, owner = self._info, self._owner
        idx = index if isinstance(index, tuple) else (index,)
        first = idx[0] if idx else Ellipsis
        if not info.shape or first is Ellipsis or not isinstance(first, (int, slice)) \
                or isinstance(first, bool):
            full = owner.get_tensor(info.name)
            return full[index] if idx and idx != (Ellipsis,) else full
        rows = info.shape[0]
        row_bytes = info.nbytes // rows if rows else 0
        if isinstance(first, int):
            i = first + rows if first < 0 else first
            if not 0 <= i < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 of size {rows}")
            start, stop, lead = i, i + 1, 0
        else:
            start, stop, step = first.indices(rows)
            if step < 1:
                raise ValueError("get_slice supports only positive steps along dimension 0")
            stop = max(start, stop)
            lead = slice(None, None, step)
        rows_tensor = owner._load(info, info.start + start * row_bytes, info.start + stop * row_bytes,
                                  (stop - start, *info.shape[1:]))
        out = rows_tensor[(lead, *idx[1:])]
        if out.numel() < rows_tensor.numel():
            out = out.clone()  # do not pin the rows that were fetched but not asked for
        return out.to(owner.device)


class SafeOpen:
    """Drop-in for ``safetensors.safe_open`` on any fsspec URL: fetches only what is asked.

    Opening fetches the header (one ranged GET, two for headers over 1 MiB); each
    ``get_tensor`` is one ranged GET (parallel GETs of ``chunk_size`` for large tensors);
    ``get_slice(name)[a:b]`` fetches only rows a..b. Small tensors inside the first GET
    are served from its bytes.
    """

    def __init__(self, url: str, framework: str = "pt", device: str | torch.device = "cpu",
                 storage_options: dict[str, Any] | None = None, *, chunk_size: int = 32 * MiB,
                 streams: int = 16, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        if framework not in ("pt", "torch"):
            raise FormatError(f"framework {framework!r} is not supported; use 'pt'")
        refuse_pickle_name(url)
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        self._source = ByteSource(open_store(url, storage_options, streams), None)
        try:
            store = self._source.store
            info = store.info(store.root)
            entry = FileEntry(info.path, info.size, info.mtime)
            self._source.register([entry])
            self._file = fetch_header(self._source, entry, HEADER_PROBE, max_header_size)
        except BaseException:
            self._source.close()
            raise
        self._entry = entry

    def keys(self) -> list[str]:
        return sorted(self._file.header.by_name)

    def offset_keys(self) -> list[str]:
        return [t.name for t in self._file.header.tensors]

    def metadata(self) -> dict[str, str] | None:
        return self._file.header.metadata

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._file.header.by_name[name]
        except KeyError:
            raise MismatchError(f"{self._source.url_of(self._entry)} has no tensor {name!r}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        return self._load(info, info.start, info.end, info.shape).to(self.device)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._info(name))

    def _load(self, info: TensorInfo, start: int, end: int, shape: Sequence[int]) -> torch.Tensor:
        buf = torch.empty(end - start, dtype=torch.uint8)
        out = buf.numpy()
        f = self._file
        if f.tail is not None and end <= f.probe_end:
            lo = start - f.header.data_start
            out[:] = np.frombuffer(f.tail, dtype=np.uint8, count=end - start, offset=lo)
        elif end > start:
            def piece(a: int) -> None:
                b = min(end, a + self.chunk_size)
                out[a - start:b - start] = np.frombuffer(self._source.get(self._entry, a, b,
                                                                          cacheable=False), np.uint8)
            self._source.store.map(piece, range(start, end, self.chunk_size))
        return buf.view(torch_dtype(info.dtype, self._source.url_of(self._entry))).reshape(tuple(shape))

    @property
    def stats(self) -> dict[str, int]:
        return self._source.counters()

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def safe_open(url: str, framework: str = "pt", device: str | torch.device = "cpu",
              storage_options: dict[str, Any] | None = None, **kwargs: Any) -> SafeOpen:
    """Open one safetensors file at a URL or path, like ``safetensors.safe_open``."""
    return SafeOpen(url, framework, device, storage_options, **kwargs)
