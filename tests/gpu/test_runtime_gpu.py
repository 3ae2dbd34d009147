"""The hybrid runtime with the primary executor on CUDA (fp16 weights, or Q8_0 / Q4_0 blocks beside
fp16), against the fp32 dense reference: the same plans as the CPU tests, the real channel with
pinned host buffers.

Quantized: the GPU kernels dequantize the blocks in registers and multiply x as it is, so the
reference is the dense forward over the dequantized weights; a split's CPU share multiplies its
Q8_0-rounded activations as ggml does (on these models that rounding alone moves the logits by
up to ~1.5e-2: tolerance 4e-2 with a CPU share, 2e-2 as fp16 without)."""
from __future__ import annotations

import asyncio
import dataclasses
import gc

import numpy as np
import pytest
import torch
from bursts import greedy_burst

from powerinfer_ray.kernels.quant import REPACKED
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.graphs import DecodeGraphs
from powerinfer_ray.runtime.plan import Plan
from powerinfer_ray.runtime.schedule import Post, step_schedule

pytestmark = pytest.mark.gpu


def _model_and_plan(tmp_path, variant: str, split: str, dtype: str = "f16"):
    """A tiny model of the variant (head_dim 32, predictor rank 32: whole Q8_0 / Q4_0 blocks), its
    fp32 reference, and the named split of it."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64, dtype=dtype,
                            predictor_rank=32, n_embd=128, n_ff=512)
    ref = ReferenceModel.from_file(path)
    cfg = ref.cfg
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)]
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    plan = {"all-gpu": Plan.all_gpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, groups, cfg)}[split]
    return path, ref, plan


# (variant, dtype): every variant in fp16, three of them in Q8_0 and Q4_0
CASES = [(v, "f16") for v in ("llama-reglu", "llama-gqa", "opt", "falcon-gqa")] + \
    [(v, q) for v in ("llama-gqa", "opt", "falcon-gqa") for q in ("q8_0", "q4_0")]


def _tol(dtype: str, split: str) -> float:
    return 2e-2 if dtype == "f16" or split == "all-gpu" else 4e-2


PROMPTS = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]]
NEXT = [[11, 12, 13], [40, 41, 42], [7, 8, 9]]


def _decode(eng: LocalEngine) -> list[np.ndarray]:
    """Prefill PROMPTS in slots 0..2, then NEXT as batched decode steps (B = 3, a bucket of 4), then
    one step of sequence 1 alone (B = 1): the logits of every decode step."""
    for slot, p in enumerate(PROMPTS):
        eng.primary.step([slot], [p], [0])
    pos, out = [len(p) for p in PROMPTS], []
    for toks in NEXT:
        out.append(eng.primary.step([0, 1, 2], [[t] for t in toks], pos))
        pos = [q + 1 for q in pos]
    out.append(eng.primary.step([1], [[77]], [pos[1]]))
    return out


def _assert_decode_is_the_reference(ref: ReferenceModel, out: list[np.ndarray], tol: float) -> None:
    """``_decode``'s logits against the fp32 dense reference of each sequence, relative error < tol."""
    for slot, p in enumerate(PROMPTS):
        full = ref.forward(p + [t[slot] for t in NEXT] + ([77] if slot == 1 else []), ref.new_cache())
        for j in range(3):
            w = full[len(p) + j]
            assert float((torch.from_numpy(out[j][slot]) - w).abs().max() / w.abs().max()) < tol
        if slot == 1:
            w = full[-1]
            assert float((torch.from_numpy(out[3][0]) - w).abs().max() / w.abs().max()) < tol


