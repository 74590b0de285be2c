"""Save two tiered checkpoints and die by SIGKILL once the second is in host memory.

Usage: tiered_kill.py RUN MEMORY_DIR STORAGE_OPTIONS_JSON. step-1 is persisted
(``persist=True``), step-2 only committed to the memory tier (``persist_every=0``); the
process then kills itself (no exit handler, no wait at exit: what a crash leaves). States
come from ``tiered_state`` so the test can check them bit for bit.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import ckptturbo as ct

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_tiers import tiered_state  # noqa: E402


def main() -> None:
    run, memory, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tiers = ct.Tiers(memory=memory, persist_every=0, node="n0")
    ct.save(tiered_state(1), f"{run}/step-1", storage_options=options, tiers=tiers,
            persist=True).wait()
    handle = ct.save(tiered_state(2), f"{run}/step-2", storage_options=options, tiers=tiers)
    handle.local.result()
    print("local", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
