"""The offline pipeline through the engine, timed: ``profile --engine`` then ``train-predictors
--engine`` on one model, each phase's numbers written to bench/results as soon as it ends.

    python bench/offline_bench.py [-m MODEL] [--as-file DIR] [--corpus builtin] [--phases profile,train] \\
        [--profile-tokens N] [--train-tokens N] [--seq-len 256] [--work-dir DIR] [--train-args "..."] \\
        [--out-dir bench/results] [--name NAME] [engine flags: --vram-budget GIB, -t N, --prefill-chunk N, ...]

    # the embedded tiny model on the CPU, split between the primary and a CPU executor
    python bench/offline_bench.py --vram-budget 0.015 --device cpu --profile-tokens 4096 --train-tokens 4096 \\
        --seq-len 64 --train-args "--heldout-tokens 1024" --name tiny-2c
    # the 13B shape from its file at 16 GiB of VRAM (the GPU host: bench/host_run.sh offline / offtrain)
    python bench/offline_bench.py -m "planted:llama2-13b?dtype=f16" --as-file /dev/shm --vram-budget 16 -t 14 \\
        --prefill-chunk 2048 --phases profile --profile-tokens 300000 --name 13b-16gib-h200

The engine flags are the CLI's (``powerinfer-ray profile --help``, "(with --engine)"); the policy
is always 'oracle', and -c/--n-ctx defaults to --seq-len (no window is longer: a longer KV cache
would only take VRAM from the neurons). ``-m`` takes a model file or a ``planted:`` spec;
train-predictors reads a GGUF file, so a planted model trains only with ``--as-file DIR``
(``model_bench``'s: the model written once to DIR/<shape>.gguf by bench/planted_file.py).
Planted models carry a byte-level tokenizer: any text encodes, the built-in corpus included
(about 2M tokens).

Phase profile: the engine's preflight (the placement solved for the budget) and load, then
``runtime.engine_profile.profile_engine`` over ``--profile-tokens`` tokens of the corpus's
windows, then ``offline.profile.write_profile`` into --work-dir/profile: the functions
``profile --engine`` runs, with the load timed apart. Record (results/profile-<name>.json):
``tokens`` (the profile's own count), ``seconds`` (the whole phase) and ``tok_s`` over it;
``load_s``, and ``run_s`` / ``run_tok_s`` of the windows alone (N tokens take about
load_s + N / run_tok_s); the engine's step counters and this process's memory.

Phase train: ``powerinfer-ray train-predictors --engine`` in this process with the same engine
flags, ``--max-tokens`` = --train-tokens, ``--json`` and --train-args (e.g. "--recall 0.95
--heldout-tokens 4096 --spill-dir /dev/shm/spill"); the model with predictors goes to
--work-dir. Record (results/predictors-<name>.json): ``layers``, ``seconds`` and ``minutes``
(the whole command), ``min_recall`` (held-out, over the layers), ``tokens`` (the training tokens
run), ``fit_s`` (the layers' training alone) and ``report``: the command's own JSON report (per
layer recall, precision, kept and active shares, width).

Each phase prints one summary line. --work-dir defaults to a temporary folder removed at the end.
``powerinfer-ray bench offline ...`` runs this script too.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import GIB, model_source, write_results  # noqa: E402

from powerinfer_ray import cli  # noqa: E402
from powerinfer_ray.runtime.config import (EngineConfig, ExecutorConfig, PlanConfig,  # noqa: E402
                                           SchedulerConfig, exposed_fields)

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("profile", "train")
ENGINE_SKIP = ("policy",)  # always 'oracle': the true activations


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=cli.HelpFormat, allow_abbrev=False)
    ap.add_argument("-m", "--model", default=None, help="GGUF model path or planted:<shape> spec "
                    "(default: the embedded tiny model)")
    ap.add_argument("--as-file", default=None, metavar="DIR",
                    help="a planted model: write it to DIR/<shape>.gguf once (e.g. /dev/shm) and run from it")
    ap.add_argument("--corpus", default="builtin", help=cli.CORPUS_HELP)
    ap.add_argument("--phases", default="profile,train", help="comma-separated, run in this order: profile, train")
    ap.add_argument("--profile-tokens", type=int, default=100_000, help="tokens profiled")
    ap.add_argument("--train-tokens", type=int, default=100_000, help="train-predictors' --max-tokens")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window, both phases")
    ap.add_argument("--train-args", default="", help="more train-predictors flags, one string")
    ap.add_argument("--work-dir", default=None,
                    help="where the profile's files and the model with predictors go (default: a temporary folder)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None, help="results: profile-<name>.json, predictors-<name>.json "
                    "(default: the model's name and the budget)")
    for cls, title in ((PlanConfig, "placement"), (ExecutorConfig, "executors"), (SchedulerConfig, "scheduler")):
        cli.add_config_flags(ap, cls, title + " (the engine's flags)", skip=ENGINE_SKIP)
    return ap


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(a.model, **{f.name: getattr(a, f.name) for f in exposed_fields(EngineConfig)
                                    if f.name not in ENGINE_SKIP})


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags given, as the CLI spells them (for train-predictors)."""
    out: list[str] = []
    for f in exposed_fields(EngineConfig):
        v = getattr(a, f.name, f.default)
        if f.name in ENGINE_SKIP or v == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.metadata["kind"] is bool:
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


def base_record(a: argparse.Namespace, ec: EngineConfig) -> dict[str, Any]:
    """What both phases' records hold: the model, the engine's settings, the corpus."""
    return {"model": a.model, "planted": a.planted, "model_file_gib": a.model_bytes / GIB if a.model_bytes else None,
            "vram_budget_gib": ec.vram_budget_gib, "gpu_fraction": ec.gpu_fraction, "device": ec.device,
            "threads": ec.threads, "prefill_chunk": ec.prefill_chunk, "max_batch": ec.max_batch, "n_ctx": ec.n_ctx,
            "corpus": a.corpus, "seq_len": a.seq_len}


