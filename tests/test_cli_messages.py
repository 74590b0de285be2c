"""What a person sees when a command goes wrong, and how fast a command starts.

Every command runs as a real process (the way a script calls it) or in-process through
``main``; a script must tell a typo from an empty run by the exit code alone.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ckptturbo as ct
from ckptturbo.cli import main
from ckptturbo.manifest_records import DTYPE_ITEMSIZES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptturbo.cli", *argv],
                          env={**os.environ, "PYTHONPATH": REPO, **env},
                          capture_output=True, text=True, timeout=120)


def imported(done: subprocess.CompletedProcess) -> set[str]:
    """Module names ``-X importtime`` reported (its lines end in ``| <indent>name``)."""
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def run(tmp_path) -> str:
    run = str(tmp_path / "run")
    ct.save({"w": torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), "step": 3},
            f"{run}/step-1").wait(timeout=60)
    return run


@pytest.mark.parametrize("argv", [["--version"], ["ls", "{run}"], ["inspect", "{run}/step-1"]])
def test_commands_that_need_no_tensors_do_not_import_torch(run, argv):
    """torch costs seconds and hundreds of MB to import; --version, ls and inspect read
    JSON only (inspect still shows dtypes, by name)."""
    done = run_cli(*[a.format(run=run) for a in argv])
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported(done)
    assert "ckptturbo" in modules and ("ckptturbo.manifest" in modules or argv == ["--version"])
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    if argv[0] == "inspect":
        assert "bfloat16" in done.stdout and "2x3" in done.stdout


def test_the_command_imports_no_torch_and_a_program_gets_every_public_name_at_once():
    env = {**os.environ, "PYTHONPATH": REPO}
    command = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptturbo.cli",
                              "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert command.returncode == 0 and "ckptturbo" in command.stdout, command.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in command.stderr.splitlines()]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    # a program (isort puts ckptturbo before torch) gets DCP with the package, not in its first save
    done = subprocess.run(
        [sys.executable, "-c", "import sys, ckptturbo as ct; "
         "assert 'torch.distributed.checkpoint' in sys.modules; "
         "names = [getattr(ct, n) for n in ct.__all__]; from ckptturbo import TurboWriter, save; "
         "assert set(ct.__all__) <= set(dir(ct)); print(len(names))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(ct.__all__) >= 22
    with pytest.raises(AttributeError, match="no_such_name"):
        ct.no_such_name  # noqa: B018


# dtypes of torch releases newer than the oldest the project supports (torch>=2.9): the
# table names them so that ckptturbo validates them without torch; older torches lack them
NEWER_DTYPES = {"bcomplex32"}


def test_dtype_table_matches_torch():
    """The manifest's dtypes are validated from this table without torch: it must name every
    dtype the installed torch has, with torch's item size, and nothing else but the dtypes of
    newer torch releases."""
    torch_dtypes = {str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values()
                    if isinstance(d, torch.dtype)}
    wrong = {name: (DTYPE_ITEMSIZES.get(name), size) for name, size in torch_dtypes.items()
             if DTYPE_ITEMSIZES.get(name) != size}
    assert not wrong, f"(table, torch) item sizes: {wrong}"
    assert set(DTYPE_ITEMSIZES) - set(torch_dtypes) <= NEWER_DTYPES


def test_library_logs_nothing_unless_the_application_configures_logging(tmp_path):
    """A missing chunk logs warnings; with no logging configured they must not reach stderr
    (Python's last-resort handler), only the exception does."""
    code = f"""
import os, torch, ckptturbo as ct
url = {str(tmp_path / 'run' / 'step-1')!r}
ct.save({{"w": torch.ones(4)}}, url).wait(timeout=60)
chunks = os.path.join(os.path.dirname(url), ".ckptturbo", "chunks")
for d, _, files in os.walk(chunks):
    for f in files:
        os.remove(os.path.join(d, f))
try:
    ct.load({{"w": torch.zeros(4)}}, url)
except ct.IntegrityError:
    print("raised")
"""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "raised", done.stderr
    assert done.stderr == ""


# --- exit codes and messages ---------------------------------------------------------

def one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2, (rc, out, err)
    assert err.startswith("ckptturbo: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(n in err for n in needles), err


def test_ls_of_a_missing_path_fails(tmp_path, capsys):
    """Before: "no committed checkpoints" and exit 0, like an empty run."""
    one_line_error(*cli(capsys, "ls", str(tmp_path / "nosuch" / "run")), "does not exist")
    os.chdir(tmp_path)  # a bucket/prefix typed without its s3://
    one_line_error(*cli(capsys, "ls", "my-bucket/run"), "does not exist", "s3://my-bucket/run")
    # with --tiers too, when neither tier holds anything
    one_line_error(*cli(capsys, "ls", str(tmp_path / "nosuch" / "run"), "--tiers",
                        "--memory", str(tmp_path / "mem")), "does not exist")


def test_ls_of_an_empty_run_is_not_an_error(tmp_path, capsys):
    (tmp_path / "fresh-run").mkdir()
    rc, out, err = cli(capsys, "ls", str(tmp_path / "fresh-run"))
    assert rc == 0 and out == "" and "no committed checkpoints" in err


def test_ls_of_a_checkpoint_lists_it_and_says_so(run, capsys):
    rc, out, err = cli(capsys, "ls", f"{run}/step-1")
    assert rc == 0 and "step-1" in out and "ITEMS" in out
    assert "is a checkpoint, not a run" in err and f"ckptturbo ls {run}" in err
    rc, out, _ = cli(capsys, "ls", f"{run}/step-1", "--json")
    assert rc == 0 and [c["name"] for c in json.loads(out)] == ["step-1"]


def test_inspect_says_what_is_there_instead_of_a_checkpoint(run, tmp_path, capsys):
    one_line_error(*cli(capsys, "inspect", run), "is a run, not a checkpoint",
                   f"ckptturbo ls {run}")
    plain = tmp_path / "plain-dcp" / "step-1"
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # DCP's "assuming a single process" must not reach stderr
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(plain)))
    one_line_error(*cli(capsys, "inspect", str(plain)), "plain DCP checkpoint")
    one_line_error(*cli(capsys, "ls", str(plain)), "plain DCP checkpoint")
    one_line_error(*cli(capsys, "inspect", str(tmp_path / "nosuch" / "step-1")), "does not exist")
    one_line_error(*cli(capsys, "verify", run), "is a run, not a checkpoint")


