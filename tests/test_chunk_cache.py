"""The node's cache tier for chunks (``cache_dir``): processes of one node that load the
same checkpoint at once read each chunk from storage once between them (SeaweedFS behind
the byte-counting proxy), a later load reads none, and a damaged entry is read again."""
from __future__ import annotations

import multiprocessing
import os

import torch

import ckptturbo as ct
from ckptturbo.testing.proxy_process import ProxyProcess


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(256, 512, generator=gen) for i in range(6)}


def _load(url: str, options: dict, cache_dir: str, start, out: str) -> None:
    start.wait(60)  # both processes ask for the chunks together
    got = {c.name: c.tensor for c in ct.load_changes(url, {}, storage_options=options,
                                                     cache_dir=cache_dir)}
    torch.save(got, out)


def test_processes_of_a_node_read_each_chunk_once(s3_server, tmp_path):
    tensors = _tensors()
    url = s3_server.url("node-cache") + "/step-1"
    ct.save(tensors, url, storage_options=s3_server.storage_options).wait(120)
    size = sum(t.nbytes for t in tensors.values())
    cache_dir = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    with ProxyProcess(s3_server.endpoint) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        start = ctx.Barrier(2)
        procs = [ctx.Process(target=_load, args=(url, options, cache_dir, start,
                                                 str(tmp_path / f"p{i}.pt")))
                 for i in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0
        together = proxy.control.stats().bytes_down
        proxy.control.reset_stats()
        again = dict((c.name, c.tensor) for c in ct.load_changes(
            url, {}, storage_options=options, cache_dir=cache_dir))
        later = proxy.control.stats().bytes_down

        entries = [os.path.join(d, f) for d, _, files in os.walk(cache_dir) for f in files
                   if len(os.path.basename(d)) == 2 and not f.startswith(".tmp-")]
        damaged = os.path.getsize(entries[0]) - 40  # an entry: magic, BLAKE3 digest, bytes
        with open(entries[0], "r+b") as f:  # a bit flipped at rest in the cache
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        proxy.control.reset_stats()
        healed = dict((c.name, c.tensor) for c in ct.load_changes(
            url, {}, storage_options=options, cache_dir=cache_dir))
        reread = proxy.control.stats().bytes_down
    for i in range(2):
        got = torch.load(tmp_path / f"p{i}.pt")
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert all(torch.equal(again[k], v) and torch.equal(healed[k], v) for k, v in tensors.items())
    assert size <= together < 1.1 * size, (together, size)  # once, not twice
    assert later < 64 << 10, later  # the manifest only
    assert damaged <= reread - later < damaged + (16 << 10), reread  # the damaged chunk only
