"""The paper's neuron-placement integer program (cvxpy + HiGHS), and a greedy baseline.

PowerInfer (SOSP'24), section 6 "Neuron placement policy", over groups of neurons of similar
frequency (problem.py builds them). For layer l and its neuron group g:

  a[l,g] in {0,1}   group on the GPU (1) or the CPU (0)                                 eq. 8
  y[l]   in {0,1}   layer l has GPU neurons                                             eq. 7

  maximise   sum_lg v_lg a[l,g]  (+ attention units, below)    impact served by GPU   eq. 2
  s.t.       a_GPU + a_CPU = 1: built in, a is the GPU indicator and 1 - a the CPU's   eq. 3
             sum_lg M_lg a[l,g] + attention on GPU <= MCap_GPU                         eq. 4
             sum_lg M_lg (1 - a[l,g]) + attention on CPU <= MCap_CPU (host RAM, if set) eq. 4
             sum_g s_lg a[l,g] >= C_l y[l]                     communication           eq. 5
             sum_g a[l,g] <= G_l y[l]                                                  eq. 6

  v_lg = sum of the group's activation frequencies (eq. 1), M_lg its bytes, s_lg its neurons,
  G_l the number of groups of layer l (the paper's large constant, at its tightest), MCap_GPU =
  budget - fixed parts (dense, predictors, workspace; plus attention + KV when all of it fits).

  C_l = min { n : sum_{e<n} f_(e) * M_l / B_dram >= T_sync }, f_(0) >= f_(1) >= ... the layer's
  frequencies and M_l its bytes per neuron: the CPU time its n hottest neurons would cost per
  token at host-DRAM bandwidth must exceed one per-layer CPU-GPU sync T_sync (both from the
  HostProfile; problem.communication_threshold).

How it is handed to HiGHS (same optimum, solved in about a second at 70B instead of minutes):
  * Within a layer all full-size groups have equal bytes and neurons and decreasing impact, so
    swapping a chosen group for an unchosen hotter one never hurts: some optimal a takes them as a
    prefix. The integrality of eq. 8 is carried by the count n[l] = sum_g a[l,g] (integer), with
    a relaxed to [0,1]: for integer n[l] the LP puts a = 1 on the n[l] hottest groups, and the
    placement is read back as exactly that prefix. A smaller last group (n_ff % group_size) keeps
    its own binary s[l]. HiGHS branches on L counts instead of L x G binaries.
  * The m_l = ceil((C_l - r_l) / group_size) hottest full groups, which eq. 5 forces whenever
    the layer is used (r_l: size of the smaller last group, else 0), are tied to y[l] (a = y, so
    they are no variables). Valid for prefix solutions; in the LP relaxation a fractional y[l]
    then buys a fraction of the whole block, not its hottest groups at full value, which makes
    the relaxation tight: branch-and-bound closes at the root or after a few nodes.
  * Attention units (problem.py) that are interchangeable (same bytes, same impact) become one
    integer count per class; the chosen count fills layers in order, whole layers first.
  * eq. 4 is divided by the gcd of all unit sizes and the capacity floored: exact in integers,
    and it turns "room for 1.7 groups" into "room for 1", which tightens the LP.
  * The greedy solution repaired for eq. 5 (solve_greedy(communication=True)) is an incumbent:
    when HiGHS stops at its gap or time limit below it, the repaired greedy is returned.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from .costs import GIB
from .problem import InfeasibleBudgetError, PlacementProblem
from .result import Placement, PlacementError

DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_MIP_GAP = 1e-4  # relative gap: 0.01 % of the objective
_MAX_ROUNDING_RETRIES = 3


class SolverError(RuntimeError):
    """HiGHS failed without a usable solution."""


@dataclass
class _Structure:
    """Per-layer shape of the groups: the full-size groups and the smaller last one."""

    full: np.ndarray  # [L, Gm] bool: group has group_size neurons
    n_full: np.ndarray  # [L] full groups
    small_col: np.ndarray  # [L] column of the smaller last group, -1 if none
    small_size: np.ndarray  # [L] neurons in it (0 if none)
    block: np.ndarray  # [L] m_l: hottest full groups eq. 5 forces when y[l] = 1

    @classmethod
    def of(cls, problem: PlacementProblem) -> "_Structure":
        sizes, gs = problem.group_sizes, problem.group_size
        full = sizes == gs
        small = (sizes > 0) & ~full  # [L, Gm] at most one per layer: the last group
        small_col = np.where(small.any(axis=1), small.argmax(axis=1), -1)
        small_size = (sizes * small).sum(axis=1)
        need = np.maximum(problem.min_gpu_neurons - small_size, 0)
        block = np.minimum(-(-need // gs), full.sum(axis=1))  # ceil, at most the full groups
        return cls(full, full.sum(axis=1), small_col, small_size, block)


def solve_ilp(problem: PlacementProblem, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
              mip_gap: float = DEFAULT_MIP_GAP, verbose: bool = False) -> Placement:
    """Solve eqs. 2-8 with HiGHS; the result is re-checked with Placement.verify."""
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s: expected > 0, got {time_limit_s}")
    if not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap: expected in [0, 1), got {mip_gap}")
    t0 = time.perf_counter()
    incumbent = _incumbent(problem)
    solved = _solve_rounded(problem, time_limit_s, mip_gap, verbose)
    seconds = time.perf_counter() - t0
    if solved is None:  # time limit without a HiGHS solution: the incumbent stands
        if incumbent is None:
            raise SolverError(f"HiGHS found no solution within {time_limit_s} s and the greedy "
                              f"incumbent breaks the CPU capacity; raise time_limit_s")
        return _as_ilp(incumbent, "time_limit:greedy_incumbent", seconds)
    a, h, status = solved
    placement = problem.to_placement(a, h, status=status, method="ilp", seconds=seconds,
                                     enforce_communication=True)
    if incumbent is not None and incumbent.objective > placement.objective:  # stopped within the gap
        placement = _as_ilp(incumbent, f"{status}:greedy_incumbent", seconds)
    placement.verify(problem.costs, problem.budget_bytes, problem.cpu_capacity)
    return placement


def _solve_rounded(problem: PlacementProblem, time_limit_s: float, mip_gap: float,
                   verbose: bool) -> tuple[np.ndarray, np.ndarray, str] | None:
    """HiGHS's (a, h, status) after rounding, re-solved with less capacity in the rare case
    where a count it left within its integrality tolerance rounds over eq. 4."""
    capacity = problem.gpu_capacity
    for _ in range(_MAX_ROUNDING_RETRIES):
        solved = _solve_once(problem, capacity, time_limit_s, mip_gap, verbose)
        if solved is None:
            return None
        over = _gpu_bytes(problem, solved[0], solved[1]) - problem.gpu_capacity
        if over <= 0:
            return solved
        capacity -= over
    raise SolverError(f"ILP: rounded solution exceeds the GPU capacity by {over} bytes after "
                      f"{_MAX_ROUNDING_RETRIES} tries")


def _incumbent(problem: PlacementProblem) -> Placement | None:
    """The greedy that respects eq. 5, or None where it breaks the CPU capacity (eq. 4)."""
    try:
        return solve_greedy(problem, communication=True)
    except PlacementError:
        return None


def _as_ilp(placement: Placement, status: str, seconds: float) -> Placement:
    placement.method, placement.status, placement.solve_seconds = "ilp", status, seconds
    return placement


def _gpu_bytes(problem: PlacementProblem, a: np.ndarray, h: np.ndarray) -> int:
    ffn = int((problem.group_bytes * a).sum())
    return ffn + (int((problem.attn_bytes * h).sum()) if problem.attention_placeable else 0)


def _solve_once(problem: PlacementProblem, capacity: int, time_limit_s: float, mip_gap: float,
                verbose: bool) -> tuple[np.ndarray, np.ndarray, str] | None:
    """One HiGHS solve: (a [L, Gm] bool, h [L, K] bool, status), or None at the time limit
    without a solution."""
    import cvxpy as cp  # here, not at import: it takes ~2 s, and a cached split needs no solve

    model = _Model(problem, capacity)
    with warnings.catch_warnings():  # cvxpy warns at HiGHS's time limit; our status says it
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
        # HiGHS presolve spends seconds probing this model for no reduction: off
        model.prob.solve(solver=cp.HIGHS, verbose=verbose, time_limit=float(time_limit_s),
                         mip_rel_gap=float(mip_gap), presolve="off", output_flag=verbose)
    status = _check_status(model.prob, problem, time_limit_s)
    return None if status is None else (*model.selection(), status)


class _Model:
    """eqs. 2-8 in the count form (module docstring), as a cvxpy problem.

    Per layer l: y[l] (eq. 7); the block of m_l hottest groups is on iff y[l] (a = y there, so
    the block is not a variable); n[l] = further full groups, integer; a[l,g] in [0,1] for those
    groups, summing to n[l]; s[l] the smaller last group. L x Gm continuous, 3L integer columns.
    """

    def __init__(self, problem: PlacementProblem, capacity: int):
        import cvxpy as cp

        self.problem, self.st = problem, _Structure.of(problem)
        st, L = self.st, problem.costs.n_layer
        unit = _byte_unit(problem)
        block = np.arange(problem.group_sizes.shape[1])[None, :] < st.block[:, None]  # [L, Gm]
        free = st.full & ~block  # [L, Gm] full groups past the block
        has_small = st.small_col >= 0
        rows = np.arange(L)
        self.y = y = cp.Variable(L, boolean=True)  # eq. 7
        self.n = n = cp.Variable(L, integer=True, bounds=[np.zeros(L), free.sum(axis=1)])
        a = cp.Variable(free.shape, bounds=[np.zeros(free.shape), free.astype(float)])  # eq. 8 via n
        self.s = s = cp.Variable(L, boolean=True)
        block_impact = (problem.group_impact * block).sum(axis=1)  # [L]
        small_impact = np.where(has_small, problem.group_impact[rows, st.small_col], 0.0)
        group_units = np.asarray(problem.costs.neuron_bytes) * problem.group_size // unit  # [L]
        small_units = np.where(has_small, problem.group_bytes[rows, st.small_col], 0) // unit
        full_groups = cp.multiply(st.block, y) + n  # [L] full groups on the GPU

        served = block_impact @ y + cp.sum(cp.multiply(problem.group_impact * free, a)) + small_impact @ s
        gpu_units = group_units @ full_groups + small_units @ s
        cons = [
            cp.sum(a, axis=1) == n,  # the count carries eq. 8's integrality
            problem.group_size * full_groups + cp.multiply(st.small_size, s)
            >= cp.multiply(problem.min_gpu_neurons, y),  # eq. 5
            full_groups + s <= cp.multiply(problem.n_groups, y),  # eq. 6
            s <= cp.multiply(has_small, y),  # eq. 6 for the smaller group; 0 where there is none
        ]
        cpu_units = int(problem.group_bytes.sum()) // unit - gpu_units
        if problem.attention_placeable:
            classes, self.members = _attention_classes(problem)
            self.t = t = cp.Variable(len(classes), integer=True,
                                     bounds=[np.zeros(len(classes)), self.members.sum(axis=1)])
            served = served + np.array([w for w, _ in classes]) @ t  # eq. 2, attention part
            attn_units = np.array([b // unit for _, b in classes]) @ t
            gpu_units = gpu_units + attn_units
            cpu_units = cpu_units + int(problem.attn_bytes.sum()) // unit - attn_units
        cons.append(gpu_units <= capacity // unit)  # eq. 4, GPU
        if problem.cpu_capacity is not None:
            cons.append(cpu_units <= problem.cpu_capacity // unit)  # eq. 4, CPU
        self.prob = cp.Problem(cp.Maximize(served), cons)  # eq. 2

    def selection(self) -> tuple[np.ndarray, np.ndarray]:
        """(a [L, Gm] bool, h [L, K] bool) of the solved values, FFN groups as prefixes."""
        y, n, s = (np.rint(v.value).astype(int) for v in (self.y, self.n, self.s))
        a = _prefix(self.st.block * y + n, self.st, s.astype(bool))
        if not self.problem.attention_placeable:
            return a, np.zeros((0, 0), dtype=bool)
        return a, _fill_attention(self.problem, self.members, np.rint(self.t.value).astype(int))


def _prefix(n: np.ndarray, st: _Structure, s: np.ndarray) -> np.ndarray:
    """[L, Gm] bool: the n[l] hottest full groups of each layer, and the smaller one if s[l]."""
    a = (np.arange(st.full.shape[1])[None, :] < n[:, None]) & st.full
    rows = np.flatnonzero(s & (st.small_col >= 0))
    a[rows, st.small_col[rows]] = True
    return a


def _attention_classes(problem: PlacementProblem) -> tuple[list[tuple[float, int]], np.ndarray]:
    """Interchangeable attention units: [(impact, bytes)] per class, and members [C, L*K] bool."""
    keys = list(zip(problem.attn_impact.ravel().tolist(), problem.attn_bytes.ravel().tolist()))
    classes = sorted(set(keys))
    index = {c: i for i, c in enumerate(classes)}
    members = np.zeros((len(classes), len(keys)), dtype=bool)
    members[[index[k] for k in keys], np.arange(len(keys))] = True
    return classes, members


def _fill_attention(problem: PlacementProblem, members: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[L, K] bool: for each class, its first counts[c] units in layer-major order (whole layers
    first, so fewer layers split their attention between the devices)."""
    h = np.zeros(members.shape[1], dtype=bool)
    for row, count in zip(members, counts):
        h[np.flatnonzero(row)[:count]] = True
    return h.reshape(problem.attn_bytes.shape)


