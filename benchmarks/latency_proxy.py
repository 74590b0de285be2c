"""A loopback TCP proxy that makes a local S3 server behave like a remote one.

On one machine every request to SeaweedFS answers in a millisecond at memory speed, which
hides exactly what matters for loading models from object stores: each request pays a
round trip before its first byte, and each connection is limited in bandwidth, so only
many parallel ranged requests reach the aggregate bandwidth. This proxy adds both:

* a first-byte delay per request (the client's first bytes after a response are held
  back ``--latency-ms`` before they go upstream), and
* a per-connection bandwidth cap on responses (``--conn-mbps``, token-bucket paced).

It binds 127.0.0.1 only, prints ``PORT <n>`` on its first stdout line, and stops by itself:
when its parent process dies, after ``--idle-exit`` seconds without connections, or after
``--max-seconds``. Every ``--stats-interval`` it writes JSON statistics to
``--stats-file``; SIGUSR1 resets them, so one proxy can measure several runs in turn.
"concurrent" counts connections with a request in flight (sent, response not yet over;
a response is over when no byte came for 25 ms), sampled every 10 ms.

Run as ``python -m benchmarks.latency_proxy --upstream 127.0.0.1:PORT``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

BUSY_GAP_S = 0.025
CHUNK = 64 << 10


class Proxy:
    def __init__(self, upstream: tuple[str, int], latency: float, rate: float) -> None:
        self.upstream = upstream
        self.latency = latency
        self.rate = rate  # bytes per second per connection
        self.conns: dict[int, dict] = {}
        self.last_activity = time.monotonic()
        self.reset()

    def reset(self) -> None:
        self.stats = {"requests": 0, "bytes": 0, "connections": 0, "peak_concurrent": 0,
                      "started": time.time()}

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstream)
        except OSError:
            cwriter.close()
            return
        state = {"new_request": True, "in_flight": False, "last_byte": 0.0}
        self.conns[id(state)] = state
        self.stats["connections"] += 1
        try:
            await asyncio.gather(self._requests(creader, uwriter, state),
                                 self._responses(ureader, cwriter, state))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a peer went away, or the proxy is shutting down
        finally:
            self.conns.pop(id(state), None)
            self.last_activity = time.monotonic()
            for w in (cwriter, uwriter):
                w.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        state: dict) -> None:
        while data := await reader.read(CHUNK):
            if state["new_request"]:
                state["new_request"] = False
                state["in_flight"] = True
                state["last_byte"] = 0.0
                self.stats["requests"] += 1
                await asyncio.sleep(self.latency)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()

    async def _responses(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         state: dict) -> None:
        loop = asyncio.get_running_loop()
        free_at = loop.time()
        while data := await reader.read(CHUNK):
            state["new_request"] = True
            now = loop.time()
            free_at = max(free_at, now) + len(data) / self.rate
            if free_at - now > 0.002:
                await asyncio.sleep(free_at - now)
            writer.write(data)
            await writer.drain()
            state["last_byte"] = time.monotonic()
            self.stats["bytes"] += len(data)
        writer.close()

    async def sample(self, stats_file: str | None, interval: float) -> None:
        next_write = 0.0
        while True:
            now = time.monotonic()
            busy = 0
            for s in self.conns.values():
                if s["in_flight"] and s["last_byte"] and now - s["last_byte"] > BUSY_GAP_S:
                    s["in_flight"] = False
                busy += s["in_flight"]
            self.stats["peak_concurrent"] = max(self.stats["peak_concurrent"], busy)
            if self.conns:
                self.last_activity = now
            if stats_file and now >= next_write:
                tmp = f"{stats_file}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.stats, f)
                os.replace(tmp, stats_file)
                next_write = now + interval
            await asyncio.sleep(0.01)


async def main(args: argparse.Namespace) -> None:
    host, port = args.upstream.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit("the proxy only forwards to loopback")
    proxy = Proxy((host, int(port)), args.latency_ms / 1000, args.conn_mbps * 1e6)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.port)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.reset)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, lambda: stop.done() or stop.set_result(None))
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)  # ready for signals too
    sampler = asyncio.create_task(proxy.sample(args.stats_file, args.stats_interval))
    parent, began = os.getppid(), time.monotonic()
    async with server:
        while not stop.done():
            await asyncio.sleep(0.2)
            idle = time.monotonic() - proxy.last_activity
            if (os.getppid() != parent or idle > args.idle_exit
                    or time.monotonic() - began > args.max_seconds):
                break
    sampler.cancel()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT on loopback")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="first-byte delay per request")
    p.add_argument("--conn-mbps", type=float, default=100.0, help="MB/s cap per connection")
    p.add_argument("--idle-exit", type=float, default=120.0, help="exit after this idle time (s)")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (s)")
    p.add_argument("--stats-file", default=None)
    p.add_argument("--stats-interval", type=float, default=0.2)
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)
