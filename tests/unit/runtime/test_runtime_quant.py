"""Q8_0 / Q4_0 models through the hybrid runtime without Ray (the CPU executor serves in a thread):
on every split the logits equal the dense forward over the dequantized weights with the CPU
kernels' Q8_0 activation rounding (quant_models.KernelReference), to 1e-5, once the reference
takes the runtime's side of the rounding ties its fp32 arithmetic may decide either way
(quant_models.match_rounding)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_models import (SITES, KernelPredictorHooks, KernelReference, assert_twin_computes_its_weights,
                          match_rounding, write_upstream_int4)
from ties import assert_greedy

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.tiny import tiny_config, write_tiny_model
from powerinfer_ray.runtime.config import EngineConfig
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.plan import Plan

VARIANTS = ["llama-gqa", "qwen2", "opt", "falcon-gqa"]
SPLITS = ["all-gpu", "all-cpu", "mixed", "split-heads"]
TOL = 1e-5  # float64 against the runtime's fp32, rounding ties matched


def _plan(cfg, split: str) -> Plan:
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)]
    half = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return {"all-gpu": Plan.all_gpu(cfg), "all-cpu": Plan.all_cpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, half, cfg), "layer-offload": Plan.whole_layers(cfg, cfg.n_layer // 2)}[split]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models with head_dim 32 (a head's rows and columns are whole blocks) in both types."""
    d = tmp_path_factory.mktemp("qmodels")
    return {(v, q): write_tiny_model(d / f"{v}.{q}.gguf", v, seed=1, n_layer=3, n_ctx=64, n_embd=128, dtype=q)
            for v in VARIANTS for q in ("q8_0", "q4_0")}


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", SPLITS)
def test_oracle_masks_equal_the_kernels_reference(models, variant, qtype, split):
    """Prefill in chunks, then cached decode steps: every step's logits."""
    path = models[variant, qtype]
    ref = KernelReference.from_file(path)
    assert ref.cfg.dtype == qtype and ref.quantized
    eng = LocalEngine(EngineConfig(str(path), plan=_plan(ref.cfg, split), policy="oracle", prefill_chunk=8,
                                   max_batch=2))
    try:
        prompt, decode = list(range(3, 20)), [7, 99, 150, 3, 42]
        got, pos = [], 0
        for i in range(0, len(prompt), 8):
            got.append(eng.primary.step([0], [prompt[i:i + 8]], [pos])[0])
            pos += len(prompt[i:i + 8])
        for t in decode:
            got.append(eng.primary.step([0], [[t]], [pos])[0])
            pos += 1
        lw = eng.primary.weights.layers[0]
        assert lw.attn.qtype == qtype and (lw.ffn.qtype == qtype or lw.ffn.n == 0)
        if split != "all-gpu":
            assert eng.cpu.ffn[0].qtype == qtype and eng.cpu.stats.exchanges > 0
    finally:
        eng.close()
    at = [min(i + 8, len(prompt)) - 1 for i in range(0, len(prompt), 8)] + [len(prompt) + j for j in range(len(decode))]
    errs, flips = match_rounding(ref, prompt + decode, got, at)
    assert max(errs) < TOL, (errs, flips)


def _steps(eng: LocalEngine, prompt: list[int], decode: list[int], chunk: int) -> tuple[list, list[int]]:
    """Prefill in chunks, then decode steps of sequence slot 0: the logits of each step and their positions."""
    got, at, pos = [], [], 0
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        got.append(eng.primary.step([0], [part], [pos])[0])
        pos += len(part)
        at.append(pos - 1)
    for t in decode:
        got.append(eng.primary.step([0], [[t]], [pos])[0])
        at.append(pos)
        pos += 1
    return got, at


