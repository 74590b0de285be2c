"""Streaming safetensors: exact round trips, strict headers, bounded memory, read-once.

Everything runs against real files and a real S3 server (SeaweedFS on loopback). Requests
are counted by a subclass of the real s3fs filesystem that counts what it sends.
"""
from __future__ import annotations

import collections
import json
import os
import time
import tracemalloc
import warnings

import fsspec
import pytest
import s3fs
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptturbo.errors import CheckpointNotFound, FormatError, MismatchError
from ckptturbo.runtime import default_runtime
from ckptturbo.store import Store
from ckptturbo.stream import nextfile, safe_open, stream_safetensors
from ckptturbo.stream.calibrate import calibrate
from ckptturbo.stream.format import TensorInfo, header_length, parse_header
from ckptturbo.stream.nextfile import next_shard
from ckptturbo.stream.profiles import PROFILES, load_saved
from ckptturbo.stream.readahead import grid_plan, peak_held, plan_reads
from ckptturbo.testing.launcher import run_distributed
from tests.waiting import wait_until

MiB = 1 << 20


class CountingS3(s3fs.S3FileSystem):
    """The real s3fs client, counting every S3 API call and every byte it returns."""

    protocol = ("counts3",)
    calls: collections.Counter = collections.Counter()
    nbytes = 0
    from_start: list[str] = []  # files read from their first byte (header GETs)

    async def _call_s3(self, method, *args, **kwargs):
        CountingS3.calls[method] += 1
        return await super()._call_s3(method, *args, **kwargs)

    async def _cat_file(self, *args, **kwargs):
        data = await super()._cat_file(*args, **kwargs)
        CountingS3.nbytes += len(data)
        if kwargs.get("start") in (0, None) and str(args[0]).endswith(".safetensors"):
            CountingS3.from_start.append(os.path.basename(str(args[0])))
        return data

    @classmethod
    def reset(cls) -> None:
        cls.calls.clear()
        cls.nbytes = 0
        cls.from_start = []


fsspec.register_implementation("counts3", CountingS3, clobber=True)


def counting(url: str) -> str:
    return url.replace("s3://", "counts3://", 1)


