"""The placement ILP against hand-solved optima, a brute-force oracle and the greedy baseline."""
import itertools
import pickle

import numpy as np
import pytest

from powerinfer_ray.placement import (HostProfile, InfeasibleBudgetError, ModelCosts, PlacementError,
                                      build_problem, communication_threshold, solve_greedy, solve_ilp,
                                      solve_placement)

NO_SYNC = HostProfile(sync_us=0.0)


def flat_costs(n_ff, neuron_bytes, n_kv_groups=1, attn_group_bytes=0, kv_group_bytes=0, fixed=0):
    """Costs with only FFN (and optionally attention) bytes; `fixed` goes to dense_bytes."""
    L = len(n_ff)
    return ModelCosts(n_layer=L, n_ff=tuple(n_ff), neuron_bytes=tuple(neuron_bytes),
                      n_kv_groups=n_kv_groups, attn_group_bytes=(attn_group_bytes,) * L,
                      kv_group_bytes=(kv_group_bytes,) * L, predictor_bytes=(0,) * L,
                      dense_bytes=fixed, workspace_bytes=0)


def counts_of(freqs, n_tokens):
    return [np.round(np.asarray(f) * n_tokens).astype(np.int64) for f in freqs]


# --- hand-solved problems ------------------------------------------------------------------------
def test_knapsack_where_greedy_is_not_optimal():
    # layer 0: neurons of 6 B with frequency 0.7 (0.117 per byte); layer 1: 5 B at 0.5 (0.1 per byte).
    # Budget 10 B. Greedy takes the denser 6 B neuron, then nothing fits in 4 B: 0.7.
    # All feasible sets: {0a} 0.7, {1a} 0.5, {1a,1b} 1.0 (10 B); {0a,1a} 11 B and {0a,0b} 12 B do
    # not fit. Optimum: both layer-1 neurons, 1.0.
    costs = flat_costs([2, 2], [6, 5])
    counts = counts_of([[0.7, 0.7], [0.5, 0.5]], 10)
    problem = build_problem(counts, 10, costs, 10, NO_SYNC, group_size=1)
    ilp, greedy = solve_ilp(problem, mip_gap=0), solve_greedy(problem)
    assert ilp.objective == pytest.approx(1.0) and greedy.objective == pytest.approx(0.7)
    assert ilp.gpu_counts() == [0, 2] and greedy.gpu_counts() == [1, 0]
    assert ilp.gpu_share == pytest.approx(1.0 / 2.4)


def test_communication_constraint_empties_a_layer():
    # 1000 B neurons read at 1 GB/s: a neuron of frequency f costs the CPU f us per token.
    # T_sync = 1.2 us. Layer 0 (f = .9 x4): .9, 1.8 -> C_0 = 2. Layer 1 (.5 .5 .5 .1): .5, 1, 1.5 -> C_1 = 3.
    host = HostProfile(dram_gbs=1.0, sync_us=1.2)
    freqs = [[0.9] * 4, [0.5, 0.5, 0.5, 0.1]]
    assert [communication_threshold(np.array(f), 1000, host) for f in freqs] == [2, 3]
    # Budget: 5 neurons. Greedy: 4 of layer 0 + 1 of layer 1 = 4.1, but 1 < C_1.
    # ILP over (n0, n1) with n0 in {0, 2..4}, n1 in {0, 3, 4}, n0 + n1 <= 5:
    # (4,0) 3.6, (3,0) 2.7, (2,3) 3.3, (0,4) 1.6 -> optimum (4, 0): layer 1 gets no GPU neuron.
    costs = flat_costs([4, 4], [1000, 1000])
    problem = build_problem(counts_of(freqs, 10), 10, costs, 5000, host, group_size=1)
    ilp, greedy = solve_ilp(problem, mip_gap=0), solve_greedy(problem)
    assert greedy.gpu_counts() == [4, 1] and greedy.objective == pytest.approx(4.1)
    assert ilp.gpu_counts() == [4, 0] and ilp.objective == pytest.approx(3.6)
    assert ilp.min_gpu_neurons == (2, 3)
    # without a sync cost the constraint vanishes and the ILP matches greedy's 4.1
    free = build_problem(counts_of(freqs, 10), 10, costs, 5000, NO_SYNC, group_size=1)
    assert solve_ilp(free, mip_gap=0).objective == pytest.approx(4.1)
    # and the communication-aware greedy gives the ILP's answer here
    assert solve_greedy(problem, communication=True).gpu_counts() == [4, 0]


