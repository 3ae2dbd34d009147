"""The CPU kernels' worker threads (csrc/pool.h): results against float64 whatever the team size,
from several Python threads at once, after the workers went to sleep, and pinned to cores."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from powerinfer_ray.kernels import cpu_ffn, cpu_library, sparse_ffn_ref

from kernel_checks import make_shard, rel_err

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="no C++ compiler: compiled kernel unavailable")


def _case(seed: int, T: int = 3, N: int = 400, D: int = 96):
    gen = torch.Generator().manual_seed(seed)
    up, gate, down_t, b = make_shard(N, D, torch.float32, "reglu", True, gen)
    x = torch.randn(T, D, generator=gen)
    mask = torch.rand(T, N, generator=gen) < 0.3
    idx = mask.any(0).nonzero().reshape(-1)
    ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask.index_select(1, idx), "reglu", b)
    packed = np.packbits(mask.numpy(), axis=1, bitorder="little")
    return (x, up, gate, down_t, packed, N, "reglu", b), ref


def _run(args, threads: int, split: str = "auto") -> torch.Tensor:
    out = torch.full((args[0].shape[0], args[0].shape[1]), float("nan"))
    cpu_ffn.sparse_ffn_bitmask(*args, out, threads, split=split)
    return out


def test_teams_of_any_size_in_turn():
    """Regions of 1 .. 7 threads one after another (the team grows, and smaller regions leave
    workers idle), both splits, each against float64; the dense linear too; an empty-ish read."""
    args, ref = _case(1)
    for threads in (1, 4, 2, 7, 3, 1, 6):
        for split in ("rows", "cols"):
            assert rel_err(_run(args, threads, split), ref) < 1e-5, (threads, split)
    w = torch.randn(50, 96)
    x = torch.randn(2, 96)
    for threads in (5, 2):
        y = cpu_ffn.linear(x, w, threads=threads)
        assert rel_err(y, x.double() @ w.double().T) < 1e-5
    lib = cpu_library.library()
    ones = torch.ones(1000)
    assert [lib.pi_read_sum(ones.data_ptr(), 1000, t) for t in (1, 3, 8)] == [1000.0] * 3


def test_calls_from_several_python_threads_at_once():
    """Python threads calling kernels concurrently (cpu_ffn serialises the FFN entry; linear is not
    locked, so regions queue in the pool): every result right."""
    cases = [_case(s) for s in range(4)]
    w = torch.randn(64, 96)
    errors: list[str] = []

    def work(i: int) -> None:
        args, ref = cases[i]
        for _ in range(15):
            if rel_err(_run(args, 2 + i % 3), ref) >= 1e-5:
                errors.append(f"ffn {i}")
            x = torch.randn(1, 96)
            if rel_err(cpu_ffn.linear(x, w, threads=3), x.double() @ w.double().T) >= 1e-5:
                errors.append(f"linear {i}")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts) and not errors, errors


def test_sleeping_workers_wake_for_the_next_call():
    """spin 0: the workers sleep as soon as a call ends; the next call wakes them (no hang)."""
    args, ref = _case(7)
    try:
        started = cpu_library.configure_threads(0)
        for _ in range(5):
            time.sleep(0.02)  # asleep by now
            assert rel_err(_run(args, 3), ref) < 1e-5
        assert cpu_library.configure_threads(0) >= max(started, 2)  # a team of 3: two workers at least
    finally:
        cpu_library.configure_threads(100)
    with pytest.raises(ValueError, match="spin_us is -1"):
        cpu_library.configure_threads(-1)


def _allowed(tid: int) -> str:
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":")[1].strip()
    return ""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinning_the_caller_and_the_workers_then_unpinning():
    """cpus=[a, b]: the calling thread runs on a only and the workers alternate b, a, ...; no cpus:
    every thread back on the process's CPUs; results right either way."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    everything = _allowed(threading.get_native_id())
    args, ref = _case(9)
    _run(args, 3)  # two workers exist
    before = set(os.listdir("/proc/self/task"))
    try:
        cpu_library.configure_threads(100, cpus)
        assert os.sched_getaffinity(0) == {cpus[0]}
        allowed = {_allowed(int(t)) for t in before}
        assert str(cpus[1]) in allowed  # worker 0
        assert rel_err(_run(args, 3), ref) < 1e-5
    finally:
        cpu_library.configure_threads(100)
    assert _allowed(threading.get_native_id()) == everything
    assert str(cpus[1]) not in {_allowed(int(t)) for t in os.listdir("/proc/self/task")} or len(everything) == 1
