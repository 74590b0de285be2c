"""The ``ckptturbo`` command on real files and a real S3 server, called in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.catalog import list_checkpoints
from ckptturbo.cli import main, parse_size
from ckptturbo.runs import Location

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state(seed: int, big_seed: int = 0) -> dict:
    """'big' (1 MiB: a chunk of its own) depends on big_seed only, so saves can share it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(256, 1024, generator=torch.Generator().manual_seed(big_seed)),
        "small": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 100, (5,), generator=g),
        "extra": {"step": seed, "name": f"s{seed}"},
    }


def save(sd: dict, url: str, **kw) -> None:
    ct.save(sd, url, **kw).wait(timeout=60)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def chunk_file(url: str, fqn: str) -> str:
    loc = Location(url)
    return loc.chunk_path(loc.read_manifest().items[fqn].shards[0].pieces[0].chunk)


def chunk_files(run: str) -> set[str]:
    root = os.path.join(run, ".ckptturbo", "chunks")
    return {f for _, _, files in os.walk(root) for f in files}


@pytest.fixture
def run(tmp_path) -> str:
    """Two checkpoints that share the 'big' chunk, plus a save that never committed."""
    run = str(tmp_path / "run")
    save(state(1), f"{run}/step-1")
    save(state(2), f"{run}/step-2")
    os.makedirs(f"{run}/step-3")
    with open(f"{run}/step-3/partial", "wb") as f:
        f.write(b"x")
    return run


def test_ls_lists_committed_checkpoints_only(run, capsys):
    rc, out, _ = cli(capsys, "ls", run)
    assert rc == 0
    assert "step-1" in out and "step-2" in out and "step-3" not in out
    rc, out, _ = cli(capsys, "ls", run, "--json")
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["step-1", "step-2"]
    assert rows[0]["items"] == 5 and rows[0]["total_bytes"] >= 1 << 20


def test_inspect_shows_shapes_dtypes_and_reuse(run, capsys):
    rc, out, _ = cli(capsys, "inspect", f"{run}/step-2")
    assert rc == 0
    assert "256x1024" in out and "bfloat16" in out and "extra.step" in out
    assert "reused from earlier saves" in out
    _, out, _ = cli(capsys, "inspect", f"{run}/step-2", "--json")
    info = json.loads(out)
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["big"]["shape"] == [256, 1024] and tensors["big"]["dtype"] == "float32"
    assert tensors["small"]["dtype"] == "bfloat16" and tensors["big"]["chunks"] == 1
    assert {o["name"] for o in info["objects"]} == {"extra.step", "extra.name"}
    assert info["bytes_reused"] >= 1 << 20          # 'big' came from step-1
    assert 0 < info["bytes_written"] < 1 << 20
    first = json.loads(cli(capsys, "inspect", f"{run}/step-1", "--json")[1])
    assert first["bytes_reused"] == 0
    dedup = info["total_bytes"] / info["unique_bytes"]
    assert info["dedup_ratio"] == pytest.approx(dedup, rel=1e-3)


def test_verify_passes_then_reports_corrupt_chunk(run, capsys):
    ckpt = f"{run}/step-1"
    rc, out, _ = cli(capsys, "verify", ckpt)
    assert rc == 0 and out.startswith("OK")
    path = chunk_file(ckpt, "big")
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out, _ = cli(capsys, "verify", ckpt)
    assert rc == 1
    assert "corrupt" in out and "used by: big" in out and "FAILED" in out


def test_verify_reports_missing_chunk(run, capsys):
    ckpt = f"{run}/step-1"
    os.unlink(chunk_file(ckpt, "small"))       # the pack of small items
    rc, out, _ = cli(capsys, "verify", ckpt)
    assert rc == 1
    assert "missing" in out and "small" in out and "extra.step" in out


def test_verify_follows_a_custom_chunk_store(tmp_path, capsys):
    store = str(tmp_path / "shared-store")
    ckpt = str(tmp_path / "run" / "step-1")
    save(state(1), ckpt, store=store)
    assert cli(capsys, "verify", ckpt)[0] == 0
    manifest = Location(ckpt).read_manifest()
    loc = Location.for_manifest(ckpt, None, manifest)
    assert loc.chunk_path(next(iter(manifest.chunks))).startswith(store)
    os.unlink(loc.chunk_path(manifest.items["big"].shards[0].pieces[0].chunk))
    rc, out, _ = cli(capsys, "verify", ckpt)
    assert rc == 1 and "missing" in out and "big" in out


