"""HF checkpoint -> PowerInfer-compatible GGUF model file.

Reads an HF model folder (``config.json``, safetensors, ``tokenizer.json`` +
``tokenizer_config.json``; see ``hf_checkpoint``) and, optionally, upstream PowerInfer's per-layer
predictors (``model_{l}.pt``), and streams a GGUF file: each tensor is read from the checkpoint
only when the writer reaches it, so models larger than RAM convert. The architectures and the
layouts written are in ``hf_archs``.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..model import gguf_keys as K
from ..model.config import ConfigError, ModelConfig
from ..model.gguf_writer import LazyTensor, TensorLike, write_model
from ..model.qtypes import FILE_TYPE, storage_kind
from ..model.tokenizer import hf_tokenizer_fields
from .hf_archs import Plan, planner_for
from .hf_checkpoint import Checkpoint, ConvertError, HFConfig

log = logging.getLogger(__name__)

OUTTYPES = ("f16", "bf16", "f32", "q8_0", "q4_0")


# ------------------------------------------------------------------------------------------------
# predictors: upstream PowerInfer's model_{l}.pt
# ------------------------------------------------------------------------------------------------
_PREDICTOR_FILE = re.compile(r"model_(\d+)\.pt")


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # not a zip-format file: mmap is unavailable
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ConvertError(f"{path}: expected a state dict with 'fc1.weight' and 'fc2.weight', "
                           f"got a {type(sd).__name__}")
    return sd


def predictor_files(pred_dir: Path, n_layer: int) -> list[Path]:
    """model_0.pt .. model_{n_layer-1}.pt, sorted numerically; one clear error when any is missing."""
    if not pred_dir.is_dir():
        raise ConvertError(f"{pred_dir}: no such predictor folder")
    found = {int(m.group(1)): p for p in pred_dir.iterdir() if (m := _PREDICTOR_FILE.fullmatch(p.name))}
    missing = [l for l in range(n_layer) if l not in found]
    extra = sorted(l for l in found if l >= n_layer)
    if missing or extra:
        raise ConvertError(f"{pred_dir}: expected predictor files model_0.pt .. model_{n_layer - 1}.pt "
                           f"(one per layer); missing layers {missing}, unexpected layers {extra}")
    return [found[l] for l in range(n_layer)]


def predictor_rank(path: Path, cfg: ModelConfig) -> int:
    """The width r of one predictor file, after checking fc1 [r, n_embd] and fc2 [n_ff, r]."""
    sd = _load_state(path)
    if "fc1.weight" not in sd or "fc2.weight" not in sd:
        raise ConvertError(f"{path}: keys {sorted(sd)}, expected 'fc1.weight' and 'fc2.weight'")
    if any(k.endswith(".bias") for k in sd):
        raise ConvertError(f"{path}: has biases {sorted(k for k in sd if k.endswith('.bias'))}; "
                           "PowerInfer predictors are bias-free")
    fc1, fc2 = tuple(sd["fc1.weight"].shape), tuple(sd["fc2.weight"].shape)
    r = fc1[0] if len(fc1) == 2 else -1
    if fc1 != (r, cfg.n_embd) or fc2 != (cfg.n_ff, r):
        raise ConvertError(f"{path}: fc1.weight {list(fc1)} / fc2.weight {list(fc2)}, expected "
                           f"[r, n_embd={cfg.n_embd}] / [n_ff={cfg.n_ff}, r]")
    return r


def add_predictors(p: Plan, pred_dir: Path, outtype: str) -> Plan:
    """fc1 / fc2 of every layer, their ranks and the sparse threshold (the predictor folder's
    config.json 'sparse_threshold' as upstream reads it, default 0.0) into the plan."""
    files = predictor_files(pred_dir, p.cfg.n_layer)
    ranks = tuple(predictor_rank(f, p.cfg) for f in files)
    thr_file = pred_dir / "config.json"
    thr = json.loads(thr_file.read_text()).get("sparse_threshold") if thr_file.is_file() else None
    p.cfg = p.cfg.with_(predictor_ranks=ranks, sparse_threshold=float(thr if thr is not None else 0.0))
    for l, (f, r) in enumerate(zip(files, ranks)):
        for tmpl, key, shape in ((K.FC1, "fc1.weight", (r, p.cfg.n_embd)), (K.FC2, "fc2.weight", (p.cfg.n_ff, r))):
            p.tensors[K.tensor(tmpl, l)] = LazyTensor(shape, outtype, lambda f=f, key=key: _load_state(f)[key])
    return p


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def _chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template, or chat_template.jinja / .json beside it."""
    t = tok_config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (hf_dir / "chat_template.json").is_file():
        return json.loads((hf_dir / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return None


def tokenizer_metadata(hf_dir: Path, hf: HFConfig, n_vocab: int) -> dict[str, Any]:
    """GGUF tokenizer fields from tokenizer.json (+ tokenizer_config.json); {} without a tokenizer."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        log.warning("%s: no tokenizer.json; the model file will have no tokenizer (prompts must be "
                    "token ids). A folder with only tokenizer.model gets one by re-saving the "
                    "tokenizer with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d)", hf_dir)
        return {}
    cfg_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    fallback = {k: hf.data.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    try:
        fields = hf_tokenizer_fields(path.read_text(encoding="utf-8"), tok_config,
                                     _chat_template(hf_dir, tok_config), n_vocab, fallback)
    except (ValueError, KeyError) as exc:
        raise ConvertError(f"{path}: cannot convert the tokenizer ({exc})") from None
    n_tok = len(fields.get(K.TOK_TOKENS) or [])
    if n_tok > n_vocab:
        log.warning("%s: %d tokens but the embedding has %d rows; ids >= %d cannot be run",
                    path, n_tok, n_vocab, n_vocab)
    return fields


# ------------------------------------------------------------------------------------------------
# the converter
# ------------------------------------------------------------------------------------------------
def with_progress(tensors: dict[str, TensorLike], desc: str) -> tuple[dict[str, TensorLike], Any]:
    """The same tensors, each lazy one ticking a tqdm bar (unit: tensor) when it is produced."""
    from tqdm import tqdm

    bar = tqdm(total=len(tensors), desc=desc, unit="tensor")

    def ticking(name: str, t: LazyTensor) -> LazyTensor:
        def make() -> Any:
            bar.set_postfix_str(name, refresh=False)
            out = t.make()
            bar.update(1)
            return out
        return LazyTensor(t.shape, t.dtype, make)

    return {n: ticking(n, t) if isinstance(t, LazyTensor) else t for n, t in tensors.items()}, bar


def convert_hf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str = "f16",
               predictors_dir: str | os.PathLike[str] | None = None, sparse: bool | None = None,
               progress: bool = True) -> Path:
    """Convert the HF model in ``hf_dir`` into a GGUF model file at ``out_path``.

    ``outtype`` is the storage type of matrices (norms and biases stay f32; in q8_0 / q4_0
    files some matrices differ, see ``quants.storage_kind``); ``predictors_dir``
    holds upstream's per-layer ``model_{l}.pt`` predictors; ``sparse`` stamps the ``PWRI`` magic
    (default: when predictors are given). The file appears only once complete.
    """
    hf_dir, out = Path(hf_dir), Path(out_path)
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype is {outtype!r}, expected one of {OUTTYPES}")
    hf = HFConfig.read(hf_dir)
    ck = Checkpoint(hf_dir)
    try:
        plan = planner_for(hf)(hf, ck, outtype, hf_dir.resolve().name)
    except ConfigError as exc:  # sizes that contradict each other, e.g. heads not dividing hidden_size
        raise ConvertError(f"{hf.path}: {exc}") from None
    ck.warn_unused()
    if predictors_dir is not None:
        plan = add_predictors(plan, Path(predictors_dir), outtype)
    metadata = {K.FILE_TYPE: FILE_TYPE[outtype], **tokenizer_metadata(hf_dir, hf, plan.cfg.n_vocab)}
    plan.tensors = {n: LazyTensor(t.shape, storage_kind(outtype, n, t.shape), t.make)  # the block types' exceptions
                    if isinstance(t, LazyTensor) and t.dtype == outtype else t for n, t in plan.tensors.items()}
    tensors, bar = with_progress(plan.tensors, f"converting {hf_dir.name}") if progress else (plan.tensors, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    try:
        write_model(tmp, plan.cfg, tensors, metadata=metadata, sparse=sparse)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return out
