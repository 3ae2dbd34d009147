"""The compiled CPU kernels' entry points (csrc/sparse_ffn.cpp, built and loaded by cpu_library).

Dimension legend: T tokens, D n_embd, N shard rows, K active rows.

Weights are fp32 / fp16 / bf16 rows, or ggml Q4_0 / Q8_0 rows (qtype 'q4_0' / 'q8_0': uint8
[N, D // 32 * block bytes], quant.py), which the kernels multiply as ggml does: x quantized to
Q8_0 once per call, integer dots per block, the down rows dequantized into fp32 sums.
"""
from __future__ import annotations

import ctypes
import struct
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from .cpu_library import available, library  # noqa: F401  (available: the callers' check)
from .quant import check_matrix, dequantize, n_cols, row_bytes
from .torch_ffn import sparse_ffn_torch

_W_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_Q_DT = {"q4_0": 3, "q8_0": 4}
_ACT = {"relu": 0, "reglu": 1, "drelu": 2, "swiglu": 3}
_MAX_T = 64  # tokens per kernel call (the kernel's stack buffers); more are split into calls
SPLITS = {"auto": 0, "rows": 1, "cols": 2}  # the kernel's work split (csrc/sparse_ffn.cpp); 'auto' for the runtime
_BAD_ARGS = -1000000000

_lock = threading.Lock()  # one call at a time per process (shared scratch)
_scratch: torch.Tensor | None = None
_stats = (ctypes.c_int64 * 4)()  # pi_sparse_ffn_bitmask's (pairs, rows, down rows, up rows); used under _lock
_THR = {None: 0, "gate": 1, "h": 2}  # the kernels' thr_on: what a SwiGLU activation threshold compares
_scratch_bytes: dict[tuple, int] = {}  # pi_scratch_bytes by its arguments


def _w_code(w: torch.Tensor, qtype: str | None) -> int:
    """The kernel's weight type: fp32 / fp16 / bf16 by dtype, or the qtype's."""
    return _Q_DT[qtype] if qtype is not None else _W_DT[w.dtype]


def _scratch_for(nbytes: int) -> int:
    """Address of at least nbytes of the process's kernel scratch (grown, never shrunk); hold _lock."""
    global _scratch
    if _scratch is None or _scratch.numel() < nbytes:
        _scratch = torch.empty(max(nbytes, 64), dtype=torch.uint8)
    return _scratch.data_ptr()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_ok(w: torch.Tensor, width: int) -> bool:
    return w.dim() == 2 and w.shape[1] == width and w.stride(1) == 1


