"""Train the embedded tiny models on the built-in corpus: the Llama-style ReGLU default model
and a Llama-style SwiGLU model (the fixture of training-free threshold sparsity).

The training model is written with the dense reference's own building blocks (``rms_norm``,
``apply_rope`` in GGML mode 0, ``ffn_activation``) and keeps its weights under their GGUF
tensor names and shapes, so the export is a plain ``write_model`` and the exported file's
held-out loss under ``ReferenceModel`` equals the training model's (``check_export``).

Dimension legend: B batch, T tokens, V vocab, D n_embd, H heads, hd head dim, F n_ff.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from ..model import gguf_keys as K
from ..model.config import ModelConfig
from ..model.gguf_config import expected_shapes
from ..model.gguf_writer import write_model
from ..model.reference import ReferenceModel, apply_rope, ffn_activation, rms_norm
from ..model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer, byte_level_fields
from .corpus import DATA_DIR

DEFAULT_MODEL_FILE = "tiny-reglu.powerinfer.gguf"  # the name model.default looks for
DEFAULT_STATS_FILE = "tiny-reglu.activation.parquet"
SWIGLU_MODEL_FILE = "tiny-swiglu.gguf"  # dense; `sparsify` adds thresholds


def _shipped(name: str, flags: str = "") -> Path:
    path = DATA_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: the embedded model is missing; train it with "
                                f"scripts/train_tiny_model.py{flags}")
    return path


def trained_model_path() -> Path:
    """The trained tiny ReGLU model with its predictors, as shipped in package data
    (``powerinfer_ray.model.default.default_model_path()`` returns it when present)."""
    return _shipped(DEFAULT_MODEL_FILE)


def trained_stats_path() -> Path:
    """Activation statistics of the shipped model (Parquet, ``profile.ActivationStats``)."""
    return DATA_DIR / DEFAULT_STATS_FILE


def trained_swiglu_path() -> Path:
    """The trained tiny SwiGLU model (dense, no thresholds), as shipped in package data."""
    return _shipped(SWIGLU_MODEL_FILE, " --ffn-act swiglu")


def tiny_trained_config(ffn_act: str = "reglu", n_vocab: int = 1024, n_embd: int = 192,
                        n_layer: int = 6, n_head: int = 4, n_ff: int = 768,
                        n_ctx: int = 512) -> ModelConfig:
    """The shape of an embedded tiny model (Llama-style, tied output, fp16)."""
    return ModelConfig(arch="llama", ffn_act=ffn_act, n_vocab=n_vocab, n_embd=n_embd,
                       n_layer=n_layer, n_head=n_head, n_head_kv=n_head, n_ff=n_ff, n_ctx=n_ctx,
                       norm_eps=1e-5, rope_theta=10000.0, tied_output=True, dtype="f16",
                       name=f"powerinfer-ray-tiny-{ffn_act}")


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], n_vocab: int = 1024) -> dict[str, Any]:
    """A byte-level BPE vocabulary of ``n_vocab`` tokens (256 bytes, merges, <s>, </s>) learned
    on ``docs``, as GGUF metadata (``byte_level_fields``) that ``Tokenizer`` rebuilds."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    n_merges = n_vocab - BYTE_VOCAB_SIZE
    if n_merges < 0:
        raise ValueError(f"n_vocab is {n_vocab}, expected at least {BYTE_VOCAB_SIZE}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, min_frequency=2, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw]
    pieces = [m.replace(" ", "", 1) for m in merges]  # the token each merge creates
    assert len(set(pieces)) == len(pieces) == n_merges, (len(set(pieces)), len(pieces), n_merges)
    return byte_level_fields(pieces, merges)


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream [N] (each document starts with BOS)."""
    ids: list[int] = []
    for d in docs:
        ids.extend(tok.encode(d))
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [W, seq_len + 1] (inputs and next-token targets) of a stream."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


# ------------------------------------------------------------------------------------------------
# the training model
# ------------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """The llama forward (gated FFN) of ``ReferenceModel`` for batches, with dropout and the FFN
    activations exposed for an L1 penalty; parameters are named and shaped as in GGUF."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        assert cfg.arch == "llama" and cfg.gated and cfg.n_head == cfg.n_head_kv, cfg
        self.cfg, self.dropout = cfg, dropout
        g = torch.Generator().manual_seed(seed)
        self.p = nn.ParameterDict()
        for name, shape in expected_shapes(cfg).items():
            self.p[self._key(name)] = nn.Parameter(self._init(name, shape, g))

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "__")  # ParameterDict keys may not hold dots

    def _init(self, name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape)
        std = 0.02  # GPT-2's init; residual writers scaled down by depth (GPT-2 paper, 2.3)
        if ".attn_output." in name or ".ffn_down_t." in name:
            std /= math.sqrt(2 * self.cfg.n_layer)
        return torch.randn(shape, generator=g) * std

    def w(self, template: str, l: int | None = None) -> torch.Tensor:
        name = K.global_tensor(template) if l is None else K.tensor(template, l)
        return self.p[self._key(name)]

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights under their GGUF names (fp32, CPU)."""
        return {k.replace("__", "."): v.detach().float().cpu() for k, v in self.p.items()}

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, T] -> logits [B, T, V] and the FFN activations h [B, T, F] per layer."""
        c = self.cfg
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        x = self.w(K.TOKEN_EMBD)[tokens]  # [B, T, D]
        hs = []
        for l in range(c.n_layer):
            x = x + self._drop(self._attention(l, rms_norm(x, self.w(K.ATTN_NORM, l), c.norm_eps), pos))
            m = rms_norm(x, self.w(K.FFN_NORM, l), c.norm_eps)
            h = ffn_activation(c.ffn_act, m @ self.w(K.FFN_UP, l).T, m @ self.w(K.FFN_GATE, l).T)  # [B, T, F]
            hs.append(h)
            x = x + self._drop(h @ self.w(K.FFN_DOWN_T, l))
        x = rms_norm(x, self.w(K.OUTPUT_NORM), c.norm_eps)
        return x @ self.w(K.TOKEN_EMBD).T, hs  # tied output head

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.dropout(x, self.dropout, self.training) if self.dropout else x

    def _attention(self, l: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        shape = (B, T, c.n_head, c.head_dim)
        q = apply_rope((x @ self.w(K.ATTN_Q, l).T).view(shape), pos, c.rot_dims, c.rope_theta, "norm")
        k = apply_rope((x @ self.w(K.ATTN_K, l).T).view(shape), pos, c.rot_dims, c.rope_theta, "norm")
        v = (x @ self.w(K.ATTN_V, l).T).view(shape)
        q, k, v = (t.transpose(1, 2).to(v.dtype) for t in (q, k, v))  # [B, H, T, hd]
        o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                            dropout_p=self.dropout if self.training else 0.0)
        return o.transpose(1, 2).reshape(B, T, -1) @ self.w(K.ATTN_OUT, l).T


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------
@dataclass
class TrainSettings:
    steps: int = 1500
    batch: int = 16
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.1
    l1: float = 0.0  # coefficient of the mean |h| penalty on FFN activations
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 64
    seed: int = 0
    max_seconds: float | None = None  # safety stop on a shared device (the best step is kept)


