"""The engine's configuration as data: frozen, validated dataclasses for the plan, the executors
and the scheduler, and the metadata from which the CLI's flags and Serve's arguments are made.

One name per idea, end to end: a field's name is the actor's keyword, the Serve argument and
(with dashes) the CLI flag, e.g. ``vram_budget_gib`` / ``--vram-budget-gib``. A bad value raises
a ValueError naming the field, the value and what is expected, when the config is built: at the
edge, before Ray starts or an actor is created.

``EngineConfig`` is all three parts at once (``PlanConfig``, ``ExecutorConfig``,
``SchedulerConfig``) plus the model; ``part(cls)`` narrows it to one of them.
"""
from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .plan import Plan

if TYPE_CHECKING:  # the command line builds its flags from this module: it stays light (no torch)
    import numpy as np

    from ..model.config import ModelConfig
    from ..model.source import WeightSource
    from ..placement.costs import ModelCosts

log = logging.getLogger(__name__)

GIB = 1 << 30
DEVICES = ("cuda", "cpu")
POLICIES = ("predictor", "gate-first", "oracle", "dense")  # runtime/layers.py says what each computes
DTYPES = ("f32", "f16", "bf16")
METHODS = ("ilp", "greedy")
PREDICTOR_QTYPES = ("auto", "stored", "q8_0", "q4_0")
REPLACEMENT = ("off", "on", "auto")


def option(default: Any, help: str, *, kind: type = str, choices: tuple[str, ...] | None = None,  # noqa: A002, ANN401
           flags: tuple[str, ...] = (), exposed: bool = True) -> Any:  # noqa: ANN401
    """A config field with what the CLI and Serve need to offer it: help text, the value's kind
    (str, int, float, bool), its choices, extra CLI flags (llama.cpp's spellings) and whether it
    is offered at all (``exposed``; a Plan object is not)."""
    meta = {"help": help, "kind": kind, "choices": choices, "flags": flags, "exposed": exposed}
    return field(default=default, metadata=meta)


def exposed_fields(cls: type) -> Iterator[Field]:
    """The fields of a config class that the CLI and Serve offer, in declaration order."""
    return (f for f in fields(cls) if f.metadata.get("exposed"))


# ------------------------------------------------------------------------------------------------
# checks (messages name the field, the value and what is expected)
# ------------------------------------------------------------------------------------------------
def _bad(name: str, value: Any, expected: str, fix: str = "") -> ValueError:  # noqa: ANN401
    return ValueError(f"{name}={value!r}: expected {expected}" + (f" ({fix})" if fix else ""))


def _is_int(v: Any) -> bool:  # noqa: ANN401
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:  # noqa: ANN401
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(name: str, v: Any, lo: int, *, optional: bool = False, fix: str = "") -> None:  # noqa: ANN401
    if v is None and optional:
        return
    if not _is_int(v) or v < lo:
        raise _bad(name, v, f"an integer >= {lo}", fix)


def check_number(name: str, v: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False,  # noqa: ANN401
                 optional: bool = False, fix: str = "") -> None:
    if v is None and optional:
        return
    ok = _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf else f"{'>' if lo_open else '>='} {lo:g}"
        raise _bad(name, v, f"a finite number {span}", fix)


def check_choice(name: str, v: Any, choices: tuple[str, ...], *, optional: bool = True) -> None:  # noqa: ANN401
    if v is None and optional:
        return
    if v not in choices:
        raise _bad(name, v, "one of " + ", ".join(choices))


def _check_flag(name: str, v: Any, optional: bool = False) -> None:  # noqa: ANN401
    if not (isinstance(v, bool) or (optional and v is None)):
        raise _bad(name, v, "true or false" + (" (or null for the default)" if optional else ""))


# ------------------------------------------------------------------------------------------------
# the three parts
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelChoice:
    model: str  # GGUF model path or planted:<shape> spec


