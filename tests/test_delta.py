"""Delta saves and live weight updates (issue 38): ``ct.save(..., delta_from=...)`` stores
the changed elements of dense updates, every load path reconstructs them bit for bit,
``ct.tensor_versions`` names tensors by content from the manifest alone and
``ct.load_changes`` reads only what a server lacks, once per process group."""
from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo import delta_codec, manifest_codec
from ckptturbo.cli import main as cli_main
from ckptturbo.errors import CheckpointKindError, CheckpointNotFound, FormatError, IntegrityError
from ckptturbo.manifest_delta import MAX_CHAIN
from ckptturbo.runs import Location
from ckptturbo.testing.fault_proxy import FaultProxy, Outage
from ckptturbo.testing.launcher import run_distributed

ROWS, COLS = 1024, 1024  # a 2 MiB bf16 matrix: chunks of its own, payloads packed


def base_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)
                      for i in range(3)}
            | {"bias": torch.randn(1000, generator=g).to(torch.bfloat16)},
            "step": 0}


def updated(state: dict, seed: int, fraction: float = 0.1) -> dict:
    """The next step of a dense update: ``fraction`` of every matrix's elements change;
    the bias does not."""
    g = torch.Generator().manual_seed(seed)
    model = {}
    for name, t in state["model"].items():
        t = t.clone()
        if name != "bias":
            mask = torch.rand(t.shape, generator=g) < fraction
            t[mask] = torch.randn(int(mask.sum()), generator=g).to(t.dtype)
        model[name] = t
    return {"model": model, "step": state["step"] + 1}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def empty_like_state() -> dict:
    return {"model": {f"w{i}": torch.empty(ROWS, COLS, dtype=torch.bfloat16) for i in range(3)}
            | {"bias": torch.zeros(1000, dtype=torch.bfloat16)}, "step": -1}


