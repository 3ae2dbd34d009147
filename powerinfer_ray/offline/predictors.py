"""Activation predictors: per layer, a small MLP that guesses which FFN neurons will fire.

The predictor of layer l maps the predictor input x [D] (the residual before the FFN norm;
the layer input for falcon) to one logit per neuron: ``fc2 @ relu(fc1 @ x)`` with fc1 [r, D],
fc2 [F, r] and no biases (upstream PowerInfer's layout); neuron j is computed iff its logit
>= ``powerinfer.sparse_threshold`` (0 here).

``train_predictors`` collects (x, activation) pairs from the dense reference over a corpus
(each neuron's activation as a one-byte code of its contribution |h| * ||down row||, 0 when
inactive; spilled to Arrow IPC shards on disk beyond a memory cap), trains each layer with
class-weighted BCE (active neurons weighted up, and more so the ones that move the output
most), sizes each layer's width adaptively and writes a new GGUF with the predictors.
Recall alone is the wrong objective (upstream issue #124: a predictor that marks everything
active has recall 1): each width's precision and predicted sparsity are measured on held-out
tokens, and the chosen width is the smallest one that reaches the recall target with a
predicted sparsity close to the best any tried width reached.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as Fn

from ..model import gguf_keys as K
from ..model.gguf_file import ModelFile
from ..model.gguf_writer import LazyTensor, write_model
from ..model.reference import ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts, token_windows

THRESHOLD = 0.0
MIN_WIDTH = 16
WIDTH_STEP = 16  # widths are multiples of 16 (kernel-friendly)


# ------------------------------------------------------------------------------------------------
# the predictor at inference (reference path)
# ------------------------------------------------------------------------------------------------
class PredictorHooks:
    """FFNHooks whose mask is the predictors' guess (logit >= threshold); records per layer
    how many neurons it kept and, through ``observe``, recall and precision against the truth."""

    def __init__(self, fc1: list[torch.Tensor], fc2: list[torch.Tensor], threshold: float = THRESHOLD) -> None:
        self.fc1, self.fc2, self.threshold = fc1, fc2, threshold
        n = len(fc1)
        self.tp, self.fp, self.fn, self.tokens = [0] * n, [0] * n, [0] * n, [0] * n
        self._last: dict[int, torch.Tensor] = {}

    @classmethod
    def from_file(cls, path: str | Path | ModelFile, device: str | torch.device = "cpu",
                  threshold: float | None = None) -> "PredictorHooks":
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        cfg = mf.config
        if not cfg.has_predictors:
            raise ValueError(f"{mf.path}: the model has no predictors (tensors {K.tensor(K.FC1, 0)!r}...)")
        fc1 = [mf.layer(K.FC1, l, dtype=torch.float32, device=device) for l in range(cfg.n_layer)]
        fc2 = [mf.layer(K.FC2, l, dtype=torch.float32, device=device) for l in range(cfg.n_layer)]
        thr = threshold if threshold is not None else (cfg.sparse_threshold or THRESHOLD)
        return cls(fc1, fc2, thr)

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> logits [T, F]."""
        w1, w2 = self.fc1[layer], self.fc2[layer]
        return torch.relu(x.to(w1.dtype) @ w1.T) @ w2.T

    def mask(self, layer: int, pred_in: torch.Tensor) -> torch.Tensor:
        m = self.logits(layer, pred_in) >= self.threshold  # [T, F]
        self._last[layer] = m
        return m

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        m, truth = self._last.pop(layer), h != 0
        self.tp[layer] += int((m & truth).sum())
        self.fp[layer] += int((m & ~truth).sum())
        self.fn[layer] += int((~m & truth).sum())
        self.tokens[layer] += int(h.shape[0])

    def stats(self, n_ff: int) -> list[dict[str, float]]:
        """Per layer: recall, precision and the share of neurons kept, over what it saw."""
        out = []
        for l in range(len(self.fc1)):
            tp, fp, fn, t = self.tp[l], self.fp[l], self.fn[l], max(self.tokens[l], 1)
            out.append({"recall": tp / max(tp + fn, 1), "precision": tp / max(tp + fp, 1),
                        "kept": (tp + fp) / (t * n_ff), "active": (tp + fn) / (t * n_ff)})
        return out