def sparse_ffn_cpu(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                   idx: torch.Tensor, mask: torch.Tensor | None, act: str, up_bias: torch.Tensor | None,
                   y: torch.Tensor, threads: int | None = None, split: str = "auto",
                   qtype: str | None = None, act_threshold: float | None = None, act_on: str = "gate") -> torch.Tensor:
    """Run the compiled kernel; inputs already validated by `sparse_ffn` (CPU tensors).

    x [T, D] any float dtype; up, gate, down_t [N, D] rows with unit column stride, one of
    fp32 / fp16 / bf16, or quantized rows uint8 [N, row_bytes] of qtype; idx [K] int32 or int64;
    mask None, bool [T, K] or int32 bits [K]; y [T, D] contiguous, x's dtype. split: the
    kernel's work split, 'auto' | 'rows' | 'cols' (benchmarks compare them); act_threshold,
    act_on: the SwiGLU activation threshold (sparse_ffn.py). Returns y.
    """
    lib = library()
    assert lib is not None, "sparse_ffn_cpu called without a compiled kernel"
    T, D = x.shape
    N, K = up.shape[0], idx.numel()
    wdt, width = _w_code(up, qtype), D if qtype is None else row_bytes(qtype, D)
    assert all(w is None or (w.dtype == up.dtype and _rows_ok(w, width)) for w in (up, gate, down_t)), \
        f"weights must share dtype {up.dtype} and have rows of {width} with unit column stride"
    idx = idx if idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous() else idx.contiguous().long()
    bias = None if up_bias is None else up_bias.contiguous()
    if bias is not None and bias.dtype not in _W_DT:
        bias = bias.float()
    mode, ld_mask = 0, 0
    if mask is not None:
        if mask.dtype == torch.bool:
            mask, mode = mask.contiguous(), 1
            ld_mask = mask.shape[1]
        else:
            mask, mode = mask.to(torch.int32).contiguous(), 2
    nthreads = int(threads or torch.get_num_threads())
    with _lock:
        for t0 in range(0, T, _MAX_T):
            t1 = min(T, t0 + _MAX_T)
            xs = x[t0:t1].to(torch.float32).contiguous()  # [Tc, D] fp32: x is read T x K times
            ys = y[t0:t1]
            ms = mask[t0:t1] if mode == 1 else mask
            if mode == 2 and t0:
                ms = torch.bitwise_right_shift(mask, t0)
            scratch = _scratch_for(lib.pi_scratch_bytes(t1 - t0, D, K, nthreads, _W_DT[y.dtype], SPLITS[split], 0,
                                                        wdt))
            rc = lib.pi_sparse_ffn(
                xs.data_ptr(), t1 - t0, D,
                up.data_ptr(), _ptr(gate), down_t.data_ptr(), wdt,
                up.stride(0), gate.stride(0) if gate is not None else 0, down_t.stride(0), N,
                _ptr(bias), _W_DT.get(bias.dtype, 0) if bias is not None else 0,
                idx.data_ptr(), int(idx.dtype == torch.int64), K,
                _ptr(ms), mode, ld_mask,
                _ACT[act], ys.data_ptr(), _W_DT[y.dtype], scratch, nthreads, SPLITS[split],
                float(act_threshold or 0.0), _THR[act_on if act_threshold is not None else None])
            if rc != 0:
                if rc == _BAD_ARGS:
                    raise ValueError(f"sparse_ffn_cpu: bad arguments T={T}, D={D}, threads={nthreads}")
                k = -rc - 1
                raise IndexError(f"sparse_ffn: idx[{k}] = {int(idx[k])} is outside the shard's rows [0, {N})")
    return y


def _bad(what: str, got, expected: str) -> ValueError:
    return ValueError(f"sparse_ffn_bitmask: {what} is {got}, expected {expected}")


def _packed_view(packed, T: int, n: int) -> tuple[int, int]:
    """(address, row stride in bytes) of a packed mask uint8 [T, ceil(n/8)], numpy or torch."""
    B = (n + 7) // 8
    if isinstance(packed, np.ndarray):
        shape, dt, strides = packed.shape, packed.dtype, packed.strides
        if dt != np.uint8:
            raise _bad("packed_mask.dtype", dt, "uint8")
        try:  # faster than __array_interface__ (a writable C-contiguous buffer only)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(packed))
        except (TypeError, ValueError, BufferError):
            addr = packed.__array_interface__["data"][0]
    elif isinstance(packed, torch.Tensor):
        shape, dt, strides = tuple(packed.shape), packed.dtype, packed.stride()
        if dt != torch.uint8:
            raise _bad("packed_mask.dtype", dt, "torch.uint8")
        if packed.device.type != "cpu":
            raise _bad("packed_mask.device", packed.device, "cpu")
        addr = packed.data_ptr()
    else:
        raise _bad("packed_mask", type(packed).__name__, "a numpy array or torch tensor (uint8), or None")
    if len(shape) != 2 or shape[0] != T or shape[1] != B:
        raise _bad("packed_mask.shape", tuple(shape), f"[{T}, {B}] ([T, ceil(n / 8)] with T = x.shape[0] = {T}, n = {n})")
    if B > 1 and strides[1] != 1:
        raise _bad("packed_mask.strides", tuple(strides), "unit stride along the bytes of a row")
    return addr, (strides[0] if T > 1 else B)


def _none() -> None:
    return None