# ------------------------------------------------------------------------------------------------
def profile_phase(a: argparse.Namespace, ec: EngineConfig, work: Path) -> dict[str, Any]:
    """``profile --engine``'s functions, the engine's load timed apart from the windows."""
    from powerinfer_ray.offline.profile import write_profile
    from powerinfer_ray.runtime.engine import LocalEngine
    from powerinfer_ray.runtime.engine_profile import oracle_config, profile_engine
    from powerinfer_ray.runtime.hostmem import process_memory
    from powerinfer_ray.runtime.preflight import prepare

    t0 = time.perf_counter()
    prep = prepare(oracle_config(ec, "activation profiles"))
    for note in prep.notes:
        print(note, file=sys.stderr)
    eng = LocalEngine(prep.config)
    t1 = time.perf_counter()
    try:
        stats = profile_engine(eng, a.corpus, a.profile_tokens, a.seq_len)
        t2 = time.perf_counter()
        st = eng.stats()
    finally:
        eng.close()
    write_profile(stats, work / "profile", plot=False)
    seconds = time.perf_counter() - t0
    primary = st["primary"]
    return {**base_record(a, ec), "device": prep.device, "phase": "profile", "max_tokens": a.profile_tokens,
            "tokens": stats.n_tokens, "seconds": seconds, "tok_s": stats.n_tokens / seconds, "load_s": t1 - t0,
            "run_s": t2 - t1, "run_tok_s": stats.n_tokens / (t2 - t1),
            "active_share": float(stats.active_fraction().mean()), "steps": primary["steps"],
            "exchanges": primary["exchanges"], "layer_s": primary["layer_s"],
            "cpu_busy_s": st["cpu"]["busy_s"] if "cpu" in st else None,
            "process_memory_gib": {k.removesuffix("_bytes"): v / GIB for k, v in process_memory().items()}}


def train_phase(a: argparse.Namespace, ec: EngineConfig, work: Path) -> dict[str, Any]:
    """``powerinfer-ray train-predictors --engine``, as a user runs it; its --json report read back."""
    report, out = work / "predictors-report.json", work / f"{Path(a.model).name.split('.')[0]}.predictors.gguf"
    argv = ["train-predictors", "-m", a.model, a.corpus, "-o", str(out), "--max-tokens", str(a.train_tokens),
            "--seq-len", str(a.seq_len), "--json", str(report), "--engine", *engine_argv(a),
            *shlex.split(a.train_args)]
    t0 = time.perf_counter()
    rc = cli.main(argv)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"powerinfer-ray {shlex.join(argv)} exited with status {rc}")
    r = json.loads(report.read_text())
    recall = [layer["recall"] for layer in r["layers"]]
    return {**base_record(a, ec), "phase": "train", "cli": "powerinfer-ray " + shlex.join(argv),
            "layers": len(r["layers"]), "seconds": seconds, "minutes": seconds / 60, "min_recall": min(recall),
            "min_precision": min(layer["precision"] for layer in r["layers"]), "tokens": r["n_train_tokens"],
            "max_tokens": a.train_tokens, "heldout_tokens": r["n_heldout_tokens"],
            "fit_s": sum(layer["fit"].get("seconds", 0.0) for layer in r["layers"]),
            "target": r["target"], "target_met": r["target_met"], "report": r}


def summary(rec: dict[str, Any]) -> str:
    where = f"at {rec['vram_budget_gib']:g} GiB" if rec["vram_budget_gib"] is not None else "without a budget"
    if rec["phase"] == "profile":
        return (f"profile {rec['model']} {where}: {rec['tokens']} tokens in {rec['seconds']:.1f} s = "
                f"{rec['tok_s']:.0f} tok/s (windows {rec['run_tok_s']:.0f} tok/s after a {rec['load_s']:.1f} s load)")
    return (f"predictors {rec['model']} {where}: {rec['layers']} layers in {rec['minutes']:.2f} min "
            f"(fit {rec['fit_s']:.0f} s), min recall {rec['min_recall']:.4f}, on {rec['tokens']} tokens; "
            f"target {rec['target']}{'' if rec['target_met'] else ' NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise ValueError(f"--phases {a.phases!r}: expected a comma-separated list of {', '.join(PHASES)}")
    if a.model is None:
        from powerinfer_ray.model.default import default_model_path

        a.model = str(default_model_path())
    model_source(a)
    if "train" in phases and a.model.startswith("planted:"):
        raise ValueError(f"-m {a.model}: train-predictors reads a GGUF file; add --as-file DIR (e.g. /dev/shm)")
    from powerinfer_ray.runtime.engine_profile import window_n_ctx

    a.n_ctx = window_n_ctx(a.model, a.seq_len, a.n_ctx)
    ec = engine_config(a)
    name = a.name or Path(a.model.removeprefix("planted:").split("?")[0]).name.split(".")[0] + (
        f"-{ec.vram_budget_gib:g}gib" if ec.vram_budget_gib is not None else "")
    command = "python bench/offline_bench.py " + shlex.join(argv)
    with tempfile.TemporaryDirectory(prefix="offline-bench-") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for phase in phases:
            rec = (profile_phase if phase == "profile" else train_phase)(a, ec, work)
            kind = "profile" if phase == "profile" else "predictors"
            write_results(a.out_dir, f"{kind}-{name}", command, records=[rec])
            print(summary(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
