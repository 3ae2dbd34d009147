"""The hybrid runtime without Ray: executors over the real shared-memory channel (the CPU
executor serves in a thread), checked against the dense reference forward."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import torch
from bursts import greedy_burst
from quant_models import match_rounding
from ties import DecisionReference, assert_greedy, assert_same_up_to_ties, predictor_weights

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.planted import planted_model
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime.channel import OP_FFN, REQUEST_FIELDS, Channel, PeerDied, pack_mask, unpack_mask
from powerinfer_ray.runtime import cold as cold_module
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.graphs import DecodeGraphs, ShareChoice, bucket_of, buckets
from powerinfer_ray.runtime.layers import add_partials
from powerinfer_ray.runtime.plan import Plan
from powerinfer_ray.runtime.shard import load_attn_shard, load_ffn_shard

VARIANTS = ["llama-reglu", "llama-gqa", "llama-drelu", "llama-swiglu", "qwen2", "opt", "falcon", "falcon-gqa"]


def _plans(cfg):
    rng = np.random.default_rng(0)
    random_masks = [rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)]
    half_groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return {
        "all-gpu": Plan.all_gpu(cfg),
        "all-cpu": Plan.all_cpu(cfg),
        "mixed": Plan.from_masks(random_masks, None, cfg),
        "split-heads": Plan.from_masks(random_masks, half_groups, cfg),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {v: write_tiny_model(d / f"{v}.gguf", v, seed=1, n_layer=3, n_ctx=64) for v in VARIANTS}


def _run_steps(engine: LocalEngine, prompt: list[int], decode: list[int], chunk: int) -> list[np.ndarray]:
    """Prefill in chunks, then cached decode steps; the logits of every position."""
    out, pos = [], 0
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        out.append(engine.primary.step([0], [part], [pos])[0])
        pos += len(part)
    for t in decode:
        out.append(engine.primary.step([0], [[t]], [pos])[0])
        pos += 1
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", ["all-gpu", "all-cpu", "mixed", "split-heads"])
def test_oracle_masks_equal_dense_reference(models, variant, split):
    path = models[variant]
    ref = ReferenceModel.from_file(path)
    plan = _plans(ref.cfg)[split]
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="oracle", prefill_chunk=8, max_batch=2))
    try:
        prompt, decode = list(range(3, 20)), [7, 99, 150, 3, 42]
        got = _run_steps(eng, prompt, decode, chunk=8)
        cache = ref.new_cache()
        full = ref.forward(prompt + decode, cache)  # [T, V]
        want = [full[len(prompt[:i + 8]) - 1] for i in range(0, len(prompt), 8)]
        want += [full[len(prompt) + j] for j in range(len(decode))]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-4)
        if split != "all-gpu":
            assert eng.cpu is not None and eng.cpu.stats.exchanges > 0
    finally:
        eng.close()


@pytest.mark.parametrize("variant, dtype", [("llama-reglu", "f32"), ("opt", "f32"), ("falcon-gqa", "f32"),
                                            ("opt", "f16")])  # f16: OPT's fp32 up bias in fp16 compute
def test_dense_prefill_of_the_cpu_shard_equals_the_exchange(tmp_path, variant, dtype):
    """Long prompts run the CPU shard's neurons densely on the primary (rows streamed from host
    memory, predictor mask applied): the same logits as the per-layer exchange path."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=4, n_layer=2, n_ctx=64, predictor_rank=16)
    cfg = ReferenceModel.from_file(path).cfg
    plan = _plans(cfg)["split-heads"]
    prompt = list(range(3, 23))
    out = {}
    for dense_min in (0, 8):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=0.3,
                                       prefill_chunk=32, prefill_dense_min=dense_min, dtype=dtype))
        try:
            out[dense_min] = (eng.primary.step([0], [prompt], [0])[0], eng.primary.step([0], [[9]], [20])[0],
                              eng.cpu.stats.neurons, eng.primary.stats.neurons, eng.primary.stats.cold_neurons)
        finally:
            eng.close()
    tol = 1e-4 if dtype == "f32" else 2e-2
    for i in (0, 1):
        a, b = torch.from_numpy(out[8][i]).float(), torch.from_numpy(out[0][i]).float()
        assert float((a - b).abs().max() / b.abs().max()) < tol
    assert out[8][2] < out[0][2]  # the CPU executor computed only the decode step's neurons
    # the same predicted neurons either way (fp16: up to a rounding flip of a logit at the
    # threshold); those of the CPU shard count as the CPU's in the GPU share
    slack = 0 if dtype == "f32" else out[0][2] // 100
    assert out[0][4] == 0 and abs(out[8][3] - out[0][3]) <= slack
    assert abs(out[8][4] + out[8][2] - out[0][2]) <= slack


@pytest.mark.parametrize("variant, dtype", [("llama-reglu", "f32"), ("opt", "f32"), ("falcon-gqa", "f32"),
                                            ("llama-gqa", "f16")])