class _Shard:
    """Validated shard weights and what the kernel needs of them (cached per tensors: see _shard)."""

    __slots__ = ("r_up", "r_gate", "r_down", "r_bias", "up_ptr", "N", "D", "args", "bias")

    def __init__(self, up, gate, down_t, up_bias, qtype):
        bias = up_bias
        if bias is not None and (bias.dtype not in _W_DT or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        self.r_up, self.r_gate, self.r_down, self.r_bias = (
            _none if t is None else weakref.ref(t) for t in (up, gate, down_t, up_bias))
        D = up.shape[1] if qtype is None else n_cols(up, qtype)
        self.up_ptr, self.N, self.D, self.bias = up.data_ptr(), up.shape[0], D, bias
        # pi_sparse_ffn_bitmask's weight arguments, in order (up .. bias_dt)
        self.args = (up.data_ptr(), _ptr(gate), down_t.data_ptr(), _w_code(up, qtype),
                     up.stride(0), gate.stride(0) if gate is not None else 0, down_t.stride(0), up.shape[0],
                     _ptr(bias), _W_DT[bias.dtype] if bias is not None else 0)

    def same(self, up, gate, down_t, up_bias) -> bool:
        return (self.r_up() is up and self.r_gate() is gate and self.r_down() is down_t
                and self.r_bias() is up_bias and up.data_ptr() == self.up_ptr)


_shards: dict[tuple, _Shard] = {}


def _shard(up, gate, down_t, up_bias, act, qtype) -> _Shard:
    """The weights' checks run once per set of tensors (an executor passes the same shard every
    step): cached by identity, held by weak references, revalidated if up's storage moved."""
    key = (id(up), id(gate), id(down_t), id(up_bias), act, qtype)
    sh = _shards.get(key)
    if sh is not None and sh.same(up, gate, down_t, up_bias):
        return sh
    _check_weights(up, gate, down_t, up_bias, act, qtype)
    if len(_shards) >= 512:
        _shards.clear()
    sh = _shards[key] = _Shard(up, gate, down_t, up_bias, qtype)
    return sh


def _check_weights(up, gate, down_t, up_bias, act, qtype) -> None:
    if act not in _ACT:
        raise _bad("act", repr(act), f"one of {tuple(_ACT)}")
    if qtype is not None:
        check_matrix(up, qtype, None, "up", "sparse_ffn_bitmask")
    if not isinstance(up, torch.Tensor) or up.dim() != 2:
        raise _bad("up.shape", tuple(getattr(up, "shape", ())), "[N, D]")
    if up.dtype not in _W_DT and qtype is None:
        raise _bad("up.dtype", up.dtype, "float32, float16 or bfloat16 (uint8 blocks need a qtype)")
    N, D = up.shape
    if (gate is None) != (act == "relu"):
        raise _bad("gate", "None" if gate is None else "given", f"{'None' if act == 'relu' else 'a tensor'} for act={act!r}")
    for name, w in (("up", up), ("gate", gate), ("down_t", down_t)):
        if w is None:
            continue
        if w.dim() != 2 or w.shape[0] != N or w.shape[1] != D:
            raise _bad(f"{name}.shape", tuple(w.shape), f"[{N}, {D}] like up")
        if w.dtype != up.dtype:
            raise _bad(f"{name}.dtype", w.dtype, f"{up.dtype} like up")
        if D > 1 and w.stride(1) != 1:
            raise _bad(f"{name}.stride()", w.stride(), "rows with unit column stride")
        if not w.is_cpu:
            raise _bad(f"{name}.device", w.device, "cpu")
    if up_bias is not None and (tuple(up_bias.shape) != (N,) or not up_bias.is_cpu):
        raise _bad("up_bias", f"{tuple(up_bias.shape)} on {up_bias.device}", f"[{N}] on cpu")


def sparse_ffn_bitmask(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                       packed_mask, n: int, act: str, up_bias: torch.Tensor | None, out: torch.Tensor,
                       threads: int | None = None, *, split: str = "auto", skip_zero: bool = True,
                       qtype: str | None = None, rows: torch.Tensor | None = None, act_threshold: float | None = None,
                       act_on: str = "gate") -> tuple[int, int, int]:
    """The CPU executor's FFN answer in one call, from the mask as the channel holds it.

    x [T, D] fp32 / fp16 / bf16 (rows with unit column stride, e.g. the channel's x view);
    up, gate (None for act='relu'), down_t [N, D] (the shard), fp32 / fp16 / bf16, or quantized
    rows uint8 [N, D // 32 * block bytes] of qtype ('q4_0' | 'q8_0'; quant.py); packed_mask uint8 [T, ceil(n/8)]
    (numpy array or torch tensor, rows with any stride; neuron j in bit j % 8 of byte j // 8, as
    `runtime.channel.pack_mask` writes it; padding bits of the last byte ignored) or None for every
    one of the n rows (policy 'dense'); n: the mask's neurons, rows 0 .. n-1 of the shard; out
    [T, D] contiguous, float32 or x's dtype: every element is written; threads: default
    torch.get_num_threads(); split: the kernel's work split, 'auto' | 'rows' | 'cols' (benchmarks
    compare them); skip_zero: a row whose activation is
    zero for every token skips its down row (same result, fewer bytes); False reads it anyway, as a
    dense FFN does (llama.cpp; the engine's policy 'dense', i.e. the layer-offload baseline);
    rows: int32 [>= n] contiguous, neuron j of the mask is row rows[j] of up / gate / down_t and
    up_bias (a shard read in place from a model file's whole matrices; None: row j).

    out[t] = sum over j < n with bit (t, j) set of act(gate[r] . x[t], up[r] . x[t] + up_bias[r]) *
    down_t[r] with r = rows[j] (r = j without rows), accumulated in fp32. The decoding (active rows = bits set for any token, per-token
    bits), the conversion of x and the output dtype happen in the compiled kernel; each active row
    is read once. Returns (pairs, rows, down_rows): the (token, neuron) pairs set, the rows active
    for any token (their up / gate rows read) and the down rows read (rows - the skipped ones; the
    torch path reads every one). act_threshold, act_on: a SwiGLU activation threshold (h zeroed
    where |SiLU(g)| ('gate') or |h| ('h') is not above it); on the gate a row's gate comes first
    and its up row is read only when the gate passes for some token of the mask: the returns get a
    fourth, up_rows, the rows whose up row was read, and without a mask (gate-first over all n
    rows) pairs counts those whose gate passes. Quantized rows: x is quantized to Q8_0 once per call and the dots
    run on integers, as ggml's. Bad arguments raise ValueError naming the field. Without a compiler:
    numpy decoding and the torch path, same results up to rounding.
    """
    call = prepare_bitmask(x, up, gate, down_t, packed_mask, n, act, up_bias, out, split=split, skip_zero=skip_zero,
                           qtype=qtype, rows=rows, act_threshold=act_threshold, act_on=act_on)
    return call(x.shape[0], threads)


def prepare_bitmask(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor, packed_mask,
                    n: int, act: str, up_bias: torch.Tensor | None, out: torch.Tensor, *, split: str = "auto",
                    skip_zero: bool = True, qtype: str | None = None, rows: torch.Tensor | None = None,
                    act_threshold: float | None = None, act_on: str = "gate") -> "BitmaskCall":
    """``sparse_ffn_bitmask`` checked once for buffers that every call reuses (the CPU
    executor's channel: x, the packed mask and out at their capacity of T rows): returns
    ``call(T, threads=None)``, the same call on their first T rows (row strides as given; the
    mask's row stride is its bytes per row when T = 1), without the checks."""
    return BitmaskCall(x, up, gate, down_t, packed_mask, n, act, up_bias, out, split, skip_zero, qtype, rows,
                       act_threshold, act_on)


class BitmaskCall:
    """A prepared ``sparse_ffn_bitmask`` (``prepare_bitmask``): pi_sparse_ffn_bitmask's arguments in
    one int64 array (``argv``, pi_sparse_ffn_bitmask_argv's), T (3), scratch (22) and threads (23)
    set per call; the compiled serving loop (``ServeLoop``) makes the same call from the array."""

    def __init__(self, x, up, gate, down_t, packed_mask, n, act, up_bias, out, split, skip_zero, qtype, rows,  # noqa: ANN001
                 act_threshold, act_on) -> None:
        sh, rows_ptr, addr, ld, sp = _validate(x, up, gate, down_t, packed_mask, n, act, up_bias, out, split, qtype,
                                              rows, act_threshold, act_on)
        self.cap, D = x.shape
        ld_x = x.stride(0) if self.cap > 1 else D
        self._y_dt, self._sp, self._wcode, self.n = _W_DT[out.dtype], sp, sh.args[3], n
        self._fallback = lambda T: _bitmask_torch(  # noqa: E731  (no compiled kernel)
            x[:T], up, gate, down_t, None if packed_mask is None else packed_mask[:T], n, act, up_bias, out[:T], qtype,
            rows, act_threshold, act_on)
        self._buffers = (x, out, sh, rows)  # the addresses in argv stay valid while this lives
        self._thresholded = act_threshold is not None
        thr = _THR[act_on if act_threshold is not None else None]
        thr_bits = struct.unpack("<q", struct.pack("<d", float(act_threshold or 0.0)))[0]
        self.argv = (ctypes.c_int64 * 29)(*(0 if v is None else v for v in (
            x.data_ptr(), _W_DT[x.dtype], ld_x, 0, D, *sh.args, addr, ld, n, rows_ptr, _ACT[act], out.data_ptr(),
            self._y_dt, 0, 0, sp, int(not skip_zero), ctypes.addressof(_stats), thr_bits, thr)))

    def scratch_bytes(self, T: int, threads: int) -> int:
        """Scratch bytes of a call of T tokens on ``threads`` threads."""
        key = (min(T, _MAX_T), self.argv[4], self.n, threads, self._y_dt, self._sp, self._wcode)
        nb = _scratch_bytes.get(key)
        if nb is None:
            nb = _scratch_bytes[key] = library().pi_scratch_bytes(*key[:5], self._sp, 1, self._wcode)
        return nb

    def __call__(self, T: int, threads: int | None = None) -> tuple[int, ...]:
        """(pairs, rows, down rows), and the up rows read under an activation threshold."""
        if not 0 <= T <= self.cap:
            raise _bad("T", T, f"an int in [0, {self.cap}] (the buffers' rows)")
        if T == 0:
            return 0, 0, 0
        lib = library()
        if lib is None:
            return self._fallback(T)
        nthreads = int(threads or torch.get_num_threads())
        with _lock:
            argv = self.argv
            argv[3], argv[22], argv[23] = T, _scratch_for(self.scratch_bytes(T, nthreads)), nthreads
            rc = lib.pi_sparse_ffn_bitmask_argv(argv)
            if rc != 0:
                raise ValueError(f"sparse_ffn_bitmask: the kernel rejected its arguments (rc {rc}): T={T}, "
                                 f"D={argv[4]}, n={self.n}, threads={nthreads}")
            if self._thresholded:
                return _stats[0], _stats[1], _stats[2], _stats[3]
            return _stats[0], _stats[1], _stats[2]


class ServeLoop:
    """The CPU executor's compiled serving loop (csrc pi_serve) on a channel's header: it answers the
    FFN requests of the layers with a prepared call (``calls[l]``, for requests whose mask width is
    ``n_masks[l]``) without returning to Python, and returns at the first request it leaves to the
    caller. ``counters`` [14] (int64, its answers since it was made; ``COUNTERS``) may be read from
    any thread."""

    COUNTERS = ("exchanges", "tokens", "pairs", "rows", "up_rows", "down_rows", "busy_ns", "kernel_ns",
                "decode_exchanges", "decode_busy_ns", "decode_kernel_ns", "decode_rows", "decode_up_rows",
                "decode_down_rows")

    def __init__(self, header: np.ndarray, calls: list[BitmaskCall | None], n_masks: list[int], t_max: int) -> None:
        assert header.dtype == np.int64 and header.flags.c_contiguous and len(calls) == len(n_masks)
        self._lib = library()
        self._header, self._calls, self._t_max = header, calls, t_max
        self._argvs = (ctypes.c_void_p * len(calls))(*(None if c is None else ctypes.addressof(c.argv) for c in calls))
        self._n_masks = (ctypes.c_int64 * len(calls))(*n_masks)
        self.ctl = np.zeros(6, np.int64)  # pi_serve's ctl
        self.ctl[5] = t_max
        self.counters = np.zeros(len(self.COUNTERS), np.int64)
        self._scratch: torch.Tensor | None = None

    def configure(self, threads: int, idle_s: float) -> None:
        """Threads of its kernel calls, and how long it spins without a request before it returns
        (from the serving thread, between ``run`` calls)."""
        need = max((c.scratch_bytes(self._t_max, threads) for c in self._calls if c is not None), default=64)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        self.ctl[1:5] = threads, self._scratch.data_ptr(), self._scratch.numel(), int(idle_s * 1e9)

    def interrupt(self) -> None:
        """``run`` returns before its next request, now or when next called, until ``clear`` (any thread)."""
        self.ctl[0] = 1

    def clear(self) -> None:
        self.ctl[0] = 0

    def run(self, last: int) -> tuple[int, bool]:
        """Serve the requests after ``last`` (the GIL released). Returns (a request it left to the
        caller, unanswered, True), or, when none came within the idle time or it was interrupted,
        (the last request it answered, or ``last``, False)."""
        assert self.ctl[1] > 0, "ServeLoop.configure first"
        r = int(self._lib.pi_serve(self._header.ctypes.data, last, self._argvs, self._n_masks, len(self._calls),
                                   self.ctl.ctypes.data, self.counters.ctypes.data))
        return (r, True) if r >= 0 else (-1 - r, False)

    def totals(self) -> dict[str, int]:
        return dict(zip(self.COUNTERS, self.counters.tolist()))


def _validate(x, up, gate, down_t, packed_mask, n, act, up_bias, out, split, qtype, rows, act_threshold,  # noqa: ANN001, ANN202
              act_on):
    """sparse_ffn_bitmask's checks (ValueError naming the field); (shard, rows address, mask
    address, mask row stride, split code)."""
    sh = _shard(up, gate, down_t, up_bias, act, qtype)
    rows_ptr, n_max = _row_ids(rows, sh.N) if rows is not None else (None, sh.N)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != sh.D:
        raise _bad("x.shape", tuple(getattr(x, "shape", ())), f"[T, {sh.D}]")
    T, D = x.shape
    if _W_DT.get(x.dtype) is None:
        raise _bad("x.dtype", x.dtype, "float32, float16 or bfloat16")
    ld_x = x.stride(0) if T > 1 else D
    if (D > 1 and x.stride(1) != 1) or ld_x < D or not x.is_cpu:
        raise _bad("x", f"strides {x.stride()} on {x.device}", "a cpu tensor, rows with unit column stride")
    y_dt = _W_DT.get(out.dtype) if isinstance(out, torch.Tensor) else None
    if y_dt is None or out.shape != x.shape or not out.is_contiguous() or not out.is_cpu \
            or out.dtype not in (torch.float32, x.dtype):
        raise _bad("out", f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}",
                   f"contiguous [{T}, {D}] float32 or {x.dtype} on cpu")
    if isinstance(n, np.integer):
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= n_max:
        raise _bad("n", n, f"an int in [0, {n_max}] (the mask's neurons: rows 0 .. n-1 of the shard"
                   + (", or of rows" if rows is not None else "") + ")")
    addr, ld = _packed_view(packed_mask, T, n) if packed_mask is not None else (None, 0)
    sp = SPLITS.get(split)
    if sp is None:
        raise _bad("split", repr(split), f"one of {tuple(SPLITS)}")
    if act_threshold is not None:
        _check_threshold(act, act_threshold, act_on)
    return sh, rows_ptr, addr, ld, sp


