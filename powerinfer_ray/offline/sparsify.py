"""Training-free activation sparsity for SwiGLU models: one threshold per layer, calibrated on text.

In layer l, FFN neuron j is active iff its criterion c_j exceeds t_l; an inactive neuron
contributes nothing (h_j := 0). The criterion is |SiLU(gate_j)| (``on="gate"``, CATS: a device
computes the gate rows, thresholds, and reads up/down rows only for the active neurons) or
|h_j| = |SiLU(gate_j) * up_j| (``on="h"``: gate and up rows of every neuron, down rows of the
active ones). 'gate' is the default: it is the criterion a device can apply before it reads any
up/down row, so gate-first execution needs no predictor. '|h|' keeps more quality at equal
sparsity and costs the same in predicted mode, which reads only the predicted neurons' rows.

t_l is the target-sparsity quantile of c over the calibration tokens, calibrated layer after
layer on the thresholded forward: layer l sees the hidden states that the thresholded layers
before it produce, so on the calibration text the thresholded model reaches the target sparsity
in every layer (the sampled quantile's error aside).

The thresholds go into the GGUF metadata (gguf_keys.FFN_THRESHOLDS and the keys beside it),
with a fingerprint of the model they were calibrated on, so that thresholds carried over from
another file (``thresholds_from``) are refused unless they belong to the same weights.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..model import gguf_keys as K
from ..model.config import THRESHOLD_ON, ModelConfig
from ..model.gguf_file import ModelFile
from ..model.gguf_writer import write_model
from ..model.inspect import thresholds_table
from ..model.reference import KVCache, ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts
from .stream import token_windows

# Fewer tokens than this estimate a layer's quantile from too few contexts: calibrated on 1024
# tokens of the tiny SwiGLU model's train split, a 0.5 target reaches 0.500-0.506 per layer on
# its held-out text (256 tokens: 0.504-0.510; 16384: 0.498-0.502).
MIN_CALIBRATION_TOKENS = 1024
QUANTILE_SAMPLES = 1 << 24  # criterion values kept per layer (a uniform sample beyond this)
FINGERPRINT_TOLERANCE = 0.25  # relative L2 distance: dtype conversion moves it by ~1e-3 (f16)
RELU_FAMILY = ("relu", "reglu", "drelu")


@dataclass(frozen=True)
class Thresholds:
    """Per-layer thresholds and what they were calibrated for."""

    values: tuple[float, ...]  # [L] t_l
    on: str  # gate | h
    target: tuple[float, ...]  # [L] target sparsity
    tokens: int  # calibration tokens
    fingerprint: tuple[float, ...]  # [L * FINGERPRINT_ROWS] of the calibrated model

    def fields(self) -> dict[str, Any]:
        """The GGUF metadata that carries these thresholds."""
        return {K.FFN_THRESHOLDS: [float(t) for t in self.values], K.FFN_THRESHOLD_ON: self.on,
                K.FFN_TARGET_SPARSITY: [float(s) for s in self.target],
                K.FFN_CALIBRATION_TOKENS: int(self.tokens),
                K.FFN_THRESHOLD_FINGERPRINT: [float(f) for f in self.fingerprint]}

    @classmethod
    def from_file(cls, path: str | Path) -> "Thresholds":
        """The thresholds of a sparsified model file (ValueError when it has none)."""
        mf = ModelFile(path, validate=False)
        if K.FFN_THRESHOLDS not in mf.fields:
            raise ValueError(f"{path}: has no {K.FFN_THRESHOLDS!r} metadata; pass a model file "
                             "written by `powerinfer-ray sparsify`")
        f = mf.fields
        return cls(tuple(f[K.FFN_THRESHOLDS]), str(f.get(K.FFN_THRESHOLD_ON, "gate")),
                   tuple(f.get(K.FFN_TARGET_SPARSITY, ())), int(f.get(K.FFN_CALIBRATION_TOKENS, 0)),
                   tuple(f.get(K.FFN_THRESHOLD_FINGERPRINT, ())))

    def check_fits(self, cfg: ModelConfig, fingerprint: np.ndarray, source: str) -> None:
        """Refuse thresholds calibrated for another model (layer count, then weights)."""
        if len(self.values) != cfg.n_layer:
            raise ValueError(f"thresholds from {source}: {len(self.values)} layers, the model "
                             f"{cfg.name!r} has {cfg.n_layer}; calibrate for this model with "
                             "`powerinfer-ray sparsify -m MODEL CORPUS`")
        if len(self.fingerprint) != len(fingerprint):
            raise ValueError(f"thresholds from {source}: no fingerprint of the model they were "
                             f"calibrated on ({K.FFN_THRESHOLD_FINGERPRINT!r}); recalibrate")
        want = np.asarray(self.fingerprint, dtype=np.float64)
        dist = float(np.linalg.norm(fingerprint - want) / max(np.linalg.norm(want), 1e-30))
        if dist > FINGERPRINT_TOLERANCE:
            raise ValueError(f"thresholds from {source} were calibrated on another model: the gate "
                             f"weights differ by {100 * dist:.0f} % (tolerance "
                             f"{100 * FINGERPRINT_TOLERANCE:.0f} %); calibrate for this model with "
                             "`powerinfer-ray sparsify -m MODEL CORPUS`")


def model_fingerprint(mf: ModelFile) -> np.ndarray:
    """Per layer, the sums of the first FINGERPRINT_ROWS rows of ffn_gate [L * R] (float64)."""
    c = mf.config
    rows = np.arange(min(K.FINGERPRINT_ROWS, c.n_ff))
    sums = [mf.layer(K.FFN_GATE, l, rows=rows, dtype=torch.float64).sum(1) for l in range(c.n_layer)]
    return torch.cat(sums).numpy()


def parse_targets(words: Sequence[str]) -> list[float]:
    """Target sparsities from command-line words, each a number or a comma-separated list."""
    out = []
    for part in (p for w in words for p in w.split(",") if p.strip()):
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"--target-sparsity: {part!r} is not a number; expected a share of "
                             "neurons to skip, e.g. 0.5, or one per layer, e.g. 0.3,0.4,0.5") from None
    return out


def target_per_layer(target: float | Sequence[float], n_layer: int) -> tuple[float, ...]:
    """One target sparsity per layer from a number or a per-layer list, each in [0, 1)."""
    vals = [float(target)] if isinstance(target, (int, float)) else [float(t) for t in target]
    if len(vals) == 1:
        vals = vals * n_layer
    if len(vals) != n_layer:
        raise ValueError(f"target sparsity: {len(vals)} values, expected 1 or one per layer "
                         f"(n_layer={n_layer})")
    for l, s in enumerate(vals):
        if not 0.0 <= s < 1.0:
            raise ValueError(f"target sparsity of layer {l} is {s}, expected 0 <= s < 1")
    return tuple(vals)


def check_swiglu(cfg: ModelConfig, where: str) -> None:
    if cfg.ffn_act in RELU_FAMILY:
        raise ValueError(f"{where}: ffn_act is {cfg.ffn_act}, whose zeros are already activation "
                         "sparsity; thresholds are for SwiGLU models and not needed here")
    if cfg.ffn_act != "swiglu":
        raise ValueError(f"{where}: ffn_act is {cfg.ffn_act}, expected swiglu")


# ------------------------------------------------------------------------------------------------
# calibration
# ------------------------------------------------------------------------------------------------
class _Criterion:
    """FFNHooks that keep (a uniform sample of) one layer's dense criterion values."""

    def __init__(self, ref: ReferenceModel, layer: int, on: str, keep: float, gen: torch.Generator) -> None:
        self.ref, self.layer, self.on, self.keep, self.gen = ref, layer, on, keep, gen
        self.values: list[torch.Tensor] = []

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        if layer != self.layer:
            return
        c = self.ref.criterion(layer, pred_in, self.on).float().flatten().cpu()  # [T * F]
        if self.keep < 1.0:
            c = c[torch.rand(c.numel(), generator=self.gen) < self.keep]
        self.values.append(c)


