"""Live weight updates: a running vLLM engine moves to a new checkpoint in storage.

vLLM's weight-transfer API (``LLM.start_weight_update / update_weights /
finish_weight_update`` offline, the same names as HTTP routes on ``vllm serve``) takes a
backend registered with ``WeightTransferEngineFactory``; :func:`ckptturbo.integrations.
vllm.register` registers this one as ``"ckptturbo"``. Start the engine with
``weight_transfer_config={"backend": "ckptturbo"}`` and send
``{"update_info": {"url": "s3://bucket/run/step-200"}}``.

Only what changed is read. Each worker remembers what it serves
(:class:`~ckptturbo.integrations.vllm.ServedWeights`, left on the model by the ``ckptturbo``
load format and by every update): the content key of every tensor and a host copy of the
tensors as the checkpoint holds them. ``ct.load_changes`` compares the keys with the new
checkpoint's manifest before a byte is read: equal tensors are skipped, tensors saved as
deltas of the version served arrive as their changed elements only (applied to the host
copy, bit-exact), the rest arrive whole; every chunk is verified, and over the
tensor-parallel ``cpu_group`` each is read from storage once and forwarded; with
``cache_dir`` (the node's cache tier) the engines of a node read each chunk once between
them. A URL of safetensors has no content keys: every tensor is read (once across the
workers).

Staged, then swapped. Nothing in the model changes until every worker has read and
verified every changed tensor and checked its name, shape and dtype against the tensors
it serves. The swap is vLLM's own layerwise reload (``initialize_layerwise_reload``,
``model.load_weights``, ``finalize_layerwise_reload``), fed the decoder layers (and
other modules) that hold a changed tensor, whole, from the host copy and the staged
tensors: the parameters' ``weight_loader`` cuts tensor-parallel slices and fuses qkv and
gate_up, and layers that repack or quantize their weights after loading (vLLM's CPU
kernels, online quantization) process them again. A swap that fails on any worker is
undone on every worker by feeding the same layers their previous tensors. Memory: the
host copy (the checkpoint's bytes, once per node: the tensor-parallel workers of a node
map one copy, :mod:`~ckptturbo.integrations.vllm_shared`) plus the changed tensors while
staged.

vLLM runs the update between two model steps, on every worker at the same boundary, so no
forward pass sees a half-written model: requests in flight are served by the old weights
up to the update and by the new ones after it (``/pause?mode=wait`` first for requests
that must see one version only).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import ckptturbo as ct
from ckptturbo.adapter_support import settle
from ckptturbo.errors import CheckpointKindError, CkptTurboError, MismatchError

from .vllm import (
    LoaderOptions,
    ServedWeights,
    Weights,
    _LoadsWeights,
    served_weights,
    tensor_parallel_group,
)
from .vllm_shared import share

log = logging.getLogger(__name__)


class UpdateFailed(CkptTurboError):
    """An update that did not happen: every worker still serves the previous weights."""


@dataclass
class UpdateDefaults(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: defaults for every update
    (optional; an update may carry its own)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    memory_limit: int | None = None
    cache_dir: str | None = None


@dataclass
class UpdateRequest(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: the checkpoint to serve from now on."""

    url: str
    storage_options: dict[str, Any] | None = None
    memory_limit: int | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"update_info needs the checkpoint's 'url', got {self.url!r}")


@dataclass
class UpdateReport:
    """What one update did on this worker (logged; kept for tests and benchmarks)."""

    url: str
    full: int = 0
    deltas: int = 0
    unchanged: int = 0
    fed: int = 0
    staged_bytes: int = 0
    seconds: float = 0.0


