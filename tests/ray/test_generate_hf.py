"""``powerinfer-ray convert`` of random HF SwiGLU models (Llama with SiLU, Qwen2), then the engine that
``powerinfer-ray generate`` starts (dense: no predictors, no thresholds), on a real local Ray, split
between the primary and a CPU executor: greedy token ids are HF transformers' greedy ids, up to rounding ties."""
from __future__ import annotations

import pytest
import ray
import torch
from ties import FullForward, assert_greedy  # noqa: E402

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402
from unit.offline.test_convert_hf import PROMPT, save_hf  # noqa: E402

from powerinfer_ray.actors.coordinator import Coordinator  # noqa: E402
from powerinfer_ray.cli import main  # noqa: E402

N = 16


@pytest.mark.parametrize("name", ["llama-silu", "qwen2"])
def test_engine_greedy_equals_hf(ray_cluster, tmp_path, name):
    model = save_hf(name, tmp_path / "hf")
    gguf = tmp_path / "m.gguf"
    assert main(["convert", str(tmp_path / "hf"), "-o", str(gguf), "--outtype", "f32"]) == 0
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf").encode(PROMPT)
    eng = Coordinator.options(name=f"hf-{name}").remote(str(gguf), device="cpu", threads=1,
                                                       gpu_fraction=0.5, cpu_groups=1)
    try:
        info = ray.get(eng.ready.remote())
        assert info["policy"] == "dense" and info["executors"] == ["gpu", "cpu"]
        out = ray.get(eng.generate.remote(prompt_token_ids=ids, max_tokens=N, ignore_eos=True, temperature=0.0))
        assert len(out["token_ids"]) == N
        assert_greedy(FullForward(lambda seq: model(input_ids=torch.tensor([seq])).logits[0]), ids, out["token_ids"])
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
