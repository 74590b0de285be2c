"""The manifest parser under hostile input: only ckptturbo errors, never a crash or a hang.

A manifest with a valid checksum can still be hostile (anyone who can write the bucket can
compute one), so the generated documents are re-sealed before parsing: what is tested is
the validation behind the checksum. ``CKPTTURBO_SOAK=1`` raises the example count to 10,000.
"""
from __future__ import annotations

import json
import os

import blake3
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptturbo as ct
from ckptturbo.manifest import Manifest
from ckptturbo.manifest_delta import tensor_versions

EXAMPLES = 10_000 if os.environ.get("CKPTTURBO_SOAK") else 400
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seal(doc: object) -> bytes:
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != "blake3"}
        canonical = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        doc["blake3"] = blake3.blake3(canonical).hexdigest()
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def valid_doc(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fuzz")
    url = str(root / "run" / "step-1")
    sd = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
          "b": torch.ones(3, dtype=torch.bfloat16), "step": 3}
    ct.save(sd, url, chunk_size=128, pack_threshold=64).wait(timeout=60)
    return json.loads((root / "run" / "step-1" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def delta_doc(tmp_path_factory) -> dict:
    """A version 4 manifest: one tensor a delta record over its base, one unchanged."""
    root = tmp_path_factory.mktemp("fuzz-delta")
    base = {"w": torch.zeros(16, 16, dtype=torch.bfloat16), "b": torch.ones(3)}
    ct.save(base, str(root / "run" / "step-1"), pack_threshold=64).wait(timeout=60)
    new = {"w": base["w"].clone(), "b": base["b"]}
    new["w"][3, 4] = 1
    ct.save(new, str(root / "run" / "step-2"), pack_threshold=64,
            delta_from=str(root / "run" / "step-1")).wait(timeout=60)
    doc = json.loads((root / "run" / "step-2" / "manifest.json").read_text())
    assert doc["version"] == 4 and doc["items"]["w"][0] == "delta"
    return doc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=70),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _replace(doc: object, path: tuple, value: object) -> object:
    if not path:
        return value
    copy = json.loads(json.dumps(doc))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def _parse(data: bytes) -> None:
    try:
        manifest = Manifest.from_bytes(data, "fuzzed/manifest.json")
        manifest.to_metadata()
        tensor_versions(manifest)  # builds every shard, delta records' too
    except ct.CkptTurboError:
        pass


@FUZZ
@given(data=st.data())
def test_structural_mutations_raise_only_ckptturbo_errors(valid_doc, data):
    paths = _paths(valid_doc)
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    _parse(seal(_replace(valid_doc, path, value)))


@FUZZ
@given(data=st.data())
def test_delta_record_mutations_raise_only_ckptturbo_errors(delta_doc, data):
    path = data.draw(st.sampled_from(_paths(delta_doc)))
    _parse(seal(_replace(delta_doc, path, data.draw(json_values))))


@FUZZ
@given(raw=st.binary(max_size=300))
def test_random_bytes_raise_only_ckptturbo_errors(raw):
    _parse(raw)


def test_deeply_nested_json_is_refused():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ct.FormatError):
        Manifest.from_bytes(deep, "deep/manifest.json")
    wrapped = b'{"format":"ckptturbo-manifest","version":2,"planner_data":' + deep + b"}"
    with pytest.raises(ct.FormatError):
        Manifest.from_bytes(wrapped, "deep/manifest.json")