def test_prefill_share_streams_the_hottest_rows_and_equals_the_masked_reference(tmp_path, variant, dtype,
                                                                                 monkeypatch):
    """A prompt chunk with a prefill share: the primary streams that share of each layer's CPU rows (the
    first of the shard, hottest first) through its two buffers, in chunks of 5 rows here (the buffers
    taking turns within and across layers), and computes their predicted neurons; the CPU executor
    computes the rest. At shares 0, 0.4 and 1 the logits equal the reference forward under the same
    predictor masks, the CPU's predicted neurons split between the two executors exactly, and the
    streamed bytes are the streamed rows'."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=7, n_layer=3, n_ctx=64, predictor_rank=16)
    ref = ReferenceModel.from_file(path)
    cfg, thr = ref.cfg, 0.3
    plan = _plans(cfg)["split-heads"]
    monkeypatch.setattr(cold_module, "STREAM_BYTES", 5 * cfg.neuron_bytes)
    prompt = list(range(3, 23))
    masked = DecisionReference(ref, predictor_weights(ModelFile(path), cfg.n_layer, thr))
    full = masked.forward(prompt + [9], masked.new_cache())
    runs = {}
    for share in (0.0, 0.4, 1.0):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=thr, prefill_chunk=32,
                                       prefill_dense_min=0, prefill_share=share, dtype=dtype))
        try:
            got = [eng.primary.step([0], [prompt], [0])[0], eng.primary.step([0], [[9]], [20])[0]]
            assert eng.primary.cold.stream is None or eng.primary.cold.stream.rows == 5
            st = eng.primary.stats
            runs[share] = (st.neurons, st.cold_neurons, eng.cpu.stats.neurons, st.streamed_bytes)
        finally:
            eng.close()
        tol = 1e-4 if dtype == "f32" else 2e-2
        for g, w in zip(got, [full[len(prompt) - 1], full[-1]]):
            assert float((torch.from_numpy(g).float() - w).abs().max() / w.abs().max()) < tol
    own, none, cpu_alone, _ = runs[0.0]
    assert none == 0 and runs[0.0][3] == 0
    slack = 0 if dtype == "f32" else cpu_alone // 100  # f16: a logit at the threshold may flip
    for share in (0.4, 1.0):
        neurons, mine, cpu, streamed = runs[share]
        assert abs(neurons - own) <= slack and mine > 0 and abs(cpu + mine - cpu_alone) <= slack
        assert streamed == sum(round(len(lp.cpu_neurons) * share) for lp in plan.layers) * cfg.neuron_bytes
    assert runs[1.0][1] > runs[0.4][1]


def test_prompt_chunks_stream_by_their_length_on_cuda(tmp_path):
    """On CUDA, by default: chunks of at least 256 tokens stream every CPU row, chunks of 64-255 the
    hottest 0.3, shorter ones none (the CPU executor computes them); a share given applies to every
    chunk below the dense minimum; decode steps stream nothing. (The rule alone: a ColdRows for a
    CUDA device, never attached.)"""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=7, n_layer=2, n_ctx=64)
    src = ModelFile(path)
    plan, st = _plans(ReferenceModel.from_file(path).cfg)["mixed"], None
    cuda = torch.device("cuda")
    auto = cold_module.ColdRows(src, plan, torch.float16, cuda, st, None)
    given = cold_module.ColdRows(src, plan, torch.float16, cuda, st, None, prefill_share=0.6)
    for c in (auto, given):
        c.rows = []  # as if attached
    assert [auto.share_for(n) for n in (1, 16, 63, 64, 200, 255, 256, 3000)] == [0, 0, 0, .3, .3, .3, 1, 1]
    assert [given.share_for(n) for n in (1, 16, 64, 255, 256)] == [.6, .6, .6, .6, 1]
    assert auto.share_for(64, decode=True) == given.share_for(300, decode=True) == 0
    cpu = cold_module.ColdRows(src, plan, torch.float32, torch.device("cpu"), st, None)
    cpu.rows = []
    assert [cpu.share_for(n) for n in (16, 64, 3000)] == [0, 0, 0]  # a CPU primary streams nothing


def test_zero_copy_default_by_batch_and_rows_on_cuda(tmp_path):
    """On CUDA, by default, decode steps of at least ZERO_COPY_MIN_BATCH sequences take the ZERO_COPY
    share of the CPU's neurons over PCIe; steps of one sequence take ZERO_COPY_Q4_0 of Q4_0 rows and
    none of float or Q8_0 rows; a share given applies to every step; a CPU primary takes none. (The
    rule alone: ColdRows for a CUDA device, never attached.)"""
    from powerinfer_ray.offline.quantize import quantize_file

    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=7, n_layer=2, n_ctx=64)
    plan = _plans(ReferenceModel.from_file(path).cfg)["mixed"]
    cuda, c = torch.device("cuda"), cold_module
    srcs = {"f16": ModelFile(path)} | {q: ModelFile(quantize_file(path, tmp_path / f"{q}.gguf", q, progress=False))
                                        for q in ("q8_0", "q4_0")}
    batches = [1, 2, c.ZERO_COPY_MIN_BATCH - 1, c.ZERO_COPY_MIN_BATCH, 32]
    big = [0, 0, 0, c.ZERO_COPY, c.ZERO_COPY]
    for name, src in srcs.items():
        auto = c.ColdRows(src, plan, torch.float16, cuda, None, None, None)
        assert [auto.share(b) for b in batches] == [c.ZERO_COPY_Q4_0 if name == "q4_0" else 0] + big[1:], name
        given = c.ColdRows(src, plan, torch.float16, cuda, None, None, 0.2)
        assert [given.share(b) for b in batches] == [0.2] * len(batches)
        cpu = c.ColdRows(src, plan, torch.float32, torch.device("cpu"), None, None, None)
        assert [cpu.share(b) for b in batches] == [0] * len(batches)
    assert c.ZERO_COPY_Q4_0 > 0  # else the Q4_0 rows would not tell the rule from none


def test_batched_decode_equals_single_sequences(models):
    """Sequences of different lengths decoded together give each its own logits."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)["split-heads"], policy="oracle",
                                   prefill_chunk=16, max_batch=3))
    try:
        prompts = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3, 4, 5, 6]]
        for slot, p in enumerate(prompts):
            eng.primary.step([slot], [p], [0])
        nxt = [[11], [12], [13]]
        got = eng.primary.step([0, 1, 2], nxt, [len(p) for p in prompts])
        for slot, p in enumerate(prompts):
            want = ref.forward(p + nxt[slot], ref.new_cache())[-1]
            torch.testing.assert_close(torch.from_numpy(got[slot]), want, rtol=1e-4, atol=1e-4)
    finally:
        eng.close()


