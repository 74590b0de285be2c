"""The chain broadcast checks of tests/test_broadcast.py, on NCCL with CUDA buffers.

NCCL matches point-to-point operations by order alone and runs them on streams, so this is
where a wrong posting order would hang rather than pass. Needs two GPUs or more: this
folder is collected only on GPU machines (CPU CI runs ``tests/`` without ``tests/gpu``).
"""
from __future__ import annotations

import pytest
import torch

from ckptturbo.testing.launcher import run_distributed
from tests.test_broadcast import (
    check_four_rank_results,
    check_two_rank_results,
    four_rank_job,
    two_rank_job,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA devices for NCCL")


def test_two_ranks_nccl() -> None:
    check_two_rank_results(run_distributed(two_rank_job, 2, timeout=180, backend="nccl",
                                           device="cuda"))


@pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA devices")
def test_four_ranks_many_concurrent_chains_nccl() -> None:
    check_four_rank_results(run_distributed(four_rank_job, 4, timeout=180, backend="nccl",
                                            device="cuda"))
