"""The engine on a real local Ray cluster (num_cpus=2), as a user's own Ray program uses it."""
from __future__ import annotations

import time

import pytest
import ray
import torch
from ties import assert_counts, assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("m") / "m.gguf", "llama-gqa", seed=5, n_layer=3,
                            n_ctx=256, predictor_rank=16)
    return path, ReferenceModel.from_file(path)


@pytest.fixture(scope="module")
def engine(ray_cluster, model):
    # mixed split with CPU-placed heads: both executors and both kinds of exchange are exercised;
    # prompts of >= 8 tokens run the CPU shard densely on the primary, from the model file's rows
    # (the CPU executor computes on them in place: no copy in either process)
    eng = Coordinator.options(name="test-engine").remote(str(model[0]), gpu_fraction=0.5, cpu_groups=1,
                                                         policy="oracle", max_batch=8, threads=1,
                                                         prefill_dense_min=8)
    assert ray.get(eng.ready.remote())["dense_prefill"] == "file"
    yield eng
    ray.get(eng.shutdown.remote())
    ray.kill(eng)


def test_generate_from_a_user_driver_matches_dense_greedy(engine, model):
    path, ref = model
    prompt = list(range(5, 30))
    out = ray.get(engine.generate.remote(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True))
    assert len(out["token_ids"]) == 12
    assert_greedy(ref, prompt, out["token_ids"])
    assert out["finish_reason"] == "length" and out["stats"]["completion_tokens"] == 12
    # the engine is reachable by name from any driver or task of the cluster
    same = ray.get_actor("test-engine")
    assert ray.get(same.generate.remote(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True))["token_ids"] \
        == out["token_ids"]


def test_activation_counts_of_the_engines_tokens(engine, model, tmp_path):
    """The engine's counts (policy oracle: the CPU shard's in dense prefill on the primary, then
    the CPU executor's answers) are the reference's nonzero activations over the tokens it ran;
    save_activation writes them for ``solve --activation``."""
    from powerinfer_ray.offline.profile import ActivationStats

    _, ref = model
    ray.get(engine.activation_stats.remote(reset=True))  # the earlier tests' tokens
    prompt = list(range(40, 60))
    out = ray.get(engine.generate.remote(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True))
    ran = prompt + out["token_ids"][:-1]  # the last token is sampled, never run
    st = ray.get(engine.stats.remote())["activation"]
    saved = ray.get(engine.save_activation.remote(str(tmp_path / "act")))
    got = ActivationStats.load_parquet(tmp_path / "act" / "activation.parquet")
    assert got.n_tokens == saved["n_tokens"] == st["tokens"] == len(ran)
    assert_counts(ref, [ran], got.counts)
    assert got.counts.sum() > 0
    assert st["mean_active_fraction"] == pytest.approx(got.counts.sum() / (len(ran) * got.counts.size))


def test_eight_concurrent_requests_equal_running_them_alone(engine, model):
    _, ref = model
    prompts = [list(range(10 + i, 20 + 2 * i)) for i in range(8)]
    refs = [engine.generate.remote(prompt_token_ids=p, max_tokens=10, ignore_eos=True) for p in prompts]
    outs = ray.get(refs)
    for p, o in zip(prompts, outs):
        assert len(o["token_ids"]) == 10
        assert_greedy(ref, p, o["token_ids"])
    st = ray.get(engine.stats.remote())
    assert st["coordinator"]["running"] == 0
    assert 0.0 < st["gpu_executor"]["gpu_activation_share"] < 1.0
    assert st["cpu_executor"]["neurons"] > 0 and st["gpu_executor"]["exchanges"] > 0
    c = st["coordinator"]  # every step over the step link (counted since the executors last started)
    assert 0 < c["link_calls"] <= c["steps"] and 0 < c["link_step_s"] <= c["step_s"]
    # each actor reports its own process's memory (its pid's /proc), the CPU executor where its rows are
    pids = {k: i["pid"] for k, i in zip(("gpu_executor", "cpu_executor"), ray.get(engine.ready.remote())["executors_ready"])}
    for k in ("coordinator", "gpu_executor", "cpu_executor"):
        m = st[k]["memory"]
        assert 0 < m["rss_anon_bytes"] <= m["rss_bytes"] <= m["rss_peak_bytes"], (k, m)
    for k, pid in pids.items():
        hwm = int(open(f"/proc/{pid}/status").read().split("VmHWM:")[1].split()[0]) * 1024
        assert hwm >= st[k]["memory"]["rss_peak_bytes"]  # the peak only grows
    assert st["cpu_executor"]["memory"]["ffn_rows"] == "file" and st["cpu_executor"]["memory"]["shared_bytes"] == 0


def test_streaming_yields_the_same_tokens(engine, model):
    _, ref = model
    prompt = list(range(50, 60))
    chunks = [ray.get(r) for r in engine.generate_stream.remote(prompt_token_ids=prompt, max_tokens=8,
                                                                  ignore_eos=True)]
    ids = [t for c in chunks for t in c["token_ids"]]
    assert len(ids) == 8
    assert_greedy(ref, prompt, ids)
    assert chunks[-1]["finish_reason"] == "length"


