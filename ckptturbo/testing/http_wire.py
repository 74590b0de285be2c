"""HTTP/1.1 message framing on raw sockets, for the fault-injecting proxy.

The proxy must see where each request and response starts and ends (to fault one request,
not a whole connection) without rewriting what passes through: this module reads message
heads, tells how a body is framed (Content-Length, chunked, or up to the close) and copies
bodies, stopping or flipping a byte at a given offset when asked. Bodies that pass through
untouched move with splice(2) where the platform has it (no copy through Python), so a
benchmark behind the proxy is not measuring the proxy. Sockets must be blocking.
"""
from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEAD = 64 << 10  # a longer request or response head is treated as a broken peer
_PIECE = 1 << 20
_F_SETPIPE_SZ = 1031


class WireError(Exception):
    """The peer closed or sent something that is not HTTP/1.1; the connection is dropped."""


@dataclass(frozen=True)
class Head:
    """A request or response head: its raw bytes (forwarded unchanged) and parsed fields."""

    raw: bytes
    start: tuple[str, str, str]  # (method, target, version) or (version, status, reason)
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value

    @property
    def is_chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.strip().isdigit() else None


def parse_head(raw: bytes) -> Head:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2:
        raise WireError(f"not an HTTP start line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return Head(raw, (parts[0], parts[1], parts[2] if len(parts) > 2 else ""), headers)


class Reader:
    """Buffered reads from one socket: heads and chunk-size lines through a small buffer,
    body bytes straight from the socket once the buffer is empty."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(MAX_HEAD)
        if not data:
            raise WireError("peer closed the connection")
        self.buf += data

    def read_head(self) -> Head | None:
        """The next message head, or None when the peer closed cleanly between messages."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise WireError("message head too long")
            data = self.sock.recv(MAX_HEAD)
            if not data:
                if self.buf:
                    raise WireError("peer closed in the middle of a message head")
                return None
            self.buf += data
        raw = bytes(self.buf[:end + 4])
        del self.buf[:end + 4]
        return parse_head(raw)

    def peek_line(self) -> bytes:
        """The next CRLF-terminated line, left in the buffer."""
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise WireError("chunk-size line too long")
            self._fill()
        return bytes(self.buf[:end + 2])

    def read_line(self) -> bytes:
        line = self.peek_line()
        del self.buf[:len(line)]
        return line

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes."""
        n -= len(self.take_buffered(n))
        while n:
            data = self.sock.recv(min(n, _PIECE))
            if not data:
                raise WireError("peer closed in the middle of a body")
            n -= len(data)

    def take_buffered(self, limit: int) -> bytes:
        data = bytes(self.buf[:limit])
        del self.buf[:limit]
        return data


class Writer:
    """Sends to one socket, counting bytes and pacing them to ``rate`` bytes/s (0: no cap)
    with a token bucket whose idle time earns at most a burst of 256 KiB."""

    _BURST = 256 << 10

    def __init__(self, sock: socket.socket, count: Callable[[int], None], rate: float) -> None:
        self.sock = sock
        self.count = count
        self.rate = rate
        self.piece = self._BURST if rate > 0 else _PIECE
        self._tokens = float(self._BURST)
        self._last = time.monotonic()
        self._pipe: tuple[int, int] | None = None

    def send(self, data: bytes) -> None:
        if data:
            self.sock.sendall(data)
            self.sent(len(data))

    def sent(self, n: int) -> None:
        self.count(n)
        if self.rate > 0:
            t = time.monotonic()
            self._tokens = min(self._BURST, self._tokens + (t - self._last) * self.rate) - n
            self._last = t
            if self._tokens < 0:
                time.sleep(-self._tokens / self.rate)

    def splice_from(self, src: socket.socket, n: int) -> int:
        """Move up to ``n`` bytes from ``src`` to this socket without copying them through
        Python; returns how many moved (0: src is at EOF)."""
        if self._pipe is None:
            self._pipe = os.pipe()
            try:
                fcntl.fcntl(self._pipe[1], _F_SETPIPE_SZ, _PIECE)
            except OSError:
                pass  # the default pipe size only means more, smaller pieces
        r, w = self._pipe
        moved = os.splice(src.fileno(), w, min(n, self.piece))
        left = moved
        while left:
            left -= os.splice(r, self.sock.fileno(), left)
        if moved:
            self.sent(moved)
        return moved

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None


def chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError as exc:
        raise WireError(f"bad chunk-size line {line[:40]!r}") from exc


def drain_body(src: Reader, head: Head) -> None:
    """Read and drop a request's body (to answer it without forwarding it)."""
    if not head.is_chunked:
        src.skip(head.content_length or 0)
        return
    while (size := chunk_size(src.read_line())) > 0:
        src.skip(size + 2)
    while src.read_line() != b"\r\n":
        pass


def copy_exact(src: Reader, dst: Writer, n: int, *, stop_at: int | None = None,
               flip_at: int | None = None) -> bool:
    """Copy ``n`` body bytes from src to dst. With ``stop_at``, copy only that many and
    return False; with ``flip_at``, invert the byte at that offset on the way. Raises
    WireError when src ends early."""
    limit = n if stop_at is None else min(n, stop_at)
    done = 0
    while done < limit:
        want = min(limit - done, dst.piece)
        if flip_at is not None and done <= flip_at < done + want:
            if flip_at > done:
                want = flip_at - done  # up to the byte to flip, then that byte alone
            else:
                byte = src.take_buffered(1) or src.sock.recv(1)
                if not byte:
                    raise WireError("peer closed in the middle of a body")
                dst.send(bytes([byte[0] ^ 0xFF]))
                done += 1
                continue
        if src.buf:
            data = src.take_buffered(want)
            dst.send(data)
            got = len(data)
        elif hasattr(os, "splice"):
            got = dst.splice_from(src.sock, want)
        else:
            data = src.sock.recv(want)
            dst.send(data)
            got = len(data)
        if not got:
            raise WireError("peer closed in the middle of a body")
        done += got
    return stop_at is None or stop_at >= n


def copy_chunked(src: Reader, dst: Writer, *, stop_at: int | None = None,
                 flip_at: int | None = None) -> bool:
    """Copy a chunked body through its last chunk and trailers. ``stop_at``/``flip_at`` are
    offsets into the first non-empty chunk's data (see :func:`copy_exact`)."""
    first = True
    while True:
        line = src.read_line()
        dst.send(line)
        size = chunk_size(line)
        if size == 0:
            break
        if first:
            first = False
            if not copy_exact(src, dst, size, stop_at=stop_at, flip_at=flip_at):
                return False
        else:
            copy_exact(src, dst, size)
        dst.send(src.read_line())  # the CRLF after the chunk's data
    while (trailer := src.read_line()) != b"\r\n":
        dst.send(trailer)
    dst.send(trailer)
    return True


def copy_to_close(src: Reader, dst: Writer, stop: threading.Event) -> None:
    """Copy a body framed by the close of the connection (HTTP/1.0 style)."""
    dst.send(src.take_buffered(len(src.buf)))
    while not stop.is_set():
        data = src.sock.recv(dst.piece)
        if not data:
            return
        dst.send(data)
