"""The defects that broke the core promise: an unverified manifest, multipart uploads, hangs.

Each test injects the fault for real: bytes edited on disk, a chunk large enough to go
multipart on a real SeaweedFS, and a TCP endpoint that accepts connections and never answers.
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import ckptturbo as ct
from ckptturbo.runs import Location
from ckptturbo.store import Store

MiB = 1 << 20


def _saved(tmp_path) -> tuple[str, dict]:
    sd = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(100, dtype=torch.int64),
          "step": 7}
    url = str(tmp_path / "run" / "step-1")
    ct.save(sd, url, chunk_size=4096, pack_threshold=1024).wait(timeout=60)
    return url, sd


def test_every_digit_flipped_in_the_manifest_is_detected(tmp_path):
    """A flipped piece offset used to load wrong values silently: now the manifest's own
    checksum refuses any edit that changes what the document says. (A digit past a float's
    precision, e.g. in the `created` timestamp, can parse to the same value: harmless.)"""
    url, _ = _saved(tmp_path)
    path = tmp_path / "run" / "step-1" / "manifest.json"
    original = path.read_bytes()
    meaning = json.loads(original)
    positions = [i for i, b in enumerate(original) if chr(b).isdigit()]
    assert len(positions) > 200  # offsets, sizes, lengths, chunk ids, timestamps
    detected = 0
    for i in positions:
        flipped = bytearray(original)
        flipped[i] = ord("0") + (flipped[i] - ord("0") + 1) % 10
        path.write_bytes(bytes(flipped))
        try:
            Location(url).read_manifest()
        except ct.FormatError:
            detected += 1
        else:
            assert json.loads(flipped) == meaning, f"edit at byte {i} was accepted"
    assert detected >= len(positions) - 3
    path.write_bytes(original)
    Location(url).read_manifest()  # the untouched manifest still reads


def test_flipped_piece_offset_fails_load_and_verify(tmp_path):
    url, sd = _saved(tmp_path)
    path = tmp_path / "run" / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    pieces = doc["items"]["a"][5]  # the shard's piece count, then (length, chunk, offset) each
    assert pieces[0] >= 2
    pieces[1 + 3 + 2] += 4  # the second piece's offset in its chunk: verified bytes, wrong place
    path.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True))
    out = {"a": torch.zeros(3000), "b": torch.zeros(100, dtype=torch.int64), "step": 0}
    with pytest.raises(ct.FormatError, match="manifest.json is corrupted"):
        ct.load(out, url)
    assert torch.count_nonzero(out["a"]) == 0  # nothing was written into the destination
    verify = subprocess.run([sys.executable, "-m", "ckptturbo.cli", "verify", url],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode != 0
    assert "corrupted" in verify.stderr + verify.stdout


def test_multipart_upload_of_a_large_chunk(s3_server):
    """A chunk above the multipart threshold goes up in parts and reads back bit-exact."""
    opts = s3_server.storage_options
    url = s3_server.url("run") + "/step-1"
    big = torch.randint(0, 255, (136 * MiB,), dtype=torch.uint8)  # > 128 MiB threshold
    sd = {"big": big, "small": torch.arange(10.0)}
    summary = ct.save(sd, url, storage_options=opts, chunk_size=256 * MiB).wait(timeout=300)
    assert summary.chunks_written >= 2
    out = {"big": torch.zeros_like(big), "small": torch.zeros(10)}
    ct.load(out, url, storage_options=opts)
    assert torch.equal(out["big"], big) and torch.equal(out["small"], sd["small"])


def test_store_multipart_put_from_a_memoryview(s3_server):
    """The writer hands the store numpy-backed memoryviews; botocore refuses those as
    bodies, so each part must be sent as bytes."""
    store = Store(s3_server.url("mp"), s3_server.storage_options,
                  multipart_threshold=10 * MiB, part_size=5 * MiB)
    data = np.random.default_rng(0).integers(0, 255, 12 * MiB + 17, dtype=np.uint8)
    path = store.join(store.root, "object")
    store.put(path, memoryview(data))
    assert store.get(path) == data.tobytes()
    assert store.get(path, 5 * MiB - 3, 5 * MiB + 3) == data[5 * MiB - 3:5 * MiB + 3].tobytes()


class BlackHole:
    """A TCP endpoint that accepts connections and never answers (a hung load balancer)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def black_hole(monkeypatch):
    monkeypatch.setenv("CKPTTURBO_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("CKPTTURBO_DEADLINE", "4")
    hole = BlackHole()
    yield {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{hole.port}"}}
    hole.close()


def test_black_holed_endpoint_fails_save_and_load_within_the_deadline(black_hole):
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(20)}
    for attempt in (
        lambda: ct.save(sd, "s3://bucket/run/step-1", storage_options=black_hole).wait(timeout=120),
        lambda: ct.load({k: torch.zeros_like(v) for k, v in sd.items()}, "s3://bucket/run/step-1",
                        storage_options=black_hole),
    ):
        started = time.monotonic()
        with pytest.raises(ct.StorageError, match="request_timeout=1s|treated as down"):
            attempt()
        # deadline 4 s, plus at most one request_timeout for the attempt under way
        assert time.monotonic() - started < 4 + 1 + 3


def test_outage_fails_every_pending_request_at_once(black_hole):
    """After one call finds the store silent for a whole deadline, the rest fail at once
    instead of each waiting out its own deadline (a save of many chunks, not once per chunk)."""
    store = Store("s3://bucket/run", black_hole, max_workers=4)
    paths = [store.join(store.root, f"obj-{i}") for i in range(40)]
    started = time.monotonic()
    with pytest.raises(ct.StorageError):
        store.map(lambda p: store.put(p, b"x"), paths)
    assert time.monotonic() - started < 4 + 1 + 3
    with pytest.raises(ct.StorageError, match="treated as down"):
        store.get(paths[0])


SECRET = "ckptturbo-distinctive-secret-8c1f0e"


def test_no_secret_leaks_into_errors_logs_or_reprs(s3_server, caplog, monkeypatch, black_hole):
    """Wrong credentials, a missing bucket and an unreachable endpoint: the secret from
    storage_options appears in no exception message, log record (any level) or repr."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    wrong = dict(s3_server.storage_options, secret=SECRET)
    missing_bucket = dict(s3_server.storage_options)
    silent = dict(black_hole, secret=SECRET)
    texts = []
    sd = {"w": torch.ones(4)}
    cases = [(s3_server.url("run") + "/step-1", wrong),
             ("s3://no-such-bucket-ckptturbo/run/step-1", missing_bucket),
             ("s3://bucket/run/step-1", silent)]
    for url, opts in cases:
        writer, reader = ct.TurboWriter(url, opts), ct.TurboReader(url, opts)
        texts += [repr(writer), repr(reader), repr(Store(url, opts))]
        for attempt in (
            lambda url=url, opts=opts: ct.save(sd, url, storage_options=opts).wait(timeout=120),
            lambda url=url, opts=opts: ct.load({"w": torch.zeros(4)}, url, storage_options=opts),
        ):
            with pytest.raises(ct.CkptTurboError) as info:
                attempt()
            chain = info.value
            while chain is not None:
                texts.append(f"{type(chain).__name__}: {chain} {chain.args!r}")
                chain = chain.__cause__ or chain.__context__
    texts += [record.getMessage() for record in caplog.records]
    assert len(caplog.records) > 0
    leaked = [t for t in texts if SECRET in t]
    assert not leaked, leaked[:3]


def test_listing_a_missing_bucket_is_an_error(s3_server):
    """An absent prefix lists as empty, but an absent bucket is a wrong URL, not an empty run."""
    opts = s3_server.storage_options
    listing = subprocess.run([sys.executable, "-m", "ckptturbo.cli", "ls",
                              "s3://no-such-bucket-ckptturbo/run",
                              "--storage-options", json.dumps(opts)],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode != 0
    assert "no-such-bucket-ckptturbo does not exist" in listing.stderr
    assert Store(s3_server.url("empty"), opts).list_dirs(s3_server.url("empty")[5:]) == []