def test_bad_requests_raise_clear_errors(engine):
    with pytest.raises(ray.exceptions.RayTaskError, match="temperature"):
        ray.get(engine.generate.remote(prompt_token_ids=[1, 2], temperature=-0.5))
    with pytest.raises(ray.exceptions.RayTaskError, match="context"):
        ray.get(engine.generate.remote(prompt_token_ids=list(range(256)) * 2, max_tokens=2))


@pytest.mark.parametrize("victim", ["cpu", "gpu"])
def test_killed_executor_fails_the_request_and_the_next_one_succeeds(engine, model, victim):
    _, ref = model
    prompt = list(range(5, 30))
    handles = ray.get(engine.executor_handles.remote())
    stream = engine.generate_stream.remote(prompt_token_ids=prompt, max_tokens=200, ignore_eos=True)
    first = ray.get(next(stream), timeout=120)  # generating now: kill mid-generation
    assert first["token_ids"]
    ray.kill(handles[victim])
    with pytest.raises(ray.exceptions.RayTaskError, match="generation failed"):
        for ref_ in stream:
            ray.get(ref_, timeout=120)
    out = ray.get(engine.generate.remote(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True), timeout=120)
    assert len(out["token_ids"]) == 6
    assert_greedy(ref, prompt, out["token_ids"])
    assert ray.get(engine.stats.remote())["restarts"] >= 1


def test_per_device_load_shows_on_the_metrics_endpoint(engine, ray_cluster):
    """The dashboard's numbers: powerinfer_* metrics tagged by actor and device on /metrics."""
    import urllib.request

    ray.get(engine.generate.remote(prompt_token_ids=list(range(5, 15)), max_tokens=20, ignore_eos=True))
    ray.get(engine.stats.remote())  # also pushes the CPU executor's counters
    url = f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics"
    want = ("powerinfer_neurons_computed", "powerinfer_memory_used_bytes", "powerinfer_gpu_activation_share")
    deadline, text = time.time() + 60, ""
    while time.time() < deadline:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        if all(w in text for w in want) and "cpu-executor" in text and "gpu-executor" in text:
            break
        time.sleep(2)
    lines = [l for l in text.splitlines() if l.startswith("ray_powerinfer_neurons_computed")]
    assert lines, f"no powerinfer metrics on {url}"
    assert any("cpu-executor" in l for l in lines) and any("gpu-executor" in l for l in lines), lines
    assert all(float(l.rsplit(" ", 1)[1]) > 0 for l in lines)


def test_cpu_threads_are_set_live_and_checked(engine, model):
    """set_cpu_threads changes the CPU executor's kernel threads without a reload; bad counts
    and a start that asks for more CPUs than the cluster has fail with a clear error."""
    _, ref = model
    assert ray.get(engine.set_cpu_threads.remote(2)) == 2
    assert ray.get(engine.stats.remote())["cpu_executor"]["threads"] == 2
    out = ray.get(engine.generate.remote(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True))
    assert len(out["token_ids"]) == 4
    assert_greedy(ref, [5, 6, 7], out["token_ids"])
    assert ray.get(engine.set_cpu_threads.remote(1)) == 1
    with pytest.raises(ray.exceptions.RayTaskError, match="threads=0"):
        ray.get(engine.set_cpu_threads.remote(0))
    # num_cpus=0: schedulable beside the module's engine, which holds the cluster's 2 CPUs
    too_many = Coordinator.options(name="test-engine-threads", num_cpus=0).remote(str(model[0]), gpu_fraction=0.5,
                                                                                 threads=8)
    with pytest.raises(ray.exceptions.RayActorError, match="threads=8"):
        ray.get(too_many.ready.remote(), timeout=120)


def test_latency_histograms_show_on_the_metrics_endpoint(engine, ray_cluster):
    """Time to first token, time per output token and time in the queue, per request, as Ray
    histograms of the engine: their counts reach the requests that finished."""
    import urllib.request

    n = 3
    ray.get([engine.generate.remote(prompt_token_ids=[5, 6, 7 + i], max_tokens=4, ignore_eos=True) for i in range(n)])
    url = f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics"
    names = ("time_to_first_token_seconds", "time_per_output_token_seconds", "queue_time_seconds")

    def counts() -> dict[str, float]:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for name in names:
            lines = [l for l in text.splitlines() if l.startswith(f"ray_powerinfer_{name}_count")]
            out[name] = sum(float(l.rsplit(" ", 1)[1]) for l in lines)
        return out

    deadline, got = time.time() + 60, {}
    while time.time() < deadline:
        got = counts()
        if all(v >= n for v in got.values()):
            break
        time.sleep(2)
    assert all(v >= n for v in got.values()), got


@pytest.mark.skipif(torch.cuda.is_available(), reason="the cluster has a GPU")
def test_cuda_on_a_cluster_without_a_gpu_fails_at_once(engine, model):
    """The engine checks what the cluster has: without the check its GPU executor waited forever
    for a GPU. The failure is final (a constructor's error is not restarted)."""
    eng = Coordinator.options(name="test-engine-cuda", num_cpus=0).remote(str(model[0]), device="cuda")
    with pytest.raises(ray.exceptions.RayActorError, match="device='cuda': the Ray cluster has no GPU"):
        ray.get(eng.ready.remote(), timeout=120)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(eng.ready.remote(), timeout=60)
