"""How much the predictors cost in quality, on the reference path (no Ray, no kernels).

Over windows of a text's token stream (``stream``: documents joined as the model was trained,
BOS at each window's start when the tokenizer adds one), the same windows HF transformers would
score: perplexity is exp(mean next-token NLL over every position but each window's last), as
``model(ids, labels=ids).loss`` computes it. Three forwards of each window: dense; sparse with
the predictors' masks (neuron j of layer l computed iff its logit >= the layer's threshold);
and sparse with the oracle mask (exactly the neurons the dense forward found active), which
must equal dense up to floating point. Reported: perplexity of each, next-token top-1 agreement
of sparse with dense, and per layer the predictors' recall, precision, recall of activation
mass and kept share. A model without predictors gets the dense perplexity alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as Fn

from ..model import gguf_keys as K
from ..model.costs import predictor_kind
from ..model.gguf_file import ModelFile
from ..model.qtypes import QTYPES
from ..model.quants import dequantize, quantize
from ..model.reference import ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts
from .samples import down_norms
from .stream import StreamFormat, token_windows

THRESHOLD = 0.0  # the decision threshold of a file that names none (upstream's default)


class PredictorHooks:
    """FFNHooks whose mask is the predictors' guess (logit >= the layer's threshold) on
    ``layers`` (all by default; the others run dense); counts per layer, through ``observe``,
    recall, precision and the recall of activation mass (|h| * ||down row||) against the truth."""

    def __init__(self, fc1: list[torch.Tensor], fc2: list[torch.Tensor], threshold: float | Sequence[float] = THRESHOLD,
                 layers: Iterable[int] | None = None, down_norms: list[torch.Tensor] | None = None) -> None:
        n = len(fc1)
        self.fc1, self.fc2 = fc1, fc2
        self.thresholds = [float(threshold)] * n if isinstance(threshold, (int, float)) else [float(t) for t in threshold]
        assert len(self.thresholds) == n, (len(self.thresholds), n)
        self.layers = set(range(n)) if layers is None else set(layers)
        self.down_norms = down_norms
        self.tp, self.fp, self.fn, self.tokens = [0] * n, [0] * n, [0] * n, [0] * n
        self.mass_kept, self.mass = [0.0] * n, [0.0] * n
        self._last: dict[int, torch.Tensor] = {}

    @property
    def threshold(self) -> float | list[float]:
        """The one threshold of every layer, or the per-layer list."""
        return self.thresholds[0] if len(set(self.thresholds)) == 1 else list(self.thresholds)

    @classmethod
    def from_file(cls, path: str | Path | ModelFile, device: str | torch.device = "cpu",
                  threshold: float | None = None, margin: float = 0.0,
                  predictor_qtype: str | None = None) -> "PredictorHooks":
        """The file's predictors at ``threshold`` (default: its ``powerinfer.sparse_threshold``)
        minus ``margin`` (a positive margin keeps more neurons); with ``predictor_qtype`` the
        weights of the blocks the engine quantizes float predictors to (``model.costs.predictor_kind``)."""
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        cfg = mf.config
        if not cfg.has_predictors:
            raise ValueError(f"{mf.path}: the model has no predictors (tensors {K.tensor(K.FC1, 0)!r}...)")

        def held(tmpl: str, l: int) -> torch.Tensor:
            w = mf.layer(tmpl, l, dtype=torch.float32, device=device)
            kind = predictor_kind(mf, tmpl, l, predictor_qtype)
            return dequantize(quantize(w, kind), kind) if kind in QTYPES and mf.qtype(tmpl, l) is None else w

        fc1 = [held(K.FC1, l) for l in range(cfg.n_layer)]
        fc2 = [held(K.FC2, l) for l in range(cfg.n_layer)]
        base = threshold if threshold is not None else file_threshold(mf)
        return cls(fc1, fc2, base - margin)

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> logits [T, F]."""
        w1, w2 = self.fc1[layer], self.fc2[layer]
        return torch.relu(x.to(w1.dtype) @ w1.T) @ w2.T

    def mask(self, layer: int, pred_in: torch.Tensor) -> torch.Tensor | None:
        if layer not in self.layers:
            return None
        m = self.logits(layer, pred_in) >= self.thresholds[layer]  # [T, F]
        self._last[layer] = m
        return m

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        m = self._last.pop(layer, None)
        if m is None:
            return
        truth = h != 0
        self.tp[layer] += int((m & truth).sum())
        self.fp[layer] += int((m & ~truth).sum())
        self.fn[layer] += int((~m & truth).sum())
        self.tokens[layer] += int(h.shape[0])
        if self.down_norms is not None:
            c = h.abs().float() * self.down_norms[layer]  # [T, F]
            self.mass_kept[layer] += float((c * m).sum())
            self.mass[layer] += float(c.sum())

    def stats(self, n_ff: int) -> list[dict[str, float]]:
        """Per predicted layer: recall, precision, mass recall and the kept and active shares."""
        out = []
        for l in sorted(self.layers):
            tp, fp, fn, t = self.tp[l], self.fp[l], self.fn[l], max(self.tokens[l], 1)
            out.append({"layer": l, "threshold": self.thresholds[l], "recall": tp / max(tp + fn, 1),
                        "precision": tp / max(tp + fp, 1), "kept": (tp + fp) / (t * n_ff),
                        "active": (tp + fn) / (t * n_ff),
                        "mass_recall": self.mass_kept[l] / self.mass[l] if self.mass[l] else 1.0})
        return out


