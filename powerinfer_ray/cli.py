"""The ``powerinfer-ray`` command line: each subcommand parses flags and calls one function.

Flags follow llama.cpp / upstream PowerInfer where they exist (-m, -p, -n, -t, -c, --vram-budget,
--reset-gpu-index, --disable-gpu-index). The engine's flags are made from its config fields
(``runtime.config``): ``--vram-budget-gib`` is the field ``vram_budget_gib``. A user error prints
one line and exits with status 2 (``--debug``: the traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any



class HelpFormat(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each flag's default, where it has one worth printing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _model_arg(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-m", "--model", required=required, default=None,
                   help="GGUF model path or planted:<shape> spec (default: the embedded tiny model)")


def add_config_flags(p: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    """One flag per exposed field of config class ``cls`` but those in ``skip``: ``--field-name``
    (and the field's llama.cpp spellings), typed, with the field's help and default."""
    from .runtime.config import exposed_fields

    group = p.add_argument_group(title)
    for f in exposed_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        short = [s for s in meta["flags"] if not s.startswith("--")]
        flags = [*short, f"--{f.name.replace('_', '-')}", *(s for s in meta["flags"] if s.startswith("--"))]
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if meta["kind"] is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default is None else "store_true"
        else:
            kw.update(type=meta["kind"], choices=meta["choices"], metavar=None if meta["choices"] else f.name.upper())
        group.add_argument(*flags, **kw)


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
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="0 is greedy (the HTTP API follows OpenAI's default of 1)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of this mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty, [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty, [-2, 2]")


def _engine_flags(p: argparse.ArgumentParser, when: str = "", skip: tuple[str, ...] = ()) -> None:
    """The engine's flags (but ``skip``), in groups whose titles end in ``when``."""
    from .runtime.config import ExecutorConfig, PlanConfig, SchedulerConfig

    for cls, title in ((PlanConfig, "placement"), (ExecutorConfig, "executors"), (SchedulerConfig, "scheduler")):
        add_config_flags(p, cls, title + when, skip)


def _offline_engine_flags(p: argparse.ArgumentParser, what: str, skip: tuple[str, ...] = ()) -> None:
    """--engine (``what`` through the hybrid engine) and the engine's flags, but ``skip``: flags
    of the command's own, which the engine takes too."""
    p.add_argument("--engine", action="store_true",
                   help=f"{what} through the hybrid engine (policy oracle, placed by the engine flags below, e.g. "
                        "--vram-budget-gib): for models larger than one device. Default: the dense model on one "
                        "device")
    _engine_flags(p, " (with --engine)", skip)


def build_parser() -> argparse.ArgumentParser:
    from .bench import DRIVERS, MODEL_MODES
    from .serve.config import IngressConfig, ReplicaConfig

    ap = argparse.ArgumentParser(prog="powerinfer-ray", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def cmd(name: str, func: Any, help: str) -> argparse.ArgumentParser:  # noqa: A002, ANN401
        sp = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormat)
        sp.set_defaults(func=func)
        return sp

    p = cmd("generate", cmd_generate, "generate text with the hybrid engine")
    p.add_argument("-p", "--prompt", default="The meaning of", help="prompt text")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")
    p.add_argument("--print-token-ids", action="store_true", help="print the generated token ids after the text")
    p.add_argument("--save-activation", default=None, metavar="DIR",
                   help="write the engine's activation counts of the prompt and the generated tokens to DIR "
                        "(what solve --activation reads; policies oracle and predictor)")
    _sampling_flags(p)
    _model_arg(p)
    _engine_flags(p)

    p = cmd("serve", cmd_serve, "start the OpenAI-compatible Ray Serve app")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all; then set --api-key)")
    p.add_argument("--port", type=int, default=8000)
    add_config_flags(p, IngressConfig, "HTTP")
    add_config_flags(p, ReplicaConfig, "replicas (scale-out over the GPUs and nodes of the Ray cluster)")
    _model_arg(p)
    _engine_flags(p)

    p = cmd("convert", cmd_convert, "HF checkpoint -> PowerInfer-compatible GGUF")
    p.add_argument("hf_dir")
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--outtype", choices=("f16", "bf16", "f32", "q8_0", "q4_0"), default="f16")
    p.add_argument("--predictors", default=None, help="folder of upstream model_{l}.pt predictors")
    p.add_argument("--no-pwri", action="store_true", help="keep the plain GGUF magic for sparse models")

    p = cmd("quantize", cmd_quantize, "re-store a GGUF/PWRI model's matrices as q8_0 or q4_0 blocks")
    p.add_argument("infile")
    p.add_argument("outfile")
    p.add_argument("type", choices=("q8_0", "q4_0"))

    p = cmd("inspect", cmd_inspect, "print a model file's metadata, config and tensors")
    p.add_argument("model")
    p.add_argument("--tensors", action="store_true")

    p = cmd("profile", cmd_profile, "count per-neuron activations over a corpus")
    _model_arg(p)
    p.add_argument("corpus", help=CORPUS_HELP)
    p.add_argument("-o", "--out-dir", required=True)
    p.add_argument("--max-tokens", type=int, default=200_000)
    _stream_flags(p)
    _offline_engine_flags(p, "run the windows")

    p = cmd("sparsify", cmd_sparsify, "calibrate per-layer activation thresholds of a SwiGLU model")
    _model_arg(p, required=True)
    p.add_argument("corpus", nargs="?", default=None, help="calibration text: " + CORPUS_HELP)
    p.add_argument("-o", "--outfile", required=True)
    p.add_argument("--target-sparsity", nargs="+", default=["0.5"],
                   help="share of FFN neurons to skip: one value, or one per layer (0.3,0.4,0.5 ...)")
    p.add_argument("--on", choices=("gate", "h"), default="gate",
                   help="threshold |SiLU(gate)| (computes up/down only for active neurons) or |h|")
    p.add_argument("--thresholds", default=None,
                   help="take the thresholds from this sparsified file of the same model (no corpus)")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=256)

    p = cmd("train-predictors", cmd_train_predictors, "train per-layer activation predictors for a quality target")
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
                   help="all predictors together at most this share of the model's bytes")
    p.add_argument("--memory-cap-mb", type=int, default=256,
                   help="training samples held in memory; beyond it they spill to disk")
    p.add_argument("--spill-dir", default=None, help="where samples spill (default: a temporary folder)")
    p.add_argument("--device", default=None,
                   help="cuda or cpu: where predictors train and the held-out check runs the dense model (default: "
                        "cuda if present); with --engine also the engine's primary executor")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    _stream_flags(p)
    _offline_engine_flags(p, "collect the training samples (every step dense on the primary; the held-out check "
                          "still runs the dense model on --device)", skip=("device",))

    p = cmd("quality", cmd_quality, "perplexity and top-1 agreement of the sparse model against dense on a text")
    _model_arg(p)
    p.add_argument("text", help=CORPUS_HELP)
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens (default: all)")
    p.add_argument("--margin", type=float, default=0.0,
                   help="predictor margin: decide at the file's threshold minus this (> 0 keeps more neurons)")
    p.add_argument("--predictor-qtype", default=None, choices=("q8_0", "q4_0"),
                   help="score float predictors as the engine holds them quantized to these blocks "
                   "(the engine's predictor_qtype)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    _stream_flags(p)

    p = cmd("calibrate", cmd_calibrate, "measure this host's bandwidths and sync cost")
    p.add_argument("-o", "--outfile", default="host-profile.json")

    p = cmd("solve", cmd_solve, "solve the GPU/CPU neuron placement (ILP, cvxpy + HiGHS)")
    _model_arg(p)
    p.add_argument("--activation", required=True, help="activation stats: folder of activation_{l}.pt or a Parquet file")
    p.add_argument("--vram-budget-gib", "--vram-budget", dest="vram_budget_gib", type=float, required=True,
                   help="GPU memory for the model, GiB")
    p.add_argument("--host-profile", default=None)
    p.add_argument("--method", choices=("ilp", "greedy"), default="ilp")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("-o", "--outfile", default=None, help="default: <model>.generated.gpuidx")

    modes = sorted(DRIVERS) + list(MODEL_MODES)
    p = cmd("bench", cmd_bench, "benchmarks (from a source checkout): " + " | ".join(modes))
    p.add_argument("mode", choices=modes)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="flags of the benchmark driver")
    return ap