def all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {
        "f32": torch.randn(33, 17, generator=g),
        "f64": torch.randn(9, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, 5, 6, generator=g).half(),
        "bf16": torch.randn(300, 70, generator=g).bfloat16(),
        "i8": torch.randint(-128, 127, (50,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (51,), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-999, 999, (7, 3), dtype=torch.int16, generator=g),
        "i32": torch.randint(-999, 999, (11,), dtype=torch.int32, generator=g),
        "i64": torch.randint(-999, 999, (13,), dtype=torch.int64, generator=g),
        "bool": torch.rand(29, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "empty2": torch.empty(3, 0, dtype=torch.int32),
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            t[name] = torch.randn(40, generator=g).to(getattr(torch, name))
    for name in ("uint16", "uint32", "uint64"):
        values = torch.randint(0, 999, (5,), dtype=torch.int64, generator=g)
        t[name] = values.to(getattr(torch, name))
    return t


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(raw(got[k]), raw(v)), k


def sharded_model(directory: str, nshards: int = 3, per_shard: int = 3, size: int = 40_000,
                  index: bool = True) -> dict[str, torch.Tensor]:
    """A Hugging Face style sharded model: shards plus model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    everything, weight_map = {}, {}
    for s in range(nshards):
        name = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        shard = {f"layer{s}.w{i}": torch.randn(size // 4 + 1000 * i, generator=g)
                 for i in range(per_shard)}
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        everything.update(shard)
        weight_map.update(dict.fromkeys(shard, name))
    if index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return everything


def upload_dir(server, local: str, name: str | None = None) -> str:
    url = server.url(name)
    store = Store(url, server.storage_options)
    for entry in sorted(os.listdir(local)):
        with open(os.path.join(local, entry), "rb") as f:
            store.put(store.join(store.root, entry), f.read())
    return url


# --- round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [None, 256 << 10, 8192])
def test_all_dtypes_round_trip_local(tmp_path, limit):
    want = all_dtypes()
    path = str(tmp_path / "m.safetensors")
    save_file(want, path, metadata={"k": "v"})
    stream = stream_safetensors(path, memory_limit=limit)
    got = dict(stream)
    assert_same(got, want)
    assert stream.stats["bytes_fetched"] == os.path.getsize(path)  # no byte read twice
    if limit:
        assert stream.stats["peak_bytes_held"] <= limit


def test_yielded_tensors_are_fresh_and_own_their_memory(tmp_path):
    want = {f"t{i}": torch.full((1000,), float(i)) for i in range(20)}
    save_file(want, str(tmp_path / "m.safetensors"))
    got = dict(stream_safetensors(str(tmp_path / "m.safetensors"), chunk_size=64 << 10))
    for t in got.values():
        assert t.untyped_storage().nbytes() == t.nbytes  # not a view of a shared range buffer
        t.add_(100)  # writable, and writing one must not change another
    assert all(torch.equal(got[n], want[n] + 100) for n in want)


def test_order_is_file_then_offset_and_dtype_cast(tmp_path):
    want = sharded_model(str(tmp_path / "m"))
    names = [n for n, _ in stream_safetensors(str(tmp_path / "m"))]
    assert names == sorted(want, key=lambda n: (int(n[5]), n))  # shards in order, then offsets
    got = dict(stream_safetensors(str(tmp_path / "m"), dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    mixed = {"f": torch.ones(3), "i": torch.ones(3, dtype=torch.int64)}
    save_file(mixed, str(tmp_path / "x.safetensors"))
    got = dict(stream_safetensors(str(tmp_path / "x.safetensors"), dtype=torch.float16))
    assert got["f"].dtype == torch.float16 and got["i"].dtype == torch.int64


@pytest.mark.parametrize("index", [True, False])
def test_sharded_local_with_and_without_index(tmp_path, index):
    want = sharded_model(str(tmp_path / "m"), index=index)
    assert_same(dict(stream_safetensors(str(tmp_path / "m"), chunk_size=16 << 10, streams=3)), want)


def test_list_of_urls_and_names_filter(tmp_path):
    want = sharded_model(str(tmp_path / "m"))
    files = sorted(str(p) for p in (tmp_path / "m").glob("*.safetensors"))
    assert_same(dict(stream_safetensors(files)), want)
    pick = ["layer0.w1", "layer2.w0"]
    stream = stream_safetensors(str(tmp_path / "m"), names=pick, chunk_size=16 << 10)
    assert_same(dict(stream), {k: want[k] for k in pick})
    assert stream.stats["bytes_fetched"] < sum(os.path.getsize(f) for f in files)
    with pytest.raises(MismatchError, match="nope"):
        stream_safetensors(str(tmp_path / "m"), names=["nope"])


def test_index_naming_a_missing_tensor_is_an_error(tmp_path):
    sharded_model(str(tmp_path / "m"))
    index = tmp_path / "m" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(MismatchError, match="ghost"):
        stream_safetensors(str(tmp_path / "m"))


def test_index_leaves_out_a_file_whose_header_was_fetched_early_s3(s3_server, tmp_path):
    # header GETs start while the index is read: one for a file the index does not name
    # (here not even valid) is dropped, its kept bytes returned to the budget
    want = sharded_model(str(tmp_path / "m"), size=300_000)
    (tmp_path / "m" / "consolidated.safetensors").write_bytes(b"\xff" * 4096)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    stream = stream_safetensors(url, storage_options=s3_server.storage_options,
                                chunk_size=256 << 10, streams=4)
    assert [f.entry.path.rsplit("/", 1)[-1] for f in stream.files] == [
        f"model-{s:05d}-of-00003.safetensors" for s in (1, 2, 3)]
    assert_same(dict(stream), want)
    assert stream.budget.held == 0


def test_large_reads_go_out_as_concurrent_part_gets_s3(s3_server, tmp_path, monkeypatch):
    # each connection to an object store is capped, so a range of several parts is fetched
    # as that many GETs at once, their bodies copied straight into the tensors
    monkeypatch.setattr(Store, "read_part_size", 128 << 10)
    want = sharded_model(str(tmp_path / "m"), size=600_000)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    CountingS3.reset()
    stream = stream_safetensors(counting(url), storage_options=s3_server.storage_options,
                                chunk_size=512 << 10, streams=2)
    reads = [r for rs in stream._reads for r in rs]
    assert_same(dict(stream), want)
    sizes = sum(os.path.getsize(p) for p in (tmp_path / "m").glob("*.safetensors"))
    assert stream.stats["bytes_fetched"] == sizes  # the parts tile each range: nothing twice
    assert CountingS3.calls["get_object"] > len(reads) + 1  # ranges of 512 KiB in 4 parts


def test_sharded_round_trip_s3(s3_server, tmp_path):
    want = sharded_model(str(tmp_path / "m"), size=300_000)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    CountingS3.reset()
    stream = stream_safetensors(counting(url), storage_options=s3_server.storage_options,
                                chunk_size=256 << 10, streams=4)
    assert_same(dict(stream), want)
    sizes = sum(os.path.getsize(p) for p in (tmp_path / "m").glob("*.safetensors"))
    assert stream.stats["bytes_fetched"] == sizes  # headers included, nothing twice
    assert CountingS3.calls["head_object"] == 0  # the listing gave sizes


def test_single_file_s3_and_missing(s3_server, tmp_path):
    want = all_dtypes()
    save_file(want, str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path))
    assert_same(dict(stream_safetensors(url + "/m.safetensors",
                                        storage_options=s3_server.storage_options)), want)
    with pytest.raises(CheckpointNotFound):
        stream_safetensors(url + "/absent.safetensors", storage_options=s3_server.storage_options)


def test_reads_go_ahead_by_bytes_not_files_while_the_consumer_waits(tmp_path):
    """A consumer stuck on the first tensor does not stop reads of later files while the
    budget allows them; an explicit lookahead still caps the files."""
    sharded_model(str(tmp_path / "m"), nshards=4, size=4_000_000)
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    stream = stream_safetensors(str(tmp_path / "m"), chunk_size=MiB, streams=4)
    it = iter(stream)
    next(it)  # then lag: nothing more is consumed
    assert wait_until(lambda: stream.source.counters()["bytes_fetched"] == total)
    stream.close()
    capped = stream_safetensors(str(tmp_path / "m"), chunk_size=MiB, streams=4, lookahead=1)
    it = iter(capped)
    next(it)
    # wait until the window provably holds the reads back: every read of the first file is
    # in, a pump now issues whatever the bounds allow (a read that just finished may not
    # have run its own yet), and every read issued has arrived and been counted
    assert wait_until(lambda: all(r.done.is_set() for r in capped._reads[0]))
    capped._waiter.start()
    assert wait_until(lambda: all(r.done.is_set() for reads in capped._reads for r in reads
                                  if r.reserved))
    # header GETs (1 MiB each) and the first file only
    assert capped.source.counters()["bytes_fetched"] <= os.path.getsize(files[0]) + 3 * MiB
    capped.close()


def test_start_reads_before_the_first_next(tmp_path):
    want = sharded_model(str(tmp_path / "m"), nshards=2, size=200_000)
    total = sum(os.path.getsize(f) for f in (tmp_path / "m").glob("*.safetensors"))
    stream = stream_safetensors(str(tmp_path / "m"), chunk_size=64 << 10, streams=4).start()
    assert wait_until(lambda: stream.source.counters()["bytes_fetched"] == total)
    assert_same(dict(stream), want)


def test_first_reads_ramp_up_then_join_the_grid(tmp_path):
    from ckptturbo.stream.ranges import RAMP_START

    g = torch.Generator().manual_seed(3)
    save_file({f"t{i}": torch.randn(4 * MiB // 4, generator=g) for i in range(12)},
              str(tmp_path / "a.safetensors"))
    save_file({"u": torch.randn(24 * MiB // 4, generator=g)}, str(tmp_path / "b.safetensors"))
    stream = stream_safetensors(str(tmp_path), chunk_size=8 * MiB, streams=2)
    first, second = stream._reads
    sizes = [r.size for r in first]
    # after the header GET
    assert sizes[1:5] == [RAMP_START, RAMP_START, 2 * RAMP_START, 2 * RAMP_START]
    assert max(sizes) == 8 * MiB
    assert second[1].size == 8 * MiB  # a later file: the header GET, then the grid at once
    assert [r.end for r in first[:-1]] == [r.start for r in first[1:]]
    stream.close()


def test_reads_spread_the_whole_stream_over_the_streams(tmp_path):
    # 4 files of 16 MiB, 4 streams: without a file window reads run ahead into later
    # files, so ranges are up to 16 MiB (a quarter of the stream), not a quarter of each
    # file: a later file is its header GET's 1 MiB and one read of the rest; with
    # lookahead=1 only one file is in flight and each file is cut in 4 MiB ranges
    g = torch.Generator().manual_seed(4)
    for i in range(4):
        save_file({f"f{i}.t{j}": torch.randn(MiB, generator=g) for j in range(4)},
                  str(tmp_path / f"s{i}.safetensors"))
    stream = stream_safetensors(str(tmp_path), chunk_size=32 * MiB, streams=4)
    assert all(len(reads) == 2 and reads[1].size > 14 * MiB for reads in stream._reads[1:])
    stream.close()
    windowed = stream_safetensors(str(tmp_path), chunk_size=32 * MiB, streams=4, lookahead=1)
    assert max(r.size for reads in windowed._reads for r in reads) == 4 * MiB
    windowed.close()


@pytest.mark.parametrize("chunk", [64 << 10, 4 * MiB])
def test_views_are_read_only_copies_of_nothing_with_the_same_values(tmp_path, chunk):
    want = sharded_model(str(tmp_path / "m"), size=300_000)
    got = dict(stream_safetensors(str(tmp_path / "m"), chunk_size=chunk, streams=3, views=True))
    assert_same(got, want)
    if chunk > 1 << 20:  # else every tensor spans reads and is assembled into fresh memory
        # tensors inside one read are views of its bytes: neighbours in the file are
        # neighbours in memory
        a, b = got["layer0.w0"], got["layer0.w1"]
        assert b.data_ptr() - a.data_ptr() == a.nbytes


@pytest.mark.parametrize("where", ["local", "s3", "cache"])
def test_views_raise_no_warning_and_stay_views(tmp_path, s3_server, where):
    """Views are of buffers the stream read into, not of immutable bytes: torch warns of
    no read-only buffer (any warning fails here), and the tensors are still views (bytes
    from the disk cache are copied out instead)."""
    want = sharded_model(str(tmp_path / "m"), size=300_000)
    url, so = str(tmp_path / "m"), None
    if where == "s3":
        url, so = upload_dir(s3_server, url), s3_server.storage_options
    cache = {"cache_dir": str(tmp_path / "cache")} if where == "cache" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2 if cache else 1):  # the second load reads the cache alone
            stream = stream_safetensors(url, storage_options=so, chunk_size=4 * MiB,
                                        streams=3, views=True, **cache)
            got = dict(stream)
    assert_same(got, want)
    if not cache:
        a, b = got["layer0.w0"], got["layer0.w1"]
        assert b.data_ptr() - a.data_ptr() == a.nbytes
    assert stream.stats["cache_hits" if cache else "bytes_fetched"] > 0


# --- memory bound --------------------------------------------------------------------------

def test_memory_bound_small_limit_over_8mib_model(tmp_path):
    g = torch.Generator().manual_seed(2)
    want = {"big": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB: larger than the limit
            **{f"s{i}": torch.randn(64 << 10, generator=g) for i in range(20)}}  # 20 x 256 KiB
    path = str(tmp_path / "m.safetensors")
    save_file(want, path)
    assert os.path.getsize(path) > 8 * MiB
    limit = 1 * MiB
    stream = stream_safetensors(path, memory_limit=limit, chunk_size=4 * MiB, streams=8)
    got = {}
    for name, t in stream:
        got[name] = t
        time.sleep(0.002)  # workload, not a wait: a slow consumer lets the prefetcher run ahead
    assert_same(got, want)
    assert 0 < stream.stats["peak_bytes_held"] <= limit


def test_memory_bound_s3(s3_server, tmp_path):
    want = {f"t{i}": torch.randn(100_000) for i in range(20)}  # 8 MB
    save_file(want, str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path))
    stream = stream_safetensors(url, storage_options=s3_server.storage_options, memory_limit=MiB)
    assert_same(dict(stream), want)
    assert stream.stats["peak_bytes_held"] <= MiB


# --- refusing pickles and bad files --------------------------------------------------------

@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".pkl"])
def test_pickles_refused_by_name(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    torch.save({"a": torch.ones(2)}, path)
    with pytest.raises(FormatError, match="pickle"):
        stream_safetensors(str(path))
    with pytest.raises(FormatError, match="pickle"):
        safe_open(str(path))


def test_pickles_refused_in_dir_and_by_content(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FormatError, match="pickle"):
        stream_safetensors(str(tmp_path))
    disguised = tmp_path / "x" / "model.safetensors"
    disguised.parent.mkdir()
    torch.save({"a": torch.ones(2)}, disguised)  # a zip under a safetensors name
    with pytest.raises(FormatError, match="pickle"):
        stream_safetensors(str(disguised))


def test_huge_claimed_header_fails_fast_without_allocating(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}" + b"\0" * 100)
    tracemalloc.start()
    began = time.monotonic()
    with pytest.raises(FormatError, match="header length"):
        stream_safetensors(str(path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - began < 5 and peak < 16 * MiB


def test_header_larger_than_the_first_get(tmp_path):
    want = {f"tensor.number.{i}": torch.full((i % 7,), float(i)) for i in range(300)}
    path = str(tmp_path / "m.safetensors")
    save_file(want, path)
    stream = stream_safetensors(path, chunk_size=4096)  # first GET: 4 KiB, header ~20 KB
    assert_same(dict(stream), want)
    assert stream.stats["bytes_fetched"] == os.path.getsize(path)


def test_dtype_torch_lacks_fails_before_streaming(tmp_path):
    header = json.dumps({"x": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "f4.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(FormatError, match="F4"):
        stream_safetensors(str(path))
    with pytest.raises(ValueError):
        stream_safetensors([])


def test_truncated_file_is_a_format_error(tmp_path):
    save_file({"a": torch.ones(1000)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-10])
    with pytest.raises(FormatError, match="cover"):
        stream_safetensors(str(tmp_path / "m.safetensors"))


# --- header parser: property tests ---------------------------------------------------------

def _parse_all(blob: bytes) -> None:
    n = header_length(blob[:8], "fuzz", file_size=len(blob), max_header_size=1 << 20)
    parse_header(blob[8:8 + n], "fuzz", file_size=len(blob))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_parser_arbitrary_bytes_only_format_error(blob):
    try:
        _parse_all(blob)
    except FormatError:
        pass


def _valid_blob() -> bytes:
    header = {"__metadata__": {"a": "b"},
              "x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "y": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
              "z": {"dtype": "U8", "shape": [], "data_offsets": [32, 33]}}
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + bytes(33)


_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
                            | st.text(max_size=5),
                            lambda c: (st.lists(c, max_size=3)
                                       | st.dictionaries(st.text(max_size=4), c, max_size=3)),
                            max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["x", "y", "z", "__metadata__"]),
       st.sampled_from(["dtype", "shape", "data_offsets", "extra", None]), _JSON_VALUES)
def test_parser_mutated_valid_headers_only_format_error(name, field, value):
    blob = _valid_blob()
    doc = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    if field is None or name == "__metadata__":
        doc[name] = value
    else:
        doc[name][field] = value
    text = json.dumps(doc).encode()
    mutated = len(text).to_bytes(8, "little") + text + bytes(33)
    try:
        _parse_all(mutated)
    except FormatError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255), st.integers(0, 2 ** 64 - 1))
def test_parser_byte_flips_and_lengths_only_format_error(pos, byte, length):
    blob = bytearray(_valid_blob())
    blob[pos % len(blob)] = byte
    try:
        _parse_all(bytes(blob))
    except FormatError:
        pass
    try:
        _parse_all(length.to_bytes(8, "little") + bytes(blob[8:]))
    except FormatError:
        pass


def test_parser_rejects_specific_faults():
    def blob_of(doc: dict, data: int = 33) -> bytes:
        text = json.dumps(doc).encode()
        return len(text).to_bytes(8, "little") + text + bytes(data)

    ok = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    _parse_all(blob_of(ok, 8))
    faults = {
        "gap": {"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
        "overlap": {**ok, "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
        "dtype": {"x": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}},
        "shape": {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        "negative": {"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
        "metadata": {**ok, "__metadata__": {"a": 1}},
    }
    for doc in faults.values():
        with pytest.raises(FormatError):
            _parse_all(blob_of(doc, 8))
    dup = b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "x": {}}'
    with pytest.raises(FormatError, match="duplicate"):
        _parse_all(len(dup).to_bytes(8, "little") + dup + bytes(8))
    with pytest.raises(FormatError, match="cover"):
        _parse_all(blob_of(ok, 9))  # trailing bytes after the data


# --- safe_open -------------------------------------------------------------------------------

def test_safe_open_local_matches_safetensors(tmp_path):
    from safetensors import safe_open as ref_open

    want = all_dtypes()
    path = str(tmp_path / "m.safetensors")
    save_file(want, path, metadata={"format": "pt"})
    with safe_open(path, framework="pt") as f, ref_open(path, framework="pt") as ref:
        assert f.keys() == list(ref.keys())
        assert f.metadata() == ref.metadata()
        for k in f.keys():
            assert torch.equal(raw(f.get_tensor(k)), raw(ref.get_tensor(k)))
        s, r = f.get_slice("bf16"), ref.get_slice("bf16")
        assert s.get_shape() == r.get_shape() and s.get_dtype() == r.get_dtype()
        for index in (slice(3, 9), slice(None, 5), slice(-4, None), slice(2, 50, 7), 0, -1,
                      (slice(1, 4), slice(10, 20)), Ellipsis, (Ellipsis, 3)):
            assert torch.equal(s[index], r[index]), index
        assert torch.equal(f.get_slice("scalar")[...], ref.get_slice("scalar")[...])
    with pytest.raises(FormatError):
        safe_open(path, framework="tf")  # pt and numpy are served, tensorflow is not


def test_safe_open_s3_fetches_only_the_rows_asked(s3_server, tmp_path):
    big = torch.arange(4000 * 256, dtype=torch.float32).reshape(4000, 256)  # ~4 MB, 1 KiB rows
    save_file({"w": big, "b": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path)) + "/m.safetensors"
    with safe_open(counting(url), storage_options=s3_server.storage_options) as f:
        CountingS3.reset()
        rows = f.get_slice("w")[3000:3010]
        assert torch.equal(rows, big[3000:3010])
        assert CountingS3.nbytes == 10 * 1024 and CountingS3.calls["get_object"] == 1
        assert torch.equal(f.get_tensor("w"), big)


def _mixed_order_file(path: str) -> dict[str, torch.Tensor]:
    """Names whose sorted order is not the file's: safetensors puts wider dtypes first."""
    g = torch.Generator().manual_seed(4)
    want = {f"a{i:02d}": torch.randint(0, 99, (256 << 10,), dtype=torch.int8, generator=g)
            for i in range(20)}
    want.update({f"z{i:02d}": torch.randn(64 << 10, generator=g) for i in range(20)})
    save_file(want, path)
    return want


@pytest.mark.parametrize("order", ["keys", "offset_keys"])
def test_safe_open_s3_reads_ahead_in_the_order_of_the_calls(s3_server, tmp_path, order):
    want = _mixed_order_file(str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path)) + "/m.safetensors"
    with safe_open(counting(url), storage_options=s3_server.storage_options,
                   memory_limit=4 * MiB) as f:
        names = getattr(f, order)()
        assert names != (f.offset_keys() if order == "keys" else f.keys())
        CountingS3.reset()
        got = {k: f.get_tensor(k) for k in names}
        assert f._ahead is not None and f._ahead.done
        assert 0 < f._ahead.budget.peak <= 4 * MiB
    assert_same(got, want)
    assert CountingS3.calls["get_object"] < len(names) // 3  # ranges, not a GET per tensor


def test_safe_open_s3_call_out_of_order_stops_reading_ahead(s3_server, tmp_path):
    want = _mixed_order_file(str(tmp_path / "m.safetensors"))
    url = upload_dir(s3_server, str(tmp_path)) + "/m.safetensors"
    with safe_open(url, storage_options=s3_server.storage_options) as f:
        keys = f.keys()
        got = {k: f.get_tensor(k) for k in keys[:5]}  # follows keys(): reading ahead
        got["z03"] = f.get_tensor("z03")  # out of order: back to one GET per call
        assert f._ahead is None
        got.update((k, f.get_tensor(k)) for k in keys[5:7])
        assert f._ahead is None
        got["a09"] = f.get_tensor("a09")
    assert_same(got, {k: want[k] for k in got})
    with safe_open(url, storage_options=s3_server.storage_options) as f:
        got = {k: f.get_tensor(k) for k in ["z05", "a01", "z07"]}  # no order: never starts
        assert f._ahead is None
        skipping = safe_open(url, storage_options=s3_server.storage_options)
        skipping.get_tensor("a00")
        got["a04"] = skipping.get_tensor("a04")  # a few ahead in the order: still followed
        assert skipping._ahead is not None
        skipping.close()
    assert_same(got, {k: want[k] for k in got})


def test_safe_open_read_ahead_plans_fit_the_budget_at_every_call():
    def tensors(order, size=MiB):
        return [TensorInfo(f"t{i}", "U8", (size,), i * size, (i + 1) * size) for i in order]

    # the offset grid, in the order of the calls: ranges of 4 MiB, each held while needed
    plan = plan_reads(tensors(range(7, -1, -1)), "f", 4 * MiB, 1, 4 * MiB)
    assert [(r.start, r.end) for r in plan[0][1]] == [(4 * MiB, 8 * MiB)]
    assert peak_held(plan) == 4 * MiB
    # interleaved calls would hold both ranges at once: ranges that follow the calls instead
    interleaved = tensors([0, 4, 1, 5, 2, 6, 3, 7])
    assert peak_held(grid_plan(interleaved, "f", 4 * MiB, 1, 8 * MiB)) == 8 * MiB
    plan = plan_reads(interleaved, "f", 4 * MiB, 1, 6 * MiB)
    assert plan is not None and peak_held(plan) <= 6 * MiB
    assert all(r.start >= t.start and r.end <= t.end for t, rs in plan for r in rs)
    # a tensor larger than the budget cannot be read ahead: it is read per call
    assert plan_reads(tensors([0], 8 * MiB), "f", MiB, 4, 4 * MiB) is None


def _chain_held(f) -> int:
    """Bytes held by a handle's read-ahead and the shards opened ahead after it."""
    held, nxt = f._budget.held, f._next
    while nxt is not None:
        held, nxt = held + nxt.budget.held, nxt.next
    return held


def test_safe_open_s3_reads_the_next_shards_ahead_within_the_budget(s3_server, tmp_path):
    want = sharded_model(str(tmp_path), nshards=3, size=2 * MiB)
    url = upload_dir(s3_server, str(tmp_path))
    limit, got, adopted = 4 * MiB, {}, []
    for i in range(3):
        with safe_open(f"{url}/model-{i + 1:05d}-of-00003.safetensors",
                       storage_options=s3_server.storage_options, memory_limit=limit) as f:
            adopted.append(f._adopted is not None)  # opened ahead by the handle before it
            for k in f.keys():
                got[k] = f.get_tensor(k)
                assert _chain_held(f) <= limit
            assert (f._next is not None) == (next_shard(f.name) is not None)
    assert adopted == [False, True, True] and not default_runtime()._parked
    assert_same(got, want)


def test_safe_open_s3_next_shard_not_opened_is_dropped(s3_server, tmp_path, monkeypatch):
    monkeypatch.setattr(nextfile, "PARK_SECONDS", 0.2)
    want = sharded_model(str(tmp_path), nshards=3, size=2 * MiB)
    os.remove(tmp_path / "model-00003-of-00003.safetensors")
    url = upload_dir(s3_server, str(tmp_path))
    shards = [f"{url}/model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    with safe_open(shards[0], storage_options=s3_server.storage_options) as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    ahead = default_runtime()._parked[shards[1]]
    wait_until(lambda: shards[1] not in default_runtime()._parked, timeout=10)  # parked 0.2 s
    assert shards[1] not in default_runtime()._parked and ahead.budget.held == 0
    # opened with other settings, the shard read ahead is not used; a missing one raises as usual
    with safe_open(shards[0], storage_options=s3_server.storage_options) as f:
        got.update((k, f.get_tensor(k)) for k in f.keys())
    with safe_open(shards[1], storage_options=s3_server.storage_options, streams=4) as f:
        assert f._adopted is None
        got.update((k, f.get_tensor(k)) for k in f.keys())
        assert f._next is not None  # the third, opened ahead: it does not exist
    with pytest.raises(FileNotFoundError, match="No such file or directory"):
        safe_open(shards[2], storage_options=s3_server.storage_options, streams=4)
    assert not default_runtime()._parked
    assert_same(got, {k: v for k, v in want.items() if not k.startswith("layer2.")})


# --- profiles and calibration ----------------------------------------------------------------

def test_profiles_and_calibration_are_picked_up(tmp_path):
    save_file({"a": torch.randn(300_000)}, str(tmp_path / "m.safetensors"))
    profiles = tmp_path / "profiles.json"
    result = calibrate(str(tmp_path), streams=(1, 2), chunk_sizes=(64 << 10, 256 << 10),
                       sample_bytes=1 * MiB, save=str(profiles))
    assert len(result["results"]) == 4 and result["endpoint"] == "file"
    saved = load_saved("file", profiles)
    assert (saved.streams, saved.chunk_size) == (result["streams"], result["chunk_size"])
    stream = stream_safetensors(str(tmp_path), profiles_file=str(profiles))
    assert stream.stats["streams"] == result["streams"]
    dict(stream)
    stream = stream_safetensors(str(tmp_path), profile="small-files", profiles_file=str(profiles))
    assert stream.stats["chunk_size"] == PROFILES["small-files"].chunk_size
    assert stream_safetensors(str(tmp_path), profile="small-files", streams=3).stats["streams"] == 3
    with pytest.raises(ValueError):
        stream_safetensors(str(tmp_path), profile="nope")


# --- read once across ranks ------------------------------------------------------------------

def _rank_stream(rank: int, world: int, url: str, options: dict, limit: int | None) -> dict:
    import torch.distributed as dist

    fsspec.register_implementation("counts3", CountingS3, clobber=True)
    CountingS3.reset()
    stream = stream_safetensors(counting(url), storage_options=options,
                                process_group=dist.group.WORLD, chunk_size=64 << 10,
                                memory_limit=limit)
    digests = [(name, t.dtype, tuple(t.shape), raw(t).sum().item(), raw(t)[::97].tolist())
               for name, t in stream]
    return {"digests": digests, "bytes_fetched": stream.stats["bytes_fetched"],
            "wire_bytes": CountingS3.nbytes, "peak": stream.stats["peak_bytes_held"],
            "headers": sorted(CountingS3.from_start)}


@pytest.mark.parametrize("world", [2, 4])
def test_read_once_across_ranks(s3_server, tmp_path, world):
    sharded_model(str(tmp_path / "m"), nshards=2, per_shard=4, size=300_000)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    limit = 2 * MiB
    results = run_distributed(_rank_stream, world, url, s3_server.storage_options, limit,
                              timeout=120)
    size = sum(os.path.getsize(p) for p in (tmp_path / "m").glob("*.safetensors"))
    expected = [(name, t.dtype, tuple(t.shape), raw(t).sum().item(), raw(t)[::97].tolist())
                for name, t in stream_safetensors(str(tmp_path / "m"))]
    for r in results:
        assert r["digests"] == expected  # every rank yields every tensor, in the same order
        assert r["peak"] <= limit
    assert sum(r["bytes_fetched"] for r in results) == size  # storage served the model once
    index = os.path.getsize(tmp_path / "m" / "model.safetensors.index.json")
    assert sum(r["wire_bytes"] for r in results) == size + index  # counted on the wire
    assert all(r["bytes_fetched"] > 0 for r in results)  # and the reading was shared
    # each file's header is fetched once, by the rank its place in the list spreads it to
    # (2 files on 4 ranks: ranks 0 and 2), not every header by rank 0
    names = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert [r["headers"] for r in results] == [
        [n for i, n in enumerate(names) if i * world // len(names) == rank]
        for rank in range(world)]


def _rank_stream_error(rank: int, world: int, url: str, options: dict) -> tuple[str, str]:
    import torch.distributed as dist

    try:
        list(stream_safetensors(url, storage_options=options, process_group=dist.group.WORLD))
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc)
    return "", ""


def test_a_header_another_rank_cannot_read_fails_every_rank(s3_server, tmp_path):
    """The second file's header is rank 1's to fetch: its error reaches rank 0 too, in
    bounded time, naming the rank and the file."""
    sharded_model(str(tmp_path / "m"), nshards=2, per_shard=2, size=40_000)
    second = tmp_path / "m" / "model-00002-of-00002.safetensors"
    second.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}" + b"\0" * 100)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    results = run_distributed(_rank_stream_error, 2, url, s3_server.storage_options, timeout=120)
    assert [name for name, _ in results] == ["FormatError", "FormatError"]
    assert all("model-00002-of-00002.safetensors" in message for _, message in results)
    assert results[0][1].startswith("rank 1 failed to read a header: ")


def _rank_digests(rank: int, world: int, url: str, options: dict) -> list:
    import torch.distributed as dist

    return [(name, raw(t).sum().item()) for name, t in
            stream_safetensors(url, storage_options=options, process_group=dist.group.WORLD)]


def test_a_file_the_index_leaves_out_may_be_broken_across_ranks(s3_server, tmp_path):
    """Headers are fetched for the directory's files while rank 0 reads the index: a file
    the index leaves out is dropped, even when its header cannot be read (rank 0 fetches
    it here, as the first of three candidates on two ranks)."""
    sharded_model(str(tmp_path / "m"), nshards=2, per_shard=2, size=40_000)
    (tmp_path / "m" / "extra.safetensors").write_bytes(b"\xff" * 64)
    url = upload_dir(s3_server, str(tmp_path / "m"))
    expected = [(name, raw(t).sum().item()) for name, t in stream_safetensors(str(tmp_path / "m"))]
    assert run_distributed(_rank_digests, 2, url, s3_server.storage_options,
                           timeout=120) == [expected, expected]


def test_an_index_rank_0_cannot_read_fails_every_rank(s3_server, tmp_path):
    """Rank 0 has sent the candidate files before it reads the index: its failure there
    still reaches every rank, which raise the same kind of error."""
    sharded_model(str(tmp_path / "m"), nshards=2, per_shard=2, size=40_000)
    (tmp_path / "m" / "model.safetensors.index.json").write_text("{not json")
    url = upload_dir(s3_server, str(tmp_path / "m"))
    results = run_distributed(_rank_stream_error, 2, url, s3_server.storage_options, timeout=120)
    assert [name for name, _ in results] == ["FormatError", "FormatError"]
    assert "not valid JSON" in results[0][1]
    assert results[1][1].startswith("rank 0 failed to list the model: ")
