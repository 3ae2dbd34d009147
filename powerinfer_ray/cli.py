"""The ``powerinfer-ray`` command line: each subcommand parses flags and calls one function.

Flags follow llama.cpp / upstream PowerInfer where they exist (-m, -p, -n, -t, --vram-budget,
--reset-gpu-index, --disable-gpu-index).
"""
from __future__ import annotations

import argparse
import json
import sys


def _model_arg(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-m", "--model", required=required, default=None,
                   help="GGUF model path or planted:<shape> spec (default: the embedded tiny model)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    _model_arg(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU executor threads")
    p.add_argument("--vram-budget", type=float, default=None,
                   help="GPU memory budget in GiB (default: everything on the GPU executor)")
    p.add_argument("--reset-gpu-index", action="store_true", help="re-solve the placement, ignore a cached split")
    p.add_argument("--disable-gpu-index", action="store_true", help="do not read or write a split file")
    p.add_argument("--device", default=None, help="device of the primary executor (cuda or cpu; default: cuda if present)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--no-graphs", action="store_true",
                   help="decode with eager PyTorch instead of CUDA graphs (debugging; slower)")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="powerinfer-ray", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="generate text with the hybrid engine")
    _add_engine_flags(p)
    _sampling_flags(p)
    p.add_argument("-p", "--prompt", default="The meaning of")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="start the OpenAI-compatible Ray Serve app")
    _add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="HF checkpoint -> PowerInfer-compatible GGUF")
    p.add_argument("hf_dir")
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--outtype", choices=("f16", "bf16", "f32", "q8_0", "q4_0"), default="f16")
    p.add_argument("--predictors", default=None, help="folder of upstream model_{l}.pt predictors")
    p.add_argument("--no-pwri", action="store_true", help="keep the plain GGUF magic for sparse models")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("quantize", help="re-store a GGUF/PWRI model's matrices as q8_0 or q4_0 blocks")
    p.add_argument("infile")
    p.add_argument("outfile")
    p.add_argument("type", choices=("q8_0", "q4_0"))
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("inspect", help="print a model file's metadata, config and tensors")
    p.add_argument("model")
    p.add_argument("--tensors", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("profile", help="count per-neuron activations over a corpus")
    _model_arg(p)
    p.add_argument("corpus", help="text file, JSONL (text field) or Parquet (text column)")
    p.add_argument("-o", "--out-dir", required=True)
    p.add_argument("--max-tokens", type=int, default=200_000)
    p.add_argument("--seq-len", type=int, default=256)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("sparsify", help="calibrate per-layer activation thresholds of a SwiGLU model")
    _model_arg(p, required=True)
    p.add_argument("corpus", nargs="?", default=None,
                   help="calibration text: text file, JSONL (text field), Parquet (text column) or builtin")
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--target-sparsity", nargs="+", default=["0.5"],
                   help="share of FFN neurons to skip: one value, or one per layer (0.3,0.4,0.5 ...)")
    p.add_argument("--on", choices=("gate", "h"), default="gate",
                   help="threshold |SiLU(gate)| (computes up/down only for active neurons) or |h|")
    p.add_argument("--thresholds", default=None,
                   help="take the thresholds from this sparsified file of the same model (no corpus)")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=256)
    p.set_defaults(func=cmd_sparsify)

    p = sub.add_parser("train-predictors", help="train per-layer activation predictors")
    _model_arg(p)
    p.add_argument("corpus")
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--recall", type=float, default=0.95, help="recall target at threshold 0")
    p.add_argument("--max-tokens", type=int, default=100_000)
    p.set_defaults(func=cmd_train_predictors)

    p = sub.add_parser("calibrate", help="measure this host's bandwidths and sync cost")
    p.add_argument("-o", "--outfile", default="host-profile.json")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("solve", help="solve the GPU/CPU neuron placement (ILP, cvxpy + HiGHS)")
    _model_arg(p)
    p.add_argument("--activation", required=True, help="activation stats: folder of activation_{l}.pt or a Parquet file")
    p.add_argument("--vram-budget", type=float, required=True, help="GiB")
    p.add_argument("--host-profile", default=None)
    p.add_argument("--method", choices=("ilp", "greedy"), default="ilp")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("-o", "--outfile", default=None, help="default: <model>.generated.gpuidx")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("bench", help="benchmarks: kernels | runtime | hybrid | layer-offload | dense-gpu | cpu-only | sweep")
    p.add_argument("mode")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="flags of the benchmark driver")
    p.set_defaults(func=cmd_bench)
    return ap


# ------------------------------------------------------------------------------------------------
def _resolve_model(spec: str | None) -> str:
    if spec:
        return spec
    from .model.default import default_model_path

    return str(default_model_path())


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(vram_budget_gib=a.vram_budget, threads=a.threads, reset_gpu_index=a.reset_gpu_index,
                disable_gpu_index=a.disable_gpu_index, device=a.device, n_ctx=a.ctx_size,
                max_batch=a.max_batch, graphs=False if a.no_graphs else None)


def cmd_generate(a: argparse.Namespace) -> int:
    from .generate import generate_cli

    return generate_cli(_resolve_model(a.model), a.prompt, a.n_predict, stream=a.stream,
                        sampling=dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed),
                        **_engine_kwargs(a))


def cmd_serve(a: argparse.Namespace) -> int:
    from .serve import serve_cli

    return serve_cli(_resolve_model(a.model), host=a.host, port=a.port, api_key=a.api_key, **_engine_kwargs(a))


def cmd_convert(a: argparse.Namespace) -> int:
    from .offline.convert import convert_hf

    out = convert_hf(a.hf_dir, a.outfile, outtype=a.outtype, predictors_dir=a.predictors,
                     sparse=False if a.no_pwri else None)
    print(f"wrote {out}")
    return 0


def cmd_quantize(a: argparse.Namespace) -> int:
    from .offline.quantize import quantize_file

    print(f"wrote {quantize_file(a.infile, a.outfile, a.type)}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from .model.inspect import describe

    print(describe(a.model, tensors=a.tensors))
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .offline.profile import run_profile

    run_profile(_resolve_model(a.model), a.corpus, a.out_dir, max_tokens=a.max_tokens, seq_len=a.seq_len)
    return 0


def cmd_sparsify(a: argparse.Namespace) -> int:
    from .offline.sparsify import parse_targets, sparsify

    sparsify(a.model, a.corpus, a.outfile, parse_targets(a.target_sparsity), on=a.on,
             max_tokens=a.max_tokens, seq_len=a.seq_len, thresholds_from=a.thresholds)
    return 0


def cmd_train_predictors(a: argparse.Namespace) -> int:
    from .offline.predictors import train_predictors

    train_predictors(_resolve_model(a.model), a.corpus, a.outfile, recall_target=a.recall, max_tokens=a.max_tokens)
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from .offline.calibrate import calibrate_host

    prof = calibrate_host(a.outfile)
    print(json.dumps(prof if isinstance(prof, dict) else getattr(prof, "__dict__", str(prof)), indent=2, default=str))
    return 0


def cmd_solve(a: argparse.Namespace) -> int:
    from .offline.solve import solve_for_model

    solve_for_model(_resolve_model(a.model), a.activation, a.vram_budget, host_profile=a.host_profile,
                    method=a.method, group_size=a.group_size, out=a.outfile)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(a.mode, a.rest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, missing or unwritable files: one clear line
        print(f"powerinfer-ray {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
