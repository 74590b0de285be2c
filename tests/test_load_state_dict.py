"""ct.load_state_dict (the whole dict, no template) and ct.save(collective=False)."""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from test_dcp_distributed import _model_and_optim
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import ckptturbo as ct
from ckptturbo.testing.launcher import run_distributed
from ckptturbo.tree import flatten


def _assert_same(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, list(a), list(b))
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def test_whole_dict_comes_back_as_dcp_builds_it(tmp_path):
    """A ct.save of a nested dict loads back without a template, nested as DCP's own
    template-free load (the one behind dcp_to_torch_save) nests it."""
    model, optim = _model_and_optim()
    state = {"model": model.state_dict(), "step": 17, "names": ["a", "b"],
             "half": torch.arange(10, dtype=torch.bfloat16)}
    url = str(tmp_path / "run" / "step-17")
    ct.save(state, url, chunk_size=4 << 10).wait(timeout=60)

    loaded = ct.load_state_dict(url)
    dcp_view: dict = {}
    _load_state_dict(dcp_view, storage_reader=ct.TurboReader(url),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    _assert_same(dcp_view, loaded)
    _assert_same(state, loaded)


def test_exact_nesting_with_the_stored_skeleton(tmp_path):
    """Optimizer state has integer keys and Lightning's loops hold empty dicts: DCP's
    flattening loses both; a checkpoint saved flattened with ckptturbo.tree keeps them."""
    model, optim = _model_and_optim()
    state = {"state_dict": model.state_dict(), "optimizer_states": [optim.state_dict()],
             "loops": {"fit_loop": {}}, "pair": (torch.ones(3), 2)}
    url = str(tmp_path / "run" / "exact")
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    ct.save(flatten(state), url, planner=planner).wait(timeout=60)

    loaded = ct.load_state_dict(url)
    _assert_same(state, loaded)
    assert 0 in loaded["optimizer_states"][0]["state"]


def test_device_templates_and_dtype(tmp_path):
    w = torch.randn(40, 30)
    url = str(tmp_path / "run" / "t")
    ct.save({"w": w, "b": torch.zeros(30, dtype=torch.float16)}, url).wait(timeout=60)
    into = torch.empty(40, 30)
    loaded = ct.load_state_dict(url, device="cpu", templates={"w": into})
    assert loaded["w"] is into and torch.equal(into, w)
    assert loaded["b"].dtype == torch.float16 and not loaded["b"].any()

    with pytest.raises(ct.MismatchError, match="'nope' is not in the checkpoint"):
        ct.load_state_dict(url, templates={"nope": torch.empty(1)})
    with pytest.raises(ct.MismatchError,
                       match=r"'w': shape \(30, 40\) in the template, \(40, 30\)"):
        ct.load_state_dict(url, templates={"w": torch.empty(30, 40)})


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_objects_need_the_trusted_switch(tmp_path):
    url = str(tmp_path / "run" / "obj")
    ct.save({"w": torch.ones(4), "opaque": _Opaque(), "buf": io.BytesIO(b"raw")},
            url).wait(timeout=60)
    with pytest.raises(ct.FormatError, match="opaque"):
        ct.load_state_dict(url)
    trusted = ct.load_state_dict(url, allow_pickle=True)
    assert trusted["opaque"].x == 1 and trusted["buf"].getvalue() == b"raw"


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(ct.CheckpointNotFound, match="never-saved"):
        ct.load_state_dict(str(tmp_path / "run" / "never-saved"))


def _rank0_saves_alone_then_all_load(rank: int, world: int, url: str) -> list[float]:
    """Rank 0 saves while rank 1 is not in any checkpoint call; then both load grouped."""
    state = {"w": torch.arange(6000, dtype=torch.float32).reshape(60, 100), "step": 5}
    if rank == 0:
        handle = ct.save(state, url, collective=False, chunk_size=8 << 10)
        handle.wait(timeout=60)
    dist.barrier()  # rank 1 waits here the whole time: a collective save would hang
    loaded = ct.load_state_dict(url, broadcast=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 5
    return loaded["w"].sum().item()


def test_save_alone_in_a_group_and_grouped_load(tmp_path):
    url = str(tmp_path / "run" / "alone")
    sums = run_distributed(_rank0_saves_alone_then_all_load, 2, url, timeout=120)
    assert sums[0] == sums[1] == float(sum(range(6000)))
