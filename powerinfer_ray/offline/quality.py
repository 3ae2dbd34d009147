"""How much the predictors cost in quality, on the reference path (no Ray, no kernels).

On held-out text, three forwards of each window: dense; sparse with the predictors' masks
(neuron computed iff its logit >= threshold); and sparse with the oracle mask (exactly the
neurons the dense forward found active), which must equal dense up to floating point. Reported:
next-token top-1 agreement of sparse with dense, perplexity of each, the predictors' recall,
precision and kept share per layer, and the oracle's largest logit difference.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as Fn

from ..model.gguf_file import ModelFile
from ..model.reference import ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts, token_windows
from .predictors import PredictorHooks


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


def _is_plain_text(text: Corpus) -> bool:
    """A str that names no corpus (no 'builtin...' word, no existing file) is the text itself."""
    if not isinstance(text, str):
        return False
    if text.startswith("builtin") or ("\n" not in text and len(text) < 1024 and Path(text).exists()):
        return False
    return True


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(Fn.cross_entropy(logits.float(), targets, reduction="sum"))


@torch.no_grad()
def quality_report(model_path: str | Path, text: Corpus, seq_len: int = 256, max_tokens: int = 4096,
                   device: str | torch.device = "cpu", threshold: float | None = None) -> dict[str, Any]:
    """Dense vs predictor-sparse vs oracle-sparse forwards over windows of ``text`` (a string,
    or any corpus ``iter_texts`` reads) of the model at ``model_path``."""
    mf = ModelFile(model_path)
    ref = ReferenceModel.from_file(mf, device=device)
    tok = Tokenizer(mf.fields)
    hooks = PredictorHooks.from_file(mf, device=device, threshold=threshold)
    texts = [text] if _is_plain_text(text) else iter_texts(text)
    seq_len = min(seq_len, ref.cfg.n_ctx)
    nll = {"dense": 0.0, "sparse": 0.0, "oracle": 0.0}
    agree = oracle_agree = n = 0
    oracle_diff = 0.0
    for window in token_windows(tok.encode, texts, seq_len + 1, max_tokens + max_tokens // seq_len):
        inp = window[:-1]
        tgt = torch.tensor(window[1:], device=ref.device)
        rec = RecordHooks()
        dense = ref.forward(inp, ref.new_cache(), rec)  # [T, V]
        sparse = ref.forward(inp, ref.new_cache(), hooks)
        oracle = ref.forward(inp, ref.new_cache(), OracleHooks(rec.masks))
        for name, logits in (("dense", dense), ("sparse", sparse), ("oracle", oracle)):
            nll[name] += _nll(logits, tgt)
        agree += int((dense.argmax(-1) == sparse.argmax(-1)).sum())
        oracle_agree += int((dense.argmax(-1) == oracle.argmax(-1)).sum())
        oracle_diff = max(oracle_diff, float((dense - oracle).abs().max()))
        n += len(inp)
    if n == 0:
        raise ValueError(f"text gave no window of {seq_len + 1} tokens: pass more text")
    ppl = {k: math.exp(v / n) for k, v in nll.items()}
    return {
        "model": str(model_path), "tokens": n, "seq_len": seq_len, "threshold": hooks.threshold,
        "ppl_dense": ppl["dense"], "ppl_sparse": ppl["sparse"], "ppl_oracle": ppl["oracle"],
        "ppl_ratio": ppl["sparse"] / ppl["dense"],
        "top1_agreement": agree / n, "oracle_top1_agreement": oracle_agree / n,
        "oracle_max_abs_logit_diff": oracle_diff,
        "layers": hooks.stats(ref.cfg.n_ff),
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['tokens']} held-out tokens: perplexity dense {r['ppl_dense']:.3f}, sparse "
             f"{r['ppl_sparse']:.3f} ({100 * (r['ppl_ratio'] - 1):+.2f} %), oracle {r['ppl_oracle']:.3f}; "
             f"top-1 agreement {100 * r['top1_agreement']:.2f} %; oracle max |logit diff| "
             f"{r['oracle_max_abs_logit_diff']:.2e}",
             f"{'layer':>5} {'recall':>7} {'precision':>9} {'kept %':>7} {'active %':>8}"]
    for l, s in enumerate(r["layers"]):
        lines.append(f"{l:>5} {s['recall']:>7.4f} {s['precision']:>9.3f} {100 * s['kept']:>7.2f} "
                     f"{100 * s['active']:>8.2f}")
    return "\n".join(lines)