@dataclass(frozen=True)
class PlanConfig:
    """How the model is split between the primary executor and the CPU executor."""

    vram_budget_gib: float | None = option(
        None, "GPU memory for the model, GiB: the placement is solved for it (default: the whole model on the "
        "primary executor)", kind=float, flags=("--vram-budget",))
    reset_gpu_index: bool = option(False, "re-solve the placement; ignore a cached split file", kind=bool)
    disable_gpu_index: bool = option(False, "neither read nor write the split file <model>.generated.gpuidx",
                                     kind=bool)
    host_profile: str | None = option(None, "host profile JSON written by `calibrate` (default: built in)")
    method: str = option("ilp", "placement solver", choices=METHODS)
    gpu_fraction: float | None = option(
        None, "instead of solving: this fraction of each layer's hottest neurons on the primary (baselines)",
        kind=float)
    cpu_groups: int = option(0, "with gpu_fraction: KV-head groups of each layer on the CPU executor", kind=int)
    predictor_qtype: str = option(
        "auto", "how the primary holds predictors the file stores in float: as stored, or quantized at load to "
        "q8_0 / q4_0 blocks (auto: as stored when the budget holds the whole model, else q8_0, whose bytes saved "
        "hold hot neurons, or q4_0 when only q4_0 lets the budget hold all attention)", choices=PREDICTOR_QTYPES)
    plan: Plan | None = option(None, "an explicit plan (wins over everything above)", exposed=False)
    replacement: str | None = option(
        None, "move neurons between the GPU and the CPU to follow the traffic served (runtime/replacement.py): on; "
        "off; auto: on where the engine can (a split for vram_budget_gib with neurons on both sides, a policy that "
        "counts activations) (default: auto under serve, off elsewhere)", choices=REPLACEMENT)
    replacement_interval: int = option(512, "re-placement: counted tokens (prompt and output) between two "
                                       "solves of the split from them, beside the steps", kind=int)
    replacement_threshold: float = option(
        0.05, "re-placement: move only when the re-solved split takes at least this share of the CPU's recent "
        "activations onto the GPU (0..1; runtime/replacement.py says what a move costs)", kind=float)

    def check_plan(self) -> None:
        check_number("vram_budget_gib", self.vram_budget_gib, 0.0, lo_open=True, optional=True,
                     fix="GiB of GPU memory for the model; leave it out to put the whole model on the primary")
        _check_flag("reset_gpu_index", self.reset_gpu_index)
        _check_flag("disable_gpu_index", self.disable_gpu_index)
        check_choice("method", self.method, METHODS, optional=False)
        check_number("gpu_fraction", self.gpu_fraction, 0.0, 1.0, optional=True)
        check_int("cpu_groups", self.cpu_groups, 0)
        check_choice("predictor_qtype", self.predictor_qtype, PREDICTOR_QTYPES, optional=False)
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise _bad("plan", type(self.plan).__name__, "a runtime.plan.Plan")
        check_choice("replacement", self.replacement, REPLACEMENT)
        check_int("replacement_interval", self.replacement_interval, 1, fix="counted tokens between two solves")
        check_number("replacement_threshold", self.replacement_threshold, 0.0, 1.0)

    @property
    def vram_budget_bytes(self) -> int | None:
        """The budget in bytes (the one GiB -> bytes conversion)."""
        return None if self.vram_budget_gib is None else int(self.vram_budget_gib * GIB)


