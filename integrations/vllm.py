"""vLLM model loader ``--load-format ckptturbo``: weights streamed from an object store.

vLLM only lets an ``s3://`` ``--model`` load through its own streamer formats, so the
model directory stays local (config, tokenizer) and the weights URL comes in
``--model-loader-extra-config``::

    vllm serve ./my-model-config --load-format ckptturbo \\
        --model-loader-extra-config '{"url": "s3://bucket/model/", "storage_options": {...},
                                      "memory_limit": 2147483648,
                                      "cache_dir": "/local/nvme/ckptturbo"}'

The URL holds either safetensors (one file, or a directory with or without
``model.safetensors.index.json``) or a ckptturbo checkpoint (a ``manifest.json``); the
stream's own listing tells them apart (no second client, no probe). Every tensor-parallel
worker iterates the whole checkpoint and each parameter's ``weight_loader`` keeps its own
slice, so the workers read storage once between them: the stream runs over the gloo
``cpu_group`` vLLM's tensor-parallel ``GroupCoordinator`` already has, one worker fetches
each byte range and forwards it to the others.

The weights are opened when vLLM asks the loader for the model, before vLLM builds it:
alone, listing, headers and the first reads run on a thread of their own while the model
is built; with tensor-parallel peers, listing and headers are read collectively first and
the reads start when the weights are consumed (the peers' gloo group must not carry two
conversations at once). Tensors come as views of the bytes read (``views=True``), so the
weight loader's copy into the parameter is the only copy of each byte.

The loader, and the weight-transfer backend ``ckptturbo`` of
:mod:`ckptturbo.integrations.vllm_updates` (live updates to a new checkpoint), are
registered by :func:`register`, the entry point of the group ``vllm.general_plugins``
(vLLM calls it in the engine and in every worker process). A model loaded from a ckptturbo
checkpoint keeps the content keys of its tensors (:class:`ServedWeights`), so that its
first update reads only what changed.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

import ckptturbo as ct
from ckptturbo.errors import CheckpointKindError, CkptTurboError, MismatchError
from ckptturbo.stream import SafetensorsStream

from .vllm_shared import share

log = logging.getLogger(__name__)

LOAD_FORMAT = "ckptturbo"
WEIGHT_TRANSFER_BACKEND = "ckptturbo"
DEFAULT_MEMORY_LIMIT = 2 << 30
SERVED_ATTRIBUTE = "_ckptturbo_served"
_registered = False


@dataclass
class ServedWeights:
    """What a worker's model serves: the checkpoint's URL, the content key of each of its
    tensors (``ct.tensor_versions``, what an update compares with the new manifest) and a
    host copy of the tensors as the checkpoint holds them (what an update reloads the
    layers it changes from, and puts back when a swap fails). Kept on the model object,
    the one thing vLLM hands both to the loader and to a worker's weight-transfer engine.
    Empty: the model was loaded some other way, nothing of it is known."""

    url: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)

    def keys_for(self, versions: dict[str, str]) -> dict[str, str]:
        """The served keys of the tensors the new checkpoint has."""
        return {name: self.versions[name] for name in versions if name in self.versions}

    def remember(self, model: nn.Module, url: str, versions: dict[str, str] | None,
                 tensors: dict[str, torch.Tensor]) -> None:
        """The model now serves ``url``, whose changed ``tensors`` were loaded. With no
        keys (safetensors) no tensor can be compared any more: the next update reads all."""
        if versions is None:
            self.versions.clear()
        else:
            self.versions = {name: key for name, key in versions.items()
                             if name in tensors or self.versions.get(name) == key}
        self.host.update(tensors)
        self.url = url
        setattr(model, SERVED_ATTRIBUTE, self)


def served_weights(model: nn.Module) -> ServedWeights:
    """What ``model`` serves (an empty record for a model loaded without ckptturbo)."""
    served = getattr(model, SERVED_ATTRIBUTE, None)
    return served if isinstance(served, ServedWeights) else ServedWeights()


@dataclass(frozen=True)
class LoaderOptions:
    """``--model-loader-extra-config`` of the ckptturbo load format, checked up front."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    lookahead: int | None = None
    memory_limit: int | None = None
    cache_dir: str | None = None

    @classmethod
    def parse(cls, extra: Any) -> LoaderOptions:
        extra = dict(extra or {})
        unknown = set(extra) - {"url", "storage_options", "lookahead", "memory_limit", "cache_dir"}
        if unknown:
            raise CkptTurboError(f"--model-loader-extra-config for load format {LOAD_FORMAT!r} has "
                                 f"unknown keys {sorted(unknown)}")
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise CkptTurboError(f"load format {LOAD_FORMAT!r} needs the weights' URL: "
                                 "--model-loader-extra-config '{\"url\": \"s3://bucket/model/\"}'")
        for key in ("lookahead", "memory_limit"):
            value = extra.get(key)
            positive = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if value is not None and not positive:
                raise CkptTurboError(f"{LOAD_FORMAT} extra config {key!r} must be a positive "
                                     f"integer, got {value!r}")
        options = extra.get("storage_options") or {}
        if not isinstance(options, dict):
            raise CkptTurboError(f"{LOAD_FORMAT} extra config 'storage_options' must be an object")
        return cls(url, options, extra.get("lookahead"), extra.get("memory_limit"),
                   extra.get("cache_dir"))