def _byte_unit(problem: PlacementProblem) -> int:
    """gcd of all unit sizes (eq. 4 is exact in these units)."""
    sizes = np.unique(problem.group_bytes[problem.group_sizes > 0])
    if problem.attention_placeable:
        sizes = np.union1d(sizes, np.unique(problem.attn_bytes))
    return int(np.gcd.reduce(sizes.astype(np.int64)))


def _check_status(prob: cp.Problem, problem: PlacementProblem, time_limit_s: float) -> str | None:
    """Our status for cvxpy's: 'optimal' (within the MIP gap), 'time_limit' (an incumbent), None
    (time limit without a solution); raise on infeasible or failed solves."""
    import cvxpy as cp

    if prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        return "optimal"
    if prob.status == cp.USER_LIMIT:
        has_solution = prob.value is not None and np.isfinite(prob.value)
        return "time_limit" if has_solution else None
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        need = problem.costs.min_budget_bytes(problem.attention_placeable)
        raise InfeasibleBudgetError(
            f"ILP infeasible at budget {problem.budget_bytes / GIB:.3f} GiB ({problem.budget_bytes} "
            f"bytes); the minimum budget is {need / GIB:.3f} GiB ({need} bytes) "
            f"({problem.costs.describe_fixed()}); check host_ram_bytes too", need)
    raise SolverError(f"HiGHS returned status {prob.status!r} within {time_limit_s} s; "
                      f"raise time_limit_s or use method='greedy'")


