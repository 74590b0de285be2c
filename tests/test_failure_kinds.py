"""What a failed storage request means (retry or not) and how long a dead store may hold a
save or load: classified by type and error code, bounded by one deadline, reported while
it lasts.

The classifier is tested directly on the exception types the storage stacks raise, and on
the real exceptions a Store gets from SeaweedFS through the fault proxy.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
from itertools import pairwise

import aiohttp
import botocore.exceptions as boto
import pytest
import torch
from fsspec.exceptions import FSTimeoutError

import ckptturbo as ct
from ckptturbo import catalog
from ckptturbo.retry import Failure, RetryPolicy, classify, is_transient
from ckptturbo.store import Store
from ckptturbo.testing.fault_proxy import FaultProxy, Faults, Outage


def client_error(code: str, status: int) -> boto.ClientError:
    return boto.ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                             "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:  # noqa: BLE001 - the chained exception is the result
        return exc


def raised_while_handling(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - __context__ only, as a bug in a handler would
    except BaseException as exc:  # noqa: BLE001
        return exc


@pytest.mark.parametrize("exc", [
    ValueError("expected 1500 bytes"),
    KeyError("layer.500.weight"),
    RuntimeError("timeout while parsing 503 tensors"),
    OSError(errno.EIO, "Input/output error"),
    client_error("InvalidArgument", 400),
    client_error("InvalidRange", 416),
], ids=repr)
def test_messages_that_look_like_server_errors_are_not_retried(exc):
    assert classify(exc) is Failure.PERMANENT and not is_transient(exc)


def test_an_error_in_a_handler_is_not_the_timeout_it_handled():
    assert classify(raised_while_handling(ValueError("bad"), TimeoutError())) is Failure.PERMANENT


@pytest.mark.parametrize("exc, kind", [
    (client_error("SlowDown", 503), Failure.BUSY),
    (client_error("InternalError", 500), Failure.BUSY),
    (client_error("500", 500), Failure.BUSY),                # a HEAD's 500 has no body
    (client_error("", 429), Failure.BUSY),
    (client_error("RequestTimeout", 400), Failure.NO_ANSWER),
    (client_error("AccessDenied", 403), Failure.AUTH),
    (client_error("SignatureDoesNotMatch", 403), Failure.AUTH),
    (client_error("NoSuchBucket", 404), Failure.NOT_FOUND),
    (raised_from(OSError(errno.EIO, "We encountered an internal error"),
                 client_error("InternalError", 500)), Failure.BUSY),  # s3fs's translation
    (OSError(errno.EREMOTEIO, "Internal Server Error"), Failure.BUSY),
    (OSError(errno.EBUSY, "Please reduce your request rate."), Failure.BUSY),
    (OSError("We encountered an internal error. Please try again."), Failure.BUSY),
    (ConnectionResetError(errno.ECONNRESET, "reset"), Failure.NO_ANSWER),
    (OSError(errno.ECONNREFUSED, "refused"), Failure.NO_ANSWER),
    (FSTimeoutError(), Failure.NO_ANSWER),
    (asyncio.TimeoutError(), Failure.NO_ANSWER),
    (boto.EndpointConnectionError(endpoint_url="http://host"), Failure.NO_ANSWER),
    (boto.ReadTimeoutError(endpoint_url="http://host"), Failure.NO_ANSWER),
    (boto.NoCredentialsError(), Failure.AUTH),
    (aiohttp.ServerDisconnectedError(), Failure.NO_ANSWER),
    (aiohttp.ClientPayloadError("cut short"), Failure.NO_ANSWER),
    (PermissionError(errno.EACCES, "denied"), Failure.AUTH),
    (FileNotFoundError(errno.ENOENT, "gone"), Failure.NOT_FOUND),
], ids=lambda v: repr(v) if isinstance(v, BaseException) else v.name)
def test_classified_by_type_and_error_code(exc, kind):
    assert classify(exc) is kind


def test_a_permanent_error_is_tried_once():
    """Before: KeyError('layer.500.weight') contains "500" and was retried until the deadline."""
    policy = RetryPolicy("s3://b", lambda p: f"s3://{p}", retries=5, backoff=0.01,
                         request_timeout=None, deadline=None, outage_cooldown=None)
    attempts = []

    def fails() -> None:
        attempts.append(1)
        raise KeyError("layer.500.weight")

    with pytest.raises(ct.StorageError, match="KeyError"):
        policy.call("read", "b/x", fails)
    assert len(attempts) == 1


@pytest.mark.parametrize("kind, method, expected", [
    ("error_500", "put", Failure.BUSY), ("slow_down", "get", Failure.BUSY),
    ("reset", "get", Failure.NO_ANSWER), ("truncate", "list", Failure.NO_ANSWER),
    ("stall_upload", "put", Failure.NO_ANSWER), ("black_hole", "info", Failure.NO_ANSWER),
])
def test_real_store_errors_are_classified(s3_server, kind, method, expected):
    """The exceptions s3fs/aiobotocore raise for each fault, classified from the chain."""
    direct = Store(s3_server.url("kinds"), s3_server.storage_options)
    path = direct.join(direct.root, "object")
    direct.put(path, b"x" * 100_000)
    with FaultProxy(s3_server.endpoint, faults=Faults(**{kind: 1.0})) as proxy:
        # a short attempt only where the fault is silence: a loaded machine can take over
        # 2 s to answer the first request of a new client
        silent = kind in ("stall_upload", "black_hole")
        store = Store(s3_server.url("kinds"), proxy.storage_options(s3_server.storage_options),
                      retries=0, request_timeout=2 if silent else 30)
        calls = {"put": lambda: store.put(path, b"y" * 100_000), "get": lambda: store.get(path),
                 "info": lambda: store.info(path), "list": lambda: store.list_files(store.root)}
        with pytest.raises(ct.StorageError) as info:
            calls[method]()
    assert classify(info.value.__cause__) is expected


def test_real_auth_and_missing_errors_are_classified(s3_server):
    wrong = dict(s3_server.storage_options, secret="not-the-secret")
    with pytest.raises(ct.StorageAuthError):
        Store(s3_server.url("kinds"), wrong).put(s3_server.url("kinds")[5:] + "/o", b"x")
    with pytest.raises(ct.CheckpointNotFound):
        Store(s3_server.url("kinds"), s3_server.storage_options).get(
            s3_server.url("kinds")[5:] + "/absent")


# --- one bound for a whole save or load against a dead store ---------------------------

def _state(tensors: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(48 << 10, generator=g) for i in range(tensors)}


CHUNKING = {"chunk_size": 64 << 10, "pack_threshold": 16 << 10}


@pytest.fixture
def fresh_outage_state(monkeypatch):
    monkeypatch.setenv("CKPTTURBO_OUTAGE_COOLDOWN", "30")


def progress_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "ckptturbo.retry" and r.levelno == logging.WARNING]


def test_silent_store_fails_the_save_within_the_deadline_and_says_so_meanwhile(
        s3_server, monkeypatch, caplog, fresh_outage_state):
    """Default request timeout (60 s), a 12 s deadline: the first request of the save gets
    no answer at all. Before, the attempt ran until botocore's 30 s read timeout; now it is
    cut at the deadline, and a warning every <= 10 s names what is waited for, for how long,
    and how to change the bound."""
    monkeypatch.setenv("CKPTTURBO_DEADLINE", "12")
    caplog.set_level(logging.WARNING, logger="ckptturbo")
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.set_outage(Outage.BLACK_HOLE)
        options = proxy.storage_options(s3_server.storage_options)
        started = time.time()
        with pytest.raises(ct.StorageError, match="CKPTTURBO_DEADLINE"):
            ct.save(_state(2), f"{s3_server.url('silent')}/step-1", storage_options=options,
                    **CHUNKING).wait(timeout=60)
        ended = time.time()
    assert ended - started < 12 + 5, ended - started  # before: >= 30 s (botocore read timeout)
    warned = progress_warnings(caplog)
    assert len(warned) >= 1, [r.getMessage() for r in caplog.records]
    times = [started] + [r.created for r in warned] + [ended]
    assert max(b - a for a, b in pairwise(times)) <= 10.5, times
    text = warned[-1].getMessage()
    assert "waiting for s3://" in text and "silent" in text  # the store and the request
    assert re.search(r"for \d+s", text)  # how long it has waited
    assert "request_timeout=60s" in text and "CKPTTURBO_DEADLINE" in text


@pytest.mark.parametrize("kind", ["stall_upload", "stall_download"])
@pytest.mark.parametrize("request_timeout, deadline, bound", [
    ("1", None, 15),    # the target: <= 15 s with 1 s request timeouts, default deadline
    (None, "8", 8 + 4),  # default 60 s request timeout: each attempt is cut at the deadline
], ids=["rt1", "deadline8"])
def test_partition_mid_transfer_fails_within_one_bound(
        s3_server, monkeypatch, fresh_outage_state, kind, request_timeout, deadline, bound):
    """Every chunk transfer goes silent part-way, the connection open, while control
    requests still pass. The first request that gives up marks the store down and cancels
    the others, so the whole save or load fails within one call's bound. Before, an attempt
    ran for its full request timeout past the deadline (60 s here with deadline=8)."""
    for name, value in (("REQUEST_TIMEOUT", request_timeout), ("DEADLINE", deadline)):
        if value is None:
            monkeypatch.delenv(f"CKPTTURBO_{name}", raising=False)
        else:
            monkeypatch.setenv(f"CKPTTURBO_{name}", value)
    run = s3_server.url(f"bound-{kind}-{bound}")
    sd = _state(40)
    upload = kind == "stall_upload"
    if not upload:
        ct.save(sd, f"{run}/step-1", storage_options=s3_server.storage_options,
                **CHUNKING).wait(timeout=120)
    faults = Faults(**{kind: 1.0}, methods=("PUT",) if upload else ("GET",),
                    path_contains="/chunks/")
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        started = time.monotonic()
        with pytest.raises(ct.StorageError):
            if upload:
                ct.save(sd, f"{run}/step-1", storage_options=options, **CHUNKING).wait(timeout=60)
            else:
                ct.load({k: torch.empty_like(v) for k, v in sd.items()}, f"{run}/step-1",
                        storage_options=options)
        took = time.monotonic() - started
        assert proxy.stats().faults.get(kind, 0) > 0
    assert took <= bound, took
    names = [c.name for c in catalog.list_checkpoints(run, s3_server.storage_options)]
    assert names == ([] if upload else ["step-1"])
