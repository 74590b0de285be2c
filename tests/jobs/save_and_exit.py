"""Save, wait only for ``staged``, and end the process at once (exit-safety tests).

Run under torch.distributed.run with a gloo group, or alone. Usage:
save_and_exit.py URL SEED [STORAGE_OPTIONS_JSON]. The state is a pure function of SEED and
the rank, so the test can check the committed checkpoint bit for bit.

With a group, the script ends as torch asks (pytorch#190489: a gloo group left to the
interpreter's finalisation can abort the process), in one of three ways, SAVE_AND_EXIT_END:
"exit" (the default) destroys the group in an ``atexit`` handler, which runs after
ckptturbo's wait at exit, as a framework's teardown would; "destroy" calls
``destroy_process_group()`` right after ``staged``, the upload still running;
"torch-destroy" calls torch's own, unwrapped, as a module that bound the name before
ckptturbo was imported would.
"""
from __future__ import annotations

import atexit
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
    end = os.environ.get("SAVE_AND_EXIT_END", "exit")
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        if end == "exit":
            atexit.register(dist.destroy_process_group)
    handle = ct.save(state_of(seed), url, storage_options=options)
    handle.staged.result()
    print("staged", flush=True)  # and the interpreter ends here, the upload still running
    if end == "destroy" and dist.is_initialized():
        dist.destroy_process_group()
        if handle.done() and handle.durable.exception() is None:
            print("the group was destroyed after the save was durable", flush=True)
    elif end == "torch-destroy" and dist.is_initialized():
        dist.destroy_process_group.__wrapped__()


if __name__ == "__main__":
    main()
