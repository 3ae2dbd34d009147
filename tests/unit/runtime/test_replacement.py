"""Online re-placement (runtime/replacement.py): the decayed counts, the split solved at the
engine's shard sizes (against the placement ILP), its swaps in pauses; executors swapping between
steps against the dense reference (eager and the decode segments, zero-copy, dense prefill, rows in
the file's map and copied); the engine's loop, whose solve never holds up a step."""
from __future__ import annotations

import asyncio
import threading
import time
import numpy as np
import pytest
import torch
from ties import assert_greedy

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.costs import model_costs
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.placement.host import HostProfile
from powerinfer_ray.placement.solve import solve_placement
from powerinfer_ray.runtime.config import EngineConfig, resolve_replacement
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.plan import LayerPlan, Plan, Swap
from powerinfer_ray.runtime.replacement import DecayedCounts, Replacer, Settings, gain, layer_swaps, pauses, target
from powerinfer_ray.serve.config import serving

GIB = 1 << 30


def _plan(n_layer: int, n_ff: int, seed: int, fraction: float = 0.3) -> Plan:
    from powerinfer_ray.model.config import ModelConfig

    cfg = ModelConfig(arch="llama", ffn_act="reglu", n_vocab=300, n_embd=16, n_layer=n_layer, n_head=2, n_head_kv=2, n_ff=n_ff,
                      n_ctx=32)
    rng = np.random.default_rng(seed)
    return Plan.from_masks([rng.random(n_ff) < fraction for _ in range(n_layer)], None, cfg)


# --- the policy ---------------------------------------------------------------------------------------
def test_decayed_counts_halve_old_traffic_and_survive_a_reset():
    d = DecayedCounts(1, 3, half_life=100)
    d.update(np.array([[10, 0, 5]]), 100)
    np.testing.assert_allclose(d.counts, [[10, 0, 5]])  # nothing before: no decay to see
    d.update(np.array([[10, 50, 5]]), 200)  # 100 more tokens: what came before halves
    np.testing.assert_allclose(d.counts, [[5, 50, 2.5]])
    assert d.tokens == pytest.approx(150.0)
    d.update(np.array([[4, 0, 0]]), 50)  # totals went back (executors restarted): counted afresh
    f = 0.5 ** 0.5
    np.testing.assert_allclose(d.counts, [[5 * f + 4, 50 * f, 2.5 * f]])


def test_target_keeps_each_layers_size_and_takes_the_hottest_the_placed_first_on_a_tie():
    plan = Plan((LayerPlan(np.array([0, 1]), np.array([2, 3, 4, 5]), np.array([0]), np.array([], np.int64)),))
    counts = np.array([[1.0, 5.0, 9.0, 5.0, 0.0, 7.0]])
    assert sorted(target(plan, counts)[0]) == [2, 5]
    counts[0, 5] = 5.0  # 1, 3 and 5 tie for the second row: 1 is there
    assert sorted(target(plan, counts)[0]) == [1, 2]


def test_target_is_the_first_k_of_the_neurons_sorted_by_count_then_placed_then_id():
    """Against a sort in Python (key: count descending, placed on the GPU first, id): counts drawn
    from a few values so that most neurons tie, sizes from none to all."""
    rng = np.random.default_rng(7)
    for F, k in [(64, 0), (64, 1), (64, 20), (64, 63), (64, 64), (500, 137)]:
        gpu = np.sort(rng.permutation(F)[:k])
        plan = Plan((LayerPlan(gpu, np.setdiff1d(np.arange(F), gpu), np.array([0]), np.array([], np.int64)),))
        counts = rng.integers(0, 4, (1, F)).astype(float)
        here = set(gpu.tolist())
        want = sorted(range(F), key=lambda j: (-counts[0, j], j not in here, j))[:k]
        assert sorted(target(plan, counts)[0].tolist()) == sorted(want), (F, k)