def check(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for name, t in want["model"].items():
        assert same_bits(got["model"][name], t), name


def save_chain(run: str, steps: int, opts: dict | None = None) -> list[dict]:
    """step-0 in full, then ``steps`` delta saves, each over the one before."""
    states = [base_state()]
    ct.save(states[0], f"{run}/step-0", storage_options=opts).durable.result()
    for i in range(1, steps + 1):
        states.append(updated(states[-1], seed=i))
        ct.save(states[-1], f"{run}/step-{i}", storage_options=opts,
                delta_from=f"{run}/step-{i - 1}").durable.result()
    return states


def stored_bytes(run: str, opts: dict | None) -> int:
    """Bytes of every chunk object of the run, from the store's own listing."""
    fs, root = fsspec.core.url_to_fs(f"{run}/.ckptturbo/chunks", **(opts or {}))
    return sum(info["size"] for info in fs.find(root, detail=True).values())


def manifest_doc(url: str) -> dict:
    return json.loads(Path(url, "manifest.json").read_bytes())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_delta_chain_roundtrips_bit_exactly_and_costs_a_sixth(where, tmp_path, request):
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        run, opts = server.url("delta-chain"), server.storage_options
    else:
        run, opts = str(tmp_path / "run"), None
    states = [base_state()]
    ct.save(states[0], f"{run}/step-0", storage_options=opts).durable.result()
    full = stored_bytes(run, opts)
    for i in range(1, 4):  # a chain of 3 deltas
        states.append(updated(states[-1], seed=i))
        before = stored_bytes(run, opts)
        ct.save(states[-1], f"{run}/step-{i}", storage_options=opts,
                delta_from=f"{run}/step-{i - 1}").durable.result()
        added = stored_bytes(run, opts) - before
        assert added <= 0.25 * full, (i, added, full)  # ~0.16x: 1 bit + 10% of the values
    for i, want in enumerate(states):
        url = f"{run}/step-{i}"
        got = empty_like_state()
        ct.load(got, url, storage_options=opts)
        check(got, want)
        got = empty_like_state()
        dcp.load(got, storage_reader=ct.TurboReader(url, opts))
        check(got, want)
        check(ct.load_state_dict(url, storage_options=opts), want)
    versions = ct.tensor_versions(f"{run}/step-3", storage_options=opts)
    firsts = [ct.tensor_versions(f"{run}/step-{i}", storage_options=opts) for i in range(3)]
    assert versions["model.w0"].chain == tuple(v["model.w0"].key for v in firsts)
    assert versions["model.bias"] == firsts[0]["model.bias"]  # unchanged: the base's record


def test_format_version_4_only_with_delta_records(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    save_chain(run, 1)
    plain, delta = manifest_doc(f"{run}/step-0"), manifest_doc(f"{run}/step-1")
    assert plain["version"] == manifest_codec.FORMAT_VERSION == 3
    assert delta["version"] == manifest_codec.DELTA_VERSION == 4
    assert delta["items"]["model.w0"][0] == "delta" and delta["items"]["model.bias"][0] == "tensor"
    # a release that reads versions up to 3 refuses it by its version, naming it
    monkeypatch.setattr(manifest_codec, "READABLE_VERSIONS", (1, 2, 3))
    with pytest.raises(FormatError, match=r"format version 4; this ckptturbo reads versions"):
        ct.load_state_dict(f"{run}/step-1")
    ct.load_state_dict(f"{run}/step-0")


def test_gc_after_deleting_the_base_keeps_the_delta_loadable_and_verified(tmp_path, capsys):
    run = str(tmp_path / "run")
    states = save_chain(run, 2)
    for i in (0, 1):
        ct.delete(f"{run}/step-{i}")
    report = ct.collect_garbage(run)
    assert report.referenced == len(Location(f"{run}/step-2").read_manifest().chunks)
    check(ct.load_state_dict(f"{run}/step-2"), states[2])
    assert cli_main(["verify", f"{run}/step-2"]) == 0
    dest = tmp_path / "export.safetensors"
    assert cli_main(["export", f"{run}/step-2", str(dest)]) == 0
    from safetensors.torch import load_file

    assert same_bits(load_file(str(dest))["model.w1"], states[2]["model"]["w1"])


def test_rebase_rule_stores_in_full(tmp_path):
    run = str(tmp_path / "run")
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    ct.save(sd, f"{run}/s0").durable.result()
    saved = [sd]
    for i in range(1, MAX_CHAIN + 2):
        sd = {"w": sd["w"].clone()}
        sd["w"][i, :3] += 1
        ct.save(sd, f"{run}/s{i}", delta_from=f"{run}/s{i - 1}").durable.result()
        saved.append(sd)
        chain = ct.tensor_versions(f"{run}/s{i}")["w"].chain
        assert len(chain) == (i if i <= MAX_CHAIN else 0), i
        assert same_bits(ct.load_state_dict(f"{run}/s{i}")["w"], sd["w"])
    # unchanged over a delta record: the same record, the same version, nothing written
    h = ct.save(saved[2], f"{run}/again", delta_from=f"{run}/s2")
    assert h.wait().bytes_written == 0
    assert ct.tensor_versions(f"{run}/again") == ct.tensor_versions(f"{run}/s2")
    dense = {"w": sd["w"] + 1}  # every element changes: a payload would not be smaller
    ct.save(dense, f"{run}/dense", delta_from=f"{run}/s1").durable.result()
    assert manifest_doc(f"{run}/dense")["items"]["w"][0] == "tensor"
    other = {"w": torch.randn(32, 64).to(torch.bfloat16)}  # another shape: no base
    ct.save(other, f"{run}/other", delta_from=f"{run}/s1").durable.result()
    assert manifest_doc(f"{run}/other")["version"] == 3


def test_bits_not_values_decide_what_changed():
    nan = torch.tensor([float("nan"), 0.0, 1.0], dtype=torch.bfloat16)
    flipped = torch.tensor([float("nan"), -0.0, 1.0], dtype=torch.bfloat16)
    assert delta_codec.changed(nan, nan.clone()).tolist() == [False, False, False]
    mask = delta_codec.changed(nan, flipped)
    assert mask.tolist() == [False, True, False]
    payload = delta_codec.encode(mask, flipped)
    m, v = delta_codec.split(payload, 3, torch.bfloat16, "t")
    out = nan.clone()
    delta_codec.apply(out, m, v)
    assert same_bits(out, flipped)
    with pytest.raises(FormatError, match="'t'"):
        delta_codec.split(payload[:-1], 3, torch.bfloat16, "'t'")


def test_load_changes_yields_only_what_the_server_lacks(tmp_path):
    run = str(tmp_path / "run")
    states = save_chain(run, 3)
    latest = f"{run}/step-3"
    versions = [ct.tensor_versions(f"{run}/step-{i}") for i in range(4)]
    assert "step" not in versions[3]  # objects are not tensors
    assert list(ct.load_changes(latest, {k: v.key for k, v in versions[3].items()})) == []

    served = {k: v.key for k, v in versions[1].items()}
    changes = {c.name: c for c in ct.load_changes(latest, served)}
    assert sorted(changes) == ["model.w0", "model.w1", "model.w2"]  # the bias is the same
    for name, change in changes.items():
        assert change.kind == "delta" and change.key == versions[3][name].key
        w = states[1]["model"][name.split(".")[1]].clone()
        assert change.mask.shape == w.shape and change.values.dtype == w.dtype
        w[change.mask] = change.values
        assert same_bits(w, states[3]["model"][name.split(".")[1]])

    unknown = {"model.w0": "0" * 64}  # a version not in the chain, the others not served
    names = ["model.w0", "model.bias"]
    changes = {c.name: c for c in ct.load_changes(latest, unknown, names=names)}
    assert {n: c.kind for n, c in changes.items()} == {"model.w0": "full", "model.bias": "full"}
    assert same_bits(changes["model.w0"].tensor, states[3]["model"]["w0"])

    batches = list(ct.load_changes(latest, {}, memory_limit=1))  # one tensor per batch
    assert len(batches) == 4
    with ct.Session() as session:  # the operations are the session's methods too
        assert session.tensor_versions(latest) == versions[3]
        assert list(session.load_changes(latest, {k: v.key for k, v in versions[3].items()})) == []


def test_inspect_counts_the_payloads_of_each_tensor(tmp_path, capsys):
    run = str(tmp_path / "run")
    save_chain(run, 2)
    assert cli_main(["inspect", "--json", f"{run}/step-2"]) == 0
    tensors = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert tensors["model.w0"]["deltas"] == 2 and tensors["model.bias"]["deltas"] == 0
    assert tensors["model.w0"]["bytes"] == ROWS * COLS * 2


def test_load_changes_refuses_other_kinds_and_missing_checkpoints(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointKindError):
        ct.tensor_versions(str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointKindError):
        next(ct.load_changes(str(tmp_path), {}))
    with pytest.raises(CheckpointNotFound):
        next(ct.load_changes(str(tmp_path / "run" / "nothing"), {}))


def test_a_damaged_payload_chunk_is_an_integrity_error_naming_the_tensor(tmp_path):
    run = str(tmp_path / "run")
    save_chain(run, 1)
    old = {k: v.key for k, v in ct.tensor_versions(f"{run}/step-0").items()}
    payload = Location(f"{run}/step-1").read_manifest().items["model.w2"].shards[0].pieces[-1]
    path = Location(f"{run}/step-1").chunk_path(payload.chunk)
    data = bytearray(Path(path).read_bytes())
    data[payload.offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.w2"):
        list(ct.load_changes(f"{run}/step-1", old))
    with pytest.raises(IntegrityError, match="model.w2"):
        ct.load_state_dict(f"{run}/step-1")


def _changes_on_rank(rank: int, world: int, run: str, opts: dict, served: dict,
                     old: dict, new: dict) -> list[str]:
    """Every rank gets every change; applied to the old weights they give the new ones."""
    group = dist.new_group(backend="gloo")
    names = []
    for change in ct.load_changes(f"{run}/step-1", served, process_group=group,
                                  storage_options=opts):
        assert change.kind == "delta"
        w = old[change.name].clone()
        w[change.mask] = change.values
        assert same_bits(w, new[change.name]), change.name
        names.append(change.name)
    return names


def test_grouped_load_changes_reads_each_changed_chunk_once(s3_server):
    run, opts = s3_server.url("delta-grouped"), s3_server.storage_options
    states = save_chain(run, 1, opts)
    served = {k: v.key for k, v in ct.tensor_versions(f"{run}/step-0",
                                                      storage_options=opts).items()}
    new = Location(f"{run}/step-1", opts).read_manifest()
    base = Location(f"{run}/step-0", opts).read_manifest()
    payload_bytes = sum(size for cid, size in new.chunks.items() if cid not in base.chunks)
    old, new = ({f"model.{k}": v for k, v in s["model"].items()} for s in states)
    fs, path = fsspec.core.url_to_fs(f"{run}/step-1/manifest.json", **opts)
    manifest_bytes = fs.size(path)
    with FaultProxy(s3_server.endpoint) as proxy:
        counted = proxy.storage_options(opts)
        results = run_distributed(_changes_on_rank, 2, run, counted, served, old, new,
                                  timeout=240)
        down = proxy.stats().bytes_down
    assert all(sorted(r) == ["model.w0", "model.w1", "model.w2"] for r in results)
    # each rank reads the manifest; every payload chunk crosses the proxy once (twice
    # would be 2x payload_bytes), with some HTTP headers
    assert payload_bytes <= down < 1.2 * payload_bytes + 2 * manifest_bytes + 50_000, (
        down, payload_bytes)


def _load_row_shards(rank: int, world: int, url: str, want: torch.Tensor) -> bool:
    """A DTensor template sharded by rows: each rank reads its rows of a delta record."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    template = distribute_tensor(torch.zeros(ROWS, COLS, dtype=torch.bfloat16), mesh, [Shard(0)])
    out = ct.load_state_dict(url, templates={"model.w1": template})
    rows = ROWS // world
    return same_bits(out["model"]["w1"].to_local(), want[rank * rows:(rank + 1) * rows])


def test_sharded_templates_read_their_boxes_of_a_delta_record(tmp_path):
    run = str(tmp_path / "run")
    states = save_chain(run, 2)
    assert run_distributed(_load_row_shards, 2, f"{run}/step-2", states[2]["model"]["w1"],
                           timeout=240) == [True, True]


def test_an_outage_is_a_storage_error_from_the_iterator(s3_server, monkeypatch):
    monkeypatch.setenv("CKPTTURBO_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("CKPTTURBO_DEADLINE", "4")
    monkeypatch.setenv("CKPTTURBO_OUTAGE_COOLDOWN", "30")
    run = s3_server.url("delta-outage")
    with FaultProxy(s3_server.endpoint) as proxy, ct.Session() as session:
        opts = proxy.storage_options(s3_server.storage_options)
        session.save(base_state(), f"{run}/step-0", storage_options=opts).durable.result()
        changes = session.load_changes(f"{run}/step-0", {}, storage_options=opts)
        proxy.set_outage(Outage.REFUSE)
        with pytest.raises(ct.StorageError):
            next(changes)


def _collective_delta_save(rank: int, world: int, run: str) -> str:
    try:
        ct.save({"w": torch.zeros(4)}, f"{run}/step-1", delta_from=f"{run}/step-0")
    except ct.CkptTurboError as exc:
        return str(exc)
    return "saved"


def test_a_collective_delta_save_of_several_ranks_is_refused_at_once(tmp_path):
    run = str(tmp_path / "run")
    ct.save({"w": torch.zeros(4)}, f"{run}/step-0").durable.result()
    for message in run_distributed(_collective_delta_save, 2, run, timeout=120):
        assert "one process" in message, message


def test_a_chain_of_delta_saves_reads_its_base_back_once(s3_server):
    """A delta save over this process's previous delta save compares with the values it
    kept; the first of the chain, and another session, read the base from storage."""
    from ckptturbo.testing.proxy_process import ProxyProcess

    run = s3_server.url("delta-kept")
    states = [base_state()]
    for i in (1, 2):
        states.append(updated(states[-1], seed=i))
    full = sum(t.nbytes for t in states[0]["model"].values())
    with ProxyProcess(s3_server.endpoint) as proxy:
        opts = proxy.storage_options(s3_server.storage_options)
        session, other = ct.Session(), ct.Session()
        try:
            read = []
            session.save(states[0], f"{run}/step-0", storage_options=opts).durable.result()
            for i, saver in ((1, session), (2, session), (3, other)):
                proxy.control.reset_stats()
                state = states[min(i, 2)] if i < 3 else updated(states[2], seed=3)
                saver.save(state, f"{run}/step-{i}", storage_options=opts,
                           delta_from=f"{run}/step-{i - 1}").durable.result()
                read.append(proxy.control.stats().bytes_down)
        finally:
            session.close()
            other.close()
    assert read[0] >= full  # the first delta save read its base
    assert read[1] < 64 << 10, read  # the second compared with the values kept: manifests only
    assert read[2] >= full  # another session keeps nothing: it reads the base
    got = empty_like_state()
    ct.load(got, f"{run}/step-2", storage_options=s3_server.storage_options)
    check(got, states[2])