def test_rm_then_gc_frees_only_unreferenced_chunks(run, capsys):
    before = chunk_files(run)
    rc, out, _ = cli(capsys, "rm", f"{run}/step-1")
    assert rc == 0 and "gc" in out
    assert [c.name for c in list_checkpoints(run)] == ["step-2"]

    rc, out, _ = cli(capsys, "gc", run, "--dry-run")
    assert rc == 0 and "would delete 1 " in out
    assert chunk_files(run) == before

    rc, out, _ = cli(capsys, "gc", run)
    assert rc == 0 and "deleted 1 " in out
    remaining = Location(f"{run}/step-2").read_manifest()
    assert chunk_files(run) == set(remaining.chunks)

    want = state(2)
    got = {"big": torch.zeros(256, 1024), "small": torch.zeros(3, 4, dtype=torch.bfloat16),
           "ids": torch.zeros(5, dtype=torch.int64), "extra": {"step": 0, "name": ""}}
    ct.load(got, f"{run}/step-2")
    for key in ("big", "small", "ids"):
        assert torch.equal(got[key], want[key]), key
    assert got["extra"] == want["extra"]
    assert cli(capsys, "verify", f"{run}/step-2")[0] == 0


def test_rm_of_a_self_contained_checkpoint_says_its_chunks_went_with_it(tmp_path, capsys):
    run = str(tmp_path / "run")
    save(state(1), f"{run}/step-1", store=".")
    rc, out, _ = cli(capsys, "rm", f"{run}/step-1")
    assert rc == 0 and "and its chunks" in out and "gc" not in out
    assert not os.path.exists(f"{run}/step-1")


def test_gc_refuses_while_a_save_is_pending(run, capsys):
    assert cli(capsys, "rm", f"{run}/step-1")[0] == 0
    marker = os.path.join(run, ".ckptturbo", "pending", "some-save")
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w") as f:
        json.dump({"time": time.time()}, f)
    before = chunk_files(run)
    rc, _, err = cli(capsys, "gc", run)
    assert rc == 2
    assert err.startswith("ckptturbo: error:") and "in progress" in err
    assert chunk_files(run) == before


