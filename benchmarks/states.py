"""State builders for the benchmarks, and digests to check that what loaded is what saved.

The states are filled so that content dedup finds no accidental duplicates (see
:func:`_fill`): any bytes ckptturbo skips are skipped by structure, as in real training.
"""
from __future__ import annotations

from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30


def _fill(t: torch.Tensor, seed: int, block: torch.Tensor) -> torch.Tensor:
    """Fill a float tensor with distinct pseudo-random values, fast: a random block plus a
    per-block offset that is unique for (tensor seed, block index). No two 4 KiB ranges of
    any state built here are equal, and adding a constant to a tensor does not make it equal
    to another one, so content dedup cannot find accidental duplicates."""
    flat = t.view(-1)
    b = block.numel()
    # a per-tensor rotation of the block: adding a constant to one tensor (the scenarios'
    # "training step") never reproduces another tensor's bytes
    block = block.roll((seed * 7919 + 13) % b)
    whole = flat.numel() // b
    if whole:
        offsets = torch.arange(whole, dtype=torch.float32).mul_(1e-3).add_(float(seed))
        torch.add(block.view(1, b), offsets.view(whole, 1), out=flat[:whole * b].view(whole, b))
    tail = flat.numel() - whole * b
    if tail:
        flat[whole * b:].copy_(block[:tail]).add_(float(seed) + 0.5)
    return t


def _block(seed: int) -> torch.Tensor:
    return torch.rand(1 << 20, generator=torch.Generator().manual_seed(1000 + seed))  # 4 MiB


def transformer_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like fp32 state of about ``size_bytes``: token embedding and output
    head (a quarter of the bytes), then layers of four big matrices (qkv, out, up, down)
    plus biases and layer norms (the many small tensors), and a few scalars."""
    block = _block(seed)
    d = 1024 if size_bytes >= 256 * MiB else 256 if size_bytes >= 8 * MiB else 64
    vocab = max(16, size_bytes // 8 // (d * 4))
    layer_bytes = 12 * d * d * 4
    layers = max(1, (size_bytes - 2 * vocab * d * 4) // layer_bytes)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.out.weight": (d, d), p + "attn.out.bias": (d,),
            p + "mlp.up.weight": (4 * d, d), p + "mlp.up.bias": (4 * d,),
            p + "mlp.down.weight": (d, 4 * d), p + "mlp.down.bias": (d,),
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
        })
    shapes.update({"norm.weight": (d,), "norm.bias": (d,), "output.weight": (vocab, d)})
    state = {}
    for k, (name, shape) in enumerate(shapes.items()):
        state[name] = _fill(torch.empty(shape), seed * 100_000 + k, block)
    state["step"] = torch.tensor(1000 + seed)
    return state


def one_big_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One big tensor of 3/4 of ``size_bytes`` (768 MiB at 1 GiB) and 64 small ones."""
    block = _block(seed)
    big = size_bytes * 3 // 4 // 4
    d = 1024
    state = {"embedding.weight": _fill(torch.empty(big // d, d), seed * 100_000, block)}
    small = max(4096, (size_bytes - big * 4) // 64 // 4)
    for i in range(64):
        state[f"small.{i}"] = _fill(torch.empty(small if i % 2 else small // 16),
                                    seed * 100_000 + 1 + i, block)
    return state


def tensor_nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def digests(state: dict[str, Any]) -> dict[str, str]:
    """BLAKE3 of every tensor's bytes (what "loaded equals saved" is checked against)."""
    import blake3

    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[k] = blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
        else:
            out[k] = repr(v)
    return out


def mismatches(state: dict[str, Any], expected: dict[str, str]) -> list[str]:
    got = digests(state)
    return sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))


def zero_(state: dict[str, Any]) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.zero_()


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