def tensor_parallel_group() -> Any:
    """vLLM's gloo group over this worker's tensor-parallel peers, or None when alone."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    tp = parallel_state.get_tp_group()
    return tp.cpu_group if tp.world_size > 1 else None


class Weights:
    """The weights at the URL, opened: a safetensors stream whose listing and headers are
    read (``kind == "safetensors"``), or a ckptturbo checkpoint (``kind == "checkpoint"``),
    told apart by the stream's listing. Iterate once; ``close()`` frees what is held."""

    def __init__(self, options: LoaderOptions, process_group: Any = None) -> None:
        self.options = options
        self.process_group = process_group
        self.stream: SafetensorsStream | None = None
        try:
            self.stream = ct.stream_safetensors(
                options.url, device="cpu", lookahead=options.lookahead,
                memory_limit=options.memory_limit, storage_options=options.storage_options,
                process_group=process_group, cache_dir=options.cache_dir, views=True)
            self.kind = "safetensors"
        except CheckpointKindError:
            self.kind = "checkpoint"

    def start(self) -> Weights:
        """Start reading now (see :meth:`ckptturbo.stream.SafetensorsStream.start`)."""
        if self.stream is not None:
            self.stream.start()
        return self

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.stream is None:
            return checkpoint_weights(self.options, self.process_group)
        return iter(self.stream)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def checkpoint_weights(options: LoaderOptions,
                       process_group: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a ckptturbo checkpoint, in batches of at most ``memory_limit`` bytes.

    Each batch is one grouped load: every chunk is read from storage by one worker of
    ``process_group`` and forwarded to the others. Non-tensor entries are skipped.
    """
    meta = ct.TurboReader(options.url, options.storage_options).read_metadata()
    limit = options.memory_limit or DEFAULT_MEMORY_LIMIT
    batch: dict[str, torch.Tensor] = {}
    held = 0
    for name, item in meta.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        tensor = torch.empty(item.size, dtype=item.properties.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if batch and held + nbytes > limit:
            yield from _load_batch(batch, options, process_group)
            batch, held = {}, 0
        batch[name] = tensor
        held += nbytes
    if batch:
        yield from _load_batch(batch, options, process_group)


def _load_batch(batch: dict[str, torch.Tensor], options: LoaderOptions,
                process_group: Any) -> Iterator[tuple[str, torch.Tensor]]:
    ct.load(batch, options.url, process_group=process_group,
            storage_options=options.storage_options, strict=False, cache_dir=options.cache_dir)
    yield from batch.items()


def weights(options: LoaderOptions,
            process_group: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from the URL, whichever of the two kinds it holds."""
    return iter(Weights(options, process_group).start())


class _Opening:
    """Opens the weights on a thread of its own, while vLLM builds the model."""

    def __init__(self, options: LoaderOptions) -> None:
        self._result: Weights | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(options,), daemon=True,
                                        name="ckptturbo-vllm-open")
        self._thread.start()

    def _run(self, options: LoaderOptions) -> None:
        try:
            self._result = Weights(options).start()
        except BaseException as exc:  # noqa: BLE001 - raised in the thread that waits
            self._result = exc

    def result(self) -> Weights:
        self._thread.join()
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result