def _check_threshold(act: str, t, on: str) -> None:
    if act != "swiglu":
        raise _bad("act", repr(act), "'swiglu' with act_threshold (thresholds are SwiGLU's activation sparsity)")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < float("inf"):
        raise _bad("act_threshold", t, "a finite number >= 0, or None")
    if on not in _THR or on is None:
        raise _bad("act_on", repr(on), "'gate' or 'h'")


_row_checks: dict[int, tuple[weakref.ref, int, int]] = {}  # id(rows) -> (rows, data_ptr, the N checked against)


def _row_ids(rows: torch.Tensor, N: int) -> tuple[int, int]:
    """(address, length) of a row-id tensor, checked once per tensor: int32, contiguous, on the
    CPU, every id in [0, N) (an executor passes the same ids every step)."""
    key = id(rows)
    seen = _row_checks.get(key)
    if seen is not None and seen[0]() is rows and seen[1] == rows.data_ptr() and seen[2] == N:
        return seen[1], rows.numel()
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int32 or rows.dim() != 1 \
            or not rows.is_contiguous() or not rows.is_cpu:
        raise _bad("rows", f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}",
                   "a contiguous 1-D int32 cpu tensor")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= N):
        raise _bad("rows", f"ids in [{int(rows.min())}, {int(rows.max())}]", f"ids in [0, {N}) (rows of up)")
    if len(_row_checks) >= 512:
        _row_checks.clear()
    _row_checks[key] = (weakref.ref(rows), rows.data_ptr(), N)
    return rows.data_ptr(), rows.numel()


