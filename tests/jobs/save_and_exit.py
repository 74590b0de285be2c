"""Save, wait only for ``staged``, and end the process at once (exit-safety tests).

Run under torch.distributed.run with a gloo group, or alone. Usage:
save_and_exit.py URL SEED [STORAGE_OPTIONS_JSON]. The state is a pure function of SEED and
the rank, so the test can check the committed checkpoint bit for bit.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import ckptturbo as ct


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4 << 20, generator=g), "b": torch.randn(1000, generator=g),
            "step": seed}


def main() -> None:
    url, seed = sys.argv[1], int(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    ct.save(state_of(seed), url, storage_options=options).staged.result()
    print("staged", flush=True)  # and the interpreter ends here, the upload still running


if __name__ == "__main__":
    main()
