"""The streamer's CUDA path: pinned staging buffers, copies on a side stream.

Run with ``pytest tests/gpu`` on a machine with a GPU (CPU CI does not collect this folder).
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from ckptturbo.stream import safe_open, stream_safetensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MiB = 1 << 20


def _model(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    want = {"big": torch.randn(3 * MiB // 4, generator=g),  # larger than the staging buffers
            "bf16": torch.randn(1000, 33, generator=g).bfloat16(),
            "i64": torch.arange(17), "scalar": torch.tensor(1.5), "empty": torch.empty(0, 3),
            **{f"s{i}": torch.randn(50_000, generator=g) for i in range(10)}}
    save_file(want, path)
    return want


@pytest.mark.parametrize("limit", [None, 1 * MiB])
def test_stream_to_cuda_matches(tmp_path, limit):
    path = os.path.join(tmp_path, "m.safetensors")
    want = _model(path)
    stream = stream_safetensors(path, device="cuda", memory_limit=limit, chunk_size=256 << 10)
    got = {}
    for name, t in stream:
        assert t.device.type == "cuda"
        got[name] = t
        if name == "big":
            got[name] = t * 1  # a kernel on the current stream must see the finished copy
    torch.cuda.synchronize()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].cpu(), t), name
    if limit:
        assert stream.stats["peak_bytes_held"] <= limit


def test_stream_to_cuda_with_cast(tmp_path):
    path = os.path.join(tmp_path, "m.safetensors")
    want = _model(path)
    got = dict(stream_safetensors(path, device="cuda", dtype=torch.float16))
    assert got["big"].dtype == torch.float16 and got["i64"].dtype == torch.int64
    assert torch.allclose(got["big"].float().cpu(), want["big"], atol=1e-2, rtol=1e-2)


def test_safe_open_cuda(tmp_path):
    path = os.path.join(tmp_path, "m.safetensors")
    want = _model(path)
    with safe_open(path, device="cuda") as f:
        t = f.get_tensor("bf16")
        assert t.device.type == "cuda" and torch.equal(t.cpu(), want["bf16"])
        rows = f.get_slice("bf16")[10:20]
        assert rows.device.type == "cuda" and torch.equal(rows.cpu(), want["bf16"][10:20])