@dataclass(frozen=True)
class ExecutorConfig:
    """How the executors compute: device, threads, predictor policy, weights' dtype, graphs."""

    device: str | None = option(None, "device of the primary executor (default: cuda when there is a GPU)",
                                choices=DEVICES)
    threads: int | None = option(None, "CPU executor threads (default: all cores but two)", kind=int,
                                 flags=("-t",))
    policy: str | None = option(
        None, "which FFN neurons are computed: the predictors' choice (on a sparsified SwiGLU model: the predicted "
        "mode, thresholds applied to their h), those whose |SiLU(gate)| passes the sparsified model's threshold "
        "(gate-first: each device computes its gate rows first; no predictor), the truly active ones (oracle), or "
        "all (dense, thresholds unused) (default: gate-first when the model is sparsified on |SiLU(gate)|, else "
        "predictor when it has predictors, else oracle when it is sparsified on |h|, else dense)", choices=POLICIES)
    threshold: float | None = option(None, "predictor threshold (default: the model's sparse_threshold)",
                                     kind=float)
    predictor_margin: float = option(0.0, "lowers the predictor threshold by this many logits: > 0 computes more "
                                     "neurons (closer to dense), < 0 fewer (check with `quality --margin`)",
                                     kind=float)
    dtype: str | None = option(None, "weights' dtype on the primary (default: the file's on CUDA, f32 on the CPU); "
                               "a Q8_0 / Q4_0 file's matrices stay quantized, this is then the type of the rest "
                               "(default f16 on CUDA)", choices=DTYPES)
    timeout_s: float = option(120.0, "seconds an executor waits for its peer before failing the step",
                              kind=float)
    prefill_dense_min: int | None = option(
        None, "prompt chunks of at least this many tokens run every neuron on the primary, the CPU shard's rows "
        "streamed to it once a chunk (default: 256 on CUDA, off on the CPU; 0: never)", kind=int)
    prefill_share: float | None = option(
        None, "in shorter prompt chunks, the primary streams and computes this share of the CPU shard's rows (its "
        "hottest) while the CPU executor computes the chunk's active neurons among the rest (predictor policy; "
        "default: 0.3 on CUDA in chunks of at least 64 tokens and none in shorter ones, none on the CPU; 0: the "
        "CPU executor computes all of them)", kind=float)
    graphs: bool | None = option(None, "decode steps as CUDA graphs (default: on CUDA); --no-graphs runs them "
                                 "eagerly (debugging; slower)", kind=bool)
    zero_copy: float | None = option(
        None, "share of the CPU shard's neurons the GPU computes in decode steps, reading their rows over PCIe from "
        "host memory while the CPU executor computes the rest (default on CUDA with the predictor policy: 0.35 in "
        "steps of 8 or more sequences, 0.5 in steps of one on Q4_0 rows, none otherwise; a default share is "
        "captured beside none and the faster runs; 0: the CPU executor computes all of them)", kind=float)

    def check_executors(self) -> None:
        check_choice("device", self.device, DEVICES)
        check_int("threads", self.threads, 1, optional=True)
        check_choice("policy", self.policy, POLICIES)
        check_number("threshold", self.threshold, -math.inf, optional=True)
        check_number("predictor_margin", self.predictor_margin, -math.inf)
        check_choice("dtype", self.dtype, DTYPES)
        check_number("timeout_s", self.timeout_s, 0.0, lo_open=True)
        check_int("prefill_dense_min", self.prefill_dense_min, 0, optional=True)
        check_number("prefill_share", self.prefill_share, 0.0, 1.0, optional=True)
        _check_flag("graphs", self.graphs, optional=True)
        check_number("zero_copy", self.zero_copy, 0.0, 1.0, optional=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are batched: context length, batch size, prompt chunk, queue length."""

    n_ctx: int | None = option(None, "context length in tokens (default: the model's, at most 4096)", kind=int,
                               flags=("-c", "--ctx-size"))
    max_batch: int = option(8, "sequences decoded together", kind=int)
    prefill_chunk: int | None = option(None, "prompt tokens per step (default on CUDA: 1024, or the largest "
                                       "of 512 / 256 / 128 whose activations take at most 1/25 of the VRAM budget; "
                                       "64 on the CPU)", kind=int)
    max_waiting: int = option(256, "requests the engine queues beyond the running batch (more: overloaded, "
                              "HTTP 429)", kind=int)
    decode_burst: int = option(8, "decode steps the primary runs back to back, sampling each next token itself, "
                               "while no running request prefills or asks for penalties or logprobs: one round trip "
                               "to the coordinator a burst (a new request waits for the burst's end); 1: a round "
                               "trip every step", kind=int)

    def check_scheduler(self) -> None:
        check_int("n_ctx", self.n_ctx, 2, optional=True)
        check_int("max_batch", self.max_batch, 1, fix="sequences decoded together")
        check_int("prefill_chunk", self.prefill_chunk, 1, optional=True)
        check_int("max_waiting", self.max_waiting, 0)
        check_int("decode_burst", self.decode_burst, 1, fix="decode steps a round trip")


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig, ExecutorConfig, PlanConfig, ModelChoice):
    """The whole engine: the model, its plan, its executors and its scheduler (fields in that
    order, so ``EngineConfig("m.gguf", vram_budget_gib=8)`` reads naturally)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise _bad("model", self.model, "a GGUF path or planted:<shape> spec")
        self.check_plan()
        self.check_executors()
        self.check_scheduler()

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "EngineConfig":  # noqa: ANN401
        """Build from keyword options (the actor's and Serve's); an unknown name raises a ValueError
        that suggests the nearest known one."""
        known = [f.name for f in fields(cls) if f.name != "model"]
        for name in options:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; expected some of {sorted(known)}"
                raise ValueError(f"unknown engine option {name!r}{hint}")
        return cls(model=model, **options)

    def part(self, cls: type) -> Any:  # noqa: ANN401
        """This config narrowed to one of its parts (PlanConfig, ExecutorConfig, SchedulerConfig)."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


def coerce(cls: type, name: str, value: Any) -> Any:  # noqa: ANN401
    """A field's value from text (``serve run module:app k=v`` passes strings) or as given; the
    config's own checks then judge the range."""
    f = {f.name: f for f in fields(cls)}[name]
    kind = f.metadata.get("kind", str)
    if value is None or (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))):
        return value
    if kind is float and _is_int(value):
        return float(value)
    text = str(value).strip().lower()
    if kind is bool and text in ("true", "false", "1", "0", "yes", "no"):
        return text in ("true", "1", "yes")
    if kind in (int, float) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise _bad(name, value, {bool: "true or false", int: "an integer", float: "a number"}.get(kind, "a string"))