@pytest.mark.parametrize("split", ["mixed", "split-heads"])
def test_prompt_chunks_of_several_sequences_in_one_step_equal_single_sequences(models, split):
    """A prefill step of several sequences (equal token counts, each from its own position, as
    the scheduler groups queued prompts) gives each sequence its own logits."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)[split], policy="oracle", prefill_chunk=16,
                                   max_batch=3))
    try:
        prompts = [list(range(10, 22)), [5, 6, 7, 8, 9, 30, 31], [200, 1, 2, 3, 4, 5]]
        eng.primary.step([0], [prompts[0][:6]], [0])  # the first sequence is 6 tokens into its prompt
        got = eng.primary.step([0, 1, 2], [prompts[0][6:10], prompts[1][:4], prompts[2][:4]], [6, 0, 0])
        for slot, (p, end) in enumerate(zip(prompts, (10, 4, 4))):
            want = ref.forward(p[:end], ref.new_cache())[-1]
            torch.testing.assert_close(torch.from_numpy(got[slot]), want, rtol=1e-4, atol=1e-4)
    finally:
        eng.close()


def _decode_batch(eng: LocalEngine, prompts: list[list[int]], nxt: list[list[int]]) -> list[np.ndarray]:
    """Prefill each prompt in its slot, then decode steps of all sequences together (each at
    its own position), then one step of the first sequence alone; the logits of every step."""
    for slot, p in enumerate(prompts):
        eng.primary.step([slot], [p], [0])
    pos, out = [len(p) for p in prompts], []
    for toks in nxt:
        out.append(eng.primary.step(list(range(len(prompts))), [[t] for t in toks], pos))
        pos = [q + 1 for q in pos]
    out.append(eng.primary.step([0], [[8]], [pos[0]]))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
def test_graph_decode_segments_equal_dense_reference(models, variant, split):
    """The decode step as fixed-shape segments (graphs.py; captured as CUDA graphs on a GPU, run
    eagerly here) over every split, batched at different positions, equals the dense forward."""
    path = models[variant]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)[split], policy="dense", prefill_chunk=16,
                                   max_batch=4, graphs=True))
    try:
        prompts, nxt = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]], [[11, 12, 13], [40, 41, 42]]
        got = _decode_batch(eng, prompts, nxt)
        assert set(eng.primary.graphs) == {1, 2, 4}  # every bucket built at the start; 3 sequences padded to 4
        # the steps counted by kind: 3 prompts (eager), 2 batched decode steps and one alone (segments)
        assert (eng.primary.stats.steps, eng.primary.stats.graph_steps) == (len(prompts) + len(nxt) + 1, len(nxt) + 1)
        assert 0 < eng.primary.stats.graph_busy_s < eng.primary.stats.busy_s  # the segments' share of its time
        for slot, p in enumerate(prompts):
            full = ref.forward(p + [t[slot] for t in nxt] + ([8] if slot == 0 else []), ref.new_cache())
            for j in range(len(nxt)):
                torch.testing.assert_close(torch.from_numpy(got[j][slot]), full[len(p) + j], rtol=1e-4, atol=1e-4)
        full0 = ref.forward(prompts[0] + [t[0] for t in nxt] + [8], ref.new_cache())
        torch.testing.assert_close(torch.from_numpy(got[-1][0]), full0[-1], rtol=1e-4, atol=1e-4)
        if split != "all-gpu":
            assert eng.cpu.stats.exchanges > 0
    finally:
        eng.close()


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_decode_step_returns_each_sequences_argmax(models, graphs):
    """A decode step asked for the argmax alone (a greedy burst's steps: on the decode segments the
    step finds it itself, on a GPU inside the graph) returns each sequence's greedy next token under
    the float64 dense forward (rounding ties allowed), for 3 sequences in a bucket of 4 (a padding
    row) and for one alone, as the argmax of the same step's logits does."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)["mixed"], policy="dense", prefill_chunk=16,
                                   max_batch=4, graphs=graphs))
    try:
        prompts = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]]
        for slot, p in enumerate(prompts):
            eng.primary.step([slot], [p], [0])
        pos, seqs = [len(p) for p in prompts], [list(p) for p in prompts]
        for toks in ([11, 12, 13], [40, 41, 42]):
            ids = eng.primary.step([0, 1, 2], [[t] for t in toks], pos, argmax=True)
            assert ids.shape == (3,) and ids.dtype == np.int64
            for s, (t, i) in enumerate(zip(toks, ids)):
                seqs[s].append(t)
                assert_greedy(ref, seqs[s], [int(i)])
            pos = [q + 1 for q in pos]
        t = int(ids[1])
        one = eng.primary.step([1], [[t]], [pos[1]], argmax=True)
        logits = eng.primary.step([1], [[t]], [pos[1]])  # the same step again: its cache entry rewritten alike
        seqs[1].append(t)
        assert_greedy(ref, seqs[1], [int(one[0])])
        assert_greedy(ref, seqs[1], [int(logits[0].argmax())])
        assert eng.primary.stats.graph_steps == (4 if graphs else 0)
    finally:
        eng.close()


@pytest.mark.parametrize("split", ["mixed", "split-heads"])
def test_greedy_bursts_chain_their_steps_on_the_segments(models, split):
    """A greedy burst on the decode segments chains its steps: each step's inputs (the argmax, the
    next positions, the CPU heads' positions in the channel) come from the step before, not from the
    host. 3 sequences in the bucket of 4 (a padding row), a burst of 8: every token is greedy under
    the dense forward (ties allowed), and the samplers' states come back empty (greedy)."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)[split], policy="dense", max_batch=4, graphs=True))
    prompts = [list(range(5 + 3 * i, 11 + 3 * i)) for i in range(3)]
    try:
        for q, seq in zip(prompts, greedy_burst(eng.primary, prompts, 8)):
            assert_greedy(ref, q, seq)
    finally:
        eng.close()


def test_graph_buckets_cover_every_batch_size():
    """Decode batch sizes pad to powers of two up to the slots: hand-counted buckets, and every size's
    bucket is one of them and holds it."""
    assert [buckets(s) for s in (1, 2, 3, 6, 8, 32)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4, 6], [1, 2, 4, 8],
                                                         [1, 2, 4, 8, 16, 32]]
    for slots in range(1, 40):
        for n in range(1, slots + 1):
            assert bucket_of(n, slots) in buckets(slots) and bucket_of(n, slots) >= n


def test_every_bucket_is_built_before_serving_and_none_while_serving(models):
    """The engine builds the decode segments (captured graphs on a GPU) of every batch size it admits
    at its start; requests of different lengths served together (batches shrinking from 5 to 1) run
    every decode step on them and build none, and their tokens are the dense greedy ones."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)["mixed"], policy="dense", max_batch=6, graphs=True))
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(5)]
    lengths = [2, 3, 4, 5, 6]
    try:
        st = eng.primary.stats
        assert set(eng.primary.graphs) == {1, 2, 4, 6} and st.graph_captures == 4 and st.graph_steps == 0

        async def run():
            return await asyncio.gather(*(eng.generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True)
                                          for p, n in zip(prompts, lengths)))

        outs = asyncio.run(run())
        # (one-token prompt chunks of several prompts run on them too)
        assert st.graph_captures == 4 and st.graph_steps >= eng.coordinator.stats()["decode_steps"] > 0
        for p, n, out in zip(prompts, lengths, outs):
            assert out["token_ids"] == ref.generate_greedy(p, n)
    finally:
        eng.close()


@pytest.mark.parametrize("variant", ["opt", "llama-reglu"])
def test_dense_policy_reads_every_cpu_row_in_full(models, variant):
    """Policy 'dense' (the layer-offload baseline) reads every byte of the CPU executor's rows, as a
    dense FFN does: the down rows of zero activations too (ReLU / ReGLU zero most of them here;
    the counter is the kernel's, checked against hand counts in tests/kernels/test_cpu_bitmask.py),
    and its logits are the dense forward's."""
    path = models[variant]
    ref = ReferenceModel.from_file(path)
    plan = _plans(ref.cfg)["mixed"]
    full = sum(len(lp.cpu_neurons) for lp in plan.layers) * ref.cfg.neuron_bytes  # per step
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", prefill_chunk=16, max_batch=4))
    try:
        prompt, decode = [3, 4, 5, 6, 7], [9, 10, 11]
        got = _run_steps(eng, prompt, decode, 16)
        st = eng.cpu.stats
        assert st.exchanges == 4 * ref.cfg.n_layer  # one exchange per layer and step
        assert st.active_bytes == 4 * full
    finally:
        eng.close()
    want = ref.forward(prompt + decode, ref.new_cache())
    for g, w in zip(got, [want[len(prompt) - 1]] + [want[len(prompt) + j] for j in range(len(decode))]):
        torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama-reglu", "opt", "falcon-gqa"])
