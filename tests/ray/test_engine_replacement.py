"""Re-placement in the Ray engine (runtime/replacement.py): the Coordinator's loop reads the
executors' counts between steps, solves in its own process and has both executor actors swap
neurons between steps; stats() and /metrics show it."""
from __future__ import annotations

import itertools
import time
import urllib.request

import numpy as np
import ray
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.costs import model_costs
from powerinfer_ray.model.planted import planted_model
from powerinfer_ray.model.source import open_model
from powerinfer_ray.placement.host import HostProfile
from powerinfer_ray.runtime.plan import Plan

SPEC = "planted:tiny?layers=2&dtype=f32"


def test_a_bad_split_follows_the_traffic_and_shows_on_stats_and_metrics(ray_cluster, tmp_path):
    """Started with each layer's coldest third on the GPU executor: after a few intervals of
    traffic the engine has moved neurons, the GPU's share of the recent activations is far above
    the first interval's, the tokens stay the dense reference's (policy 'oracle': exact), and the
    counters and the share show on the node's /metrics."""
    m = planted_model(SPEC.removeprefix("planted:"))
    ref = m.reference()
    bad = Plan.hottest(ref.cfg, 1 / 3, counts=[-m.activation_probs(l) for l in range(ref.cfg.n_layer)])
    costs = model_costs(open_model(SPEC), 256, 2)
    HostProfile(sync_us=0.0).save(tmp_path / "host.json")  # tiny neurons are never worth a sync: split anyway
    budget = (costs.min_budget_bytes(False) + costs.ffn_bytes // 3) / (1 << 30)
    eng = Coordinator.options(name="test-engine-replacement").remote(
        SPEC, plan=bad, vram_budget_gib=budget, host_profile=str(tmp_path / "host.json"), policy="oracle",
        max_batch=2, n_ctx=256, threads=1, replacement="on", replacement_interval=16)
    try:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, ref.cfg.n_vocab, 10).tolist() for _ in range(3)]
        deadline, st = time.time() + 180, {}
        for i in itertools.count():  # until the move is done, and one interval after it
            p = prompts[i % 3]
            out = ray.get(eng.generate.remote(prompt_token_ids=p, max_tokens=24, temperature=0, ignore_eos=True))
            assert len(out["token_ids"]) == 24, i
            assert_greedy(ref, p, out["token_ids"])
            st = ray.get(eng.stats.remote())["replacement"]
            hist = st["gpu_share_history"]
            if st["neurons_moved"] and not st["queued_pauses"] and len(hist) >= 2 and hist[-1]["tokens"] > 0 \
                    and st["pauses"] and hist[-1]["gpu_share"] > hist[0]["gpu_share"] + 0.3:
                break
            while st["solving"] and time.time() < deadline:  # a loaded machine: the solve outlasts the traffic
                time.sleep(0.2)
                st = ray.get(eng.stats.remote())["replacement"]
            assert time.time() < deadline, st
        assert st["accepted"] >= 1 and st["neurons_moved"] > 0, st
        assert st["gpu_share_history"][-1]["gpu_share"] > st["gpu_share_history"][0]["gpu_share"] + 0.3, st
        url = f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics"
        want = ("ray_powerinfer_replacement_neurons_moved", "ray_powerinfer_replacement_swaps",
                "ray_powerinfer_gpu_activation_share_recent")
        moved: list[str] = []

        def exported() -> bool:  # the metrics reach /metrics some seconds after they are set
            nonlocal moved
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            moved = [l for l in text.splitlines() if l.startswith(want[0]) and "test-engine-replacement" in l]
            now = ray.get(eng.stats.remote())["replacement"]["neurons_moved"]
            return all(w in text for w in want) and bool(moved) and float(moved[0].rsplit(" ", 1)[1]) == now

        while not exported():
            assert time.time() < deadline, moved
            time.sleep(2)
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