@pytest.mark.parametrize("variant, dtype", CASES)
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
@pytest.mark.parametrize("policy", ["oracle", "predictor"])
def test_cuda_primary_matches_reference(tmp_path, variant, dtype, split, policy):
    path, ref, plan = _model_and_plan(tmp_path, variant, split, dtype)
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy=policy, device="cuda", prefill_chunk=16))
    try:
        prompt = list(range(3, 19))
        got = [eng.primary.step([0], [prompt], [0])[0]]
        for i, t in enumerate([5, 77, 130]):
            got.append(eng.primary.step([0], [[t]], [len(prompt) + i])[0])
        if policy == "oracle":  # must equal dense: fp16 weights, fp32 accumulation
            full = ref.forward(prompt + [5, 77, 130], ref.new_cache())
            want = [full[len(prompt) - 1]] + [full[len(prompt) + i] for i in range(3)]
            for g, w in zip(got, want):
                err = (torch.from_numpy(g) - w).abs().max() / w.abs().max()
                assert err < _tol(dtype, split), float(err)
        if dtype != "f16":
            lw = eng.primary.weights.layers[0]
            # on CUDA the Q4_0 matrices only the dense GEMV reads are repacked; fc2's rows (rank 32:
            # one block of 18 bytes) are not whole 32-bit words and stay blocks
            want = REPACKED.get(dtype, dtype)
            assert lw.attn.qtype == want and lw.fc_qtypes == ((want, dtype) if policy == "predictor" else (None, None))
        else:
            assert eng.primary.stats.neurons > 0
        assert eng.primary.stats.exchanges > 0 or split == "all-gpu"
    finally:
        eng.close()


@pytest.mark.parametrize("variant", ["llama-reglu", "opt"])
def test_cuda_prefill_of_a_long_prompt_matches_reference(tmp_path, variant):
    """The engine's default prefill chunk on CUDA (one chunk here): 50 tokens in one sparse FFN call
    per layer, i.e. the Triton kernels' token blocks (MAX_T) and a ragged last block."""
    path, ref, plan = _model_and_plan(tmp_path, variant, "mixed")
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="oracle", device="cuda"))
    try:
        prompt = [(7 * i + 3) % 250 + 1 for i in range(50)]
        got = eng.primary.step([0], [prompt], [0])[0]
        want = ref.forward(prompt, ref.new_cache())[len(prompt) - 1]
        err = (torch.from_numpy(got) - want).abs().max() / want.abs().max()
        assert err < 2e-2, float(err)
    finally:
        eng.close()


@pytest.mark.parametrize("variant, dtype", CASES)
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
def test_cuda_graph_decode_equals_eager_and_reference(tmp_path, variant, dtype, split):
    """Decode steps replayed as CUDA graphs (B = 1 and B = 3 at different positions): policy
    'dense' equals the fp32 dense reference; policy 'predictor' equals the eager step, with the
    same neuron counts on both executors (quantized: the GEMVs, sparse FFN and predictor on blocks
    inside the graphs)."""
    path, ref, plan = _model_and_plan(tmp_path, variant, split, dtype)
    tol = _tol(dtype, split)

    def run(policy, graphs):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy=policy, device="cuda", prefill_chunk=16,
                                       max_batch=4, graphs=graphs, threshold=0.2))
        try:
            out = _decode(eng)
            assert bool(eng.primary.graphs) == graphs
            # one capture per batch bucket of max_batch 4 (1, 2, 4), all at the start, none on replays
            assert eng.primary.stats.graph_captures == (3 if graphs else 0)
            # the CPU shard's neurons, wherever computed (the graphs' zero-copy share on the primary)
            cpu = eng.cpu.stats.neurons + eng.primary.stats.cold_neurons if eng.cpu else 0
            act = eng.activation_stats() if policy == "predictor" else None
            return out, eng.primary.stats.neurons, cpu, act
        finally:
            eng.close()

    _assert_decode_is_the_reference(ref, run("dense", True)[0], tol)
    # predictors: fp16 rounding differs between the paths (attention kernels), and a logit at
    # the threshold can flip a neuron: near-equal outputs and neuron counts, not identical ones
    eager, graph = run("predictor", False), run("predictor", True)
    top_eager = np.concatenate([a.argmax(-1) for a in eager[0]])
    top_graph = np.concatenate([b.argmax(-1) for b in graph[0]])
    assert (top_eager == top_graph).mean() >= 0.9, (top_eager, top_graph)
    assert graph[1] > 0 and abs(graph[1] - eager[1]) <= 0.03 * eager[1]
    assert abs(graph[2] - eager[2]) <= 0.03 * max(eager[2], 1)
    # the activation counts: the graphs add each replay's decisions once (the capture's warm-up
    # run adds none), padding rows none
    assert graph[3].n_tokens == eager[3].n_tokens == 19 + 3 * 3 + 1
    assert abs(int(graph[3].counts.sum()) - int(eager[3].counts.sum())) <= 0.03 * eager[3].counts.sum()