def test_graph_decode_with_predictors_equals_the_eager_step(tmp_path, variant):
    """With predictors the segment path computes the same neurons as the eager step: equal
    logits and equal neuron and byte counts on both executors (padding rows add none)."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=5, n_layer=3, n_ctx=64, predictor_rank=16)
    plan = _plans(ReferenceModel.from_file(path).cfg)["split-heads"]
    runs = {}
    for graphs in (False, True):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=0.2, prefill_chunk=16,
                                       max_batch=4, graphs=graphs))
        try:
            got = _decode_batch(eng, [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]], [[11, 12, 13], [40, 41, 42]])
            st = eng.primary.stats
            runs[graphs] = (got, st.neurons, st.active_bytes, eng.cpu.stats.neurons, eng.cpu.stats.active_bytes)
        finally:
            eng.close()
    for a, b in zip(runs[False][0], runs[True][0]):
        torch.testing.assert_close(torch.from_numpy(b), torch.from_numpy(a), rtol=1e-4, atol=1e-4)
    assert runs[True][1:] == runs[False][1:] and runs[True][1] > 0 and runs[True][3] > 0


@pytest.mark.parametrize("variant", ["llama-reglu", "opt", "falcon-gqa"])
def test_zero_copy_decode_splits_the_cpu_neurons_and_equals_the_masked_reference(tmp_path, variant):
    """Zero-copy decode: the primary computes a share of the CPU shard's predicted neurons from
    their rows in host memory (here the file's own map) and the CPU executor the rest. The logits
    of every decode step equal the reference forward under the same predictor masks (up to
    decisions within rounding of the threshold), and the two executors' neuron counts partition
    those of the CPU executor alone."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=6, n_layer=3, n_ctx=64, predictor_rank=16)
    ref = ReferenceModel.from_file(path, dtype=torch.float64)
    plan, thr = _plans(ref.cfg)["split-heads"], 0.2
    masked = DecisionReference(ref, predictor_weights(ModelFile(path), ref.cfg.n_layer, thr))
    prompts, nxt = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]], [[11, 12, 13], [40, 41, 42]]
    runs = {}
    for share in (0.0, 0.5, 1.0):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=thr, prefill_chunk=16,
                                       max_batch=4, graphs=True, zero_copy=share))
        try:
            got = _decode_batch(eng, prompts, nxt)
            st = eng.primary.stats
            runs[share] = (st.neurons, st.cold_neurons, st.host_read_bytes, eng.cpu.stats.neurons)
        finally:
            eng.close()
        for slot, p in enumerate(prompts):
            seq = p + [t[slot] for t in nxt] + ([8] if slot == 0 else [])
            steps = [got[j][slot] for j in range(len(nxt))] + ([got[-1][0]] if slot == 0 else [])
            errs, flips = match_rounding(masked, seq, steps, list(range(len(p), len(seq))), tol=1e-4)
            assert max(errs) < 1e-4, (share, slot, errs, flips)
    own, _, _, cpu_alone = runs[0.0]
    assert runs[0.0][1:3] == (0, 0)
    for share in (0.5, 1.0):
        neurons, mine, read, cpu = runs[share]
        assert neurons == own and mine > 0 and read > 0
        assert cpu + mine == cpu_alone  # prefill stays on the CPU executor; decode's CPU neurons are split
    assert runs[1.0][1] > runs[0.5][1]


class _Timed:
    """A decode graph set whose steps take ``ns`` (what ShareChoice reads of ``DecodeGraphs``); each
    step's share goes into ``log``."""

    def __init__(self, share: float, ns: int, log: list | None = None) -> None:
        self.share, self.ns, self.B, self.step_ns, self.runs = share, ns, 1, [], 0
        self.log = [] if log is None else log

    def run(self, slots, tokens, start_pos, argmax=False):
        self.run_burst(slots, tokens, start_pos, 1)
        return np.zeros((len(tokens), 2), np.float32)

    def run_burst(self, slots, tokens, start_pos, n):
        self.runs += n
        self.step_ns = [self.ns] * n
        self.log += [self.share] * n
        return np.full((n, len(tokens)), self.runs, np.int64)


def test_share_choice_measures_in_blocks_then_runs_the_faster_set_and_follows_a_change():
    """Blocks of BLOCK steps of each set alternate ROUNDS times; then the faster set runs, and every
    RECHECK steps a block of the other; when the running set slows past the other, the choice moves
    once its window's median has crossed."""
    fast, slow = _Timed(0.5, 100), _Timed(0.0, 125)
    c = ShareChoice([fast, slow])
    picks = []
    for _ in range(2 * c.ROUNDS * c.BLOCK):
        picks.append(c.pick())
        c.run([0], [1], [0])
    assert picks == ([0] * c.BLOCK + [1] * c.BLOCK) * c.ROUNDS
    for _ in range(c.RECHECK + c.BLOCK - len(picks)):  # through the first recheck's block
        c.run([0], [1], [0])
    assert slow.runs == (c.ROUNDS + 1) * c.BLOCK and fast.runs == c.RECHECK - c.ROUNDS * c.BLOCK
    fast.ns = 200  # the host changed: the running set is now the slower one
    before = fast.runs
    window = c.ROUNDS * (c.BLOCK - c.SETTLE)
    for _ in range(window):
        c.run([0], [1], [0])
    # back from the recheck block: SETTLE steps uncounted, then until half its window is the new time
    assert fast.runs - before == c.SETTLE + window // 2
    before = fast.runs
    for _ in range(c.RECHECK - 2 * window):
        c.run([0], [1], [0])
    assert fast.runs == before  # no recheck yet


def test_share_choice_runs_bursts_in_runs_of_one_set_as_it_runs_steps():
    """Bursts of 5 steps (``run_burst``) take the sets step for step as single steps do: blocks kept
    whole across bursts, then the faster set, the recheck block on time; each burst's tokens come
    back in order."""
    def shares(burst: int) -> list[float]:
        log: list[float] = []
        c = ShareChoice([_Timed(0.5, 100, log), _Timed(0.0, 125, log)])
        total = c.RECHECK + 2 * c.BLOCK
        while len(log) < total:
            n = min(burst, total - len(log))
            assert c.run_burst([0], [1], [0], n).shape == (n, 1)
        return log

    one = shares(1)
    c = ShareChoice
    assert one[:2 * c.ROUNDS * c.BLOCK] == ([0.5] * c.BLOCK + [0.0] * c.BLOCK) * c.ROUNDS
    assert one[c.RECHECK:c.RECHECK + c.BLOCK] == [0.0] * c.BLOCK and set(one[2 * c.ROUNDS * c.BLOCK:c.RECHECK]) == {0.5}
    assert shares(5) == one


