"""Activation predictors: per layer, a small MLP that guesses which FFN neurons will fire.

The predictor of layer l maps the predictor input x [D] (the residual before the FFN norm; the
layer input for falcon) to one logit per neuron: ``fc2 @ relu(fc1 @ x)`` with fc1 [r, D],
fc2 [F, r] and no biases (upstream PowerInfer's layout); neuron j is computed iff its logit >=
``powerinfer.sparse_threshold``.

``train_predictors`` reads the corpus as the model's token stream, holds out its last documents
(or a held-out text), collects (x, activation) samples from the dense reference (or another
runner: ``collect``, e.g. the engine's, ``runtime.engine_samples``) into a store that spills to
disk, trains each layer (``predictor_fit``), chooses the threshold for a quality
target on the held-out text (``thresholds``: by default perplexity at most +0.5 % and top-1
agreement at least 99 % against dense), writes the model and reports, on the held-out text,
recall, precision, perplexity increase and top-1 agreement per layer and in all.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..model import gguf_keys as K
from ..model.gguf_file import ModelFile
from ..model.gguf_writer import LazyTensor, write_model
from ..model.reference import ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Corpus, iter_texts
from .predictor_fit import (FitSettings, LayerFit, fit_layer, fit_summary, layer_width, predictor_bytes,
                            selector_matrix, svd_start)
from .quality import Evaluator, PredictorHooks, Score
from .samples import (DEFAULT_MEMORY_CAP, CollectHooks, Collector, LayerData, SampleStore, collect_samples,
                      down_norms)
from .stream import StreamFormat, array_pieces, split_heldout, stream_array, windows_of
from .thresholds import QualityTarget, choose_threshold, per_layer_quality

DEFAULT_SHARE = 0.2  # predictors' default cap, as a share of the model's bytes
HELDOUT_SHARE = 0.2  # at most this share of a corpus is held out when no held-out text is given


@dataclass
class LayerReport:
    layer: int
    width: int
    bytes: int
    recall: float  # on the held-out text, with the file's predictors
    precision: float
    mass_recall: float
    kept: float  # share of neurons computed
    active: float  # share of neurons truly active
    ppl_increase: float | None  # with only this layer sparse
    top1: float | None
    fit: dict[str, Any] = field(default_factory=dict)


@dataclass
class PredictorResult:
    path: Path
    layers: list[LayerReport]
    predictor_bytes: int
    model_bytes: int  # the dense model's tensors, without predictors
    threshold: float
    target: str
    target_met: bool
    ppl_dense: float  # on the held-out text
    ppl_sparse: float
    top1: float
    n_train_tokens: int
    n_heldout_tokens: int
    seconds: float

    @property
    def share_of_model(self) -> float:
        return self.predictor_bytes / max(self.model_bytes, 1)

    @property
    def sparsity(self) -> float:
        return 1 - sum(r.kept for r in self.layers) / max(len(self.layers), 1)

    def table(self) -> str:
        rows = [f"{'layer':>5} {'width':>6} {'recall':>7} {'mass rec.':>9} {'precision':>9} "
                f"{'kept %':>7} {'active %':>8} {'ppl +%':>7} {'top-1 %':>7}"]
        for r in self.layers:
            ppl = f"{100 * r.ppl_increase:>+7.3f}" if r.ppl_increase is not None else f"{'-':>7}"
            top1 = f"{100 * r.top1:>7.2f}" if r.top1 is not None else f"{'-':>7}"
            rows.append(f"{r.layer:>5} {r.width:>6} {r.recall:>7.4f} {r.mass_recall:>9.5f} "
                        f"{r.precision:>9.3f} {100 * r.kept:>7.2f} {100 * r.active:>8.2f} {ppl} {top1}")
        rows.append(f"held-out text ({self.n_heldout_tokens} tokens): perplexity dense {self.ppl_dense:.4f}, "
                    f"sparse {self.ppl_sparse:.4f} ({100 * (self.ppl_sparse / self.ppl_dense - 1):+.3f} %), "
                    f"top-1 agreement {100 * self.top1:.2f} %, sparsity {100 * self.sparsity:.2f} % at threshold "
                    f"{self.threshold:+.3f}; target {self.target}{'' if self.target_met else ' NOT MET'}")
        rows.append(f"predictors: {self.predictor_bytes} bytes = {100 * self.share_of_model:.2f} % of the "
                    f"model's {self.model_bytes} bytes; trained on {self.n_train_tokens} tokens in {self.seconds:.0f} s")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(path=str(self.path), share_of_model=self.share_of_model, sparsity=self.sparsity)
        return d


def train_predictors(model_path: str | Path, corpus: Corpus, out_path: str | Path, *,
                     heldout: Corpus | None = None, target: QualityTarget | None = QualityTarget(),
                     recall_target: float = 0.99, max_tokens: int = 100_000, heldout_tokens: int = 8192,
                     seq_len: int = 256, fmt: StreamFormat | None = None, max_width: int | None = None,
                     max_predictor_share: float | None = DEFAULT_SHARE, settings: FitSettings | None = None,
                     memory_cap: int = DEFAULT_MEMORY_CAP, spill_dir: str | Path | None = None,
                     device: str | torch.device | None = None, per_layer: bool = True, progress: bool = True,
                     collect: Collector | None = None, log: Callable[[str], None] = print) -> PredictorResult:
    """Train one predictor per layer of the model at ``model_path`` on up to ``max_tokens``
    tokens of ``corpus`` and write the model with them to ``out_path`` (PWRI-stamped).

    ``heldout`` (default: the corpus's last documents, ``heldout_tokens`` tokens at most) is the
    text the threshold is chosen on: for ``target`` when given, else so that every layer reaches
    ``recall_target`` (count recall). ``per_layer`` adds each layer's own perplexity increase
    and top-1 agreement (a sparse pass per layer). ``collect`` gathers the training samples
    instead of the dense reference (which then loads after it, for the held-out text)."""
    t0 = time.time()
    s = settings or FitSettings()
    if target is None:
        s = replace(s, recall_target=recall_target)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mf = ModelFile(model_path)
    cfg = mf.config
    tok = Tokenizer(mf.fields)
    fmt = (fmt or StreamFormat()).resolve(tok)
    seq_len = min(seq_len, cfg.n_ctx)
    train_ids, held_ids = _token_split(tok, corpus, heldout, fmt, max_tokens, heldout_tokens, seq_len)
    bos = tok.bos_id if fmt.window_bos else None
    model_bytes = sum(int(t.n_bytes) for n, t in mf.tensors.items() if not _is_predictor(n))
    width = layer_width(cfg, model_bytes, max_width, max_predictor_share)
    store = SampleStore(cfg.n_layer, cfg.n_embd, cfg.n_ff, memory_cap, spill_dir)
    held = SampleStore(cfg.n_layer, cfg.n_embd, cfg.n_ff, memory_cap, spill_dir)
    try:
        log(f"{len(train_ids)} training and {len(held_ids)} held-out tokens ({fmt.describe()}); "
            f"predictor width {width}")
        windows = windows_of(array_pieces(train_ids), seq_len, bos)
        desc = "collecting activations" if progress else None
        if collect is not None:  # before the reference loads: the two are never in memory at once
            n_train = collect(windows, seq_len, store, len(train_ids), desc)
        ref = ReferenceModel.from_file(mf, device=dev)
        if collect is None:
            n_train = collect_samples(ref, windows, store, len(train_ids), desc)
        ev = Evaluator(ref, windows_of(array_pieces(held_ids), seq_len, bos),
                       dense_hooks=CollectHooks(held, down_norms(ref)))
        fits = _fit_all(ref, store, held, width, s, dev, progress, log)
    finally:
        store.close()
        held.close()
    fc1 = [f.fc1.to(dev) for f in fits]
    fc2 = [f.fc2.to(dev) for f in fits]
    if target is not None:
        log(f"choosing the threshold for {target.describe()} on the held-out text:")
        cal = choose_threshold(ev, fc1, fc2, target, log=log)
        threshold, met = cal.threshold, cal.met
    else:
        threshold, met = min(f.threshold for f in fits), True
    write_with_predictors(mf, out_path, [w.cpu() for w in fc1], [w.cpu() for w in fc2], threshold, fmt)
    reports, sparse = _heldout_report(ev, fits, fc1, fc2, threshold, per_layer)
    result = PredictorResult(Path(out_path), reports, sum(r.bytes for r in reports), model_bytes, threshold,
                             target.describe() if target is not None else f"recall {recall_target}", met,
                             ev.dense.ppl, sparse.ppl, sparse.top1, n_train, ev.dense.tokens, time.time() - t0)
    log(result.table())
    return result


def _heldout_report(ev: Evaluator, fits: list[LayerFit], fc1: list[torch.Tensor], fc2: list[torch.Tensor],
                    threshold: float, per_layer: bool) -> tuple[list[LayerReport], Score]:
    """Per layer on the held-out text: recall, precision, kept share with every layer sparse,
    and (``per_layer``) the perplexity and top-1 cost of this layer alone; the all-sparse score."""
    cfg = ev.ref.cfg
    hooks = PredictorHooks(fc1, fc2, threshold, down_norms=down_norms(ev.ref))
    sparse = ev.score(hooks)
    single = per_layer_quality(ev, fc1, fc2, threshold) if per_layer else [{}] * cfg.n_layer
    reports = [LayerReport(l, f.width, predictor_bytes(cfg, [f.width]), st["recall"], st["precision"],
                           st["mass_recall"], st["kept"], st["active"], one.get("ppl_increase"), one.get("top1"),
                           fit_summary(f))
               for l, (f, st, one) in enumerate(zip(fits, hooks.stats(cfg.n_ff), single))]
    return reports, sparse


def _token_split(tok: Tokenizer, corpus: Corpus, heldout: Corpus | None, fmt: StreamFormat, max_tokens: int,
                 heldout_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the held-out text's first ``heldout_tokens``, or
    the corpus's last documents (at most HELDOUT_SHARE of what it gives)."""
    if heldout is not None:
        train, _ = stream_array(tok, iter_texts(corpus), fmt, max_tokens)
        held, _ = stream_array(tok, iter_texts(heldout), fmt, heldout_tokens)
    else:
        arr, starts = stream_array(tok, iter_texts(corpus), fmt, max_tokens + heldout_tokens)
        train, held = split_heldout(arr, starts, min(heldout_tokens, int(HELDOUT_SHARE * len(arr))))
        train = train[:max_tokens]  # the held-out share may have left more than max_tokens before it
    for name, ids in (("corpus", train), ("held-out text", held)):
        if len(ids) < seq_len:
            raise ValueError(f"the {name} gave {len(ids)} tokens, fewer than one window of {seq_len}: "
                             "pass more text or a smaller seq_len")
    return train, held


def _fit_all(ref: ReferenceModel, store: SampleStore, held: SampleStore, width: int, s: FitSettings,
             dev: torch.device, progress: bool, log: Callable[[str], None]) -> list[LayerFit]:
    """Train every layer's predictor from its SVD start."""
    cfg = ref.cfg
    bar = None
    if progress:
        from tqdm import tqdm

        per_epoch = sum(-(-n // s.batch) for n in store.counts)
        bar = tqdm(total=per_epoch * s.epochs, desc="training predictors", unit="step")
    fits = []
    gen = torch.Generator().manual_seed(s.seed)
    for l in range(cfg.n_layer):
        data = LayerData(store, l, dev)
        hx, hq = held.all(l)
        ex, eq = torch.from_numpy(hx).to(dev), torch.from_numpy(hq).to(dev)
        start = svd_start(selector_matrix(ref, l), width, data.head(4096), gen, dev)
        fit = fit_layer(data, (ex, eq), start, s, cfg.dtype, bar.update if bar is not None else None)
        fits.append(fit)
        log(f"layer {l}: active {100 * data.active_share:.2f} %, kept {100 * fit.kept:.2f} % at held-out recall "
            f"{s.recall_target} after {fit.epochs} epochs ({fit.seconds:.1f} s)")
        del data, ex, eq
    if bar is not None:
        bar.close()
    return fits


def _is_predictor(name: str) -> bool:
    return name.endswith((".fc1.weight", ".fc2.weight", ".fc1.bias", ".fc2.bias"))


def write_with_predictors(mf: ModelFile, out_path: str | Path, fc1: list[torch.Tensor],
                          fc2: list[torch.Tensor], threshold: float, fmt: StreamFormat | None = None) -> Path:
    """Copy every tensor (lazily, at its stored dtype) and all metadata of ``mf``, replace the
    predictors by fc1 [r_l, D] / fc2 [F, r_l] and set the threshold; stamps PWRI. A resolved
    ``fmt`` is recorded as the stream the predictors were trained and calibrated on."""
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
    if fmt is not None:
        meta.update({K.STREAM_DOC_SEP: fmt.doc_sep, K.STREAM_WINDOW_BOS: bool(fmt.window_bos)})
    tmp = Path(str(out_path) + ".tmp")
    write_model(tmp, cfg, tensors, metadata=meta, sparse=True)
    shutil.move(tmp, out_path)
    return Path(out_path)
