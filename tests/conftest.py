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