# ------------------------------------------------------------------------------------------------
# training samples: memory up to a cap, then Arrow IPC shards
# ------------------------------------------------------------------------------------------------
# An activation is stored as a one-byte code of its contribution c = |h_j| * ||down_t[j]||
# (how far it moves the layer output): 0 = inactive, else 1 + 8 log2(c) + 127 clipped to
# 1..255, i.e. 8 steps per octave over 2^-16..2^16. The mask is code > 0; the magnitudes weight
# the loss so that the misses that remain are the activations that matter least.
_CODE_STEPS, _CODE_ZERO = 8.0, 128.0


def encode_magnitude(c: torch.Tensor) -> torch.Tensor:
    """Contributions c [T, F] (0 where inactive) -> uint8 codes [T, F]."""
    q = (torch.log2(c.clamp_min(1e-30)) * _CODE_STEPS + _CODE_ZERO).round().clamp(1, 255)
    return torch.where(c > 0, q, torch.zeros_like(q)).to(torch.uint8)


def decode_magnitude(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> contributions (0 where inactive), float32."""
    c = torch.exp2((q.float() - _CODE_ZERO) / _CODE_STEPS)
    return torch.where(q > 0, c, torch.zeros_like(c))


class SampleStore:
    """Per-layer samples (x [D] float32, activation code [F] uint8). Buffers in memory until all
    layers together exceed ``memory_cap`` bytes, then writes the largest layer's buffer as an
    Arrow IPC shard (columns x, code) under ``spill_dir``."""

    def __init__(self, n_layer: int, n_embd: int, n_ff: int, memory_cap: int = 1 << 30,
                 spill_dir: str | Path | None = None) -> None:
        self.n_layer, self.D, self.F = n_layer, n_embd, n_ff
        self.memory_cap = memory_cap
        self._spill_root = Path(spill_dir) if spill_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.buf: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_layer)]
        self.buf_bytes = [0] * n_layer
        self.shards: list[list[Path]] = [[] for _ in range(n_layer)]
        self.counts = [0] * n_layer
        self.active = np.zeros((n_layer, n_ff), dtype=np.int64)
        self.mass = np.zeros(n_layer)  # sum of decoded contributions, for the mean

    # --- writing ------------------------------------------------------------------------------
    def add(self, layer: int, x: torch.Tensor, code: torch.Tensor) -> None:
        """x [T, D]; code [T, F] uint8 (``encode_magnitude``) or bool (active, magnitude 1)."""
        if code.dtype == torch.bool:
            code = code.to(torch.uint8) * int(_CODE_ZERO)
        xa = x.detach().float().cpu().numpy()
        qa = code.detach().cpu().numpy()
        self.active[layer] += (qa > 0).sum(0)
        self.mass[layer] += float(decode_magnitude(code.detach()).sum())
        self.buf[layer].append((xa, qa))
        self.buf_bytes[layer] += xa.nbytes + qa.nbytes
        self.counts[layer] += xa.shape[0]
        while sum(self.buf_bytes) > self.memory_cap:
            self._spill(int(np.argmax(self.buf_bytes)))

    def mean_magnitude(self, layer: int) -> float:
        return float(self.mass[layer] / max(self.active[layer].sum(), 1))

    @property
    def spill_dir(self) -> Path:
        if self._spill_root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="predictor-samples-")
            self._spill_root = Path(self._tmp.name)
        self._spill_root.mkdir(parents=True, exist_ok=True)
        return self._spill_root

    def _spill(self, layer: int) -> None:
        import pyarrow as pa

        x, q = self._concat(layer)
        path = self.spill_dir / f"layer{layer}_shard{len(self.shards[layer])}.arrow"
        batch = pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), self.D),
                                 pa.FixedSizeListArray.from_arrays(pa.array(q.reshape(-1)), self.F)],
                                names=["x", "code"])
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        self.shards[layer].append(path)
        self.buf[layer], self.buf_bytes[layer] = [], 0

    def _concat(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        parts = self.buf[layer]
        if not parts:
            return np.zeros((0, self.D), np.float32), np.zeros((0, self.F), np.uint8)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _read_shard(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        import pyarrow as pa

        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, self.D)
        q = table.column("code").combine_chunks().flatten().to_numpy().reshape(-1, self.F)
        return x.copy(), q.copy()

    # --- reading ------------------------------------------------------------------------------
    def spilled(self, layer: int) -> bool:
        return bool(self.shards[layer])

    def chunks(self, layer: int, rng: np.random.Generator | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(x [N, D], code [N, F]) chunks: each shard, then the memory buffer; shard order
        shuffled when ``rng`` is given."""
        order = list(range(len(self.shards[layer])))
        if rng is not None:
            rng.shuffle(order)
        for i in order:
            yield self._read_shard(self.shards[layer][i])
        if self.buf[layer]:
            yield self._concat(layer)

    def all(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Every sample of a layer: x [N, D] float32, code [N, F] uint8 (loads shards)."""
        parts = list(self.chunks(layer)) or [self._concat(layer)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        for shards in self.shards:
            for p in shards:
                p.unlink(missing_ok=True)


class _CollectHooks:
    """Observe (predictor input, activation codes) into a store; ``down_norms[l]`` [F] are the
    row norms of layer l's ffn_down_t."""

    def __init__(self, store: SampleStore, down_norms: list[torch.Tensor]) -> None:
        self.store, self.down_norms = store, down_norms

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.store.add(layer, pred_in, encode_magnitude(h.abs().float() * self.down_norms[layer]))


def collect_samples(ref: ReferenceModel, tok: Tokenizer, corpus: Corpus, max_tokens: int, seq_len: int,
                    train: SampleStore, held: SampleStore, eval_every: int = 10,
                    progress: bool = False) -> None:
    """Run the reference over windows of ``corpus``; every ``eval_every``-th window's samples
    go to ``held`` (held-out tokens for measuring recall), the rest to ``train``."""
    norms = [ref.w[K.tensor(K.FFN_DOWN_T, l)].float().norm(dim=1) for l in range(ref.cfg.n_layer)]
    hooks = (_CollectHooks(train, norms), _CollectHooks(held, norms))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_tokens, desc="collecting activations", unit="tok", unit_scale=True)
    for i, window in enumerate(token_windows(tok.encode, iter_texts(corpus), seq_len, max_tokens)):
        ref.forward(window, ref.new_cache(), hooks[i % eval_every == eval_every - 1])
        if bar is not None:
            bar.update(len(window))
    if bar is not None:
        bar.close()


# ------------------------------------------------------------------------------------------------
# training one layer
# ------------------------------------------------------------------------------------------------
@dataclass
class FitSettings:
    epochs: int = 10
    batch: int = 1024
    lr: float = 3e-3
    weight_decay: float = 0.0
    recall_target: float = 0.95
    recall_margin: float = 0.01  # aim this far above the target on the held-out split
    magnitude_power: float = 0.5  # positive weight ~ (contribution / mean) ** power; 0: plain
    max_rounds: int = 6  # pos_weight raises to reach the target
    round_epochs: int = 3
    seed: int = 0


@dataclass
class Trial:
    """One trained width: measured on held-out tokens with the fp16-rounded weights."""

    width: int
    recall: float
    precision: float
    pred_sparsity: float
    true_sparsity: float
    pos_weight: float
    rounds: int
    seconds: float
    fc1: torch.Tensor = field(repr=False)  # [r, D]
    fc2: torch.Tensor = field(repr=False)  # [F, r]
    mass_recall: float = 1.0  # share of the activations' contribution the kept neurons carry

    def meets(self, target: float) -> bool:
        return self.recall >= target

    def row(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k not in ("fc1", "fc2")}


class LayerData:
    """Training batches of one layer as device tensors (all resident, or chunk by chunk)."""

    def __init__(self, store: SampleStore, layer: int, device: torch.device) -> None:
        self.store, self.layer, self.device = store, layer, device
        self.n = store.counts[layer]
        self.mean_magnitude = store.mean_magnitude(layer)
        self.resident: tuple[torch.Tensor, torch.Tensor] | None = None
        if not store.spilled(layer):
            x, q = store.all(layer)
            self.resident = (torch.from_numpy(x).to(device), torch.from_numpy(q).to(device))

    def batches(self, batch: int, gen: torch.Generator, rng: np.random.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        chunks = [self.resident] if self.resident is not None else (
            (torch.from_numpy(x).to(self.device), torch.from_numpy(q).to(self.device))
            for x, q in self.store.chunks(self.layer, rng))
        for x, q in chunks:
            perm = torch.randperm(x.shape[0], generator=gen).to(self.device)
            for i in range(0, x.shape[0], batch):
                idx = perm[i:i + batch]
                yield x[idx], q[idx]


def fit_width(data: LayerData, ex: torch.Tensor, eq: torch.Tensor, width: int, s: FitSettings,
              device: torch.device) -> Trial:
    """Train fc1 [width, D] -> ReLU -> fc2 [F, width] with BCE whose positive class weight
    starts balanced ((1 - p) / p) and doubles until held-out recall at threshold 0 reaches the
    target (plus margin); each raise fine-tunes ``round_epochs`` epochs. ``eq`` [N, F] are the
    held-out activation codes."""
    t0 = time.time()
    D, F = ex.shape[1], eq.shape[1]
    gen = torch.Generator().manual_seed(s.seed + width)
    rng = np.random.default_rng(s.seed + width)
    fc1 = (torch.randn(width, D, generator=gen) / math.sqrt(D)).to(device).requires_grad_()
    fc2 = (torch.randn(F, width, generator=gen) / math.sqrt(width)).to(device).requires_grad_()
    p = float(data.store.active[data.layer].sum()) / max(data.n * F, 1)
    pos_weight = min(max((1 - p) / max(p, 1e-6), 1.0), 1e3)
    steps_per_epoch = max(1, math.ceil(data.n / s.batch))
    result = None
    for rnd in range(s.max_rounds + 1):
        epochs = s.epochs if rnd == 0 else s.round_epochs
        _train_epochs(data, fc1, fc2, pos_weight, epochs, steps_per_epoch, s, gen, rng, lr_scale=1.0 if rnd == 0 else 0.5)
        result = _measure(fc1, fc2, ex, eq, width, pos_weight, rnd, t0)
        if result.recall >= s.recall_target + s.recall_margin:
            break
        pos_weight *= 2.0
    assert result is not None
    return result


def _train_epochs(data: LayerData, fc1: torch.Tensor, fc2: torch.Tensor, pos_weight: float, epochs: int,
                  steps_per_epoch: int, s: FitSettings, gen: torch.Generator, rng: np.random.Generator,
                  lr_scale: float) -> None:
    opt = torch.optim.Adam([fc1, fc2], lr=s.lr * lr_scale, weight_decay=s.weight_decay)
    total = epochs * steps_per_epoch
    warm = max(1, total // 20) if lr_scale == 1.0 else 0  # fine-tuning rounds start warm
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / warm if i < warm else
                                              0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm))))
    step = 0
    for _ in range(epochs):
        for x, q in data.batches(s.batch, gen, rng):
            if step >= total:
                break
            logits = torch.relu(x @ fc1.T) @ fc2.T  # [B, F]
            y = q > 0
            loss = Fn.binary_cross_entropy_with_logits(logits, y.float(), weight=_weights(q, y, pos_weight, data.mean_magnitude, s))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1


