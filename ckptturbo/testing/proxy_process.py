"""Run the fault proxy in a process of its own, controlled over a loopback socket.

A benchmark that measures ckptturbo behind the proxy must not share its interpreter (and
its GIL) with the proxy's forwarding threads, or it would measure the proxy. And a
benchmark's rank processes read the proxy's byte counts too. So :class:`ProxyProcess`
runs a :class:`~ckptturbo.testing.fault_proxy.FaultProxy` in a forked child, and
:class:`ProxyControl` (picklable: it is a port number) asks that child for its stats,
resets them, or switches faults and outages, from any process on the machine.

Protocol: one JSON object per line each way on the control port, ``{"op": "stats"}``,
``{"op": "reset"}``, ``{"op": "outage", "mode": "black_hole"}``,
``{"op": "faults", "faults": {...Faults fields...}}``; the answer is ``{"ok": ...}`` or
``{"error": "..."}``. The child exits when its parent closes the pipe it watches (on
:meth:`ProxyProcess.stop`, or when the parent dies).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from .fault_proxy import FaultProxy, Faults, Outage, ProxyStats, with_endpoint

_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProxyControl:
    """Talks to a proxy process's control port (from any process)."""

    port: int

    def _ask(self, request: dict[str, Any]) -> Any:
        with socket.create_connection(("127.0.0.1", self.port), timeout=_TIMEOUT_S) as s:
            s.sendall(json.dumps(request).encode() + b"\n")
            with s.makefile("rb") as f:
                answer = json.loads(f.readline() or b'{"error": "no answer"}')
        if "error" in answer:
            raise RuntimeError(f"fault proxy control: {answer['error']}")
        return answer["ok"]

    def stats(self) -> ProxyStats:
        return ProxyStats(**self._ask({"op": "stats"}))

    def reset_stats(self) -> None:
        self._ask({"op": "reset"})

    def set_outage(self, outage: Outage | str) -> None:
        self._ask({"op": "outage", "mode": Outage(outage).value})

    def set_faults(self, faults: Faults) -> None:
        self._ask({"op": "faults", "faults": dataclasses.asdict(faults)})


def _serve_control(proxy: FaultProxy, control: socket.socket) -> None:
    while True:
        try:
            conn, _ = control.accept()
        except OSError:
            return  # the control socket was closed: the process is ending
        with conn, conn.makefile("rwb") as f:
            try:
                request = json.loads(f.readline())
                answer: dict[str, Any] = {"ok": _apply(proxy, request)}
            except Exception as exc:  # noqa: BLE001 - reported to the asking process
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            f.write(json.dumps(answer).encode() + b"\n")
            f.flush()


def _apply(proxy: FaultProxy, request: dict[str, Any]) -> Any:
    op = request["op"]
    if op == "stats":
        return proxy.stats().to_json()
    if op == "reset":
        return proxy.reset_stats()
    if op == "outage":
        return proxy.set_outage(request["mode"])
    if op == "faults":
        fields = dict(request["faults"])
        fields["methods"] = tuple(fields.get("methods", ()))
        return proxy.set_faults(Faults(**fields))
    raise ValueError(f"unknown op {op!r}")


def _child_main(proxy: FaultProxy, control: socket.socket, lifeline: Any, parent_end: Any) -> None:
    parent_end.close()
    proxy.start()
    threading.Thread(target=_serve_control, args=(proxy, control), daemon=True).start()
    try:
        lifeline.recv()  # returns (EOFError) when the parent closes its end or dies
    except (EOFError, OSError):
        pass
    control.close()
    proxy.stop()
    os._exit(0)


class ProxyProcess:
    """A :class:`FaultProxy` (same arguments) in a forked child process.

    The proxy binds its port here, before the fork, so :attr:`endpoint` is valid at once.
    """

    def __init__(self, upstream: str, **kwargs: Any) -> None:
        proxy = FaultProxy(upstream, **kwargs)  # not started: its threads start in the child
        self.port = proxy.port
        control = socket.socket()
        control.bind(("127.0.0.1", 0))
        control.listen(64)
        self.control = ProxyControl(control.getsockname()[1])
        ctx = multiprocessing.get_context("fork")
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main,
                                 args=(proxy, control, lifeline, self._lifeline),
                                 daemon=True, name=f"fault-proxy-{self.port}")
        self._proc.start()
        lifeline.close()
        control.close()
        proxy.close_listener()  # the child holds its own copy

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A copy of s3fs/fsspec ``options`` with the endpoint replaced by this proxy."""
        return with_endpoint(options, self.endpoint)

    def stop(self) -> None:
        """Ask the child to stop (it closes every connection), then reap it by PID."""
        self._lifeline.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
