"""What a person sees when a command goes wrong, and how fast a command starts.

Every command runs as a real process (the way a script calls it) or in-process through
``main``; a script must tell a typo from an empty run by the exit code alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptturbo as ct
from ckptturbo.cli import main
from ckptturbo.layout import DTYPE_ITEMSIZES

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
    assert "ckptturbo" in modules and ("ckptturbo.layout" in modules or argv == ["--version"])
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    if argv[0] == "inspect":
        assert "bfloat16" in done.stdout and "2x3" in done.stdout


def test_import_is_lazy_and_keeps_every_public_name():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, ckptturbo as ct; assert 'torch' not in sys.modules; "
         "names = [getattr(ct, n) for n in ct.__all__]; from ckptturbo import TurboWriter, save; "
         "assert set(ct.__all__) <= set(dir(ct)); print(len(names))"],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(ct.__all__) >= 22
    with pytest.raises(AttributeError, match="no_such_name"):
        ct.no_such_name  # noqa: B018


def test_dtype_table_matches_torch():
    """The manifest's dtypes are validated from this table without torch: it must name every
    dtype torch has, with torch's item size."""
    torch_dtypes = {str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values()
                    if isinstance(d, torch.dtype)}
    assert DTYPE_ITEMSIZES == torch_dtypes


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
