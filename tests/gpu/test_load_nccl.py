"""Loads in GPU jobs: CUDA destinations, NCCL process groups, mixed backends.

In an NCCL (or mixed) job whose load goes mostly to CUDA tensors, chunks travel as CUDA
tensors over NCCL; otherwise as host buffers on gloo (the job's group when it is gloo or
mixed, else a gloo group over its ranks). These tests check that a GPU job loads through
the ordinary ``dcp.load`` / ``ct.load`` / streamer calls, bit-exact, reading storage once,
with the transport the rule picks. NCCL cannot put two ranks on one GPU: the multi-rank
NCCL tests need two GPUs or more; the rest runs on one.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ckptturbo as ct
from ckptturbo.testing.launcher import run_distributed
from tests.test_transport import _saved, state

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs CUDA")


def _on_cuda(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in sd.items()}


def _equal_on_cuda(sd: dict[str, torch.Tensor]) -> bool:
    return all(sd[k].is_cuda and torch.equal(sd[k].cpu(), v) for k, v in state().items())


def test_single_process_load_into_cuda_tensors_local_and_s3(tmp_path, s3_server):
    url, _, _, _ = _saved(tmp_path)
    s3_url, opts = s3_server.url("gpu") + "/step-1", s3_server.storage_options
    ct.save(state(), s3_url, storage_options=opts).durable.result()
    for where, options in ((url, None), (s3_url, opts)):
        sd = _on_cuda(state(zeros=True))
        ct.load(sd, where, storage_options=options)
        assert _equal_on_cuda(sd), where


def test_cuda_targets_that_need_staging_cast_and_stride_on_the_device(tmp_path):
    url, _, _, _ = _saved(tmp_path)
    sd = _on_cuda(state(zeros=True))
    sd["w"] = sd["w"].to(torch.bfloat16)  # stored fp32: cast on the device
    sd["zero"] = torch.ones(80_000, device="cuda")[::2]  # not contiguous: staged, then strided
    ct.load(sd, url)
    expected = state()
    assert torch.equal(sd["w"].cpu(), expected["w"].to(torch.bfloat16))
    assert torch.equal(sd["zero"].cpu(), expected["zero"])
    assert torch.equal(sd["b"].cpu(), expected["b"])


def _grouped_cuda_load(rank: int, world: int, url: str, device_index: int,
                       transport: str = "auto") -> dict:
    torch.cuda.set_device(device_index)
    sd = _on_cuda(state(zeros=True))
    sd["b"] = sd["b"].cpu()  # a CPU destination beside the CUDA ones
    reader = ct.TurboReader(url, broadcast=True, transport=transport)
    dcp.load(sd, storage_reader=reader)
    chosen = reader.transport_used
    expected = state()
    equal = all(torch.equal(sd[k].cpu(), v) for k, v in expected.items())
    return {"equal": equal and not sd["b"].is_cuda, "from_storage": reader.bytes_from_storage,
            "kind": chosen.kind if chosen else None,
            "device": str(chosen.device) if chosen else None,
            "job_group": chosen is None or chosen.group is None}


def test_nccl_world_of_one(tmp_path):
    url, unique, _, _ = _saved(tmp_path)
    [result] = run_distributed(_grouped_cuda_load, 1, url, 0, backend="nccl", timeout=240)
    assert result["equal"] and result["from_storage"] == unique, result


def _shared_gpu_load(rank: int, world: int, url: str) -> dict:
    return _grouped_cuda_load(rank, world, url, 0)


def test_two_processes_share_one_gpu_with_gloo_transport(tmp_path):
    url, unique, _, _ = _saved(tmp_path)
    results = run_distributed(_shared_gpu_load, 2, url, backend="gloo", timeout=240)
    assert all(r["equal"] and r["job_group"] and r["kind"] == "job" for r in results), results
    assert sum(r["from_storage"] for r in results) == unique


def _own_gpu_load(rank: int, world: int, url: str, transport: str) -> dict:
    return _grouped_cuda_load(rank, world, url, rank, transport)


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU per rank")
@pytest.mark.parametrize("backend, transport, kind", [
    ("nccl", "auto", "nccl"), ("cpu:gloo,cuda:nccl", "auto", "nccl"), ("nccl", "gloo", "gloo"),
])
def test_grouped_load_in_an_nccl_job_reads_storage_once(tmp_path, backend, transport, kind):
    url, unique, _, _ = _saved(tmp_path)
    results = run_distributed(_own_gpu_load, 2, url, transport, backend=backend, timeout=240)
    assert all(r["equal"] for r in results), results
    # most bytes go to CUDA tensors: CUDA buffers over the job's NCCL group, unless gloo is asked
    assert all(r["kind"] == kind and r["device"].startswith("cuda" if kind == "nccl" else "cpu")
               for r in results), results
    assert sum(r["from_storage"] for r in results) == unique


def _stream_rank(rank: int, world: int, path: str) -> bool:
    torch.cuda.set_device(rank)
    expected = state()
    got = dict(ct.stream_safetensors(path, device="cuda", process_group=dist.group.WORLD))
    return got.keys() == expected.keys() and all(torch.equal(got[k].cpu(), v)
                                                 for k, v in expected.items())


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU per rank")
def test_streaming_across_an_nccl_group(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file(state(), path)
    assert all(run_distributed(_stream_rank, 2, path, backend="nccl", timeout=240))