def _weights(q: torch.Tensor, y: torch.Tensor, pos_weight: float, mean_mag: float, s: FitSettings) -> torch.Tensor:
    """Per-element BCE weights [B, F]: 1 where inactive; where active pos_weight, times
    (contribution / mean contribution) ** magnitude_power, the ratio clipped to 1/20..20."""
    w = torch.full(q.shape, pos_weight, device=q.device)
    if s.magnitude_power:
        rel = (decode_magnitude(q) / max(mean_mag, 1e-30)).clamp(0.05, 20.0)
        w = w * rel.pow(s.magnitude_power)
    return torch.where(y, w, torch.ones_like(w))


@torch.no_grad()
def _measure(fc1: torch.Tensor, fc2: torch.Tensor, ex: torch.Tensor, eq: torch.Tensor, width: int,
             pos_weight: float, rounds: int, t0: float) -> Trial:
    w1, w2 = fc1.detach().half().float(), fc2.detach().half().float()  # as stored in the file
    pred = (torch.relu(ex @ w1.T) @ w2.T) >= THRESHOLD  # [N, F]
    ey = eq > 0
    tp = float((pred & ey).sum())
    n_true, n_pred = float(ey.sum()), float(pred.sum())
    mag = decode_magnitude(eq)
    return Trial(width=width, recall=tp / max(n_true, 1.0), precision=tp / max(n_pred, 1.0),
                 pred_sparsity=1 - n_pred / ey.numel(), true_sparsity=1 - n_true / ey.numel(),
                 pos_weight=pos_weight, rounds=rounds, seconds=time.time() - t0,
                 fc1=w1.cpu(), fc2=w2.cpu(),
                 mass_recall=float((mag * pred).sum() / mag.sum().clamp_min(1e-30)))


