"""The fault-injecting proxy itself, in front of the real embedded SeaweedFS, driven by plain
botocore (not ckptturbo's store): every fault kind is observable as the kind of failure a
client sees, faults are reproducible from the seed, outages switch on and off, latency and
bandwidth caps slow requests down, bytes are counted, and stopping ends every connection.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.session import get_session

from ckptturbo.testing.fault_proxy import FaultProxy, Faults, Outage
from ckptturbo.testing.http_wire import Reader, Writer, copy_chunked
from ckptturbo.testing.proxy_process import ProxyProcess
from tests.waiting import wait_until

TIMEOUT_S = 1.0
BLOB = os.urandom(3 << 20)


def client(endpoint: str, server, timeout: float = TIMEOUT_S):
    """A botocore S3 client without retries or checksum validation: it shows each fault."""
    return get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=server.key, aws_secret_access_key=server.secret,
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                      connect_timeout=timeout, read_timeout=timeout,
                      response_checksum_validation="when_required",
                      request_checksum_calculation="when_required",
                      s3={"addressing_style": "path"}))


@pytest.fixture(scope="module")
def objects(s3_server):
    """Two objects put straight to the server (no proxy): their keys, one prefix per module."""
    prefix = s3_server.url().split("/", 3)[3]
    direct = client(s3_server.endpoint, s3_server, timeout=10)
    keys = {"blob": f"{prefix}/blob", "small": f"{prefix}/small"}
    direct.put_object(Bucket=s3_server.bucket, Key=keys["blob"], Body=BLOB)
    direct.put_object(Bucket=s3_server.bucket, Key=keys["small"], Body=b"x" * 1000)
    return keys


def get(c, bucket: str, key: str) -> bytes:
    return c.get_object(Bucket=bucket, Key=key)["Body"].read()


def settled_stats(proxy, timeout_s: float = 5.0):
    """The counters once the proxy has booked the last answer: the client holds every byte of
    a response a moment before the proxy's sending thread returns and counts it."""
    wait_until(lambda: not proxy.stats().in_flight, timeout_s)
    return proxy.stats()


def test_passes_requests_through_and_counts_bytes(s3_server, objects):
    with FaultProxy(s3_server.endpoint) as proxy:
        c = client(proxy.endpoint, s3_server)
        bucket = s3_server.bucket
        c.put_object(Bucket=bucket, Key=objects["blob"] + ".copy", Body=BLOB)
        assert get(c, bucket, objects["blob"] + ".copy") == BLOB
        ranged = c.get_object(Bucket=bucket, Key=objects["blob"], Range="bytes=100-199")
        assert ranged["Body"].read() == BLOB[100:200]
        assert c.head_object(Bucket=bucket, Key=objects["small"])["ContentLength"] == 1000
        listed = c.list_objects_v2(Bucket=bucket, Prefix=objects["blob"])
        keys = {o["Key"] for o in listed["Contents"]}
        assert keys == {objects["blob"], objects["blob"] + ".copy"}
        c.delete_object(Bucket=bucket, Key=objects["blob"] + ".copy")
        stats = settled_stats(proxy)
    assert stats.requests == 6 and stats.connections >= 1
    assert len(BLOB) < stats.bytes_up < len(BLOB) + (64 << 10)  # the PUT body, plus heads
    assert len(BLOB) < stats.bytes_down < len(BLOB) + (64 << 10)  # the GET, plus the rest
    assert stats.in_flight == 0 and stats.peak_in_flight == 1 and stats.faults == {}
    assert proxy.events() == []


@pytest.mark.parametrize("kind,code,status", [("error_500", "InternalError", 500),
                                              ("slow_down", "SlowDown", 503)])
def test_error_answers_are_s3_errors(s3_server, objects, kind, code, status):
    with FaultProxy(s3_server.endpoint, faults=Faults(**{kind: 1.0})) as proxy:
        c = client(proxy.endpoint, s3_server)
        for call in (lambda: get(c, s3_server.bucket, objects["small"]),
                     lambda: c.put_object(Bucket=s3_server.bucket, Key=objects["small"] + ".x",
                                          Body=BLOB)):
            with pytest.raises(ClientError) as info:
                call()
            error = info.value.response
            assert error["Error"]["Code"] == code  # parsed from the XML body
            assert error["ResponseMetadata"]["HTTPStatusCode"] == status
            assert error["ResponseMetadata"]["RequestId"].startswith("ckptturbo-fault-")
        with pytest.raises(ClientError) as info:  # HEAD: the status alone, no body
            c.head_object(Bucket=s3_server.bucket, Key=objects["small"])
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert proxy.stats().faults == {kind: 3}
    direct = client(s3_server.endpoint, s3_server)
    with pytest.raises(ClientError, match="404|Not Found|NoSuchKey"):  # never forwarded
        direct.head_object(Bucket=s3_server.bucket, Key=objects["small"] + ".x")


