"""The served tensors of a tensor-parallel engine's workers, one copy per node
(``ckptturbo.integrations.vllm_shared.share``): two gloo processes get equal tensors mapped
from the same pages of /dev/shm, and no file is left behind."""
from __future__ import annotations

import glob
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptturbo.integrations.vllm_shared import _directory, share


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
            "b": torch.randn(7, generator=gen), "empty": torch.empty(0, 3)}


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        shared = share(_tensors(), dist.group.WORLD)
        with open("/proc/self/maps") as maps:
            mapped = sum("ckptturbo-vllm-" in line and "(deleted)" in line for line in maps)
        torch.save({"tensors": {k: v.clone() for k, v in shared.items()}, "mapped": mapped},
                   f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_workers_of_a_node_map_one_copy(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(glob.glob(os.path.join(_directory(), "ckptturbo-vllm-*")))
    mp.start_processes(_worker, args=(port, str(tmp_path / "out")), nprocs=2,
                       start_method="spawn")
    expected = _tensors()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.{rank}")
        assert got["mapped"] == 2  # w and b, from unlinked files; the empty one stays
        for name, tensor in expected.items():
            assert got["tensors"][name].dtype == tensor.dtype
            assert torch.equal(got["tensors"][name], tensor), (rank, name)
    assert set(glob.glob(os.path.join(_directory(), "ckptturbo-vllm-*"))) == before


def test_alone_the_tensors_stay_as_they_are():
    tensors = _tensors()
    assert share(tensors, None) is tensors