# ------------------------------------------------------------------------------------------------
def _resolve_model(spec: str | None) -> str:
    if spec:
        return spec
    from .model.default import default_model_path

    return str(default_model_path())


def _prepared(a: argparse.Namespace):  # noqa: ANN202  (runtime.preflight.Prepared)
    """The engine's config from the flags, checked against the model and this host before Ray."""
    from .runtime.config import EngineConfig, exposed_fields
    from .runtime.preflight import prepare
    from .serve.launcher import joins_cluster

    ec = EngineConfig(_resolve_model(a.model), **{f.name: getattr(a, f.name) for f in exposed_fields(EngineConfig)})
    prep = prepare(ec, local_gpu_check=not joins_cluster())
    for note in prep.notes:
        print(note, file=sys.stderr)
    return prep


def cmd_generate(a: argparse.Namespace) -> int:
    from .generate import generate_cli
    from .runtime.sampling import SamplingParams

    if a.n_predict < 1:
        raise ValueError(f"-n/--n-predict={a.n_predict}: expected an integer >= 1 (tokens to generate)")
    sampling = dict(max_tokens=a.n_predict, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                    presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty)
    SamplingParams.from_kwargs(**sampling)  # its checks, before Ray
    prep = _prepared(a)
    prep.prompt_ids(a.prompt, a.n_predict)
    if a.save_activation:
        from .runtime.activity import check_counted

        check_counted(prep.policy)
    save = os.path.abspath(a.save_activation) if a.save_activation else None  # the engine actor's cwd may differ
    return generate_cli(prep, a.prompt, sampling, stream=a.stream, as_json=a.json, print_token_ids=a.print_token_ids,
                        save_activation=save)


