"""Counter-based random integers for planted models: splitmix64 over int64 lanes, identical on
every device, keyed by (seed, tensor, layer, block) so any subset of row blocks is reproducible."""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

BLOCK_ROWS = 256  # rows per generation block: the unit of determinism
VAR8, VAR4 = (256**2 - 1) / 3, (16**2 - 1) / 3  # variance of odd ints in [-255, 255] / [-15, 15]


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def stream_key(seed: int, *parts: Any) -> int:
    """A 64-bit key for one random stream, e.g. (seed, template, layer, block)."""
    h = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes."""
    return (z >> s) & ((1 << (64 - s)) - 1)


_STEPS = {}  # (n_words, device) -> (i + 1) * gamma [W]: the counters of every stream


def splitmix64(keys: torch.Tensor, n_words: int) -> torch.Tensor:
    """keys [S] int64 -> [S, n_words] int64: word i of stream s is splitmix64(key_s + (i+1) gamma).
    int64 multiplication wraps modulo 2^64 on CPU and CUDA alike; ops run in place."""
    steps = _STEPS.get((n_words, keys.device))
    if steps is None:
        steps = torch.arange(1, n_words + 1, dtype=torch.int64, device=keys.device) * _GAMMA
        if len(_STEPS) >= 16:  # a handful of widths recur (one per tensor kind)
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[(n_words, keys.device)] = steps
    z = keys[:, None] + steps[None, :]  # [S, W]
    t = torch.empty_like(z)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (64 - shift)) - 1  # logical shift
        z ^= t
        if mult is not None:
            z *= mult
    return z


def odd_ints(keys: torch.Tensor, n: int, bits: int = 8) -> torch.Tensor:
    """keys [S] -> [S, n] float32 odd integers uniform in [-(2^bits - 1), 2^bits - 1] (mean 0,
    variance (4^bits - 1) / 3), from the little-endian bytes of the streams."""
    words = splitmix64(keys, (n + 7) // 8)  # [S, W]
    if bits == 8:  # a byte read as int8 b in [-128, 127] -> 2b + 1
        out = torch.mul(words.view(torch.int8)[:, :n], 2.0)
        return out.add_(1.0)
    assert bits == 4, f"bits={bits}: expected 4 or 8"
    nib = words.view(torch.uint8)[:, :n] & 15
    return torch.mul(nib, 2.0).sub_(15.0)


def _keys(seed: int, parts: tuple, blocks: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.tensor([stream_key(seed, *parts, int(b)) for b in blocks], dtype=torch.int64, device=device)


def block_ints(seed: int, parts: tuple, blocks: np.ndarray, cols: int, bits: int,
               device: torch.device) -> torch.Tensor:
    """Random odd ints of whole row blocks: [len(blocks) * BLOCK_ROWS, cols] float32."""
    x = odd_ints(_keys(seed, parts, blocks, device), BLOCK_ROWS * cols, bits)  # [nb, B*cols]
    return x.view(len(blocks) * BLOCK_ROWS, cols)


def row_norm(x: torch.Tensor) -> torch.Tensor:
    """Exact L2 norm of rows of small integers: x [R, C] -> [R] float64 (order-independent)."""
    return (x * x).sum(dim=1, dtype=torch.float64).sqrt()


def std_normal(seed: int, what: str, n: int) -> np.ndarray:
    """n seeded N(0, 1) draws from the hash stream (inverse CDF of uniforms)."""
    w = splitmix64(torch.tensor([stream_key(seed, what)]), n)[0]
    u = (_srl(w, 11).double() + 0.5) / 2.0**53
    return torch.special.ndtri(u).numpy()
