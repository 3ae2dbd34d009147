"""A sparsified SwiGLU model on a real local Ray cluster (num_cpus=2): the engine picks gate-first
from the file's metadata and generates the thresholded model's greedy tokens over a hybrid split."""
from __future__ import annotations

import pytest
import ray
from swiglu_models import sparsified
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.reference import ReferenceModel


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = sparsified(tmp_path_factory.mktemp("m") / "tiny-swiglu-0.5.gguf")
    return path, ReferenceModel.from_file(path)


def test_gate_first_engine_generates_the_thresholded_models_greedy_tokens(ray_cluster, model):
    path, ref = model
    # half the neurons and one KV-head group of each layer on the CPU executor; prompts run
    # through the per-layer exchange (no dense prefill), so both devices threshold their own gates
    eng = Coordinator.options(name="test-swiglu-engine").remote(str(path), gpu_fraction=0.5, cpu_groups=1,
                                                                max_batch=4, threads=1, prefill_dense_min=0)
    try:
        assert ray.get(eng.ready.remote())["policy"] == "gate-first"
        prompts = [list(range(5, 25)), [300, 12, 7, 99, 41]]
        outs = ray.get([eng.generate.remote(prompt_token_ids=p, max_tokens=10, ignore_eos=True) for p in prompts])
        for p, o in zip(prompts, outs):
            assert len(o["token_ids"]) == 10
            assert_greedy(ref, p, o["token_ids"])
        st = ray.get(eng.stats.remote())
        assert st["policy"] == "gate-first"
        assert st["cpu_executor"]["neurons"] > 0 and 0.0 < st["gpu_executor"]["gpu_activation_share"] < 1.0
        # the thresholds hold: about half of the (token, neuron) pairs were computed
        n_tok = sum(len(p) + 10 for p in prompts)
        pairs = st["cpu_executor"]["neurons"] + st["gpu_executor"]["neurons"]
        assert 0.35 < pairs / (n_tok * ref.cfg.n_ff * ref.cfg.n_layer) < 0.65
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
