"""ModelCosts sizes against hand-computed byte counts; HostProfile defaults and files."""
import json

import pytest

from powerinfer_ray.placement import CostsError, HostProfile, HostProfileError, ModelCosts

# A tiny shape whose sizes are easy to count by hand.
SHAPE = dict(n_layer=2, n_embd=8, n_ff=16, n_head=4, n_head_kv=2, n_vocab=10, gated=True,
             dtype_bytes=2, predictor_ranks=[3, 5], n_ctx=6, batch=2)


def test_from_shape_matches_hand_count():
    c = ModelCosts.from_shape(**SHAPE, workspace_bytes=100)
    # one row of n_embd=8 fp16 elements = 16 B; a gated neuron = up + gate + down_t rows = 48 B
    assert c.neuron_bytes == (48, 48)
    # head_dim 2, 2 query heads per KV group: q 4 rows (64 B) + o 4 columns (64 B)
    # + k 2 rows (32 B) + v 2 rows (32 B) = 192 B
    assert c.attn_group_bytes == (192, 192)
    assert c.attn_layer_bytes == (384, 384)  # 2 KV groups
    # K and V: 2 x head_dim 2 x (6 ctx x 2 batch) tokens x 2 B = 96 B per group
    assert c.kv_group_bytes == (96, 96)
    # fc1 8x3 + fc2 3x16 = 72 params = 144 B; fc1 8x5 + fc2 5x16 = 120 params = 240 B
    assert c.predictor_bytes == (144, 240)
    # embeddings + output head 2 x 10x8x2 = 320 B; norms (2 per layer + final) x (w + b) x 8 x 4 B = 320 B
    assert c.dense_bytes == 640
    assert c.fixed_bytes == 640 + 144 + 240 + 100
    assert c.attention_bytes == 2 * 2 * (192 + 96)
    assert c.ffn_bytes == 2 * 16 * 48
    assert c.total_bytes == 1124 + 1152 + 1536
    assert c.min_budget_bytes(attention_placeable=True) == 1124
    assert c.min_budget_bytes(attention_placeable=False) == 1124 + 1152


def test_from_shape_variants():
    plain = ModelCosts.from_shape(**{**SHAPE, "gated": False}, workspace_bytes=0)
    assert plain.neuron_bytes == (32, 32)  # up + down_t only
    tied = ModelCosts.from_shape(**SHAPE, tied_embeddings=True, workspace_bytes=0)
    assert tied.dense_bytes == 640 - 160
    # default workspace: fp32, min(512, 6 x 2) = 12 tokens x (4x8 + 2x16 + 10 + 4 heads x 6 ctx)
    auto = ModelCosts.from_shape(**SHAPE)
    assert auto.workspace_bytes == 4 * 12 * (32 + 32 + 10 + 24)
    per_layer = ModelCosts.from_shape(**{**SHAPE, "n_ff": [16, 32]}, workspace_bytes=0)
    assert per_layer.n_ff == (16, 32) and per_layer.ffn_bytes == 48 * 48


@pytest.mark.parametrize("change, field", [
    (dict(n_head_kv=3), "n_head_kv"), (dict(n_embd=9), "n_embd"), (dict(n_layer=0), "n_layer"),
    (dict(predictor_ranks=[3]), "predictor_ranks"), (dict(n_ff=[16, 16, 16]), "n_ff"),
])
def test_from_shape_rejects_bad_shape(change, field):
    with pytest.raises(CostsError, match=field):
        ModelCosts.from_shape(**{**SHAPE, **change})


def test_costs_json_round_trip(tmp_path):
    c = ModelCosts.from_shape(**SHAPE)
    c.save(tmp_path / "c.json")
    assert ModelCosts.load(tmp_path / "c.json") == c
    (tmp_path / "s.json").write_text(json.dumps({"shape": SHAPE}))
    assert ModelCosts.load(tmp_path / "s.json") == c
    (tmp_path / "bad.json").write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(CostsError, match="bad.json.*missing"):
        ModelCosts.load(tmp_path / "bad.json")


def test_host_defaults_are_design_measurements():
    h = HostProfile()
    assert (h.hbm_gbs, h.dram_gbs, h.pcie_h2d_gbs, h.sync_us) == (4190.0, 180.0, 55.0, 45.0)
    assert h.host_ram_bytes is None


def test_host_file_round_trip_and_missing(tmp_path):
    h = HostProfile(dram_gbs=150.0, sync_us=30.0, cpu_threads=8, host_ram_bytes=1 << 34)
    h.save(tmp_path / "h.json")
    assert HostProfile.load(tmp_path / "h.json") == h
    assert HostProfile.load(tmp_path / "absent.json") == HostProfile()


@pytest.mark.parametrize("text, match", [
    ("{not json", "h.json.*parse error"),
    ('{"dram_gb": 100}', "h.json.*unknown keys.*dram_gb"),
    ('{"dram_gbs": -1}', "h.json.*dram_gbs.*positive"),
    ('{"cpu_threads": 2.5}', "cpu_threads"),
    ("[1, 2]", "h.json.*JSON object"),
])
def test_host_bad_files_name_the_file_and_field(tmp_path, text, match):
    (tmp_path / "h.json").write_text(text)
    with pytest.raises(HostProfileError, match=match):
        HostProfile.load(tmp_path / "h.json")
