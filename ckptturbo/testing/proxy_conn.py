"""One client connection through the fault proxy: two threads, one per direction.

The request thread reads each request head from the client, asks the proxy for the
request's fate, and forwards it (or answers it, resets, or goes silent); the response
thread forwards the server's answers in order, applying the body faults. They pass a
queue of :class:`_Pending` requests, so an interim ``100 Continue`` reaches a client that
waits for it before sending a body. Either thread that ends shuts both sockets down,
which ends the other; the request thread then closes them.
"""
from __future__ import annotations

import queue
import select
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .http_wire import (
    Reader,
    WireError,
    Writer,
    chunk_size,
    copy_chunked,
    copy_exact,
    copy_to_close,
    drain_body,
)

if TYPE_CHECKING:
    from .fault_proxy import Decision, FaultProxy

RESPONSE_FAULTS = frozenset({"stall_download", "truncate", "flip_byte"})
REQUEST_BODY_FAULTS = frozenset({"stall_upload", "flip_upload"})

_POLL_S = 0.25  # how often a silent (faulted) connection looks at the proxy and its client
_FINISH_S = 30.0  # how long a closing connection waits for its last answers to go out

# What the request thread does after a request: read the next one, end the connection
# once the answers owed have been sent, or end it at once.
_NEXT, _FINISH, _ABORT = "next", "finish", "abort"

_S3_ERRORS = {
    "error_500": ("500 Internal Server Error", "InternalError",
                  "We encountered an internal error. Please try again."),
    "slow_down": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
}


def s3_error(kind: str, resource: str, request_id: str, head_only: bool,
             close: bool) -> bytes:
    """A complete S3 error response (XML body as S3 sends it; none for HEAD)."""
    status, code, message = _S3_ERRORS[kind]
    body = ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{resource}</Resource><RequestId>{request_id}</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: {request_id}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode()
    return head if head_only else head + body


def _fault_offset(reader: Reader, size: int | None, decision: Decision) -> int | None:
    """Where in a body a body fault acts: in the body, or in the first chunk of a chunked
    body (``size`` None; the chunk-size line is peeked, not consumed); None if it is empty."""
    span = size if size is not None else chunk_size(reader.peek_line())
    return decision.offset(span) if span > 0 else None


@dataclass(frozen=True)
class _Pending:
    """A request the response thread must answer, in order."""

    method: str
    target: str
    decision: Decision
    synthetic: bytes | None = None  # an answer made here instead of the server's
    close_after: bool = False


