"""How forwarded chunks travel and where they are verified, on real gloo processes: the
choice of group (forced each way, and checked it was taken) and verification at the storage boundary ("storage") or on every receiver ("all")."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.groups import host_transport_group, moves_host_buffers
from ckptturbo.layout import Location
from ckptturbo.reader import verify_mode
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


def test_bad_transport_and_verify_settings_are_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="transport"):
        host_transport_group(None, "nccl-please")
    with pytest.raises(ValueError, match="transport"):
        ct.TurboReader(str(tmp_path), transport="tcp")
    with pytest.raises(ValueError, match="verify"):
        ct.TurboReader(str(tmp_path), verify="sometimes")
    assert [verify_mode(v) for v in (True, "storage", "all", False)] == ["storage", "storage", "all", "off"]


def _load(rank: int, world: int, url: str, transport: str, verify: object) -> dict:
    group = dist.group.WORLD
    sd = state(zeros=True)
    reader = ct.TurboReader(url, broadcast=True, transport=transport, verify=verify, piece_size=16 << 10)
    dcp.load(sd, storage_reader=reader)
    chosen = reader.transport_group
    return {
        "equal": all(torch.equal(sd[k], v) for k, v in state().items()),
        "job_group": chosen is None or chosen is group,
        "chosen_backend": str(dist.get_backend(chosen)),
        "chosen_ranks": dist.get_process_group_ranks(chosen if chosen is not None else group),
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

