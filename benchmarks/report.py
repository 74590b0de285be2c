"""The report of a scenario: comparisons (ratio = ckptturbo / peer) against their targets,
correctness checks, raw numbers; printed as a table and written as JSON and PNG.

Every scenario compares ckptturbo with a peer *in the same run*, alternating which goes
first, best of N repetitions, and quotes ratios: on a shared 2-core machine absolute
numbers move by 2x from minute to minute, ratios much less.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from .states import MiB

log = logging.getLogger("benchmarks")


def brief(result: dict[str, Any]) -> str:
    """One sample's metrics on one line, for the log."""
    parts = []
    for k, v in result.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3f}")
        elif isinstance(v, int) and not isinstance(v, bool):
            parts.append(f"{k}={fmt_bytes(v) if 'bytes' in k else v}")
    return " ".join(parts)


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Comparison:
    name: str
    ours: float
    peer: float
    unit: str
    peer_name: str
    target: float | None
    op: str = "<="
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("inf")

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ckptturbo": self.ours, "peer": self.peer, "unit": self.unit,
                "peer_name": self.peer_name, "ratio": self.ratio, "target": self.target,
                "op": self.op, "met": self.met, "note": self.note}


class Report:
    """Collects raw numbers, comparisons (ratio = ckptturbo / peer) with their targets and
    correctness checks; prints a table and writes ``<out>/<scenario>.json`` and ``.png``."""

    def __init__(self, scenario: str, params: dict[str, Any]) -> None:
        self.scenario = scenario
        self.params = params
        self.raw: dict[str, Any] = {}
        self.comparisons: list[Comparison] = []
        self.checks: dict[str, bool] = {}
        self.check_details: dict[str, str] = {}
        self.notes: list[str] = []
        self.started = time.time()

    def compare(self, name: str, ours: float, peer: float, unit: str, *, peer_name: str = "DCP",
                target: float | None = None, op: str = "<=", note: str = "") -> Comparison:
        c = Comparison(name, float(ours), float(peer), unit, peer_name, target, op, note)
        self.comparisons.append(c)
        return c

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks[name] = bool(ok)
        if detail:
            self.check_details[name] = detail
        if not ok:
            log.error("CHECK FAILED: %s %s", name, detail)

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def checks_passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "params": self.params,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "wall_seconds": time.time() - self.started,
            "comparisons": [c.to_json() for c in self.comparisons],
            "checks": self.checks, "check_details": self.check_details,
            "checks_passed": self.checks_passed, "notes": self.notes, "raw": self.raw,
        }

    def table(self) -> str:
        lines = [f"== {self.scenario}  {json.dumps(self.params)}"]
        head = (f"{'measure':<46} {'ckptturbo':>12} {'peer':>12}  {'peer is':<22} {'ratio':>7}"
                "  target")
        lines += [head, "-" * len(head)]
        for c in self.comparisons:
            verdict = "ok" if c.met else "MISSED"
            target = "" if c.target is None else f"{c.op} {c.target:g}  {verdict}"
            lines.append(f"{c.name:<46} {_fmt(c.ours, c.unit):>12} {_fmt(c.peer, c.unit):>12}  "
                         f"{c.peer_name:<22} {c.ratio:>7.3f}  {target}")
        lines.append("checks: " + ", ".join(f"{k}={'ok' if v else 'FAILED'}"
                                            for k, v in self.checks.items()))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def finish(self, out_dir: str) -> dict[str, Any]:
        os.makedirs(out_dir, exist_ok=True)
        doc = self.to_json()
        with open(os.path.join(out_dir, f"{self.scenario}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
        try:
            self.plot(os.path.join(out_dir, f"{self.scenario}.png"))
        except Exception as exc:  # noqa: BLE001 - a plot must not lose the numbers
            log.warning("plot failed: %s", exc)
        print(self.table(), flush=True)
        return doc

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        comps = self.comparisons
        if not comps:
            return
        cols = min(4, len(comps))
        rows = (len(comps) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
        for ax, c in zip(axes.flat, comps, strict=False):  # the last row may have spare axes
            scale, unit = (MiB, "MiB") if c.unit == "bytes" else (1, c.unit)
            bars = ax.bar(["ckptturbo", c.peer_name], [c.ours / scale, c.peer / scale],
                          color=["#2a7ab0", "#bbbbbb"])
            for b, v in zip(bars, (c.ours, c.peer), strict=True):
                ax.annotate(_fmt(v, c.unit), (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
            ax.margins(y=0.15)
            verdict = "" if c.met is None else (" ok" if c.met else " MISSED")
            target = "" if c.target is None else f" (target {c.op} {c.target:g}{verdict})"
            ax.set_title(f"{c.name}\nratio {c.ratio:.2f}{target}", fontsize=8)
            ax.set_ylabel(unit, fontsize=7)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(comps):]:
            ax.axis("off")
        fig.suptitle(f"{self.scenario} ({json.dumps(self.params)})", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _fmt(v: float, unit: str) -> str:
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "x":
        return f"{v:.3f}"
    return f"{v:.3g} {unit}"


def machine() -> dict[str, Any]:
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = 0
    return {"cpus": os.cpu_count(), "memory_bytes": mem, "gpu": torch.cuda.is_available(),
            "ckptturbo_source_blake3": source_digest(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_at_end": os.getloadavg()}


def source_digest() -> str:
    """BLAKE3 of ckptturbo's sources, subpackages included: which code the numbers were
    measured with (the tree changes under a benchmark run more often than its git commit)."""
    import blake3

    import ckptturbo

    root = os.path.dirname(ckptturbo.__file__)
    h = blake3.blake3()
    for path in sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                       if f.endswith(".py")):
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]
