"""Where a SwiGLU model's |SiLU(gate)| > t activations lie: SiLU's positive branch (SiLU(g) > t)
or its negative band (SiLU(g) < -t, g between about -2.6 and -0.5 for t = 0.2; SiLU's minimum
is -0.278). A predictor learns gate > b with one cut per neuron; a band needs two. Beside it, the
quality of the one-cut criterion SiLU(gate) > t (the positive branch only) at the same sparsity:
perplexity and top-1 agreement against dense, as for |SiLU(gate)| > t.

    OMP_NUM_THREADS=1 python bench/swiglu_lobes.py     # -> bench/results/swiglu-lobes-tiny.json

The trained tiny SwiGLU model, sparsified on |SiLU(gate)| at each target (calibrated on the
train split, as bench/swiglu_quality.py does), gate values of held-out windows per layer.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from model_bench import commit, machine  # noqa: E402

from powerinfer_ray.model.gguf_file import ModelFile  # noqa: E402
from powerinfer_ray.model.reference import ReferenceModel  # noqa: E402
from powerinfer_ray.model.tokenizer import Tokenizer  # noqa: E402
from powerinfer_ray.offline.corpus import iter_texts  # noqa: E402
from powerinfer_ray.offline.quality import Evaluator  # noqa: E402
from powerinfer_ray.offline.sparsify import sparsify  # noqa: E402
from powerinfer_ray.offline.stream import token_windows  # noqa: E402
from powerinfer_ray.offline.train_tiny import trained_swiglu_path  # noqa: E402


class GateHooks:
    """Collects each layer's dense gate values [T, F]; with ``cut`` (per layer t, signed: > 0 keeps
    SiLU(g) > t, absolute=True keeps |SiLU(g)| > t) it also masks the FFN by that criterion."""

    def __init__(self, ref: ReferenceModel, cut: list[float] | None = None, absolute: bool = False) -> None:
        self.ref, self.gates, self.cut, self.absolute = ref, {}, cut, absolute

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor | None:
        _, gate, _ = self.ref.ffn_pre(l, self.ref.ffn_input(l, pred_in))
        if self.cut is None:
            self.gates.setdefault(l, []).append(gate)
            return None
        s = F.silu(gate)
        return (s.abs() if self.absolute else s) > self.cut[l]

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="0.3,0.4,0.5,0.6")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "bench/results/swiglu-lobes-tiny.json"))
    ap.add_argument("--workdir", default="/tmp")
    a = ap.parse_args()
    src = trained_swiglu_path()
    rows = []
    for target in (float(t) for t in a.targets.split(",")):
        path = Path(a.workdir) / f"swiglu-lobes-{target}.gguf"
        sparsify(src, "builtin:train", path, target, "gate", max_tokens=a.calib_tokens, seq_len=128,
                 log=lambda s: None)
        mf = ModelFile(path)
        ref, thr = ReferenceModel.from_file(mf, thresholded=False), list(mf.config.ffn_thresholds)
        tok = Tokenizer(mf.fields)
        seq = mf.config.n_ctx
        calib = GateHooks(ref)  # the one-cut criterion's t per layer: the same active share on the train split
        for w in token_windows(tok, iter_texts("builtin:train"), seq, a.calib_tokens):
            ref.forward(w, ref.new_cache(), hooks=calib)
        pos_cut = [float(torch.quantile(F.silu(torch.cat(calib.gates[l])).flatten()[:1 << 22], target))
                   for l in sorted(calib.gates)]
        ev = Evaluator(ref, token_windows(tok, iter_texts("builtin:heldout"), seq, a.eval_tokens))
        hooks = GateHooks(ref)
        for ids in ev.windows:
            ref.forward(ids, ref.new_cache(), hooks=hooks)
        scores = {name: ev.score(GateHooks(ref, cut, absolute)) for name, cut, absolute in
                  (("abs", thr, True), ("positive", pos_cut, False))}
        quality = {f"{name}_{k}": v for name, sc in scores.items()
                   for k, v in (("ppl_delta_pct", 100 * (sc.ppl / ev.dense.ppl - 1)), ("top1", sc.top1))}
        print(f"target {target}: |SiLU(g)| > t ppl {quality['abs_ppl_delta_pct']:+.2f} % top-1 {quality['abs_top1']:.3f}; "
              f"SiLU(g) > t ppl {quality['positive_ppl_delta_pct']:+.2f} % top-1 {quality['positive_top1']:.3f}")
        for l in sorted(hooks.gates):
            s = F.silu(torch.cat(hooks.gates[l]))  # [T, F]
            pos, neg = (s > thr[l]).float().mean().item(), (s < -thr[l]).float().mean().item()
            rows.append({"target": target, "layer": l, "threshold": thr[l], "tokens": s.shape[0],
                         "active": pos + neg, "positive": pos, "negative_band": neg,
                         "band_share_of_active": neg / (pos + neg) if pos + neg else 0.0,
                         "positive_cut": pos_cut[l],
                         "positive_cut_active": (s > pos_cut[l]).float().mean().item(), **quality})
            print(f"target {target} layer {l}: t={thr[l]:.3f} active {pos + neg:.3f} = positive {pos:.3f} "
                  f"+ negative band {neg:.3f} (band: {neg / max(pos + neg, 1e-9):.0%} of active)")
    out = {"what": "where |SiLU(gate)| > t activations lie (positive branch vs negative band), trained tiny "
                   "SwiGLU model, held-out text", "machine": machine(), "commit": commit(),
           "command": "OMP_NUM_THREADS=1 python bench/swiglu_lobes.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "records": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