def quantile_threshold(values: torch.Tensor, sparsity: float) -> float:
    """The t with a ``sparsity`` share of ``values`` at or below it (0.0 for sparsity 0)."""
    k = round(sparsity * values.numel())
    return float(torch.kthvalue(values, k).values) if k > 0 else 0.0


@torch.no_grad()
def calibrate(ref: ReferenceModel, windows: Sequence[Sequence[int]], target: Sequence[float],
              on: str = "gate", seed: int = 0) -> tuple[float, ...]:
    """Per-layer thresholds [L] for ``target`` sparsities [L], layer after layer on the
    thresholded forward over token ``windows``. Leaves ``ref`` running with them."""
    L, F = ref.cfg.n_layer, ref.cfg.n_ff
    keep = min(1.0, QUANTILE_SAMPLES / max(1, sum(len(w) for w in windows) * F))
    gen = torch.Generator().manual_seed(seed)
    toks = [torch.as_tensor(w, dtype=torch.long, device=ref.device) for w in windows]
    pos = [torch.arange(len(w), device=ref.device) for w in windows]
    xs = [ref.embed(t, p) for t, p in zip(toks, pos)]  # [T, D] each
    thresholds = [0.0] * L  # 0 keeps every neuron whose criterion is nonzero: dense
    for l in range(L):
        ref.set_thresholds(thresholds, on)
        rec = _Criterion(ref, l, on, keep, gen)
        for x, p in zip(xs, pos):
            ref.block(l, x, p, KVCache(), rec)
        thresholds[l] = quantile_threshold(torch.cat(rec.values), target[l])
        ref.set_thresholds(thresholds, on)
        xs = [ref.block(l, x, p, KVCache()) for x, p in zip(xs, pos)]
    return tuple(thresholds)


