"""Every chunk of a checkpoint damaged in turn, through every load path: 100% detection.

For each chunk (single tensors, pieces of a large tensor, packs of small ones) the file on
disk is flipped at one byte, truncated, or deleted; then ``ct.load``, ``dcp.load`` with a
TurboReader, ``ct.load_state_dict``, ``ckptturbo verify`` and a 2-rank grouped load (read
once, forwarded) must each fail: the loads with IntegrityError naming the chunk and every
tensor it holds bytes of, verify with exit code 1 naming the chunk. The counts are
asserted, and reported in docs/reliability.md.
"""
from __future__ import annotations

import random
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo import cli
from ckptturbo.integrity import chunk_users
from ckptturbo.runs import Location
from ckptturbo.testing.launcher import run_distributed

DAMAGES = ("flip", "truncate", "delete")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    state = {"big": torch.randn(24 << 10, generator=g),           # 96 KiB: several chunks
             "mid": torch.randn(5000, generator=g).to(torch.bfloat16)}
    state.update({f"small{i}": torch.randn(200 + i, generator=g) for i in range(6)})  # packed
    return state


def _save(root: Path) -> tuple[str, dict[str, torch.Tensor]]:
    url = str(root / "run" / "step-1")
    state = _state()
    ct.save(state, url, chunk_size=8 << 10, pack_threshold=4 << 10).wait(timeout=60)
    return url, state


def _find(url: str, cid: str) -> Path:
    (path,) = Path(url).parent.joinpath(".ckptturbo").rglob(cid)
    return path


def _damage(path: Path, kind: str, rng: random.Random) -> bytes:
    original = path.read_bytes()
    if kind == "flip":
        data = bytearray(original)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(original[:rng.randrange(len(original))])
    else:
        path.unlink()
    return original


def _integrity_error(exc: BaseException) -> BaseException:
    """dcp.load wraps each rank's failure in a CheckpointException; ct's calls do not."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ct.IntegrityError):
            return inner
    return exc


def _expect_integrity_error(load: Callable[[], object], cid: str, users: list[str]) -> bool:
    try:
        load()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = _integrity_error(exc)
        assert isinstance(error, ct.IntegrityError), repr(exc)
        text = str(error)
        assert cid in text and all(repr(u) in text for u in users), text
        return True
    return False


def test_every_damaged_chunk_fails_every_single_process_path(tmp_path, capsys):
    url, state = _save(tmp_path)
    manifest = Location(url).read_manifest()
    users = chunk_users(manifest)
    assert len(manifest.chunks) >= 12 and any(len(u) > 1 for u in users.values())
    rng = random.Random(5)

    def ct_load() -> None:
        ct.load({k: torch.empty_like(v) for k, v in state.items()}, url)

    def dcp_load() -> None:
        with warnings.catch_warnings():  # DCP's single-process notice
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({k: torch.empty_like(v) for k, v in state.items()},
                     storage_reader=ct.TurboReader(url), no_dist=True)

    def load_state_dict() -> None:
        ct.load_state_dict(url)

    paths = {"ct.load": ct_load, "dcp.load": dcp_load, "ct.load_state_dict": load_state_dict}
    detected: Counter[str] = Counter()
    trials = 0
    for cid in sorted(manifest.chunks):
        path = _find(url, cid)
        for kind in DAMAGES:
            original = _damage(path, kind, rng)
            trials += 1
            for name, load in paths.items():
                detected[name] += _expect_integrity_error(load, cid, users[cid])
            capsys.readouterr()
            code = cli.main(["verify", url])
            out = capsys.readouterr().out
            detected["verify"] += code == 1 and cid in out
            path.write_bytes(original)
    assert trials == 3 * len(manifest.chunks)
    assert detected == {name: trials for name in [*paths, "verify"]}, (detected, trials)
    # undamaged again: every path loads
    assert cli.main(["verify", url]) == 0
    loaded = ct.load_state_dict(url)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def _grouped_sweep(rank: int, world: int, url: str, cids: list[str]) -> list[str]:
    """Rank 0 damages one chunk at a time; every rank loads it grouped (read once and
    forwarded); the outcome per chunk is returned."""
    state = _state()
    rng = random.Random(9)
    outcomes = []
    for i, cid in enumerate(cids):
        if rank == 0:
            path = _find(url, cid)
            original = _damage(path, DAMAGES[i % len(DAMAGES)], rng)
        dist.barrier()
        try:
            out = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(out, storage_reader=ct.TurboReader(url, broadcast=True, timeout=60))
            outcomes.append("loaded")
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
            found = _integrity_error(exc)
            outcomes.append(f"{type(found).__name__}: {found}")
        dist.barrier()
        if rank == 0:
            path.write_bytes(original)
        dist.barrier()
    return outcomes


def test_every_damaged_chunk_fails_a_grouped_load_on_every_rank(tmp_path):
    url, _ = _save(tmp_path)
    manifest = Location(url).read_manifest()
    users = chunk_users(manifest)
    cids = sorted(manifest.chunks)
    per_rank = run_distributed(_grouped_sweep, 2, url, cids, timeout=300)
    detected = 0
    for rank, outcomes in enumerate(per_rank):
        for cid, outcome in zip(cids, outcomes, strict=True):
            assert outcome.startswith("IntegrityError") and cid in outcome, (rank, cid, outcome)
            assert all(repr(u) in outcome for u in users[cid]), (rank, cid, outcome)
            detected += 1
    assert detected == 2 * len(cids)
