"""``powerinfer-ray solve``: a model + its activation statistics + a VRAM budget -> the upstream
split file ``<model>.generated.gpuidx`` and our placement file (attention groups included)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..model.costs import fitting_predictor_qtype, model_costs
from ..model.source import open_model

DEFAULT_CTX = 4096
GIB = 1 << 30


def load_counts(activation: str | Path) -> tuple[list[np.ndarray], int]:
    """Per-layer counts and the token count from a Parquet file (or a folder holding one) or
    upstream's folder of activation_{l}.pt files."""
    from .profile import ActivationStats

    path = Path(activation)
    if not path.exists():
        raise FileNotFoundError(f"activation statistics {path} not found (write them with powerinfer-ray profile)")
    if path.is_dir() and not list(path.glob("*.parquet")):
        stats = ActivationStats.load_pt(path)
    else:
        parquet = path if path.is_file() else next(iter(sorted(path.glob("*.parquet"))))
        stats = ActivationStats.load_parquet(parquet)
    return [np.asarray(c) for c in stats.counts], int(stats.n_tokens)


def solve_for_model(model: str, activation: str | Path, vram_budget: float, *, host_profile: str | None = None,
                    method: str = "ilp", group_size: int = 64, out: str | None = None,
                    n_ctx: int | None = None, batch: int = 1):  # noqa: ANN201
    """Solve and write the split; returns the Placement (its summary is printed)."""
    from ..placement.gpuidx import gpuidx_path
    from ..placement.solve import run_solve

    src = open_model(model)
    n_ctx = n_ctx or min(src.config.n_ctx, DEFAULT_CTX)
    pq = fitting_predictor_qtype(src, n_ctx, batch, int(vram_budget * GIB))  # as the engine will hold them
    costs = model_costs(src, n_ctx, batch, predictor_qtype=pq, embd_on_host=True)
    counts, n_tokens = load_counts(activation)
    target = Path(out) if out else gpuidx_path(model)
    placement = run_solve(counts, costs, vram_budget, n_tokens=n_tokens, host=host_profile, gpuidx_out=target,
                          placement_out=target.with_suffix(".placement.npz"), method=method,
                          group_size=group_size)
    print(placement.summary(costs))
    print(f"wrote {target} and {target.with_suffix('.placement.npz')}")
    return placement
