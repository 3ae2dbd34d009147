"""Planted sparse models at real shapes: synthetic weights whose FFN neurons fire with planted,
power-law-distributed probabilities in the model's own forward pass, plus predictors that match.

Benchmarks cannot download checkpoints, so ``planted:<preset>?dtype=f16&seed=0[&layers=N]``
(see ``source.open_model``) stands for a Llama-2 / Falcon / OPT model of the real shape. Nothing
is stored: every tensor is generated on demand, row block by row block, from a counter-based
hash of (seed, tensor, layer, block), so an executor materialises only its shard and every
device (CPU or CUDA) produces bit-identical rows. With ``dtype=q8_0`` or ``q4_0`` the matrices
are stored as ``quants.storage_kind`` says, quantized per 32-weight block from the same generated
floats on the device that generates them (so the statistics are those of the f16 model, up to
quantization), and their rows come as blocks (``layer_blocks``) or dequantized (``layer``).

How the sparsity is planted (dimension legend of ``config.py``; c = the bias channel, dim 0):

* Residual dim c is a constant "bias channel": every embedding row holds ``C_VALUE`` there and
  no attention or FFN output writes it (row c of attn_output, column c of ffn_down_t are 0).
  Every other residual dim ("rest") of an embedding row is random with rms exactly 1.
* Gate row j (ReGLU) or up row j (plain ReLU) is ``g_j = rho * a_j + sqrt(1 - rho^2) * e_j``
  on the rest dims (a_j, e_j unit vectors, see below) and ``m_j * |g_j|`` on dim c, with
  ``m_j = Phi^-1(p_j)``. The norm weight of dim c at the FFN input is ``r_l / C_VALUE`` where
  r_l is the planned per-dim rms of the residual's rest at that point. Then, whatever the
  token, ``g_j . norm(x)`` is (up to the positive 1/rms factor both parts share)
  ``g_j . x_rest + m_j |g_j| r_l``; with x_rest ~ isotropic of per-dim variance r_l^2 the first
  term is ~N(0, |g_j|^2 r_l^2), so P(neuron j fires) = Phi(m_j) = p_j.
* SwiGLU presets are thresholded on |SiLU(gate)| at SiLU(1) (planted_spec.SWIGLU_THRESHOLD): a
  neuron is active iff its gate value, ~N(m_j, 1) at unit scale, exceeds 1, so the bias channel
  carries ``(Phi^-1(p_j) + 1) |g_j|``: P(active) = p_j again, and the predictor below marks the
  same event as for ReGLU. (Unlike ReGLU's zero, this threshold depends on the gate's scale,
  which the plan holds to ~1 %.)
* The residual's growth is planned so r_l is known: the attention and FFN outputs of each
  layer add variance ATTN_VAR / L and FFN_VAR / L per dim. The down projection's scale comes
  from the planted probabilities (Var(h_j) summed over neurons); for plain ReLU the mean output
  (E[relu(z)] > 0) is projected out of each row block of ffn_down_t so no constant drift builds
  up in the stream. Query rows copy their KV head's key rows (plus small noise), so attention
  mostly attends to the token itself and its output variance is that of v (predictable).
  Measured (dense forward, f32): the rest's rms stays within 0.3 % of the plan over 40-60
  layers at D = 512, and per-layer active shares within 3 % of the planted mean.
* a_j = u_j P / |u_j P|: P [k, D] is a CountSketch of the rest dims (each rest dim belongs to
  one of k buckets, with a random sign), u_j [k] small random integers. The predictor
  ``fc1 = [P; -P; bias row]``, ``fc2_j = rho * [u_j, -u_j] / |u_j P|, rho * Phi^-1(q_j)`` computes
  ``rho * a_j . x_rest + rho * Phi^-1(q_j) r_l`` exactly (relu(Px) - relu(-Px) = Px), i.e. it sees
  the part rho of the gate direction and marks neuron j with probability q_j. The part
  sqrt(1 - rho^2) e_j is what a trained predictor would miss; rho (default 0.98) sets its recall.
* p_j (true activation) and q_j (predictor marks) follow ``min(p_max, a * rank^-b)``, calibrated
  per layer (slightly jittered, seeded) so that the mean and the share carried by the top
  ``top_frac`` of neurons hit the published statistics; neuron ids are randomly permuted.
* ``ranges=2``: a hot set per half of the vocabulary (token ids below n_vocab / 2: range A, the
  rest: range B), each the same law under its own permutation (p^A, q^A and p^B, q^B). Residual
  dim 1 is a second reserved channel, the range channel: +C_VALUE in range A's embedding rows,
  -C_VALUE in range B's, written by no layer, so each position carries its own token's range.
  The gate holds (m^A + m^B) / 2 |g_j| on the bias channel and (m^A - m^B) / 2 |g_j| on the range
  channel (its FFN norm weight as the bias channel's): a token of range A sees m^A, one of range
  B m^B. The predictor reads it too (fc1 gains [e_r; -e_r] rows, relu(x_r) - relu(-x_r) = x_r).
  The output head adds +-RANGE_LOGIT on the range channel to each token's row by its range, so
  generated tokens stay in their prompt's range and so does the hot set a generation fires.

Every random integer comes from splitmix64 over int64 lanes, every reduction is over small
integers (exact in fp32/fp64, so its order does not matter) and every other step is one IEEE
operation per element, so generation is subset-consistent and, by construction, gives the same
bits on CPU and CUDA (the CUDA path is not exercised by the CPU tests). Generating on the GPU
and copying to the host is the fast way to materialise a CPU shard on the GPU host.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_config import config_to_fields, expected_shapes
from .gguf_writer import LazyTensor, fuse_qkv, write_model
from .planted_random import splitmix64, std_normal, stream_key
from .planted_rows import RowGenerators, assemble, row_ids, zeros
from .planted_spec import PRESETS, SWIGLU_GATE, TORCH_DT, PlantedSpec, PlantedSpecError, parse_spec, preset_config
from .planted_stats import ATTN_VAR, FFN_VAR, P_MAX, POS_VAR, LayerPlan, calibrate, down_plan
from .qtypes import QTYPES, storage_kind
from .quants import QuantRows, dequantize
from .tokenizer import BYTE_VOCAB_SIZE, byte_level_fields

JITTER_MEAN, JITTER_SHARE = 0.06, 0.015  # per-layer variation: log-mean std, top-share std
if TYPE_CHECKING:
    from .reference import ReferenceModel


class PlantedModel:
    """A planted model as a ``WeightSource``: rows are generated when asked for.

    ``layer(template, bid, rows)`` returns exactly those rows of the full tensor, generating only
    the BLOCK_ROWS-row blocks that hold them; any device gives the same bits.
    """

    def __init__(self, spec: str | PlantedSpec) -> None:
        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self.preset = PRESETS[self.spec.preset]
        self.config = preset_config(self.spec)
        self.full_layers = self.preset.config["n_layer"]  # the plan is that of the full model
        self.fields = _fields(self.config)
        self.shapes = expected_shapes(self.config)
        self._plans: dict[int, LayerPlan] = {}
        self._jitter = std_normal(self.spec.seed, "layer-jitter", 2 * self.full_layers).reshape(2, -1)
        self._jitter -= self._jitter.mean(axis=1, keepdims=True)
        self._gens = RowGenerators(self.spec, self.config, self.full_layers, self.plan).table()
        self._names = _name_index(self.config, self.shapes)

    def __repr__(self) -> str:
        return f"PlantedModel({self.spec.preset!r}, dtype={self.spec.dtype}, seed={self.spec.seed}, layers={self.config.n_layer})"

    # --- statistics ------------------------------------------------------------------------
    def plan(self, l: int) -> LayerPlan:
        """The layer's planted statistics and scales (cached)."""
        if l not in self._plans:
            self._plans[l] = self._make_plan(l)
        return self._plans[l]

    def _make_plan(self, l: int) -> LayerPlan:
        c, F = self.config, self.config.n_ff
        active, marked, share_p, share_q = self._layer_targets(l)
        p_rank, b = calibrate(F, active, self.spec.targets.top_frac, share_p)
        q_rank, _ = calibrate(F, marked, self.spec.targets.top_frac, share_q)
        order = self.permutation(l)  # order[i] = neuron id of rank i
        p, q = np.empty(F), np.empty(F)
        p[order], q[order] = p_rank, q_rank
        p_b = q_b = None
        if self.spec.ranges == 2:  # range B: the same law, its own permutation
            order_b = self.permutation(l, "perm-b")
            p_b, q_b = np.empty(F), np.empty(F)
            p_b[order_b], q_b[order_b] = p_rank, q_rank
        # the residual's rest grows by (ATTN_VAR + FFN_VAR) / L per layer from the embedding's 1
        L = self.full_layers
        var_in = (1.0 + (POS_VAR if c.arch == "opt" else 0.0)) + l * (ATTN_VAR + FFN_VAR) / L
        var_ffn = var_in if c.parallel_attn else var_in + ATTN_VAR / L
        shift = SWIGLU_GATE if c.thresholded else 0.0
        relu_mean, down_scale = down_plan(p, c.gated, FFN_VAR / L, shift)
        return LayerPlan(p, q, b, math.sqrt(var_in), math.sqrt(var_ffn), down_scale, relu_mean, shift, p_b, q_b)

    def _layer_targets(self, l: int) -> tuple[float, float, float, float]:
        """(active, marked, top share of the activations, top share of the marks) of layer l: the
        targets with a seeded per-layer variation, centred over the full model's layers so the
        model-wide means hit the targets; each top share at most what its mean allows."""
        t = self.spec.targets
        scale = math.exp(JITTER_MEAN * self._jitter[0, l]) / float(np.mean(np.exp(JITTER_MEAN * self._jitter[0])))
        active, marked = min(t.active * scale, 0.95), min(t.marked * scale, 0.95)
        share = t.top_share + JITTER_SHARE * self._jitter[1, l]
        # the hottest top_frac can carry no more than all of their share of the mean
        fit = lambda mean: float(np.clip(share, t.top_frac + 0.01, min(0.99, 0.98 * t.top_frac * P_MAX / mean)))  # noqa: E731
        return active, marked, fit(active), fit(marked)

    def permutation(self, l: int, stream: str = "perm") -> np.ndarray:
        """[F] neuron ids in rank order (hottest first): a seeded shuffle, so hot neurons are
        scattered over the rows (``stream`` "perm-b": the second token range's)."""
        keys = splitmix64(torch.tensor([stream_key(self.spec.seed, stream, l)]), self.config.n_ff)[0]
        return np.argsort(keys.numpy(), kind="stable")

    def token_range(self, tokens: Any) -> np.ndarray:
        """The range (0: A, 1: B) of each token id (all 0 with one range)."""
        t = np.asarray(tokens)
        return (t >= self.config.n_vocab // 2).astype(np.int64) if self.spec.ranges == 2 else np.zeros_like(t)

    def range_tokens(self, token_range: int) -> tuple[int, int]:
        """[lo, hi) of the token ids of range ``token_range`` (0: A, 1: B; one range: every id)."""
        half = self.config.n_vocab // 2 if self.spec.ranges == 2 else self.config.n_vocab
        return (0, half) if token_range == 0 else (half, self.config.n_vocab)

    def _probs(self, l: int, token_range: int, q: bool) -> np.ndarray:
        if token_range not in range(self.spec.ranges):
            raise PlantedSpecError(f"{self}: token range {token_range} of a model with {self.spec.ranges} range(s)")
        plan = self.plan(l)
        return (plan.q_b if q else plan.p_b) if token_range else (plan.q if q else plan.p)

    def activation_probs(self, l: int, token_range: int = 0) -> np.ndarray:
        """[F] planted probability that neuron j of layer l fires (its gate/up logit > 0) on a
        token of range ``token_range``."""
        return self._probs(l, token_range, q=False).copy()

    def predictor_probs(self, l: int, token_range: int = 0) -> np.ndarray:
        """[F] planted probability that the predictor marks neuron j (logit >= threshold 0)."""
        return self._probs(l, token_range, q=True).copy()

    def activation_counts(self, n_tokens: int = 1_000_000, token_range: int = 0) -> tuple[list[np.ndarray], int]:
        """The planted statistics as a profile (of tokens of range ``token_range``) would report
        them: ([L][F] int64 counts, n_tokens). The engine places a planted model by range A's."""
        counts = [np.rint(self.activation_probs(l, token_range) * n_tokens).astype(np.int64)
                  for l in range(self.config.n_layer)]
        return counts, int(n_tokens)

    # --- WeightSource ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.shapes

    def layer(self, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
              bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows ``rows`` (all when None) of a per-layer tensor, by its template in ``gguf_keys``."""
        if not 0 <= bid < self.config.n_layer:
            raise PlantedSpecError(f"{self}: layer {bid} out of range 0..{self.config.n_layer - 1}")
        return self._tensor(K.tensor(template, bid, bias), (template, bias), bid, rows, dtype, device)

    def global_(self, name: str, dtype: torch.dtype | None = None, bias: bool = False,
                rows: Any = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """A model-level tensor (token_embd, output_norm, output, position_embd)."""
        return self._tensor(K.global_tensor(name, bias), (name, bias), 0, rows, dtype, device)

    def output_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output head [V, D] (the token embedding when tied)."""
        name = K.OUTPUT if self.has(K.global_tensor(K.OUTPUT)) else K.TOKEN_EMBD
        return self.global_(name, dtype)

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Any tensor by its full GGUF name (as ModelFile.get)."""
        if name not in self._names:
            raise PlantedSpecError(f"{self}: no tensor {name!r}")
        tmpl, l, bias = self._names[name]
        if l is None:
            return self.global_(tmpl, dtype, bias, device=device)
        return self.layer(tmpl, l, None, dtype, bias, device)

    def weights(self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of the model by GGUF name (only sensible for small models)."""
        return {name: self.get(name, dtype, device) for name in self.shapes}

    def reference(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "ReferenceModel":
        """The dense ReferenceModel of this model (materialises every weight: small models only)."""
        from .reference import ReferenceModel

        w = self.weights(device=device)
        if self.config.tied_output:
            w[K.global_tensor(K.OUTPUT)] = w[K.global_tensor(K.TOKEN_EMBD)]
        return ReferenceModel(self.config, w, dtype, device)

    def qtype(self, template: str, bid: int | None = None, bias: bool = False) -> str | None:
        """'q8_0' | 'q4_0' when ``layer_blocks`` (``global_blocks`` for bid None) hands the
        tensor's rows out as blocks; None when it comes in float."""
        name = K.global_tensor(template, bias) if bid is None else K.tensor(template, bid, bias)
        kind = self.dtype_of(name) if name in self.shapes else None
        return kind if kind in QTYPES else None

    def blocks(self, name: str, rows: Any = None, device: str | torch.device = "cpu") -> QuantRows:
        """Rows of a Q8_0 / Q4_0 tensor as blocks, quantized per 32-weight block from the
        generated floats (as ModelFile.blocks)."""
        kind = self.dtype_of(name)
        if kind not in QTYPES:
            raise PlantedSpecError(f"{self}: tensor {name!r} is stored as {kind}, not in blocks of {QTYPES}")
        tmpl, l, bias = self._names[name]
        return QuantRows(self._rows(name, (tmpl, bias), l or 0, rows, device, kind), kind)

    def layer_blocks(self, template: str, bid: int, rows: Any = None,
                     device: str | torch.device = "cpu") -> QuantRows:
        """Rows of a per-layer Q8_0 / Q4_0 matrix as blocks (see ``qtype``)."""
        return self.blocks(K.tensor(template, bid), rows, device)

    def global_blocks(self, name: str, rows: Any = None, device: str | torch.device = "cpu") -> QuantRows:
        """Rows of a model-level Q8_0 / Q4_0 matrix (token_embd, output) as blocks."""
        return self.blocks(K.global_tensor(name), rows, device)

    # --- generation ----------------------------------------------------------------------------
    def dtype_of(self, name: str) -> str:
        """How the model stores the tensor (``quants.storage_kind`` of the spec's dtype)."""
        if name not in self.shapes:
            raise PlantedSpecError(f"{self}: no tensor {name!r} in a {self.config.arch} model "
                                   f"(ffn_act={self.config.ffn_act}, bias={self.config.bias})")
        tmpl = self._names[name][0]
        if self.spec.pred_dtype is not None and tmpl in (K.FC1, K.FC2):
            return storage_kind(self.spec.pred_dtype, name, self.shapes[name])
        return storage_kind(self.spec.dtype, name, self.shapes[name])

    def _tensor(self, name: str, gen_key: tuple, l: int, rows: Any, dtype: torch.dtype | None,
                device: Any) -> torch.Tensor:
        kind = self.dtype_of(name)
        if kind in QTYPES:  # the weights the blocks stand for
            return dequantize(self._rows(name, gen_key, l, rows, device, kind), kind, dtype or torch.float32)
        return self._rows(name, gen_key, l, rows, device, None, dtype or TORCH_DT[kind])

    def _rows(self, name: str, gen_key: tuple, l: int, rows: Any, device: Any, qtype: str | None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Generated rows in ``dtype``, or with ``qtype`` their blocks (``planted_rows.assemble``)."""
        shape, dev = self.shapes[name], torch.device(device)
        gen = self._gens.get(gen_key, zeros)
        if len(shape) == 1:
            vec = gen(l, np.zeros(1, dtype=np.int64), dev)[0, : shape[0]]
            vec = vec if rows is None else vec[torch.as_tensor(row_ids(rows), device=dev)]
            return vec.to(dtype).contiguous()
        return assemble(lambda blocks: gen(l, blocks, dev), shape, rows, dtype, dev, qtype)


def _name_index(cfg: ModelConfig, shapes: dict) -> dict[str, tuple[str, int | None, bool]]:
    """GGUF name -> (template, layer or None for model-level tensors, bias)."""
    index: dict[str, tuple[str, int | None, bool]] = {}
    for bias in (False, True):
        for tmpl in (K.TOKEN_EMBD, K.POS_EMBD, K.OUTPUT_NORM, K.OUTPUT):
            index[K.global_tensor(tmpl, bias)] = (tmpl, None, bias)
        for l in range(cfg.n_layer):
            for tmpl in K.LAYER_TENSORS:
                index[K.tensor(tmpl, l, bias)] = (tmpl, l, bias)
    return {n: v for n, v in index.items() if n in shapes}



def _fields(cfg: ModelConfig) -> dict[str, Any]:
    """GGUF metadata: the config, threshold 0 and a byte-level tokenizer padded to the vocab."""
    n_fill = cfg.n_vocab - BYTE_VOCAB_SIZE
    assert n_fill >= 0, f"vocab {cfg.n_vocab} smaller than the byte vocabulary {BYTE_VOCAB_SIZE}"
    fields = config_to_fields(cfg)
    fields.update(byte_level_fields(extra_tokens=[f"<filler{i}>" for i in range(n_fill)]))
    return fields


def planted_model(spec: str) -> PlantedModel:
    """The planted model of ``spec`` ("llama2-13b?dtype=f16&seed=0[&layers=N]")."""
    return PlantedModel(spec)


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------
def write_planted_gguf(spec: str | PlantedModel, path: str | Path, progress: bool = True,
                       stats_dir: str | Path | None = None, n_tokens: int = 1_000_000) -> Path:
    """Stream a planted model to a GGUF file (PWRI magic, predictors included), tensor by tensor,
    and its planted activation statistics to ``stats_dir`` (default ``<path stem>.activation/``)
    as upstream's ``activation_{l}.pt`` count tensors over ``n_tokens`` tokens."""
    model = spec if isinstance(spec, PlantedModel) else PlantedModel(spec)
    path = Path(path)
    tensors = {name: LazyTensor(shape, model.dtype_of(name), _maker(model, name))
               for name, shape in model.shapes.items()}
    if model.spec.qkv == "fused":
        tensors = fuse_qkv(model.config, tensors)
    t0 = time.perf_counter()
    write_model(path, model.config, tensors, metadata=model.fields, sparse=True, progress=progress)
    if progress:
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    write_activation_stats(model, Path(stats_dir) if stats_dir else path.with_suffix(".activation"), n_tokens)
    return path


def _maker(model: PlantedModel, name: str) -> Callable[[], torch.Tensor]:
    """What the writer stores for ``name``: the weights, or the blocks of a block type."""
    if model.dtype_of(name) in QTYPES:
        return lambda: model.blocks(name).blocks
    return lambda: model.get(name)


def write_activation_stats(model: PlantedModel, folder: Path, n_tokens: int = 1_000_000) -> Path:
    """``folder/activation_{l}.pt``: 1-D int64 counts of each layer's neurons over n_tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    counts, _ = model.activation_counts(n_tokens)
    for l, c in enumerate(counts):
        torch.save(torch.from_numpy(c), folder / f"activation_{l}.pt")
