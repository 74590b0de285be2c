"""Lightning's CUDA-only sharded strategy with ckptturbo:
TurboFSDPStrategy(state_dict_type="sharded").

Lightning's FSDPStrategy needs CUDA, so this lives here; the CPU suite covers
TurboModelParallelStrategy (FSDP2) in tests/test_integration_lightning.py.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

SCRIPT = Path(__file__).parent.parent / "integration_scripts" / "lightning_model_parallel.py"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(tmp_path: Path, *argv: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--cuda"], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_sharded_save_and_exact_resume_cuda(tmp_path, strategy):
    _run(tmp_path, str(tmp_path / "a"), "3", "--strategy", strategy)
    # steps per epoch depend on how many GPUs share the 8 batches
    [second_epoch] = (tmp_path / "a").glob("epoch=1-step=*.ckpt")
    _run(tmp_path, str(tmp_path / "b"), "3", str(second_epoch), "--strategy", strategy)
    a, b = torch.load(tmp_path / "a.final.pt"), torch.load(tmp_path / "b.final.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