def test_target_serves_what_the_placement_ilp_cut_to_the_shard_sizes_serves(tmp_path):
    """The split re-placement takes is the placement ILP's for the same budget at the plan's sizes:
    its GPU neurons of each layer, the hottest first, topped up by the hottest others where it gave
    the layer fewer. Counts of a shifted traffic on a tiny model, plans of other traffic and other
    budgets (so the sizes are not the ILP's own), the ILP solved by HiGHS."""
    from powerinfer_ray.model.source import open_model

    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=1, n_layer=3, n_ctx=64, predictor_rank=16)
    costs = model_costs(open_model(str(path)), 64, 2)
    host = HostProfile(sync_us=0.0)  # tiny neurons are never worth a sync: split the layers anyway
    rng = np.random.default_rng(5)
    F = costs.n_ff[0]
    for trial in range(4):
        probs = rng.random((costs.n_layer, F)) ** (2 + 2 * trial) * rng.uniform(0.2, 1.0, (costs.n_layer, 1))
        counts = rng.binomial(512, probs).astype(float)
        plan = _plan(costs.n_layer, F, seed=10 + trial, fraction=rng.uniform(0.1, 0.6))  # another traffic's split
        budget = costs.min_budget_bytes(False) + int(costs.ffn_bytes * rng.uniform(0.2, 0.7))
        ilp = solve_placement([c.astype(np.int64) for c in counts], 512, costs, budget, host).gpu_neurons
        for l, lp in enumerate(plan.layers):
            k, mine = len(lp.gpu_neurons), counts[l, target(plan, counts)[l]]
            by_count = np.argsort(-counts[l], kind="stable")
            solved = by_count[np.asarray(ilp[l], bool)[by_count]]  # the ILP's, hottest first
            cut = np.concatenate([solved, by_count[~np.asarray(ilp[l], bool)[by_count]]])[:k]
            assert len(mine) == k and mine.sum() == counts[l, cut].sum(), (trial, l)
            assert mine.min() >= counts[l, np.setdiff1d(np.arange(F), target(plan, counts)[l])].max(initial=0)


def test_swaps_reach_the_target_in_pauses_of_bounded_bytes():
    plan = _plan(3, 200, seed=1)
    rng = np.random.default_rng(2)
    counts = rng.random((3, 200)) ** 4 * 100
    goal = target(plan, counts)
    swaps = layer_swaps(plan, goal, counts)
    assert [s.l for s in swaps] == [0, 1, 2] and all(len(s) for s in swaps)
    for s in swaps:  # the CPU rows freed, frontmost first, go to the leaving neurons, hottest first
        assert np.all(np.diff(s.cpu_rows) > 0) and np.all(np.diff(counts[s.l, s.to_cpu]) <= 0)
    neuron_bytes = (100, 100, 300)
    groups = pauses(swaps, neuron_bytes, limit=1000)
    assert all(sum(len(s) * neuron_bytes[s.l] for s in p) <= 1000 for p in groups)
    assert sum(len(s) for p in groups for s in p) == sum(len(s) for s in swaps)
    for p in groups:
        for s in p:
            plan = plan.swap(s)
    for l in range(3):
        assert sorted(plan[l].gpu_neurons) == sorted(goal[l])
        assert np.array_equal(np.sort(np.concatenate([plan[l].gpu_neurons, plan[l].cpu_neurons])), np.arange(200))
    assert plan.gpu_activation_share(counts) == pytest.approx(sum(counts[l, goal[l]].sum() for l in range(3)) / counts.sum())
    with pytest.raises(AssertionError, match="another plan"):
        plan.swap(swaps[0])  # made for the plan before


NEURON_BYTES = (10, 10)


