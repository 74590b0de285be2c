"""Storage faults injected in front of a real SeaweedFS by ckptturbo.testing's FaultProxy.

Faults at up to 10% of requests must be absorbed by retries (saves and loads bit-exact,
corrupted bodies never accepted); an outage switched on in the middle of a save must fail
it with StorageError within one deadline and leave the last committed checkpoint intact.
CKPTTURBO_SOAK=1 runs more seeds.
"""
from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import torch

import ckptturbo as ct
from ckptturbo import catalog
from ckptturbo.testing.fault_proxy import FaultProxy, Faults, Outage

SOAK = os.environ.get("CKPTTURBO_SOAK") == "1"
SEEDS = range(20) if SOAK else range(4)
# 10% of requests in all: server errors, throttling, resets, and bodies cut short or corrupted
TEN_PERCENT = Faults(error_500=0.025, slow_down=0.025, reset=0.02, truncate=0.015, flip_byte=0.015)
CHUNKING = {"chunk_size": 64 << 10, "pack_threshold": 16 << 10}


def _state(seed: int, tensors: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(48 << 10, generator=g) for i in range(tensors)}


def _load(sd: dict[str, torch.Tensor], url: str, options: dict) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    ct.load(out, url, storage_options=options)
    return out


def test_saves_and_loads_are_bit_exact_at_ten_percent_faults(s3_server):
    injected: Counter[str] = Counter()
    for seed in SEEDS:
        sd = _state(seed)
        with FaultProxy(s3_server.endpoint, seed=seed, faults=TEN_PERCENT) as proxy:
            options = proxy.storage_options(s3_server.storage_options)
            url = f"{s3_server.url(f'faults-{seed}')}/step-1"
            ct.save(sd, url, storage_options=options, **CHUNKING).wait(timeout=120)
            loaded = _load(sd, url, options)
            injected.update(proxy.stats().faults)
        for name, tensor in sd.items():
            assert torch.equal(loaded[name], tensor), (seed, name)
    # the run really met every kind of fault it claims to survive
    for kind in ("error_500", "slow_down", "reset", "truncate", "flip_byte"):
        assert injected[kind] > 0, injected


@pytest.fixture
def short_deadline(monkeypatch):
    monkeypatch.setenv("CKPTTURBO_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("CKPTTURBO_DEADLINE", "4")
    monkeypatch.setenv("CKPTTURBO_OUTAGE_COOLDOWN", "30")


@pytest.mark.parametrize("outage", [Outage.SLOW_DOWN, Outage.REFUSE, Outage.BLACK_HOLE])
def test_outage_in_the_middle_of_a_save_fails_within_the_deadline(s3_server, short_deadline,
                                                                   outage):
    """200 chunks behind 20 ms per request: the outage starts while they upload."""
    run = s3_server.url(f"outage-{outage.value}")
    sd = _state(1)
    with FaultProxy(s3_server.endpoint, latency_s=0.02) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        ct.save(sd, f"{run}/step-1", storage_options=options, **CHUNKING).wait(timeout=120)
        big = _state(2, tensors=50)  # 50 x 192 KiB in 64 KiB chunks: 150 chunks and more
        handle = ct.save(big, f"{run}/step-2", storage_options=options,
                         chunk_size=32 << 10, pack_threshold=8 << 10)
        handle.staged.result(timeout=60)
        proxy.set_outage(outage)
        started = time.monotonic()
        with pytest.raises(ct.StorageError):
            handle.wait(timeout=120)
        # one deadline (4 s) plus the request under way (1 s) and slack for a loaded machine
        assert time.monotonic() - started < 4 + 1 + 5
        proxy.set_outage(Outage.NONE)
    # the store is healthy again: the last committed checkpoint is intact, the failed one
    # is invisible (a fresh process's view, without the outage memory of this one's store)
    direct = s3_server.storage_options
    assert [c.name for c in catalog.list_checkpoints(run, direct)] == ["step-1"]
    loaded = _load(sd, f"{run}/step-1", direct)
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor), name
    with pytest.raises(ct.CheckpointNotFound):
        _load(big, f"{run}/step-2", direct)


