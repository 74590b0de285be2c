"""TurboWriter/TurboReader in one process: formats, URLs, integrity and every error path."""
from __future__ import annotations

import datetime
import json
import os
import re

import blake3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptturbo as ct
from ckptturbo.runs import Location


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 257, generator=g),
        "b": torch.randn(17, generator=g),
        "ids": torch.randint(0, 1000, (33,), generator=g),
        "bf16": torch.randn(9, 5, generator=g).to(torch.bfloat16),
        "half": torch.randn(4, 4, generator=g).half(),
        "mask": torch.rand(11, generator=g) > 0.5,
        "i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        "cplx": torch.randn(3, 2, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "strided": torch.randn(8, 6, generator=g).t(),
        "extra": {"step": 7, "name": "run-a", "lrs": [0.1, 0.01], "blob": b"\x00\x01"},
    }


def zeros_like_state(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = {"step": 0, "name": "", "lrs": [], "blob": b""}
        else:
            out[k] = v
    return out


def assert_state_equal(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("scheme", ["path", "file"])
def test_round_trip_local(tmp_path, scheme):
    sd = make_state()
    url = str(tmp_path / "run" / "step-1")
    if scheme == "file":
        url = "file://" + url
    dcp.save(sd, storage_writer=ct.TurboWriter(url, chunk_size=64 << 10, pack_threshold=16 << 10))
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=ct.TurboReader(url))
    assert_state_equal(sd, out)
    manifest = json.loads((tmp_path / "run" / "step-1" / "manifest.json").read_text())
    assert manifest["format"] == "ckptturbo-manifest" and manifest["version"] == 3
    assert re.fullmatch(r"[0-9a-f]{64}", manifest["blake3"])  # the manifest's own checksum
    # the 300x257 float tensor is cut into 64 KiB chunks: several chunks, all content-named
    w_pieces = manifest["items"]["w"][5]  # one shard: its piece count, then 3 numbers a piece
    assert w_pieces[0] == -(-300 * 257 * 4 // (64 << 10)) and len(w_pieces) == 1 + 3 * w_pieces[0]
    chunk_files = list((tmp_path / "run" / ".ckptturbo" / "chunks").rglob("*"))
    ids = manifest["chunk_ids"]
    assert ({p.name for p in chunk_files if p.is_file()}
            == {ids[i:i + 64] for i in range(0, len(ids), 64)})


def test_round_trip_s3(s3_server):
    sd = make_state(1)
    url = s3_server.url("run") + "/step-1"
    opts = s3_server.storage_options
    dcp.save(sd, storage_writer=ct.TurboWriter(url, opts, chunk_size=64 << 10))
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=ct.TurboReader(url, opts))
    assert_state_equal(sd, out)
    out2 = zeros_like_state(sd)
    ct.load(out2, url, storage_options=opts)
    assert_state_equal(sd, out2)


def test_async_save_handle_and_incremental(tmp_path):
    sd = make_state()
    run = tmp_path / "run"
    # tensors of 4 KiB and more get chunks of their own; smaller ones share a pack
    h1 = ct.save(sd, str(run / "a"), pack_threshold=4096)
    h1.staged.result(timeout=60)
    s1 = h1.wait(timeout=60)
    assert s1.bytes_written > 0 and s1.bytes_reused == 0
    sd["b"] = sd["b"] + 1  # one small tensor changes; everything else is reused
    s2 = ct.save(sd, str(run / "b"), pack_threshold=4096).wait(timeout=60)
    assert s2.bytes_written < 0.1 * s1.bytes_written
    out = zeros_like_state(sd)
    ct.load(out, str(run / "b"))
    assert_state_equal(sd, out)


def test_missing_manifest_is_invisible(tmp_path):
    url = str(tmp_path / "run" / "nothing")
    os.makedirs(url)
    with pytest.raises(ct.CheckpointNotFound, match="manifest.json is missing"):
        ct.load({"w": torch.zeros(1)}, url)
    with pytest.raises(CheckpointException, match="no committed checkpoint"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=ct.TurboReader(url))


def _corrupt_chunk_of(tmp_path, url: str, fqn: str) -> str:
    manifest = Location(url).read_manifest()
    cid = manifest.items[fqn].shards[0].pieces[0].chunk
    path = tmp_path / "run" / ".ckptturbo" / "chunks" / cid[:2] / cid
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return cid


def test_corrupted_chunk_raises_integrity_error(tmp_path):
    sd = make_state()
    url = str(tmp_path / "run" / "step-1")
    dcp.save(sd, storage_writer=ct.TurboWriter(url))
    cid = _corrupt_chunk_of(tmp_path, url, "w")
    with pytest.raises(ct.IntegrityError) as info:
        ct.load(zeros_like_state(sd), url)
    message = str(info.value)
    assert cid in message and "'w'" in message and "expected BLAKE3" in message
    out = zeros_like_state(sd)
    ct.load(out, url, verify=False)  # the opt-out reads the damaged bytes as they are
    assert not torch.equal(out["w"], sd["w"])


def test_mismatches_are_named(tmp_path):
    sd = make_state()
    url = str(tmp_path / "run" / "step-1")
    ct.save(sd, url).wait(timeout=60)
    wrong_shape = zeros_like_state(sd)
    wrong_shape["w"] = torch.zeros(300, 256)
    with pytest.raises(ct.MismatchError, match=r"'w': shape \(300, 256\)"):
        ct.load(wrong_shape, url)
    # another dtype is no mismatch: values are cast, as DCP's FileSystemReader does
    other_dtype = zeros_like_state(sd)
    other_dtype["b"] = torch.zeros(17, dtype=torch.float64)
    ct.load(other_dtype, url)
    assert torch.equal(other_dtype["b"], sd["b"].double())
    missing = zeros_like_state(sd)
    missing["new_layer"] = torch.zeros(3)
    with pytest.raises(ct.MismatchError, match="'new_layer' is in the state dict but not"):
        ct.load(missing, url)
    partial = {"w": torch.zeros(300, 257)}
    with pytest.raises(ct.MismatchError, match="in the checkpoint but not in the state dict"):
        ct.load(partial, url)
    ct.load(partial, url, strict=False)
    assert torch.equal(partial["w"], sd["w"])


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path):
    sd = make_state()
    run = tmp_path / "run"
    ct.save(sd, str(run / "good")).wait(timeout=60)
    # Block every chunk directory with a plain file: any new chunk fails to upload.
    chunks = run / ".ckptturbo" / "chunks"
    for i in range(256):
        d = chunks / f"{i:02x}"
        if not d.exists():
            d.write_bytes(b"")
    changed = dict(sd, w=sd["w"] * 2)
    handle = ct.save(changed, str(run / "bad"))
    with pytest.raises(ct.StorageError):
        handle.wait(timeout=60)
    assert handle.staged.done()
    assert not (run / "bad" / "manifest.json").exists()
    out = zeros_like_state(sd)
    ct.load(out, str(run / "good"))
    assert_state_equal(sd, out)