def test_a_split_is_taken_when_it_gains_on_the_interval_its_solve_did_not_see():
    """The solve sees the counts before the newest interval; a split is taken when its gain (the
    share of the plan's CPU counts its GPU neurons take onto the GPU) reaches the threshold both there
    and on the newest interval: a shift of the traffic does, a split fitted to noise does not."""
    plan = _plan(2, 50, seed=3)
    rng = np.random.default_rng(4)
    hot = [rng.permutation(50)[:10] for _ in range(2)]  # the traffic's hot neurons (few on the GPU)
    p = np.full((2, 50), 0.05)
    for l in range(2):
        p[l, hot[l]] = 0.8
    shifted = [rng.binomial(200, p) for _ in range(2)]  # two intervals of 200 tokens of it
    noise = [rng.binomial(200, np.full((2, 50), 0.3)) for _ in range(2)]  # no hot set at all
    for intervals, threshold, taken in ((shifted, 0.02, True), (shifted, 0.99, False), (noise, 0.02, False)):
        r = Replacer(plan, Settings(interval=200, threshold=threshold), NEURON_BYTES)
        r.observe(intervals[0], 200)
        assert not r.ready  # nothing yet to solve from
        r.observe(intervals[0] + intervals[1], 400)
        assert r.ready and r.history[-1]["gpu_share"] == pytest.approx(plan.gpu_activation_share(intervals[1]), abs=1e-4)
        np.testing.assert_array_equal(r.basis[0], intervals[0])  # the solve's view: the first interval
        assert r.judge() is taken
        goal = target(plan, intervals[0].astype(float))
        fitted, unseen = gain(plan, goal, intervals[0]), gain(plan, goal, intervals[1])
        for l in range(2):  # by hand: the goal's counts beyond the plan's, over all counts
            assert len(goal[l]) == len(plan[l].gpu_neurons)
        by_hand = sum(intervals[1][l, goal[l]].sum() - intervals[1][l, plan[l].gpu_neurons].sum() for l in range(2))
        on_cpu = sum(intervals[1][l, plan[l].cpu_neurons].sum() for l in range(2))  # what the CPU computed
        assert unseen == pytest.approx(by_hand / on_cpu)
        assert r.counters["last_gain"] == pytest.approx(unseen, abs=1e-4)
        assert r.counters["last_gain_fitted"] == pytest.approx(fitted, abs=1e-4)
        assert bool(r.queue) is taken
        if intervals is noise:  # fitted to the first interval's noise: a gain there, none on the next
            assert fitted > 0.02 and unseen < 0.02
        else:
            assert min(fitted, unseen) > 0.1


def test_refused_splits_back_off_the_solves_until_the_traffic_leaves_the_split():
    """Traffic the split already serves: after each refused split the next solve waits 1, 2, 4,
    8, then 8 intervals (``MAX_BACKOFF``); a shift that grows the CPU's share of an interval by the
    threshold (a fraction of it) makes a solve due at every interval (the first refused: its counts are the old
    traffic's) until a split moves."""
    from powerinfer_ray.runtime.replacement import MAX_BACKOFF

    plan = _plan(2, 50, seed=5)
    rng = np.random.default_rng(6)
    on_gpu = np.zeros((2, 50), bool)
    for l in range(2):
        on_gpu[l, plan[l].gpu_neurons] = True
    r = Replacer(plan, Settings(interval=1000, threshold=0.05), NEURON_BYTES)
    totals, due = np.zeros((2, 50)), []

    def interval(i: int, probs: np.ndarray) -> bool | None:
        """One interval of traffic of ``probs``; the solve's verdict when one was due."""
        totals[:] += rng.binomial(1000, probs)  # the CPU's share of an interval: ~2 % noise, below the threshold
        r.observe(totals.copy(), 1000 * (i + 1))
        if not r.ready:
            return None
        due.append(i)
        return r.judge()

    for i in range(25):  # the split's own traffic: nothing better to move to
        assert interval(i, np.where(on_gpu, 0.8, 0.05)) in (None, False)
    assert due == [1, 2, 4, 8, 16, 24] and r.backoff == MAX_BACKOFF == 8
    shifted = np.where(on_gpu, 0.05, 0.8)
    verdicts = [interval(i, shifted) for i in range(25, 28)]  # in the backoff's wait
    assert due[-3:] == [25, 26, 27]  # each interval due: its share is below the one the split was kept at
    # refused while the counts solved from are mostly the old traffic's; then moved
    assert verdicts[0] is False and verdicts[-1] is True and r.queue
    assert r.backoff == 1 and r.stats()["backoff"] == 1


def test_replacement_is_checked_against_what_the_engine_can_do(tmp_path):
    path = str(write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=1, n_layer=2, n_ctx=64, predictor_rank=16))
    with pytest.raises(ValueError, match="replacement='sometimes'"):
        EngineConfig(path, replacement="sometimes")
    with pytest.raises(ValueError, match="replacement_interval=0"):
        EngineConfig(path, replacement_interval=0)
    with pytest.raises(ValueError, match="replacement_threshold=1.5"):
        EngineConfig(path, replacement_threshold=1.5)
    split = _plan(2, 128, seed=0)
    with pytest.raises(ValueError, match="replacement='on'.*vram_budget_gib"):
        resolve_replacement(EngineConfig(path, replacement="on"), split, "predictor")
    with pytest.raises(ValueError, match="policy that counts activations.*'dense'"):
        resolve_replacement(EngineConfig(path, replacement="on", vram_budget_gib=1.0), split, "dense")
    ec = EngineConfig(path, replacement="auto")
    assert not resolve_replacement(ec, split, "predictor")  # no budget: off, not an error
    assert resolve_replacement(EngineConfig(path, replacement="auto", vram_budget_gib=1.0), split, "oracle")
    assert not resolve_replacement(EngineConfig(path, vram_budget_gib=1.0), split, "oracle")  # default: off
    assert serving(EngineConfig(path)).replacement == "auto"  # a server's default
    assert serving(EngineConfig(path, replacement="off")).replacement == "off"