def test_layer_never_worth_a_sync_goes_to_the_gpu_whole_or_not_at_all():
    # four neurons of frequency .1: all of them save .4 us < T_sync 1.2 us -> C = n_ff: a split
    # never pays for its sync, but the whole layer on the GPU needs none
    host = HostProfile(dram_gbs=1.0, sync_us=1.2)
    assert communication_threshold(np.full(4, 0.1), 1000, host) == 4
    costs = flat_costs([4], [1000])
    placement = solve_placement(counts_of([[0.1] * 4], 10), 10, costs, 10_000, host, group_size=1)
    assert placement.gpu_counts() == [4]  # the whole layer fits: all of it
    placement = solve_placement(counts_of([[0.1] * 4], 10), 10, costs, 3_000, host, group_size=1)
    assert placement.gpu_counts() == [0]  # three of four would fit, but a split is not worth its sync


def test_attention_becomes_placeable_when_it_does_not_fit():
    # 2 layers x 2 KV groups of 30 B weights + 10 B KV = 40 B; neurons 10 B; dense 100 B.
    # Budget 240 B < 100 + 4 x 40 = 260: attention is placeable, 140 B of room.
    # An attention unit's impact is 2 x 40/10 = 8 (4 neurons of frequency 1, weighted x2); a 40 B
    # unit beats any 4 neurons (impact <= 4), so: 3 attention units (120 B) + the 2 hottest neurons.
    # (2 units + 6 neurons = 16 + <= 6 = 22 < 24 + f1 + f2.)
    costs = flat_costs([4, 4], [10, 10], n_kv_groups=2, attn_group_bytes=30, kv_group_bytes=10, fixed=100)
    freqs = [[0.9, 0.1, 0.2, 0.3], [0.4, 0.8, 0.1, 0.1]]
    problem = build_problem(counts_of(freqs, 10), 10, costs, 240, NO_SYNC, group_size=1)
    assert problem.attention_placeable
    for placement in (solve_ilp(problem, mip_gap=0), solve_greedy(problem)):
        assert placement.gpu_attention.tolist() == [[True, True], [True, False]]  # whole layers first
        assert [np.flatnonzero(m).tolist() for m in placement.gpu_neurons] == [[0], [1]]  # .9 and .8
        assert placement.objective == pytest.approx(3 * 8 + 0.9 + 0.8)
        assert placement.gpu_bytes(costs) == 100 + 120 + 20
    # with 20 B more, all attention fits and stays fixed on the GPU: neurons get what is left
    fits = build_problem(counts_of(freqs, 10), 10, costs, 280, NO_SYNC, group_size=1)
    assert not fits.attention_placeable
    assert sum(solve_ilp(fits).gpu_counts()) == 2


def test_infeasible_budget_names_the_minimum():
    costs = ModelCosts.from_shape(n_layer=2, n_embd=8, n_ff=16, n_head=4, n_head_kv=2, n_vocab=10,
                                  gated=True, dtype_bytes=2, predictor_ranks=[3, 5], n_ctx=6, batch=2,
                                  workspace_bytes=100)
    counts = [np.arange(16)] * 2
    # by hand (test_costs_host): dense 640 + predictors 144 + 240 + workspace 100 = 1124 B
    with pytest.raises(InfeasibleBudgetError, match=r"1124 bytes") as err:
        solve_placement(counts, 100, costs, 1123)
    assert err.value.min_budget_bytes == 1124 and "GiB" in str(err.value)
    back = pickle.loads(pickle.dumps(err.value))  # as Ray carries it from the engine to the caller
    assert str(back) == str(err.value) and back.min_budget_bytes == 1124
    at_min = solve_placement(counts, 100, costs, 1124)
    assert at_min.gpu_counts() == [0, 0] and not at_min.gpu_attention.any()
    # keeping all attention (4 groups x (192 + 96) B) on the GPU needs 1124 + 1152
    with pytest.raises(InfeasibleBudgetError, match=r"2276 bytes"):
        solve_placement(counts, 100, costs, 2275, attention_placeable=False)


