"""Activation predictor and the GPU/CPU split of its predicted-active neurons.

Dimension legend: T tokens, D n_embd, r predictor width, N neurons of the layer (n_ff),
Kg / Kc active neurons placed on the GPU / CPU, C capacity of a packed part.

A neuron is active for a token iff its logit >= threshold (upstream PowerInfer skips a neuron
iff logit < threshold). Comparisons are made in fp32 whatever the logits' dtype. The packed
split also takes gate values instead of logits (``silu=True``, the SwiGLU gate-first mode): a
neuron is then active iff |SiLU(g)| > threshold.

Neuron ids: every function here returns GLOBAL neuron ids (0 <= id < N, rows of the layer's
full up / gate / down_t) unless `local_of` is given, a [N] int32 map from a global id to the
neuron's row in the shard of the device that holds it (`local_index(gpu_mask)` builds it for
shards that keep their neurons in ascending global order, like upstream's gpu_bucket). The
executors pass local ids to `sparse_ffn`, which indexes shard rows.

Two forms of the split:
- `split_active`: exact-size tensors (idx [K], token mask bool [T, K]); on the GPU the sizes
  need a host sync (nonzero).
- `split_active_packed`: one int32 buffer, no host sync, static shapes (CUDA-graph safe), holding
  two parts [count | ids[C] | bits[C]]: count, then the first min(count, C) ids, then their
  token bitmasks (bit t set = active for token t, so T <= 32). The CPU part is one small
  contiguous tensor, copied to the host in one transfer; `packed_views` gives zero-copy views
  (idx, bits, n_active) that `sparse_ffn` takes directly, `unpack_active` exact tensors.
  If count > C the ids past C are dropped (count still says how many there were).
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from .linear import linear, linear_ref

_triton_failed = False
_pack_failed = False


class ActiveSplit(NamedTuple):
    gpu_idx: torch.Tensor  # [Kg] int64
    gpu_tok_mask: torch.Tensor  # [T, Kg] bool
    cpu_idx: torch.Tensor  # [Kc] int64
    cpu_tok_mask: torch.Tensor  # [T, Kc] bool


class PackedSplit(NamedTuple):
    gpu: torch.Tensor  # [1 + 2 Cg] int32: count | ids | bits
    cpu: torch.Tensor  # [1 + 2 Cc] int32


def predictor_logits(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, qtype: str | None = None) -> torch.Tensor:
    """logits [T, N] = fc2 . relu(fc1 . x): x [T, D], fc1 [r, D], fc2 [N, r]; x's dtype. With a
    qtype, fc1 and fc2 are quantized rows (quant.py) and both GEMVs run in `linear.linear`."""
    if qtype is not None:
        if x.dim() != 2:
            raise ValueError(f"predictor_logits: x.shape is {tuple(x.shape)}, expected [T, D]")
        z = torch.relu(linear(x, fc1, qtype=qtype))  # [T, r] fp32
        return linear(z, fc2, qtype=qtype).to(x.dtype)  # [T, N]
    if x.dim() != 2 or fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[1] != x.shape[1] or fc2.shape[1] != fc1.shape[0]:
        raise ValueError(f"predictor_logits: shapes x {tuple(x.shape)}, fc1 {tuple(fc1.shape)}, "
                         f"fc2 {tuple(fc2.shape)}; expected [T, D], [r, D], [N, r]")
    z = torch.relu(x @ fc1.to(x.dtype).T)  # [T, r]
    return z @ fc2.to(x.dtype).T  # [T, N]


_hidden_failed = False


def predictor_logits_of(h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``predictor_logits(h.to(dtype), fc1, fc2)`` for the fp32 residual h [T, D] and float fc1 / fc2:
    on CUDA for one token the cast, fc1 and the ReLU in one Triton launch (triton_predictor), then
    fc2 as a GEMV; torch elsewhere."""
    global _hidden_failed
    if (h.is_cuda and h.dim() == 2 and h.shape[0] == 1 and dtype in (torch.float16, torch.bfloat16)
            and not _hidden_failed):
        try:
            from . import triton_predictor
            z = triton_predictor.predictor_hidden(h.contiguous(), fc1, dtype)  # [1, r]
            return z @ fc2.to(dtype).T  # [1, N]
        except ImportError:
            _hidden_failed = True
    return predictor_logits(h.to(dtype), fc1, fc2)


def predictor_logits_ref(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                         qtype: str | None = None) -> torch.Tensor:
    """float64 reference of `predictor_logits` (quantized fc1 / fc2 dequantized exactly)."""
    return linear_ref(torch.relu(linear_ref(x, fc1, qtype=qtype)), fc2, qtype=qtype)


