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


CORPUS_HELP = ("a text file (one document, blank lines kept), a folder of text files (one document "
               "each), JSONL (field 'text' per line) or Parquet (column 'text'), each record a document, "
               "or builtin[:pydoc|:stdlib][:train|:heldout] (the shipped corpus). Documents are "
               "tokenized into one stream, joined as --doc-sep says, and cut into windows of --seq-len")


def _stream_flags(p: argparse.ArgumentParser) -> None:
    from .offline.stream import DOC_SEPS

    p.add_argument("--doc-sep", choices=DOC_SEPS, default=None,
                   help="what goes between two documents of the token stream (default: how the model "
                        "file says it was trained, else BOS when its tokenizer adds BOS, else EOS)")
    p.add_argument("--window-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="start every window with BOS (default: as the model file says, else when its "
                        "tokenizer adds BOS)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")


def _stream_format(a: argparse.Namespace):  # noqa: ANN202
    from .offline.stream import StreamFormat

    return StreamFormat(a.doc_sep, a.window_bos)


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
    p.add_argument("--outtype", choices=("f16", "bf16", "f32"), default="f16")
    p.add_argument("--predictors", default=None, help="folder of upstream model_{l}.pt predictors")
    p.add_argument("--no-pwri", action="store_true", help="keep the plain GGUF magic for sparse models")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="print a model file's metadata, config and tensors")
    p.add_argument("model")
    p.add_argument("--tensors", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("profile", help="count per-neuron activations over a corpus")
    _model_arg(p)
    p.add_argument("corpus", help=CORPUS_HELP)
    p.add_argument("-o", "--out-dir", required=True)
    p.add_argument("--max-tokens", type=int, default=200_000)
    _stream_flags(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("train-predictors", help="train per-layer activation predictors for a quality target")
    _model_arg(p)
    p.add_argument("corpus", help=CORPUS_HELP)
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--heldout", default=None,
                   help="text the thresholds are chosen and reported on (same forms as the corpus; "
                        "default: the corpus's last documents)")
    p.add_argument("--heldout-tokens", type=int, default=8192, help="held-out tokens at most")
    p.add_argument("--max-ppl-increase", default=None,
                   help="the threshold is chosen so that held-out perplexity stays within this of dense "
                        "('none': no limit; without this flag and --min-top1: 0.5%% and 99%%)")
    p.add_argument("--min-top1", default=None,
                   help="and so that held-out top-1 agreement with dense is at least this (e.g. 99%%)")
    p.add_argument("--recall", type=float, default=None,
                   help="instead of a quality target: the threshold at which every layer reaches this "
                        "held-out recall")
    p.add_argument("--max-tokens", type=int, default=100_000, help="training tokens")
    p.add_argument("--max-width", type=int, default=None, help="widest predictor (hidden units) of a layer")
    p.add_argument("--max-predictor-share", default="20%",
                   help="all predictors together at most this share of the model's bytes (default 20%%)")
    p.add_argument("--memory-cap-mb", type=int, default=256,
                   help="training samples held in memory; beyond it they spill to disk")
    p.add_argument("--spill-dir", default=None, help="where samples spill (default: a temporary folder)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    _stream_flags(p)
    p.set_defaults(func=cmd_train_predictors)

    p = sub.add_parser("quality", help="perplexity and top-1 agreement of the sparse model against dense on a text")
    _model_arg(p)
    p.add_argument("text", help=CORPUS_HELP)
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens (default: all)")
    p.add_argument("--margin", type=float, default=0.0,
                   help="predictor margin: decide at the file's threshold minus this (> 0 keeps more neurons)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    _stream_flags(p)
    p.set_defaults(func=cmd_quality)

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


def cmd_inspect(a: argparse.Namespace) -> int:
    from .model.inspect import describe

    print(describe(a.model, tensors=a.tensors))
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .offline.profile import run_profile

    run_profile(_resolve_model(a.model), a.corpus, a.out_dir, max_tokens=a.max_tokens, seq_len=a.seq_len,
                fmt=_stream_format(a))
    return 0


def cmd_train_predictors(a: argparse.Namespace) -> int:
    from .offline.predictors import train_predictors
    from .offline.thresholds import parse_fraction, quality_target

    if a.recall is not None and (a.max_ppl_increase is not None or a.min_top1 is not None):
        raise ValueError("--recall chooses thresholds by recall: give it without --max-ppl-increase / --min-top1")
    target = None if a.recall is not None else quality_target(a.max_ppl_increase, a.min_top1)
    r = train_predictors(_resolve_model(a.model), a.corpus, a.outfile, heldout=a.heldout, target=target,
                         recall_target=a.recall or 0.99, max_tokens=a.max_tokens, heldout_tokens=a.heldout_tokens,
                         seq_len=a.seq_len, fmt=_stream_format(a), max_width=a.max_width,
                         max_predictor_share=parse_fraction(a.max_predictor_share, "--max-predictor-share"),
                         memory_cap=a.memory_cap_mb << 20, spill_dir=a.spill_dir, device=a.device)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r.to_dict(), fh, indent=1)
    print(f"wrote {r.path}")
    return 0


def cmd_quality(a: argparse.Namespace) -> int:
    from .offline.quality import format_report, quality_report

    r = quality_report(_resolve_model(a.model), a.text, seq_len=a.seq_len, max_tokens=a.max_tokens,
                       device=a.device, margin=a.margin, fmt=_stream_format(a))
    print(format_report(r))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=1)
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