# ------------------------------------------------------------------------------------------------
# width sizing
# ------------------------------------------------------------------------------------------------
def initial_width(active_frac: float, share80: float, n_ff: int, n_embd: int, hi: int | None = None) -> int:
    """A first guess of a layer's predictor width: proportional to the neurons a token
    activates (F * p), scaled by skewness (share of neurons covering 80 % of activations,
    relative to the 0.8 of a uniform layer: a skewed layer is easier to predict), times 2.
    At upstream's Llama-2-13B point (F 13824, p 0.156, share 0.2) this gives ~1100 (upstream
    used 1024-2048)."""
    guess = 2.0 * n_ff * active_frac * (share80 / 0.8)
    return _round_width(guess, hi if hi is not None else max_width(n_ff, n_embd))


def max_width(n_ff: int, n_embd: int, n_layer: int = 1, model_bytes: int | None = None,
              budget: float | None = None, dtype_bytes: int = 2) -> int:
    """The widest predictor a layer may get: min(F / 2, 2 D), and, with a ``budget`` (share of
    ``model_bytes`` for all predictors together), that budget split evenly over the layers."""
    hi = min(n_ff // 2, 2 * n_embd)
    if budget is not None and model_bytes:
        hi = min(hi, int(budget * model_bytes / (n_layer * dtype_bytes * (n_embd + n_ff))))
    return max(MIN_WIDTH, hi // WIDTH_STEP * WIDTH_STEP)


def _round_width(w: float, hi: int) -> int:
    return int(min(hi, max(MIN_WIDTH, round(w / WIDTH_STEP) * WIDTH_STEP)))


def choose(trials: list[Trial], target: float, sparsity_tol: float) -> Trial:
    """The smallest width that meets the recall target with a predicted density (1 - predicted
    sparsity) within ``sparsity_tol`` (relative) of the best meeting width; without any meeting
    width, the one with the highest recall."""
    ok = [t for t in trials if t.meets(target)]
    if not ok:
        return max(trials, key=lambda t: t.recall)
    best_density = min(1 - t.pred_sparsity for t in ok)
    good = [t for t in ok if 1 - t.pred_sparsity <= best_density * (1 + sparsity_tol) + 1e-3]
    return min(good, key=lambda t: t.width)


def size_layer(data: LayerData, ex: torch.Tensor, eq: torch.Tensor, r0: int, hi: int, s: FitSettings,
               device: torch.device, sparsity_tol: float = 0.05,
               log: Callable[[str], None] | None = None) -> tuple[Trial, list[Trial]]:
    """Try r0 and 2*r0, then move along the doubling ladder: grow while no tried width meets the
    target or the widest one is the choice (more width still bought predicted sparsity);
    shrink while the narrowest is the choice. Returns the choice and all trials."""
    tried: dict[int, Trial] = {}

    def trial(w: int) -> None:
        tried[w] = fit_width(data, ex, eq, w, s, device)
        if log is not None:
            t = tried[w]
            log(f"  width {w:5d}: recall {t.recall:.4f} (mass {t.mass_recall:.4f}) precision {t.precision:.3f} "
                f"predicted sparsity {t.pred_sparsity:.3f} (true {t.true_sparsity:.3f}) "
                f"pos_weight {t.pos_weight:.1f} ({t.seconds:.1f} s)")

    target = s.recall_target + s.recall_margin
    for w in sorted({r0, _round_width(2 * r0, hi)}):
        trial(w)
    while True:
        best = choose(list(tried.values()), target, sparsity_tol)
        lo, top = min(tried), max(tried)
        wider, narrower = _round_width(2 * top, hi), _round_width(lo / 2, hi)
        if (not best.meets(target) or best.width == top) and wider not in tried:
            trial(wider)
        elif best.meets(target) and best.width == lo and narrower not in tried:
            trial(narrower)
        else:
            break
    return choose(list(tried.values()), target, sparsity_tol), sorted(tried.values(), key=lambda t: t.width)


# ------------------------------------------------------------------------------------------------
# the pipeline
# ------------------------------------------------------------------------------------------------
@dataclass
class LayerReport:
    layer: int
    width: int
    bytes: int
    recall: float
    precision: float
    true_sparsity: float
    pred_sparsity: float
    pos_weight: float
    share80: float
    mass_recall: float  # share of the layer's activation contribution the kept neurons carry
    tried: list[dict[str, float]]


@dataclass
class PredictorResult:
    path: Path
    layers: list[LayerReport]
    predictor_bytes: int
    model_bytes: int  # the dense model's tensors, without predictors
    recall_target: float
    threshold: float
    n_train_tokens: int
    n_eval_tokens: int
    seconds: float

    @property
    def share_of_model(self) -> float:
        return self.predictor_bytes / max(self.model_bytes, 1)

    def table(self) -> str:
        rows = [f"{'layer':>5} {'width':>6} {'bytes':>9} {'recall':>7} {'mass rec.':>9} {'precision':>9} "
                f"{'true sparsity':>13} {'pred sparsity':>13}"]
        for r in self.layers:
            rows.append(f"{r.layer:>5} {r.width:>6} {r.bytes:>9} {r.recall:>7.4f} {r.mass_recall:>9.4f} "
                        f"{r.precision:>9.3f} {r.true_sparsity:>13.3f} {r.pred_sparsity:>13.3f}")
        rows.append(f"predictors: {self.predictor_bytes} bytes = {100 * self.share_of_model:.2f} % of "
                    f"the model's {self.model_bytes} bytes; recall target {self.recall_target} "
                    f"at threshold {self.threshold}; held-out tokens {self.n_eval_tokens}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["share_of_model"] = self.share_of_model
        return d


def train_predictors(model_path: str | Path, corpus: Corpus, out_path: str | Path,
                     recall_target: float = 0.95, max_tokens: int = 100_000, seq_len: int = 256,
                     widths: list[int] | None = None, settings: FitSettings | None = None,
                     memory_cap: int = 1 << 30, spill_dir: str | Path | None = None,
                     device: str | torch.device | None = None, progress: bool = True,
                     tokenizer: Tokenizer | None = None, budget: float | None = 0.2,
                     log: Callable[[str], None] = print) -> PredictorResult:
    """Train one predictor per layer of the model at ``model_path`` on ``corpus`` and write the
    model with them (and ``powerinfer.sparse_threshold``) to ``out_path`` (PWRI-stamped).
    ``widths`` fixes each layer's width (skips the sizing search); ``budget`` caps all
    predictors together at that share of the model's bytes (None: no cap)."""
    t0 = time.time()
    s = replace(settings or FitSettings(), recall_target=recall_target)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mf = ModelFile(model_path)
    cfg = mf.config
    tok = tokenizer or Tokenizer(mf.fields)
    ref = ReferenceModel.from_file(mf, device=dev)
    L, D, F = cfg.n_layer, cfg.n_embd, cfg.n_ff
    model_bytes = sum(int(t.n_bytes) for n, t in mf.tensors.items() if not _is_predictor(n))
    hi = max_width(F, D, L, model_bytes, budget, cfg.dtype_bytes)
    train_store = SampleStore(L, D, F, memory_cap, spill_dir)
    held_store = SampleStore(L, D, F, 1 << 62)
    try:
        collect_samples(ref, tok, corpus, max_tokens, min(seq_len, cfg.n_ctx), train_store, held_store,
                        progress=progress)
        if min(held_store.counts) == 0:
            raise ValueError(f"corpus {corpus!r} gave too few tokens to hold any out "
                             f"({sum(train_store.counts) // L} collected); pass a larger corpus")
        del ref
        reports, chosen = [], []
        for l in range(L):
            data = LayerData(train_store, l, dev)
            hx, hq = held_store.all(l)
            ex, eq = torch.from_numpy(hx).to(dev), torch.from_numpy(hq).to(dev)
            counts = train_store.active[l]
            p = counts.sum() / max(train_store.counts[l] * F, 1)
            share = _share80(counts)
            log(f"layer {l}: active {100 * p:.2f} %, 80 % of activations in {100 * share:.1f} % of neurons")
            if widths is not None:
                best = fit_width(data, ex, eq, widths[l], s, dev)
                trials = [best]
            else:
                best, trials = size_layer(data, ex, eq, initial_width(p, share, F, D, hi), hi, s, dev, log=log)
            chosen.append(best)
            reports.append(LayerReport(l, best.width, cfg.dtype_bytes * best.width * (D + F), best.recall, best.precision,
                                       best.true_sparsity, best.pred_sparsity, best.pos_weight, share,
                                       best.mass_recall, [t.row() for t in trials]))
            del data, ex, eq
        n_train, n_eval = train_store.counts[0], held_store.counts[0]
    finally:
        train_store.close()
        held_store.close()
    write_with_predictors(mf, out_path, [t.fc1 for t in chosen], [t.fc2 for t in chosen], THRESHOLD)
    result = PredictorResult(Path(out_path), reports, sum(r.bytes for r in reports), model_bytes,
                             recall_target, THRESHOLD, n_train, n_eval, time.time() - t0)
    log(result.table())
    return result


def _share80(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    cum = np.cumsum(np.sort(counts)[::-1])
    return (int(np.searchsorted(cum, 0.8 * total)) + 1) / counts.size


def _is_predictor(name: str) -> bool:
    return name.endswith((".fc1.weight", ".fc2.weight", ".fc1.bias", ".fc2.bias"))


def write_with_predictors(mf: ModelFile, out_path: str | Path, fc1: list[torch.Tensor],
                          fc2: list[torch.Tensor], threshold: float) -> Path:
    """Copy every tensor (lazily, at its stored dtype) and all metadata of ``mf``, replace the
    predictors by fc1 [r_l, D] / fc2 [F, r_l] and set the threshold; stamps PWRI."""
    if Path(out_path).resolve() == mf.path.resolve():
        raise ValueError(f"out_path {out_path}: must differ from the input model (it is read lazily)")
    cfg = mf.config.with_(predictor_ranks=tuple(int(w.shape[0]) for w in fc1), sparse_threshold=threshold)
    tensors: dict[str, Any] = {}
    for name, t in mf.tensors.items():
        if _is_predictor(name):
            continue
        tensors[name] = LazyTensor(tuple(t.data.shape), mf.dtype_of(name), lambda n=name: mf.get(n))
    for l in range(cfg.n_layer):
        tensors[K.tensor(K.FC1, l)] = fc1[l]
        tensors[K.tensor(K.FC2, l)] = fc2[l]
    meta = {k: v for k, v in mf.fields.items() if k != K.ARCH}
    meta[K.SPARSE_THRESHOLD] = float(threshold)
    tmp = Path(str(out_path) + ".tmp")
    write_model(tmp, cfg, tensors, metadata=meta, sparse=True)
    shutil.move(tmp, out_path)
    return Path(out_path)
