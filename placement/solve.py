"""Entry points: solve_placement (arrays in, Placement out) and run_solve (paths in, files out),
which the `powerinfer-ray solve` command calls."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .costs import GIB, ModelCosts
from .gpuidx import save_placement, write_split
from .host import HostProfile
from .ilp import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S, solve_greedy, solve_ilp
from .problem import DEFAULT_ATTENTION_WEIGHT, DEFAULT_GROUP_SIZE, StatsError, build_problem
from .result import Placement
from .stats import read_activation_parquet

METHODS = ("ilp", "greedy")


def solve_placement(
    stats_counts: Sequence[np.ndarray],
    n_tokens: int,
    costs: ModelCosts,
    budget_bytes: int,
    host: HostProfile | None = None,
    method: str = "ilp",
    group_size: int = DEFAULT_GROUP_SIZE,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_gap: float = DEFAULT_MIP_GAP,
    attention_placeable: bool | None = None,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> Placement:
    """Place neurons (and attention groups if needed) under budget_bytes of GPU memory.

    stats_counts: [L][n_ff_l] activation counts over n_tokens tokens. method 'ilp' solves the
    paper's integer program, 'greedy' takes the hottest neurons per byte (no communication
    constraint). Raises InfeasibleBudgetError (a ValueError) with the minimum budget.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    problem = build_problem(stats_counts, n_tokens, costs, budget_bytes, host, group_size,
                            attention_placeable, attention_weight)
    if method == "greedy":
        return solve_greedy(problem)
    return solve_ilp(problem, time_limit_s=time_limit_s, mip_gap=mip_gap)


def run_solve(
    stats: str | Path | Sequence[np.ndarray],
    costs: ModelCosts | str | Path,
    vram_budget_gib: float,
    *,
    n_tokens: int | None = None,
    host: HostProfile | str | Path | None = None,
    gpuidx_out: str | Path | None = None,
    placement_out: str | Path | None = None,
    method: str = "ilp",
    group_size: int = DEFAULT_GROUP_SIZE,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> Placement:
    """What `powerinfer-ray solve` does: read, solve, write.

    stats         a Parquet file (layer, neuron, count; metadata n_tokens) or a directory holding
                  one, or the per-layer
                  count arrays the caller loaded from upstream's activation_{l}.pt files
                  (see stats.activation_pt_files), with n_tokens given
    costs         ModelCosts, or a JSON file of them (ModelCosts.save / {"shape": {...}})
    vram_budget_gib  GPU budget in GiB (2^30 bytes), as upstream's --vram-budget
    host          HostProfile, a JSON file (missing = defaults), or None (defaults)
    gpuidx_out    upstream split file to write (<model>.generated.gpuidx), optional
    placement_out our .npz placement file to write, optional
    """
    costs = costs if isinstance(costs, ModelCosts) else ModelCosts.load(costs)
    host = host if isinstance(host, HostProfile) else HostProfile.load(host)
    counts, n_tokens = _load_stats(stats, n_tokens, costs)
    if not vram_budget_gib > 0:
        raise ValueError(f"--vram-budget: expected a positive number of GiB, got {vram_budget_gib}")
    placement = solve_placement(counts, n_tokens, costs, int(vram_budget_gib * GIB), host, method=method,
                                group_size=group_size, time_limit_s=time_limit_s)
    if gpuidx_out is not None:
        write_split(gpuidx_out, placement, costs)
    if placement_out is not None:
        save_placement(placement_out, placement)
    return placement


def _parquet_in(path: Path) -> Path:
    """The Parquet file itself, or the one Parquet file of a directory."""
    if not path.is_dir():
        return path
    found = sorted(path.glob("*.parquet"))
    if len(found) == 1:
        return found[0]
    if found:
        raise StatsError(f"{path}: expected one Parquet file of activation counts, found "
                         f"{[p.name for p in found]}; pass the file")
    raise StatsError(f"{path}: no Parquet file; for upstream's activation_{{l}}.pt files, load them "
                     f"with torch (placement.activation_pt_files lists them in order) and pass the "
                     f"arrays with n_tokens")


def _load_stats(stats: str | Path | Sequence[np.ndarray], n_tokens: int | None,
                costs: ModelCosts) -> tuple[list[np.ndarray], int]:
    if isinstance(stats, (str, Path)):
        path = _parquet_in(Path(stats))
        loaded = read_activation_parquet(path, costs.n_ff)
        if n_tokens is not None and n_tokens != loaded.n_tokens:
            raise StatsError(f"{path}: n_tokens given as {n_tokens}, but the file says {loaded.n_tokens}")
        return loaded.counts, loaded.n_tokens
    if n_tokens is None:
        raise StatsError("n_tokens: expected the number of tokens profiled with count arrays "
                         "(upstream's .pt files do not store it)")
    return [np.asarray(c) for c in stats], n_tokens