# ------------------------------------------------------------------------------------------------
# resolution against the model: the defaults that depend on it, and the plan
# ------------------------------------------------------------------------------------------------
def engine_n_ctx(ec: SchedulerConfig, cfg: ModelConfig) -> int:
    n = ec.n_ctx or min(cfg.n_ctx, 4096)
    if n > cfg.n_ctx:
        raise ValueError(f"n_ctx={n}: the model's context holds {cfg.n_ctx} tokens; use n_ctx <= {cfg.n_ctx}")
    return n


PREFILL_CHUNKS = (1024, 512, 256, 128)  # a CUDA primary's default prompt chunks, the largest that fits
PREFILL_BUDGET_SHARE = 1 / 25  # of the VRAM budget, at most, for a default chunk's activations


def resolve_prefill_chunk(ec: SchedulerConfig, device: str, cfg: ModelConfig | None = None) -> int:
    """Prompt tokens per step. On a CUDA primary, whose prefill streams the CPU shard's rows from
    host memory once per chunk (the copy, not the token count, sets a chunk's cost), 1024; under a
    VRAM budget (with the model's ``cfg``) the largest of ``PREFILL_CHUNKS`` whose activations
    (``workspace.prefill_bytes``, which the plan reserves) take at most ``PREFILL_BUDGET_SHARE`` of
    it, since those bytes would otherwise hold hot neurons for every decode step. 64 on the CPU,
    where cost grows with tokens and a long prompt's chunk delays the other sequences' decode steps."""
    if ec.prefill_chunk is not None:
        return ec.prefill_chunk
    if device != "cuda":
        return 64
    budget = getattr(ec, "vram_budget_bytes", None)
    if budget is None or cfg is None:
        return PREFILL_CHUNKS[0]
    from .workspace import prefill_bytes

    n_ctx, act, room = engine_n_ctx(ec, cfg), _act_bytes(ec, cfg), budget * PREFILL_BUDGET_SHARE
    return next((c for c in PREFILL_CHUNKS if prefill_bytes(cfg, max(c, ec.max_batch), ec.max_batch, n_ctx, act) <= room),
                PREFILL_CHUNKS[-1])


def _act_bytes(ec: ExecutorConfig, cfg: ModelConfig) -> int:
    """Bytes of an activation in the primary's compute dtype."""
    return 4 if (ec.dtype or cfg.float_dtype) == "f32" else 2


def resolve_policy(ec: ExecutorConfig, cfg: ModelConfig) -> str:
    """The policy given (checked against the model), else the one its metadata selects
    (``layers.default_policy``)."""
    from .layers import check_policy, default_policy

    if ec.policy is None:
        name = default_policy(cfg)
        if name == "oracle":
            log.warning("%s is sparsified on |h| and has no predictors: running policy 'oracle' (exact, computes "
                        "every gate and up row); train predictors for the predicted mode", cfg.name or "the model")
        return name
    check_policy(ec.policy, cfg)
    return ec.policy


