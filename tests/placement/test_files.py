"""Split file (upstream .gpuidx), our placement file, activation statistics, run_solve."""
import json
import struct

import gguf
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from powerinfer_ray.placement import (GIB, HostProfile, ModelCosts, PlacementError, StatsError, activation_pt_files,
                                      gpuidx_path, load_placement, placement_from_gpuidx,
                                      read_activation_parquet, read_gpuidx,
                                      run_solve, save_placement, solve_placement, write_activation_parquet,
                                      write_gpuidx)
from powerinfer_ray.placement.gpuidx import GpuIndexError

MASKS = [np.array([1, 0, 1, 1, 0], dtype=bool), np.zeros(5, dtype=bool), np.array([0, 1, 0, 0, 1], dtype=bool)]


def _hand_gpuidx(masks, capacity: int, type_id: int, magic: bytes = b"GGUF") -> bytes:
    """Upstream's split file assembled byte by byte (GGUF v3, alignment 32, little endian):
    keys general.architecture, generic.gpu_index.block_count, split.vram_capacity; per layer
    blk.l.gpu_idx then blk.l.gpu_bucket, int32 data stored with tensor type ``type_id``."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    pad = lambda n: (-n) % 32  # noqa: E731
    kv = (string("general.architecture") + struct.pack("<I", 8) + string("generic.gpu_index")
          + string("generic.gpu_index.block_count") + struct.pack("<II", 4, len(masks))
          + string("split.vram_capacity") + struct.pack("<IQ", 10, capacity))
    datas = []
    for l, m in enumerate(masks):
        datas += [(f"blk.{l}.gpu_idx", np.asarray(m, "<i4")), (f"blk.{l}.gpu_bucket", np.flatnonzero(m).astype("<i4"))]
    infos, blobs, offset = b"", b"", 0
    for name, d in datas:
        infos += string(name) + struct.pack("<IQIQ", 1, d.size, type_id, offset)
        blob = d.tobytes()
        blobs += blob + bytes(pad(len(blob)))
        offset += len(blob) + pad(len(blob))
    head = magic + struct.pack("<IQQ", 3, len(datas), 3) + kv + infos
    return head + bytes(pad(len(head))) + blobs


def test_gpuidx_is_upstreams_file_byte_for_byte(tmp_path):
    """We write what upstream writes (I32 as type id 18, tensors 2l, 2l+1), and read upstream's
    files: type 18 or gguf-py's I32 (26), magic GGUF or PWRI."""
    path = tmp_path / "m.gguf.generated.gpuidx"
    write_gpuidx(path, MASKS, vram_capacity=12345)
    assert path.read_bytes() == _hand_gpuidx(MASKS, 12345, 18)
    for type_id, magic in ((18, b"GGUF"), (18, b"PWRI"), (26, b"GGUF"), (26, b"PWRI")):
        hand = tmp_path / f"hand-{type_id}-{magic.decode()}.gpuidx"
        hand.write_bytes(_hand_gpuidx(MASKS, 777, type_id, magic))
        index = read_gpuidx(hand, n_ff=[5, 5, 5])
        assert index.vram_capacity == 777, (type_id, magic)
        assert [m.tolist() for m in index.gpu_neurons] == [m.tolist() for m in MASKS], (type_id, magic)


def test_gpuidx_of_an_upstream_sized_layer(tmp_path):
    """n_ff = 13824 (Llama-2-13B): gguf-py would read type 18 as IQ3_XXS blocks of 256; we read
    upstream's int32 data."""
    rng = np.random.default_rng(0)
    masks = [rng.random(13824) < 0.3 for _ in range(2)]
    path = tmp_path / "u.gpuidx"
    path.write_bytes(_hand_gpuidx(masks, 5 << 30, 18, b"PWRI"))
    index = read_gpuidx(path, n_ff=[13824, 13824])
    assert index.vram_capacity == 5 << 30
    assert all(np.array_equal(a, b) for a, b in zip(index.gpu_neurons, masks))
    write_gpuidx(tmp_path / "ours.gpuidx", masks, 5 << 30)
    assert (tmp_path / "ours.gpuidx").read_bytes()[4:] == path.read_bytes()[4:]  # all but the magic


