"""The local-disk cache tier: zero requests on a second load, never serves damaged bytes."""
from __future__ import annotations

import os

import fsspec
import torch
from safetensors.torch import save_file
from test_stream import CountingS3, assert_same, counting, sharded_model, upload_dir

from ckptturbo.store import Store
from ckptturbo.stream import stream_safetensors
from ckptturbo.stream.cache import DiskCache, cache_key

fsspec.register_implementation("counts3", CountingS3, clobber=True)


def _load(url: str, server, cache_dir: str, **kwargs) -> tuple[dict, dict]:
    stream = stream_safetensors(counting(url), storage_options=server.storage_options,
                                cache_dir=cache_dir, chunk_size=128 << 10, **kwargs)
    return dict(stream), stream.stats


def test_second_load_makes_no_request_at_all(s3_server, tmp_path):
    want = sharded_model(str(tmp_path / "m"), size=200_000)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    cache = str(tmp_path / "cache")
    CountingS3.reset()
    got, stats = _load(url, s3_server, cache)
    assert_same(got, want)
    assert CountingS3.calls["get_object"] > 0 and stats["cache_hits"] == 0
    CountingS3.reset()
    got, stats = _load(url, s3_server, cache)
    assert_same(got, want)
    assert sum(CountingS3.calls.values()) == 0, CountingS3.calls  # not even a LIST or HEAD
    assert stats["requests"] == 0 and stats["bytes_fetched"] == 0 and stats["cache_hits"] > 0


def test_corrupt_entry_is_dropped_and_refetched(s3_server, tmp_path):
    want = {f"t{i}": torch.randn(50_000) for i in range(4)}
    save_file(want, str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path), None)
    cache = tmp_path / "cache"
    _load(url, s3_server, str(cache))
    entries = sorted((p for p in cache.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    victim = entries[0]  # the largest entry: a range of tensor data
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    CountingS3.reset()
    got, stats = _load(url, s3_server, str(cache))
    assert_same(got, want)  # the damaged range was not served
    assert stats["cache_corrupt"] == 1 and CountingS3.calls["get_object"] == 1
    got, stats = _load(url, s3_server, str(cache))  # and it was rewritten
    assert stats["requests"] == 0


def test_changed_object_is_detected_with_validation(s3_server, tmp_path):
    first = {"a": torch.zeros(40_000)}
    save_file(first, str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path))
    cache = str(tmp_path / "cache")
    assert_same(_load(url, s3_server, cache)[0], first)
    second = {"a": torch.ones(50_000)}
    save_file(second, str(tmp_path / "m.safetensors"))
    store = Store(url, s3_server.storage_options)
    store.put(store.join(store.root, "m.safetensors"), (tmp_path / "m.safetensors").read_bytes())
    # documented staleness rule: without validation the cached model is served as it was
    assert_same(_load(url, s3_server, cache)[0], first)
    got, stats = _load(url, s3_server, cache, cache_validate=True)
    assert_same(got, second)
    assert stats["requests"] > 0


def test_lru_eviction_within_cap(tmp_path):
    cache = DiskCache(tmp_path / "c", max_bytes=10_000)
    keys = [cache_key("k", i) for i in range(6)]
    for i, key in enumerate(keys[:4]):
        cache.put(key, bytes([i]) * 2000)
        os.utime(cache._path(key), (1000 + i, 1000 + i))  # distinct, increasing ages
    assert cache.get(keys[0]) == bytes([0]) * 2000  # a hit makes it the most recent
    cache.put(keys[4], b"x" * 2000)
    cache.put(keys[5], b"y" * 2000)
    assert cache.total_bytes <= 10_000
    assert cache.get(keys[1]) is None and cache.get(keys[2]) is None  # least recently used
    assert cache.get(keys[0]) is not None and cache.get(keys[5]) == b"y" * 2000
    cache.put(cache_key("huge"), b"z" * 20_000)  # larger than the cap: not cached
    assert cache.get(cache_key("huge")) is None


def test_truncated_entry_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path / "c")
    key = cache_key("t")
    cache.put(key, b"abc" * 1000)
    path = cache._path(key)
    path.write_bytes(path.read_bytes()[:-1])
    assert cache.get(key) is None and not path.exists()
    assert cache.stats["corrupt"] == 1


def test_cache_with_local_files(tmp_path):
    want = sharded_model(str(tmp_path / "m"))
    cache = str(tmp_path / "cache")
    first = stream_safetensors(str(tmp_path / "m"), cache_dir=cache, chunk_size=32 << 10)
    assert_same(dict(first), want)
    second = stream_safetensors(str(tmp_path / "m"), cache_dir=cache, chunk_size=32 << 10)
    assert_same(dict(second), want)
    assert second.stats["requests"] == 0