@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_cuda_embedding_in_host_memory_reads_its_rows_over_pcie(tmp_path, dtype):
    """A budget's plan (``Plan.embd_on_host``) keeps the token embedding in page-locked host memory:
    torch's CUDA allocations hold none of it, the budget's count leaves it out, and the prompt
    chunks and decode graphs that gather its rows over PCIe compute the fp32 dense reference."""
    path, ref, plan = _model_and_plan(tmp_path, "llama-gqa", "mixed", dtype)
    held = {}
    for on_host in (False, True):
        torch.cuda.synchronize()
        gc.collect()
        before = torch.cuda.memory_allocated()
        eng = LocalEngine(EngineConfig(str(path), plan=dataclasses.replace(plan, embd_on_host=on_host), policy="dense",
                                       device="cuda", prefill_chunk=16, max_batch=4))
        try:
            w = eng.primary.weights
            table = w.embd.numel() * w.embd.element_size()
            held[on_host] = (w.weight_bytes(), torch.cuda.memory_allocated() - before)
            if on_host:
                assert w.embd_host.is_pinned() and w.embd.is_cuda and w.embd.data_ptr() == w.embd_host.data_ptr()
                _assert_decode_is_the_reference(ref, _decode(eng), _tol(dtype, "mixed"))
                assert eng.primary.stats.graph_steps > 0
        finally:
            eng.close()
    assert held[False][0] - held[True][0] == table
    assert held[False][1] - held[True][1] >= table


def test_cuda_engine_captures_every_bucket_at_start_and_none_while_serving(tmp_path):
    """The CUDA engine captures the decode graphs of every batch size it admits (max_batch 8: 1, 2, 4,
    8) before serving; requests of different lengths served together (batches shrinking from 7 to 1)
    capture none, every decode step replays graphs, and the tokens are the dense greedy ones."""
    path, ref, plan = _model_and_plan(tmp_path, "llama-gqa", "mixed")
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", device="cuda", max_batch=8))
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(7)]
    lengths = [2, 3, 4, 5, 6, 7, 8]
    try:
        st = eng.primary.stats
        assert set(eng.primary.graphs) == {1, 2, 4, 8} and st.graph_captures == 4

        async def run():
            return await asyncio.gather(*(eng.generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True)
                                          for p, n in zip(prompts, lengths)))

        outs = asyncio.run(run())
        assert st.graph_captures == 4 and st.graph_steps >= eng.coordinator.stats()["decode_steps"] > 0
        for p, n, o in zip(prompts, lengths, outs):  # greedy under the fp32 reference, up to fp16 rounding
            toks = o["token_ids"]
            full = ref.forward(p + toks[:-1], ref.new_cache())[len(p) - 1:]  # [n, V]: the logits of each choice
            assert len(toks) == n
            for row, t in zip(full, toks):
                assert float(row.max() - row[t]) <= 2e-2 * float(row.abs().max()), (p, toks)
    finally:
        eng.close()


@pytest.mark.parametrize("split", ["mixed", "split-heads"])
def test_cuda_greedy_bursts_chain_their_steps_on_the_gpu(tmp_path, split):
    """A greedy burst on the decode graphs launches each step before the one ahead of it has ended:
    each step takes the argmax found on the GPU and the next positions from the step before (the CPU
    heads' too, in the channel). 3 sequences in the bucket of 4 (a padding row), a burst of 8: every
    token is greedy under the fp32 reference up to fp16 rounding; a step asked for the argmax alone
    returns the argmax of the logits the same graph copied out."""
    path, ref, plan = _model_and_plan(tmp_path, "llama-gqa", split)
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", device="cuda", max_batch=4))
    prompts = [list(range(5 + 3 * i, 11 + 3 * i)) for i in range(3)]
    try:
        p = eng.primary
        seqs = greedy_burst(p, prompts, 8)
        for q, seq in zip(prompts, seqs):
            full = ref.forward(q + seq[:-1], ref.new_cache())[len(q) - 1:]  # [9, V]: the logits of each choice
            for row, t in zip(full, seq):
                assert float(row.max() - row[t]) <= 2e-2 * float(row.abs().max()), (q, seq)
        ids = p.step([0, 1, 2], [[seq[-1]] for seq in seqs], [len(q) + 8 for q in prompts], argmax=True)
        g = p.graphs[4]  # one set: fp16 rows below 8 sequences take no default zero-copy share
        assert isinstance(g, DecodeGraphs)
        np.testing.assert_array_equal(ids, g.seg.logits_host[:3].numpy().argmax(-1))
    finally:
        eng.close()