def test_share_choice_sets_each_equal_the_masked_reference(tmp_path):
    """A decode bucket captured at a zero-copy share and at none (``ShareChoice``, as a default share
    is on CUDA): every step equals the reference forward under the same predictor masks whichever set
    runs it, both sets run, and their steps are counted by share."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=6, n_layer=3, n_ctx=64, predictor_rank=16)
    ref = ReferenceModel.from_file(path, dtype=torch.float64)
    plan, thr = _plans(ref.cfg)["split-heads"], 0.2
    masked = DecisionReference(ref, predictor_weights(ModelFile(path), ref.cfg.n_layer, thr))
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=thr, prefill_chunk=16,
                                   max_batch=1, graphs=True, zero_copy=0.5))
    try:
        p = eng.primary
        assert p.decode_shares(1) == [0.5]  # a share given is the only one
        choice = p.graphs[1] = ShareChoice([p.graphs[1], DecodeGraphs(p.weights, p.exchange, p.stats, 1, p.activity,
                                                                      p.cold, share=0.0)])
        choice.sets[1].capture()
        prompt = [5, 6, 7, 9]
        seq, steps = list(prompt), []
        p.step([0], [prompt], [0])
        for i in range(2 * ShareChoice.BLOCK + 4):
            tok = 11 + 7 * i
            steps.append(p.step([0], [[tok]], [len(seq)])[0])
            seq.append(tok)
        st = p.stats
        assert st.share_steps == {"0.5": ShareChoice.BLOCK + 4, "0": ShareChoice.BLOCK}  # blocks in turn
        assert st.graph_steps == len(steps)
        assert st.cold_neurons > 0 and st.host_read_bytes > 0  # the share's steps computed CPU neurons here
    finally:
        eng.close()
    errs, flips = match_rounding(masked, seq, steps, list(range(len(prompt), len(seq))), tol=1e-4)
    assert max(errs) < 1e-4, (errs, flips)


def test_predictor_policy_computes_only_predicted_neurons(tmp_path):
    """With predictors, the sparse forward equals the reference forward masked by the same
    predictor decisions (the reference's FFNHooks.mask), and far fewer neurons are computed."""
    path = write_tiny_model(tmp_path / "p.gguf", "llama-reglu", seed=2, n_layer=2, predictor_rank=16)
    ref = ReferenceModel.from_file(path, dtype=torch.float64)
    thr = 0.5
    masked = DecisionReference(ref, predictor_weights(ModelFile(path), ref.cfg.n_layer, thr))

    plan = _plans(ref.cfg)["mixed"]
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=thr, prefill_chunk=16))
    try:
        prompt = list(range(30, 42))
        got = eng.primary.step([0], [prompt], [0])[0]
        errs, flips = match_rounding(masked, prompt, [got], [len(prompt) - 1], tol=1e-4)
        assert max(errs) < 1e-4, (errs, flips)
        total = eng.primary.stats.neurons + eng.cpu.stats.neurons
        assert 0 < total < len(prompt) * ref.cfg.n_ff * ref.cfg.n_layer
    finally:
        eng.close()