def test_corrupted_manifest_in_transit_is_never_trusted(s3_server):
    """Every manifest GET has one byte flipped: the load fails (botocore's response checksum
    or ckptturbo's manifest checksum); it never returns values."""
    run = s3_server.url("flip-manifest")
    sd = _state(3)
    ct.save(sd, f"{run}/step-1", storage_options=s3_server.storage_options, **CHUNKING).wait(
        timeout=120)
    faults = Faults(flip_byte=1.0, methods=("GET",), path_contains="manifest.json")
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        with pytest.raises(ct.CkptTurboError):
            ct.load(out, f"{run}/step-1", storage_options=options)
        assert proxy.stats().faults.get("flip_byte", 0) > 0
    assert all(not v.any() for v in out.values())


def test_manifest_corrupted_once_in_transit_is_read_again(s3_server):
    """The first manifest GET has one byte flipped, the next ones pass: the load reads it
    once more and returns the right values (seed 4 of the soak's 10% run met this)."""
    run = s3_server.url("flip-manifest-once")
    sd = _state(4)
    ct.save(sd, f"{run}/step-1", storage_options=s3_server.storage_options, **CHUNKING).wait(
        timeout=120)
    faults = Faults(flip_byte=1.0, methods=("GET",), path_contains="manifest.json", limit=1)
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        loaded = _load(sd, f"{run}/step-1", proxy.storage_options(s3_server.storage_options))
        assert proxy.stats().faults == {"flip_byte": 1}
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor), name


def test_manifest_is_read_in_one_bounded_request(s3_server, monkeypatch):
    """One GET per manifest read, no HEAD first; a manifest over the limit, or an empty
    one, is refused as FormatError naming it, not read whole or taken for a storage error."""
    from ckptturbo import runs
    from ckptturbo.store import Store

    run = s3_server.url("manifest-reads")
    sd = _state(7)
    ct.save(sd, f"{run}/step-1", storage_options=s3_server.storage_options, **CHUNKING).wait(
        timeout=120)
    store = Store(run, s3_server.storage_options)
    requests = []
    store.fs.s3.meta.events.register(
        "before-send.s3", lambda request, **_: requests.append((request.method, request.url)))
    _load(sd, f"{run}/step-1", s3_server.storage_options)
    assert [m for m, url in requests if "manifest.json" in url] == ["GET"]
    size = len(store.get(store.join(store.root, "step-1", "manifest.json")))
    monkeypatch.setattr(runs, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ct.FormatError, match=f"step-1/manifest.json is over {size - 1} bytes"):
        _load(sd, f"{run}/step-1", s3_server.storage_options)
    monkeypatch.undo()
    store.put(store.join(store.root, "step-1", "manifest.json"), b"")
    with pytest.raises(ct.FormatError, match="step-1/manifest.json"):
        _load(sd, f"{run}/step-1", s3_server.storage_options)


@pytest.mark.parametrize("kind", ["stall_upload", "stall_download"])
def test_partition_in_the_middle_of_a_body_fails_within_the_deadline(s3_server, short_deadline,
                                                                     kind):
    """Every chunk transfer goes silent part-way through its body, the connection open:
    the save (or load) fails with StorageError within one deadline, not once per chunk."""
    run = s3_server.url(f"partition-{kind}")
    sd = _state(4)
    url = f"{run}/step-1"
    upload = kind == "stall_upload"
    if not upload:
        ct.save(sd, url, storage_options=s3_server.storage_options, **CHUNKING).wait(timeout=120)
    faults = Faults(**{kind: 1.0}, methods=("PUT",) if upload else ("GET",),
                    path_contains="/chunks/")
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        started = time.monotonic()
        with pytest.raises(ct.StorageError):
            if upload:
                ct.save(sd, url, storage_options=options, **CHUNKING).wait(timeout=120)
            else:
                _load(sd, url, options)
        assert time.monotonic() - started < 4 + 1 + 5
        assert proxy.stats().faults.get(kind, 0) > 0
    names = [c.name for c in catalog.list_checkpoints(run, s3_server.storage_options)]
    assert names == ([] if upload else ["step-1"])


