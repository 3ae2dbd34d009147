"""Host memory (runtime/hostmem.py): the fit check before loading, with a host memory limit; the
process and host figures against /proc; warming the in-place rows (runtime/warm.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from dataclasses import replace

from powerinfer_ray.model.source import open_model
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime import group
from powerinfer_ray.runtime.config import EngineConfig
from powerinfer_ray.runtime.engine import executor_spec
from powerinfer_ray.runtime.hostmem import GIB, PROCESS_BYTES, host_memory, on_tmpfs, process_memory
from powerinfer_ray.runtime.plan import Plan
from powerinfer_ray.runtime.shard import in_place_ffn_shard
from powerinfer_ray.runtime.warm import Warmer, resident_share, warm_ranges


def _split_plan(cfg, seed: int = 0) -> Plan:
    """70 % of each layer's neurons and the last KV-head group on the CPU."""
    rng = np.random.default_rng(seed)
    masks = [rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)]
    groups = [np.arange(cfg.n_head_kv) < cfg.n_head_kv - 1] * cfg.n_layer
    return Plan.from_masks(masks, groups, cfg)


def _start(model: str, plan: Plan, limit: int, slots: int = 2, n_ctx: int = 64) -> group.ExecutorGroup:
    """The executor group of an engine over ``model`` with ``plan``, allowed ``limit`` bytes of host memory."""
    src = open_model(model)
    ec = EngineConfig(model, plan=plan, policy="oracle", max_batch=slots, n_ctx=n_ctx, prefill_chunk=16)
    spec = replace(executor_spec(ec, src, plan, "cpu", model=src), host_memory_bytes=limit)
    return group.start_group(group.LocalBackend(), spec)


def _no_loading(monkeypatch):  # noqa: ANN001, ANN202
    """The executors must not be built: a check before loading fails first."""
    def refuse(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("an executor was built")
    monkeypatch.setattr(group, "PrimaryExecutor", refuse)
    monkeypatch.setattr(group, "CPUExecutor", refuse)


def test_a_placement_that_cannot_fit_fails_before_loading_naming_the_sizes(monkeypatch):
    """A planted model (no file: the CPU's rows are copied) whose executors need more than the host
    memory limit (GroupSpec.host_memory_bytes): ValueError before any executor is built, naming
    the copied rows, the CPU attention, the processes and the limit; at exactly the need it
    starts, and with the token embedding in host memory its bytes count too. Sizes by hand: f32 gated rows of n_embd 128 are 3 * 128 * 4 bytes per neuron; a
    KV-head group (one query head: n_head = n_head_kv = 4) is its q, k, v and o rows of head_dim
    32 (4 * 32 * 128 * 4 bytes) and its fp32 KV cache (2 * (slots + 1) * n_ctx * 32 * 4 bytes)."""
    spec = "planted:tiny?layers=2&dtype=f32"
    cfg = open_model(spec).config
    plan = _split_plan(cfg)
    slots, n_ctx = 2, 64
    rows = sum(len(lp.cpu_neurons) for lp in plan.layers) * 3 * 128 * 4
    attn = 2 * 1 * (4 * 32 * 128 * 4 + 2 * (slots + 1) * n_ctx * 32 * 4)  # 2 layers x 1 group
    need = rows + attn + 2 * PROCESS_BYTES
    with monkeypatch.context() as m:
        _no_loading(m)
        with pytest.raises(ValueError) as e:
            _start(spec, plan, need - 1, slots, n_ctx)
    msg = str(e.value)
    assert "does not fit this host's memory" in msg and "planted-tiny" in msg
    assert f"need {need / GIB:.1f} GiB" in msg and f"{rows / GIB:.1f} GiB of FFN rows copied" in msg
    assert f"{attn / GIB:.1f} GiB of CPU attention" in msg and "2 executor process(es)" in msg
    assert f"{(need - 1) / GIB:.1f} GiB are allowed (host memory limit)" in msg
    assert re.search(r"host total \d+\.\d GiB", msg)
    # a budget's plan holds the (f32) token embedding in page-locked host memory as well
    with monkeypatch.context() as m:
        _no_loading(m)
        on_host, table = replace(plan, embd_on_host=True), cfg.n_vocab * cfg.n_embd * 4
        with pytest.raises(ValueError, match="GiB of token embedding"):
            _start(spec, on_host, need + table - 1, slots, n_ctx)
        with pytest.raises(AssertionError, match="an executor was built"):  # the check passed
            _start(spec, on_host, need + table, slots, n_ctx)
    g = _start(spec, plan, need, slots, n_ctx)
    try:
        assert g.cpu is not None and g.cpu.ffn_rows in ("shared", "private")
    finally:
        g.close()


def test_rows_in_place_in_a_file_on_tmpfs_cost_no_host_memory(tmp_path, monkeypatch):
    """The same split from a file: in place, the CPU's rows cost nothing more when the file is on
    tmpfs (its pages are memory already), and their bytes when the file is on a disk (they must
    stay in the page cache); its attention group (one range) is read in place too, only its KV
    cache counts; a limit just under the need fails, the need itself passes the check."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=1, n_layer=2, n_ctx=64)
    cfg = open_model(path).config
    plan = _split_plan(cfg)
    rows = sum(len(lp.cpu_neurons) for lp in plan.layers) * 3 * cfg.n_embd * 4
    attn = 2 * (2 * 3 * 64 * cfg.head_dim * 4)  # 2 layers x the KV cache of one group
    need = attn + 2 * PROCESS_BYTES + (0 if on_tmpfs(path) else rows)
    with monkeypatch.context() as m:
        _no_loading(m)
        with pytest.raises(ValueError, match="in place in the file on tmpfs" if on_tmpfs(path) else "kept in the page cache"):
            _start(str(path), plan, need - 1)
    g = _start(str(path), plan, need)
    try:
        assert g.cpu.ffn_rows == "file" and all(a.wqkv is None for a in g.cpu.attn)  # attention in place
    finally:
        g.close()


def test_process_and_host_memory_match_proc():
    """The figures are /proc's (kB -> bytes), and a new 64 MiB private buffer shows in RssAnon (in a
    fresh process: here earlier tests' threads may free memory between the two readings)."""
    code = ("import json, numpy as np; from powerinfer_ray.runtime.hostmem import process_memory; "
            "b = process_memory(); buf = np.ones(64 << 20, np.uint8); a = process_memory(); print(json.dumps([b, a]))")
    before, after = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True).stdout)
    assert after["rss_anon_bytes"] - before["rss_anon_bytes"] >= 60 << 20
    assert after["rss_peak_bytes"] >= after["rss_bytes"] >= after["rss_anon_bytes"]
    total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    h = host_memory()
    assert h.total == total and 0 < h.available <= h.total
    st = os.statvfs("/dev/shm")
    assert h.shm_free == st.f_bavail * st.f_frsize
    assert on_tmpfs("/dev/shm") == any(line.split()[1] == "/dev/shm" and line.split()[2] == "tmpfs"
                                       for line in open("/proc/mounts"))