def test_merge_of_disjoint_shards_equals_dense_layer(models):
    """Partial FFN and attention outputs of disjoint shards add up to the dense layer."""
    from powerinfer_ray.runtime.layers import attn_partial, ffn_partial

    mf = ModelFile(models["opt"])
    ref = ReferenceModel.from_file(mf)
    cfg, l = ref.cfg, 1
    x = torch.randn(5, cfg.n_embd)
    ids = np.random.default_rng(3).permutation(cfg.n_ff)
    parts = [ffn_partial(x, load_ffn_shard(mf, l, np.sort(s), torch.float32, torch.device("cpu")),
                         cfg.ffn_act, "dense")[0] for s in np.array_split(ids, 3)]
    want = ref.ffn(l, x)
    torch.testing.assert_close(add_partials(torch.zeros_like(want), parts, ref.w[K.tensor(K.FFN_DOWN_T, l, bias=True)]), want,
                               rtol=1e-5, atol=1e-5)
    shards = [load_attn_shard(mf, l, g, torch.float32, torch.device("cpu"), 1, 16)
              for g in (np.array([0, 2]), np.array([1, 3]))]
    att = [attn_partial(x[None], s, cfg, [0], [0])[0] for s in shards]
    want = ref.attention(l, x, torch.arange(5), ref.new_cache())
    torch.testing.assert_close(add_partials(torch.zeros_like(want), att, ref.w[K.tensor(K.ATTN_OUT, l, bias=True)]), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_dtype", ["f32", "f16", "bf16"])
def test_channel_round_trip_between_threads(x_dtype):
    """Hidden states in the channel's dtype and the mask packed 8 neurons a byte arrive intact."""
    ch = Channel.create(d=8, t_max=4, b_max=2, n_mask=21, x_dtype=x_dtype)
    peer = Channel.attach(ch.spec)
    mask = torch.rand(3, 21, generator=torch.Generator().manual_seed(0)) < 0.4  # [N, n]
    try:
        def serve():
            seq = peer.wait_request(0)
            op, layer, n_seq, n_tok, n_mask = peer.request()
            got = unpack_mask(peer.mask_rows(n_tok, n_mask), n_mask)  # [N, n]
            peer.out[:n_tok] = peer.x_ffn[:n_tok].float() * 2 + got.sum(1, keepdim=True).float()
            peer.respond(seq, 0)

        th = threading.Thread(target=serve)
        th.start()
        x = torch.arange(24, dtype=torch.float32).view(3, 8)
        ch.x_ffn[:3] = x
        packed = pack_mask(mask)
        ch.mask_rows(3, 21)[:] = packed.numpy()
        seq = ch.post(OP_FFN, 7, 1, 3, 21)
        ch.wait_response(seq, timeout_s=10)
        th.join()
        want = x * 2 + mask.sum(1, keepdim=True).float()
        assert ch.out.dtype == ch.x_ffn.dtype and torch.equal(ch.out[:3].float(), want)  # small ints: exact
        assert ch.x_ffn.dtype == {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[x_dtype]
        assert torch.equal(unpack_mask(packed.numpy(), 21), mask)
    finally:
        peer.close()
        ch.close(unlink=True)


def test_channel_counts_answers_and_abort_ends_every_wait():
    """The header counts requests, failed answers and the peer's compute (what the primary reads
    around a decode graph); a request written without the bell (as a decode graph's kernel posts)
    still reaches an in-process peer; abort() ends waits for good, even against a late answer."""
    ch = Channel.create(d=4, t_max=2, b_max=1, n_mask=8)
    peer = Channel.attach(ch.spec)
    try:
        def serve(n):
            seq = 0
            for i in range(n):
                seq = peer.wait_request(seq)
                t0 = time.monotonic_ns()
                time.sleep(0.01)
                peer.respond(seq, t0, ok=i != 1)

        th = threading.Thread(target=serve, args=(3,))
        th.start()
        before = ch.counters()
        ch.wait_response(ch.post(OP_FFN, 0, 1, 1, 8), timeout_s=10)
        with pytest.raises(RuntimeError, match="failed on layer 3"):
            ch.wait_response(ch.post(OP_FFN, 3, 1, 1, 8), timeout_s=10)
        ch.header[REQUEST_FIELDS] = (OP_FFN, 5, 1, 1, 8)  # as the GPU posts: fields, then req_seq, no bell
        ch.header[0] += 1
        t0 = time.perf_counter()
        ch.wait(lambda: int(ch.header[1]) >= int(ch.header[0]), 10.0, "the third answer")
        assert time.perf_counter() - t0 < 5
        th.join()
        req, fails, busy_ns = (a - b for a, b in zip(ch.counters(), before))
        assert (req, fails) == (3, 1) and 3 * 0.01 <= busy_ns * 1e-9 < 3.0
        seq = ch.post(OP_FFN, 0, 1, 1, 8)  # never answered
        ch.abort()
        assert ch.aborted
        peer.respond(seq, time.monotonic_ns())  # a late answer does not undo it
        with pytest.raises(PeerDied, match="given up on"):
            ch.wait_response(seq + 5, timeout_s=10)
    finally:
        peer.close()
        ch.close(unlink=True)


def test_wait_step_counts_a_steps_exchanges_and_reports_failures_and_a_silent_peer():
    """The primary's wait for a decode graph (which posts by itself; here the test posts): the
    growth of the channel's counters, a failed answer raised after the step, a peer silent past
    timeout_s raised as PeerDied with every wait ended (abort), and every later step refused."""
    from powerinfer_ray.runtime.exchange import Exchange
    from powerinfer_ray.runtime.stats import ExecStats

    ex = Exchange(4, 2, 1, 8, torch.float32, torch.device("cpu"), ExecStats(), timeout_s=1.0)
    ch, peer = ex.channel, None
    try:
        peer = Channel.attach(ex.spec)
        answers = iter([True, True, False])  # the third request fails

        def serve():
            seq = 0
            for ok in answers:
                seq = peer.wait_request(seq)
                peer.respond(seq, time.monotonic_ns(), ok=ok)

        class Done:  # the step's end: its last request answered
            def __init__(self, seq):
                self.seq = seq

            def query(self):
                return int(ch.header[1]) >= self.seq

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        before = ch.counters()
        ch.wait_response(ch.post(OP_FFN, 0, 1, 1, 8), timeout_s=10)  # a step of two requests, one at a time
        n_req, fails, busy = ex.wait_step(Done(ch.post(OP_FFN, 1, 1, 1, 8)), before)
        assert (n_req, fails) == (2, 0) and busy >= 0
        before = ch.counters()
        with pytest.raises(RuntimeError, match="failed on 1 of the step's 1 requests"):
            ex.wait_step(Done(ch.post(OP_FFN, 2, 1, 1, 8)), before)
        th.join()
        t0 = time.perf_counter()
        with pytest.raises(PeerDied, match="timed out"):  # nobody serves any more
            ex.wait_step(Done(ch.post(OP_FFN, 3, 1, 1, 8)), ch.counters())
        assert ch.aborted and time.perf_counter() - t0 < 10
        with pytest.raises(PeerDied, match="given up on"):  # a later step's waits all pass: refused
            ex.wait_step(Done(ch.post(OP_FFN, 4, 1, 1, 8)), ch.counters())
    finally:
        if peer is not None:
            peer.close()
        ex.close()


def test_coordinator_stops_and_limits(models):
    path = models["llama-reglu"]
    eng = LocalEngine(EngineConfig(str(path), policy="dense", max_batch=2))
    ref = ReferenceModel.from_file(path)
    try:
        prompt = list(range(40, 50))
        a = asyncio.run(eng.generate(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True))
        greedy = a["token_ids"]
        assert len(greedy) == 10 and a["finish_reason"] == "length"
        assert_greedy(ref, prompt, greedy)
        # greedy: after the prompt's step, 8 decode steps in one call (decode_burst), then the last alone
        st = eng.coordinator.stats()
        assert (st["steps"], st["decode_steps"], eng.primary.stats.steps) == (3, 9, 10)
        b = asyncio.run(eng.generate(prompt_token_ids=prompt, max_tokens=10, stop_token_ids=[greedy[4]],
                                     ignore_eos=True))
        k = greedy.index(greedy[4])
        assert b["token_ids"] == greedy[:k] and b["finish_reason"] == "stop"
        with pytest.raises(ValueError, match="context"):
            asyncio.run(eng.generate(prompt_token_ids=list(range(64)), max_tokens=2))
        for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(top_k=-2), dict(foo=1)):
            with pytest.raises(ValueError):
                asyncio.run(eng.generate(prompt_token_ids=prompt, **bad))
    finally:
        eng.close()


def test_local_engine_is_driven_from_any_event_loop(models):
    """LocalEngine with a CPU executor, driven from two successive asyncio.run() calls (each a new
    event loop) and then from two loops at once (two threads): every completion is the dense
    greedy tokens (up to rounding ties); a caller that gives up cancels its request and frees its slot."""
    path = models["llama-gqa"]
    ref = ReferenceModel.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(ref.cfg)["split-heads"], policy="oracle", max_batch=2))
    prompts = [list(range(7, 19)), [40, 41, 42, 43, 44]]
    gen = lambda p: eng.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True)  # noqa: E731
    try:
        want = asyncio.run(gen(prompts[0]))["token_ids"]
        assert len(want) == 6
        assert_greedy(ref, prompts[0], want)
        assert asyncio.run(gen(prompts[0]))["token_ids"] == want
        other: list[dict] = []
        th = threading.Thread(target=lambda: other.append(asyncio.run(gen(prompts[1]))))
        th.start()
        first = asyncio.run(gen(prompts[0]))
        th.join(timeout=120)
        assert_same_up_to_ties(ref, prompts[0], first["token_ids"], want)  # batched with the other
        assert len(other[0]["token_ids"]) == 6
        assert_greedy(ref, prompts[1], other[0]["token_ids"])

        async def give_up():
            await asyncio.wait_for(eng.generate(prompt_token_ids=prompts[0], max_tokens=50, ignore_eos=True), 0.05)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(give_up())
        deadline = time.monotonic() + 60
        while ((st := eng.coordinator.stats())["aborted"] < 1 or st["running"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.coordinator.stats()
        assert st["aborted"] == 1 and st["running"] == 0 and st["finished"] == 4
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(gen(prompts[0]))


def _mapped_file(addr: int) -> str | None:
    """The file this process maps at addr (/proc/self/maps), or None."""
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5].strip() if len(parts) > 5 else None
    return None


@pytest.mark.parametrize("variant", ["llama-reglu", "opt"])  # gated rows; ReLU rows with an up bias
def test_cpu_executor_computes_on_the_rows_in_the_file_mapping(tmp_path, variant):
    """A file's FFN rows are not copied: the CPU executor's up / gate / down_t (and up's bias) are
    the file's own tensors in its memory map (and so are its heads' q rows and o columns) (their bytes at the tensor's offset in the file, in a
    mapping of that file), the shard is the neurons' ids, nothing goes to /dev/shm, and the
    primary's dense prefill reads its own mapping of the same file; the logits of both paths
    equal the dense reference."""
    from powerinfer_ray.model.source import file_mapping
    from powerinfer_ray.runtime.channel import SHM_DIR

    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=4, n_layer=2, n_ctx=64, predictor_rank=16)
    ref = ReferenceModel.from_file(path)
    plan = _plans(ref.cfg)["split-heads"]
    before = set(SHM_DIR.glob("powerinfer-shard-*"))
    prompt = list(range(3, 23))
    want = ref.forward(prompt + [9], ref.new_cache())
    for dense_min in (8, 0):  # the primary computes the CPU's rows of the prompt / the exchange does
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="oracle", prefill_chunk=32,
                                       prefill_dense_min=dense_min))
        try:
            cpu = eng.cpu
            assert cpu.ffn_rows == "file" and cpu.shard_spec is None and cpu.ready()["memory"]["shared_bytes"] == 0
            m = file_mapping(cpu.src)
            for l in range(ref.cfg.n_layer):
                sh = cpu.ffn[l]
                assert np.array_equal(sh.ids, plan[l].cpu_neurons) and sh.rows.tolist() == plan[l].cpu_neurons.tolist()
                for tmpl, t in ((K.FFN_UP, sh.up), (K.FFN_GATE, sh.gate), (K.FFN_DOWN_T, sh.down_t),
                                (K.FFN_UP, sh.up_bias)):
                    name = K.tensor(tmpl, l, bias=t is sh.up_bias)
                    if t is None:
                        assert not cpu.src.has(name)
                        continue
                    offset = int(cpu.src.tensors[name].data_offset)
                    assert t.data_ptr() == m.address + offset, name
                    assert t.data_ptr() + t.numel() * t.element_size() <= m.address + m.nbytes
                    assert _mapped_file(t.data_ptr()) == str(path.resolve())
                    assert np.array_equal(t.view(torch.int16 if t.dtype == torch.float16 else t.dtype).numpy(),
                                          cpu.src.raw(name).view(np.int16 if t.dtype == torch.float16 else np.float32))
                a, hd, D = cpu.attn[l], ref.cfg.head_dim, ref.cfg.n_embd  # the CPU's heads: q rows, o columns
                rows = slice(int(a.groups[0]) * ref.cfg.n_gqa * hd, (int(a.groups[-1]) + 1) * ref.cfg.n_gqa * hd)
                q, o = (cpu.src.tensors[K.tensor(t, l)] for t in (K.ATTN_Q, K.ATTN_OUT))
                assert a.wqkv is None and a.wq.data_ptr() == m.address + int(q.data_offset) + rows.start * D * 4
                assert a.wo_t.data_ptr() == m.address + int(o.data_offset) + rows.start * 4
                assert torch.equal(a.wq, torch.from_numpy(np.array(cpu.src.raw(q.name)[rows])))
            assert set(SHM_DIR.glob("powerinfer-shard-*")) == before
            if dense_min:
                cold = eng.primary.cold
                assert cold.source == "file"
                assert _mapped_file(cold.rows[1].up.data_ptr()) == str(path.resolve())
            got = [eng.primary.step([0], [prompt], [0])[0], eng.primary.step([0], [[9]], [20])[0]]
            assert (eng.primary.stats.cold_neurons > 0) == bool(dense_min)
        finally:
            eng.close()
        for g, w in zip(got, (want[19], want[20])):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_a_quantized_file_is_read_in_place_as_its_blocks(tmp_path, qtype):
    """A Q8_0 / Q4_0 file: the CPU executor's FFN rows and its heads' q rows and o columns are the
    file's blocks in its memory map (tests/unit/runtime/test_runtime_quant.py checks these engines'
    logits on every split)."""
    from powerinfer_ray.model.source import file_mapping

    path = write_tiny_model(tmp_path / "q.gguf", "llama-gqa", seed=1, n_layer=2, n_ctx=64, n_embd=128, dtype=qtype)
    cfg = ReferenceModel.from_file(path).cfg
    eng = LocalEngine(EngineConfig(str(path), plan=_plans(cfg)["split-heads"], policy="oracle", prefill_chunk=16))
    try:
        cpu = eng.cpu
        m = file_mapping(cpu.src)
        assert cpu.ffn_rows == "file" and cpu.shard_spec is None
        for l in range(cfg.n_layer):
            sh, a = cpu.ffn[l], cpu.attn[l]
            assert sh.qtype == qtype and sh.up.dtype == torch.uint8 and sh.rows is not None
            assert sh.down_t.data_ptr() == m.address + int(cpu.src.tensors[K.tensor(K.FFN_DOWN_T, l)].data_offset)
            assert a.qtype == qtype and a.wqkv is None
            q = cpu.src.tensors[K.tensor(K.ATTN_Q, l)]
            row = a.wq.stride(0)  # bytes of a q row's blocks
            assert a.wq.data_ptr() == m.address + int(q.data_offset) + int(a.groups[0]) * cfg.n_gqa * cfg.head_dim * row
        logits = eng.primary.step([0], [[3, 4, 5]], [0])[0]
        assert np.isfinite(logits).all()
    finally:
        eng.close()