# --- greedy -----------------------------------------------------------------------------------
def solve_greedy(problem: PlacementProblem, communication: bool = False) -> Placement:
    """Top-frequency-first greedy: the fixed parts are paid already (gpu_capacity); take units
    (FFN groups of all layers, and attention units when placeable) by impact per byte, highest
    first, skipping those that no longer fit.

    communication=False ignores eq. 5-6: the baseline the ILP must match or beat when T_sync = 0,
    and the test oracle. communication=True keeps eq. 5: the hottest groups of a layer that reach
    C_l neurons form one unit (its density is their average, never below a later group's), a
    later group is taken only after its layer's block, and layers with C_l > n_ff get nothing.
    """
    t0 = time.perf_counter()
    a, h = _greedy_fill(problem, communication)
    placement = problem.to_placement(a, h, status="greedy", method="greedy",
                                     seconds=time.perf_counter() - t0,
                                     enforce_communication=communication)
    placement.verify(problem.costs, problem.budget_bytes, problem.cpu_capacity)
    return placement


def _greedy_units(problem: PlacementProblem, communication: bool) -> list[tuple]:
    """Units (density, kind, layer, col_begin, col_end, bytes, needs): kind 0 = FFN groups,
    1 = attention; needs = the column that must be on the GPU first (the block), else -1."""
    units = []
    cum = np.cumsum(problem.group_sizes, axis=1)  # [L, Gm] neurons in groups 0..g
    n_groups = problem.n_groups
    for l in range(problem.costs.n_layer):
        c = int(problem.min_gpu_neurons[l]) if communication else 0
        if c > cum[l, -1]:
            continue  # no number of GPU neurons is worth a sync in this layer
        first = int(np.searchsorted(cum[l], c)) + 1 if c > 0 else 1  # groups 0..first-1 reach C_l
        spans = [(0, first)] + [(g, g + 1) for g in range(first, int(n_groups[l]))]
        for b, e in spans:
            impact, size = problem.group_impact[l, b:e].sum(), int(problem.group_bytes[l, b:e].sum())
            units.append((impact / size, 0, l, b, e, size, 0 if c > 0 and b > 0 else -1))
    if problem.attention_placeable:
        for (l, k), size in np.ndenumerate(problem.attn_bytes):
            units.append((problem.attn_impact[l, k] / max(int(size), 1), 1, l, k, k + 1, int(size), -1))
    return units


def _greedy_fill(problem: PlacementProblem, communication: bool) -> tuple[np.ndarray, np.ndarray]:
    """(a [L, Gm], h [L, K]) bool: densest units first while they fit; ties: FFN, layer, group."""
    a = np.zeros(problem.group_sizes.shape, dtype=bool)
    h = np.zeros(problem.attn_bytes.shape, dtype=bool)
    left = problem.gpu_capacity
    for _, kind, l, b, e, size, needs in sorted(_greedy_units(problem, communication),
                                                key=lambda u: (-u[0], u[1], u[2], u[3])):
        if size > left or (needs >= 0 and not a[l, needs]):
            continue  # does not fit, or its layer's block (eq. 5) is not on the GPU
        (a if kind == 0 else h)[l, b:e] = True
        left -= size
    return a, h
