"""TEMPORARY (the A/B of the GPU-driven exchange; deleted once measured): the decode step as one
graph per run of steps between two exchanges, the host posting and awaiting, as at 9d10fa9."""
from __future__ import annotations

import time
from functools import partial

import torch

from .graphs import DecodeGraphs, GraphCaptureError
from .schedule import Post, Step


class HostPostGraphs(DecodeGraphs):
    def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **kw)
        self.blocks = _blocks(self.items)
        self.graphs = None
        self.event = torch.cuda.Event()
        self.timers = None
        self.n_steps = 0
        self.stats.layer_s.setdefault("gpu_wait", 0.0)

    def _fns(self, steps: list[Step]) -> list:
        return [partial(getattr(self.seg, s.op), s) for s in steps]

    def _capture(self) -> None:
        """Run every segment once on a side stream (Triton compiles, cuBLAS picks its kernels),
        then capture each run of steps into its own graph, all in one private memory pool
        (replayed in capture order, so sharing the pool is safe)."""
        runs = [self._fns(b) for b in self.blocks if type(b) is list]
        dev = self.w.device
        counted = self.seg.act.flat.clone()  # the warm-up run counts nothing: the replay (or eager step) does
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(side):
                for fns in runs:
                    for fn in fns:
                        fn()
        finally:
            torch.cuda.current_stream(dev).wait_stream(side)
            self.seg.act.flat.copy_(counted)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for fns in runs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                for fn in fns:
                    fn()
            graphs.append(g)
        self.graphs = graphs

    def _replay(self) -> None:
        st, dev = self.stats, self.w.device
        if self.graphs is None:
            t_c = time.perf_counter()
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001
                raise GraphCaptureError(f"{type(e).__name__}: {e}") from e
            st.graph_captures += 1
            st.capture_s += time.perf_counter() - t_c
        k, pending = 0, None  # pending: a post waiting for the next launch
        seq = t_post = 0
        timed = self.n_steps % 8 == 0
        if timed and self.timers is None:
            self.timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in self.graphs]
        for it in self.blocks:
            if type(it) is list:
                t_l = time.monotonic_ns()
                if timed:
                    self.timers[k][0].record()
                self.graphs[k].replay()
                if timed:
                    self.timers[k][1].record()
                st.layer_s["launch"] += (time.monotonic_ns() - t_l) * 1e-9
                k += 1
                if pending is not None:
                    seq, t_post = self._post(pending)
                    pending = None
            elif type(it) is Post:
                self.event.record()
                pending = it
            else:
                if pending is not None:
                    seq, t_post = self._post(pending)
                    pending = None
                self.ex.await_(seq, t_post)
        torch.cuda.current_stream(dev).synchronize()
        if timed:
            st.gpu_compute_s += sum(a.elapsed_time(b) for a, b in self.timers) * 1e-3
            st.gpu_timed_steps += 1
        self.n_steps += 1

    def _post(self, it: Post) -> tuple[int, int]:
        t0 = time.monotonic_ns()
        self.event.synchronize()  # the graph's copies into the channel are done
        self.stats.layer_s["gpu_wait"] += (time.monotonic_ns() - t0) * 1e-9
        return self.ex.post(it.op, it.l, self.B, self.B, it.n_mask)


def _blocks(items: list) -> list:
    """The schedule with each run of consecutive steps (between two exchanges) as one list."""
    blocks: list = []
    for it in items:
        if type(it) is not Step:
            blocks.append(it)
        elif blocks and type(blocks[-1]) is list:
            blocks[-1].append(it)
        else:
            blocks.append([it])
    return blocks