class CkptTurboModelLoader(BaseModelLoader):
    """``load_format="ckptturbo"``: vLLM's model gets its weights from ckptturbo."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = LoaderOptions.parse(load_config.model_loader_extra_config)
        self._opening: _Opening | Weights | None = None
        self._keep_copy = False  # for live updates (weight-transfer backend "ckptturbo")

    def download_model(self, model_config: Any) -> None:
        """Fill the local cache tier (``cache_dir``) so the next load makes no request."""
        if not self.options.cache_dir:
            return
        opened = Weights(self.options)
        try:
            if opened.kind == "safetensors":
                for _ in opened:
                    pass
        finally:
            opened.close()

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        """Open the weights (listing, headers, first reads) before vLLM builds the model,
        then let vLLM build it and call :meth:`load_weights`."""
        transfer = getattr(vllm_config, "weight_transfer_config", None)
        self._keep_copy = getattr(transfer, "backend", None) == WEIGHT_TRANSFER_BACKEND
        group = tensor_parallel_group()
        self._opening = _Opening(self.options) if group is None else Weights(self.options, group)
        try:
            return super().load_model(vllm_config, model_config, prefix)
        finally:
            opening, self._opening = self._opening, None
            if opening is not None:  # load_weights never ran (building the model failed)
                with contextlib.suppress(Exception):
                    (opening.result() if isinstance(opening, _Opening) else opening).close()

    def _weights(self) -> Weights:
        opening, self._opening = self._opening, None
        if isinstance(opening, _Opening):
            return opening.result()
        if opening is not None:
            return opening.start()
        return Weights(self.options, tensor_parallel_group()).start()  # load_weights alone

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        started = time.perf_counter()
        opened = self._weights()
        stream = iter(opened)
        count = 0
        kept: dict[str, torch.Tensor] = {}

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in stream:
                count += 1
                if self._keep_copy:  # the stream's own buffers: no copy is made
                    kept[name] = tensor
                yield name, tensor

        try:
            loaded = cast(_LoadsWeights, model).load_weights(counted())
            # Every worker of the group must consume the whole stream, or its peers wait forever.
            for _ in stream:
                count += 1
        finally:
            opened.close()
        log.info("ckptturbo loaded %d tensors from %s in %.2fs", count, self.options.url,
                 time.perf_counter() - started)
        if self._keep_copy:
            versions = None
            if opened.kind == "checkpoint":
                versions = {name: v.key for name, v in
                            ct.tensor_versions(self.options.url,
                                                 storage_options=self.options.storage_options)
                            .items()}
            ServedWeights().remember(model, self.options.url, versions,
                                     share(kept, tensor_parallel_group()))
        if loaded is not None and model_config.quantization is None:
            missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
            if missing:
                raise MismatchError(f"{self.options.url} has no weights for {len(missing)} "
                                    f"parameter(s) of the model, e.g. {missing[:5]}")


class _LoadsWeights(Protocol):
    """What vLLM asks of every model class it builds: loading its own (name, tensor) pairs
    and answering the names it loaded (None from models that do not say)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str] | None:
        ...


def register() -> None:
    """Entry point (``vllm.general_plugins``): register the ``ckptturbo`` load format and
    weight-transfer backend once (the backend's module is imported when an engine uses it)."""
    global _registered
    if not _registered:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        register_model_loader(LOAD_FORMAT)(CkptTurboModelLoader)
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND, "ckptturbo.integrations.vllm_updates",
            "CkptTurboWeightTransferEngine")
        _registered = True


def update_weights(llm: Any, url: str, *, storage_options: dict[str, Any] | None = None,
                   memory_limit: int | None = None, cache_dir: str | None = None,
                   weight_version: str | None = None) -> None:
    """Move an offline ``vllm.LLM`` (started with ``weight_transfer_config={"backend":
    "ckptturbo"}``) to the checkpoint at ``url``: start, update, finish, with the weight
    version ``weight_version`` or else ``url`` (vLLM keeps the old version when none is
    named). ``cache_dir``: the node's cache tier, shared with the node's other engines. A
    failure raises and leaves the previous weights and version serving."""
    info: dict[str, Any] = {"url": url}
    if storage_options is not None:
        info["storage_options"] = storage_options
    if memory_limit is not None:
        info["memory_limit"] = memory_limit
    if cache_dir is not None:
        info["cache_dir"] = cache_dir
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": info})
    except BaseException:
        with contextlib.suppress(Exception):  # the update ended the session on every worker
            llm.finish_weight_update()
        raise
    llm.finish_weight_update(weight_version=weight_version or url)