def test_export_safetensors_round_trip(run, tmp_path, capsys, caplog):
    from safetensors import safe_open
    from safetensors.torch import load_file

    want = state(1)
    dest = str(tmp_path / "st")
    rc, out, _ = cli(capsys, "export", f"{run}/step-1", dest, "--format", "safetensors")
    assert rc == 0 and "model.safetensors" in out
    assert "skipping object 'extra.step'" in caplog.text
    got = load_file(os.path.join(dest, "model.safetensors"))
    assert set(got) == {"big", "small", "ids"}
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    with safe_open(os.path.join(dest, "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"

    sharded = str(tmp_path / "sharded")
    rc, _, _ = cli(capsys, "export", f"{run}/step-1", sharded, "--format", "safetensors",
                   "--max-shard-size", "1MiB")
    assert rc == 0
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"
    merged = {}
    for file in files:
        merged.update(load_file(os.path.join(sharded, file)))
    assert all(torch.equal(merged[k], want[k]) for k in ("big", "small", "ids"))


def test_export_format_from_the_destination_name(run, tmp_path, capsys):
    """``export ckpt out.safetensors`` writes that file, no --format needed; a name that says
    no format needs --format, and --format overrides the name."""
    from safetensors.torch import load_file

    want = state(1)
    rc, out, _ = cli(capsys, "export", f"{run}/step-1", str(tmp_path / "out.safetensors"))
    assert rc == 0 and "out.safetensors" in out
    got = load_file(tmp_path / "out.safetensors")
    assert set(got) == {"big", "small", "ids"}
    assert all(torch.equal(got[k], want[k]) for k in got)

    rc, _, _ = cli(capsys, "export", f"{run}/step-1", str(tmp_path / "w.safetensors"),
                   "--max-shard-size", "1MiB")
    assert rc == 0
    with open(tmp_path / "w.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert files == ["w-00001-of-00002.safetensors", "w-00002-of-00002.safetensors"]

    rc, _, err = cli(capsys, "export", f"{run}/step-1", str(tmp_path / "out"))
    assert rc == 2 and "--format" in err and "out" in err
    assert not (tmp_path / "out").exists()

    dcp_dir = tmp_path / "as-dcp.safetensors"
    assert cli(capsys, "export", f"{run}/step-1", str(dcp_dir), "--format", "dcp")[0] == 0
    assert (dcp_dir / ".metadata").is_file()


def test_export_dcp_round_trip(run, tmp_path, capsys, caplog):
    from torch.distributed.checkpoint import FileSystemReader

    want = state(2)

    def fresh() -> dict:
        return {"big": torch.zeros(256, 1024), "small": torch.zeros(3, 4, dtype=torch.bfloat16),
                "ids": torch.zeros(5, dtype=torch.int64)}

    plain = str(tmp_path / "plain")
    assert cli(capsys, "export", f"{run}/step-2", plain, "--format", "dcp")[0] == 0
    assert "--allow-pickle" not in caplog.text  # a dict of an int and a str is safe to load
    got = {**fresh(), "extra": {"step": 0, "name": ""}}
    dcp.load(got, storage_reader=FileSystemReader(plain))
    assert got["extra"] == want["extra"]
    assert all(torch.equal(got[k], want[k]) for k in ("big", "small", "ids"))

    full = str(tmp_path / "full")
    assert cli(capsys, "export", f"{run}/step-2", full, "--format", "dcp", "--allow-pickle")[0] == 0
    got = {**fresh(), "extra": {"step": 0, "name": ""}}
    dcp.load(got, storage_reader=FileSystemReader(full))
    assert got["extra"] == want["extra"]
    assert all(torch.equal(got[k], want[k]) for k in ("big", "small", "ids"))


def test_s3_ls_and_verify(s3_server, capsys):
    so = s3_server.storage_options
    run = s3_server.url()
    save(state(1), f"{run}/step-1", storage_options=so)
    opts = json.dumps(so)
    rc, out, _ = cli(capsys, "ls", run, "--storage-options", opts)
    assert rc == 0 and "step-1" in out
    rc, out, _ = cli(capsys, "--storage-options", opts, "verify", f"{run}/step-1")
    assert rc == 0 and out.startswith("OK")
    loc = Location(f"{run}/step-1", so)
    cid = loc.read_manifest().items["big"].shards[0].pieces[0].chunk
    loc.chunk_store.delete([loc.chunk_path(cid)])
    rc, out, _ = cli(capsys, "verify", f"{run}/step-1", "--storage-options", opts)
    assert rc == 1 and "missing" in out and "big" in out


@pytest.mark.parametrize("argv", [["inspect", "{tmp}/nowhere/step-1"], ["ls", "nosuchproto://bucket/run"]])
def test_bad_url_is_one_line_error(tmp_path, capsys, argv):
    rc, out, err = cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert rc == 2 and out == ""
    assert err.startswith("ckptturbo: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_entry_point_runs_as_a_module(run):
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "ckptturbo.cli", "ls", run], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "step-2" in done.stdout and "step-3" not in done.stdout


def test_bench_calibrate_saves_best_settings(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(256, 256)}, str(tmp_path / "model.safetensors"))
    profiles = tmp_path / "profiles.json"
    monkeypatch.setenv("CKPTTURBO_PROFILES", str(profiles))
    rc, out, _ = cli(capsys, "bench", "--calibrate", str(tmp_path), "--streams", "1,2",
                     "--chunk-sizes", "64KiB", "--sample-size", "256KiB", "--save")
    assert rc == 0 and "best for file" in out
    assert "streams" in json.loads(profiles.read_text())["file"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("42") == 42


def test_closed_pipe_exits_quietly(tmp_path):
    """``ckptturbo inspect ... | head``: output far larger than the pipe's buffer, read by a
    real ``head`` that exits after one line; the CLI must exit 0 without a traceback."""
    url = str(tmp_path / "run" / "many")
    save({f"layer{i:04d}.weight_with_a_long_name": torch.zeros(2) for i in range(3000)}, url)
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = subprocess.Popen([sys.executable, "-m", "ckptturbo.cli", "inspect", url], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-n", "1"], stdin=cmd.stdout, stdout=subprocess.PIPE)
    cmd.stdout.close()  # only head reads the pipe now: its exit closes it
    first, _ = head.communicate(timeout=120)
    err = cmd.stderr.read().decode()
    cmd.stderr.close()
    assert cmd.wait(timeout=120) == 0, err
    assert first.startswith(b"checkpoint ")
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