def calibration_windows(tok: Tokenizer, corpus: Corpus, max_tokens: int, seq_len: int,
                        min_tokens: int = MIN_CALIBRATION_TOKENS) -> list[list[int]]:
    """Token windows of ``seq_len`` over ``corpus``, at most ``max_tokens`` in all; a ValueError
    that says how many tokens are needed when the corpus gives fewer than ``min_tokens``."""
    if max_tokens < min_tokens:
        raise ValueError(f"max_tokens is {max_tokens}, expected at least {min_tokens} "
                         "(the fewest tokens thresholds are calibrated on)")
    windows = list(token_windows(tok, iter_texts(corpus), seq_len, max_tokens))
    n = sum(map(len, windows))
    if n < min_tokens:
        raise ValueError(f"corpus {str(corpus)[:80]!r} gave {n} tokens in windows of {seq_len}; "
                         f"calibrating thresholds needs at least {min_tokens} tokens: pass a "
                         "longer corpus")
    return windows


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------
def sparsify(model_path: str | Path, corpus: Corpus | None, out_path: str | Path,
             target_sparsity: float | Sequence[float] = 0.5, on: str = "gate",
             max_tokens: int = 16384, seq_len: int = 256, min_tokens: int = MIN_CALIBRATION_TOKENS,
             thresholds_from: str | Path | None = None, device: str | torch.device | None = None,
             log: Callable[[str], None] = print) -> Thresholds:
    """Calibrate per-layer thresholds of the SwiGLU model at ``model_path`` on ``corpus`` (or take
    them from the sparsified file ``thresholds_from``) and write the model with them to
    ``out_path``."""
    mf = ModelFile(model_path)
    check_swiglu(mf.config, str(model_path))
    if Path(out_path).resolve() == mf.path.resolve():
        raise ValueError(f"output {out_path}: must differ from the input model (it is read lazily)")
    fingerprint = model_fingerprint(mf)
    if thresholds_from is not None:
        th = Thresholds.from_file(thresholds_from)
        th.check_fits(mf.config, fingerprint, str(thresholds_from))
    else:
        if corpus is None:
            raise ValueError("corpus: none given; pass a calibration corpus or --thresholds FILE")
        if on not in THRESHOLD_ON:
            raise ValueError(f"criterion {on!r}: expected one of {THRESHOLD_ON}")
        target = target_per_layer(target_sparsity, mf.config.n_layer)
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        ref = ReferenceModel.from_file(mf, device=dev, thresholded=False)
        tok = Tokenizer(mf.fields)
        windows = calibration_windows(tok, corpus, max_tokens, min(seq_len, mf.config.n_ctx), min_tokens)
        values = calibrate(ref, windows, target, on)
        th = Thresholds(values, on, target, sum(map(len, windows)), tuple(fingerprint.tolist()))
    write_thresholded(mf, out_path, th)
    log("\n".join(thresholds_table(ModelFile(out_path))))
    log(f"wrote {out_path}")
    return th