def test_cached_split_written_by_upstream_is_used(tmp_path):
    """A split file beside the model, in upstream's bytes (type 18), whose vram_capacity fits the
    budget (upstream's rule) and whose bytes fit it at the engine's batch and context, is the plan,
    not re-solved."""
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.model.tiny import write_tiny_model
    from powerinfer_ray.runtime.config import GIB, EngineConfig, engine_costs, resolve_plan, split_bytes

    model = write_tiny_model(tmp_path / "m.gguf", predictor_rank=8)  # n_ff 256, 2 layers
    masks = [np.arange(256) % 3 == 0, np.arange(256) >= 200]
    gpuidx_path(model).write_bytes(_hand_gpuidx(masks, 1000, 18))
    need = split_bytes(engine_costs(EngineConfig(str(model)), open_model(model)), masks)
    plan = resolve_plan(EngineConfig(str(model), vram_budget_gib=need / GIB))
    assert [lp.gpu_neurons.tolist() for lp in plan.layers] == [np.flatnonzero(m).tolist() for m in masks]


def test_gpuidx_round_trip_and_pwri_magic(tmp_path):
    path = tmp_path / "a.gpuidx"
    write_gpuidx(path, MASKS, vram_capacity=7)
    index = read_gpuidx(path, n_ff=[5, 5, 5])
    assert index.vram_capacity == 7
    assert [m.tolist() for m in index.gpu_neurons] == [m.tolist() for m in MASKS]
    with open(path, "r+b") as f:  # what upstream's export_split does after writing
        f.write(b"PWRI")
    assert [m.tolist() for m in read_gpuidx(path).gpu_neurons] == [m.tolist() for m in MASKS]
    assert gpuidx_path("/x/model.gguf").name == "model.gguf.generated.gpuidx"


