"""ct.safe_open keeps safetensors.safe_open 0.8's contract, on local files and on S3.

Each test writes real files with safetensors itself, opens them with ``safetensors.safe_open``
(the reference, on the local file) and with ``ckptturbo.safe_open`` (on the same file, or
on its copy in the SeaweedFS fixture), and compares what they return or raise.
"""
from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors import safe_open as ref_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from ckptturbo.errors import CheckpointNotFound, CkptTurboError, FormatError, MismatchError
from ckptturbo.store import Store
from ckptturbo.stream import safe_open
from ckptturbo.stream.format import DTYPE_BITS
from ckptturbo.stream.safe_open import (
    HandleClosedError,
    SafeOpenFormatError,
    SliceIndexError,
    TensorNotFoundError,
)


@pytest.fixture(params=["local", "s3"])
def opener(request):
    """``open(path, *args, **kwargs)``: ct.safe_open on the local file, or on a copy in S3."""
    if request.param == "local":
        return safe_open
    server = request.getfixturevalue("s3_server")
    prefix = server.url()

    def open_copy(path, *args, **kwargs):
        url = f"{prefix}/{pathlib.Path(path).name}"
        if pathlib.Path(path).exists():
            store = Store(url, server.storage_options)
            store.put(store.root, pathlib.Path(path).read_bytes())
        return safe_open(url, *args, storage_options=server.storage_options, **kwargs)

    return open_copy


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor: fp8/fp4 tensors have no torch.equal."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def every_dtype() -> dict[str, torch.Tensor]:
    """A 3x4 tensor of each safetensors dtype that torch has, of random bytes (F4: 3x8 values)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (_, attr) in DTYPE_BITS.items():
        if attr is None or not hasattr(torch, attr):
            continue
        dtype = getattr(torch, attr)
        data = torch.randint(0, 256, (3, 4 * dtype.itemsize), dtype=torch.uint8, generator=g)
        out[name] = (data & 1 if dtype == torch.bool else data).view(dtype)
    return out


def test_every_dtype_matches_safetensors(tmp_path, opener):
    want = every_dtype()
    assert {"F4", "F8_E8M0", "U16", "U32", "U64", "C64", "BF16"} <= set(want)
    assert set(want) == {n for n, (_, a) in DTYPE_BITS.items() if a and hasattr(torch, a)}
    want["scalar"], want["empty"] = torch.tensor(2.5), torch.empty(0, 3)
    path = str(tmp_path / "m.safetensors")
    save_file(want, path, metadata={"format": "pt"})
    with opener(path, "pt", "cpu", backend="mmap") as f, ref_open(path, "pt") as ref:
        assert f.keys() == ref.keys() and f.offset_keys() == ref.offset_keys()
        assert f.metadata() == ref.metadata() == {"format": "pt"}
        every = f.get_tensors()
        assert list(every) == ref.offset_keys()
        for name, ref_tensor in ref.get_tensors().items():
            for got in (f.get_tensor(name), every[name]):
                assert (got.dtype, got.shape) == (ref_tensor.dtype, ref_tensor.shape), name
                assert torch.equal(raw(got), raw(ref_tensor)), name
            s = f.get_slice(name)
            assert (s.get_shape(), s.get_dtype()) == (ref.get_slice(name).get_shape(),
                                                      ref.get_slice(name).get_dtype())


def test_f4_rows_and_packed_shapes(tmp_path, opener):
    packed = torch.randint(0, 256, (6, 5), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = str(tmp_path / "f4.safetensors")
    save_file({"w": packed, "v": torch.arange(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)},
              path)
    with opener(path, "pt") as f:
        s = f.get_slice("w")
        assert s.get_shape() == [6, 10] and s.get_dtype() == "F4"  # the header's shape
        assert torch.equal(raw(s[2:4]), raw(packed[2:4]))  # rows of the torch tensor
        assert torch.equal(raw(s[-1, 1:3]), raw(packed[-1, 1:3]))
        assert torch.equal(raw(f.get_slice("v")[3:]), torch.arange(3, 8, dtype=torch.uint8))


def test_sub_byte_dtypes_torch_lacks_raise_a_safetensors_error(tmp_path, opener):
    header = json.dumps({"f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
                         "odd": {"dtype": "F4", "shape": [2, 3], "data_offsets": [3, 6]}}).encode()
    path = tmp_path / "f6.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(6))
    with opener(str(path)) as f:
        for name, cause in (("f6", "no torch equivalent"), ("odd", "even last dimension")):
            with pytest.raises(SafeOpenFormatError,
                               match=f"f6.safetensors: tensor '{name}'.*{cause}") as e:
                f.get_tensor(name)
            assert isinstance(e.value, SafetensorError) and isinstance(e.value, FormatError)


def test_misaligned_tensors_are_read(tmp_path, opener):
    """A valid file may put a float32 at an odd offset; its tensor is still right."""
    header = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x07"
                     + struct.pack("<2f", 1.5, -2))
    with opener(str(path)) as f:
        want = torch.tensor([1.5, -2.0])
        assert torch.equal(f.get_tensor("b"), want) and torch.equal(f.get_tensors()["b"], want)
        assert torch.equal(f.get_slice("b")[1:], want[1:])


def test_pathlike_and_filename_keyword(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(4)}, str(path))
    for name in (path, str(path), bytes(path)):
        with safe_open(name, "pt") as f:
            assert torch.equal(f.get_tensor("a"), torch.arange(4))
    with safe_open(filename=path, framework="pt", device=None) as f:  # as safetensors names them
        assert f.keys() == ["a"]


def test_closed_handle_raises_and_its_slices_still_read(tmp_path, opener):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.arange(10.0), "b": torch.ones(2)}, path)
    with opener(path, "pt", chunk_size=8) as f, ref_open(path, "pt") as ref:  # 8-byte GETs
        assert torch.equal(f.get_tensor("a"), torch.arange(10.0))
        s, ref_slice = f.get_slice("a"), ref.get_slice("a")
    calls = [lambda h: h.keys(), lambda h: h.offset_keys(), lambda h: h.metadata(),
             lambda h: h.get_tensor("a"), lambda h: h.get_tensors(), lambda h: h.get_slice("a")]
    for call in calls:
        with pytest.raises(SafetensorError):
            call(ref)
        with pytest.raises(HandleClosedError, match="m.safetensors: File is closed") as e:
            call(f)
        assert isinstance(e.value, SafetensorError) and isinstance(e.value, CkptTurboError)
    assert torch.equal(s[2:5], ref_slice[2:5])  # safetensors' slices outlive the handle too
    h = opener(path, "pt")
    h.close()
    with pytest.raises(HandleClosedError):
        h.keys()


def test_missing_tensor_and_missing_file(tmp_path, opener):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.zeros(1)}, path)
    with opener(path) as f:
        for call in (f.get_tensor, f.get_slice):
            with pytest.raises(TensorNotFoundError,
                               match="m.safetensors: File does not contain tensor 'zz'") as e:
                call("zz")
            assert isinstance(e.value, SafetensorError) and isinstance(e.value, MismatchError)
    with pytest.raises(FileNotFoundError,
                       match=r"^No such file or directory: .*gone\.safetensors$") as e:
        opener(str(tmp_path / "gone.safetensors"))
    assert isinstance(e.value, CheckpointNotFound)


def test_bad_header_is_a_safetensors_error(tmp_path, opener):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorError, match="bad.safetensors: not a valid safetensors file") as e:
        opener(str(path))
    assert isinstance(e.value, FormatError)


def test_torch_indexing_matches_safetensors(tmp_path, opener):
    a = torch.randn(10, 5)
    path = str(tmp_path / "m.safetensors")
    save_file({"a": a, "s": torch.tensor(3.0)}, path)
    indexes = [slice(None), (), slice(None, 2), (slice(None), slice(None, 2)), (0, slice(None, 2)),
               (slice(2, None), -1), [], slice(-3, None), slice(1, 9, 3), slice(5, 2), 4, -10,
               Ellipsis, (Ellipsis, 1), None, (slice(None), [0, 3]), slice(0, 100)]
    with opener(path, "pt") as f, ref_open(path, "pt") as ref:
        s, r = f.get_slice("a"), ref.get_slice("a")
        for index in indexes:
            assert torch.equal(s[index], r[index]), index
        assert torch.equal(f.get_slice("s")[...], ref.get_slice("s")[...])
        for bad in (10, -11, slice(None, None, -1), (0, 0, 0)):
            with pytest.raises((IndexError, ValueError)) as ref_error:
                r[bad]
            with pytest.raises(SliceIndexError, match="m.safetensors: tensor 'a' of shape") as e:
                s[bad]
            assert isinstance(e.value, type(ref_error.value))
            assert isinstance(e.value, SafetensorError)


def test_numpy_framework_matches_safetensors(tmp_path, opener):
    a = np.random.default_rng(0).random((10, 5))
    path = str(tmp_path / "np.safetensors")
    save_numpy({"a": a, "b": np.arange(6, dtype=np.uint16), "t": np.asarray(True)}, path)
    for framework in ("np", "numpy"):
        with opener(path, framework) as f, ref_open(path, framework) as ref:
            for name in ref.keys():
                got, want = f.get_tensor(name), ref.get_tensor(name)
                assert isinstance(got, np.ndarray) and got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
            s, r = f.get_slice("a"), ref.get_slice("a")
            for index in (slice(None), (), slice(None, 2), (0, slice(None, 2)),
                          (slice(2, None), -5), []):
                np.testing.assert_array_equal(s[index], r[index])
            for bad in ((slice(2, None), -6), [0, 1], (slice(2, None), 20), slice(None, 20),
                        (slice(None), slice(None, 20))):
                with pytest.raises(SafetensorError) as ref_error:
                    r[bad]
                with pytest.raises(SliceIndexError) as e:
                    s[bad]
                assert str(e.value) == str(ref_error.value)  # safetensors' words, callers match
                assert "np.safetensors" in e.value.__notes__[0]  # the file, in the traceback


def test_frameworks_devices_and_backends(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"bf": torch.ones(2, dtype=torch.bfloat16), "f": torch.ones(2)}, path)
    for framework in ("pt", "torch", "pytorch"):
        for device in ("cpu", None, torch.device("cpu")):
            for backend in ("mmap", "pread"):
                with safe_open(path, framework, device, backend=backend) as f:
                    assert f.get_tensor("bf").device.type == "cpu"
    with (safe_open(path, "np") as f,
          pytest.raises(SafeOpenFormatError, match="tensor 'bf': dtype BF16")):
        f.get_tensor("bf")  # numpy has no bfloat16 (safetensors fails here too)
    bad = [({"framework": "tf"}, "framework 'tf' is not supported"),
           ({"framework": "bogus"}, "framework 'bogus' is invalid"),
           ({"backend": "nope"}, "backend 'nope' is invalid"),
           ({"device": "bogus"}, "device 'bogus' is invalid"),
           ({"framework": "np", "device": "cuda:0"},
            "device 'cuda:0' is not supported for framework 'numpy'")]
    for kwargs, message in bad:
        with pytest.raises((SafetensorError, ImportError)):  # tensorflow: when a tensor is read
            ref_open(path, **{"framework": "pt", **kwargs}).get_tensor("f")
        with pytest.raises(SafeOpenFormatError, match=f"m.safetensors: {message}"):
            safe_open(path, **kwargs)