def test_inspect_of_a_missing_bucket_names_the_bucket(s3_server, capsys):
    """Before: "manifest.json is missing", while ls said the bucket does not exist."""
    opts = json.dumps(s3_server.storage_options)
    one_line_error(*cli(capsys, "inspect", "s3://no-such-bucket-ckptturbo/run/step-1",
                        "--storage-options", opts),
                   "bucket s3://no-such-bucket-ckptturbo does not exist")
    one_line_error(*cli(capsys, "ls", s3_server.url("never-written"), "--storage-options", opts),
                   "does not exist")


@pytest.mark.parametrize("dest", ["a-file", "/proc/ckptturbo-export"])
def test_export_dcp_to_a_bad_destination_is_one_line_exit_2(run, tmp_path, capsys, dest):
    """Before: a traceback and exit 1, which cli.md reserves for verify's corruption."""
    (tmp_path / "a-file").write_text("x")
    target = str(tmp_path / dest) if dest == "a-file" else dest
    one_line_error(*cli(capsys, "export", f"{run}/step-1", target, "--format", "dcp"),
                   "cannot export to", target)


def test_export_dcp_keeps_safe_objects_and_skips_unsafe_ones_with_one_warning(tmp_path, capsys,
                                                                              caplog):
    """An AdamW's step, lr, betas and eps load with the restricted unpickler, so they are
    exported without --allow-pickle (before: skipped, one warning each); an object of an
    arbitrary class still needs --allow-pickle."""
    import datetime

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    url = str(tmp_path / "run" / "step-1")
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ct.save(state, url).wait(timeout=60)
    dest = str(tmp_path / "plain")
    assert cli(capsys, "export", url, dest, "--format", "dcp")[0] == 0
    assert "--allow-pickle" not in caplog.text
    got = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
           "optim": {"state": {0: {"step": torch.zeros(()), "exp_avg": torch.zeros(3, 4),
                                   "exp_avg_sq": torch.zeros(3, 4)},
                               1: {"step": torch.zeros(()), "exp_avg": torch.zeros(3),
                                   "exp_avg_sq": torch.zeros(3)}},
                     "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "eps": 0.0,
                                       "weight_decay": 0.0, "amsgrad": False, "maximize": False,
                                       "foreach": None, "capturable": False,
                                       "differentiable": False,
                                       "fused": None, "decoupled_weight_decay": True,
                                       "params": [0, 1]}]}}
    dcp.load(got, storage_reader=FileSystemReader(dest))
    group = got["optim"]["param_groups"][0]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999) and group["eps"] == 1e-8
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    ct.save({"w": torch.ones(2), "when": datetime.datetime(2026, 1, 1), "step": 7},
            str(tmp_path / "run" / "step-2")).wait(timeout=60)
    caplog.clear()
    dest2 = str(tmp_path / "plain2")
    assert cli(capsys, "export", str(tmp_path / "run" / "step-2"), dest2, "--format", "dcp")[0] == 0
    skipped = [r for r in caplog.records if "--allow-pickle" in r.getMessage()]
    assert len(skipped) == 1 and "when" in skipped[0].getMessage()
    got2 = {"w": torch.zeros(2), "step": 0}
    dcp.load(got2, storage_reader=FileSystemReader(dest2))
    assert got2["step"] == 7 and torch.equal(got2["w"], torch.ones(2))