# --- executors swapping between steps ---------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], list(range(30, 42)), [200, 1, 2, 3]]
NEXT = [[11, 12, 13], [40, 41, 42], [7, 99, 150], [3, 4, 5], [60, 61, 62]]  # decode steps of all three
LATE = list(range(70, 80))  # a prompt prefilled after every swap (densely on the primary where it can)


class Hooks:
    """FFNHooks of the reference: the predictor's decisions (float64, from the file's weights) as the
    FFN's mask, or none (the true activity); each counted per layer and neuron, as the engine counts."""

    def __init__(self, ref: ReferenceModel, threshold: float | None) -> None:
        self.ref, self.thr = ref, threshold
        self.counts = np.zeros((ref.cfg.n_layer, ref.cfg.n_ff), np.int64)

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor | None:
        if self.thr is None:
            return None
        w = self.ref.w
        fc1, fc2 = w[K.tensor(K.FC1, l)].double(), w[K.tensor(K.FC2, l)].double()
        m = torch.relu(pred_in.double() @ fc1.T) @ fc2.T >= self.thr  # [T, F]
        self.counts[l] += m.sum(0).numpy()
        return m

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        if self.thr is None:
            self.counts[l] += (h != 0).sum(0).numpy()


def _split(cfg, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return Plan.from_masks([rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)], groups, cfg)


def _moves(plan: Plan, seed: int) -> list[list[Swap]]:
    """Re-placement toward random traffic: every layer's GPU set changes, in several pauses."""
    counts = np.random.default_rng(seed).random((len(plan), len(plan[0].gpu_neurons) + len(plan[0].cpu_neurons)))
    goal = target(plan, counts)
    out = pauses(layer_swaps(plan, goal, counts), (1,) * len(plan), limit=7)
    assert len(out) >= 4
    return out


def _held(eng: LocalEngine) -> tuple[int, list[int]]:
    """What the primary holds: its bytes and the address of every FFN and predictor tensor."""
    tensors = [t for lw in eng.primary.weights.layers for t in (lw.ffn.up, lw.ffn.gate, lw.ffn.down_t, lw.fc2)
               if t is not None]
    return eng.primary.weight_bytes(), [t.data_ptr() for t in tensors]


def _serve_with_swaps(eng: LocalEngine, moves: list[list[Swap]]) -> list[np.ndarray]:
    """PROMPTS prefilled, NEXT decoded (all three together), LATE prefilled in a fourth slot and
    decoded once with the others; half the pauses after the first decode step, the rest after
    the third, as the engine's loop applies them (both executors, between steps). The logits of
    every step."""
    out = [eng.primary.step([s], [p], [0]) for s, p in enumerate(PROMPTS)]
    pos = [len(p) for p in PROMPTS]
    half = len(moves) // 2
    for i, toks in enumerate(NEXT):
        if i in (1, 3):
            for pause in moves[:half] if i == 1 else moves[half:]:
                asyncio.run(eng._swap(pause))
        out.append(eng.primary.step([0, 1, 2], [[t] for t in toks], pos))
        pos = [q + 1 for q in pos]
    out.append(eng.primary.step([3], [LATE], [0]))
    out.append(eng.primary.step([0, 1, 2, 3], [[9], [9], [9], [9]], pos + [len(LATE)]))
    return out


