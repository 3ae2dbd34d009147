"""Everything about an engine configuration that can be checked before Ray starts: the model file
opens, the context and the policy fit the model, the device exists, the plan is solvable within
the budget (the solver's message names the minimum). The command line runs it first, so a user
error costs a second and one line, not Ray's start-up and a traceback.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import time
from dataclasses import dataclass

from ..model.config import ModelConfig
from ..model.source import open_model
from ..model.tokenizer import Tokenizer
from .config import EngineConfig, engine_n_ctx, resolve_plan, resolve_policy
from .engine import make_tokenizer
from .prompt import PromptChecker


@dataclass(frozen=True)
class Prepared:
    """A checked engine configuration (its plan resolved, so the engine does not solve again) and
    what the checks learnt about the model."""

    config: EngineConfig
    model: ModelConfig
    n_ctx: int
    policy: str
    device: str
    tokenizer: Tokenizer | None
    notes: tuple[str, ...] = ()  # things the user should know (printed, not fatal)

    def prompt_ids(self, prompt: str, max_tokens: int) -> list[int]:
        """The prompt's token ids, checked against the context with ``max_tokens`` new tokens."""
        checker = PromptChecker(self.tokenizer, self.n_ctx, self.model.n_vocab)
        ids = self.tokenizer.encode(checker.check_text(prompt))  # check_text: no tokenizer, no text
        checker.check_length(len(ids))
        checker.check_budget(len(ids), max_tokens)
        return ids


def prepare(ec: EngineConfig, *, local_gpu_check: bool = True) -> Prepared:
    """Check ``ec`` against the model and this host (``local_gpu_check``: the engine will run on
    this machine, so its GPU is the cluster's)."""
    src = open_model(ec.model)
    cfg = src.config
    n_ctx, policy = engine_n_ctx(ec, cfg), resolve_policy(ec, cfg)
    device = ec.device or ("cuda" if _cuda() else "cpu")
    if device == "cuda" and local_gpu_check and not _cuda():
        raise ValueError("device='cuda': this host has no CUDA GPU (torch sees none); use device 'cpu' "
                         "or leave it out")
    if device == "cpu" or ec.vram_budget_gib is not None:  # a CPU executor is likely: build its kernels
        from ..kernels.cpu_library import build_in_background

        build_in_background()  # while the plan is solved
    plan = resolve_plan(ec, src)
    notes = []
    if device == "cpu" and ec.vram_budget_gib is not None:
        notes.append(f"note: vram_budget_gib={ec.vram_budget_gib:g} without a GPU splits the model between the "
                     "CPU primary and a CPU executor, which only adds exchange cost: leave it out on this host")
    if device == "cpu" or plan.needs_cpu_executor:
        _prepare_cpu_kernel()
    return Prepared(dataclasses.replace(ec, plan=plan), cfg, n_ctx, policy, device, make_tokenizer(src.fields),
                    tuple(notes))


def _prepare_cpu_kernel() -> None:
    """Load the compiled CPU kernel here (waiting for the build ``prepare`` started), saying so
    when its first-use compile takes a while, so that the engine finds it built and its first
    token does not pay for the compiler."""
    from ..kernels import cpu_library

    done = threading.Event()

    def tell() -> None:
        if not done.wait(1.0):
            print("compiling the CPU sparse-FFN kernel (once per machine) ...", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    th = threading.Thread(target=tell, daemon=True)
    th.start()
    cpu_library.library()
    done.set()
    th.join()
    if time.perf_counter() - t0 > 1.0:
        print(f"compiled the CPU kernel in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