@pytest.mark.parametrize("spec", ["tiny", "tiny-falcon", "tiny?dtype=q4_0"])
def test_cuda_primary_fills_the_cpu_shard_of_a_planted_model(spec):
    """The primary generates the CPU executor's rows on the GPU and writes them into its shared
    file (defer_fill): bit for bit the rows the CPU executor generates itself on the CPU."""
    from powerinfer_ray.model.source import open_model, rows_faster_on
    from powerinfer_ray.runtime.cpu_executor import CPUExecutor
    from powerinfer_ray.runtime.primary import PrimaryExecutor

    src = open_model(f"planted:{spec}")
    assert rows_faster_on(src, "cuda") and not rows_faster_on(src, "cpu")  # the engine has the primary fill
    cfg = src.config
    rng = np.random.default_rng(1)
    plan = Plan.from_masks([rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)], None, cfg)
    own = CPUExecutor(src, plan, threads=2)
    deferred = CPUExecutor(src, plan, threads=2, defer_fill=True)
    primary = PrimaryExecutor(src, plan, device="cuda")
    try:
        assert deferred.needs_fill
        primary.fill_cold(deferred.shard_spec)
        deferred.filled()
        for a, b in zip(own.ffn, deferred.ffn):
            for t in ("up", "gate", "down_t"):
                x, y = getattr(a, t), getattr(b, t)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), t
    finally:
        primary.close()
        own.stop()
        deferred.stop()


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_cuda_pinned_staging_copies_the_files_rows(tmp_path, dtype, monkeypatch):
    """The primary's loader inside pinned_staging (buffers of a few rows here: many chunks, both
    buffers in turn): whole matrices, runs and gathers, float rows and Q8_0 blocks, equal to the
    host's own copy of the rows."""
    from powerinfer_ray.model import gguf_keys as K
    from powerinfer_ray.model import staging
    from powerinfer_ray.model.source import layer_rows, open_model

    monkeypatch.setattr(staging, "STAGE_BYTES", 3 * 128 * 2 + 5)
    src = open_model(str(write_tiny_model(tmp_path / "m.gguf", "llama-gqa", seed=1, n_layer=2, dtype=dtype,
                                          n_embd=128, n_ff=512)))
    rng = np.random.default_rng(0)
    cases = [None, np.arange(40, 97), rng.choice(512, 200, replace=False)]
    with staging.pinned_staging("cuda"):
        assert staging._active is not None
        for rows in cases:
            if dtype == "f16":
                got = layer_rows(src, K.FFN_UP, 1, rows=rows, dtype=torch.float16, device="cuda")
                want = layer_rows(src, K.FFN_UP, 1, rows=rows, dtype=torch.float16)
            else:
                got = src.layer_blocks(K.FFN_UP, 1, rows=rows, device="cuda").blocks
                want = src.layer_blocks(K.FFN_UP, 1, rows=rows).blocks
            assert got.is_cuda and torch.equal(got.cpu(), want)
    assert staging._active is None


