"""How busy the machine's cores were during a measurement, from /proc/stat.

A benchmark of links is only valid while the cores are not what decides: a result taken
with the cores more than :data:`BUSY_LIMIT` busy is marked as not valid. The sampler runs
on a thread of the benchmark's main process and keeps the whole machine's counters every
``interval``; a measurement taken in any process (rank processes included) asks for the
busy fraction between its two clock readings (``time.perf_counter``, which on Linux is
the system-wide monotonic clock, the same in every process).
"""
from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from collections.abc import Callable

BUSY_LIMIT = 0.70


def _busy_total() -> tuple[int, int]:
    """(busy, total) jiffies of all cores: idle and iowait are not busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already in user time
    return total - idle, total


def _own_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every process below it (ranks, the store, its server),
    the reaped children's included: what this benchmark itself spends."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total = 0
    for pid, count in ticks.items():
        up = pid
        while up not in (0, 1, root) and up in parents:
            up = parents[up]
        if up == root:
            total += count
    return total


class CoreSampler:
    """Samples /proc/stat every ``interval`` seconds while open; :meth:`busy` gives the
    fraction of all cores' time spent busy between two perf_counter readings. Byte
    counters handed to :meth:`watch` (a link's statistics files) are sampled with them, so
    that :meth:`bulk_done` can tell when a link had carried a measurement's bytes."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._times: list[float] = []
        self._counts: list[tuple[int, int]] = []
        self._own: list[int] = []
        self._files: dict[str, str] = {}
        self._probe: Callable[[], dict[str, int]] | None = None
        self._bytes: list[dict[str, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="core-sampler")

    def watch(self, files: dict[str, str],
              probe: Callable[[], dict[str, int]] | None = None) -> None:
        """Sample these byte counters (name -> file holding an integer) from now on, and
        the gauges ``probe`` returns (requests in flight at the store, say)."""
        with self._lock:
            self._files = dict(files)
            self._probe = probe
            self._bytes = [{} for _ in self._times]
        self._sample()

    def unwatch(self) -> None:
        """Stop sampling the counters (their files are about to go), keeping what was seen."""
        with self._lock:
            self._files = {}
            self._probe = None

    def _sample(self) -> None:
        with self._lock:
            self._counts.append(_busy_total())
            self._own.append(_own_ticks(os.getpid()))
            counts = {}
            for name, path in self._files.items():
                with open(path) as f:
                    counts[name] = int(f.read())
            if self._probe is not None:
                try:
                    counts.update(self._probe())
                except (OSError, EOFError):
                    self._probe = None  # what it asked has gone: the run is ending
            self._bytes.append(counts)
            self._times.append(time.perf_counter())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _window(self, start: float, end: float) -> tuple[int, int]:
        """Indices of the samples that enclose [start, end] (call with the lock held)."""
        i = max(0, bisect.bisect_right(self._times, start) - 1)
        return i, min(len(self._times) - 1, bisect.bisect_left(self._times, end))

    def busy(self, start: float, end: float) -> float:
        """Busy fraction over the samples that enclose [start, end] (NaN if none)."""
        self._sample()  # the measurement has ended: the newest counts close it
        with self._lock:
            i, j = self._window(start, end)
            if j <= i:
                return float("nan")
            busy = self._counts[j][0] - self._counts[i][0]
            total = self._counts[j][1] - self._counts[i][1]
        return busy / total if total else float("nan")

    def own(self, start: float, end: float) -> float:
        """The fraction of all cores' time this process and its descendants used over
        [start, end]: the benchmark's own share of :meth:`busy`."""
        with self._lock:
            i, j = self._window(start, end)
            if j <= i:
                return float("nan")
            total = self._counts[j][1] - self._counts[i][1]
            return (self._own[j] - self._own[i]) / total if total else float("nan")

    def bulk_done(self, name: str, start: float, end: float, share: float = 0.99) -> float:
        """Seconds from ``start`` until counter ``name`` had counted ``share`` of what it
        counted by ``end`` (to within one sampling interval): how long a link worked for a
        measurement's bulk, leaving out small messages at its end (a manifest, a
        collective's reply). NaN if the counter was not watched over the whole window."""
        self._sample()
        with self._lock:
            i, j = self._window(start, end)
            samples = zip(self._times[i:j + 1], self._bytes[i:j + 1], strict=True)
            series = [(t, b.get(name)) for t, b in samples]
        if len(series) < 2 or any(v is None for _, v in series):
            return float("nan")
        first, final = series[0][1], series[-1][1]
        done = next(t for t, v in series if v - first >= share * (final - first))
        return max(0.0, min(done, end) - start)

    def counted(self, name: str, start: float, end: float) -> float:
        """What counter ``name`` counted over the samples that enclose [start, end]: the
        bytes a link carried during a measurement whose own process cannot count them (NaN
        if the counter was not watched at both ends of the window)."""
        self._sample()
        with self._lock:
            i, j = self._window(start, end)
            first, last = self._bytes[i].get(name), self._bytes[j].get(name)
        return float("nan") if first is None or last is None else float(last - first)

    def mean(self, name: str, start: float, end: float) -> float:
        """The mean of gauge ``name`` over the samples taken in [start, end] (NaN if none)."""
        with self._lock:
            i, j = self._window(start, end)
            values = [b[name] for b in self._bytes[i + 1:j] if name in b]
        return statistics.fmean(values) if values else float("nan")

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
