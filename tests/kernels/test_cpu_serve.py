"""The CPU executor's compiled serving loop (cpu_ffn.ServeLoop, csrc pi_serve) on a real channel:
it answers FFN requests of its prepared layers as the Python loop does (the channel's out against
the float64 reference, the answer's header fields, its counters) and hands every other request
back unanswered: other ops, an unprepared layer, another mask width, more tokens than the channel
holds. It returns when idle or interrupted, and leaves the answer alone once the primary gave up."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from powerinfer_ray.kernels import cpu_ffn
from powerinfer_ray.runtime.channel import ABORTED, OP_ATTN, OP_FFN, OP_PING, Channel

from kernel_checks import TOL, make_shard, rel_err
from test_cpu_bitmask import pack, reference, token_mask
from waits import wait_until

pytestmark = pytest.mark.skipif(not cpu_ffn.available(), reason="no C++ compiler: compiled kernel unavailable")
D, CAP, WIDTHS = 64, 4, (101, 77)  # the channel's tokens; the two prepared layers' mask widths


class Loop:
    """A ServeLoop over a fresh channel, its run() in a thread; posts from this thread."""

    def __init__(self, threads: int = 2) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ch = Channel.create(D, CAP, CAP, max(WIDTHS), "f16")
        self.shards = [make_shard(n + 9, D, torch.float16, "reglu", True, gen) for n in WIDTHS]
        calls = [cpu_ffn.prepare_bitmask(self.ch.x_ffn, up, gate, down_t, self.ch.mask_rows(CAP, n), n, "reglu", b,
                                         self.ch.out) for n, (up, gate, down_t, b) in zip(WIDTHS, self.shards)]
        self.loop = cpu_ffn.ServeLoop(self.ch.header, [*calls, None], [*WIDTHS, 0], CAP)  # layer 2: not prepared
        self.loop.configure(threads, idle_s=30.0)
        self.gen, self.last, self.returned = gen, int(self.ch.header[0]), []
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: self.returned.append(self.loop.run(self.last)), daemon=True)
        self.thread.start()

    def join(self) -> int:
        """Joins the run: (the request it handed back, True) or (the last it answered, False)."""
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the serving loop did not return"
        got = self.returned.pop()
        self.last = got[0]
        return got

    def post(self, op: int, l: int, n_seq: int, T: int, n_mask: int) -> int:
        return self.ch.post(op, l, n_seq, T, n_mask)

    def answered(self, seq: int) -> None:
        wait_until(lambda: int(self.ch.header[1]) == seq, 60, f"the answer to request {seq}", poll=1e-4)

    def request(self, l: int, T: int, n_seq: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """An FFN request of T new tokens for layer l; (seq, mask, x)."""
        n = WIDTHS[l]
        x = torch.randn(T, D, generator=self.gen).half()
        mask = token_mask(T, n, 0.3, self.gen)
        self.ch.x_ffn[:T] = x
        self.ch.mask_rows(T, n)[:] = pack(mask)
        self.ch.out.fill_(float("nan"))
        return self.post(OP_FFN, l, n_seq, T, n), mask, x

    def close(self) -> None:
        self.ch.close(unlink=True)


@pytest.fixture
def served():
    lp = Loop()
    yield lp
    if lp.thread is not None and lp.thread.is_alive():
        lp.loop.interrupt()
        lp.thread.join(timeout=60)
    lp.close()


def test_it_answers_ffn_requests_as_the_reference_and_counts_them(served):
    served.start()
    want = dict.fromkeys(cpu_ffn.ServeLoop.COUNTERS, 0)
    busy0 = int(served.ch.header[13])
    for l, T, n_seq in ((0, 3, 3), (1, 2, 1), (0, 1, 1), (1, 4, 4)):  # decode steps (T = n_seq) and a prompt chunk
        seq, mask, x = served.request(l, T, n_seq)
        served.answered(seq)
        up, gate, down_t, b = served.shards[l]
        ref, pairs, rows = reference(x, up, gate, down_t, mask, "reglu", b)
        assert rel_err(served.ch.out[:T], ref) < TOL[torch.float16]
        h = served.ch.header
        assert int(h[7]) == 0 and 0 < int(h[10]) <= int(h[11])  # status ok; the answer's times
        want.update(exchanges=want["exchanges"] + 1, tokens=want["tokens"] + (T if l == 0 else 0),
                    pairs=want["pairs"] + pairs, rows=want["rows"] + rows, up_rows=want["up_rows"] + rows)
        if T == n_seq:
            want.update(decode_exchanges=want["decode_exchanges"] + 1, decode_rows=want["decode_rows"] + rows,
                        decode_up_rows=want["decode_up_rows"] + rows)
    got = served.loop.totals()
    for k in ("exchanges", "tokens", "pairs", "rows", "up_rows", "decode_exchanges", "decode_rows", "decode_up_rows"):
        assert got[k] == want[k], k
    assert 0 < got["down_rows"] <= got["rows"] and 0 < got["decode_down_rows"] <= got["decode_rows"]
    assert 0 < got["kernel_ns"] <= got["busy_ns"] and got["decode_busy_ns"] < got["busy_ns"]
    assert int(served.ch.header[13]) - busy0 == got["busy_ns"]  # the header's busy_ns: the same answers
    ping = served.post(OP_PING, 0, 0, 0, 0)
    assert served.join() == (ping, True) and int(served.ch.header[1]) == ping - 1  # handed back unanswered


@pytest.mark.parametrize("what", ["other op", "unprepared layer", "other mask width", "too many tokens",
                                  "no sequence"])
def test_it_hands_back_what_it_cannot_answer(served, what):
    op, l, n_seq, T, n_mask = {"other op": (OP_ATTN, 0, 1, 1, WIDTHS[0]), "unprepared layer": (OP_FFN, 2, 1, 1, 0),
                               "other mask width": (OP_FFN, 0, 1, 1, WIDTHS[1]),
                               "too many tokens": (OP_FFN, 0, 1, CAP + 1, WIDTHS[0]),
                               "no sequence": (OP_FFN, 0, 0, 1, WIDTHS[0])}[what]
    served.start()
    seq = served.post(op, l, n_seq, T, n_mask)
    assert served.join() == (seq, True)
    assert int(served.ch.header[1]) == seq - 1 and served.loop.totals()["exchanges"] == 0


def test_it_returns_when_idle_and_when_interrupted(served):
    served.loop.configure(2, idle_s=0.05)
    seq, _, _ = served.request(0, 1, 1)  # posted before the run starts: its idle time cannot pass first
    served.start()
    served.answered(seq)
    assert served.join() == (seq, False)  # nothing came within the idle time after it: the last it answered
    served.loop.interrupt()
    seq, _, _ = served.request(0, 1, 1)
    served.start()
    assert served.join() == (seq - 1, False) and int(served.ch.header[1]) == seq - 1  # interrupted: it left the request
    served.loop.clear()
    served.loop.configure(1, idle_s=30.0)  # new threads, as set_threads does
    served.start()
    served.answered(seq)
    assert served.loop.totals()["exchanges"] == 2


def test_no_answer_once_the_primary_gave_up(served):
    served.start()
    seq, _, _ = served.request(0, 1, 1)
    served.answered(seq)
    served.ch.abort()
    seq, _, _ = served.request(1, 1, 1)
    # computed (counted), not answered; the ping must not overwrite it before
    wait_until(lambda: served.loop.totals()["exchanges"] == 2, 60, "the request after the abort computed", poll=1e-4)
    ping = served.post(OP_PING, 0, 0, 0, 0)
    assert served.join() == (ping, True)  # it went on to the next request
    assert served.ch.aborted and int(served.ch.header[1]) != seq  # no answer
    assert np.isfinite(served.ch.out[:1].float().numpy()).all()