@pytest.mark.parametrize("qtype, rank", [("q8_0", 32), ("q4_0", 32), ("q4_0", 16)])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "segments"])
def test_predictor_policy_computes_the_predicted_neurons(tmp_path, qtype, rank, graphs):
    """Quantized fc1 / fc2 (rank 32: whole blocks; rank 16: fc2's rows are half a block, so it is
    stored in f16), the predictor's split over both executors, decode steps eager or as the graph
    segments: the forward masked by the reference's own predictor decisions, and far fewer
    neurons than dense."""
    path = write_tiny_model(tmp_path / "p.gguf", "llama-reglu", seed=2, n_layer=2, n_ctx=64, n_embd=128,
                            predictor_rank=rank, dtype=qtype)
    ref = KernelReference.from_file(path)
    fc_qtypes = (qtype, qtype if rank % 32 == 0 else None)
    assert (K.tensor(K.FC2, 1) in ref.quantized) == (fc_qtypes[1] is not None)
    thr = 0.5
    eng = LocalEngine(EngineConfig(str(path), plan=_plan(ref.cfg, "split-heads"), policy="predictor", threshold=thr,
                                   prefill_chunk=16, max_batch=2, graphs=graphs))
    try:
        prompt, decode = list(range(30, 42)), [5, 77, 130]
        got, at = _steps(eng, prompt, decode, 16)
        assert eng.primary.weights.layers[0].fc_qtypes == fc_qtypes
        total = eng.primary.stats.neurons + eng.cpu.stats.neurons
        assert 0 < total < (len(prompt) + len(decode)) * ref.cfg.n_ff * ref.cfg.n_layer // 2
        assert eng.cpu.stats.neurons > 0
    finally:
        eng.close()
    errs, flips = match_rounding(ref, prompt + decode, got, at, hooks=KernelPredictorHooks(ref, thr))
    assert max(errs) < TOL, (errs, flips)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_dense_prefill_of_a_quantized_cpu_shard(tmp_path, qtype):
    """A long prompt runs the CPU shard's quantized rows on the primary (their blocks streamed in
    chunks, the up bias with them), decode steps exchange with the CPU executor: both equal the
    reference, the CPU executor computes only the decode steps, and its kernel's bytes are the
    compressed rows'."""
    path = write_tiny_model(tmp_path / "m.gguf", "opt", seed=4, n_layer=2, n_ctx=64, n_embd=128, dtype=qtype)
    ref = KernelReference.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_plan(ref.cfg, "split-heads"), policy="dense", prefill_chunk=32,
                                   prefill_dense_min=8, max_batch=2))
    try:
        assert eng.primary.cold.source is not None and eng.primary.cold.rows[0].qtype == qtype
        prompt, decode = list(range(3, 23)), [9, 17]
        got, at = _steps(eng, prompt, decode, 32)
        n_cpu = sum(len(lp.cpu_neurons) for lp in eng.primary.plan.layers)
        assert eng.primary.stats.cold_neurons == len(prompt) * n_cpu
        assert eng.cpu.stats.neurons == len(decode) * n_cpu
        # policy 'dense' reads each of the CPU's up and down rows per decode step: 128 weights each,
        # as stored (4 blocks of 34 or 18 bytes)
        assert eng.cpu.stats.kernel_bytes == len(decode) * n_cpu * 2 * 4 * {"q8_0": 34, "q4_0": 18}[qtype]
    finally:
        eng.close()
    errs, flips = match_rounding(ref, prompt + decode, got, at)
    assert max(errs) < TOL, (errs, flips)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["llama-gqa", "falcon-gqa"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "segments"])
def test_layer_offload_split_equals_the_kernels_reference(models, variant, qtype, graphs):
    """The layer-offload baseline on quantized weights: policy 'dense' over whole layers, the first
    on the primary (heads and every neuron), the last on the CPU executor; prefill chunks, then
    decode steps eager or as the graph segments: every step's logits equal the reference, and
    each executor computes every neuron and reads every row of its own layers at every step."""
    path = models[variant, qtype]
    ref = KernelReference.from_file(path)
    cfg = ref.cfg
    plan = _plan(cfg, "layer-offload")
    mine = [l for l in range(cfg.n_layer) if len(plan[l].gpu_neurons)]
    assert mine == [0] and not len(plan[1].gpu_groups) and not len(plan[2].gpu_groups)
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", prefill_chunk=8, max_batch=2,
                                   graphs=graphs))
    try:
        prompt, decode = list(range(3, 20)), [7, 99, 150]
        got, at = _steps(eng, prompt, decode, 8)
        steps, tokens = len(got), len(prompt) + len(decode)
        assert [a.n_groups for a in eng.cpu.attn] == [0, cfg.n_head_kv, cfg.n_head_kv]
        assert eng.primary.stats.neurons == tokens * cfg.n_ff and eng.cpu.stats.neurons == tokens * cfg.n_ff * 2
        # one exchange per layer with parallel attention (falcon), two (heads, then neurons) otherwise
        assert eng.cpu.stats.exchanges == steps * 2 * (1 if cfg.parallel_attn else 2)
        assert eng.cpu.stats.kernel_bytes == steps * 2 * cfg.n_ff * cfg.neuron_bytes  # as stored, every row
        # the decode exchanges' own counters: the requests of one token per sequence (the decode steps and
        # the prompt's last chunk of one token), not the prompt chunks of eight
        st, one = eng.cpu.stats, sum(len(prompt[i:i + 8]) == 1 for i in range(0, len(prompt), 8)) + len(decode)
        assert st.decode_exchanges == one * 2 * (1 if cfg.parallel_attn else 2) < st.exchanges
        assert st.decode_kernel_bytes == one * 2 * cfg.n_ff * cfg.neuron_bytes
        assert 0 < st.decode_kernel_s < st.kernel_s and 0 < st.decode_busy_s < st.busy_s
        assert st.decode_kernel_s <= st.decode_busy_s
    finally:
        eng.close()
    errs, flips = match_rounding(ref, prompt + decode, got, at)
    assert max(errs) < TOL, (errs, flips)