def _write_raw(path, tensors, capacity=1):
    w = gguf.GGUFWriter(str(path), "generic.gpu_index")
    w.add_uint64("split.vram_capacity", capacity)
    for name, data in tensors:
        w.add_tensor(name, np.asarray(data, dtype=np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("tensors, match", [
    ([("blk.0.gpu_bucket", [0]), ("blk.0.gpu_idx", [1, 0])], r"position 0 expected 'blk.0.gpu_idx'"),
    ([("blk.0.gpu_idx", [1, 0])], "2 tensors per layer"),
    ([("blk.0.gpu_idx", [1, 0]), ("blk.0.gpu_bucket", [1])], "gpu_bucket expected the sorted ids"),
    ([("blk.0.gpu_idx", [2, 0]), ("blk.0.gpu_bucket", [0])], "0/1 values"),
])
def test_gpuidx_bad_files(tmp_path, tensors, match):
    path = tmp_path / "bad.gpuidx"
    _write_raw(path, tensors)
    with pytest.raises(GpuIndexError, match=f"bad.gpuidx.*{match}"):
        read_gpuidx(path)


def test_our_keys_round_trip_and_bad_groups_are_named(tmp_path):
    groups = np.array([[True, False], [False, False], [True, True]])
    write_gpuidx(tmp_path / "o.gpuidx", MASKS, 5, budget_bytes=1 << 30, gpu_attention=groups)
    index = read_gpuidx(tmp_path / "o.gpuidx", n_ff=[5, 5, 5])
    assert index.budget_bytes == 1 << 30 and index.gpu_attention.tolist() == groups.tolist()
    assert index.vram_capacity == 5 and index.magic == b"GGUF"
    with pytest.raises(GpuIndexError, match=r"gpu_attention: expected a bool array \[3, K\]"):
        write_gpuidx(tmp_path / "b.gpuidx", MASKS, 5, gpu_attention=groups[:2])
    w = gguf.GGUFWriter(str(tmp_path / "b.gpuidx"), "generic.gpu_index")
    w.add_uint64("split.vram_capacity", 5)
    w.add_array("powerinfer_ray.split.gpu_attention", [1, 0, 2, 1])  # 2 of 3 layers, a 2
    for l, m in enumerate(MASKS):
        w.add_tensor(f"blk.{l}.gpu_idx", m.astype(np.int32), raw_dtype=gguf.GGMLQuantizationType(18))
        w.add_tensor(f"blk.{l}.gpu_bucket", np.flatnonzero(m).astype(np.int32), raw_dtype=gguf.GGMLQuantizationType(18))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GpuIndexError, match="b.gpuidx: powerinfer_ray.split.gpu_attention expected 0/1 values"):
        read_gpuidx(tmp_path / "b.gpuidx")


def test_gpuidx_wrong_magic_and_shape(tmp_path):
    path = tmp_path / "x.gpuidx"
    path.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(GpuIndexError, match="x.gpuidx.*magic"):
        read_gpuidx(path)
    write_gpuidx(path, MASKS, 1)
    with pytest.raises(GpuIndexError, match="length n_ff=6"):
        read_gpuidx(path, n_ff=[6, 6, 6])
    with pytest.raises(GpuIndexError, match="expected 2 layers"):
        read_gpuidx(path, n_ff=[5, 5])


def test_placement_from_upstream_split_file(tmp_path):
    write_gpuidx(tmp_path / "u.gpuidx", MASKS, vram_capacity=99)
    placement = placement_from_gpuidx(read_gpuidx(tmp_path / "u.gpuidx"), n_kv_groups=2, budget_bytes=1000)
    assert placement.gpu_counts() == [3, 0, 2] and placement.gpu_attention.all()
    costs = ModelCosts(n_layer=3, n_ff=(5,) * 3, neuron_bytes=(100,) * 3, n_kv_groups=2, attn_group_bytes=(0,) * 3,
                       kv_group_bytes=(0,) * 3, predictor_bytes=(0,) * 3, dense_bytes=0, workspace_bytes=0)
    placement.verify(costs)
    with pytest.raises(PlacementError, match="eq. 4"):
        placement.verify(costs, budget_bytes=499)


def test_placement_file_round_trip(tmp_path):
    costs = ModelCosts(n_layer=3, n_ff=(5, 5, 5), neuron_bytes=(10,) * 3, n_kv_groups=2,
                       attn_group_bytes=(4,) * 3, kv_group_bytes=(1,) * 3, predictor_bytes=(0,) * 3,
                       dense_bytes=0, workspace_bytes=0)
    counts = [np.array([5, 1, 4, 3, 2])] * 3
    # attention units: 5 B, impact 0.2 x 5/10 = 0.1 (0.02 per B) < neurons of frequency .5 and .4
    # (0.05, 0.04 per B): 45 B = three .5 neurons + one .4 neuron + one attention unit
    placement = solve_placement(counts, 10, costs, 45, HostProfile(sync_us=0), group_size=1,
                                attention_placeable=True, attention_weight=0.2)
    assert sum(placement.gpu_counts()) == 4 and placement.gpu_attention.sum() == 1
    save_placement(tmp_path / "p.npz", placement)
    back = load_placement(tmp_path / "p.npz")
    assert [m.tolist() for m in back.gpu_neurons] == [m.tolist() for m in placement.gpu_neurons]
    assert back.gpu_attention.tolist() == placement.gpu_attention.tolist()
    for field in ("budget_bytes", "objective", "status", "gpu_share", "method", "group_size", "min_gpu_neurons"):
        assert getattr(back, field) == getattr(placement, field)
    back.verify(costs)
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(GpuIndexError, match="junk.npz"):
        load_placement(tmp_path / "junk.npz")


# --- activation statistics -------------------------------------------------------------------------
def test_parquet_round_trip(tmp_path):
    counts = [np.array([3, 0, 7]), np.array([1, 2, 0, 9])]
    write_activation_parquet(tmp_path / "a.parquet", counts, n_tokens=10)
    stats = read_activation_parquet(tmp_path / "a.parquet")
    assert stats.n_tokens == 10 and [c.tolist() for c in stats.counts] == [c.tolist() for c in counts]
    schema = pq.read_schema(tmp_path / "a.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [("layer", "int32"), ("neuron", "int32"), ("count", "int64")]


def test_parquet_from_another_writer(tmp_path):
    # sparse rows (zeros left out), no n_ff metadata: the model's n_ff fills the gaps
    table = pa.table({"layer": pa.array([1, 0, 1], pa.int32()), "neuron": pa.array([3, 0, 1], pa.int32()),
                      "count": pa.array([4, 5, 6], pa.int64())}).replace_schema_metadata({"n_tokens": "8"})
    pq.write_table(table, tmp_path / "s.parquet")
    stats = read_activation_parquet(tmp_path / "s.parquet", n_ff=[2, 4])
    assert [c.tolist() for c in stats.counts] == [[5, 0], [0, 6, 0, 4]]


@pytest.mark.parametrize("columns, meta, match", [
    ({"layer": [0], "neuron": [0], "count": [1]}, {}, "n_tokens"),
    ({"layer": [0], "neuron": [0]}, {"n_tokens": "5"}, "missing.*count"),
    ({"layer": [0, 0], "neuron": [1, 1], "count": [1, 2]}, {"n_tokens": "5"}, "more than once"),
    ({"layer": [0], "neuron": [0], "count": [-1]}, {"n_tokens": "5"}, "count expected >= 0"),
    ({"layer": [0], "neuron": [0], "count": [1.5]}, {"n_tokens": "5"}, "count expected integers"),
])
def test_parquet_bad_files(tmp_path, columns, meta, match):
    pq.write_table(pa.table(columns).replace_schema_metadata(meta), tmp_path / "bad.parquet")
    with pytest.raises(StatsError, match=f"bad.parquet.*{match}"):
        read_activation_parquet(tmp_path / "bad.parquet")


def test_activation_pt_files_sorted_numerically(tmp_path):
    for l in range(12):
        (tmp_path / f"activation_{l}.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert [p.name for p in activation_pt_files(tmp_path)] == [f"activation_{l}.pt" for l in range(12)]
    (tmp_path / "activation_5.pt").unlink()
    with pytest.raises(StatsError, match=r"missing layers \[5\]"):
        activation_pt_files(tmp_path)


# --- the CLI's entry point ---------------------------------------------------------------------------
def test_run_solve_end_to_end(tmp_path):
    shape = dict(n_layer=4, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, n_vocab=100, gated=True,
                 dtype_bytes=2, predictor_ranks=[16] * 4, n_ctx=128, batch=1)
    costs = ModelCosts.from_shape(**shape)
    (tmp_path / "shape.json").write_text(json.dumps({"shape": shape}))
    HostProfile(sync_us=0.005).save(tmp_path / "host.json")
    rng = np.random.default_rng(0)
    counts = [rng.binomial(1000, np.minimum(1, 0.6 * np.arange(1, 257) ** -0.7)[rng.permutation(256)])
              for _ in range(4)]
    write_activation_parquet(tmp_path / "act.parquet", counts, 1000)
    budget_gib = (costs.fixed_bytes + costs.attention_bytes + costs.ffn_bytes // 3) / GIB
    placement = run_solve(tmp_path / "act.parquet", tmp_path / "shape.json", budget_gib,
                          host=tmp_path / "host.json", gpuidx_out=tmp_path / "m.gpuidx",
                          placement_out=tmp_path / "p.npz", group_size=16)
    placement.verify(costs, int(budget_gib * GIB))
    assert 0 < sum(placement.gpu_counts()) < 4 * 256 and placement.gpu_attention.all()
    index = read_gpuidx(tmp_path / "m.gpuidx", costs.n_ff)
    assert [m.tolist() for m in index.gpu_neurons] == [m.tolist() for m in placement.gpu_neurons]
    assert index.vram_capacity == sum(placement.gpu_counts()) * costs.neuron_bytes[0]
    assert load_placement(tmp_path / "p.npz").objective == placement.objective
    # the same stats as arrays (as loaded from upstream's .pt files) give the same placement
    same = run_solve(counts, costs, budget_gib, n_tokens=1000, host=HostProfile(sync_us=0.005), group_size=16)
    assert [m.tolist() for m in same.gpu_neurons] == [m.tolist() for m in placement.gpu_neurons]
    with pytest.raises(StatsError, match="n_tokens"):
        run_solve(counts, costs, budget_gib)
    assert run_solve(tmp_path, costs, budget_gib, host=HostProfile(sync_us=0.005),  # its one .parquet
                     group_size=16).objective == placement.objective
    (tmp_path / "empty").mkdir()
    with pytest.raises(StatsError, match="no Parquet file.*activation_pt_files"):
        run_solve(tmp_path / "empty", costs, budget_gib)