@pytest.mark.parametrize("variant, dtype", [("llama-gqa", "f16"), ("opt", "f16"), ("falcon-gqa", "q4_0")])
def test_cuda_zero_copy_decode_reads_the_cpu_rows_in_the_file(variant, dtype):
    """Zero-copy decode from a file on /dev/shm: the GPU computes a share of the CPU shard's
    predicted neurons from the file's page-locked rows over PCIe, inside the decode graphs. The
    logits stay those of the CPU executor alone (fp16: a logit at the threshold may flip a
    neuron), the two executors split its decode neurons, and the GPU's read rows are counted."""
    import tempfile

    from powerinfer_ray.runtime.channel import device_view

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        from pathlib import Path

        path, ref, plan = _model_and_plan(Path(d), variant, "split-heads", dtype)
        runs = {}
        for share in (0.0, 0.5, 1.0):
            # the prompt's chunks leave the CPU's rows to the CPU executor: the counters are the decode steps'
            eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", device="cuda", prefill_chunk=16,
                                           max_batch=4, threshold=0.2, zero_copy=share, prefill_share=0.0,
                                           prefill_dense_min=0))
            try:
                out = _decode(eng)
                st = eng.primary.stats
                hr = eng.primary.cold.host_rows(0, share)
                if share:  # the device's view is the file's bytes
                    assert hr is not None and hr.shard.up.is_cuda
                    assert torch.equal(hr.shard.up.cpu(), eng.primary.cold.rows[0].up)
                runs[share] = (out, st.cold_neurons, st.host_read_bytes, eng.cpu.stats.neurons)
            finally:
                eng.close()
    # fp16 rounding differs between the GPU's kernel and the CPU's, and a logit at the threshold can
    # flip a neuron: near-equal outputs and neuron counts (as test_cuda_graph_decode_equals_eager_and_reference)
    base = runs[0.0]
    assert base[1:3] == (0, 0)
    top = np.concatenate([a.argmax(-1) for a in base[0]])
    for share in (0.5, 1.0):
        out, mine, read, cpu = runs[share]
        assert (np.concatenate([b.argmax(-1) for b in out]) == top).mean() >= 0.9
        for a, b in zip(base[0], out):
            assert float(np.abs(a - b).max() / np.abs(a).max()) < 0.1
        assert mine > 0 and read > 0
        assert abs(cpu + mine - base[3]) <= 0.03 * base[3]
    assert runs[1.0][1] > runs[0.5][1]
    x = torch.arange(12, dtype=torch.float16).reshape(3, 4).pin_memory()
    assert torch.equal(device_view(x).cpu(), x)


@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_cuda_default_zero_copy_captures_with_and_without_and_runs_both(dtype):
    """Zero-copy at its default (a file on /dev/shm): the decode buckets whose default share is not
    none (Q4_0 at one sequence; every file at ZERO_COPY_MIN_BATCH) are captured at that share and at
    none (``ShareChoice``), the others at none alone; the first steps run both sets, and their
    logits stay those of an engine without zero-copy."""
    import tempfile
    from pathlib import Path

    from powerinfer_ray.runtime import cold
    from powerinfer_ray.runtime.graphs import ShareChoice

    B = cold.ZERO_COPY_MIN_BATCH
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path, ref, plan = _model_and_plan(Path(d), "llama-gqa", "split-heads", dtype)
        runs = {}
        for zc in (None, 0.0):
            eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", device="cuda", prefill_chunk=16,
                                           max_batch=B, threshold=0.2, zero_copy=zc, prefill_share=0.0,
                                           prefill_dense_min=0))
            try:
                g = eng.primary.graphs
                if zc is None:
                    want = {b: ([cold.ZERO_COPY, 0.0] if b >= B else [cold.ZERO_COPY_Q4_0, 0.0] if dtype == "q4_0"
                                and b == 1 else [0.0]) for b in g}
                    assert {b: [s.share for s in c.sets] if isinstance(c, ShareChoice) else [c.share]
                            for b, c in g.items()} == want
                else:
                    assert all(isinstance(c, DecodeGraphs) and c.share == 0 for c in g.values())
                prompts = [list(range(3 + i, 9 + i)) for i in range(B)]
                for slot, p in enumerate(prompts):
                    eng.primary.step([slot], [p], [0])
                pos, out = [len(p) for p in prompts], []
                for i in range(2 * ShareChoice.BLOCK):
                    out.append(eng.primary.step(list(range(B)), [[20 + i + s] for s in range(B)], pos))
                    pos = [q + 1 for q in pos]
                runs[zc] = (out, dict(eng.primary.stats.share_steps))
            finally:
                eng.close()
    steps = 2 * ShareChoice.BLOCK
    assert runs[None][1] == {f"{cold.ZERO_COPY:g}": ShareChoice.BLOCK, "0": ShareChoice.BLOCK}
    assert runs[0.0][1] == {"0": steps}
    # near-equal: the CPU multiplies Q4_0 rows by Q8_0-rounded x (ggml's way), zero-copy by x as it is,
    # and a logit at the threshold may flip a neuron between the two roundings
    rel = [float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(runs[0.0][0], runs[None][0])]
    assert np.median(rel) < 0.05 and max(rel) < 0.25, rel
    for a, b in zip(runs[0.0][0], runs[None][0]):
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_cuda_decode_graph_posts_and_awaits_on_the_gpu(tmp_path):
    """The decode step is one graph that posts to the CPU executor and waits for its answers by
    itself: every post is answered once (the CPU executor served exactly the graph's requests),
    the GPU's clock splits the step into exchanges and the rest, and an exchange (a post until
    the GPU saw the answer) lasts at least the CPU executor's compute for it."""
    path, ref, plan = _model_and_plan(tmp_path, "llama-gqa", "split-heads")
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", device="cuda", prefill_chunk=16,
                                   max_batch=4, threshold=0.2))
    try:
        for slot, p in enumerate(PROMPTS):
            eng.primary.step([slot], [p], [0])
        st, cpu = eng.primary.stats, eng.cpu.stats
        ex0, cpu0, ls0, pc0 = st.exchanges, cpu.exchanges, dict(st.layer_s), st.peer_compute_s
        pos = [len(p) for p in PROMPTS]
        for toks in NEXT:
            eng.primary.step([0, 1, 2], [[t] for t in toks], pos)
            pos = [q + 1 for q in pos]
        posts = sum(type(it) is Post for it in step_schedule(ref.cfg, plan, "predictor"))
        assert posts == 2 * ref.cfg.n_layer  # heads and neurons in every layer
        assert st.graph_steps == 3 and st.exchanges - ex0 == cpu.exchanges - cpu0 == 3 * posts
        exchange = st.layer_s["exchange"] - ls0["exchange"]
        segment = st.layer_s["segment"] - ls0["segment"]
        assert exchange > 0 and segment > 0
        assert exchange >= 0.99 * (st.peer_compute_s - pc0)  # the round trips hold the CPU's compute
        assert 0 < st.gpu_compute_s <= exchange + segment
    finally:
        eng.close()