def _bitmask_torch(x, up, gate, down_t, packed_mask, n, act, up_bias, out, qtype, rows, act_threshold=None,
                   act_on="gate") -> tuple[int, ...]:
    """sparse_ffn_bitmask without the compiled kernel: numpy decoding, the torch path (the counts
    as the kernel's, with a threshold on the gate its gate-first ones)."""
    T = x.shape[0]
    if packed_mask is None:
        act_tn = torch.ones(T, n, dtype=torch.bool)  # [T, n]
    else:
        m = packed_mask if isinstance(packed_mask, np.ndarray) else packed_mask.numpy()
        act_tn = torch.from_numpy(np.unpackbits(m, axis=1, count=n, bitorder="little").view(np.bool_))  # [T, n]
    at_all = torch.arange(n) if rows is None else rows.long()[:n]  # the rows of up / gate / down_t
    pairs, n_rows = int(act_tn.sum()), int(act_tn.any(0).sum())
    if act_threshold is not None and act_on == "gate":  # gate first: the rows whose gate passes
        g_rows = gate.index_select(0, at_all)
        g = x.float() @ (g_rows.float() if qtype is None else dequantize(g_rows, qtype)).T  # [T, n]
        act_tn = act_tn & (F.silu(g).abs() > act_threshold)
        pairs = int(act_tn.sum()) if packed_mask is None else pairs
    idx = act_tn.any(0).nonzero().reshape(-1)
    if idx.numel() == 0:
        out.zero_()
    else:
        out.copy_(sparse_ffn_torch(x.float(), up, gate, down_t, at_all[idx], act_tn.index_select(1, idx), act, up_bias,
                                   qtype=qtype, act_threshold=act_threshold, act_on=act_on))
    if act_threshold is None:
        return pairs, n_rows, n_rows
    return pairs, n_rows, idx.numel(), idx.numel()


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           threads: int | None = None, *, qtype: str | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in float32 for CPU tensors, reading w in its own format: x [..., D]
    any float dtype, w [R, D] fp32 / fp16 / bf16 (rows with unit column stride, else torch) or
    quantized rows uint8 [R, D // 32 * block bytes] of qtype (x quantized to Q8_0 first, as ggml's),
    bias [R] or None -> [..., R] float32. The CPU executor's attention projections: every row of w
    read once by the compiled kernel's threads, no fp32 copy of the weights (torch would widen fp16
    weights first). Without a compiler: torch on the dequantized weights, same values up to rounding."""
    D = x.shape[-1]
    if qtype is not None:
        check_matrix(w, qtype, D, "w", "linear")
    elif w.dim() != 2 or D != w.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)}: expected x [..., D] and w [R, D]")
    if (w.dtype not in _W_DT and qtype is None) or not (w.is_cpu and x.is_cpu):
        raise ValueError(f"linear: w is {w.dtype} on {w.device}, x on {x.device}: expected CPU tensors, "
                         "w float32 / float16 / bfloat16 (or uint8 blocks with a qtype)")
    R = w.shape[0]
    lib = library()
    if lib is None or (D > 1 and w.stride(1) != 1):
        y = F.linear(x.float(), w.float() if qtype is None else dequantize(w, qtype))
    else:
        xs = x.reshape(-1, D).to(torch.float32).contiguous()
        y = torch.empty(xs.shape[0], R, dtype=torch.float32)
        nthreads = int(threads or torch.get_num_threads())
        for t0 in range(0, xs.shape[0], _MAX_T):
            t1 = min(xs.shape[0], t0 + _MAX_T)
            rc = lib.pi_linear(xs[t0:t1].data_ptr(), t1 - t0, D, w.data_ptr(), _w_code(w, qtype),
                               w.stride(0) if R else w.shape[1], R, y[t0:t1].data_ptr(), nthreads)
            if rc != 0:
                raise ValueError(f"linear: bad arguments T={t1 - t0}, D={D}, R={R}, threads={nthreads}")
        y = y.view(*x.shape[:-1], R)
    return y if bias is None else y.add_(bias.float())
