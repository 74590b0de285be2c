"""ckptturbo.testing (test servers, launchers, the fault proxy) stays off the library's
import path: importing ckptturbo or its command never loads it, and no library module
names it."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import ckptturbo

ROOT = pathlib.Path(ckptturbo.__file__).parent


def test_importing_the_library_does_not_load_the_testing_package():
    code = ("import sys, ckptturbo, ckptturbo.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('ckptturbo.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_no_library_module_imports_the_testing_package():
    pattern = re.compile(r"^\s*(from|import)\s+(ckptturbo\.testing|\.testing|\.\.testing)\b",
                         re.MULTILINE)
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if "testing" not in p.relative_to(ROOT).parts
                 and pattern.search(p.read_text())]
    assert offenders == []
