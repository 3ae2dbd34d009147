"""Activation profiling: how often each FFN neuron fires, per layer, over a corpus.

``profile_activations`` runs the dense reference over token windows of a corpus and counts,
per layer and neuron, the tokens on which the neuron is active (its activation h is nonzero:
ReLU h > 0, ReGLU/dReLU the product nonzero; a SwiGLU model with thresholds runs thresholded,
so its counts are those of the thresholded mask), seen through ``FFNHooks.observe``.
``ActivationStats`` holds the counts and the token count and stores them as Parquet (columns
layer, neuron, count; metadata n_tokens and model) and as upstream PowerInfer's
``activation/activation_{l}.pt`` files (one 1-D tensor of counts per layer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..model.gguf_file import ModelFile
from ..model.reference import ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts
from .stream import StreamFormat, run_windows, token_windows

PARQUET_FILE = "activation.parquet"
PT_DIR = "activation"
PLOT_FILE = "rank_frequency.png"
_META_MODEL = b"model"


class ActivationStatsError(ValueError):
    """Activation statistics that cannot be read or do not fit the model."""


@dataclass
class ActivationStats:
    """Per-layer, per-neuron activation counts over ``n_tokens`` tokens."""

    counts: np.ndarray  # [L, F] int64
    n_tokens: int
    model: str = ""

    def __post_init__(self) -> None:
        self.counts = np.asarray(self.counts, dtype=np.int64)
        if self.counts.ndim != 2:
            raise ActivationStatsError(f"counts: expected a [layers, neurons] array, got shape "
                                       f"{list(self.counts.shape)}")
        if self.n_tokens < 0 or (self.counts.size and self.counts.max() > self.n_tokens):
            raise ActivationStatsError(f"n_tokens is {self.n_tokens}, but a neuron fired "
                                       f"{int(self.counts.max())} times")

    @property
    def n_layer(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_ff(self) -> int:
        return int(self.counts.shape[1])

    # --- summaries --------------------------------------------------------------------------
    def frequency(self) -> np.ndarray:
        """Activation frequency of each neuron [L, F] (counts / tokens)."""
        return self.counts / max(self.n_tokens, 1)

    def active_fraction(self) -> np.ndarray:
        """Mean share of a layer's neurons active on a token [L]."""
        return self.frequency().mean(axis=1)

    def sparsity(self) -> np.ndarray:
        return 1.0 - self.active_fraction()

    def coverage_share(self, q: float = 0.8) -> np.ndarray:
        """Per layer, the smallest share of neurons (hottest first) whose activations add up to
        ``q`` of the layer's activations [L]; 0.8 for uniform counts, small when skewed."""
        out = np.zeros(self.n_layer)
        for l, c in enumerate(self.counts):
            total = c.sum()
            if total == 0:
                continue
            cum = np.cumsum(np.sort(c)[::-1])
            out[l] = (int(np.searchsorted(cum, q * total)) + 1) / c.size
        return out

    def summary(self, q: float = 0.8) -> dict[str, Any]:
        share = self.coverage_share(q)
        return {"model": self.model, "n_tokens": self.n_tokens, "n_layer": self.n_layer,
                "n_ff": self.n_ff, "sparsity": self.sparsity().round(4).tolist(),
                "active_fraction": self.active_fraction().round(4).tolist(),
                f"share_covering_{int(q * 100)}pct": share.round(4).tolist(),
                "mean_sparsity": round(float(self.sparsity().mean()), 4),
                f"mean_share_covering_{int(q * 100)}pct": round(float(share.mean()), 4)}

    def table(self, q: float = 0.8) -> str:
        """The per-layer summary as text."""
        share = self.coverage_share(q)
        rows = [f"{'layer':>5} {'active %':>9} {'sparsity %':>11} {f'neurons for {q:.0%} %':>18}"]
        for l in range(self.n_layer):
            rows.append(f"{l:>5} {100 * self.active_fraction()[l]:>9.2f} {100 * self.sparsity()[l]:>11.2f} "
                        f"{100 * share[l]:>18.2f}")
        rows.append(f"{'all':>5} {100 * self.active_fraction().mean():>9.2f} "
                    f"{100 * self.sparsity().mean():>11.2f} {100 * share.mean():>18.2f}")
        return "\n".join(rows)

    # --- Parquet ----------------------------------------------------------------------------
    def save_parquet(self, path: str | Path) -> Path:
        """The project's Parquet format (placement.stats: layer, neuron, count; n_tokens)."""
        from ..placement.stats import write_activation_parquet

        write_activation_parquet(path, list(self.counts), self.n_tokens, {"model": self.model})
        return Path(path)

    @classmethod
    def load_parquet(cls, path: str | Path) -> "ActivationStats":
        import pyarrow.parquet as pq

        from ..placement.stats import StatsError, read_activation_parquet

        try:
            st = read_activation_parquet(path)
        except StatsError as exc:
            raise ActivationStatsError(str(exc)) from None
        if len({len(c) for c in st.counts}) != 1:
            raise ActivationStatsError(f"{path}: layers have different neuron counts")
        meta = pq.read_schema(path).metadata or {}
        return cls(np.stack(st.counts), int(st.n_tokens), meta.get(_META_MODEL, b"").decode())

    # --- upstream activation/activation_{l}.pt ----------------------------------------------
    def save_pt(self, folder: str | Path) -> Path:
        """Write ``folder/activation_{l}.pt`` per layer, plus ``meta.json`` with n_tokens."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for l, c in enumerate(self.counts):
            torch.save(torch.from_numpy(c.copy()), folder / f"activation_{l}.pt")
        (folder / "meta.json").write_text(json.dumps({"n_tokens": self.n_tokens, "model": self.model}))
        return folder

    @classmethod
    def load_pt(cls, folder: str | Path, n_tokens: int | None = None) -> "ActivationStats":
        """Read upstream's per-layer count files (sorted numerically: 10 after 9). Without
        ``meta.json`` (upstream writes none) pass ``n_tokens``; else the largest count is used."""
        from ..placement.stats import StatsError, activation_pt_files

        folder = Path(folder)
        try:
            found = list(enumerate(activation_pt_files(folder)))  # numeric order, 0..L-1 checked
        except StatsError as exc:
            raise ActivationStatsError(str(exc)) from None
        counts = [torch.load(p, weights_only=True) for _, p in found]
        for l, c in enumerate(counts):
            if not isinstance(c, torch.Tensor) or c.ndim != 1:
                raise ActivationStatsError(f"{folder}/activation_{l}.pt: expected a 1-D tensor of counts")
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        arr = np.stack([c.to(torch.int64).numpy() for c in counts])
        n = n_tokens if n_tokens is not None else meta.get("n_tokens", int(arr.max(initial=0)))
        return cls(arr, int(n), meta.get("model", ""))

    # --- both, in a folder -------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write ``out_dir/activation.parquet`` and ``out_dir/activation/activation_{l}.pt``
        (``powerinfer-ray solve --activation out_dir`` reads them)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.save_parquet(out / PARQUET_FILE)
        self.save_pt(out / PT_DIR)
        return out

    # --- plot -------------------------------------------------------------------------------
    def plot(self, path: str | Path, title: str | None = None) -> Path | None:
        """Log-log rank/frequency plot of each layer's neurons; None (and a message) without
        matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: skipping the rank/frequency plot "
                  "(pip install 'powerinfer-ray[plot]')")
            return None
        fig, ax = plt.subplots(figsize=(6, 4.2), dpi=100)
        ranks = np.arange(1, self.n_ff + 1)
        for l, f in enumerate(self.frequency()):
            ax.loglog(ranks, np.sort(f)[::-1], label=f"layer {l}", linewidth=1.2)
        ax.set_xlabel("neuron rank (hottest first)")
        ax.set_ylabel("activation frequency (share of tokens)")
        ax.set_title(title or f"{self.model or 'model'}: FFN activation rank/frequency "
                     f"({self.n_tokens} tokens)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return Path(path)


# ------------------------------------------------------------------------------------------------
# profiling
# ------------------------------------------------------------------------------------------------
class CountingHooks:
    """FFNHooks that count, per layer and neuron, the tokens with a nonzero activation."""

    def __init__(self, n_layer: int, n_ff: int, device: torch.device) -> None:
        self.counts = torch.zeros(n_layer, n_ff, dtype=torch.int64, device=device)

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.counts[layer] += (h != 0).sum(0)  # h [T, F]


def load_reference(model: str | Path | ReferenceModel, device: str | torch.device | None = None
                   ) -> tuple[ReferenceModel, Tokenizer | None]:
    """The dense reference and its tokenizer (None when the file has none)."""
    if isinstance(model, ReferenceModel):
        return model, getattr(model, "tokenizer", None)
    mf = ModelFile(model)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref = ReferenceModel.from_file(mf, device=dev)
    try:
        tok = Tokenizer(mf.fields)
    except ValueError:
        tok = None
    return ref, tok


def profile_activations(model: str | Path | ReferenceModel, corpus: Corpus, max_tokens: int = 100_000,
                        seq_len: int = 256, progress: bool = True, tokenizer: Tokenizer | None = None,
                        device: str | torch.device | None = None, fmt: StreamFormat | None = None) -> ActivationStats:
    """Count active FFN neurons over up to ``max_tokens`` tokens of ``corpus``'s token stream
    (``stream``: documents joined as ``fmt`` says), in independent windows of ``seq_len``."""
    ref, tok = load_reference(model, device)
    tok = tokenizer or tok
    if tok is None:
        raise ValueError(f"model {getattr(ref.cfg, 'name', '')!r} has no tokenizer: pass tokenizer=")
    seq_len = min(seq_len, ref.cfg.n_ctx)
    hooks = CountingHooks(ref.cfg.n_layer, ref.cfg.n_ff, ref.device)
    n = run_windows(ref, token_windows(tok, iter_texts(corpus), seq_len, max_tokens, fmt), hooks, max_tokens,
                    "profiling" if progress else None)
    if n == 0:
        raise ValueError(f"corpus {corpus!r} gave no window of {seq_len} tokens")
    return ActivationStats(hooks.counts.cpu().numpy(), n, ref.cfg.name)


def run_profile(model: str | Path | ReferenceModel, corpus: Corpus, out_dir: str | Path,
                max_tokens: int = 100_000, seq_len: int = 256, progress: bool = True,
                plot: bool = True, device: str | torch.device | None = None,
                log: Callable[[str], None] = print, fmt: StreamFormat | None = None) -> ActivationStats:
    """Profile, print the per-layer table, and write ``out_dir/activation.parquet``,
    ``out_dir/activation/activation_{l}.pt`` and ``out_dir/rank_frequency.png``."""
    stats = profile_activations(model, corpus, max_tokens, seq_len, progress, device=device, fmt=fmt)
    return write_profile(stats, out_dir, plot, log)


def write_profile(stats: ActivationStats, out_dir: str | Path, plot: bool = True,
                  log: Callable[[str], None] = print) -> ActivationStats:
    """Write a profile's files to ``out_dir`` (``ActivationStats.save``, and the rank/frequency
    plot) and print its per-layer table."""
    out = stats.save(out_dir)
    log(f"activation profile of {stats.model or 'model'} over {stats.n_tokens} tokens:")
    log(stats.table())
    if plot:
        stats.plot(out / PLOT_FILE)
    return stats