def local_index(gpu_mask: torch.Tensor) -> torch.Tensor:
    """[N] int32: each neuron's row in its device's shard (GPU neurons and CPU neurons each
    numbered 0.. in ascending global order)."""
    g = gpu_mask.to(torch.int32)
    in_gpu = torch.cumsum(g, 0) - 1  # [N]
    in_cpu = torch.cumsum(1 - g, 0) - 1  # [N]
    return torch.where(gpu_mask, in_gpu, in_cpu).to(torch.int32)


def _check(logits: torch.Tensor, gpu_mask: torch.Tensor, local_of: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"split_active: logits.shape is {tuple(logits.shape)}, expected [T, N]")
    N = logits.shape[1]
    if gpu_mask.dtype != torch.bool or tuple(gpu_mask.shape) != (N,):
        raise ValueError(f"split_active: gpu_mask is {gpu_mask.dtype} {tuple(gpu_mask.shape)}, expected bool [{N}]")
    if local_of is not None and tuple(local_of.shape) != (N,):
        raise ValueError(f"split_active: local_of.shape is {tuple(local_of.shape)}, expected [{N}]")


def split_active(logits: torch.Tensor, threshold: float, gpu_mask: torch.Tensor,
                 local_of: torch.Tensor | None = None) -> ActiveSplit:
    """Union over tokens of the active neurons, split by placement; ids in ascending order.

    logits [T, N]; gpu_mask [N] bool (True = the neuron lives on the GPU); local_of [N] int or
    None (None: global ids). On the GPU this syncs with the host (data-dependent sizes).
    """
    _check(logits, gpu_mask, local_of)
    active = logits.float() >= threshold  # [T, N]
    union = active.any(0)  # [N]
    parts = []
    for sel in (union & gpu_mask, union & ~gpu_mask):
        ids = sel.nonzero().squeeze(1)  # [K] global
        tok = active[:, ids]  # [T, K]
        parts += [ids if local_of is None else local_of[ids].long(), tok]
    return ActiveSplit(*parts)


def token_bits(active: torch.Tensor) -> torch.Tensor:
    """bool [T, N] (T <= 32) -> int32 [N] with bit t set where active[t]."""
    T = active.shape[0]
    shifts = torch.arange(T, device=active.device, dtype=torch.int64)[:, None]  # [T, 1]
    bits = (active.to(torch.int64) << shifts).sum(0)  # [N] int64, < 2^32
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # two's complement wrap


def active_of(logits: torch.Tensor, threshold: float, silu: bool = False) -> torch.Tensor:
    """bool [T, N]: logits >= threshold, or with silu (gate values) |SiLU(g)| > threshold; fp32."""
    lg = logits.float()
    return torch.nn.functional.silu(lg).abs() > threshold if silu else lg >= threshold


def _pack_torch(active, gpu_mask, local_of, cap_g, cap_c) -> torch.Tensor:
    """The torch form of the packed split of active [T, N] (sync-free: scatter instead of nonzero)."""
    N = active.shape[1]
    dev = active.device
    bits = token_bits(active)  # [N] int32
    ids_src = local_of.to(torch.int32) if local_of is not None else torch.arange(N, dtype=torch.int32, device=dev)
    out = []
    for sel, cap in ((bits != 0) & gpu_mask, cap_g), ((bits != 0) & ~gpu_mask, cap_c):
        pos = torch.cumsum(sel.to(torch.int32), 0) - 1  # [N]
        dest = torch.where(sel & (pos < cap), pos, cap).long()  # overflow and unselected -> slot C
        ids = torch.zeros(cap + 1, dtype=torch.int32, device=dev).scatter_(0, dest, ids_src)
        bts = torch.zeros(cap + 1, dtype=torch.int32, device=dev).scatter_(0, dest, bits)
        out += [sel.sum().to(torch.int32).reshape(1), ids[:cap], bts[:cap]]
    return torch.cat(out)