# --- oracles ---------------------------------------------------------------------------------------
def brute_force(freqs, neuron_bytes, attn_unit, n_kv, budget, c, group_size, weight=2.0, attention=True):
    """Best objective over every subset of units, computed from scratch (no solver code)."""
    units = []  # (layer or None, neurons, bytes, impact)
    for l, f in enumerate(freqs):
        f = np.sort(np.asarray(f))[::-1]
        for g in range(0, f.size, group_size):
            chunk = f[g:g + group_size]
            units.append((l, chunk.size, chunk.size * neuron_bytes[l], chunk.sum()))
    if attention:
        units += [(None, 0, attn_unit, weight * attn_unit / neuron_bytes[l])
                  for l in range(len(freqs)) for _ in range(n_kv)]
    best = 0.0
    for bits in itertools.product((0, 1), repeat=len(units)):
        used = sum(u[2] for u, b in zip(units, bits) if b)
        per_layer = [sum(u[1] for u, b in zip(units, bits) if b and u[0] == l) for l in range(len(freqs))]
        if used <= budget and all(n == 0 or n >= c[l] for l, n in enumerate(per_layer)):
            best = max(best, sum(u[3] for u, b in zip(units, bits) if b))
    return best


def thresholds(freqs, neuron_bytes, host):
    """C_l by its definition, looping over the hottest neurons."""
    out = []
    for f, nb in zip(freqs, neuron_bytes):
        saved, n = 0.0, 0
        if host.sync_us > 0:
            for x in sorted(f, reverse=True):
                if saved * nb / (host.dram_gbs * 1e9) >= host.sync_us * 1e-6 * (1 - 1e-12):
                    break
                saved, n = saved + x, n + 1
            if saved * nb / (host.dram_gbs * 1e9) < host.sync_us * 1e-6 * (1 - 1e-12):
                n = len(f)  # no split pays for its sync: the whole layer (no sync at all) or nothing
        out.append(n)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_ilp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_ff = rng.integers(3, 6, size=3).tolist()  # 3 layers of 3-5 neurons: groups of 2, some of 1
    neuron_bytes = rng.integers(3, 10, size=3).tolist()
    attention = bool(seed % 2)
    attn_w, attn_kv = (int(rng.integers(4, 12)), int(rng.integers(0, 6))) if attention else (0, 0)
    costs = flat_costs(n_ff, neuron_bytes, n_kv_groups=1, attn_group_bytes=attn_w, kv_group_bytes=attn_kv)
    freqs = [np.round(rng.random(n) ** 2, 2) for n in n_ff]
    host = HostProfile(dram_gbs=1e-3, sync_us=float(rng.uniform(0, 5)))  # C_l of 0 to a few neurons
    total = costs.ffn_bytes + costs.attention_bytes
    budget = int(rng.integers(total // 5, total))
    problem = build_problem(counts_of(freqs, 100), 100, costs, budget, host, group_size=2,
                            attention_placeable=attention)
    c = thresholds(freqs, neuron_bytes, host)
    assert problem.min_gpu_neurons.tolist() == c
    expected = brute_force(freqs, neuron_bytes, attn_w + attn_kv, 1, budget, c, 2, attention=attention)
    placement = solve_ilp(problem, mip_gap=0)
    assert placement.objective == pytest.approx(expected, abs=1e-9)
    placement.verify(costs, budget)


def power_law_counts(rng, n_layer, n_ff, n_tokens):
    """Activation counts whose frequencies follow a power law, skew varying per layer."""
    counts = []
    for _ in range(n_layer):
        f = np.minimum(1.0, 0.9 * np.arange(1, n_ff + 1) ** -rng.uniform(0.5, 1.2))
        counts.append(rng.binomial(n_tokens, f[rng.permutation(n_ff)]))
    return counts


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("share", [0.2, 0.5, 0.8])
def test_ilp_at_least_greedy_on_power_law(seed, share):
    rng = np.random.default_rng(100 + seed)
    costs = flat_costs([512] * 6, [100] * 6, fixed=1000)
    counts = power_law_counts(rng, 6, 512, 2000)
    budget = 1000 + int(share * costs.ffn_bytes) + int(rng.integers(0, 3200))  # not a group multiple
    problem = build_problem(counts, 2000, costs, budget, NO_SYNC, group_size=32)
    ilp, greedy = solve_ilp(problem, mip_gap=0), solve_greedy(problem)
    assert ilp.objective >= greedy.objective - 1e-9
    greedy.verify(costs, budget)
    # with a sync cost, the ILP still beats the greedy that respects eq. 5 (a feasible point)
    synced = build_problem(counts, 2000, costs, budget, HostProfile(dram_gbs=1.0, sync_us=0.4), group_size=32)
    c = synced.min_gpu_neurons
    assert ((c > 32) & (c <= 512)).any()  # the constraint has teeth: more than a group, less than never
    assert solve_ilp(synced, mip_gap=0).objective >= solve_greedy(synced, communication=True).objective - 1e-9


# --- verify ----------------------------------------------------------------------------------------
@pytest.fixture
def solved():
    host = HostProfile(dram_gbs=1.0, sync_us=1.2)
    costs = flat_costs([4, 4], [1000, 1000])
    freqs = [[0.9] * 4, [0.5, 0.5, 0.5, 0.1]]
    return costs, solve_placement(counts_of(freqs, 10), 10, costs, 5000, host, group_size=1)


def test_verify_accepts_solution(solved):
    costs, placement = solved
    placement.verify(costs)


@pytest.mark.parametrize("breakage, match", [
    (lambda p: p.gpu_neurons[1].__setitem__(slice(0, 2), True), r"eq. 4 \(GPU memory\).*6000 bytes"),
    (lambda p: (p.gpu_neurons[0].__setitem__(slice(None), False), p.gpu_neurons[1].__setitem__(0, True)),
     r"eq. 5.*layer 1: 1 GPU neurons.*C_l=3"),
    (lambda p: p.gpu_neurons.__setitem__(0, np.ones(3, dtype=bool)), r"gpu_neurons\[0\].*shape \(4,\)"),
    (lambda p: p.gpu_neurons.__setitem__(0, np.ones(4, dtype=np.int32)), r"gpu_neurons\[0\].*bool"),
    (lambda p: p.gpu_neurons.pop(), r"expected 2 layers, got 1"),
    (lambda p: setattr(p, "gpu_attention", np.ones((2, 2), dtype=bool)), r"gpu_attention.*\(2, 1\)"),
])
def test_verify_catches_broken_placement(solved, breakage, match):
    costs, placement = solved
    breakage(placement)
    with pytest.raises(PlacementError, match=match):
        placement.verify(costs)


def test_verify_checks_cpu_capacity(solved):
    costs, placement = solved  # 4 neurons on the CPU = 4000 B
    placement.verify(costs, cpu_capacity_bytes=4000)
    with pytest.raises(PlacementError, match="CPU memory"):
        placement.verify(costs, cpu_capacity_bytes=3999)


def test_time_limit_falls_back_to_a_valid_placement():
    # a limit HiGHS cannot meet: the answer is still a checked placement, no worse than the
    # greedy that respects eq. 5
    rng = np.random.default_rng(7)
    costs = flat_costs([512] * 6, [100] * 6)
    counts = power_law_counts(rng, 6, 512, 2000)
    host = HostProfile(dram_gbs=1.0, sync_us=0.5)  # C_l from 13 to 73 neurons
    problem = build_problem(counts, 2000, costs, costs.ffn_bytes // 3, host, group_size=8)
    assert problem.min_gpu_neurons.max() < 512
    placement = solve_ilp(problem, time_limit_s=1e-6)
    assert placement.status.split(":")[0] in ("optimal", "time_limit")
    placement.verify(costs, costs.ffn_bytes // 3)
    assert placement.objective >= solve_greedy(problem, communication=True).objective - 1e-9