def activation_counts(src: WeightSource, model_path: str) -> tuple[list[np.ndarray], int] | None:
    """The model's activation statistics: planted ones, or a profile saved next to the file."""
    if hasattr(src, "activation_counts"):
        return src.activation_counts(100_000)
    from ..offline.solve import load_counts

    base = Path(model_path)
    stem = base.name.split(".")[0]
    for cand in (base.parent / f"{stem}.activation.parquet", base.parent / "activation.parquet",
                 base.parent / "activation"):
        if cand.exists():
            return load_counts(cand)
    return None


def resolve_plan(ec: EngineConfig, src: WeightSource | None = None) -> Plan:
    """The plan an engine runs with: an explicit plan as given; everything on the primary without
    a budget; else the hottest fraction (``gpu_fraction``) or the placement solved for the VRAM
    budget, reusing the cached split file ``<model>.generated.gpuidx`` the way upstream PowerInfer
    does (with the token embedding in host memory: ``embd_on_host``). The CPU shard's rows go
    hottest first when the model has activation statistics."""
    from ..model.costs import embedding_apart
    from ..model.source import open_model

    src = src or open_model(ec.model)
    cfg = src.config
    if ec.plan is not None:
        ec.plan.verify(cfg)
        return ec.plan
    pq = predictor_qtype(ec, src)
    if ec.gpu_fraction is None and ec.vram_budget_gib is None:
        return replace(Plan.all_gpu(cfg), predictor_qtype=pq)
    stats = activation_counts(src, ec.model)  # read once: the split and the CPU rows' order
    if ec.gpu_fraction is not None:
        plan = Plan.hottest(cfg, ec.gpu_fraction, stats[0] if stats else None, ec.cpu_groups)
    else:
        plan = _budget_plan(ec, src, stats, pq)
    plan = replace(plan, predictor_qtype=pq, embd_on_host=embd_on_host(ec) and embedding_apart(src))
    return plan.hot_first(stats[0]) if stats is not None else plan


def predictor_qtype(ec: EngineConfig, src: WeightSource) -> str | None:
    """The block type the primary quantizes float predictors to (None: as stored): the config's
    choice, or for 'auto' with a VRAM budget ``model.costs.fitting_predictor_qtype``'s."""
    from ..model.costs import fitting_predictor_qtype

    if ec.predictor_qtype != "auto":
        return None if ec.predictor_qtype == "stored" else ec.predictor_qtype
    if ec.vram_budget_bytes is None or resolve_policy(ec, src.config) != "predictor":
        return None
    return fitting_predictor_qtype(src, engine_n_ctx(ec, src.config), ec.max_batch, ec.vram_budget_bytes,
                                   engine_workspace(ec, src.config))


def split_cache_path(model: str) -> Path:
    """Where the solved split of a model file is cached: next to the file as upstream does, or in
    the user's cache folder when that folder is the package's own data or is not writable."""
    from ..kernels.cpu_library import cache_root
    from ..model.default import DATA_DIR
    from ..placement import gpuidx

    path = gpuidx.gpuidx_path(model)
    folder = path.resolve().parent
    if folder == DATA_DIR.resolve() or not os.access(folder, os.W_OK):
        cache_root().mkdir(parents=True, exist_ok=True)
        return cache_root() / path.name
    return path


def resolve_replacement(ec: EngineConfig, plan: Plan, policy: str) -> bool:
    """Whether the engine re-places neurons as it serves (``runtime.replacement``): off unless
    asked; 'on' raises a ValueError where it cannot, 'auto' is then off (logged)."""
    from .activity import COUNTED

    if ec.replacement in (None, "off"):
        return False
    missing = [why for bad, why in (
        (ec.vram_budget_gib is None, "a VRAM budget to solve the split for (vram_budget_gib)"),
        (not plan.needs_cpu_executor or not any(len(lp.gpu_neurons) for lp in plan.layers),
         "a split with FFN neurons on both the GPU and the CPU"),
        (policy not in COUNTED, f"a policy that counts activations ({', '.join(COUNTED)}; this engine's is {policy!r})"),
    ) if bad]
    if not missing:
        return True
    if ec.replacement == "on":
        raise _bad("replacement", "on", "an engine that can move neurons", "it needs " + "; and ".join(missing) +
                   "; or use replacement='auto' or 'off'")
    log.info("re-placement off: it needs %s", "; and ".join(missing))
    return False