def reseal(doc: dict) -> bytes:
    """The manifest with a checksum matching its (edited) content, as docs/format.md defines it."""
    doc.pop("blake3", None)
    canonical = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    doc["blake3"] = blake3.blake3(canonical).hexdigest()
    return json.dumps(doc).encode()


def test_hostile_manifest_is_rejected(tmp_path):
    sd = {"w": torch.arange(10.0)}
    url = str(tmp_path / "run" / "step-1")
    dcp.save(sd, storage_writer=ct.TurboWriter(url))
    path = tmp_path / "run" / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["chunk_ids"] = "../../../etc/passwd".ljust(64, "/") + doc["chunk_ids"][64:]
    path.write_bytes(reseal(doc))  # a hostile writer can compute a valid checksum
    with pytest.raises(ct.FormatError, match="invalid chunk id"):
        ct.load({"w": torch.zeros(10)}, url)
    path.write_text("{not json")
    with pytest.raises(ct.FormatError, match="not valid JSON"):
        ct.load({"w": torch.zeros(10)}, url)


def test_objects_needing_full_unpickling_are_refused(tmp_path):
    sd = {"w": torch.ones(2), "when": datetime.date(2024, 1, 2)}
    url = str(tmp_path / "run" / "step-1")
    dcp.save(sd, storage_writer=ct.TurboWriter(url))
    with pytest.raises(ct.FormatError, match="'when'.*allow_pickle=True"):
        ct.load({"w": torch.zeros(2), "when": None}, url)
    out = {"w": torch.zeros(2), "when": None}
    ct.load(out, url, allow_pickle=True)
    assert out["when"] == datetime.date(2024, 1, 2)


def test_s3_errors_are_clear_and_bounded(s3_server):
    sd = {"w": torch.ones(4)}
    good = s3_server.storage_options
    bad = dict(good, secret="wrong-secret")
    url = s3_server.url("run") + "/step-1"
    with pytest.raises(ct.StorageAuthError, match="refused"):
        ct.save(sd, url, storage_options=bad).wait(timeout=60)
    with pytest.raises(ct.CheckpointNotFound, match="does not exist"):
        ct.save(sd, "s3://no-such-bucket-ckptturbo/run/step-1",
                storage_options=good).wait(timeout=60)
    ct.save(sd, url, storage_options=good).wait(timeout=60)
    with pytest.raises(ct.StorageAuthError):
        ct.load({"w": torch.zeros(4)}, url, storage_options=bad)
    with pytest.raises(ct.CheckpointNotFound):
        ct.load({"w": torch.zeros(4)}, s3_server.url("run") + "/absent", storage_options=good)
    unreachable = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                   "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(ct.StorageError, match="127.0.0.1:9"):
        ct.load({"w": torch.zeros(4)}, "s3://bucket/run/x", storage_options=unreachable)


def test_writer_and_reader_are_picklable(tmp_path):
    import pickle

    writer = ct.TurboWriter(str(tmp_path / "run" / "a"))
    writer2 = pickle.loads(pickle.dumps(writer))
    assert writer2.url == writer.url
    dcp.save({"x": torch.ones(3)}, storage_writer=writer2)
    reader = pickle.loads(pickle.dumps(ct.TurboReader(str(tmp_path / "run" / "a"))))
    out = {"x": torch.zeros(3)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["x"], torch.ones(3))
    # a reader that has read its manifest keeps it across pickling, but not its location
    used = pickle.loads(pickle.dumps(reader))
    out = {"x": torch.zeros(3)}
    dcp.load(out, storage_reader=used)
    assert torch.equal(out["x"], torch.ones(3))
