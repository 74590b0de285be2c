"""The one prefetcher and the read-once engine's ordering, on real threads and gloo ranks."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.broadcast import ChainBroadcaster
from ckptturbo.broadcast_schedule import Transfer, source_order
from ckptturbo.prefetch import MemoryBudget, Prefetcher, Read
from ckptturbo.readonce import chain_piece
from ckptturbo.testing.launcher import run_distributed


def test_a_read_larger_than_the_budget_goes_alone_instead_of_stalling() -> None:
    reads = [Read(i, 0, f"r{i}", 0, size) for i, size in enumerate([10, 100, 10])]
    budget = MemoryBudget(50)
    with ThreadPoolExecutor(2) as pool:
        prefetcher = Prefetcher(reads, lambda r: bytes(r.size), pool.submit, budget,
                                streams=4, lookahead=1)
        prefetcher.start()
        for r in reads:
            r.done.wait(timeout=10)
            assert len(prefetcher.wait(r)) == r.size
            assert budget.held <= max(budget.limit, r.size)
            prefetcher.release(r)
        prefetcher.close()
    assert budget.held == 0 and budget.peak == 100


def test_reader_with_read_ahead_smaller_than_a_chunk(tmp_path) -> None:
    sd = {"w": torch.randn(64, 1024), "b": torch.arange(7)}
    url = str(tmp_path / "ckpt")
    ct.save(sd, url).wait(timeout=60)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = ct.TurboReader(url, read_ahead_bytes=1024)
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert reader.bytes_from_storage > 1024


def _pull_order(rank: int, world: int, transfers: list[Transfer], piece: int) -> list[int]:
    pulled: list[int] = []

    def source(t: Transfer):
        pulled.append(t.tid)
        yield torch.full((t.nbytes,), t.tid % 251, dtype=torch.uint8)

    ChainBroadcaster(piece_size=piece, max_inflight=1, timeout=60).run(
        transfers, source, lambda t, buf: None)
    return pulled


def test_source_order_is_the_order_the_broadcaster_pulls_sources() -> None:
    """With one buffer per rank, starts are not monotone in tid; the heads' prefetch order
    must still match the pulls exactly, or a prefetcher would wait on the wrong read."""
    rng = random.Random(7)
    world, piece = 3, 1000
    transfers = []
    for tid in range(24):
        chain = tuple(rng.sample(range(world), rng.randint(1, world)))
        transfers.append(Transfer(tid, rng.choice([0, 1, 999, 2500, 6000]), chain))
    pulled = run_distributed(_pull_order, world, transfers, piece, timeout=90)
    non_monotone = False
    for rank, order in enumerate(pulled):
        want = source_order(transfers, rank, piece, 1)
        assert order == want
        non_monotone |= want != sorted(want)
    assert non_monotone  # the case the order exists for was exercised


def test_chains_forward_small_units_in_pieces_and_large_ones_in_the_callers():
    """A quarter of the largest unit, within [512 KiB, piece_size]: a 2 MiB chunk goes in
    four pieces (it used to cross every hop whole), a 64 MiB one in 8 MiB pieces as before,
    and a caller's smaller piece_size stays."""
    KiB, MiB = 1 << 10, 1 << 20
    assert chain_piece(2 * MiB, 8 * MiB) == 512 * KiB
    assert chain_piece(64 * MiB, 8 * MiB) == 8 * MiB
    assert chain_piece(16 * MiB, 8 * MiB) == 4 * MiB
    assert chain_piece(100 * KiB, 8 * MiB) == 512 * KiB
    assert chain_piece(0, 8 * MiB) == 512 * KiB
    assert chain_piece(2 * MiB, 16 * KiB) == 16 * KiB