def test_rows_without_a_file_go_to_shared_memory_or_a_copy(monkeypatch):
    """A planted model has no file: the CPU executor generates its rows into one shared-memory file
    that the primary maps for dense prefill (runtime/sharedshard.py; a row changed on the CPU
    executor's side is what the primary sees; no name is left in /dev/shm); where /dev/shm has no
    room the rows stay private, the primary makes its own copy, and the logits are the same."""
    from powerinfer_ray.runtime import sharedshard
    from powerinfer_ray.runtime.channel import SHM_DIR

    spec = "planted:tiny?layers=2&dtype=f32"
    ref = planted_model(spec.removeprefix("planted:")).reference()
    plan = _plans(ref.cfg)["mixed"]
    before = set(SHM_DIR.glob("powerinfer-shard-*"))
    prompt, out = list(range(3, 23)), {}
    for shared in (True, False):
        if not shared:  # /dev/shm "full": more headroom asked for than any tmpfs has
            monkeypatch.setattr(sharedshard, "HEADROOM", 1 << 60)
        eng = LocalEngine(EngineConfig(spec, plan=plan, policy="oracle", prefill_chunk=32, prefill_dense_min=8))
        try:
            assert eng.cpu.ffn_rows == ("shared" if shared else "private")
            assert eng.primary.cold.source == ("shared" if shared else "copy")
            assert (eng.cpu.shard_spec is not None) == shared
            assert eng.cpu.ready()["memory"]["shared_bytes"] == (sum(sh.nbytes for sh in eng.cpu.ffn) if shared else 0)
            assert set(SHM_DIR.glob("powerinfer-shard-*")) == before  # no name left behind
            out[shared] = eng.primary.step([0], [prompt], [0])[0]
            if shared:
                cpu_up, cold_up = eng.cpu.ffn[1].up, eng.primary.cold.rows[1].up
                assert cpu_up.data_ptr() != cold_up.data_ptr() and torch.equal(cpu_up, cold_up.to(cpu_up.dtype))
                saved = cpu_up[0, :4].clone()
                cpu_up[0, :4] = 7.0  # the same pages, two mappings
                assert torch.equal(cold_up[0, :4], torch.full((4,), 7.0, dtype=cold_up.dtype))
                cpu_up[0, :4] = saved
        finally:
            eng.close()
    want = ref.forward(prompt, ref.new_cache())[-1]
    for got in out.values():
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


