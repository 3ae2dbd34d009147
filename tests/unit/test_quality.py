"""Dense vs predictor-sparse vs oracle-sparse forwards on the reference path."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.offline.corpus import frozen_documents
from powerinfer_ray.offline.quality import OracleHooks, RecordHooks, format_report, quality_report

TEXT = " ".join(frozen_documents("heldout")[:4])


@pytest.mark.parametrize("variant", ["llama-reglu", "llama-drelu", "llama-relu", "opt", "falcon"])
def test_oracle_mask_equals_dense(tmp_path, variant):
    path = write_tiny_model(tmp_path / "m.gguf", variant, n_ctx=64)
    ref = ReferenceModel.from_file(path)
    tokens = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    rec = RecordHooks()
    dense = ref.forward(tokens, ref.new_cache(), rec)
    assert sorted(rec.masks) == list(range(ref.cfg.n_layer))
    assert 0.05 < float(rec.masks[0].float().mean()) < 0.95  # the oracle really drops neurons
    oracle = ref.forward(tokens, ref.new_cache(), OracleHooks(rec.masks))
    torch.testing.assert_close(oracle, dense, rtol=0, atol=1e-5)


def test_quality_report_on_a_seeded_sparse_model(tmp_path):
    path = write_tiny_model(tmp_path / "s.gguf", "llama-reglu", n_ctx=64, predictor_rank=16)
    r = quality_report(path, TEXT, seq_len=64, max_tokens=256)
    assert r["tokens"] == 256 and r["threshold"] == 0.0
    assert r["ppl_oracle"] == pytest.approx(r["ppl_dense"], rel=1e-5)
    assert r["oracle_top1_agreement"] == 1.0 and r["oracle_max_abs_logit_diff"] < 1e-4
    assert 0.0 <= r["top1_agreement"] <= 1.0
    assert len(r["layers"]) == 2 and all(0 <= s["recall"] <= 1 for s in r["layers"])
    assert "top-1 agreement" in format_report(r)


def test_quality_report_needs_predictors(tmp_path):
    path = write_tiny_model(tmp_path / "d.gguf", "llama-reglu", n_ctx=64)
    with pytest.raises(ValueError, match="no predictors"):
        quality_report(path, TEXT, seq_len=64, max_tokens=128)