def placement_inputs(ec: EngineConfig, src: WeightSource, pq: str | None) -> tuple[Any, int, Any]:
    """(ModelCosts, budget in bytes, HostProfile) the placement of ``ec`` is solved with, the
    predictors held as ``pq`` blocks (``predictor_qtype``), at start and when re-placement solves
    it again."""
    from ..placement.host import HostProfile

    cfg = src.config
    costs = engine_costs(ec, src, pq)
    if cfg.has_predictors and resolve_policy(ec, cfg) != "predictor":  # no predictors loaded
        costs = replace(costs, predictor_bytes=(0,) * cfg.n_layer)
    return costs, ec.vram_budget_bytes, HostProfile.load(ec.host_profile)


def embd_on_host(ec: EngineConfig) -> bool:
    """Whether the engine's solved plan holds the token embedding in host memory
    (``Plan.embd_on_host``): for a VRAM budget."""
    return ec.vram_budget_bytes is not None and ec.gpu_fraction is None and ec.plan is None


def engine_costs(ec: EngineConfig, src: WeightSource, pq: str | None = None) -> ModelCosts:
    """The model's costs for the placement as this engine runs it: weights as stored (a Q6_K head is
    f16; float predictors as ``pq`` blocks when given: ``predictor_qtype``), a KV cache for
    max_batch sequences of its context, and on a CUDA primary what it allocates beside them at that
    batch and its prompt chunk (``workspace``; a CPU primary's budget, a test's, keeps ModelCosts'
    estimate of a prompt chunk's buffers). Under a VRAM budget the token embedding lives in host
    memory (``embd_on_host``)."""
    from ..model.costs import model_costs

    costs = model_costs(src, engine_n_ctx(ec, src.config), ec.max_batch, predictor_qtype=pq,
                        embd_on_host=embd_on_host(ec))
    workspace = engine_workspace(ec, src.config)
    return costs if workspace is None else replace(costs, workspace_bytes=workspace)


def engine_workspace(ec: EngineConfig, cfg: ModelConfig) -> int | None:
    """What a CUDA primary allocates beside weights and KV cache at max_batch and its prompt chunk
    (``workspace``); None on a CPU primary."""
    if (ec.device or ("cuda" if _has_cuda() else "cpu")) != "cuda":
        return None
    from .workspace import workspace_bytes

    return workspace_bytes(cfg, ec.max_batch, resolve_prefill_chunk(ec, "cuda", cfg), engine_n_ctx(ec, cfg),
                           _act_bytes(ec, cfg))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


SPLIT_SLACK = 0.01  # the budget's share an own cached split may leave unused (the ILP leaves < 0.1 %)


def split_bytes(costs: ModelCosts, gpu_masks: list[np.ndarray], gpu_groups: list[int] | None = None) -> float:
    """The GPU bytes of a split (per layer a bool mask of the GPU's neurons, and the KV-head groups
    on the GPU: None, all of them, as a cached split places them): everything fixed, the groups'
    attention and KV cache, the GPU's neurons. Infinite when the masks are not the model's."""
    from ..placement.result import attention_bytes_of, ffn_bytes_of

    if len(gpu_masks) != costs.n_layer or any(len(m) != f for m, f in zip(gpu_masks, costs.n_ff)):
        return float("inf")
    groups = gpu_groups or [costs.n_kv_groups] * costs.n_layer
    return costs.fixed_bytes + attention_bytes_of(groups, costs) + ffn_bytes_of(gpu_masks, costs)