def file_threshold(mf: ModelFile) -> float:
    t = mf.config.sparse_threshold
    return THRESHOLD if t is None else float(t)


class RecordHooks:
    """Record each layer's true active mask [T, F] during a dense forward."""

    def __init__(self) -> None:
        self.masks: dict[int, torch.Tensor] = {}

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.masks[layer] = h != 0


class OracleHooks:
    """Replay recorded masks: the sparse forward with perfect prediction."""

    def __init__(self, masks: dict[int, torch.Tensor]) -> None:
        self.masks = masks

    def mask(self, layer: int, pred_in: torch.Tensor) -> torch.Tensor:
        return self.masks[layer]

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        return None


# ------------------------------------------------------------------------------------------------
# evaluation against a cached dense pass
# ------------------------------------------------------------------------------------------------
@dataclass
class Score:
    tokens: int
    nll: float  # summed over the scored positions
    top1: float  # agreement with the dense forward's next token (1.0 for dense itself)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / max(self.tokens, 1))


class Evaluator:
    """Windows [seq_len] of held-out tokens with their dense next-token NLL and argmax cached;
    ``score(hooks)`` runs a sparse forward of every window and compares."""

    def __init__(self, ref: ReferenceModel, windows: Iterable[list[int]], dense_hooks: Any = None) -> None:
        """``dense_hooks`` observe the dense forward (e.g. to collect samples on the way)."""
        self.ref = ref
        self.windows: list[torch.Tensor] = []
        self._dense: list[torch.Tensor] = []  # argmax per window [T - 1]
        nll = 0.0
        for w in windows:
            ids = torch.as_tensor(w, dtype=torch.long, device=ref.device)
            logits = ref.forward(ids, ref.new_cache(), dense_hooks)[:-1]  # [T - 1, V]
            nll += _nll(logits, ids[1:])
            self.windows.append(ids)
            self._dense.append(logits.argmax(-1))
        n = sum(int(w.numel()) - 1 for w in self.windows)
        if n == 0:
            raise ValueError("the text gave no window: pass more text (or a smaller seq_len)")
        self.dense = Score(n, nll, 1.0)

    @torch.no_grad()
    def score(self, hooks: Any) -> Score:
        nll, agree = 0.0, 0
        for ids, dense in zip(self.windows, self._dense):
            logits = self.ref.forward(ids, self.ref.new_cache(), hooks)[:-1]
            nll += _nll(logits, ids[1:])
            agree += int((logits.argmax(-1) == dense).sum())
        return Score(self.dense.tokens, nll, agree / self.dense.tokens)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(Fn.cross_entropy(logits.float(), targets, reduction="sum"))


def _is_plain_text(text: Corpus) -> bool:
    """A str that names no corpus (no 'builtin...' word, no existing file) is the text itself."""
    if not isinstance(text, str):
        return False
    if text.split(":")[0] == "builtin" or ("\n" not in text and len(text) < 1024 and Path(text).exists()):
        return False
    return True