def cmd_serve(a: argparse.Namespace) -> int:
    from .serve.config import IngressConfig, ReplicaConfig, serving
    from .serve.launcher import serve_cli

    ingress, replicas = (cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)})
                         for cls in (IngressConfig, ReplicaConfig))
    return serve_cli(serving(_prepared(a).config), host=a.host, port=a.port, replicas=replicas,
                     **dataclasses.asdict(ingress))


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


def _offline_engine(a: argparse.Namespace, own: tuple[str, ...] = ()):  # noqa: ANN202  (EngineConfig | None)
    """With --engine: the engine's config from its flags, under policy oracle (the true activity);
    without: None, and no engine flag may be given but the command's ``own``."""
    from .runtime.config import EngineConfig, exposed_fields

    if not a.engine:
        for f in exposed_fields(EngineConfig):
            if f.name not in own and getattr(a, f.name) != f.default:
                raise ValueError(f"--{f.name.replace('_', '-')} is an engine flag: add --engine to run {a.cmd} "
                                 "through the engine, or leave it out")
        return None
    if a.policy not in (None, "oracle"):
        raise ValueError(f"--policy {a.policy}: {a.cmd} --engine needs the true activity (policy oracle); "
                         "leave --policy out")
    a.policy = "oracle"
    from .runtime.engine_profile import window_n_ctx

    a.n_ctx = window_n_ctx(_resolve_model(a.model), a.seq_len, a.n_ctx)
    return _prepared(a).config


def cmd_profile(a: argparse.Namespace) -> int:
    from .offline.profile import run_profile

    ec = _offline_engine(a)
    if ec is not None:
        from .runtime.engine_profile import run_engine_profile

        run_engine_profile(ec, a.corpus, a.out_dir, max_tokens=a.max_tokens, seq_len=a.seq_len, fmt=_stream_format(a))
        return 0
    run_profile(_resolve_model(a.model), a.corpus, a.out_dir, max_tokens=a.max_tokens, seq_len=a.seq_len,
                fmt=_stream_format(a))
    return 0


def cmd_sparsify(a: argparse.Namespace) -> int:
    from .offline.sparsify import parse_targets, sparsify

    sparsify(a.model, a.corpus, a.outfile, parse_targets(a.target_sparsity), on=a.on,
             max_tokens=a.max_tokens, seq_len=a.seq_len, thresholds_from=a.thresholds)
    return 0


def cmd_train_predictors(a: argparse.Namespace) -> int:
    from .offline.predictors import train_predictors
    from .offline.thresholds import parse_fraction, quality_target

    if a.recall is not None and (a.max_ppl_increase is not None or a.min_top1 is not None):
        raise ValueError("--recall chooses thresholds by recall: give it without --max-ppl-increase / --min-top1")
    target = None if a.recall is not None else quality_target(a.max_ppl_increase, a.min_top1)
    ec, collect = _offline_engine(a, own=("device",)), None
    if ec is not None:
        from .runtime.engine_samples import engine_collector

        collect = engine_collector(ec)
    r = train_predictors(_resolve_model(a.model), a.corpus, a.outfile, heldout=a.heldout, target=target,
                         recall_target=a.recall or 0.99, max_tokens=a.max_tokens, heldout_tokens=a.heldout_tokens,
                         seq_len=a.seq_len, fmt=_stream_format(a), max_width=a.max_width,
                         max_predictor_share=parse_fraction(a.max_predictor_share, "--max-predictor-share"),
                         memory_cap=a.memory_cap_mb << 20, spill_dir=a.spill_dir, device=a.device, collect=collect)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r.to_dict(), fh, indent=1)
    print(f"wrote {r.path}")
    return 0


def cmd_quality(a: argparse.Namespace) -> int:
    from .offline.quality import format_report, quality_report

    r = quality_report(_resolve_model(a.model), a.text, seq_len=a.seq_len, max_tokens=a.max_tokens,
                       device=a.device, margin=a.margin, fmt=_stream_format(a), predictor_qtype=a.predictor_qtype)
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

    solve_for_model(_resolve_model(a.model), a.activation, a.vram_budget_gib, host_profile=a.host_profile,
                    method=a.method, group_size=a.group_size, out=a.outfile)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(a.mode, a.rest)


def user_error(exc: BaseException) -> str | None:
    """The one line a user error prints (bad input, a missing file, inside a Ray error too);
    None for anything else (a bug: its traceback is worth more)."""
    from .serve.launcher import actor_cause

    cause = actor_cause(exc)
    if not isinstance(cause, (ValueError, OSError)):
        return None
    return " ".join(line.strip() for line in str(cause).splitlines() if line.strip()) or type(cause).__name__


def check_outfile(path: str | None) -> None:
    """Refuse an output file whose folder does not exist before any work (a long command would
    otherwise lose what it computed at the end)."""
    if path and not Path(path).resolve().parent.is_dir():
        raise ValueError(f"-o {path}: the folder {Path(path).resolve().parent} does not exist; create it or "
                         "choose another path")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outfile(getattr(args, "outfile", None))
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001  (user errors: one line; anything else re-raised)
        line = None if args.debug else user_error(exc)
        if line is None:
            raise
        print(f"powerinfer-ray {args.cmd}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