@dataclass
class TrainResult:
    weights: dict[str, torch.Tensor]
    settings: TrainSettings
    best_step: int
    heldout_loss: float
    active_frac: list[float]  # per layer, on held-out tokens
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings), "best_step": self.best_step,
                "heldout_loss": self.heldout_loss, "heldout_ppl": math.exp(self.heldout_loss),
                "active_frac": self.active_frac, "seconds": self.seconds, "history": self.history}


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(cfg: ModelConfig, train_ids: torch.Tensor, heldout_ids: torch.Tensor, s: TrainSettings,
          device: str | torch.device = "cpu", log: Callable[[str], None] = print) -> TrainResult:
    """Train ``TinyLM`` with AdamW on random windows of ``train_ids``; keep the weights of the
    step with the lowest held-out loss (evaluated every ``eval_every`` steps)."""
    torch.manual_seed(s.seed)
    device = torch.device(device)
    model = TinyLM(cfg, seed=s.seed, dropout=s.dropout).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95), **({"fused": True} if device.type == "cuda" else {}))
    data = train_ids.to(device)
    held = eval_windows(heldout_ids, s.seq_len, s.eval_windows).to(device)
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _null()
    best = (math.inf, -1, None, [])
    history: list[dict[str, float]] = []
    t0 = time.time()
    for step in range(s.steps + 1):
        if step % s.eval_every == 0 or step == s.steps:
            loss, frac = evaluate(model, held, amp)
            history.append({"step": step, "heldout_loss": loss, "active": sum(frac) / len(frac),
                            "seconds": time.time() - t0})
            log(f"step {step:5d}  held-out loss {loss:.4f} (ppl {math.exp(loss):7.2f})  "
                f"active {100 * sum(frac) / len(frac):5.1f} %  {time.time() - t0:6.1f} s")
            if loss < best[0]:
                best = (loss, step, {k: v.detach().clone() for k, v in model.p.items()}, frac)
        if step == s.steps:
            break
        if s.max_seconds is not None and time.time() - t0 > s.max_seconds:
            log(f"stopping at step {step}: max_seconds={s.max_seconds} reached")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        starts = torch.randint(0, data.numel() - s.seq_len - 1, (s.batch,), generator=gen)
        idx = starts.to(device)[:, None] + torch.arange(s.seq_len + 1, device=device)[None, :]
        batch = data[idx]  # [B, T + 1]
        model.train()
        with amp:
            logits, hs = model(batch[:, :-1])
            loss = Fn.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            if s.l1:
                loss = loss + s.l1 * sum(h.float().abs().mean() for h in hs) / len(hs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
    loss, step, state, frac = best
    with torch.no_grad():
        for k, v in state.items():
            model.p[k].copy_(v)
    return TrainResult(model.weights(), s, step, loss, frac, history, time.time() - t0)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@torch.no_grad()
def evaluate(model: TinyLM, windows: torch.Tensor, amp: Any = None,
             batch: int = 16) -> tuple[float, list[float]]:
    """Mean next-token loss over windows [W, T + 1] and the active share of FFN neurons per layer."""
    model.eval()
    total, n = 0.0, 0
    active = torch.zeros(model.cfg.n_layer, dtype=torch.float64)
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with amp if amp is not None else _null():
            logits, hs = model(w[:, :-1])
        total += float(Fn.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        n += w[:, 1:].numel()
        for l, h in enumerate(hs):
            active[l] += float((h != 0).float().mean()) * w.shape[0]
    return total / n, (active / windows.shape[0]).tolist()


# ------------------------------------------------------------------------------------------------
# export and its check
# ------------------------------------------------------------------------------------------------
def export(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
           tok_fields: dict[str, Any], metadata: dict[str, Any] | None = None) -> Path:
    """Write the trained dense model (matrices at ``cfg.dtype``) with its tokenizer and how its
    training text was fed: BOS before every document (``encode_stream``), windows cut anywhere."""
    meta = {**tok_fields, K.STREAM_DOC_SEP: "bos", K.STREAM_WINDOW_BOS: False}
    meta.update(metadata or {})
    return write_model(path, cfg, {n: weights[n] for n in expected_shapes(cfg)}, metadata=meta)


@torch.no_grad()
def reference_loss(model: ReferenceModel, windows: torch.Tensor) -> float:
    """Mean next-token loss of the dense reference over windows [W, T + 1], one at a time."""
    total, n = 0.0, 0
    for w in windows:
        logits = model.forward(w[:-1], model.new_cache())  # [T, V]
        total += float(Fn.cross_entropy(logits, w[1:].to(logits.device), reduction="sum"))
        n += w.numel() - 1
    return total / n


@torch.no_grad()
def check_export(path: str | Path, windows: torch.Tensor, device: str | torch.device = "cpu") -> dict[str, float]:
    """Held-out loss of the exported file under ``ReferenceModel`` and under ``TinyLM`` loaded
    with the same (fp16-rounded) weights, in fp32: equal up to summation order."""
    ref = ReferenceModel.from_file(path, dtype=torch.float32, device=device)
    cfg = ref.cfg
    tiny = TinyLM(cfg.with_(predictor_ranks=(), sparse_threshold=None)).to(device)
    for name in expected_shapes(tiny.cfg):
        tiny.p[TinyLM._key(name)].data.copy_(ref.w[name])
    train_side, _ = evaluate(tiny, windows.to(device))
    ref_side = reference_loss(ref, windows)
    return {"reference_loss": ref_side, "training_model_loss": train_side,
            "abs_diff": abs(ref_side - train_side)}