def layer_of(name: str) -> str:
    """The unit a checkpoint tensor is reloaded with: its decoder layer (the name up to its
    first integer segment: ``model.layers.3``), else its module. vLLM processes a layer
    once all its weights are loaded, so a layer is always fed whole; a decoder layer
    contains every fused parameter (qkv, gate_up, an MoE layer's experts) of its tensors."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name.rpartition(".")[0]


class WeightUpdate:
    """One update of one worker's model to the checkpoint at ``request.url``."""

    def __init__(self, engine: CkptTurboWeightTransferEngine, request: UpdateRequest,
                 group: Any) -> None:
        self.model = engine.model
        self.model_config = engine.model_config
        defaults = engine.defaults
        self.url = request.url
        self.storage_options = (request.storage_options if request.storage_options is not None
                                else defaults.storage_options)
        self.memory_limit = request.memory_limit or defaults.memory_limit
        self.cache_dir = request.cache_dir or defaults.cache_dir
        self.group = group
        self.report = UpdateReport(self.url)

    def run(self) -> UpdateReport:
        """Stage on every worker, swap on every worker, or raise :class:`UpdateFailed`
        with every worker serving what it served before."""
        started = time.perf_counter()
        served = served_weights(self.model)
        versions, staged = self._agreed("reading", lambda: self._stage(served))
        try:
            staged = share(staged, self.group)  # one host copy per node, not per worker
        except Exception as exc:
            raise UpdateFailed(f"weight update to {self.url} failed while staging; the "
                               f"previous weights still serve: {exc}") from exc
        affected = {layer_of(name) for name in staged}
        fresh = {**served.host, **staged}
        names = [name for name in fresh if layer_of(name) in affected]
        try:
            self._agreed("loading", lambda: self._swap([(n, fresh[n]) for n in names]))
        except UpdateFailed:
            previous = [(n, served.host[n]) for n in names if n in served.host]
            if len(previous) == len(names):
                self._swap(previous)
            raise
        served.remember(self.model, self.url, versions, staged)
        self.report.fed = len(names)
        self.report.seconds = time.perf_counter() - started
        log.info("ckptturbo weight update to %s: %s", self.url, self.report)
        return self.report

    def _agreed(self, step: str, action: Any) -> Any:
        """``action()`` here; its failure on any worker raised on every worker (only the
        outcome travels: each worker keeps its own result)."""
        try:
            return settle(self.group, f"weight update to {self.url} ({step})", action)
        except Exception as exc:
            raise UpdateFailed(f"weight update to {self.url} failed while {step}; the previous "
                               f"weights still serve: {exc}") from exc

    def _stage(self, served: ServedWeights) -> tuple[dict[str, str] | None, dict[str, Any]]:
        """Every changed tensor, read, verified and checked against the served ones."""
        versions, changes = self._changes(served)
        staged: dict[str, torch.Tensor] = {}
        redo: list[str] = []
        error: BaseException | None = None
        for change in changes:  # consumed to the end: the other workers read meanwhile
            if error is not None:
                continue
            try:
                if change.kind == "delta":
                    base = served.host.get(change.name)
                    if base is None:
                        redo.append(change.name)
                        continue
                    staged[change.name] = _apply_delta(base, change.mask, change.values)
                    self.report.deltas += 1
                else:
                    staged[change.name] = self._checked(served, change.name, change.tensor)
                    self.report.full += 1
            except Exception as exc:  # noqa: BLE001 - raised once the stream is drained
                error = exc
        if error is not None:
            raise error
        if redo:  # deltas of tensors this worker holds no copy of: the whole tensors
            for change in ct.load_changes(self.url, {}, names=redo, process_group=self.group,
                                          storage_options=self.storage_options,
                                          memory_limit=self.memory_limit,
                                          cache_dir=self.cache_dir):
                staged[change.name] = self._checked(served, change.name, change.tensor)
                self.report.full += 1
        self.report.staged_bytes = sum(t.numel() * t.element_size() for t in staged.values())
        if versions is not None:
            self.report.unchanged = len(versions) - len(staged)
        return versions, staged

    def _changes(self, served: ServedWeights) -> tuple[dict[str, str] | None, Iterable[Any]]:
        """The new checkpoint's content keys (None: safetensors, no keys) and its changes
        against what this worker serves."""
        try:
            found = ct.tensor_versions(self.url, storage_options=self.storage_options)
        except CheckpointKindError:
            options = LoaderOptions(self.url, self.storage_options or {},
                                    memory_limit=self.memory_limit, cache_dir=self.cache_dir)
            return None, (_Whole(name, tensor) for name, tensor
                          in Weights(options, self.group).start())
        for name, version in found.items():  # from the manifest, before a byte is read
            self._check(served, name, version.shape, version.dtype)
        versions = {name: version.key for name, version in found.items()}
        changes = ct.load_changes(self.url, served.keys_for(versions), process_group=self.group,
                                  storage_options=self.storage_options,
                                  memory_limit=self.memory_limit, cache_dir=self.cache_dir)
        return versions, changes

    def _checked(self, served: ServedWeights, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self._check(served, name, tuple(tensor.shape), tensor.dtype)
        return tensor

    def _check(self, served: ServedWeights, name: str, shape: tuple[int, ...],
               dtype: torch.dtype) -> None:
        """The served model has a tensor of that name, shape and dtype (any, when no host
        copy is held: a model loaded without ckptturbo)."""
        if not served.host:
            return
        old = served.host.get(name)
        if old is None:
            raise MismatchError(f"{self.url}: tensor {name!r} is not a tensor of the served "
                                f"model ({served.url})")
        if tuple(old.shape) != tuple(shape) or old.dtype != dtype:
            raise MismatchError(f"{self.url}: tensor {name!r} is {tuple(shape)} {dtype}, the "
                                f"served model's is {tuple(old.shape)} {old.dtype}")

    def _swap(self, feed: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload of the layers in ``feed``; only those are prepared for
        it (the others keep their kernel tensors untouched, and vLLM does not warn about
        each of them as a layer that failed to load)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        for module in self._modules({layer_of(name) for name, _ in feed}):
            initialize_layerwise_reload(module)
        try:
            cast(_LoadsWeights, self.model).load_weights(feed)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def _modules(self, layers: set[str]) -> list[nn.Module]:
        """The model's modules named like the checkpoint's layers (Llama-style models name
        them alike); the whole model when a name has no module of its own."""
        try:
            return [self.model.get_submodule(layer) for layer in sorted(layers)]
        except AttributeError:
            return [self.model]


def _apply_delta(base: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``base`` with the masked elements replaced (the host copy stays).
    ``masked_scatter_`` fills them in row-major order, as boolean indexing does, in a
    third of its time (a model's worth of deltas: seconds on a CPU)."""
    out = base.clone()
    out.masked_scatter_(mask.reshape(out.shape), values.to(out.dtype))
    return out


@dataclass(frozen=True)
class _Whole:
    """A tensor read whole (safetensors, which have no content keys)."""

    name: str
    tensor: torch.Tensor
    kind: str = "full"


class CkptTurboWeightTransferEngine(WeightTransferEngine[UpdateDefaults, UpdateRequest]):
    """vLLM weight-transfer backend ``"ckptturbo"``: updates come from checkpoints in
    storage; each ``update_weights`` call is one whole update, staged then swapped."""

    init_info_cls = UpdateDefaults
    update_info_cls = UpdateRequest
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.defaults = UpdateDefaults()
        self.last: UpdateReport | None = None

    def init_transfer_engine(self, init_info: UpdateDefaults) -> None:
        self.defaults = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: each update stages and swaps within ``update_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: each update is complete (or undone) when it returns."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateRequest:
        try:
            return UpdateRequest(**update_dict)
        except (TypeError, ValueError) as exc:
            raise UpdateFailed(f"weight update not started: update_info {update_dict!r} is not "
                               "{'url': ..., 'storage_options'?: {...}, 'memory_limit'?: int, "
                               "'cache_dir'?: str}: "
                               f"{exc}") from exc

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: UpdateRequest) -> None:
        self.last = WeightUpdate(self, update_info, tensor_parallel_group()).run()

    def shutdown(self) -> None:
        """No connection to release: the store is opened per update."""