def test_bench_calibrate_on_a_directory_or_a_tiny_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CKPTTURBO_PROFILES", str(tmp_path / "profiles.json"))
    (tmp_path / "empty").mkdir()
    one_line_error(*cli(capsys, "bench", "--calibrate", str(tmp_path / "empty")),
                   "directory without *.safetensors")
    (tmp_path / "tiny.txt").write_text("hello\n")
    one_line_error(*cli(capsys, "bench", "--calibrate", str(tmp_path / "tiny.txt"), "--save"),
                   "too small", "nothing was saved")
    assert not (tmp_path / "profiles.json").exists()


# --- noise ---------------------------------------------------------------------------------

def _chunk_file(url: str) -> str:
    from ckptturbo.runs import Location

    loc = Location(url)
    manifest = loc.read_manifest()
    cid = max(manifest.chunks, key=lambda c: sum(cid == c for i in manifest.items.values()
                                                 for s in i.shards for p in s.pieces
                                                 for cid in [p.chunk]))
    return loc.chunk_path(cid)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_local_chunk_is_reported_once_naming_a_capped_list(tmp_path, caplog, damage):
    """Re-reading a local file cannot undo damage at rest (before: two "reading it again"
    warnings first), and a pack of 54 tensors is named as the first few and a count
    (before: an 872-character list)."""
    caplog.set_level(logging.DEBUG, logger="ckptturbo")
    url = str(tmp_path / "run" / "step-1")
    sd = {f"layer.{i}.bias": torch.full((4,), float(i)) for i in range(54)}
    ct.save(sd, url).wait(timeout=60)
    path = _chunk_file(url)
    if damage == "missing":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(10)
    with pytest.raises(ct.IntegrityError) as info:
        ct.load({k: torch.zeros(4) for k in sd}, url)
    text = str(info.value)
    assert "and 46 more" in text and text.count("layer.") == 8, text
    assert not [r for r in caplog.records if "reading it again" in r.getMessage()]
