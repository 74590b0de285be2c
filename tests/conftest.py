"""Shared fixtures: a real SeaweedFS S3 server on loopback, started once per session."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptturbo.testing import embedded_s3  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = embedded_s3.start(str(tmp_path_factory.mktemp("seaweedfs")))
    yield server
    server.stop()


def pytest_sessionfinish(session, exitstatus):
    """With CKPTTURBO_NO_SKIPS=1 (CI), a skipped test fails the run: every optional extra
    (Ray, vLLM, the frameworks) must be installed there, or its tests would silently not run."""
    if os.environ.get("CKPTTURBO_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"CKPTTURBO_NO_SKIPS=1: {len(skipped)} skipped, failing the run "
                            "(pytest -rs names them)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
