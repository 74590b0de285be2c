"""Manifest versions: the compact version 3 form, and the checkpoints of earlier versions.

``tests/data/manifest-v2`` is a checkpoint saved by ckptturbo before version 3 (chunks
and a version 2 manifest, as that release wrote them): it must load unchanged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import blake3
import pytest
import torch

import ckptturbo as ct
from ckptturbo.manifest import Manifest
from ckptturbo.manifest_codec import FORMAT_VERSION
from ckptturbo.runs import Location

V2_RUN = Path(__file__).parent / "data" / "manifest-v2" / "run"


def expected_v2_state() -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100),
            "b": torch.ones(3, dtype=torch.bfloat16), "step": 7,
            "opt": {"lr": 0.5, "moments": [torch.full((40,), 2.0), torch.zeros(())]}}


def empty_v2_state() -> dict:
    return {"w": torch.zeros(10, 100), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 0,
            "opt": {"lr": 0.0, "moments": [torch.zeros(40), torch.ones(())]}}


def assert_same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def seal(doc: dict) -> bytes:
    doc = {k: v for k, v in doc.items() if k != "blake3"}
    canonical = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    doc["blake3"] = blake3.blake3(canonical).hexdigest()
    return json.dumps(doc).encode()


@pytest.fixture()
def v2_run(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(V2_RUN, run)
    return run


def test_a_version_2_checkpoint_loads(v2_run):
    doc = json.loads((v2_run / "step-1" / "manifest.json").read_text())
    assert doc["version"] == 2  # the fixture is what the previous release wrote
    out = empty_v2_state()
    ct.load(out, str(v2_run / "step-1"))
    assert_same(out, expected_v2_state())
    manifest = Location(str(v2_run / "step-1")).read_manifest()
    assert manifest.planner_data["opt.moments.0"] == ("opt", "moments", 0)
    for fqn, raw in doc["items"].items():
        shards = manifest.items[fqn].shards
        assert [[[p.start, p.length, p.chunk, p.offset] for p in s.pieces] for s in shards] == \
            [s["pieces"] for s in raw["shards"]]


def test_a_version_1_manifest_loads_with_a_warning(v2_run, caplog):
    path = v2_run / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("blake3")
    doc["version"] = 1
    path.write_text(json.dumps(doc))
    out = empty_v2_state()
    ct.load(out, str(v2_run / "step-1"))
    assert_same(out, expected_v2_state())
    assert "version 1 manifest" in caplog.text


def test_a_version_2_manifest_is_still_validated(v2_run):
    path = v2_run / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["items"]["w"]["shards"][0]["pieces"][1][0] += 4  # a gap between two pieces
    path.write_bytes(seal(doc))
    with pytest.raises(ct.FormatError, match="do not tile"):
        Location(str(v2_run / "step-1")).read_manifest()


def test_resaving_a_version_2_checkpoint_writes_the_current_version(v2_run):
    out = empty_v2_state()
    ct.load(out, str(v2_run / "step-1"))
    ct.save(out, str(v2_run / "step-2"), chunk_size=1024, pack_threshold=256).wait(timeout=60)
    doc = json.loads((v2_run / "step-2" / "manifest.json").read_text())
    assert doc["version"] == FORMAT_VERSION == 3 and doc["planner_paths"] is True
    again = empty_v2_state()
    ct.load(again, str(v2_run / "step-2"))
    assert_same(again, expected_v2_state())
    old = Location(str(v2_run / "step-1")).read_manifest()
    new = Location(str(v2_run / "step-2")).read_manifest()
    assert new.chunks.keys() == old.chunks.keys()  # the same bytes, found already stored
    assert new.planner_data == old.planner_data


def test_version_3_round_trip_is_exact(v2_run):
    manifest = Location(str(v2_run / "step-1")).read_manifest()
    data = manifest.to_bytes()
    back = Manifest.from_bytes(data, "round trip")
    assert back.to_bytes() == data
    assert back.chunks == manifest.chunks and back.planner_data == manifest.planner_data
    for fqn, item in manifest.items.items():
        assert back.items[fqn].shards == item.shards
    md, md_back = manifest.to_metadata(), back.to_metadata()
    assert md_back.state_dict_metadata == md.state_dict_metadata
    assert dict(md_back.storage_data) == dict(md.storage_data)


def test_planner_data_other_than_dcps_paths_is_kept_as_it_was(v2_run):
    manifest = Location(str(v2_run / "step-1")).read_manifest()
    for planner_data in ({"w": ("x", "y")}, {**manifest.planner_data, "extra": ("extra",)},
                         {"anything": [1, 2]}, None):
        manifest.planner_data = planner_data
        doc = json.loads(manifest.to_bytes())
        assert doc["planner_paths"] is False
        expected = {"anything": (1, 2)} if planner_data == {"anything": [1, 2]} else planner_data
        assert Manifest.from_bytes(manifest.to_bytes(), "x").planner_data == expected


def _v3_doc(v2_run: Path) -> dict:
    return json.loads(Location(str(v2_run / "step-1")).read_manifest().to_bytes())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["items"]["w"][5].__setitem__(2, 10 ** 6), "outside chunk"),  # chunk ordinal
    (lambda d: d["items"]["w"][5].__setitem__(3, 10 ** 6), "outside chunk"),  # offset in chunk
    (lambda d: d["items"]["w"][5].__setitem__(1, 4), "pieces cover"),  # a piece too short
    (lambda d: d["items"]["w"][5].__setitem__(1, True), "non-negative integers"),
    (lambda d: d["items"]["w"][5].__setitem__(3, -1), "negative"),
    (lambda d: d["items"]["w"][5].__setitem__(0, 99), "malformed pieces"),
    (lambda d: d["items"]["w"][4].__setitem__(0, 1), "exceeds size"),
    (lambda d: d["items"]["w"].__setitem__(6, [2]), "planner path"),
    (lambda d: d["items"]["opt.moments.0"].__setitem__(6, [3, 6, ~1]), "planner path"),
    (lambda d: d.__setitem__("chunk_sizes", d["chunk_sizes"][1:]), "chunk_ids"),
    (lambda d: d.__setitem__("chunk_ids", d["chunk_ids"][64:128] + d["chunk_ids"][64:]), "twice"),
    (lambda d: d.__setitem__("chunk_ids", d["chunk_ids"][:-1] + "A"), "invalid chunk id"),
    (lambda d: d.__setitem__("chunk_ids", "\u00e9" + d["chunk_ids"][1:]), "invalid chunk id"),
    (lambda d: d.__setitem__("chunk_ids", " " + d["chunk_ids"][1:]), "invalid chunk id"),
])
def test_hostile_version_3_records_are_refused(v2_run, edit, message):
    doc = _v3_doc(v2_run)
    edit(doc)
    with pytest.raises(ct.FormatError, match=message):
        Manifest.from_bytes(seal(doc), "hostile/manifest.json")
