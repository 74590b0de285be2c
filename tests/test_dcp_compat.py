"""Drop-in compatibility with DCP: the scenarios of torch's own checkpoint tests, written anew.

Every scenario runs twice, once with ckptturbo's TurboWriter/TurboReader and once with
DCP's FileSystemWriter/FileSystemReader, with only the storage classes substituted, and
both must give the same result: ShardedTensor and DTensor resharding on 2 and 4 gloo
ranks, ``checkpoint_id=``, Stateful objects, conversion to a torch.save file, a DDP
train-state round trip whose state holds an ``io.BytesIO``, ``overwrite=``, dtype casts.
The few deliberate differences (objects that need full unpickling, ids without a parent)
are tested for ckptturbo alone, each with its reason.
"""
from __future__ import annotations

import io
import os
import pathlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import ckptturbo as ct
from ckptturbo.errors import CheckpointExists
from ckptturbo.testing.launcher import run_distributed

KINDS = ("turbo", "dcp")

# DCP warns on every call without a process group and on every overwrite; neither is a finding
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")]


def writer(kind: str, url: str, **options):
    return ct.TurboWriter(url, **options) if kind == "turbo" else FileSystemWriter(url, **options)


def reader(kind: str, url: str):
    return ct.TurboReader(url) if kind == "turbo" else FileSystemReader(url)


def failures(exc: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def ckpt(tmp_path: pathlib.Path, name: str = "step-1") -> str:
    return str(tmp_path / "run" / name)


# --- one process ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_id_picks_the_location(kind, tmp_path):
    w = writer(kind, ckpt(tmp_path, "unused"))
    for step in (1, 2):  # one writer, reset to each checkpoint_id in turn
        dcp.save({"w": torch.full((5,), float(step))}, checkpoint_id=ckpt(tmp_path, f"s{step}"),
                 storage_writer=w)
    r = reader(kind, ckpt(tmp_path, "unused"))
    for step in (2, 1):
        out = {"w": torch.zeros(5)}
        dcp.load(out, checkpoint_id=ckpt(tmp_path, f"s{step}"), storage_reader=r)
        assert torch.equal(out["w"], torch.full((5,), float(step)))
    assert not os.path.exists(ckpt(tmp_path, "unused"))


class TrainProgress(Stateful):
    """A Stateful as trainers write them: tensors, plain values and a torch.save'd blob."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step, self.losses = step, list(losses or [])

    def state_dict(self) -> dict:
        blob = io.BytesIO()
        torch.save(self.losses, blob)
        return {"step": self.step, "ema": torch.tensor([float(self.step) / 3]), "losses": blob}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        blob = state_dict["losses"]
        blob.seek(0)
        self.losses = torch.load(blob)
        assert torch.equal(state_dict["ema"], torch.tensor([float(self.step) / 3]))


class ModelAndOptim(Stateful):
    """The Stateful of DCP's tutorial: model and optimizer through get/set_state_dict."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _trained(seed: int, steps: int, model: torch.nn.Module | None = None, optim=None):
    torch.manual_seed(seed)
    model = model or torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 3))
    optim = optim or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 12)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return model, optim, losses


@pytest.mark.parametrize("kind", KINDS)
def test_stateful_objects_round_trip(kind, tmp_path):
    model, optim, losses = _trained(0, 3)
    url = ckpt(tmp_path)
    dcp.save({"app": ModelAndOptim(model, optim), "progress": TrainProgress(3, losses)},
             storage_writer=writer(kind, url))
    fresh, fresh_optim, _ = _trained(99, 1)
    progress = TrainProgress()
    dcp.load({"app": ModelAndOptim(fresh, fresh_optim), "progress": progress},
             storage_reader=reader(kind, url))
    assert progress.step == 3 and progress.losses == losses
    pairs = zip(model.state_dict().items(), fresh.state_dict().values(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name
    # the restored optimizer continues exactly as the original would have
    _, _, expected = _trained(5, 2, model, optim)
    _, _, resumed = _trained(5, 2, fresh, fresh_optim)
    assert resumed == expected


@pytest.mark.parametrize("kind", KINDS)
def test_overwrite_true_replaces_false_refuses(kind, tmp_path):
    url = ckpt(tmp_path)
    dcp.save({"w": torch.ones(6)}, storage_writer=writer(kind, url))
    dcp.save({"w": torch.full((6,), 2.0)}, storage_writer=writer(kind, url))  # default: True
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.full((6,), 3.0)}, storage_writer=writer(kind, url, overwrite=False))
    assert "Checkpoint already exists" in str(info.value)  # DCP's wording, which callers match
    if kind == "turbo":
        (inner,) = failures(info.value)
        assert isinstance(inner, CheckpointExists) and url in str(inner)
    out = {"w": torch.zeros(6)}
    dcp.load(out, storage_reader=reader(kind, url))
    assert torch.equal(out["w"], torch.full((6,), 2.0))  # the refused save changed nothing
    dcp.save({"w": torch.full((6,), 4.0)}, storage_writer=writer(kind, ckpt(tmp_path, "new"),
                                                                  overwrite=False))


