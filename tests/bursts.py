"""A greedy decode burst driven through the primary as the coordinator drives it (shared by
tests/unit and tests/gpu)."""
from __future__ import annotations

from powerinfer_ray.runtime.sampling import Burst, SamplingParams


def greedy_burst(primary, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    """Prefill each prompt alone in its slot (0, 1, ...) and take its greedy first token, then run one
    greedy burst of n decode steps of them all (``serve_step``): asserts its shape, that greedy
    samplers hand back no generator states, and that every step of it ran on the decode graphs.
    Each sequence's tokens: the first, then the burst's."""
    first = [int(primary.step([s], [q], [0])[0].argmax()) for s, q in enumerate(prompts)]
    graph_steps = primary.stats.graph_steps
    toks, states = primary.serve_step(list(range(len(prompts))), [[t] for t in first], [len(q) for q in prompts],
                                      Burst(n, [(SamplingParams(), None)] * len(prompts)))
    assert toks.shape == (n, len(prompts)) and states == [None] * len(prompts)
    assert primary.stats.graph_steps - graph_steps == n
    return [[f] + [int(t) for t in toks[:, s]] for s, f in enumerate(first)]
