"""Placement solver: activation statistics + VRAM budget + host -> which FFN neurons (and, when
attention does not fit, which attention KV-head groups) of each layer live on the GPU.

Offline and standalone: imports numpy, cvxpy (HiGHS), gguf, pyarrow and the standard library only.
"""
from .costs import GIB, CostsError, ModelCosts
from .gpuidx import (GPUIDX_SUFFIX, GpuIndex, GpuIndexError, gpuidx_path, load_placement,
                     placement_from_gpuidx, read_gpuidx, save_placement, upstream_ffn_budget, write_gpuidx,
                     write_split)
from .host import HostProfile, HostProfileError
from .ilp import SolverError, solve_greedy, solve_ilp
from .problem import InfeasibleBudgetError, PlacementProblem, StatsError, build_problem, communication_threshold
from .result import Placement, PlacementError
from .solve import run_solve, solve_placement
from .stats import ActivationStats, activation_pt_files, read_activation_parquet, write_activation_parquet

__all__ = [
    "GIB", "CostsError", "ModelCosts", "HostProfile", "HostProfileError",
    "Placement", "PlacementError", "PlacementProblem", "InfeasibleBudgetError", "StatsError",
    "SolverError", "build_problem", "communication_threshold", "solve_ilp", "solve_greedy",
    "solve_placement", "run_solve", "GPUIDX_SUFFIX", "GpuIndex", "GpuIndexError", "gpuidx_path", "read_gpuidx", "placement_from_gpuidx",
    "write_gpuidx", "write_split", "upstream_ffn_budget", "save_placement", "load_placement", "ActivationStats", "activation_pt_files",
    "read_activation_parquet", "write_activation_parquet",
]