class Connection:
    """A client connection and its own connection to the server, with their two threads."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.client_gone = threading.Event()
        self.done = threading.Event()
        self._pending: queue.Queue[_Pending | None] = queue.Queue()
        self._owed = 0  # requests decided but not yet answered (for in-flight accounting)
        self._owed_lock = threading.Lock()
        self.to_server = Writer(server, lambda n: proxy.count(up=n), proxy.conn_rate)
        self.to_client = Writer(client, lambda n: proxy.count(down=n), proxy.conn_rate)
        self._requests = threading.Thread(target=self._request_loop, daemon=True,
                                          name="fault-proxy-requests")
        self._responses = threading.Thread(target=self._response_loop, daemon=True,
                                           name="fault-proxy-responses")

    def start(self) -> None:
        self._responses.start()
        self._requests.start()

    def join(self, timeout: float) -> None:
        self._requests.join(timeout)

    def shutdown(self) -> None:
        """Wake both threads out of any blocking call; each then ends."""
        self.done.set()
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answered(self) -> None:
        with self._owed_lock:
            self._owed -= 1
        self.proxy.finished()

    # ------------------------------------------------------------------ client -> server
    def _request_loop(self) -> None:
        reader = Reader(self.client)
        outcome = _ABORT
        try:
            while not self.done.is_set() and (outcome := self._one_request(reader)) == _NEXT:
                pass
        except (OSError, WireError):
            outcome = _ABORT  # the client or the server went away
        finally:
            self._pending.put(None)
            if outcome == _FINISH:
                self._responses.join(timeout=_FINISH_S)
            self.shutdown()
            self._responses.join(timeout=30)
            for sock in (self.client, self.server):
                sock.close()
            self.to_server.close()
            self.to_client.close()
            with self._owed_lock:
                owed, self._owed = self._owed, 0
            self.proxy.finished(owed)
            self.proxy.forget(self)

    def _one_request(self, reader: Reader) -> str:
        """Handle one request; say what comes next (_NEXT, _FINISH or _ABORT)."""
        head = reader.read_head()
        if head is None:
            self.client_gone.set()
            return _FINISH
        method, target = head.start[0], head.start[1]
        decision = self.proxy.decide(method, target, head.headers.get("range", ""))
        with self._owed_lock:
            self._owed += 1
        if self.proxy.latency_s and self.proxy.stopping.wait(self.proxy.latency_s):
            return _ABORT
        fault = decision.fault
        if fault == "reset":
            self.proxy.record(method, target, fault)
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.client.close()  # with linger 0: an RST, not a FIN
            return _ABORT
        if fault == "black_hole":
            self.proxy.record(method, target, fault)
            self._hold(self.client, discard=True)
            return _ABORT
        if fault in ("error_500", "slow_down"):
            self.proxy.record(method, target, fault)
            expects = head.headers.get("expect", "").lower() == "100-continue"
            if not expects:  # read the body, so that the answer is not lost in a reset
                drain_body(reader, head)
            request_id = f"ckptturbo-fault-{self.proxy.port}-{self.proxy.stats().requests}"
            answer = s3_error(fault, target.split("?", 1)[0], request_id, method == "HEAD",
                              close=expects)
            self._pending.put(_Pending(method, target, decision, answer, close_after=expects))
            return _FINISH if expects else _NEXT
        self._pending.put(_Pending(method, target, decision))
        self.to_server.send(head.raw)
        size = head.content_length
        stop_at = flip_at = None
        if fault in REQUEST_BODY_FAULTS and (head.is_chunked or size):
            offset = _fault_offset(reader, size, decision)
            if offset is not None:
                self.proxy.record(method, target, fault, offset)
                if fault == "stall_upload":
                    stop_at = offset
                else:
                    flip_at = offset
        if head.is_chunked:
            complete = copy_chunked(reader, self.to_server, stop_at=stop_at, flip_at=flip_at)
        else:
            complete = copy_exact(reader, self.to_server, size or 0, stop_at=stop_at,
                                  flip_at=flip_at)
        if not complete:
            self._hold(self.client, discard=False)
            return _ABORT
        return _NEXT

    def _hold(self, sock: socket.socket, discard: bool) -> None:
        """Stay silent until the proxy stops or the peer closes. ``discard``: keep reading
        (and dropping) what the peer sends; otherwise read nothing, so its sends block."""
        while not self.done.is_set() and not self.client_gone.is_set():
            readable, _, _ = select.select([sock], [], [], _POLL_S)
            if not readable:
                continue
            data = sock.recv(1 << 16) if discard else sock.recv(1, socket.MSG_PEEK)
            if not data:
                self.client_gone.set()
                return
            if not discard:
                self.done.wait(_POLL_S)  # data waits unread: poll for the close slowly

    # ------------------------------------------------------------------ server -> client
    def _response_loop(self) -> None:
        reader = Reader(self.server)
        try:
            while (item := self._next_pending()) is not None:
                if not self._one_response(reader, item):
                    break
        except (OSError, WireError):
            pass
        finally:
            self.shutdown()

    def _next_pending(self) -> _Pending | None:
        while not self.done.is_set():
            try:
                return self._pending.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _one_response(self, reader: Reader, item: _Pending) -> bool:
        """Answer one request; False ends the connection."""
        if item.synthetic is not None:
            self.to_client.send(item.synthetic)
            self._answered()
            return not item.close_after
        while True:
            head = reader.read_head()
            if head is None:
                return False
            self.to_client.send(head.raw)
            if not head.start[1].startswith("1"):
                break  # a final response; 1xx heads (100 Continue) precede it
        status = head.start[1]
        no_body = item.method == "HEAD" or status in ("204", "304")
        fault = item.decision.fault
        size = head.content_length
        if no_body or (size == 0 and not head.is_chunked):
            self._answered()
            return True
        if not head.is_chunked and size is None:
            copy_to_close(reader, self.to_client, self.done)
            self._answered()
            return False
        stop_at = flip_at = None
        offset = _fault_offset(reader, size, item.decision) if fault in RESPONSE_FAULTS else None
        if offset is not None:
            assert fault is not None  # an offset comes only with a response fault
            self.proxy.record(item.method, item.target, fault, offset)
            if fault == "flip_byte":
                flip_at = offset
            else:
                stop_at = offset
        if head.is_chunked:
            complete = copy_chunked(reader, self.to_client, stop_at=stop_at, flip_at=flip_at)
        else:
            # size is known here: a body without one was copied to the close above
            complete = copy_exact(reader, self.to_client, size or 0, stop_at=stop_at,
                                  flip_at=flip_at)
        if complete:
            self._answered()
            return True
        if fault == "stall_download":
            self._wait_silently()
        return False  # truncated: the connection closes here

    def _wait_silently(self) -> None:
        """After a mid-download stall: keep the connection open until the client gives up
        (the request thread sees it close) or the proxy stops."""
        while not self.done.is_set() and not self.client_gone.is_set():
            self.done.wait(_POLL_S)