def _reference(ref: ReferenceModel, hooks: Hooks) -> list[list[torch.Tensor]]:
    """Per step of ``_serve_with_swaps``, the reference's logits of each sequence it ran."""
    seqs = [p + [t[s] for t in NEXT] + [9] for s, p in enumerate(PROMPTS)] + [LATE + [9]]
    full = [ref.forward(s, ref.new_cache(), hooks) for s in seqs]
    steps = [[full[s][len(p) - 1]] for s, p in enumerate(PROMPTS)]
    steps += [[full[s][len(PROMPTS[s]) + j] for s in range(3)] for j in range(len(NEXT))]
    steps.append([full[3][len(LATE) - 1]])
    steps.append([full[s][-1] for s in range(4)])
    return steps


@pytest.mark.parametrize("variant, graphs, zero_copy, dense_min", [
    ("llama-reglu", False, 0.0, 0), ("llama-reglu", True, 0.0, 8), ("llama-reglu", True, 0.5, 0),
    ("opt", True, 0.5, 8),  # an up bias on both sides
    ("falcon-gqa", False, 0.0, 8)])  # parallel attention: one request per layer
def test_swaps_between_steps_keep_every_logit_on_the_reference(tmp_path, variant, graphs, zero_copy, dense_min):
    """Policy 'predictor', neurons swapped in pauses between steps, the decode steps eager or as the
    fixed-shape segments of the CUDA graphs (run eagerly here), with zero-copy and dense prefill:
    every step's logits are the reference forward's under the same predictor decisions, before,
    during and after the move; the primary holds the same bytes at the same addresses (the budget
    holds and the captured graphs stay valid); both executors end on the same plan; the activation
    counts by neuron id are the reference's whichever executor counted them."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=5, n_layer=3, n_ctx=64, predictor_rank=16)
    ref = ReferenceModel.from_file(path)
    plan = _split(ref.cfg, 1)
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="predictor", threshold=0.2, prefill_chunk=16,
                                   max_batch=4, graphs=graphs, zero_copy=zero_copy, prefill_dense_min=dense_min))
    try:
        held = _held(eng)
        moves = _moves(plan, 2)
        got = _serve_with_swaps(eng, moves)
        assert (4 in eng.primary.graphs) == graphs and _held(eng) == held
        assert eng.cpu.ffn_rows == "file" and eng.group.dense_prefill == ("file" if dense_min or zero_copy else None)
        want_plan = plan
        for pause in moves:
            for s in pause:
                want_plan = want_plan.swap(s)
        for p in (eng.primary.plan, eng.cpu.plan, eng.primary.cold.plan):
            assert all(np.array_equal(a.gpu_neurons, b.gpu_neurons) and np.array_equal(a.cpu_neurons, b.cpu_neurons)
                       for a, b in zip(p.layers, want_plan.layers))
        moved = sum(len(s) for pause in moves for s in pause)
        assert eng.primary.stats.moved_neurons == eng.cpu.stats.moved_neurons == moved
        counts = eng.activation_stats().counts
    finally:
        eng.close()
    hooks = Hooks(ref, 0.2)
    for g, w in zip(got, _reference(ref, hooks)):
        torch.testing.assert_close(torch.from_numpy(g), torch.stack(w), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(counts, hooks.counts)


@pytest.mark.parametrize("shared", [True, False])
def test_swaps_rewrite_the_rows_of_a_copied_cpu_shard(monkeypatch, shared):
    """A planted model has no file: the CPU executor's rows are a copy (one shared-memory file the
    primary maps too, or private memory and the primary's own copy), into which a swap writes the
    arriving neurons' rows. Policy 'oracle' (each executor finds its own active neurons): every
    step equals the plain dense forward, and the true activity counted by both executors is the
    reference's."""
    from powerinfer_ray.model.planted import planted_model
    from powerinfer_ray.runtime import sharedshard

    if not shared:
        monkeypatch.setattr(sharedshard, "HEADROOM", 1 << 60)  # /dev/shm "full"
    spec = "planted:tiny?layers=2&dtype=f32"
    ref = planted_model(spec.removeprefix("planted:")).reference()
    plan = _split(ref.cfg, 3)
    eng = LocalEngine(EngineConfig(spec, plan=plan, policy="oracle", prefill_chunk=16, max_batch=4,
                                   prefill_dense_min=8))
    try:
        assert eng.cpu.ffn_rows == ("shared" if shared else "private")
        got = _serve_with_swaps(eng, _moves(plan, 4))
        counts = eng.activation_stats().counts
    finally:
        eng.close()
    hooks = Hooks(ref, None)
    for g, w in zip(got, _reference(ref, hooks)):
        torch.testing.assert_close(torch.from_numpy(g), torch.stack(w), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(counts, hooks.counts)


# --- the engine's loop ------------------------------------------------------------------------------
class GatedJudge:
    """A Replacer's ``judge``, returning only once the test opens ``gate``; ``asked`` is set with
    the engine's step count when a solve comes in (in the loop's thread, beside the steps)."""

    def __init__(self, judge: callable, steps: callable) -> None:
        self.judge, self.steps = judge, steps
        self.gate, self.asked = threading.Event(), threading.Event()
        self.steps_at_ask = -1

    def __call__(self) -> bool:
        self.steps_at_ask = self.steps()
        self.asked.set()
        self.gate.wait()
        return self.judge()


def _wait_for(what, timeout_s: float = 120.0) -> None:
    """Until ``what()`` holds (the engine's loop runs in its own thread)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out waiting for the engine's state"
        time.sleep(0.02)


def test_the_background_solve_never_holds_up_a_step_and_its_split_follows_the_traffic(tmp_path):
    """An engine started on a bad split (the coldest third of each layer's neurons of a planted
    model on the primary) with re-placement on: the solve due after 16 tokens is held back, and
    generation goes on meanwhile, step after step; once it answers, the neurons move (in pauses
    between steps, while a request is in flight), the GPU's share of the activations rises, and
    the generated tokens are the dense reference's greedy ones throughout (policy 'oracle':
    exact)."""
    from powerinfer_ray.model.planted import planted_model
    from powerinfer_ray.model.source import open_model

    spec = "planted:tiny?layers=2&dtype=f32"
    m = planted_model(spec.removeprefix("planted:"))
    ref = m.reference()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, ref.cfg.n_vocab, 12).tolist() for _ in range(4)]
    bad = Plan.hottest(ref.cfg, 1 / 3, counts=[-m.activation_probs(l) for l in range(ref.cfg.n_layer)])
    costs = model_costs(open_model(spec), 256, 2)
    HostProfile(sync_us=0.0).save(tmp_path / "host.json")  # tiny neurons are never worth a sync: split anyway
    budget = (costs.min_budget_bytes(False) + costs.ffn_bytes // 3) / GIB
    eng = LocalEngine(EngineConfig(spec, plan=bad, vram_budget_gib=budget, host_profile=str(tmp_path / "host.json"),
                                   policy="oracle", max_batch=2, prefill_chunk=16, n_ctx=256, replacement="on",
                                   replacement_interval=16))
    gated = GatedJudge(eng.replacer.judge, lambda: eng.coordinator.counters["decode_steps"])
    eng.replacer.judge = gated
    try:

        def generate(i: int, n: int = 40) -> list[int]:
            out = asyncio.run(eng.generate(prompt_token_ids=prompts[i], max_tokens=n, temperature=0, ignore_eos=True))
            assert len(out["token_ids"]) == n, i
            assert_greedy(ref, prompts[i], out["token_ids"])
            return out["token_ids"]

        generate(0)
        assert gated.asked.is_set() and eng.stats()["replacement"]["solving"]
        generate(1)  # the solve still waits: every step of it ran (its 39 decode steps, in bursts or not)
        assert eng.coordinator.counters["decode_steps"] >= gated.steps_at_ask + 39
        assert eng.replacer.counters["solves"] == 0
        before = eng.replacer.history[0]["gpu_share"]
        gated.gate.set()  # the solve answers while a request is in flight
        done = threading.Thread(target=generate, args=(2, 120))
        done.start()
        _wait_for(lambda: eng.replacer.counters["pauses"] > 0 and not eng.replacer.queue)
        done.join()
        generate(3)
        st = eng.stats()["replacement"]
        with eng._backend.step_lock:  # both executors swap under it (the loop may move more meanwhile)
            moved = (eng.primary.stats.moved_neurons, eng.cpu.stats.moved_neurons)
    finally:
        gated.gate.set()  # a failed check must not leave the solve waiting: close() waits for the loop
        eng.close()
    assert st["accepted"] >= 1 and st["neurons_moved"] > 0 and st["last_gain"] is not None
    assert st["gpu_share_recent"] > before + 0.3, (before, st["gpu_share_history"])
    assert moved[0] == moved[1] >= st["neurons_moved"]
