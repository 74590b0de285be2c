"""Chain broadcast vs torch.distributed.broadcast: delivering bytes to every rank.

    python -m benchmarks.broadcast_nccl [--size-mib N] [--world N] [--piece-mib N]

Uses NCCL on CUDA when at least two GPUs exist, else gloo on CPU with 4 processes and a
smaller size. Under torchrun (RANK/WORLD_SIZE set) it uses the launcher's processes.
Two scenarios, each timed as the median of --repeats runs after one warm-up:

* one source: rank 0 holds the buffer, every rank needs it (one chain through all ranks
  vs one ``dist.broadcast``);
* spread sources: each rank holds 1/world of the buffer, as after a balanced storage read
  (one rotated chain per rank, all concurrent, vs one ``dist.broadcast`` per root).

GB/s is the buffer size over the time until every rank has it; ratio = chain / broadcast.
The chain's sink copies into the destination, so both methods end with the same result.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ckptturbo.broadcast import ChainBroadcaster
from ckptturbo.broadcast_schedule import Transfer
from ckptturbo.testing.launcher import run_distributed

from .measure import sync


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of fn over repeats, after one warm-up; ranks start together."""
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _shares(size: int, world: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each rank's share in the spread scenario."""
    step = -(-size // world)
    return [(r * step, max(0, min(step, size - r * step))) for r in range(world)]


def _chain_run(bc: ChainBroadcaster, transfers: list[Transfer], data: torch.Tensor,
               out: torch.Tensor, offsets: dict[int, int]) -> None:
    def source(t: Transfer) -> Iterator[torch.Tensor]:
        yield data[offsets[t.tid]:offsets[t.tid] + t.nbytes]

    def sink(t: Transfer, buffer: torch.Tensor) -> None:
        out[offsets[t.tid]:offsets[t.tid] + t.nbytes].copy_(buffer)

    bc.run(transfers, source, sink)


def _measure(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> list[tuple]:
    size = args.size_mib << 20
    same_everywhere = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device,
                         generator=same_everywhere)
    out = torch.empty_like(data)
    bc = ChainBroadcaster(piece_size=args.piece_mib << 20, max_inflight=args.max_inflight,
                          timeout=600, device=device)
    rows = []

    one = [Transfer(0, size, tuple(range(world)))]
    t_bcast = _timed(lambda: dist.broadcast(data if rank == 0 else out, src=0), device,
                     args.repeats)
    t_chain = _timed(lambda: _chain_run(bc, one, data, out, {0: 0}), device, args.repeats)
    rows.append(("one source", t_bcast, t_chain))

    shares = _shares(size, world)
    spread = [Transfer(r, n, tuple((r + k) % world for k in range(world)))
              for r, (_, n) in enumerate(shares)]
    offsets = {r: off for r, (off, _) in enumerate(shares)}

    def broadcasts() -> None:
        for r, (off, n) in enumerate(shares):
            dist.broadcast((data if rank == r else out)[off:off + n], src=r)

    t_bcast = _timed(broadcasts, device, args.repeats)
    t_chain = _timed(lambda: _chain_run(bc, spread, data, out, offsets), device, args.repeats)
    rows.append(("spread sources", t_bcast, t_chain))
    if not torch.equal(out, data):  # the last run was the chain's: it must deliver everything
        raise AssertionError(f"rank {rank}: chain broadcast delivered wrong bytes")
    return rows


def _report(rows: list[tuple], args: argparse.Namespace, backend: str, world: int) -> None:
    size = args.size_mib << 20
    print(f"backend={backend} world={world} size={args.size_mib} MiB "
          f"piece={args.piece_mib} MiB max_inflight={args.max_inflight} repeats={args.repeats}")
    print(f"{'scenario':<16}{'broadcast s':>12}{'GB/s':>8}{'chain s':>10}{'GB/s':>8}{'ratio':>8}")
    for name, t_bcast, t_chain in rows:
        print(f"{name:<16}{t_bcast:>12.3f}{size / t_bcast / 1e9:>8.2f}"
              f"{t_chain:>10.3f}{size / t_chain / 1e9:>8.2f}{t_bcast / t_chain:>7.2f}x")


def _worker(rank: int, world: int, backend: str, args: argparse.Namespace) -> None:
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rows = _measure(rank, world, args, device)
    if rank == 0:
        _report(rows, args, backend, world)


def main() -> None:
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=gpus if backend == "nccl" else 4)
    parser.add_argument("--size-mib", type=int, default=1024 if backend == "nccl" else 64)
    parser.add_argument("--piece-mib", type=int, default=8 if backend == "nccl" else 4)
    parser.add_argument("--max-inflight", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun: the process group comes from the environment
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
        _worker(dist.get_rank(), dist.get_world_size(), backend, args)
        dist.destroy_process_group()
        return
    run_distributed(_worker, args.world, backend, args, backend=backend, timeout=600)


if __name__ == "__main__":
    main()