def _budget_plan(ec: EngineConfig, src: WeightSource, stats: tuple[list[np.ndarray], int] | None,
                 pq: str | None) -> Plan:
    """The ILP's split for the VRAM budget (or the cached one); stats: `activation_counts`."""
    import numpy as np

    from ..model.source import PLANTED_PREFIX
    from ..placement import gpuidx
    from ..placement.problem import InfeasibleBudgetError
    from ..placement.solve import solve_placement

    cfg = src.config
    budget = ec.vram_budget_bytes
    is_file = not str(ec.model).startswith(PLANTED_PREFIX)
    cache = split_cache_path(ec.model) if is_file and not ec.disable_gpu_index else None
    # a policy that loads no predictors (gate-first, dense, oracle) places neurons in their bytes;
    # the split cached beside the file is the predictors' (upstream's): neither read nor written
    no_predictors = cfg.has_predictors and resolve_policy(ec, cfg) != "predictor"
    if no_predictors:
        cache = None
    costs, _, host = placement_inputs(ec, src, pq)
    if cache is not None and cache.exists() and not ec.reset_gpu_index:
        plan = _cached_plan(cache, src, costs, budget)
        if plan is not None:
            return plan
    if stats is None:
        log.warning("no activation statistics for %s: placing with uniform frequencies "
                    "(run powerinfer-ray profile for a better split)", ec.model)
        stats = ([np.ones(cfg.n_ff, np.int64)] * cfg.n_layer, 1)
    try:
        placement = solve_placement(stats[0], stats[1], costs, budget, host, method=ec.method)
    except InfeasibleBudgetError as e:
        if pq is None:
            raise
        raise InfeasibleBudgetError(f"{e} (with the predictors held as {pq} blocks: predictor_qtype)",
                                    e.min_budget_bytes) from None
    if cache is not None:
        gpuidx.write_split(cache, placement, costs)
    return Plan.from_masks(placement.gpu_neurons, list(placement.gpu_attention), cfg)


def _cached_plan(cache: Path, src: WeightSource, costs: ModelCosts, budget: int) -> Plan | None:
    """The split file's plan if it is this model's and serves this budget, else None (re-solve).

    Ours records the budget it was solved for: one solved for at most this budget serves when it
    fills it at this engine's batch and context, to within ``SPLIT_SLACK`` of the budget, or puts
    everything on the GPU (a split solved for a longer context holds a smaller share of the FFN). Without that key, split.vram_capacity is
    upstream's FFN bytes, checked as upstream checks them (against the VRAM it leaves for FFN
    neurons at this budget), or our old whole budget, checked against this budget."""
    from ..placement import gpuidx

    cfg = src.config
    split = gpuidx.read_gpuidx(cache)
    groups = split.gpu_attention
    if (len(split.gpu_neurons) != cfg.n_layer or any(m.size != cfg.n_ff for m in split.gpu_neurons)
            or (groups is not None and groups.shape[1] != cfg.n_head_kv)):
        log.warning("cached split %s was solved for another model: re-solving", cache)
        return None
    meaning = split.capacity_meaning(costs)
    cap = f"split.vram_capacity {split.vram_capacity / GIB:.3f} GiB"
    if split.budget_bytes is not None:
        what, fits = f"{cap} of FFN rows, solved for {split.budget_bytes / GIB:.3f} GiB", split.budget_bytes <= budget
    elif meaning == "budget":
        what, fits = f"{cap}: our old whole-budget value", split.vram_capacity <= budget
    else:
        room = gpuidx.upstream_ffn_budget({n: t.n_bytes for n, t in src.tensors.items()}, cfg.n_layer,
                                          cfg.n_head_kv * cfg.head_dim, budget)
        what = f"{cap}: FFN bytes (upstream's meaning), upstream's FFN room at this budget {(room or 0) / GIB:.3f} GiB"
        fits = room is not None and split.vram_capacity <= room
    if not fits:
        log.warning("cached split %s (%s) does not serve %.3f GiB: re-solving", cache, what, budget / GIB)
        return None
    need = split_bytes(costs, split.gpu_neurons, None if groups is None else [int(g.sum()) for g in groups])
    if need > budget:  # solved for another batch size or context than this engine's
        log.warning("cached split %s needs %.3f GiB at this engine's batch and context, over %.3f GiB: re-solving",
                    cache, need / GIB, budget / GIB)
        return None
    on_cpu = any(not m.all() for m in split.gpu_neurons) or (groups is not None and not groups.all())
    if split.budget_bytes is not None and on_cpu and budget - need > SPLIT_SLACK * budget:
        log.warning("cached split %s leaves %.3f GiB of %.3f GiB unused at this engine's batch and context (solved "
                    "for another, or a smaller budget) while rows stay on the CPU: re-solving", cache,
                    (budget - need) / GIB, budget / GIB)
        return None
    log.info("using cached split %s (%s)", cache, what)
    return Plan.from_masks(split.gpu_neurons, None if groups is None else list(groups), cfg)
