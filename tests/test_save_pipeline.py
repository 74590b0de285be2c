"""The save side's own contracts: staging needs no storage, typed results, clear errors,
bounded writer reuse, and no DCP single-process warning from ct.save / ct.load."""
from __future__ import annotations

import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

import ckptturbo as ct
from ckptturbo import runtime
from ckptturbo.failures import as_ckptturbo_error
from ckptturbo.upload import SaveStats


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128, 1024, generator=g) for i in range(4)}


def test_staged_needs_no_storage_request():
    """An endpoint nobody listens on: the copy completes, the upload then fails clearly."""
    dead = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    handle = ct.save(state(1), "s3://bucket/run/a", storage_options=dead)
    handle.staged.result(timeout=30)
    with pytest.raises(ct.StorageError, match="127.0.0.1:9"):
        handle.wait(timeout=120)


def test_last_stats_is_typed_and_reads_as_a_mapping(tmp_path):
    sd = state(2)
    writer = ct.TurboWriter(str(tmp_path / "run" / "a"))
    dcp.save(sd, storage_writer=writer)
    stats = writer.last_stats
    assert isinstance(stats, SaveStats)
    nbytes = sum(v.numel() * 4 for v in sd.values())
    assert stats.bytes_written == stats["bytes_written"] == nbytes
    assert dict(stats)["chunks_reused"] == 0 and set(stats) >= {"bytes_reused", "seconds_write"}
    writer.reset(str(tmp_path / "run" / "b"))
    dcp.save(sd, storage_writer=writer)
    assert writer.last_stats.bytes_written == 0 and writer.last_stats.bytes_reused == nbytes


def test_ct_save_and_load_without_a_group_do_not_warn(tmp_path):
    assert not dist.is_initialized()
    sd = state(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.save(sd, str(tmp_path / "run" / "a")).wait(timeout=60)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        ct.load(out, str(tmp_path / "run" / "a"))
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    noisy = [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert not noisy, noisy


def test_writers_kept_by_ct_save_are_bounded_and_evicted_ones_closed(tmp_path):
    sd = state(4)
    kept = ct.default_session()._kept
    first_key = None
    for i in range(runtime.MAX_KEPT + 2):
        ct.save(sd, str(tmp_path / f"run{i}" / "a")).wait(timeout=60)
        if first_key is None:
            first_key = next(k for k in kept if k[0] == f"file://{tmp_path}/run0")
            first = kept[first_key]
    assert len(kept) <= runtime.MAX_KEPT
    assert first_key not in kept and first._pool is None  # closed: pool released


def test_failures_are_classified_by_type_not_message():
    ours = ct.IntegrityError("chunk abc of 'w' does not match its id")
    wrapped = CheckpointException("save failed", {1: _wrap_exception(ours)})
    assert as_ckptturbo_error(wrapped, "u", "saving") is ours
    try:
        try:
            raise ours
        except ct.IntegrityError as exc:
            raise RuntimeError("gloo connection closed") from exc  # message is irrelevant
    except RuntimeError as outer:
        assert as_ckptturbo_error(outer, "u", "saving") is ours
    peer = dist.DistNetworkError("anything")
    comm = as_ckptturbo_error(CheckpointException("load failed", {0: _wrap_exception(peer)}),
                              "s3://x", "loading")
    assert isinstance(comm, ct.CommunicationError) and "s3://x" in str(comm)
    # a message alone classifies nothing: a plain error is wrapped, named, kept as the cause
    plain = RuntimeError("connection reset by peer")
    error = as_ckptturbo_error(plain, "s3://b/run/a", "saving")
    assert type(error) is ct.CkptTurboError and error.__cause__ is plain
    assert "s3://b/run/a" in str(error) and "RuntimeError: connection reset by peer" in str(error)
    # DCP's wrapper (a BaseException) becomes an Exception naming the rank's own failure
    inner = TypeError("cannot pickle '_thread.lock' object")
    failed = CheckpointException("save failed", {0: _wrap_exception(inner)})
    error = as_ckptturbo_error(failed, "u", "saving")
    assert isinstance(error, Exception) and error.__cause__ is inner
    assert "cannot pickle" in str(error)
    interrupt = KeyboardInterrupt()
    assert as_ckptturbo_error(interrupt, "u", "loading") is interrupt
    # gloo reports a dead peer as a plain RuntimeError raised inside a c10d collective; a
    # failure gathered from another rank keeps only its stack summary
    gloo = RuntimeError("Read error")
    stack = traceback.StackSummary.from_list([(distributed_c10d.__file__, 4287, "all_gather",
                                               None)])
    comm = as_ckptturbo_error(CheckpointException("load failed", {2: (gloo, stack)}), "u",
                              "loading")
    assert isinstance(comm, ct.CommunicationError) and comm.__cause__ is gloo
