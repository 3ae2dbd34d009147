"""Online re-placement: the GPU/CPU split follows the traffic the engine serves (DESIGN.md, section 7).

The placement is solved once from a profile; traffic that differs from it leaves the wrong
neurons on the GPU. While it serves, the engine counts activations (``activity``: what
``save_activation`` writes). Every ``replacement_interval`` counted tokens it reads the counts
between two steps and folds them into a decayed estimate (``DecayedCounts``: old traffic halves
every ``HALF_LIFE_INTERVALS`` intervals), and solves the split from the estimate as it stood before
the newest interval, in a thread beside the steps (``Replacer.judge``; the engine's steps never wait
for it). While the solved splits are not worth moving to, the solves back off (``Replacer.ready``:
1, 2, 4, up to ``MAX_BACKOFF`` intervals apart) until the GPU's share of an interval's CPU share
grows by the threshold: a settled engine solves every 8 intervals, a shifted one at once.

The split is solved at the engine's shard sizes (``target``): each layer keeps the number of GPU
neurons it was loaded with (the primary's row buffers, the CPU mask's width and the captured decode
graphs are sized for it, and they hold the budget the placement was solved for). At those sizes the
placement ILP (``placement/ilp.py``) for the same budget puts each layer's hottest neurons on the GPU:
its neurons of a layer cost the same bytes, so an optimum takes them as a prefix by count. ``target``
takes that prefix directly (a tie keeps the neuron where it is), which is what the ILP's solution
cut to the shard sizes gives (tests/unit/runtime/test_replacement.py checks it against
``solve_placement``), in ~30 ms of numpy at the 13B's shape instead of a solve of ~0.3 s.

The move pays when the new split takes at least ``replacement_threshold`` of the CPU's
activations onto the GPU (``gain``: a share of what the CPU computes, which is what its time per
token follows) both in the counts it was solved from and in the newest
interval's, which the solve did not see: a split fitted to a few hundred tokens' counts always
looks better on them (their noise picks its neurons), and only the unseen interval tells a shift
of the traffic from that noise. The move's cost is a one-off copy of the neurons' rows over PCIe;
its gain is a lasting cut of the CPU's reads per token. At the Llama-2-13B shape at 16 GiB (30 KiB
a neuron, ~86k neurons active per token): moving every GPU neuron of every layer (~5 GB) takes
~0.1 s at 55 GB/s (pauses between steps: ~1 s on the H200 host), and one point of share moves ~26 MB
per token off the CPU, ~0.4 ms a token at the ~60 GB/s its kernel reads in the exchange: with ~14 %
of the activations on the CPU, a gain of 0.05 (the default: 0.7 points) pays for even the largest
move within ~4,000 tokens, and smaller ones sooner. An absolute share would ask a settled engine
for the same points whatever the CPU still holds: at 0.02 the 13B stayed 1.5 points (6 % of
its speed) short of the split solved on its traffic.

Moves go in pauses between steps (``pauses``): each pause trades at most ``MOVE_BYTES`` of rows
(a transient of a third of that on the GPU, one matrix's rows at a time: the budget holds), both
executors swap the same pairs under the engine's step lock (``Plan.swap``; ``PrimaryExecutor.swap``,
``CPUExecutor.swap``), and a step runs between two pauses, so requests in flight keep going.

Dimension legend: L layers, F neurons of a layer (n_ff).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np

from .plan import Plan, Swap

if TYPE_CHECKING:
    from ..model.source import WeightSource
    from .config import EngineConfig

log = logging.getLogger(__name__)
HALF_LIFE_INTERVALS = 1  # decayed counts halve every this many intervals: old traffic fades (a split
# solved from older traffic is only judged better on it, and lags a shift by that many intervals)
MAX_BACKOFF = 8  # the most intervals between two solves while the solves find no move worth it
MOVE_BYTES = 48 << 20  # rows traded per pause between two steps
HISTORY = 128  # intervals of the GPU's share kept for stats()


@dataclass(frozen=True)
class Settings:
    """When the engine re-solves (every ``interval`` counted tokens) and when it moves
    (``threshold``: the least share of the CPU's activations a move takes onto the GPU, see the module
    docstring)."""

    interval: int
    threshold: float

    @property
    def half_life(self) -> int:
        return HALF_LIFE_INTERVALS * self.interval


class DecayedCounts:
    """Activation counts [L, F] and tokens with exponential decay, fed with the engine's running
    totals (``update``); a total below the last one (counts reset, executors restarted) starts
    the running totals afresh and keeps the estimate."""

    def __init__(self, n_layer: int, n_ff: int, half_life: int) -> None:
        self.half_life = half_life
        self.counts = np.zeros((n_layer, n_ff))  # [L, F] float64
        self.tokens = 0.0
        self._last: tuple[np.ndarray, int] | None = None

    def update(self, totals: np.ndarray, tokens: int) -> np.ndarray:
        """Fold in the totals [L, F] over ``tokens`` tokens; returns the new counts [L, F]."""
        last, last_tokens = self._last or (np.zeros_like(totals), 0)
        if tokens < last_tokens or (tokens == last_tokens and (totals < last).any()):
            last, last_tokens = np.zeros_like(totals), 0
        delta, dt = totals - last, tokens - last_tokens
        f = 0.5 ** (dt / self.half_life)
        self.counts = self.counts * f + delta
        self.tokens = self.tokens * f + dt
        self._last = (totals.copy(), tokens)
        return delta


def gain(plan: Plan, goal: list[np.ndarray], counts: np.ndarray) -> float:
    """The share of the counts [L, F] on the plan's CPU neurons that the GPU neurons ``goal`` take
    onto the GPU (negative: they leave more there)."""
    cpu = more = 0.0
    for l, (g, lp) in enumerate(zip(goal, plan.layers)):
        kept = float(counts[l, lp.gpu_neurons].sum())  # the plan's GPU counts, read once
        cpu += float(counts[l].sum()) - kept
        more += float(counts[l, g].sum()) - kept
    return more / cpu if cpu > 0 else 0.0


def target(plan: Plan, counts: np.ndarray) -> list[np.ndarray]:
    """Per layer, the GPU neurons [k_l] (ids, any order) of the split solved from the counts [L, F]
    at the plan's sizes k_l: the layer's k_l hottest, the neurons placed there first among ties."""
    out = []
    for l, lp in enumerate(plan.layers):
        c, k = counts[l], len(lp.gpu_neurons)
        if not k:  # np.partition has no k-th hottest of none
            out.append(np.zeros(0, np.int64))
            continue
        v = np.partition(c, len(c) - k)[len(c) - k]  # the k-th hottest count: linear, no sort
        above = np.flatnonzero(c > v)
        here = np.zeros(len(c), bool)
        here[lp.gpu_neurons] = True
        tied = np.flatnonzero(c == v)
        tied = np.concatenate([tied[here[tied]], tied[~here[tied]]])  # the placed first
        out.append(np.concatenate([above, tied[: k - len(above)]]))
    return out


def layer_swaps(plan: Plan, goal: list[np.ndarray], counts: np.ndarray) -> list[Swap]:
    """The swaps that take the plan to ``goal`` (``target``), per layer that changes. The CPU rows
    freed go to the neurons leaving the GPU, hottest first into the frontmost (the CPU shard's
    rows run hottest first: ``Plan.hot_first``)."""
    swaps = []
    for l, lp in enumerate(plan.layers):
        leaving = np.flatnonzero(~np.isin(lp.gpu_neurons, goal[l]))  # rows of the primary's shard
        if not len(leaving):
            continue
        arriving = np.flatnonzero(np.isin(lp.cpu_neurons, goal[l]))  # rows of the CPU shard, ascending
        leaving = leaving[np.argsort(-counts[l, lp.gpu_neurons[leaving]], kind="stable")]
        swaps.append(Swap.of(plan, l, leaving, arriving))
    return swaps


def pauses(swaps: list[Swap], neuron_bytes: tuple[int, ...], limit: int = MOVE_BYTES) -> list[list[Swap]]:
    """The swaps cut into pauses of at most ``limit`` bytes of rows each (at least one pair)."""
    out: list[list[Swap]] = [[]]
    room = limit
    for s in swaps:
        a, per = 0, neuron_bytes[s.l]
        while a < len(s):
            if room < per and out[-1]:
                out.append([])
                room = limit
            b = min(len(s), a + max(1, room // per))
            out[-1].append(Swap(s.l, s.gpu_rows[a:b], s.cpu_rows[a:b], s.to_gpu[a:b], s.to_cpu[a:b]))
            room -= (b - a) * per
            a = b
    return [p for p in out if p]


class Replacer:
    """The re-placement state of one engine: its current plan, the decayed counts, the pauses of
    an accepted split still to apply, and the counters ``stats()`` reports."""

    def __init__(self, plan: Plan, settings: Settings, neuron_bytes: tuple[int, ...]) -> None:
        self.plan, self.settings, self.neuron_bytes = plan, settings, neuron_bytes  # bytes of a layer's neuron
        n_ff = len(plan[0].gpu_neurons) + len(plan[0].cpu_neurons)
        self.decayed = DecayedCounts(len(plan), n_ff, settings.half_life)
        self.queue: deque[list[Swap]] = deque()
        self.solving = False
        self.history: deque[dict[str, float]] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()  # stats() may be read from another thread (the in-process engine)
        self.counters = {"solves": 0, "accepted": 0, "pauses": 0, "neurons_moved": 0,
                         "last_gain": None, "last_gain_fitted": None, "move_s": 0.0}
        self.basis: tuple[np.ndarray, float] = (self.decayed.counts, 0.0)  # what a solve sees
        self.newest = np.zeros_like(self.decayed.counts)  # the newest interval: what a split is judged on
        self.backoff, self._wait = 1, 0  # intervals between solves, and before the next
        self._kept_share: float | None = None  # the GPU's share of the interval of the first refusal since a move

    def observe(self, totals: np.ndarray, tokens: int) -> None:
        """The engine's running activation totals [L, F] over ``tokens`` counted tokens: the
        estimate so far becomes the next solve's basis, the counts since the last read the
        interval it is judged on."""
        self.basis = (self.decayed.counts.copy(), self.decayed.tokens)
        self.newest = self.decayed.update(totals, tokens)
        self._wait = max(0, self._wait - 1)
        if self.newest.sum():
            share = self.plan.gpu_activation_share(self.newest)
            with self._lock:
                self.history.append({"tokens": int(tokens), "gpu_share": round(share, 4)})
            if self._kept_share is not None and 1 - share > (1 - self._kept_share) * (1 + self.settings.threshold):
                self.backoff, self._wait = 1, 0  # the traffic left the split kept: solve now

    @property
    def ready(self) -> bool:
        """Whether a solve is due: counts to solve from, an unseen interval to judge by, and the
        backoff waited out (after a refused split the next solve waits ``backoff`` intervals, which
        then doubles, up to ``MAX_BACKOFF``; a move ends it, and so does every interval whose CPU
        share is the threshold (a fraction of it) above the share at the first refusal since the last move)."""
        return self.basis[1] > 0 and bool(self.newest.sum()) and not self._wait

    def judge(self) -> bool:
        """Solve the split from the basis (``target``) and queue its pauses when its gain reaches
        the threshold on the basis and on the newest interval, which it did not see. Returns whether
        it did."""
        self.counters["solves"] += 1
        counts = self.basis[0]
        goal = target(self.plan, counts)
        fitted, unseen = gain(self.plan, goal, counts), gain(self.plan, goal, self.newest)
        self.counters["last_gain"], self.counters["last_gain_fitted"] = round(unseen, 4), round(fitted, 4)
        if min(fitted, unseen) < self.settings.threshold:
            return self._refused()
        self.counters["accepted"] += 1
        self.backoff, self._wait, self._kept_share = 1, 0, None
        swaps = layer_swaps(self.plan, goal, counts)
        self.queue.extend(pauses(sorted(swaps, key=lambda s: -self._gain_of(s, counts)), self.neuron_bytes))
        log.info("re-placement: the split solved on served traffic serves %.1f %% more of the newest activations on "
                 "the GPU; moving %d neurons in %d pauses", 100 * unseen, sum(len(s) for s in swaps), len(self.queue))
        return True

    def _refused(self) -> bool:
        self._wait, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        if self._kept_share is None and self.newest.sum():  # the share the split was first kept at
            self._kept_share = self.plan.gpu_activation_share(self.newest)
        return False

    @staticmethod
    def _gain_of(s: Swap, counts: np.ndarray) -> float:
        return float(counts[s.l, s.to_gpu].sum() - counts[s.l, s.to_cpu].sum())

    def applied(self, pause: list[Swap], seconds: float) -> None:
        """Both executors swapped ``pause`` (the head of the queue)."""
        for s in pause:
            self.plan = self.plan.swap(s)
        self.counters["pauses"] += 1
        self.counters["neurons_moved"] += sum(len(s) for s in pause)
        self.counters["move_s"] += seconds

    def stats(self) -> dict[str, Any]:
        with self._lock:
            history = list(self.history)
        return {"on": True, "interval": self.settings.interval, "threshold": self.settings.threshold,
                "solving": self.solving, "queued_pauses": len(self.queue), "backoff": self.backoff, **self.counters,
                "gpu_share_recent": history[-1]["gpu_share"] if history else None, "gpu_share_history": history}


class ReplacementLoop:
    """Runs a Replacer beside an engine's request loop: ``stepped(tokens)`` after each step
    (cheap: a counter), ``run()`` as a task of the engine's event loop. ``read()`` returns the running
    activation totals and tokens (the engine reads them between steps); ``apply(pause)`` has both
    executors swap a pause between steps; ``observer(replacer)`` (metrics) after each change."""

    def __init__(self, replacer: Replacer, read: Callable[[], Awaitable[tuple[np.ndarray, int]]],
                 apply: Callable[[list[Swap]], Awaitable[None]],
                 observer: Callable[[Replacer], None] | None = None) -> None:
        self.replacer, self.read, self.apply = replacer, read, apply
        self.observer = observer or (lambda r: None)
        self.served, self._next = 0, replacer.settings.interval
        self._due = asyncio.Event()
        self.task: asyncio.Task | None = None

    def stepped(self, tokens: list[list[int]], steps: int = 1) -> None:
        """``steps`` steps of as many ``tokens`` (per sequence) ran (a burst: several decode
        steps of one token each); wakes the loop every interval."""
        self.served += sum(len(t) for t in tokens) * steps
        if self.served >= self._next:
            self._next = self.served + self.replacer.settings.interval
            self._due.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        r = self.replacer
        while True:
            await self._due.wait()
            self._due.clear()
            try:  # the folds and solves in a thread: tens of ms of numpy, the steps go on
                await asyncio.to_thread(r.observe, *await self.read())
                self.observer(r)
                if not r.ready:
                    continue
                r.solving = True
                try:
                    moving = await asyncio.to_thread(r.judge)
                finally:
                    r.solving = False
                if moving:
                    await self._move()
            except asyncio.CancelledError:
                raise
            except Exception:  # an executor failed: the request loop recovers them; solve again next time
                log.exception("re-placement stopped for this interval")
                r.queue.clear()

    async def _move(self) -> None:
        r = self.replacer
        while r.queue:
            pause = r.queue[0]
            t0 = time.perf_counter()
            await self.apply(pause)
            r.queue.popleft()
            r.applied(pause, time.perf_counter() - t0)
            self.observer(r)
            await asyncio.sleep(0)  # a step waiting for the lock goes first


def engine_replacer(ec: EngineConfig, src: WeightSource, plan: Plan, policy: str) -> Replacer | None:
    """The Replacer of an engine of config ``ec`` starting with ``plan`` (None: re-placement off,
    ``config.resolve_replacement``)."""
    from .config import placement_inputs, resolve_replacement

    if not resolve_replacement(ec, plan, policy):
        return None
    costs = placement_inputs(ec, src, plan.predictor_qtype)[0]
    return Replacer(plan, Settings(ec.replacement_interval, ec.replacement_threshold), costs.neuron_bytes)

