"""CUDA paths of the writer and reader: pinned pool, side-stream copies. Run with
`pytest tests/gpu` on a machine with a GPU (CPU CI does not collect this folder)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"w{i}": torch.randn(1024, 1024, device="cuda", generator=g) for i in range(8)}


def test_ct_save_from_cuda_stages_through_pinned_pool(tmp_path):
    sd = cuda_state()
    expected = {k: v.clone() for k, v in sd.items()}
    handle = ct.save(sd, str(tmp_path / "run" / "a"), chunk_size=4 << 20)
    handle.staged.result(timeout=60)
    for v in sd.values():
        v.fill_(0)  # after staged, device memory may be reused
    handle.wait(timeout=120)
    writers = ct.default_session()._kept.values()
    writer = next(w for w in writers if w.url.startswith(str(tmp_path)))
    assert writer._pool.pin and writer._pool.arena.is_pinned()
    out = {k: torch.empty_like(v) for k, v in expected.items()}
    ct.load(out, str(tmp_path / "run" / "a"))
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


def test_dcp_round_trip_cuda_tensors(tmp_path):
    sd = cuda_state()
    dcp.save(sd, storage_writer=ct.TurboWriter(str(tmp_path / "run" / "b")))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=ct.TurboReader(str(tmp_path / "run" / "b")))
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