def test_cuda_decode_graph_reports_a_failed_or_silent_cpu_executor(tmp_path, monkeypatch):
    """A CPU executor that fails a layer fails the decode step with its error; one that does not
    answer within timeout_s ends the graph's waits (the GPU stops spinning) and the step raises
    PeerDied instead of hanging; the engine still closes."""
    import time

    from powerinfer_ray.runtime.channel import PeerDied
    from powerinfer_ray.runtime.cpu_executor import CPUExecutor

    path, ref, plan = _model_and_plan(tmp_path, "llama-reglu", "mixed")
    for fault, error in (("raise", RuntimeError), ("stall", PeerDied)):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", device="cuda", prefill_chunk=16,
                                       threshold=0.2, timeout_s=2.0))
        try:
            eng.primary.step([0], [[5, 6, 7]], [0])
            eng.primary.step([0], [[8]], [3])  # a replay of the graphs captured at the start

            def broken(self, l, n_tok, n_mask):  # noqa: ANN001, ANN202
                if fault == "raise":
                    raise ValueError("broken layer")
                time.sleep(4.0)

            monkeypatch.setattr(CPUExecutor, "_ffn", broken)
            t0 = time.perf_counter()
            with pytest.raises(error, match="failed on|timed out"):
                eng.primary.step([0], [[9]], [4])
            assert time.perf_counter() - t0 < 30
            monkeypatch.undo()
            if fault == "stall":  # the channel was given up on: no later step returns logits
                with pytest.raises(PeerDied, match="given up on"):
                    eng.primary.step([0], [[10]], [5])
        finally:
            eng.close()