def test_upstream_int4_file_generates_through_the_engine(tmp_path):
    """Upstream's `quantize ... Q4_0` layout written by gguf-py (Q4_0 matrices and predictors,
    Q6_K head, PWRI magic): half the neurons and a KV-head group on the CPU executor, each step
    equal to the reference, and a completion equal to its greedy tokens."""
    import asyncio

    cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False, norm_eps=1e-6,
                      dtype="q4_0")
    path = tmp_path / "tiny.q4.powerinfer.gguf"
    write_upstream_int4(path, cfg, np.random.default_rng(7))
    ref = KernelReference.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), gpu_fraction=0.5, cpu_groups=1, policy="oracle", prefill_chunk=8,
                                   max_batch=2))
    try:
        w = eng.primary.weights
        assert w.out_q is None and w.out_w.dtype == torch.float32  # Q6_K, dequantized at load
        assert w.embd_q == w.layers[0].attn.qtype == eng.cpu.ffn[1].qtype == "q4_0"
        prompt = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114]
        got, at = _steps(eng, prompt, [33, 44], 8)
        out = asyncio.run(eng.generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True))
    finally:
        eng.close()
    errs, flips = match_rounding(ref, prompt + [33, 44], got, at)
    assert max(errs) < TOL, (errs, flips)
    assert len(out["token_ids"]) == 6
    assert_greedy(ref, prompt, out["token_ids"])


def test_a_head_split_across_blocks_is_refused(tmp_path):
    """head_dim 16: a KV-head group's o-projection columns are half a block, so a plan that puts a
    layer's heads on both executors cannot be held as blocks: one clear error."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", n_layer=2, n_embd=64, dtype="q4_0")
    cfg = KernelReference.from_file(path).cfg
    with pytest.raises(ValueError, match=r"layer 0: .*16 o-projection columns are not whole q4_0 blocks"):
        LocalEngine(EngineConfig(str(path), plan=_plan(cfg, "split-heads"), policy="oracle"))
    LocalEngine(EngineConfig(str(path), plan=_plan(cfg, "mixed"), policy="oracle")).close()  # whole layers' heads: fine


def test_a_layer_whose_ffn_matrices_differ_in_type_is_refused(tmp_path):
    """The kernels take a layer's up / gate / down_t in one type: a file that stores one of them
    otherwise gets one error naming the layer, each matrix's type and how to convert."""
    from powerinfer_ray.model.gguf_writer import LazyTensor, write_model
    from powerinfer_ray.model.tiny import tiny_weights

    cfg = tiny_config("llama-reglu", n_layer=2, n_embd=64, dtype="q4_0")
    weights = tiny_weights(cfg, seed=1)
    gate = K.tensor(K.FFN_GATE, 1)
    weights[gate] = LazyTensor(tuple(weights[gate].shape), "f16", lambda w=weights[gate]: w)
    path = write_model(tmp_path / "m.gguf", cfg, weights)
    with pytest.raises(ValueError, match=r"layer 1's FFN matrices are stored in different types \("
                                         r"blk.1.ffn_up.weight: q4_0, blk.1.ffn_gate.weight: float, "
                                         r"blk.1.ffn_down_t.weight: q4_0\).*powerinfer-ray quantize"):
        LocalEngine(EngineConfig(str(path), plan=_plan(cfg, "mixed"), policy="oracle"))


def test_a_q4_0_file_computes_its_dequantized_twin_with_x_rounded(tmp_path):
    """The embedded model as gguf-py's Q4_0 file beside its twin, the same weights dequantized to
    F32 (bench/quant_twin.py measures the gap): through a CPU primary with half of each layer's
    FFN rows on the CPU executor and the file's own predictors, the twin's logits are its float64
    forward and the Q4_0 file's are the same weights' forward with x rounded to Q8_0 before every
    product with a quantized matrix (attention, FFN up and gate, head, predictors): x's rounding,
    and nothing else, separates the two."""
    assert_twin_computes_its_weights(tmp_path, "mixed", SITES, TOL, device="cpu")