def split_active_packed(logits: torch.Tensor, threshold: float, gpu_mask: torch.Tensor, *,
                        local_of: torch.Tensor | None = None, gpu_capacity: int | None = None,
                        cpu_capacity: int | None = None, backend: str = "auto", silu: bool = False,
                        activity: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> PackedSplit:
    """The sync-free split (see the module docstring): two packed int32 parts, views of one buffer.

    gpu_capacity / cpu_capacity: slots per part; pass the number of neurons placed on each
    device (the host knows it from the placement) to keep the CPU part small; default N.
    backend: 'auto' (Triton on CUDA, else torch) | 'triton' | 'torch'. silu: the logits are gate
    values, active iff |SiLU(g)| > threshold. The decode step's counters, in place (CUDA-graph
    safe): activity int64 [N] += each neuron's active tokens; stats int64 [2] += the GPU part's
    (token, neuron) pairs and its rows (count).
    """
    global _triton_failed
    _check(logits, gpu_mask, local_of)
    T, N = logits.shape
    if T > 32:
        raise ValueError(f"split_active_packed: T is {T}, expected <= 32 (token bitmasks are int32)")
    cap_g = N if gpu_capacity is None else int(gpu_capacity)
    cap_c = N if cpu_capacity is None else int(cpu_capacity)
    use_triton = backend == "triton" or (backend == "auto" and logits.is_cuda and not _triton_failed)
    buf = None
    if use_triton:
        try:
            from . import triton_split
            buf = triton_split.split_pack(logits, threshold, gpu_mask, local_of, cap_g, cap_c, silu=silu,
                                          activity=activity, stats=stats)
        except ImportError:
            if backend == "triton":
                raise
            _triton_failed = True
    if buf is None:
        active = active_of(logits, threshold, silu)  # [T, N]
        buf = _pack_torch(active, gpu_mask, local_of, cap_g, cap_c)
        if activity is not None:
            activity += active.sum(0)
        if stats is not None:
            stats[0] += active[:, gpu_mask].sum()
            stats[1] += buf[0]
    return PackedSplit(buf[: 1 + 2 * cap_g], buf[1 + 2 * cap_g:])


def pack_active_bits(logits: torch.Tensor, threshold: float, col0: int = 0, n: int | None = None,
                     backend: str = "auto", skip: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The active mask of neurons col0 .. col0+n-1 packed 8 to a byte, as the CPU executor reads
    it from the channel: uint8 [T, ceil(n/8)], bit j % 8 of byte j // 8 set iff
    logits[t, col0 + j] >= threshold (fp32 compare) and not skip[j] (skip: bool [n], neurons
    computed elsewhere). One Triton launch on CUDA (threshold and packing fused, no host sync);
    elsewhere torch (runtime.channel.pack_mask's layout). out: written in place and returned
    (contiguous uint8 [T, ceil(n/8)]; on CUDA it may be host memory seen through a device view)."""
    global _pack_failed
    T, N = logits.shape
    n = N - col0 if n is None else n
    if not 0 <= col0 <= N or not 0 <= n <= N - col0:
        raise ValueError(f"pack_active_bits: columns {col0}..{col0 + n} outside the logits' {N}")
    if skip is not None and (skip.dtype != torch.bool or tuple(skip.shape) != (n,)):
        raise ValueError(f"pack_active_bits: skip is {skip.dtype} {tuple(skip.shape)}, expected bool [{n}]")
    if backend == "triton" or (backend == "auto" and logits.is_cuda and not _pack_failed):
        try:
            from . import triton_split
            return triton_split.pack_bits(logits, threshold, col0, n, skip, out=out)
        except Exception as e:  # no triton, or the kernel does not build here: torch from now on
            if backend == "triton":
                raise
            _pack_failed = True
            warnings.warn(f"pack_active_bits: Triton kernel unavailable ({type(e).__name__}: {e}); using torch",
                          RuntimeWarning, stacklevel=2)
    active = logits[:, col0:col0 + n].float() >= threshold
    packed = pack_bool_bits(active if skip is None else active & ~skip)
    return packed if out is None else out.copy_(packed)


def pack_bool_bits(active: torch.Tensor) -> torch.Tensor:
    """bool [T, n] -> uint8 [T, ceil(n/8)], neuron j in bit j % 8 of byte j // 8 (torch ops)."""
    T, n = active.shape
    m = torch.nn.functional.pad(active.to(torch.uint8), (0, (-n) % 8)).view(T, -1, 8)  # [T, ceil(n/8), 8]
    weights = 2 ** torch.arange(8, device=active.device, dtype=torch.int32)
    return (m.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def packed_views(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-copy views of one packed part: (idx [C] int32, bits [C] int32, n_active [1] int32),
    in the order `sparse_ffn(..., idx, mask=bits, n_active=n_active)` takes them."""
    cap = (part.shape[0] - 1) // 2
    return part[1: 1 + cap], part[1 + cap:], part[:1]


def unpack_active(part: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact tensors of one packed part: (idx [K] int64, tok_mask [T, K] bool). Reads the count
    (a host sync if `part` is on the GPU: meant for the host copy)."""
    idx, bits, count = packed_views(part)
    K = min(int(count[0]), idx.shape[0])
    shifts = torch.arange(T, device=part.device, dtype=torch.int32)[:, None]  # [T, 1]
    return idx[:K].long(), ((bits[None, :K] >> shifts) & 1).bool()