def test_bodies_that_stall_now_and_then_are_retried_bit_exact(s3_server, monkeypatch):
    """16% of requests go silent mid-body (8% uploads, 8% downloads): each such attempt times
    out after the request timeout and is retried; the save and load are bit-exact."""
    monkeypatch.setenv("CKPTTURBO_REQUEST_TIMEOUT", "1")
    sd = _state(5)
    url = f"{s3_server.url('stalls')}/step-1"
    with FaultProxy(s3_server.endpoint, seed=1,
                    faults=Faults(stall_upload=0.08, stall_download=0.08)) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        ct.save(sd, url, storage_options=options, **CHUNKING).wait(timeout=120)
        loaded = _load(sd, url, options)
        stalls = proxy.stats().faults
    assert stalls.get("stall_upload", 0) > 0 and stalls.get("stall_download", 0) > 0, stalls
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("validation", [False, True])
def test_memoryview_bodies_are_sent_whole_and_exact(s3_server, validation):
    """Bodies go out as views of the caller's buffer (no copy) unless the user turned
    botocore's parameter validation back on; either way every byte arrives, also for a
    multi-dimensional view of non-byte items (whose len() is not its byte count) and
    for a multipart upload."""
    from ckptturbo.store import Store

    options = dict(s3_server.storage_options, config_kwargs={"parameter_validation": validation})
    store = Store(s3_server.url(), options, multipart_threshold=12 << 20, part_size=5 << 20)
    assert store._body_views is not validation
    grid = torch.arange(6 * (1 << 20), dtype=torch.float32).reshape(6, -1)
    bodies = {"grid": memoryview(grid.numpy()),  # 24 MiB, 2-D, format "f": multipart
              "slice": memoryview(grid.numpy().reshape(-1).view("uint8"))[3:(1 << 20) + 3],
              "bytes": b"plain bytes"}
    for name, body in bodies.items():
        path = store.join(store.root, name)
        store.put(path, body)
        assert store.get(path) == bytes(body), name
        assert store.get(path, 5, 9) == bytes(body)[5:9], name


def test_payload_is_unsigned_and_plain_http_puts_carry_a_crc32(s3_server):
    """No SHA-256 of the body (UNSIGNED-PAYLOAD, TLS or not); over plain HTTP each single
    PUT carries a CRC32 instead; the user's settings win."""
    from ckptturbo.store import Store, _s3_config

    def signing(options):
        return _s3_config(options, 8)["s3"]["payload_signing_enabled"]

    assert signing({}) is False  # AWS itself: https
    assert signing({"client_kwargs": {"endpoint_url": "https://minio.example:9000"}}) is False
    assert signing({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}) is False
    assert signing({"config_kwargs": {"s3": {"payload_signing_enabled": True}}}) is True
    assert _s3_config({}, 32)["max_pool_connections"] == 32
    pool_of_4 = _s3_config({"config_kwargs": {"max_pool_connections": 4}}, 32)
    assert pool_of_4["max_pool_connections"] == 4
    assert Store(s3_server.url(), s3_server.storage_options)._crc_puts is True
    signed = {**s3_server.storage_options,
              "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    assert Store(s3_server.url(), signed)._crc_puts is False
    tls = {**s3_server.storage_options, "client_kwargs": {"endpoint_url": "https://127.0.0.1:1"}}
    assert Store(s3_server.url(), tls)._crc_puts is False


def test_stores_of_one_endpoint_share_one_client(s3_server):
    """A second Store with the same options reuses the first's filesystem and S3 client,
    also after the client was made (botocore writes into the config it is given)."""
    from ckptturbo.store import Store

    first = Store(s3_server.url(), s3_server.storage_options)
    first.put(first.join(first.root, "x"), b"made the client")
    second = Store(s3_server.url(), s3_server.storage_options)
    assert second.fs is first.fs


def test_a_body_damaged_on_its_way_up_is_refused_and_sent_again(s3_server):
    """The proxy inverts one byte of three chunk uploads: the store refuses each (its CRC32
    disagrees), the retry sends it again, and what lands is what was saved."""
    sd = _state(6)
    url = f"{s3_server.url('flip-upload')}/step-1"
    faults = Faults(flip_upload=1.0, methods=("PUT",), path_contains="/chunks/", limit=3)
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        ct.save(sd, url, storage_options=proxy.storage_options(s3_server.storage_options),
                **CHUNKING).wait(timeout=120)
        assert proxy.stats().faults == {"flip_upload": 3}
    loaded = _load(sd, url, s3_server.storage_options)
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor), name


