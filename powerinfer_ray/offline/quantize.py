"""``powerinfer-ray quantize IN.gguf OUT.gguf q8_0|q4_0``: an existing GGUF / PWRI model file with
its matrices re-stored in ggml blocks, like upstream's ``quantize`` tool.

It streams tensor by tensor (a model larger than RAM quantizes) with a progress bar. Tensors go
where ``quants.storage_kind`` says, as in ``convert --outtype``: every matrix at the type,
predictors included (upstream: Q4_0 predictors in a Q4_0 file), ``output.weight`` at Q8_0 in a
Q4_0 file, matrices whose rows are not whole blocks at F16, 1-D tensors at F32, I32 as is. A
tensor already stored as its target type is copied byte for byte; one in another quantized
type (Q6_K, K-quants, IQ types: whatever gguf can dequantize) is dequantized and quantized
again. Metadata is copied with its types (``general.file_type`` set), and so is the magic.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGUFValueType
from gguf import quants as gguf_quants
from gguf.gguf_reader import GGUFReader, ReaderField, ReaderTensor
from gguf.gguf_writer import GGUFValue

from ..model import gguf_keys as K
from ..model.gguf_file import ModelFile, open_gguf
from ..model.gguf_writer import LazyTensor, write_gguf
from ..model.qtypes import FILE_TYPE, KIND_OF, QTYPES, storage_kind

log = logging.getLogger(__name__)


def quantize_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str,
                  progress: bool = True) -> Path:
    """Write ``src``'s model to ``dst`` with its matrices as ``qtype`` blocks (see the module
    docstring); the file appears only once complete."""
    if qtype not in QTYPES:
        raise ValueError(f"quantize: type {qtype!r}, expected one of {QTYPES}")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"quantize: output {dst} is the input file; name another file")
    reader = open_gguf(src)
    fields = copied_fields(reader)
    fields[K.FILE_TYPE] = GGUFValue(FILE_TYPE[qtype], GGUFValueType.UINT32)
    arch = str(fields.pop(K.ARCH).value)
    tensors = [_plan(t, qtype) for t in reader.tensors]
    again = sorted({t.tensor_type.name for t, (_, _, kind) in zip(reader.tensors, tensors)
                    if KIND_OF.get(t.tensor_type) not in ("f32", "f16", "bf16", "i32", kind)})
    if again:
        log.warning("%s: tensors stored as %s are dequantized and quantized again, which loses more than "
                    "quantizing the float weights once (convert the HF checkpoint for the best quality)",
                    src, ", ".join(again))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    try:
        write_gguf(tmp, arch, fields, tensors, progress=progress)
        if src.open("rb").read(4) == K.PWRI_MAGIC:
            with tmp.open("r+b") as fh:
                fh.write(K.PWRI_MAGIC)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def copied_fields(reader: GGUFReader) -> dict[str, GGUFValue]:
    """A file's metadata (``general.architecture`` included) with its GGUF types, to be written
    as it was (``gguf_writer.write_gguf``)."""
    return {f.name: _typed(f) for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def _typed(f: ReaderField) -> GGUFValue:
    """A metadata field's value with its GGUF types, to be written as it was."""
    sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
    return GGUFValue(f.contents(), f.types[0], sub)


def _plan(t: ReaderTensor, qtype: str) -> tuple[str, LazyTensor, str]:
    """(name, what to write, storage kind) for one tensor of the input file."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy shape in weights
    kind_in = KIND_OF.get(t.tensor_type)
    kind = "i32" if kind_in == "i32" else storage_kind(qtype, t.name, shape)
    return t.name, LazyTensor(shape, kind, _maker(t, kind_in == kind, shape)), kind


def _maker(t: ReaderTensor, same: bool, shape: tuple[int, ...]) -> Callable[[], Any]:
    """The tensor as stored (kept: its blocks or its values) or as float32 weights (converted)."""
    def make() -> Any:
        data = np.array(t.data)  # a copy: torch takes no read-only memory maps
        if same:
            if KIND_OF[t.tensor_type] == "bf16":
                return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
            return data
        try:
            return gguf_quants.dequantize(data, t.tensor_type).reshape(shape)
        except NotImplementedError:
            raise ValueError(f"tensor {t.name!r}: gguf cannot dequantize type {t.tensor_type.name}; "
                             "convert the model from its HF checkpoint instead") from None
    return make


@torch.no_grad()
def quantization_quality(reference: str | os.PathLike[str], quantized: str | os.PathLike[str],
                         text: Any = "builtin:heldout", seq_len: int = 256,
                         max_tokens: int | None = 4096) -> dict[str, Any]:
    """What quantizing cost, on the dense reference path: perplexity of each model's dense
    forward over windows of ``text`` (a corpus ``offline.corpus.iter_texts`` reads), and the
    share of positions where the quantized model's next-token argmax is the reference's."""
    from ..model.reference import ReferenceModel
    from ..model.tokenizer import Tokenizer
    from .corpus import iter_texts
    from .stream import token_windows

    models = {"reference": ReferenceModel.from_file(reference), "quantized": ReferenceModel.from_file(quantized)}
    tok = Tokenizer(ModelFile(reference).fields)
    budget = None if max_tokens is None else max_tokens + max_tokens // seq_len  # windows hold seq_len + 1
    nll, agree, n = dict.fromkeys(models, 0.0), 0, 0
    for window in token_windows(tok, iter_texts(text), seq_len + 1, budget):
        target = torch.tensor(window[1:])
        logits = {k: m.forward(window[:-1], m.new_cache()) for k, m in models.items()}  # [T, V] each
        for k, v in logits.items():
            nll[k] += float(torch.nn.functional.cross_entropy(v.float(), target, reduction="sum"))
        agree += int((logits["reference"].argmax(-1) == logits["quantized"].argmax(-1)).sum())
        n += seq_len
    if n == 0:
        raise ValueError(f"text gave no window of {seq_len + 1} tokens: pass more text")
    ppl = {k: math.exp(v / n) for k, v in nll.items()}
    return {"tokens": n, "seq_len": seq_len, "ppl_reference": ppl["reference"], "ppl_quantized": ppl["quantized"],
            "ppl_ratio": ppl["quantized"] / ppl["reference"], "top1_agreement": agree / n}
