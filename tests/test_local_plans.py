"""plan.local: ckptturbo's planners build the same local plans as DCP's default planners,
item for item (indices too), for every kind of value, with the fast path for plain
tensors and DCP's own functions for the rest; meta tensors are materialised as DCP does."""
from __future__ import annotations

import io
import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptturbo as ct
from ckptturbo.testing.launcher import run_distributed


def _state(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6, 4, generator=g).to(device),
            "p": torch.nn.Parameter(torch.randn(5, generator=g).to(device)),
            "scalar": torch.tensor(2.5).to(device), "empty": torch.empty(0, 3, device=device),
            "t": torch.randn(4, 6, generator=g).to(device).t(),  # not contiguous
            "nested": {"half": torch.ones(3, dtype=torch.float16, device=device), "n": 7},
            "blob": io.BytesIO(b"abc"), "name": "x"}


def _indices(items: list) -> list:
    out = []
    for i in items:
        if hasattr(i, "dest_index"):
            out.append((i.dest_index, i.dest_index.index, i.storage_index.index))
        else:
            out.append((i.index, i.index.index))
    return out


def _same_set_up(theirs, ours) -> None:
    """The planners' flattened state dicts and mappings are equal (keys in order)."""
    assert list(ours.state_dict) == list(theirs.state_dict)
    assert [type(v) for v in ours.state_dict.values()] == \
           [type(v) for v in theirs.state_dict.values()]
    assert ours.mappings == theirs.mappings


def _save_plans(state: dict, **options) -> tuple:
    theirs, ours = DefaultSavePlanner(**options), ct.TurboSavePlanner(**options)
    plans = []
    for planner in (theirs, ours):
        planner.set_up_planner(state, is_coordinator=False)
        plans.append(planner.create_local_plan())
    _same_set_up(theirs, ours)
    return theirs, plans


def _load_plans(state_of, metadata: Metadata, **options) -> tuple:
    plans, dicts, planners = [], [], []
    for cls in (DefaultLoadPlanner, ct.TurboLoadPlanner):
        planner = cls(**options)
        sd = state_of()
        planner.set_up_planner(sd, metadata, False)
        plans.append(planner.create_local_plan())
        dicts.append(sd)
        planners.append(planner)
    _same_set_up(*planners)
    return plans, dicts


def test_save_and_load_plans_equal_dcps_item_for_item():
    dcp_planner, (theirs, ours) = _save_plans(_state())
    assert ours.items == theirs.items and ours.planner_data == theirs.planner_data
    assert _indices(ours.items) == _indices(theirs.items)
    metadata = dcp_planner.create_global_plan([theirs])[1]
    (theirs, ours), _ = _load_plans(_state, metadata)
    assert ours.items == theirs.items and _indices(ours.items) == _indices(theirs.items)
    # partial: keys the state dict lacks, and keys the checkpoint lacks
    (theirs, ours), _ = _load_plans(lambda: {**_state(), "extra": torch.ones(2)}, metadata,
                                    allow_partial_load=True)
    assert ours.items == theirs.items


def test_lists_tuples_and_unflattened_states_plan_as_with_dcp():
    """A list or tuple anywhere: DCP's own set-up (lists of tensors are flattened by
    index); without flattening the state dict is used as it is."""
    for extra in ({"lst": [torch.ones(2), 3]}, {"tup": (torch.ones(2), 1)}, {}):
        for options in ({}, {"flatten_state_dict": False, "flatten_sharded_tensors": False}):
            state = {**_state(), **extra}
            if options:  # DCP's writer needs flat keys: the values of the top level only
                state = {k: v for k, v in state.items() if k != "nested"}
            dcp_planner, (theirs, ours) = _save_plans(state, **options)
            assert ours.items == theirs.items and _indices(ours.items) == _indices(theirs.items)
            metadata = dcp_planner.create_global_plan([theirs])[1]
            (theirs, ours), _ = _load_plans(lambda s=state: {**s}, metadata, **options)
            assert ours.items == theirs.items, (extra, options)


def test_a_chunked_or_resized_checkpoint_goes_to_dcps_resharding():
    """A tensor stored in two chunks, and one of another size (DCP's error, unchanged)."""
    props = TensorProperties.create_from_tensor(torch.ones(1))
    two = TensorStorageMetadata(props, torch.Size([4, 2]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))])
    metadata = Metadata({"w": two})
    (theirs, ours), _ = _load_plans(lambda: {"w": torch.zeros(4, 2)}, metadata)
    assert len(ours.items) == 2 and ours.items == theirs.items
    assert _indices(ours.items) == _indices(theirs.items)
    errors = []
    for cls in (DefaultLoadPlanner, ct.TurboLoadPlanner):
        planner = cls()
        planner.set_up_planner({"w": torch.zeros(3, 2)}, metadata, False)
        try:
            planner.create_local_plan()
        except ValueError as exc:
            errors.append(str(exc))
    assert len(errors) == 2 and errors[0] == errors[1]


