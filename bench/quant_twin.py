#!/usr/bin/env python3
"""Does a Q4_0 file compute its own weights? The embedded model in upstream's Q4_0 layout, written
by gguf-py, beside its twin: the same Q4_0 weights dequantized to F32. The two files stand for the
same model; where the engine multiplies Q4_0 rows on the CPU it rounds the activation x to Q8_0
first (ggml's ``vec_dot_q4_0_q8_0``), which the twin's float rows never do. Everything else
should be equal.

    PYTHONPATH=. python3 bench/quant_twin.py [--device cpu|cuda] [--dtype f32|f16|bf16|default]
        [--max-tokens 4096] [--seq-len 256] [--batch 16] [--greedy 32] [--reference] [-o bench/results]

Through the in-process engine (``LocalEngine``), teacher-forced over windows of the held-out text
(decode steps of ``--batch`` windows at once, every position's logits), for two placements:
``primary`` (every FFN row on the primary executor: the GPU with --device cuda) and
``cpu-executor`` (every FFN row on the CPU executor, the attention, head and predictors on the
primary). Per placement, for the pairs (twin, q4) (x's rounding), (f16, twin) (what Q4_0 weights
cost, for scale) and (f16, q4): top-1 agreement of the next-token argmax and the mean
KL(first || second) of the next-token distributions in nats, with each file's perplexity. Greedy:
``--greedy`` prompts (the windows' first 16 tokens) continued 12 tokens by each file; at the first
token where the q4 file's text leaves the twin's, the gap between the twin's top two logits.

``--reference`` adds the float64 decomposition (the dense forward with the file's predictors,
no kernels): the twin, and the q4 file with x rounded to Q8_0 (the CPU kernels' rounding:
``tests/quant_models.KernelReference``) at each site alone (attention q/k/v and o, FFN up and
gate, the head, the predictors' fc1 and fc2) and at all of them; and each engine run of the q4
file against the reference that rounds where that run rounds: per window, the first position off
by more than 1e-4 in a logit, how far off it was before, and the closest rounding tie at that step
(the relative margin of a Q8_0 decision) and the predictors' closest logit to their threshold.

Writes bench/results/quant-twin-<machine>.json (``--name``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from model_bench import write_results  # noqa: E402
from quant_models import SITES, KernelPredictorHooks, KernelReference  # noqa: E402  (the kernels' float64 reference)

from powerinfer_ray.model import gguf_keys as K  # noqa: E402
from powerinfer_ray.model.default import default_model_path  # noqa: E402
from powerinfer_ray.model.gguf_file import ModelFile  # noqa: E402
from powerinfer_ray.model.tokenizer import Tokenizer  # noqa: E402
from powerinfer_ray.offline.corpus import iter_texts  # noqa: E402
from powerinfer_ray.offline.stream import token_windows  # noqa: E402
from powerinfer_ray.runtime.plan import Plan  # noqa: E402

PLACEMENTS = ("primary", "cpu-executor")
PAIRS = (("twin", "q4"), ("f16", "twin"), ("f16", "q4"))
PROMPT, GREEDY = 16, 12  # greedy: prompt tokens, tokens generated
OFF = 1e-4  # a logit this far from the reference's: the engine has left it


# ------------------------------------------------------------------------------------------------
# the two files
# ------------------------------------------------------------------------------------------------
def write_twins(src: Path, folder: Path) -> dict[str, Path]:
    """``q4``: src's matrices as gguf-py's Q4_0 blocks (every 2-D tensor whose rows are whole
    blocks: token_embd, attention, FFN, predictors; upstream's layout of a tied-head model), the
    rest F32; ``twin``: the same with each Q4_0 tensor dequantized by gguf-py to F32. Metadata
    and the PWRI magic as src's."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType
    from gguf import quants as gq
    from gguf.gguf_writer import GGUFValue

    from powerinfer_ray.model.gguf_file import open_gguf
    from powerinfer_ray.model.gguf_writer import LazyTensor, write_gguf
    from powerinfer_ray.offline.quantize import copied_fields

    reader = open_gguf(src)
    fields = copied_fields(reader)
    arch = str(fields.pop(K.ARCH).value)
    q4, twin = [], []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        x = gq.dequantize(np.array(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) != 2 or shape[-1] % 32:
            q4.append((t.name, x, "f32"))
            twin.append((t.name, x, "f32"))
            continue
        blocks = gq.quantize(x, T.Q4_0)
        q4.append((t.name, LazyTensor(shape, "q4_0", lambda b=blocks: b), "q4_0"))
        twin.append((t.name, LazyTensor(shape, "f32", lambda b=blocks, s=shape: gq.dequantize(b, T.Q4_0).reshape(s)),
                     "f32"))
    out = {"q4": folder / "tiny-reglu.q4_0.gguf", "twin": folder / "tiny-reglu.q4_0-twin.f32.gguf"}
    for (key, tensors), file_type in zip((("q4", q4), ("twin", twin)), (2, 0)):  # llama.cpp's MOSTLY_Q4_0, ALL_F32
        write_gguf(out[key], arch, {**fields, K.FILE_TYPE: GGUFValue(file_type, GGUFValueType.UINT32)}, tensors)
        if src.open("rb").read(4) == K.PWRI_MAGIC:
            with out[key].open("r+b") as fh:
                fh.write(K.PWRI_MAGIC)
    return out


# ------------------------------------------------------------------------------------------------
# through the engine
# ------------------------------------------------------------------------------------------------
def placement_plan(cfg: Any, placement: str) -> Plan:  # noqa: ANN401
    if placement == "primary":
        return Plan.all_gpu(cfg)
    return Plan.from_masks([np.zeros(cfg.n_ff, bool)] * cfg.n_layer, None, cfg)  # heads stay on the primary


def engine_steps(path: Path, placement: str, rows: list[list[int]], batch: int, device: str, dtype: str | None,
                 free: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Decode steps of ``batch`` sequences at a time through a LocalEngine: each row's tokens fed
    one a step (teacher-forced), then ``free`` tokens of its own argmax. Returns the logits of
    every step [n_rows, steps, V] (float32) and the tokens generated [n_rows, free]."""
    from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine

    cfg = ModelFile(path).config
    n = len(rows[0])
    steps = n + max(free - 1, 0)
    eng = LocalEngine(EngineConfig(str(path), plan=placement_plan(cfg, placement), device=device, dtype=dtype,
                                   max_batch=batch, prefill_chunk=batch))
    logits = np.empty((len(rows), steps, cfg.n_vocab), np.float32)
    gen = np.empty((len(rows), free), np.int64)
    try:
        for b0 in range(0, len(rows), batch):
            seqs = [list(r) for r in rows[b0:b0 + batch]]
            slots = list(range(len(seqs)))
            for p in range(steps):
                out = eng.primary.step(slots, [[s[p]] for s in seqs], [p] * len(seqs))  # [B, V]
                logits[b0:b0 + len(seqs), p] = out
                if free and p >= n - 1:
                    for s, t in zip(seqs, out.argmax(-1)):
                        s.append(int(t))
            gen[b0:b0 + len(seqs)] = [s[n:n + free] for s in seqs]
    finally:
        eng.close()
    return logits, gen


def agreement(p: np.ndarray, q: np.ndarray) -> dict[str, float]:
    """Top-1 agreement and mean KL(p || q) in nats of logits p, q [N, V]."""
    lp = torch.log_softmax(torch.from_numpy(p).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(q).double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # [N]
    return {"top1": float((p.argmax(-1) == q.argmax(-1)).mean()), "kl": float(kl.mean()),
            "kl_max": float(kl.max())}


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    lp = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    return math.exp(-float(lp.gather(-1, torch.from_numpy(targets)[:, None]).mean()))


def greedy_report(runs: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """How often the q4 file's greedy text is the twin's, and at the first token where it is not,
    the twin's top-1 minus top-2 logit (its own run: both saw the same tokens up to there)."""
    (lt, gt), (_, gq) = runs["twin"], runs["q4"]
    gaps = []
    for i in range(len(gt)):
        k = int(np.argmax(gt[i] != gq[i])) if (gt[i] != gq[i]).any() else None
        if k is not None:
            top2 = np.sort(lt[i, PROMPT - 1 + k])[-2:]
            gaps.append({"prompt": i, "token": k, "twin_top2_gap": float(top2[1] - top2[0])})
    return {"prompts": len(gt), "tokens": GREEDY, "matched": len(gt) - len(gaps), "diverged": gaps}


def engine_part(paths: dict[str, Path], windows: list[list[int]], a: argparse.Namespace) -> tuple[dict, dict]:
    """Per placement: the pairs' agreement and each file's perplexity; the q4 runs' logits."""
    inputs = [w[:-1] for w in windows]
    targets = np.array([w[1:] for w in windows]).reshape(-1)
    prompts = [w[:PROMPT] for w in windows[:a.greedy]]
    dtype = None if a.dtype == "default" else a.dtype
    results, q4_logits = {}, {}
    for placement in PLACEMENTS:
        logits, greedy, seconds = {}, {}, {}
        for name in ("f16", "twin", "q4"):
            t0 = time.perf_counter()
            lg, _ = engine_steps(paths[name], placement, inputs, a.batch, a.device, dtype)
            logits[name] = lg.reshape(-1, lg.shape[-1])
            if a.greedy and name != "f16":
                greedy[name] = engine_steps(paths[name], placement, prompts, a.batch, a.device, dtype, free=GREEDY)
            seconds[name] = round(time.perf_counter() - t0, 1)
        r = {f"{x}_vs_{y}": agreement(logits[x], logits[y]) for x, y in PAIRS}
        r["ppl"] = {k: perplexity(v, targets) for k, v in logits.items()}
        r["greedy"] = greedy_report(greedy) if greedy else None
        r["seconds"] = seconds
        results[placement] = r
        q4_logits[placement] = logits["q4"]
        print(placement, {k: v for k, v in r.items() if k != "greedy"}, flush=True)
    return results, q4_logits


# ------------------------------------------------------------------------------------------------
# the float64 decomposition
# ------------------------------------------------------------------------------------------------
class ClosestHooks(KernelPredictorHooks):
    """The predictors as the runtime computes them (``quant_models.KernelPredictorHooks``), keeping
    per layer the distance of every token's closest logit to the threshold (``closest``: [T] each)."""

    def __init__(self, ref: KernelReference) -> None:
        super().__init__(ref)
        self.closest: list[torch.Tensor] = []

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        lg = self.logits(l, pred_in)  # [T, F]
        self.closest.append((lg - self.threshold).abs().min(-1).values)
        return lg >= self.threshold


def reference(path: Path, sites: tuple[str, ...]) -> tuple[KernelReference, ClosestHooks]:
    """The float64 forward of the file's exact weights with x rounded to Q8_0 before the products
    of ``sites`` (``KernelReference.rounding_at``), and its predictors."""
    ref = KernelReference.from_file(path).rounding_at(sites)
    return ref, ClosestHooks(ref)


def reference_logits(ref: KernelReference, hooks: ClosestHooks, windows: list[list[int]]) -> np.ndarray:
    return np.concatenate([ref.forward(w[:-1], ref.new_cache(), hooks).numpy() for w in windows])


def engine_sites(device: str, placement: str) -> tuple[str, ...]:
    """Where an engine run of the q4 file rounds x: every product of a CPU primary; on a CUDA
    primary only the CPU executor's FFN rows."""
    if device == "cpu":
        return tuple(SITES)
    return ("ffn",) if placement == "cpu-executor" else ()


def divergence(ref: KernelReference, hooks: ClosestHooks, window: list[int], got: np.ndarray) -> dict[str, Any]:
    """Where the engine's logits got [T, V] of a window leave the reference's, and the closest
    rounding decisions at that step."""
    hooks.closest = []
    want = ref.forward(window[:-1], ref.new_cache(), hooks).numpy()
    d = np.abs(got - want).max(-1)  # [T]
    if not (d > OFF).any():
        return {"first_off": None, "max_diff": float(d.max())}
    p = int(np.argmax(d > OFF))
    ties = [m for m, key in ref.ties if key[1] == p]
    return {"first_off": p, "diff_before": float(d[:p].max()) if p else 0.0, "diff_at": float(d[p]),
            "closest_tie": min(ties) if ties else None,
            "closest_predictor_logit": float(min(c[p] for c in hooks.closest))}


def reference_part(paths: dict[str, Path], windows: list[list[int]], q4_logits: dict[str, np.ndarray],
                   device: str) -> dict[str, Any]:
    base = reference_logits(*reference(paths["twin"], ()), windows)
    out: dict[str, Any] = {"sites": {}}
    for sites in [()] + [(s,) for s in SITES] + [tuple(SITES)]:
        lg = reference_logits(*reference(paths["q4"], sites), windows)
        out["sites"]["+".join(sites) or "none"] = agreement(base, lg)
        print("reference, x rounded at", sites or "none", out["sites"]["+".join(sites) or "none"], flush=True)
    T = len(windows[0]) - 1
    out["engine_vs_reference"] = {}
    for placement, lg in q4_logits.items():
        sites = engine_sites(device, placement)
        ref, hooks = reference(paths["q4"], sites)
        per = [divergence(ref, hooks, w, lg[i * T:(i + 1) * T]) for i, w in enumerate(windows)]
        out["engine_vs_reference"][placement] = {"rounded_at": list(sites), "windows": per}
    return out


# ------------------------------------------------------------------------------------------------
def default_name(device: str) -> str:
    if device == "cuda":
        return "quant-twin-" + torch.cuda.get_device_name(0).split()[-1].lower()
    return f"quant-twin-cpu-{os.cpu_count()}c"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the primary executor's device")
    ap.add_argument("--dtype", choices=("f32", "f16", "bf16", "default"), default="f32",
                    help="the primary's float type, both files (default: each file's own default: on CUDA f16 "
                         "beside Q4_0 blocks, f32 for the F32 twin)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out window tokens")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="windows per decode step")
    ap.add_argument("--greedy", type=int, default=32,
                    help="prompts continued greedily: the first windows' first 16 tokens (0: none)")
    ap.add_argument("--reference", action="store_true", help="add the float64 decomposition (CPU, minutes)")
    ap.add_argument("-o", "--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default=None, help="results file name (default: quant-twin-<machine>)")
    a = ap.parse_args(argv)
    src = default_model_path()
    tok = Tokenizer(ModelFile(src).fields)
    windows = list(token_windows(tok, iter_texts("builtin:heldout"), a.seq_len, a.max_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"f16": src, **write_twins(src, Path(tmp))}
        results, q4_logits = engine_part(paths, windows, a)
        decomposition = reference_part(paths, windows, q4_logits, a.device) if a.reference else None
    command = " ".join(["python3", "bench/quant_twin.py", *(argv or sys.argv[1:])])
    write_results(a.out_dir, a.name or default_name(a.device), command,
                  what="the embedded model as gguf-py's Q4_0 file (q4) beside its F32 twin (the same weights "
                       "dequantized) and its f16 original, teacher-forced through the engine over held-out windows: "
                       "top-1 agreement and mean KL(first || second) in nats per placement of the FFN rows",
                  model=src.name, device=a.device, dtype=a.dtype, positions=len(windows) * (a.seq_len - 1),
                  windows=len(windows), seq_len=a.seq_len, results=results, reference=decomposition)
    return 0


if __name__ == "__main__":
    sys.exit(main())
