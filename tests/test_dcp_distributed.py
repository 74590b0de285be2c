"""TurboWriter/TurboReader across real gloo processes: DDP, FSDP2, HSDP, optimizer state,
resharding, balanced dedup, and the bytes storage actually serves."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptturbo as ct
from ckptturbo import replicas
from ckptturbo.catalog import list_checkpoints
from ckptturbo.errors import ReplicaMismatchError
from ckptturbo.runs import Location
from ckptturbo.testing.launcher import run_distributed

CHUNK = 256 << 10


def full_tensors() -> dict[str, torch.Tensor]:
    """The global values every test derives its state from (same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "ddp.w": torch.randn(512, 300, generator=g),        # replicated plain tensor
        "ddp.emb": torch.randn(2048, 256, generator=g),      # one big replicated tensor (2 MiB)
        "ddp.bias": torch.randn(300, generator=g),
        "fsdp.w": torch.randn(96, 200, generator=g),         # Shard(0) over the mesh
        "fsdp.norm": torch.randn(200, generator=g),          # Replicate() over the mesh
        "hsdp.w": torch.randn(64, 128, generator=g),         # Replicate x Shard(0) on a 2-D mesh
    }


def _model_and_optim():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).sum().backward()
    optim.step()
    return model, optim


def build_state(world: int, zeros: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    full = full_tensors()
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    sd: dict = {k: full[k].clone() for k in ("ddp.w", "ddp.emb", "ddp.bias")}
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        sd["fsdp.w"] = distribute_tensor(full["fsdp.w"], mesh, [Shard(0)])
        sd["fsdp.norm"] = distribute_tensor(full["fsdp.norm"], mesh, [Replicate()])
        if world % 2 == 0:
            mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
            sd["hsdp.w"] = distribute_tensor(full["hsdp.w"], mesh2, [Replicate(), Shard(0)])
        else:
            sd["hsdp.w"] = distribute_tensor(full["hsdp.w"], mesh, [Shard(0)])
    else:
        sd.update({k: full[k].clone() for k in ("fsdp.w", "fsdp.norm", "hsdp.w")})
    model, optim = _model_and_optim()
    msd, osd = get_state_dict(model, optim)
    if zeros:
        msd = {k: torch.zeros_like(v) for k, v in msd.items()}
        osd = {"state": {k: {n: torch.zeros_like(t) for n, t in s.items()}
                         for k, s in osd["state"].items()}, "param_groups": osd["param_groups"]}
    sd["model"] = msd
    sd["optim"] = osd
    sd["step"] = 0 if zeros else 42
    return sd


def check_state(sd: dict) -> None:
    expected = build_state(1, zeros=False)
    for key in ("ddp.w", "ddp.emb", "ddp.bias", "fsdp.w", "fsdp.norm", "hsdp.w"):
        value = sd[key]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(value, expected[key]), key
    for k, v in expected["model"].items():
        assert torch.equal(sd["model"][k], v), k
    for k, s in expected["optim"]["state"].items():
        for n, t in s.items():
            assert torch.equal(sd["optim"]["state"][k][n], t), (k, n)
    assert sd["step"] == 42


def save_rank(rank: int, world: int, url: str, balance: bool = True) -> dict:
    writer = ct.TurboWriter(url, chunk_size=CHUNK, balance=balance, pack_threshold=64 << 10)
    dcp.save(build_state(world, zeros=False), storage_writer=writer)
    return writer.last_stats


def load_rank(rank: int, world: int, url: str, broadcast: bool = True,
              read_ahead: int = 1 << 30) -> int:
    sd = build_state(world, zeros=True)
    reader = ct.TurboReader(url, broadcast=broadcast, read_ahead_bytes=read_ahead)
    dcp.load(sd, storage_reader=reader)
    check_state(sd)
    return reader.bytes_from_storage


def test_save_4_ranks_balanced_and_reshard_to_3_2_and_1(tmp_path):
    url = str(tmp_path / "run" / "step-1")
    stats = run_distributed(save_rank, 4, url, timeout=240)
    manifest = Location(url).read_manifest()
    written = [s["bytes_written"] + s["bytes_reused"] for s in stats]
    unique = manifest.unique_bytes
    # every distinct byte is stored once; replicas are not written again
    assert sum(written) <= 1.02 * unique
    # the replicated tensors are split over all holders: max rank within a chunk of the mean
    mean = sum(written) / 4
    assert max(written) <= mean + CHUNK + (64 << 10), written
    # load with fewer ranks (resharding, uneven shards at 3), and in one process without a group
    for world in (3, 2):
        fetched = run_distributed(load_rank, world, url, timeout=240)
        assert sum(fetched) == unique  # grouped load: each chunk from storage once

    sd = build_state(1, zeros=True)
    ct.load(sd, url)
    check_state(sd)


def test_dcp_whole_item_dedup_is_less_balanced(tmp_path):
    """balance=False keeps DCP's choice: one rank writes each replicated tensor whole."""
    url = str(tmp_path / "run" / "dcp-choice")
    stats = run_distributed(save_rank, 2, url, False, timeout=240)
    written = [s["bytes_written"] + s["bytes_reused"] for s in stats]
    sd = build_state(1, zeros=True)
    ct.load(sd, url)
    check_state(sd)
    assert max(written) > 1.2 * (sum(written) / 2)


def test_grouped_load_reads_each_chunk_once(tmp_path):
    url = str(tmp_path / "run" / "step-1")
    run_distributed(save_rank, 2, url, timeout=240)
    unique = Location(url).read_manifest().unique_bytes
    fetched = run_distributed(load_rank, 4, url, True, timeout=240)
    assert sum(fetched) == unique, (fetched, unique)
    # read-ahead of one chunk: heads still make progress (the broadcaster takes their bytes)
    tight = run_distributed(load_rank, 4, url, True, CHUNK, timeout=240)
    assert sum(tight) == unique, (tight, unique)
    naive = run_distributed(load_rank, 4, url, False, timeout=240)
    assert sum(naive) > 2 * unique


def _save_with_dcp_plan_caching(rank: int, world: int, run: str) -> list[dict]:
    """Three saves of one layout with DCP's plan cache: new writers for the first two (one
    per checkpoint, the usual pattern), the second writer again for the third; the values
    change every time, the layout never does."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                  "_cached_metadata", "_cached_final_save_plan"):
        getattr(SavePlanner, cache).clear()  # class-level: start from an empty cache
    out, writer = [], None
    for step in range(3):
        sd = build_state(world, zeros=False)
        sd["ddp.w"] = sd["ddp.w"] + step
        if step < 2:
            writer = ct.TurboWriter(f"{run}/step-{step}", chunk_size=CHUNK, pack_threshold=64 << 10)
        else:
            writer.reset(f"{run}/step-{step}")
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(sd, storage_writer=writer, planner=planner)
        out.append({"hits": writer.plan_cache_hits})
    return out


def test_dcp_plan_caching_skips_planning_and_saves_right(tmp_path):
    """DefaultSavePlanner(enable_plan_caching=True): the second and third saves send empty
    plans both ways (DCP's cache) and still store every byte where the first save's plan said."""
    run = tmp_path / "run"
    outcomes = run_distributed(_save_with_dcp_plan_caching, 3, str(run), timeout=300)
    coordinator = outcomes[0]
    # saves 2 and 3: every rank sent an unchanged (empty) plan, so the coordinator planned
    # nothing and every rank wrote from the plan DCP cached for it
    assert coordinator[1]["hits"] == 1 and coordinator[2]["hits"] == 2, coordinator
    for step in range(3):
        sd = build_state(1, zeros=True)
        ct.load(sd, str(run / f"step-{step}"))
        expected = build_state(1, zeros=False)
        assert torch.equal(sd["ddp.w"], expected["ddp.w"] + step), step
        sd["ddp.w"] = expected["ddp.w"]
        check_state(sd)
    manifests = [Location(str(run / f"step-{s}")).read_manifest() for s in range(3)]
    assert [m.stats["world_size"] for m in manifests] == [3, 3, 3]
    assert not list((run / ".ckptturbo" / "pending").iterdir())  # every marker was removed


def test_replica_mismatch_is_detected(tmp_path):
    url = str(tmp_path / "run" / "bad-replicas")
    outcomes = run_distributed(_save_divergent_replicas, 2, url, timeout=240, expect_failures=True)
    assert any("differ across ranks" in str(o) for o in outcomes), outcomes
    assert not (tmp_path / "run" / "bad-replicas" / "manifest.json").exists()


def test_replica_check_compares_equal_looking_packs_whole():
    """Packs of the same length and the same first and last pairs are still compared byte
    for byte: a replica differing in one middle item is named."""
    indices = [MetadataIndex(f"layer.{i}.weight", (0,)) for i in range(100)]
    agreeing = [(replicas.item_key(idx), 7) for idx in indices]
    differing = [(k, 8 if i == 50 else p) for i, (k, p) in enumerate(agreeing)]
    same = replicas.pack(agreeing)
    replicas.check([same, bytes(same), b""], indices, raise_=True)  # equal packs, one empty
    with pytest.raises(ReplicaMismatchError, match="layer.50.weight"):
        replicas.check([same, bytes(same), replicas.pack(differing)], indices, raise_=True)


def _save_divergent_replicas(rank: int, world: int, url: str) -> None:
    sd = {"w": torch.full((4096,), float(rank))}  # DCP calls these replicas; they differ
    dcp.save(sd, storage_writer=ct.TurboWriter(url, on_replica_mismatch="raise"))


def test_manifest_lists_every_rank_contribution(tmp_path):
    url = str(tmp_path / "run" / "step-1")
    run_distributed(save_rank, 2, url, timeout=240)
    manifest = Location(url).read_manifest()
    assert sorted(s.offsets[0] for s in manifest.items["fsdp.w"].shards) == [0, 48]
    assert manifest.stats["world_size"] == 2


def async_save_rank(rank: int, world: int, url: str) -> float:
    """ct.save in a group: staged first, then durable, on a side gloo group."""
    sd = build_state(world, zeros=False)
    handle = ct.save(sd, url, chunk_size=CHUNK)
    handle.staged.result(timeout=120)
    for v in sd.values():  # mutate everything after staging: the checkpoint must not change
        if isinstance(v, torch.Tensor):
            v.add_(1000) if not v.dtype == torch.bool else None
    summary = handle.wait(timeout=120)
    dist.barrier()
    return summary.bytes_written


def test_async_save_mutation_after_staged_4_ranks(tmp_path):
    url = str(tmp_path / "run" / "async")
    run_distributed(async_save_rank, 4, url, timeout=240)
    sd = build_state(1, zeros=True)
    ct.load(sd, url)
    check_state(sd)


def _load_outcome(rank: int, world: int, url: str) -> str:
    sd = build_state(world, zeros=True)
    try:
        ct.load(sd, url, timeout=60)
    except ct.IntegrityError as exc:
        return f"IntegrityError: {exc}"
    return "ok"


def test_corrupted_chunk_makes_every_rank_raise(tmp_path):
    url = str(tmp_path / "run" / "step-1")
    run_distributed(save_rank, 2, url, timeout=240)
    manifest = Location(url).read_manifest()
    cid = manifest.items["ddp.emb"].shards[0].pieces[3].chunk
    path = tmp_path / "run" / ".ckptturbo" / "chunks" / cid[:2] / cid
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    outcomes = run_distributed(_load_outcome, 4, url, timeout=240)
    assert all(o.startswith("IntegrityError") and cid in o and "ddp.emb" in o
               for o in outcomes), outcomes


class _DiesOnFirstTensor(ct.TurboLoadPlanner):
    """A planner whose rank crashes mid-load (a real process exit, not a simulation); of
    ckptturbo's kind, as the other ranks' default (kinds that do not mix fail before)."""

    def commit_tensor(self, read_item, tensor):
        import os

        os._exit(3)


def _load_with_crash(rank: int, world: int, url: str) -> tuple[str, float]:
    import time

    sd = build_state(world, zeros=True)
    planner = _DiesOnFirstTensor() if rank == 1 else None
    started = time.monotonic()
    try:
        ct.load(sd, url, planner=planner, timeout=20)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return type(exc).__name__, time.monotonic() - started
    return "ok", time.monotonic() - started


def test_crashed_rank_fails_the_others_within_the_timeout(tmp_path):
    url = str(tmp_path / "run" / "step-1")
    run_distributed(save_rank, 2, url, timeout=240)
    outcomes = run_distributed(_load_with_crash, 4, url, timeout=180, expect_failures=True)
    assert getattr(outcomes[1], "exitcode", None) == 3
    for rank in (0, 2, 3):
        outcome = outcomes[rank]
        if isinstance(outcome, tuple):  # the rank returned: it must have failed, in time
            assert outcome[0] == "CommunicationError" and outcome[1] < 90, outcome
        else:  # or it died of the broken group; either way it did not hang
            assert outcome.exitcode is not None or "Error" in outcome.traceback, outcome


def load_rank_s3(rank: int, world: int, url: str, opts: dict) -> int:
    sd = build_state(world, zeros=True)
    reader = ct.TurboReader(url, opts)  # broadcast="auto": on for object stores
    dcp.load(sd, storage_reader=reader)
    check_state(sd)
    return reader.bytes_from_storage


def test_grouped_load_from_s3_reads_each_chunk_once(s3_server):
    url = s3_server.url("run") + "/step-1"
    opts = s3_server.storage_options
    dcp.save(build_state(1, zeros=False),
             storage_writer=ct.TurboWriter(url, opts, chunk_size=CHUNK))
    unique = Location(url, opts).read_manifest().unique_bytes
    fetched = run_distributed(load_rank_s3, 3, url, opts, timeout=240)
    assert sum(fetched) == unique, (fetched, unique)


class _DiesWhilePlanning(ct.TurboSavePlanner):
    """A planner whose rank exits in the middle of a save (a real process exit); of the
    other ranks' (default) kind."""

    def create_local_plan(self):
        import os

        os._exit(3)


def _save_with_crash(rank: int, world: int, url: str) -> tuple[str, float, str]:
    import time

    sd = build_state(world, zeros=False)
    planner = _DiesWhilePlanning() if rank == 1 else None
    started = time.monotonic()
    handle = ct.save(sd, url, planner=planner)
    try:
        handle.wait(timeout=120)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return type(exc).__name__, time.monotonic() - started, str(exc)
    return "ok", time.monotonic() - started, ""


def test_rank_dying_during_a_save_fails_the_others_and_commits_nothing(tmp_path):
    run = tmp_path / "run"
    first = str(run / "step-1")
    run_distributed(save_rank, 2, first, timeout=240)
    outcomes = run_distributed(_save_with_crash, 3, str(run / "step-2"), timeout=180,
                               expect_failures=True)
    assert getattr(outcomes[1], "exitcode", None) == 3
    for rank in (0, 2):
        outcome = outcomes[rank]
        if isinstance(outcome, tuple):  # the save failed, in time, as a ckptturbo error
            assert outcome[0] == "CommunicationError" and outcome[1] < 90, outcome
            assert str(run / "step-2") in outcome[2], outcome
        else:  # or the rank died of the broken group; either way it did not hang
            assert outcome.exitcode is not None or "Error" in outcome.traceback, outcome
    assert [c.name for c in list_checkpoints(str(run))] == ["step-1"]  # step-2 is invisible
    run_distributed(load_rank, 2, first, timeout=240)  # and step-1 loads as it was


class _StallsWhilePlanning(ct.TurboSavePlanner):
    """A planner whose rank stays alive but silent for longer than the collective timeout;
    of the other ranks' (default) kind."""

    def create_local_plan(self):
        import time

        time.sleep(15)
        return super().create_local_plan()


def _save_with_stall(rank: int, world: int, url: str) -> tuple[str, float]:
    import os
    import time

    os.environ["CKPTTURBO_COLLECTIVE_TIMEOUT"] = "3"  # before ct.save creates its group
    planner = _StallsWhilePlanning() if rank == 1 else None
    started = time.monotonic()
    try:
        ct.save(build_state(world, zeros=False), url, planner=planner).wait(timeout=120)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return type(exc).__name__, time.monotonic() - started
    return "ok", time.monotonic() - started


def test_stalled_rank_fails_a_save_within_the_collective_timeout(tmp_path):
    run = tmp_path / "run"
    outcomes = run_distributed(_save_with_stall, 3, str(run / "step-1"), timeout=120,
                               expect_failures=True)
    for rank in (0, 2):  # they waited for rank 1 in the planners' exchange: 3 s, not 30 min
        assert outcomes[rank][0] == "CommunicationError" and outcomes[rank][1] < 13, outcomes
    assert list_checkpoints(str(run)) == []