@torch.no_grad()
def quality_report(model_path: str | Path, text: Corpus, seq_len: int = 256, max_tokens: int | None = None,
                   device: str | torch.device = "cpu", threshold: float | None = None, margin: float = 0.0,
                   fmt: StreamFormat | None = None, oracle: bool = True,
                   predictor_qtype: str | None = None) -> dict[str, Any]:
    """Dense vs predictor-sparse (vs oracle-sparse with ``oracle``) forwards over windows of
    ``seq_len`` tokens of ``text`` (a string, or any corpus ``iter_texts`` reads; at most
    ``max_tokens`` window tokens) for the model at ``model_path``; the predictors decide at
    ``threshold`` (default: the file's) minus ``margin``, with ``predictor_qtype``'s weights (as
    ``PredictorHooks.from_file``). ``kl`` is the mean KL divergence of
    the sparse next-token distribution from the dense one, in nats per token."""
    mf = ModelFile(model_path)
    ref = ReferenceModel.from_file(mf, device=device)
    tok = Tokenizer(mf.fields)
    fmt = (fmt or StreamFormat()).resolve(tok)
    texts = [text] if _is_plain_text(text) else iter_texts(text)
    seq_len = min(seq_len, ref.cfg.n_ctx)
    sparse = mf.config.has_predictors
    hooks = (PredictorHooks.from_file(mf, device=device, threshold=threshold, margin=margin,
                                      predictor_qtype=predictor_qtype) if sparse else None)
    if hooks is not None:
        hooks.down_norms = down_norms(ref)
    names = ["dense"] + (["sparse"] + (["oracle"] if oracle else []) if sparse else [])
    nll, agree = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    n, kl, oracle_diff = 0, 0.0, 0.0
    for window in token_windows(tok, texts, seq_len, max_tokens, fmt):
        ids = torch.as_tensor(window, dtype=torch.long, device=ref.device)
        rec = RecordHooks() if sparse and oracle else None
        out = {"dense": ref.forward(ids, ref.new_cache(), rec)[:-1]}  # [T - 1, V]
        if hooks is not None:
            out["sparse"] = ref.forward(ids, ref.new_cache(), hooks)[:-1]
            kl += float(Fn.kl_div(out["sparse"].log_softmax(-1), out["dense"].log_softmax(-1), log_target=True,
                                  reduction="sum"))
        if rec is not None:
            out["oracle"] = ref.forward(ids, ref.new_cache(), OracleHooks(rec.masks))[:-1]
            oracle_diff = max(oracle_diff, float((out["oracle"] - out["dense"]).abs().max()))
        top = out["dense"].argmax(-1)
        for k, logits in out.items():
            nll[k] += _nll(logits, ids[1:])
            agree[k] += int((logits.argmax(-1) == top).sum())
        n += len(window) - 1
    if n == 0:
        raise ValueError(f"the text gave no window of {seq_len} tokens: pass more text (or a smaller seq_len)")
    ppl = {k: math.exp(v / n) for k, v in nll.items()}
    r: dict[str, Any] = {"model": str(model_path), "tokens": n, "seq_len": seq_len, "stream": fmt.describe(),
                         "ppl_dense": ppl["dense"]}
    if hooks is None:
        return r
    layers = hooks.stats(ref.cfg.n_ff)
    r.update({"threshold": hooks.threshold, "margin": margin, "ppl_sparse": ppl["sparse"],
              "ppl_ratio": ppl["sparse"] / ppl["dense"], "top1_agreement": agree["sparse"] / n, "kl": kl / n,
              "sparsity": 1 - sum(s["kept"] for s in layers) / len(layers), "layers": layers})
    if oracle:
        r.update({"ppl_oracle": ppl["oracle"], "oracle_top1_agreement": agree["oracle"] / n,
                  "oracle_max_abs_logit_diff": oracle_diff})
    return r


def format_report(r: dict[str, Any]) -> str:
    head = f"{r['tokens']} tokens ({r['stream']}, windows of {r['seq_len']}): perplexity dense {r['ppl_dense']:.4f}"
    if "ppl_sparse" not in r:
        return head + " (the model has no predictors)"
    oracle = (f"; oracle {r['ppl_oracle']:.4f}, max |logit diff| {r['oracle_max_abs_logit_diff']:.2e}"
              if "ppl_oracle" in r else "")
    lines = [head + f", sparse {r['ppl_sparse']:.4f} ({100 * (r['ppl_ratio'] - 1):+.3f} %); top-1 agreement "
             f"{100 * r['top1_agreement']:.2f} %; KL {r['kl']:.5f} nats/token; sparsity {100 * r['sparsity']:.2f} %"
             + oracle,
             f"{'layer':>5} {'threshold':>9} {'recall':>7} {'mass rec.':>9} {'precision':>9} {'kept %':>7} {'active %':>8}"]
    for s in r["layers"]:
        lines.append(f"{s['layer']:>5} {s['threshold']:>9.3f} {s['recall']:>7.4f} {s['mass_recall']:>9.5f} "
                     f"{s['precision']:>9.3f} {100 * s['kept']:>7.2f} {100 * s['active']:>8.2f}")
    return "\n".join(lines)