@pytest.mark.parametrize("variant, dtype", [("llama-gqa", "f16"), ("opt", "f16"), ("falcon-gqa", "q4_0")])
def test_cuda_swaps_between_graph_replays_keep_the_graphs_and_the_budget(variant, dtype):
    """Re-placement on a CUDA primary whose decode graphs are captured (zero-copy on, from a file
    on /dev/shm: the graphs read the CPU rows' ids on the device): neurons swapped in pauses
    between replays leave every tensor where it was, allocate nothing that stays and at most one
    pause's rows of one matrix meanwhile (the budget holds), and the replays after them give the
    logits of an engine loaded with the swapped split (fp16: near-equal, top-1 equal)."""
    import tempfile
    from pathlib import Path

    from powerinfer_ray.runtime.replacement import layer_swaps, pauses, target

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path, ref, plan = _model_and_plan(Path(d), variant, "split-heads", dtype)
        counts = np.random.default_rng(1).random((len(plan), ref.cfg.n_ff))
        limit = 64 * ref.cfg.neuron_bytes  # rows a pause trades (the engine's: replacement.MOVE_BYTES)
        moves = pauses(layer_swaps(plan, target(plan, counts), counts),
                       (ref.cfg.neuron_bytes,) * len(plan), limit=limit)
        swapped = plan
        for pause in moves:
            for s in pause:
                swapped = swapped.swap(s)
        kw = dict(policy="predictor", device="cuda", prefill_chunk=16, max_batch=4, threshold=0.2, zero_copy=0.5)
        eng = LocalEngine(EngineConfig(str(path), plan=plan, **kw))
        try:
            _decode(eng)  # graphs captured for B = 4 and B = 1
            torch.cuda.synchronize()
            gc.collect()  # earlier tests' cyclic garbage, whose CUDA tensors a collection inside the swaps would free
            held, ptrs = torch.cuda.memory_allocated(), [lw.ffn.up.data_ptr() for lw in eng.primary.weights.layers]
            torch.cuda.reset_peak_memory_stats()
            for pause in moves:
                eng.primary.swap(pause)
                eng.cpu.swap(pause)
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == held
            assert torch.cuda.max_memory_allocated() <= held + limit // 3 + (1 << 20)  # one matrix's rows at a time
            assert [lw.ffn.up.data_ptr() for lw in eng.primary.weights.layers] == ptrs
            captures = eng.primary.stats.graph_captures
            got = _decode(eng)
            assert eng.primary.stats.graph_captures == captures  # the same graphs replayed
        finally:
            eng.close()
        fresh = LocalEngine(EngineConfig(str(path), plan=swapped, **kw))
        try:
            want = _decode(fresh)
        finally:
            fresh.close()
    for a, b in zip(got, want):
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
        assert float(np.abs(a - b).max() / np.abs(b).max()) < 0.1


def test_no_garbage_collection_runs_inside_a_graph_capture(tmp_path):
    """The collector set to run at (nearly) every allocation, then an engine whose start captures
    its decode graphs: no collection starts while a capture is underway (what it frees may call
    into CUDA, which a capture forbids: the process aborts), the engine still matches the dense
    reference, and the collector is left on."""
    path, ref, plan = _model_and_plan(tmp_path, "llama-reglu", "mixed")
    during: list[str] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during.append(f"generation {info['generation']}")

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1, 1000, 1000)
    try:  # policy 'dense': decode graphs (not 'oracle', which steps eagerly) and the dense reference's sums
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="dense", device="cuda", prefill_chunk=16))
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    try:
        assert gc.isenabled() and eng.primary.use_graphs and eng.primary.stats.graph_captures > 0
        prompt = list(range(3, 19))
        eng.primary.step([0], [prompt], [0])
        got = eng.primary.step([0], [[5]], [len(prompt)])[0]
        want = ref.forward(prompt + [5], ref.new_cache())[len(prompt)]
        np.testing.assert_allclose(got, want, atol=_tol("f16", "mixed"))
    finally:
        eng.close()
    assert during == []


def test_cuda_engine_on_ray_answers_through_the_compiled_loop(ray_cluster, tmp_path):
    """The engine as users run it, its executors Ray actors (the CPU executor in a process of its
    own): the decode graphs post each layer's FFN request from the GPU, and the CPU executor's
    compiled serving loop (csrc pi_serve) answers it. The tokens are the fp32 dense reference's
    greedy ones (ties within the fp16 tolerance), and both executors count every exchange once."""
    import ray
    from ties import assert_greedy

    from powerinfer_ray.actors.coordinator import Coordinator

    path, ref, plan = _model_and_plan(tmp_path, "llama-reglu", "mixed")
    eng = Coordinator.options(name="gpu-engine-loop", num_cpus=0).remote(str(path), plan=plan, policy="dense",
                                                                         device="cuda", max_batch=2, threads=1)
    try:
        prompt = list(range(3, 19))
        out = ray.get(eng.generate.remote(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True))
        assert_greedy(ref, prompt, out["token_ids"], tie=_tol("f16", "mixed"))
        st = ray.get(eng.stats.remote())
        cpu, gpu = st["cpu_executor"], st["gpu_executor"]
        assert gpu["graph_steps"] > 0 and cpu["exchanges"] == gpu["exchanges"] > cpu["compiled_exchanges"] > 0
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