def test_overwrite_false_refuses_before_staging_or_uploading(tmp_path):
    url = ckpt(tmp_path)
    ct.save({"w": torch.ones(1000)}, url).wait(timeout=60)
    store = tmp_path / "run" / ".ckptturbo"
    before = sorted(str(p) for p in store.rglob("*"))
    manifest = (tmp_path / "run" / "step-1" / "manifest.json").read_bytes()
    new_state = {"w": torch.arange(1000.0)}
    with pytest.raises(CheckpointExists, match="step-1"):
        ct.save(new_state, url, overwrite=False).wait(timeout=60)
    with pytest.raises(CheckpointExists, match="step-1"):  # async_save stages first: checked there
        dcp.async_save(new_state, storage_writer=ct.TurboWriter(url, overwrite=False))
    assert sorted(str(p) for p in store.rglob("*")) == before  # no chunk, no marker
    assert (tmp_path / "run" / "step-1" / "manifest.json").read_bytes() == manifest


def test_validate_checkpoint_id_matches_dcp(tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    ids = [tmp_path / "run" / "a", str(tmp_path / "run" / "a"), "relative/run/a",
           f"file://{tmp_path}/run/a", "memory://run/a", "s3://bucket/run/a", "abc://abc.abc",
           "abc://bucket/run/a"]
    for cid in ids:
        dcp_says = (FileSystemWriter.validate_checkpoint_id(cid)
                    or FsspecWriter.validate_checkpoint_id(cid))
        assert ct.TurboWriter.validate_checkpoint_id(cid) is dcp_says, cid
        assert ct.TurboReader.validate_checkpoint_id(cid) is dcp_says, cid
    # DCP raises on some of these; ckptturbo answers False to anything it cannot serve,
    # including a bucket with no prefix to hold the run's chunk store
    for cid in (42, None, b"bytes", "", "s3://bucket", "gcs_not_installed_xyz://b/run/a"):
        assert ct.TurboWriter.validate_checkpoint_id(cid) is False, cid
        assert ct.TurboReader.validate_checkpoint_id(cid) is False, cid


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_checkpoint_loads_cast_into_bf16(kind, tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g),
          "i": torch.arange(10, dtype=torch.int32)}
    url = ckpt(tmp_path)
    dcp.save(sd, storage_writer=writer(kind, url))
    out = {"w": torch.zeros(48, 64, dtype=torch.bfloat16).t(),  # not contiguous either
           "b": torch.zeros(48, dtype=torch.float64), "i": torch.zeros(10, dtype=torch.int64)}
    dcp.load(out, storage_reader=reader(kind, url))
    for key, value in out.items():
        assert torch.equal(value, sd[key].to(value.dtype)), key
    wrong_shape = {"w": torch.zeros(64, 40), "b": torch.zeros(48), "i": torch.zeros(10)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(wrong_shape, storage_reader=reader(kind, url))
    (inner,) = failures(info.value)  # DCP's planner refuses it before any read
    assert isinstance(inner, ValueError) and "for w" in str(inner)


def test_ct_load_casts_like_dcp_load_and_names_shape_mismatches(tmp_path):
    sd = {"w": torch.randn(16, 8), "step": 7}
    url = ckpt(tmp_path)
    ct.save(sd, url).wait(timeout=60)
    out = {"w": torch.zeros(16, 8, dtype=torch.bfloat16), "step": 0}
    ct.load(out, url)
    assert torch.equal(out["w"], sd["w"].bfloat16()) and out["step"] == 7
    with pytest.raises(ct.MismatchError, match=r"'w': shape \(8, 16\)"):
        ct.load({"w": torch.zeros(8, 16, dtype=torch.bfloat16), "step": 0}, url)


def to_torch_save(storage_reader, path: str) -> None:
    """What format_utils.dcp_to_torch_save does, with the storage reader given (DCP's
    function takes a directory and builds a FileSystemReader itself)."""
    sd: dict = {}
    _load_state_dict(sd, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    torch.save(sd, path)


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_to_a_torch_save_file(kind, tmp_path):
    blob = io.BytesIO(b"raw bytes a trainer keeps")
    sd = {"model": {"w": torch.randn(5, 4), "layers": [torch.ones(2), torch.zeros(3)]},
          "step": 11, "name": "run-a", "blob": blob}
    url = ckpt(tmp_path)
    dcp.save(sd, storage_writer=writer(kind, url))
    out = str(tmp_path / f"{kind}.pt")
    to_torch_save(reader(kind, url), out)
    got = torch.load(out, weights_only=False)
    if kind == "dcp":  # the helper is DCP's function with the reader substituted, nothing else
        dcp_to_torch_save(url, str(tmp_path / "by_dcp.pt"))
        by_dcp = torch.load(str(tmp_path / "by_dcp.pt"), weights_only=False)
        assert by_dcp.keys() == got.keys() and by_dcp["blob"].getvalue() == got["blob"].getvalue()
    assert torch.equal(got["model"]["w"], sd["model"]["w"])
    layers = zip(got["model"]["layers"], sd["model"]["layers"], strict=True)
    assert all(torch.equal(a, b) for a, b in layers)
    assert (got["step"], got["name"], got["blob"].getvalue()) == (11, "run-a", blob.getvalue())


class _RunsCode:
    """Unpickling this touches a file: what a hostile checkpoint would do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_objects_needing_full_unpickling_need_the_one_switch(tmp_path):
    """The deliberate difference: FileSystemReader unpickles whatever is stored (running
    its code); TurboReader refuses what torch's restricted unpickler refuses, unless the
    caller trusts the checkpoint (allow_pickle=True)."""
    marker = tmp_path / "code-ran"
    sd = {"w": torch.ones(2), "payload": _RunsCode(str(marker))}
    for kind in KINDS:
        dcp.save(sd, storage_writer=writer(kind, ckpt(tmp_path, kind)))
    dcp.load({"w": torch.zeros(2), "payload": None},
             storage_reader=reader("dcp", ckpt(tmp_path, "dcp")))
    assert marker.exists()  # DCP ran the stored code
    marker.unlink()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(2), "payload": None},
                 storage_reader=reader("turbo", ckpt(tmp_path, "turbo")))
    (inner,) = failures(info.value)
    assert isinstance(inner, ct.FormatError) and "'payload'" in str(inner)
    assert not marker.exists()
    out = {"w": torch.zeros(2), "payload": None}
    dcp.load(out, storage_reader=ct.TurboReader(ckpt(tmp_path, "turbo"), allow_pickle=True))
    assert marker.exists()  # trusted: loads as with DCP


# --- real gloo ranks --------------------------------------------------------------------
ROWS, COLS = 8, 6


def _global() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def _sharded_tensor(world: int, dim: int, zeros: bool):
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.zeros(spec, ROWS, COLS)
    if not zeros:
        for shard in st.local_shards():
            shard.tensor.copy_(_box(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
    return st


def _box(offsets, sizes) -> torch.Tensor:
    (r, c), (h, w) = offsets, sizes
    return _global()[r:r + h, c:c + w]


def _layout(world: int, placement, zeros: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.zeros(ROWS, COLS) if zeros else _global()
    return {"dtensor": distribute_tensor(full, mesh, [placement]),
            "sharded": _sharded_tensor(world, placement.dim if hasattr(placement, "dim") else 0,
                                       zeros),
            "step": 0 if zeros else 5}


def _check(sd: dict) -> None:
    assert torch.equal(sd["dtensor"].full_tensor(), _global())
    for shard in sd["sharded"].local_shards():
        box = _box(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
        assert torch.equal(shard.tensor, box)
    assert sd["step"] == 5


def reshard_save_rank(rank: int, world: int, kind: str, url: str) -> None:
    from torch.distributed.tensor import Shard

    dcp.save(_layout(world, Shard(0), zeros=False), storage_writer=writer(kind, url))
    out = _layout(world, Shard(1), zeros=True)  # same ranks, the other dimension
    dcp.load(out, storage_reader=reader(kind, url))
    _check(out)
    try:  # overwrite=False is refused on every rank, not only where storage was asked
        dcp.save(_layout(world, Shard(0), zeros=True),
                 storage_writer=writer(kind, url, overwrite=False))
    except CheckpointException:
        pass
    else:
        raise AssertionError(f"rank {rank}: overwrite=False replaced {url}")


def reshard_load_rank(rank: int, world: int, kind: str, url: str) -> None:
    from torch.distributed.tensor import Shard

    out = _layout(world, Shard(0), zeros=True)
    dcp.load(out, storage_reader=reader(kind, url))
    _check(out)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_tensor_and_dtensor_reshard_from_2_to_2_and_4_ranks(kind, tmp_path):
    url = ckpt(tmp_path)
    run_distributed(reshard_save_rank, 2, kind, url, timeout=180)
    run_distributed(reshard_load_rank, 4, kind, url, timeout=180)
    out = {"dtensor": torch.zeros(ROWS, COLS), "step": 0}  # and into one process, plain tensors
    dcp.load(out, storage_reader=reader(kind, url))
    assert torch.equal(out["dtensor"], _global()) and out["step"] == 5


def ddp_round_trip_rank(rank: int, world: int, kind: str, url: str) -> list[float]:
    """Train a DDP model, checkpoint it with a train state holding a torch.save'd list in
    an io.BytesIO, train on; a fresh model restored from the checkpoint must train on
    to exactly the same losses and weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make(seed: int):
        torch.manual_seed(seed)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 3)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, optim, steps: int, seed: int) -> list[float]:
        g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
        out = []
        for _ in range(steps):
            loss = model(torch.randn(4, 12, generator=g)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # the job's mean loss, the same on every rank (DCP keeps
            out.append(round(logged.item() / world, 6))  # one copy of a replicated object)
        return out

    model, optim = make(0)
    losses = train(model, optim, 3, seed=1)
    state = {"app": ModelAndOptim(model, optim), "train": TrainProgress(3, losses)}
    dcp.save(state, storage_writer=writer(kind, url))
    expected = train(model, optim, 2, seed=2)

    fresh, fresh_optim = make(123)
    progress = TrainProgress()
    dcp.load({"app": ModelAndOptim(fresh, fresh_optim), "train": progress},
             storage_reader=reader(kind, url))
    assert progress.step == 3 and [round(x, 6) for x in progress.losses] == losses
    assert train(fresh, fresh_optim, 2, seed=2) == expected
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    return expected


def test_ddp_train_state_with_bytesio_round_trip(tmp_path):
    """Each storage class restores the run exactly (checked on every rank), and with the
    same seeds both give the same continued training."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_kind = {kind: run_distributed(ddp_round_trip_rank, 2, kind, ckpt(tmp_path, kind),
                                         timeout=180)
                   for kind in KINDS}
    assert by_kind["turbo"] == by_kind["dcp"]


class Schedule:
    """A user class: loadable without allow_pickle once registered as a safe global."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup


def test_registered_safe_globals_load_without_the_switch(tmp_path):
    url = ckpt(tmp_path)
    dcp.save({"w": torch.ones(2), "sched": Schedule(7)}, storage_writer=ct.TurboWriter(url))
    with pytest.raises(CheckpointException, match="'sched'.*add_safe_globals"):
        dcp.load({"w": torch.zeros(2), "sched": None}, storage_reader=ct.TurboReader(url))
    assert io.BytesIO not in torch.serialization.get_safe_globals()  # the reader's own, undone
    with torch.serialization.safe_globals([Schedule, io.BytesIO]):
        out = {"w": torch.zeros(2), "sched": None}
        dcp.load(out, storage_reader=ct.TurboReader(url))
        assert isinstance(out["sched"], Schedule) and out["sched"].warmup == 7
        # the reader's own use of io.BytesIO leaves the caller's registration in place
        assert io.BytesIO in torch.serialization.get_safe_globals()
