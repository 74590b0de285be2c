"""How forwarded chunks travel and where they are verified: the choice of transport (every
case of the pure rule; on real gloo processes, forced each way and checked it was taken)
and verification at the storage boundary ("storage") or on every receiver ("all")."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.groups import (
    host_transport_group,
    moves_cuda_tensors,
    moves_host_buffers,
    transport_kind,
)
from ckptturbo.reader import verify_mode
from ckptturbo.runs import Location
from ckptturbo.testing.launcher import run_distributed

CHUNK = 64 << 10


def state(zeros: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(256, 200, generator=g), "b": torch.randn(300, generator=g),
          "zero": torch.zeros(40_000)}  # an all-zero chunk: receivers check it, and it passes
    return {k: torch.zeros_like(v) for k, v in sd.items()} if zeros else sd


@pytest.mark.parametrize("backend, expected", [
    ("gloo", True), ("mpi", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True),
    ("nccl", False), ("cuda:nccl", False), ("xccl", False), ("undefined", False),
])
def test_which_backends_carry_host_buffers(backend, expected):
    assert moves_host_buffers(backend) is expected


@pytest.mark.parametrize("backend, expected", [
    ("nccl", True), ("cuda:nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False),
    ("cpu:nccl", False), ("mpi", False), ("xccl", False),
])
def test_which_backends_carry_cuda_tensors_over_nccl(backend, expected):
    assert moves_cuda_tensors(backend) is expected


@pytest.mark.parametrize("backend, transport, cuda_bytes, expected", [
    # an NCCL job whose bytes mostly go to CUDA tensors: chunks travel as CUDA tensors
    ("nccl", "auto", 90, "nccl"), ("cpu:gloo,cuda:nccl", "auto", 60, "nccl"),
    # ... unless the user asks for gloo, or most bytes go to CPU tensors: host buffers
    ("nccl", "gloo", 90, "gloo"), ("nccl", "auto", 50, "gloo"), ("nccl", "auto", 0, "gloo"),
    ("cpu:gloo,cuda:nccl", "auto", 10, "job"), ("cpu:gloo,cuda:nccl", "gloo", 90, "gloo"),
    # gloo jobs: the job's group, or one of its own; CUDA destinations do not change that
    ("gloo", "auto", 0, "job"), ("gloo", "auto", 100, "job"), ("gloo", "gloo", 0, "gloo"),
    ("xccl", "auto", 100, "gloo"),
])
def test_transport_rule_covers_every_case(backend, transport, cuda_bytes, expected):
    assert transport_kind(backend, transport, cuda_bytes, 100) == expected


def test_bad_transport_and_verify_settings_are_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="transport"):
        host_transport_group(None, "nccl-please", keeper=ct.default_session())
    with pytest.raises(ValueError, match="transport"):
        transport_kind("nccl", "nccl-please", 1, 1)
    with pytest.raises(ValueError, match="transport"):
        ct.TurboReader(str(tmp_path), transport="tcp")
    with pytest.raises(ValueError, match="verify"):
        ct.TurboReader(str(tmp_path), verify="sometimes")
    modes = [verify_mode(v) for v in (True, "storage", "all", False)]
    assert modes == ["storage", "storage", "all", "off"]


def _load(rank: int, world: int, url: str, transport: str, verify: object) -> dict:
    group = dist.group.WORLD
    sd = state(zeros=True)
    reader = ct.TurboReader(url, broadcast=True, transport=transport, verify=verify,
                            piece_size=16 << 10)
    dcp.load(sd, storage_reader=reader)
    chosen = reader.transport_used
    return {
        "equal": all(torch.equal(sd[k], v) for k, v in state().items()),
        "kind": chosen.kind,
        "device": str(chosen.device),
        "job_group": chosen.group is None or chosen.group is group,
        "chosen_backend": str(dist.get_backend(chosen.group)),
        "chosen_ranks": dist.get_process_group_ranks(
            chosen.group if chosen.group is not None else group),
        "from_storage": reader.bytes_from_storage,
        "verified": reader.chunks_verified,
    }


def _saved(tmp_path) -> tuple[str, int, int, int]:
    """url, unique bytes, chunks, and how many of those are all zeros."""
    url = str(tmp_path / "run" / "step-1")
    dcp.save(state(), storage_writer=ct.TurboWriter(url, chunk_size=CHUNK))
    location = Location(url)
    manifest = location.read_manifest()
    zero = 0
    for cid, size in manifest.chunks.items():
        data = bytearray(size)
        location.chunk_store.get_into(location.chunk_path(cid), memoryview(data))
        zero += not any(data)
    assert zero >= 1
    return url, manifest.unique_bytes, len(manifest.chunks), zero


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_each_transport_choice_is_taken_and_loads_bit_exact(tmp_path, transport):
    url, unique, nchunks, zero = _saved(tmp_path)
    results = run_distributed(_load, 3, url, transport, True, timeout=240)
    assert all(r["equal"] for r in results)
    # "auto" on a gloo job forwards on the job's own group; "gloo" always on a group of its own
    assert all(r["job_group"] is (transport == "auto") for r in results), results
    assert all(r["kind"] == ("job" if transport == "auto" else "gloo") and r["device"] == "cpu"
               for r in results), results
    assert all(r["chosen_backend"] == "gloo" and r["chosen_ranks"] == [0, 1, 2] for r in results)
    assert sum(r["from_storage"] for r in results) == unique  # read once either way
    # verified where read: each chunk hashed once in all, not once per rank; receivers hash
    # only all-zero chunks (what a head that failed would forward)
    assert sum(r["verified"] for r in results) == nchunks + 2 * zero, results


def test_verify_all_rehashes_on_every_receiver(tmp_path):
    url, unique, nchunks, _ = _saved(tmp_path)
    results = run_distributed(_load, 3, url, "auto", "all", timeout=240)
    assert all(r["equal"] for r in results)
    assert sum(r["from_storage"] for r in results) == unique
    assert sum(r["verified"] for r in results) == 3 * nchunks  # every rank needs every chunk

