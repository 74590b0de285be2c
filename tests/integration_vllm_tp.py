"""Two tensor-parallel workers set up as vLLM sets them up, iterating the loader's weights.

Run by tests/test_integration_vllm.py as ``python integration_vllm_tp.py PORT EXTRA_JSON OUT``:
it starts 2 processes, each initialises vLLM's distributed state (gloo, TP=2) and
iterates :func:`ckptturbo.integrations.vllm.weights` over vLLM's own tensor-parallel
``cpu_group``; each writes ``{name: tensor}`` to ``OUT.rank<r>``.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.multiprocessing as mp


def worker(rank: int, port: int, extra: str, out: str) -> None:
    import os

    os.environ["VLLM_DIST_IDENT"] = f"ckptturbo-tp-{port}"  # set by vLLM's launcher otherwise
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from ckptturbo.integrations import vllm as ctv

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=2, backend="gloo")
        group = ctv.tensor_parallel_group()
        assert group is not None
        options = ctv.LoaderOptions.parse(json.loads(extra))
        got = {name: tensor.clone() for name, tensor in ctv.weights(options, group)}
    torch.save(got, f"{out}.rank{rank}")


if __name__ == "__main__":
    port, extra, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mp.start_processes(worker, args=(port, extra, out), nprocs=2, start_method="spawn")
