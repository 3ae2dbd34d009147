"""``powerinfer-ray generate``: check everything before Ray starts, start a local Ray cluster and
the engine, print one completion (streamed, whole, or as JSON with token ids and stats), and
decode tokens/s at the end (like llama.cpp's timings)."""
from __future__ import annotations

import json
import sys
import time
from typing import Any

from .runtime.preflight import Prepared
from .serve.launcher import init_ray, start_engine  # noqa: F401  (init_ray: bench drivers import it from here)


def generate_cli(prep: Prepared, prompt: str, sampling: dict[str, Any], *, stream: bool = False,
                 as_json: bool = False, print_token_ids: bool = False, save_activation: str | None = None) -> int:
    """Generate one completion of ``prompt`` (sampling: SamplingParams keywords) with the engine of
    an already checked configuration; save_activation: a folder for the engine's activation
    counts of its tokens (``Coordinator.save_activation``)."""
    import ray

    init_ray()
    engine, info = start_engine(prep.config)
    try:
        t0 = time.perf_counter()
        out = _run(engine, prompt, sampling, stream and not as_json, echo=not as_json)
        wall = time.perf_counter() - t0
        load = ray.get(engine.stats.remote())
        saved = ray.get(engine.save_activation.remote(save_activation)) if save_activation else None
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine, no_restart=True)
    share = load["gpu_executor"].get("gpu_activation_share", 0.0)
    if saved is not None:
        print(f"activation counts of {saved['n_tokens']} tokens (mean active fraction "
              f"{saved['mean_active_fraction']:.1%}) written to {saved['path']}", file=sys.stderr)
    if as_json:
        print(json.dumps({"model": info["model"], "policy": info["policy"], "device": info["device"],
                          "prompt": prompt, "prompt_token_ids": out["prompt_token_ids"], "text": out["text"],
                          "token_ids": out["token_ids"], "finish_reason": out["finish_reason"],
                          "stats": {**out["stats"], "wall_s": wall, "primary_activation_share": share}}))
        return 0
    if print_token_ids:
        print(f"token ids: {out['token_ids']}")
    print(_timings(info, out["stats"], wall, share, load["gpu_executor"]), file=sys.stderr)
    return 0


def _run(engine: Any, prompt: str, sampling: dict[str, Any], stream: bool, echo: bool) -> dict[str, Any]:  # noqa: ANN401
    """The engine's result of one generation; the text printed as it comes (stream) or at the end."""
    import ray

    if echo:
        print(prompt, end="", flush=True)
    if not stream:
        out = ray.get(engine.generate.remote(prompt, **sampling))
        if echo:
            print(out["text"])
        return out
    text, ids, last = [], [], {}
    for ref in engine.generate_stream.remote(prompt, **sampling):
        last = ray.get(ref)
        text.append(last["text"])
        ids.extend(last["token_ids"])
        print(last["text"], end="", flush=True)
    print()
    return {"text": "".join(text), "token_ids": ids, "prompt_token_ids": None,
            "finish_reason": last.get("finish_reason"), "stats": last.get("stats") or {}}


def _timings(info: dict[str, Any], stats: dict[str, Any], wall: float, share: float, primary: dict) -> str:
    where = ("GPU share of activated neurons" if info["device"] == "cuda" else
             "primary share of activated neurons (no GPU: the primary ran on the CPU)")
    return (f"\n[{info['model']}] {stats.get('completion_tokens', 0)} tokens in {wall:.2f} s; "
            f"decode {stats.get('decode_tok_s') or 0:.1f} tok/s; time to first token "
            f"{(stats.get('ttft_s') or 0) * 1e3:.0f} ms; {where} {share:.1%}; "
            f"sync {primary.get('per_exchange_sync_us', 0):.0f} us/exchange")