# gated rows; ReLU rows with an up bias; either as Q4_0 / Q8_0 blocks
@pytest.mark.parametrize("spec", ["tiny", "tiny-opt", "tiny?dtype=q4_0", "tiny-opt?dtype=q8_0"])
def test_primary_fills_the_cpu_executors_rows_of_a_planted_model(spec):
    """defer_fill: the CPU executor lays its shared file out and the primary generates the rows and
    writes them in (runtime/sharedshard.py fill): the CPU executor's shard then equals the one it
    loads itself, bias included (quantized: the same blocks); when the primary cannot, the CPU
    executor writes them itself."""
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.cpu_executor import CPUExecutor
    from powerinfer_ray.runtime.primary import PrimaryExecutor

    src = open_model(f"planted:{spec}")
    plan = _plans(src.config)["mixed"]
    own = CPUExecutor(src, plan, threads=1)
    deferred = CPUExecutor(src, plan, threads=1, defer_fill=True)
    fallback = CPUExecutor(src, plan, threads=1, defer_fill=True)
    primary = PrimaryExecutor(src, plan, device="cpu")
    try:
        assert deferred.needs_fill and not own.needs_fill
        assert not deferred.ffn[0].up.any()  # laid out, not written
        primary.fill_cold(deferred.shard_spec)
        deferred.filled()
        fallback.filled(by_primary=False)
        assert not deferred.needs_fill and not fallback.needs_fill
        for a, b, c in zip(own.ffn, deferred.ffn, fallback.ffn):
            assert np.array_equal(a.ids, b.ids) and a.qtype == b.qtype == c.qtype == src.qtype(K.FFN_UP, 0)
            for t in ("up", "gate", "down_t", "up_bias"):
                x, y, z = getattr(a, t), getattr(b, t), getattr(c, t)
                assert (x is None) == (y is None) == (z is None), t
                assert x is None or (torch.equal(x, y) and torch.equal(x, z)), t
    finally:
        for ex in (own, deferred, fallback, primary):
            ex.close() if hasattr(ex, "close") else ex.stop()


def test_share_lays_rows_out_and_rejects_rows_that_do_not_fit():
    """sharedshard.share: each layer's [up | gate | down] at the offsets its spec names, read back
    through the shards over the file; a layer whose rows do not match the layout fails, naming it."""
    from powerinfer_ray.runtime.shard import FFNShard
    from powerinfer_ray.runtime.sharedshard import release, share

    gen = torch.Generator().manual_seed(5)
    d, rows = 16, [3, 0, 5]
    src = [FFNShard(np.arange(n) * 2, *(torch.randn(n, d, generator=gen).half() for _ in range(3)), None)
           for n in rows]
    shards, spec = share(rows, True, d, torch.float16, lambda l: src[l])
    try:
        for l, (a, b) in enumerate(zip(src, shards)):
            assert np.array_equal(a.ids, b.ids)
            for t in ("up", "gate", "down_t"):
                assert torch.equal(getattr(a, t), getattr(b, t)), (l, t)
        assert [o for _, *o, _ in spec.layers][2] == [3 * 3 * d, 3 * 3 * d + 5 * d, 3 * 3 * d + 10 * d]
    finally:
        release(spec)
    no_gate = [FFNShard(s.ids, s.up, None, s.down_t, None) for s in src]
    with pytest.raises(ValueError, match="layer 0: shard no rows, expected"):
        share(rows, True, d, torch.float16, lambda l: no_gate[l])
    with pytest.raises(ValueError, match=r"layer 2: shard rows \(5, 16\) torch.float32"):
        share(rows, True, d, torch.float16, lambda l: src[l] if l < 2 else
              FFNShard(src[2].ids, src[2].up.float(), src[2].gate, src[2].down_t, None))


def test_one_thread_runs_in_order_and_passes_results_and_errors():
    from powerinfer_ray.runtime.cpu_executor import OneThread

    r = OneThread("t")
    try:
        seen = []
        futs = [r.submit(lambda i=i: seen.append((i, threading.get_ident())) or i * i) for i in range(5)]
        assert [f.result(timeout=5) for f in futs] == [0, 1, 4, 9, 16]
        assert [i for i, _ in seen] == list(range(5)) and {t for _, t in seen} == {r.thread.ident}
        with pytest.raises(ZeroDivisionError):
            r.call(lambda: 1 / 0)
        assert r.call(lambda: "still serving") == "still serving"
    finally:
        r.close()
    r.thread.join(timeout=5)
    assert not r.thread.is_alive()


def test_cpu_executor_loads_and_computes_in_its_one_thread(models, monkeypatch):
    """Loading (torch) and the per-layer kernels run in the CPU executor's worker thread: one
    thread starting OpenMP regions, so libgomp keeps one pool and keeps its workers spinning
    (two pools outnumbering the cores put them to sleep between regions: OneThread)."""
    from powerinfer_ray.runtime import cpu_executor as executor

    threads: dict[str, set[int]] = {"load": set(), "kernel": set(), "attention": set()}

    def spy(kind, fn):  # noqa: ANN001, ANN202
        def wrapped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            threads[kind].add(threading.get_ident())
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(executor, "in_place_ffn_shard", spy("load", executor.in_place_ffn_shard))  # its FFN rows
    prepare = executor.prepare_bitmask
    monkeypatch.setattr(executor, "prepare_bitmask", lambda *a, **kw: spy("kernel", prepare(*a, **kw)))
    monkeypatch.setattr(executor, "cpu_linear", spy("attention", executor.cpu_linear))
    path = models["llama-reglu"]
    plan = _plans(ReferenceModel.from_file(path).cfg)["split-heads"]  # CPU neurons and heads
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", prefill_chunk=16, max_batch=2))
    try:
        _run_steps(eng, [3, 4, 5], [6, 7], 16)
        worker = eng.cpu._omp.thread.ident
        assert threads["load"] and threads["kernel"] and threads["attention"]
        assert threads["load"] | threads["kernel"] | threads["attention"] == {worker} != {threading.get_ident()}
    finally:
        eng.close()


def _threads_on(cpus: set[int]) -> list[int]:
    """Native ids of this process's threads that may run on exactly ``cpus``."""
    out = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        with open(f"/proc/self/task/{tid}/status") as f:
            allowed = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
        got: set[int] = set()
        for part in allowed.split(","):
            a, _, b = part.partition("-")
            got |= set(range(int(a), int(b or a) + 1))
        if got == cpus:
            out.append(int(tid))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 4, reason="threads=2 pins only with two more CPUs left")
def test_a_pinned_cpu_executor_shares_its_core_with_no_other_thread(models):
    """threads=2 on a host of four CPUs or more: the CPU executor pins its thread and the kernels'
    worker to the last two CPUs. After prefill and decode steps of its heads and neurons (torch's
    attention ops between the kernels' calls), its thread is the only one confined to its CPU:
    torch's OpenMP workers, had its thread started them after pinning, would be confined there too
    (a thread starts with its creator's CPUs) and spin on that one core."""
    path = models["llama-gqa"]
    plan = _plans(ReferenceModel.from_file(path).cfg)["split-heads"]
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", prefill_chunk=16, max_batch=2, threads=2))
    try:
        _run_steps(eng, list(range(3, 35)), [35, 36, 37], 16)
        assert eng.cpu.stats.attn_s > 0 and eng.cpu.pinned == sorted(os.sched_getaffinity(0))[-2:]
        assert _threads_on({eng.cpu.pinned[0]}) == [eng.cpu._omp.thread.native_id]
    finally:
        eng.close()