def test_warming_covers_exactly_the_cpu_rows_in_shard_order(tmp_path):
    """The ranges are the in-place shard's rows of every matrix (runs of adjacent rows, joined
    across gaps of at most two rows), hottest chunk first; warming maps them all into memory."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=2, n_layer=2, n_ctx=64)
    src = open_model(path)
    cfg = src.config
    ids = np.array([7, 3, 4, 5, 100, 102, 200, 9], np.int64)  # runs: 3-5 and 7-9 join (gap 2), 100-102, 200
    sh = in_place_ffn_shard(src, 1, ids, torch.float32)
    rb = cfg.n_embd * 4
    got = warm_ranges([sh])
    want = []
    for a, b in ((3, 10), (100, 103), (200, 201)):
        for t in (sh.up, sh.gate, sh.down_t):
            want.append((t.data_ptr() + a * rb, (b - a) * rb))
    assert got == want
    w = Warmer([sh], progress=False).start()
    w.thread.join(timeout=30)
    assert w.state()["done"] and w.state()["bytes"] == sum(n for _, n in want)
    assert all(resident_share(a, n) == 1.0 for a, n in want)


def test_warming_goes_chunk_by_chunk_in_shard_order(tmp_path, monkeypatch):
    """Shard order is hottest first (Plan.hot_first): each chunk of it is warmed before the next."""
    from powerinfer_ray.runtime import warm

    monkeypatch.setattr(warm, "CHUNK_ROWS", 4)
    path = write_tiny_model(tmp_path / "m.gguf", "llama-relu", seed=2, n_layer=1, n_ctx=64)
    src = open_model(path)
    sh = in_place_ffn_shard(src, 0, np.array([7, 3, 4, 5, 100, 102, 200, 9]), None)
    rb = src.config.n_embd * 4
    starts = [(a - sh.up.data_ptr()) // rb for a, _ in warm_ranges([sh])[::2]]  # up's ranges (then down_t's)
    assert starts == [3, 9, 100, 200]  # 3-7 in the first chunk; 9 is in the second (one chunk would join 3-9)