def _dtensors(mesh, placements, device: str = "cpu") -> dict:
    """DTensors of several shapes (uneven and empty shards too), on ``device``."""
    out = {}
    for name, shape in (("a", (8, 6)), ("b", (8, 6)), ("c", (5, 3)), ("d", (1,)), ("e", (9,))):
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        d = distribute_tensor(full, mesh, placements)
        if device == "meta":
            d = DTensor.from_local(torch.empty_like(d.to_local(), device="meta"), mesh,
                                   placements, shape=d.size(), stride=d.stride())
        out[name] = d
    return out


def _meta_load(rank: int, world: int) -> list:
    """Meta tensors materialised as DCP's planner does (device, dtype, shape, strides),
    and DTensors' save and load plans equal to DCP's: saved and loaded on the same
    sharding, resharded, and from meta DTensors."""
    dcp_planner, (theirs, _) = _save_plans(_state())
    metadata = dcp_planner.create_global_plan([theirs])[1]
    (theirs, ours), (a, b) = _load_plans(lambda: _state("meta"), metadata)
    assert ours.items == theirs.items
    for key in ("w", "p", "scalar", "empty", "t"):
        x, y = a[key], b[key]
        assert (type(x), x.device, x.dtype, x.shape, x.stride()) == \
               (type(y), y.device, y.dtype, y.shape, y.stride()), key
    assert b["nested"]["half"].device == a["nested"]["half"].device != torch.device("meta")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    hsdp = [Replicate(), Shard(0)]
    dcp_planner, (theirs, ours) = _save_plans(_dtensors(mesh, hsdp))
    assert ours.items == theirs.items and _indices(ours.items) == _indices(theirs.items)
    # the coordinator's metadata, as a save of every rank's plan makes it
    everyone = [None] * world
    dist.all_gather_object(everyone, theirs)
    metadata = dcp_planner.create_global_plan(everyone)[1]
    for placements, device in ((hsdp, "cpu"), ([Shard(0), Shard(0)], "cpu"),
                               (hsdp, "meta")):
        (theirs, ours), (a, b) = _load_plans(lambda p=placements, d=device:
                                             _dtensors(mesh, p, d), metadata)
        assert ours.items == theirs.items and _indices(ours.items) == _indices(theirs.items)
        for key, x in a.items():
            y = b[key]
            assert (type(x), x.device, x.placements, x.shape, x.stride(), x.to_local().shape) \
                == (type(y), y.device, y.placements, y.shape, y.stride(), y.to_local().shape)
    return _indices(ours.items)


def test_meta_tensors_and_dtensors_plan_as_with_dcp():
    out = run_distributed(_meta_load, 4, timeout=120)
    assert out[0] != out[1]  # each rank its own shard


def test_one_walk_flattens_as_dcps_two_or_hands_over_to_them():
    """plan.flatten gives DCP's flattening (keys in order, mappings, the very values) for
    nested dicts, int keys, lists of tensors, dicts in lists, tuples and empty dicts, and
    None (DCP's own walks) where the rebuild would pad a list or a key repeats."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    from ckptturbo.plan.flatten import flatten

    t = torch.ones(2)
    states = [
        _state(),
        {"optim": {"state": {0: {"step": t, "exp_avg": t}, 1: {}},
                   "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"params": []}]}},
        {"lst": [t, 3, [4, 5], [t, "x"]], "tup": (t, 1), "empty": {}, "none": None},
        {"deep": {"a": [{"b": t}, {"c": [1, 2]}], "": {"x": t}}},
    ]
    for state in states:
        theirs = flatten_state_dict(_flatten_sharded_tensors(state))
        ours = flatten(state)
        assert ours is not None
        assert list(ours[0]) == list(theirs[0]) and ours[1] == theirs[1]
        assert all(a is b for a, b in zip(ours[0].values(), theirs[0].values(), strict=True))
    for state in ({"pad": [{}, t]}, {"pad": [{"e": {}}, t]}, {"a.b": t, "a": {"b": t}}):
        assert flatten(state) is None, state
    # the corner itself: DCP's rebuild pads the list, so its keys differ from one flatten
    assert list(flatten_state_dict(_flatten_sharded_tensors({"pad": [{}, t]}))[0]) != \
        list(flatten_state_dict({"pad": [{}, t]})[0])