def test_large_reads_go_out_as_concurrent_ranged_parts(s3_server):
    """A read larger than read_part_size is split into ranged GETs in flight together
    (one capped connection per object would bound the load); every byte lands in place,
    and an object shorter than the read is a short read, not a failed request."""
    from ckptturbo.errors import ShortReadError
    from ckptturbo.store import Store

    blob = os.urandom((1 << 20) + 12345)
    with FaultProxy(s3_server.endpoint, latency_s=0.05) as proxy:
        store = Store(s3_server.url(), proxy.storage_options(s3_server.storage_options))
        store.read_part_size = 64 << 10
        path = store.join(store.root, "blob")
        store.put(path, blob)
        before = proxy.stats().requests
        out = bytearray(len(blob) - 7)
        store.get_into(path, memoryview(out), start=7)
        stats = proxy.stats()
        with pytest.raises(ShortReadError, match="short read"):
            store.get_into(path, memoryview(bytearray(len(blob) + (200 << 10))))
    assert bytes(out) == blob[7:]
    assert stats.requests - before == 17  # ceil((1 MiB + 12338) / 64 KiB) ranged GETs
    assert stats.peak_in_flight >= 8  # in flight together, not one after another


def test_ranged_parts_are_bit_exact_at_ten_percent_faults(s3_server, monkeypatch):
    """The same faults as above, with every chunk read in 16 KiB parts: a failed part
    fails its attempt, which is retried whole."""
    from ckptturbo.store import Store

    monkeypatch.setattr(Store, "read_part_size", 16 << 10)
    sd = _state(7)
    with FaultProxy(s3_server.endpoint, seed=7, faults=TEN_PERCENT) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        url = f"{s3_server.url('parts-faults')}/step-1"
        ct.save(sd, url, storage_options=options, **CHUNKING).wait(timeout=120)
        loaded = _load(sd, url, options)
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor), name


def test_many_deletes_go_in_few_requests_and_remove_every_object(s3_server, tmp_path):
    """A commit removes one marker per rank and a gc every doomed chunk: on S3, 1,003
    paths (3 of them absent) go in two DeleteObjects requests, not 1,003 DELETEs, and
    every object is gone; on a local disk the same paths go, and an absent one is named
    once the others are deleted."""
    from ckptturbo.store import Store

    store = Store(s3_server.url("bulk-deletes"), s3_server.storage_options)
    paths = [store.join(store.root, "pending", f"m{i:04d}") for i in range(1003)]
    store.map(lambda p: store.put(p, b"x", durable=False), paths[:1000])
    requests = []
    store.fs.s3.meta.events.register(
        "before-send.s3", lambda request, **_: requests.append(request.method))
    store.delete(paths)
    assert Counter(requests) == Counter({"POST": 2})
    assert store.list_files(store.join(store.root, "pending")) == []

    local = Store(str(tmp_path), None)
    paths = [local.join(local.root, f"m{i:04d}") for i in range(600)]
    for p in paths[:599]:
        local.put(p, b"x", durable=False)
    with pytest.raises(ct.CheckpointNotFound, match="m0599"):
        local.delete(paths)
    assert os.listdir(tmp_path) == []
