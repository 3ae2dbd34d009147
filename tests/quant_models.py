"""Quantized test models and the reference the quantized runtime is checked against (shared by
tests/unit, tests/ray and tests/gpu).

``write_upstream_int4``: a model file in the layout of upstream PowerInfer's ``quantize ... Q4_0``,
written by gguf-py alone (an independent writer). ``KernelReference``: the dense forward over a
quantized file's dequantized weights, multiplying what ggml's CPU kernels multiply;
``KernelPredictorHooks``: its predictors' decisions so computed.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf import quants as gq

from powerinfer_ray.kernels import quantize_q8_0
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.qtypes import QTYPES
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_weights
from powerinfer_ray.model.tokenizer import Tokenizer

SITES = ("attn", "ffn", "head", "pred")  # where the runtime multiplies x with quantized rows


class KernelReference(ReferenceModel):
    """The dense forward over a quantized file's exactly dequantized weights (float64), with the
    input of every product with a Q8_0 / Q4_0 matrix rounded to Q8_0 first, as the CPU kernels
    quantize their activation (ggml's ``vec_dot_q4_0_q8_0``): q/k/v and o, up and gate, the
    output head. The down projection's input is not rounded: the kernel adds the dequantized down
    rows scaled by the activation in float. GPU kernels multiply x as it is: compare them with
    the plain ``ReferenceModel``.

    Rounding ties: where an activation lies within fp32 error of a half step (or a block's scale
    amax / 127 of the middle between two f16 values), the runtime's fp32 value may round the other
    way, and the one-step difference spreads through later roundings. ``forward`` records such
    decisions in ``ties`` (relative margin, key), and takes the other side of those in ``flips``
    (keys: the rounded tensor (its first matrix's name), row, block, element or -1 for the scale;
    rows are a ``forward`` call's tokens)."""

    quantized: frozenset[str] = frozenset()  # names of the tensors the file stores in blocks
    ffn_rows: list | None = None  # per layer bool [F]: the neurons whose up / gate round x (None: all)
    head_name = K.global_tensor(K.OUTPUT)  # the head's tensor in the file (token_embd when tied)
    flips: frozenset = frozenset()
    TIE = 1e-4  # relative margin under which a rounding decision is a tie: the runtime's fp32 activations
    # drift ~1e-6 a layer, but an element left by cancellation can be off by more, and another
    # CPU's sums (the kernels' -march=native build, torch's GEMMs) round differently: 1e-5 was too tight on CI

    @classmethod
    def from_file(cls, path, dtype: torch.dtype = torch.float64, device="cpu",  # noqa: ANN001
                  thresholded: bool = True) -> "KernelReference":
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        ref = super().from_file(mf, dtype, device, thresholded)
        ref.quantized = frozenset(n for n in mf.tensors if mf.dtype_of(n) in QTYPES)
        if not mf.has(ref.head_name):
            ref.head_name = K.global_tensor(K.TOKEN_EMBD)
        ref.ties = []
        return ref

    def rounding_at(self, sites, ffn_rows=None) -> "KernelReference":  # noqa: ANN001
        """Round x only before the products of ``sites`` (of SITES: attn, q/k/v and o; ffn, up and
        gate; head; pred, the predictors' fc1 and fc2 through ``KernelPredictorHooks``), as a
        runtime whose other products multiply x as it is (a CUDA primary's). ``ffn_rows``: per
        layer a bool [F] mask, the neurons whose up and gate take the rounded x (the CPU
        executor's, beside a CUDA primary); None: every neuron. Returns self."""
        def at(n: str) -> bool:
            return (("attn" in sites and ".attn_" in n) or ("ffn" in sites and ".ffn_" in n)
                    or ("head" in sites and n == self.head_name)
                    or ("pred" in sites and (".fc1." in n or ".fc2." in n)))
        assert set(sites) <= set(SITES), sites
        self.quantized = frozenset(n for n in self.quantized if at(n))
        self.ffn_rows = ffn_rows
        return self

    def forward(self, tokens, cache, hooks=None) -> torch.Tensor:  # noqa: ANN001
        self.ties = []
        return super().forward(tokens, cache, hooks)

    def _rounded(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in self.quantized:
            return x
        blocks = quantize_q8_0(x).reshape(*x.shape[:-1], -1, 34)  # [T, nb, 34]: the kernels' own rounding
        d16 = blocks[..., :2].contiguous().view(torch.float16)  # [T, nb, 1]
        q = blocks[..., 2:].contiguous().view(torch.int8).double()  # [T, nb, 32]
        b = x.float().reshape(q.shape)
        d = b.abs().amax(-1, keepdim=True) / 127  # [T, nb, 1] fp32, as quantize_q8_0
        v = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)  # [T, nb, 32]: q before rounding
        other = torch.nextafter(d16, torch.where(d16.float() > d, -torch.inf, torch.inf).half())  # the other f16
        mid = (d16.double() + other.double()) / 2
        q_margin = ((v.abs() - v.abs().floor() - 0.5).abs() / v.abs().clamp_min(1)).double()
        d_margin = ((d.double() - mid).abs() / d.double().clamp_min(1e-30))
        for (r, blk, e), m in _under(q_margin, self.TIE):
            self.ties.append((m, (name, r, blk, e)))
        for (r, blk, _), m in _under(d_margin, self.TIE):
            self.ties.append((m, (name, r, blk, -1)))
        scale = d16.double().clone()
        for n, r, blk, e in self.flips:
            if n != name:
                continue
            if e < 0:
                scale[r, blk, 0] = other[r, blk, 0].double()
            else:  # the other side of the half step
                q[r, blk, e] += 1.0 if v[r, blk, e] > q[r, blk, e] else -1.0
        return (q * scale).reshape(x.shape).to(x.dtype)

    def _linear(self, x: torch.Tensor, tmpl: str, l: int) -> torch.Tensor:
        if tmpl != K.FFN_UP:  # ffn_pre rounded up's (and gate's) input
            # q, k and v multiply one rounding of x (the runtime's one GEMV over wqkv): one name
            x = self._rounded(x, K.tensor(K.ATTN_Q if tmpl in (K.ATTN_K, K.ATTN_V) else tmpl, l))
        return super()._linear(x, tmpl, l)

    def ffn_pre(self, l: int, x: torch.Tensor):  # noqa: ANN201
        rounded = super().ffn_pre(l, self._rounded(x, K.tensor(K.FFN_UP, l)))
        if self.ffn_rows is None:
            return rounded
        rows = torch.as_tensor(np.asarray(self.ffn_rows[l]), device=x.device)  # [F]
        return tuple(None if r is None else torch.where(rows, r, p)
                     for r, p in zip(rounded, super().ffn_pre(l, x)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self._rounded(self._norm(x, K.OUTPUT_NORM, None), self.head_name) @ self.w[K.global_tensor(K.OUTPUT)].T


class KernelPredictorHooks:
    """FFN hooks whose mask is the file's predictors' decision (logit >= threshold, default the
    file's) with the logits as the runtime's GEMVs on Q8_0 / Q4_0 rows compute them: float64 over
    ``ref``'s weights, x and relu(fc1 x) rounded to Q8_0 by ``ref`` (its ties recorded, its flips
    taken) where ``ref.quantized`` holds fc1 and fc2."""

    def __init__(self, ref: KernelReference, threshold: float | None = None) -> None:
        t = ref.cfg.sparse_threshold if threshold is None else threshold
        self.ref, self.threshold = ref, 0.0 if t is None else float(t)

    def logits(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        ref, fc1, fc2 = self.ref, K.tensor(K.FC1, l), K.tensor(K.FC2, l)
        z = torch.relu(ref._rounded(pred_in, fc1) @ ref.w[fc1].T)  # [T, r]
        return ref._rounded(z, fc2) @ ref.w[fc2].T  # [T, F]

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        return self.logits(l, pred_in) >= self.threshold  # [T, F]

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        return None


def _under(margin: torch.Tensor, tie: float) -> list[tuple[tuple[int, ...], float]]:
    """(index, margin) of the entries of margin [T, nb, k] below tie."""
    hits = (margin < tie).nonzero().tolist()
    return [((r, b, e), float(margin[r, b, e])) for r, b, e in hits]


def match_rounding(ref: KernelReference, tokens: list[int], got: list, at: list[int], tol: float = 1e-5,
                   max_flips: int = 6, hooks=None) -> tuple[list[float], frozenset]:  # noqa: ANN001
    """Relative errors of the runtime's logits ``got`` (one [V] per position in ``at``, ascending)
    against ``ref`` over ``tokens``, once the reference has taken the other side of the rounding
    ties the runtime took: while a step is off by more than tol, the ties of that step's tokens are
    flipped one at a time, then two at a time (the second a tie once the first is flipped: the
    runtime may have taken two ties of one step, neither of which explains the step alone), and
    the first flip that brings the step 10x closer is kept (until max_flips are kept). An error the
    ties cannot explain stays in the result. hooks: the reference forward's (``FFNHooks``)."""
    def errors(flips: frozenset, upto: int) -> list[float]:
        ref.flips = flips
        full = ref.forward(tokens[:upto + 1], ref.new_cache(), hooks)
        return [float((torch.as_tensor(g).double() - full[i]).abs().max() / full[i].abs().max())
                for g, i in zip(got, at) if i <= upto]

    def ties(first: int, last: int, flips: frozenset) -> list:  # of the last forward, closest first
        return [key for _, key in sorted(set(ref.ties)) if first <= key[1] <= last and key not in flips]

    def explain(flips: frozenset, bad: int, target: float) -> frozenset | None:  # ref.ties: under flips
        first = at[bad - 1] + 1 if bad else 0  # a flip that made this step the first one off: its rows
        singles = ties(first, at[bad], flips)
        for key in singles:
            if errors(flips | {key}, at[bad])[bad] < target:
                return flips | {key}
        for key in singles:
            errors(flips | {key}, at[bad])
            for second in ties(first, at[bad], flips | {key}):
                if errors(flips | {key, second}, at[bad])[bad] < target:
                    return flips | {key, second}
        return None

    flips = frozenset()
    errs = errors(flips, at[-1])
    while len(flips) < max_flips:
        bad = next((k for k, e in enumerate(errs) if e > tol), None)
        if bad is None:
            break
        found = explain(flips, bad, errs[bad] / 10)
        if found is None:
            break
        flips = found
        errs = errors(flips, at[-1])
    ref.flips = frozenset()
    return errs, flips


def assert_twin_computes_its_weights(folder, placement: str, sites, tol: float, cpu_rows_only: bool = False,  # noqa: ANN001
                                     **engine) -> None:
    """The embedded model as gguf-py's Q4_0 file and its F32 twin (bench/quant_twin.py's
    ``write_twins``) hold the same weights, and an engine of each (``placement``: 'primary', every
    FFN row on the primary; 'mixed', half of each layer's on the CPU executor; the file's own
    predictors; ``engine``: more EngineConfig fields) computes their float64 forward over a
    held-out window in decode steps, the Q4_0 file's with x rounded to Q8_0 at ``sites``
    (``cpu_rows_only``: the FFN's before the CPU executor's rows alone), to ``tol`` (rounding ties
    matched)."""
    from powerinfer_ray.bench import load_driver
    from powerinfer_ray.model.default import default_model_path
    from powerinfer_ray.offline.corpus import iter_texts
    from powerinfer_ray.offline.stream import token_windows
    from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
    from powerinfer_ray.runtime.plan import Plan

    paths = load_driver("quant_twin").write_twins(default_model_path(), folder)
    q4, twin = ModelFile(paths["q4"]), ModelFile(paths["twin"])
    assert q4.dtype_of(K.tensor(K.FC2, 0)) == q4.dtype_of(K.global_tensor(K.TOKEN_EMBD)) == "q4_0"
    for name in q4.tensors:
        assert twin.dtype_of(name) == "f32" and torch.equal(q4.get(name), twin.get(name)), name
    window = next(token_windows(Tokenizer(q4.fields), iter_texts("builtin:heldout"), 24, 24))
    cfg = q4.config
    half = [np.arange(cfg.n_ff) % 2 == 0] * cfg.n_layer
    plan = Plan.all_gpu(cfg) if placement == "primary" else Plan.from_masks(half, None, cfg)
    for path in paths.values():
        ref = KernelReference.from_file(path).rounding_at(sites, [~m for m in half] if cpu_rows_only else None)
        eng = LocalEngine(EngineConfig(str(path), plan=plan, max_batch=1, prefill_chunk=8, **engine))
        try:
            assert eng.primary.policy.name == "predictor"
            got = [eng.primary.step([0], [[t]], [i])[0] for i, t in enumerate(window)]
            assert placement == "primary" or eng.cpu.stats.neurons > 0
        finally:
            eng.close()
        errs, flips = match_rounding(ref, window, got, list(range(len(window))), hooks=KernelPredictorHooks(ref))
        assert max(errs) < tol, (path.name, errs, flips)


def k_blocks(rng: np.random.Generator, n_blocks: int, qt: T) -> np.ndarray:
    """Random K-quant blocks with small finite scales (gguf-py reads them; it has no quantizer
    for them). Q6_K, as upstream's quantize writes output.weight (210 bytes: ql[128], qh[64],
    int8 scales[16], f16 d); Q4_K (144 bytes: f16 d, f16 dmin, scales[12], qs[128])."""
    if qt == T.Q6_K:
        b = rng.integers(0, 256, (n_blocks, 210), dtype=np.uint8)
        b[:, 192:208] = rng.integers(-30, 31, (n_blocks, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = np.full((n_blocks, 1), 0.002, np.float16).view(np.uint8)
        return b
    b = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    b[:, 0:4] = np.full((n_blocks, 2), 0.001, np.float16).view(np.uint8)
    return b



def write_upstream_int4(path, cfg, rng, q4_k: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A PowerInfer model in the layout of upstream's ``quantize ... Q4_0``, written by gguf-py
    alone (GGUFWriter + gguf.quants): Q4_0 for every matrix (token_embd, attention, FFN with
    ffn_down_t, predictors fc1/fc2), Q6_K output.weight, F32 norms, PWRI magic; the tensors
    named in ``q4_k`` as random Q4_K blocks instead. Returns the weights the file stands for
    (gguf-py's dequantization)."""
    w = GGUFWriter(path, "llama")
    a = "llama"
    for key, v in ((f"{a}.context_length", cfg.n_ctx), (f"{a}.embedding_length", cfg.n_embd),
                   (f"{a}.block_count", cfg.n_layer), (f"{a}.feed_forward_length", cfg.n_ff),
                   (f"{a}.attention.head_count", cfg.n_head), (f"{a}.attention.head_count_kv", cfg.n_head_kv),
                   (f"{a}.rope.dimension_count", cfg.head_dim), ("general.file_type", 2)):
        w.add_uint32(key, v)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("powerinfer.sparse_threshold", 0.0)
    out: dict[str, np.ndarray] = {}
    for name, t in tiny_weights(cfg, seed=5).items():
        x = t.float().numpy()
        if name == "output.weight" or name in q4_k:
            qt = T.Q4_K if name in q4_k else T.Q6_K
            data = k_blocks(rng, x.size // 256, qt).reshape(x.shape[0], -1)
            w.add_tensor(name, data, raw_dtype=qt)
            out[name] = gq.dequantize(data, qt)
        elif x.ndim == 2:
            data = gq.quantize(x, T.Q4_0)
            w.add_tensor(name, data, raw_dtype=T.Q4_0)
            out[name] = gq.dequantize(data, T.Q4_0)
        else:
            w.add_tensor(name, x)
            out[name] = x
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
    return out