def test_reset_closes_the_connection_without_an_answer(s3_server, objects):
    with FaultProxy(s3_server.endpoint, faults=Faults(reset=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        with pytest.raises(ConnectionClosedError):
            get(c, s3_server.bucket, objects["small"])
        with socket.create_connection(("127.0.0.1", proxy.port)) as raw:
            raw.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            with pytest.raises(ConnectionResetError):  # an RST, not a clean FIN
                raw.recv(100)
        assert [e.fault for e in proxy.events()] == ["reset", "reset"]


def test_black_hole_never_answers(s3_server, objects):
    with FaultProxy(s3_server.endpoint, faults=Faults(black_hole=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        began = time.monotonic()
        with pytest.raises(ReadTimeoutError):
            get(c, s3_server.bucket, objects["small"])
        assert TIMEOUT_S <= time.monotonic() - began < TIMEOUT_S + 5
        assert proxy.stats().bytes_down == 0 and proxy.stats().bytes_up == 0


def test_stall_download_goes_silent_in_the_middle_of_the_body(s3_server, objects):
    with FaultProxy(s3_server.endpoint, faults=Faults(stall_download=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        response = c.get_object(Bucket=s3_server.bucket, Key=objects["blob"])  # the head came
        assert response["ContentLength"] == len(BLOB)
        received = bytearray()
        with pytest.raises(ReadTimeoutError):
            while chunk := response["Body"].read(4096):
                received += chunk
        (event,) = proxy.events()
        assert event.fault == "stall_download" and event.offset < len(BLOB)
        # every byte before the stall arrived (but a last partial read of up to 4 KiB)
        assert event.offset - 4096 < len(received) <= event.offset
        assert received == BLOB[:len(received)]


def test_stall_upload_goes_silent_in_the_middle_of_the_body(s3_server, objects):
    key = objects["blob"] + ".stalled"
    with FaultProxy(s3_server.endpoint, faults=Faults(stall_upload=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        began = time.monotonic()
        # the client times out waiting for the answer, or, when the rest of the body does not
        # fit in the socket buffers, while sending it (botocore calls that "closed")
        with pytest.raises((ReadTimeoutError, ConnectionClosedError)):
            c.put_object(Bucket=s3_server.bucket, Key=key, Body=BLOB)
        assert time.monotonic() - began >= TIMEOUT_S  # a stall, not a close
        assert get(c, s3_server.bucket, objects["small"]) == b"x" * 1000  # no body: passes
        (event,) = proxy.events()
        assert event.fault == "stall_upload" and event.method == "PUT" and event.offset < len(BLOB)
        assert proxy.stats().bytes_up < len(BLOB)
    direct = client(s3_server.endpoint, s3_server)
    with pytest.raises(ClientError, match="404|Not Found"):  # the server never got it all
        direct.head_object(Bucket=s3_server.bucket, Key=key)


def test_truncate_cuts_the_body_short(s3_server, objects):
    with FaultProxy(s3_server.endpoint, faults=Faults(truncate=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        response = c.get_object(Bucket=s3_server.bucket, Key=objects["blob"])
        with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
            response["Body"].read()
        (event,) = proxy.events()
        assert event.fault == "truncate" and 0 <= event.offset < len(BLOB)


def test_flip_byte_corrupts_exactly_one_byte(s3_server, objects):
    with FaultProxy(s3_server.endpoint, seed=3, faults=Faults(flip_byte=1.0)) as proxy:
        c = client(proxy.endpoint, s3_server)
        data = get(c, s3_server.bucket, objects["blob"])
        (event,) = proxy.events()
    assert len(data) == len(BLOB)
    diff = [i for i in range(len(BLOB)) if data[i] != BLOB[i]]
    assert diff == [event.offset] and data[event.offset] == BLOB[event.offset] ^ 0xFF


def _outcomes(endpoint: str, server, key: str, tags: list[str | None], workers: int) -> list[str]:
    """GET ``key`` once per tag (a tag makes the request distinct for the proxy: it goes
    in the query as response-cache-control); what each saw: "ok" or the error's class.
    The faults drawn here answer or close at once (none stalls), so the client may wait
    long: a short timeout turned a slow answer on a loaded machine into a ReadTimeoutError
    that no fault caused (seen once in CI-like runs)."""
    c = client(endpoint, server, timeout=10.0)

    def one(tag: str | None) -> str:
        extra = {"ResponseCacheControl": tag} if tag else {}
        try:
            c.get_object(Bucket=server.bucket, Key=key, **extra)["Body"].read()
            return "ok"
        except Exception as exc:  # noqa: BLE001 - the kind of failure is the outcome
            return type(exc).__name__

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, tags))


def test_faults_are_reproducible_from_the_seed(s3_server, objects):
    """The same seed gives the same faults on the same requests, even when the requests
    arrive in another order over other connections; another seed gives other faults."""
    faults = Faults(error_500=0.1, slow_down=0.1, reset=0.1, truncate=0.1, flip_byte=0.1)
    tags = [f"n{i}" for i in range(40)]  # 40 distinct requests

    def run(seed: int, workers: int) -> tuple[list[tuple[str, str, int | None]], list[str]]:
        with FaultProxy(s3_server.endpoint, seed=seed, faults=faults) as proxy:
            outcomes = _outcomes(proxy.endpoint, s3_server, objects["blob"], tags, workers)
            return sorted((e.target, e.fault, e.offset) for e in proxy.events()), outcomes

    first, outcomes = run(11, workers=1)
    again, outcomes_again = run(11, workers=4)
    other, _ = run(12, workers=1)
    assert first == again and outcomes == outcomes_again
    assert first != other
    kinds = {fault for _, fault, _ in first}
    assert 8 <= len(first) <= 32 and len(kinds) >= 3, first  # about half of 40 requests
    flips = sum(fault == "flip_byte" for _, fault, _ in first)
    assert outcomes.count("ok") == 40 - len(first) + flips  # a flipped byte reads "ok"


def test_a_retried_request_is_a_new_draw(s3_server, objects):
    with FaultProxy(s3_server.endpoint, seed=5, faults=Faults(slow_down=0.5)) as proxy:
        outcomes = _outcomes(proxy.endpoint, s3_server, objects["small"], [None] * 20, workers=1)
    assert 3 <= outcomes.count("ClientError") <= 17 and "ok" in outcomes, outcomes


def test_faults_only_hit_matching_requests(s3_server, objects):
    faults = Faults(error_500=1.0, methods=("PUT",), path_contains=".only-these")
    with FaultProxy(s3_server.endpoint, faults=faults) as proxy:
        c = client(proxy.endpoint, s3_server)
        assert get(c, s3_server.bucket, objects["small"]) == b"x" * 1000
        c.put_object(Bucket=s3_server.bucket, Key=objects["small"] + ".other", Body=b"y")
        with pytest.raises(ClientError, match="InternalError"):
            c.put_object(Bucket=s3_server.bucket, Key=objects["small"] + ".only-these", Body=b"y")
        proxy.set_faults(Faults())
        c.put_object(Bucket=s3_server.bucket, Key=objects["small"] + ".only-these", Body=b"y")
        assert proxy.stats().faults == {"error_500": 1}


def test_outages_switch_on_and_off_while_running(s3_server, objects):
    with FaultProxy(s3_server.endpoint) as proxy:
        c = client(proxy.endpoint, s3_server)

        def ok() -> bool:
            return get(c, s3_server.bucket, objects["small"]) == b"x" * 1000

        assert ok()
        proxy.set_outage(Outage.SLOW_DOWN)
        for _ in range(3):
            with pytest.raises(ClientError, match="SlowDown"):
                ok()
        proxy.set_outage(Outage.NONE)
        assert ok()
        proxy.set_outage(Outage.REFUSE)  # returns once the accept loop has closed the port
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
        fresh = client(proxy.endpoint, s3_server)
        with pytest.raises(EndpointConnectionError):
            get(fresh, s3_server.bucket, objects["small"])
        with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
            ok()  # an open connection is reset at its next request, then refused
        proxy.set_outage(Outage.NONE)  # returns once the port listens again
        assert ok()  # the same port again
        proxy.set_outage(Outage.BLACK_HOLE)
        with pytest.raises(ReadTimeoutError):
            ok()
        proxy.set_outage(Outage.NONE)
        assert ok()


def test_latency_and_bandwidth_cap_slow_requests(s3_server, objects):
    with FaultProxy(s3_server.endpoint, latency_s=0.2) as proxy:
        c = client(proxy.endpoint, s3_server)
        began = time.monotonic()
        for _ in range(3):
            c.head_object(Bucket=s3_server.bucket, Key=objects["small"])
        assert time.monotonic() - began >= 3 * 0.2
    rate = 4e6
    with FaultProxy(s3_server.endpoint, conn_rate=rate) as proxy:
        c = client(proxy.endpoint, s3_server, timeout=10)
        began = time.monotonic()
        assert get(c, s3_server.bucket, objects["blob"]) == BLOB
        # the first 256 KiB may go at once (the token bucket's burst), the rest at the rate
        assert time.monotonic() - began >= (len(BLOB) - (256 << 10)) / rate * 0.9


def test_stop_ends_silent_connections_and_every_thread(s3_server, objects):
    proxy = FaultProxy(s3_server.endpoint, faults=Faults(black_hole=1.0)).start()
    held = socket.create_connection(("127.0.0.1", proxy.port))
    held.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert wait_until(lambda: proxy.stats().in_flight == 1)  # read, and held unanswered
    began = time.monotonic()
    proxy.stop()
    assert time.monotonic() - began < 5
    held.settimeout(2)
    assert held.recv(100) == b""  # the proxy closed it
    held.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("fault-proxy")]
    assert alive == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()


def test_proxy_process_is_controlled_from_outside(s3_server, objects):
    with ProxyProcess(s3_server.endpoint, seed=1) as proxy:
        c = client(proxy.endpoint, s3_server)
        assert get(c, s3_server.bucket, objects["small"]) == b"x" * 1000
        stats = settled_stats(proxy.control)
        assert stats.requests == 1 and stats.bytes_down > 1000
        proxy.control.reset_stats()
        assert proxy.control.stats().requests == 0
        proxy.control.set_faults(Faults(slow_down=1.0))
        with pytest.raises(ClientError, match="SlowDown"):
            get(c, s3_server.bucket, objects["small"])
        proxy.control.set_faults(Faults())
        proxy.control.set_outage(Outage.SLOW_DOWN)
        with pytest.raises(ClientError, match="SlowDown"):
            get(c, s3_server.bucket, objects["small"])
        proxy.control.set_outage("none")
        assert get(c, s3_server.bucket, objects["small"]) == b"x" * 1000
        assert proxy.control.stats().faults == {"slow_down": 2}
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()


@pytest.mark.parametrize("flip_at,stop_at", [(None, None), (5, None), (None, 7)])
def test_chunked_bodies_are_framed_and_faulted_in_their_first_chunk(flip_at, stop_at):
    """SeaweedFS answers S3 calls with Content-Length; chunked bodies (which other servers
    and clients use) go through the same framing code, shown here on a socket pair."""
    wire = b"a;ext=1\r\n" + b"a" * 10 + b"\r\n" + b"3\r\n" + b"b" * 3 + b"\r\n0\r\nT: 1\r\n\r\n"
    src_in, src_out = socket.socketpair()
    dst_in, dst_out = socket.socketpair()
    with src_in, src_out, dst_in, dst_out:
        src_in.sendall(wire + b"NEXT")
        sent = []
        complete = copy_chunked(Reader(src_out), Writer(dst_in, sent.append, 0.0),
                                stop_at=stop_at, flip_at=flip_at)
        dst_in.close()
        out = b""
        while more := dst_out.recv(1 << 16):
            out += more
    assert complete == (stop_at is None) and sum(sent) == len(out)
    if stop_at is not None:
        assert out == wire[:len(b"a;ext=1\r\n") + stop_at]
    elif flip_at is not None:
        at = len(b"a;ext=1\r\n") + flip_at
        assert out == wire[:at] + bytes([wire[at] ^ 0xFF]) + wire[at + 1:]
    else:
        assert out == wire  # byte for byte, trailers included