def write_thresholded(mf: ModelFile, out_path: str | Path, th: Thresholds) -> Path:
    """Copy every tensor (lazily, at its stored dtype) and all metadata of ``mf`` with the
    thresholds ``th``; keeps the file's magic."""
    cfg = mf.config.with_(ffn_thresholds=th.values, ffn_threshold_on=th.on)
    tensors = {name: mf.stored(name) for name in mf.tensors}
    meta: Mapping[str, Any] = {**{k: v for k, v in mf.fields.items() if k != K.ARCH}, **th.fields()}
    tmp = Path(str(out_path) + ".tmp")
    write_model(tmp, cfg, tensors, metadata=meta, sparse=mf.magic == K.PWRI_MAGIC)
    shutil.move(tmp, out_path)
    return Path(out_path)


# ------------------------------------------------------------------------------------------------
# quality of a thresholded model against its dense forward
# ------------------------------------------------------------------------------------------------
class _ZeroShare:
    """FFNHooks that count, per layer, the zeros of the (thresholded) h."""

    def __init__(self, n_layer: int) -> None:
        self.zeros, self.values = np.zeros(n_layer), np.zeros(n_layer)

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.zeros[layer] += float((h == 0).sum())
        self.values[layer] += h.numel()


@torch.no_grad()
def threshold_quality(ref: ReferenceModel, windows: Sequence[Sequence[int]], thresholds: Sequence[float],
                      on: str = "gate") -> dict[str, Any]:
    """The thresholded forward against the dense one over token windows [W, T + 1] (inputs and
    their next-token targets): perplexity of each, top-1 agreement of the next-token argmax,
    and the share of neurons inactive per layer."""
    nll = {"dense": 0.0, "thresholded": 0.0}
    agree = n = 0
    zeros = _ZeroShare(ref.cfg.n_layer)
    for w in windows:
        inp, tgt = list(w[:-1]), torch.as_tensor(w[1:], device=ref.device)
        ref.set_thresholds(None)
        dense = ref.forward(inp, ref.new_cache())  # [T, V]
        ref.set_thresholds(thresholds, on)
        sparse = ref.forward(inp, ref.new_cache(), zeros)
        for name, logits in (("dense", dense), ("thresholded", sparse)):
            nll[name] += float(torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="sum"))
        agree += int((dense.argmax(-1) == sparse.argmax(-1)).sum())
        n += len(inp)
    assert n > 0, "no windows to evaluate"
    ppl = {k: float(np.exp(v / n)) for k, v in nll.items()}
    return {"tokens": n, "ppl_dense": ppl["dense"], "ppl": ppl["thresholded"],
            "ppl_increase": ppl["thresholded"] / ppl["dense"] - 1.0, "top1_agreement": agree / n,
            "sparsity": (zeros.zeros / np.maximum(zeros.values, 1)).tolist()}
