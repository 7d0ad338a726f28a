#!/usr/bin/env python3
"""Quality evidence: SparQ vs dense vs the exact top-k oracle and the window baseline, on real GGUF models.

    python bench/quality.py                      # full mode, SmolLM2 and Gemma-3 (about an hour on 2 cores)
    python bench/quality.py --model smollm2 --quick

For each model: bench/results/quality_<model>[_<mode>].json (machine, commit, command, every per-example
record, summaries with standard errors, selection agreement, the target checks), a markdown table next to
it (.md) and a plot (.png: each metric vs transfer ratio with ±1 SE bands, per-layer agreement).
Resumable: run the same command again after an interruption and it continues. The commit recorded is the
one checked out when the run started (with `dirty` if the tree had changes).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import sparq_llama  # noqa: F401  (before llama_cpp)
from record import RESULTS, provenance
from sparq_llama.eval import PRESETS, EvalConfig, report, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="smollm2 / gemma3 (repeatable; default: both)")
    ap.add_argument("--mode", default="full", choices=tuple(PRESETS),
                    help="full: every setting; index: the index and selection against the paper's (1/4, 1/8); "
                         "budget: k2 at 1/8; long: 16k retrieval; quick: the test suite's")
    ap.add_argument("--quick", dest="mode", action="store_const", const="quick", help="same as --mode quick")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--fresh", action="store_true", help="discard earlier partial results")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the .md table and .png plot from the existing JSON (no model runs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.render:
        for model in args.model or ["smollm2", "gemma3"]:
            out = Path(args.out_dir) / (f"quality_{model}" + ("" if args.mode == "full" else f"_{args.mode}") + ".json")
            render(model, args.mode, json.loads(out.read_text()), out)
        return 0
    prov = provenance("quality")    # the code that produces the numbers, read before it runs
    for model in args.model or ["smollm2", "gemma3"]:
        stem = f"quality_{model}" + ("" if args.mode == "full" else f"_{args.mode}")
        out = Path(args.out_dir) / f"{stem}.json"
        cfg = EvalConfig.preset(model, args.mode, n_threads=args.threads)
        t0 = time.time()
        data = run(cfg, out, fresh=args.fresh)
        data.update(prov, mode=args.mode, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    wall_s_this_run=round(time.time() - t0, 1), targets=report.targets(data))
        out.write_text(json.dumps(data, indent=1))
        render(model, args.mode, data, out)
    return 0


def render(model: str, mode: str, data: dict, out: Path) -> None:
    """The markdown table (.md) and the plot (.png) next to the JSON; the table is printed too."""
    table = report.markdown(data)
    commit = (data.get("git") or {}).get("commit") or data.get("commit", "unknown")
    out.with_suffix(".md").write_text(f"# Quality: {model} ({mode})\n\nFrom `{out.name}` (commit "
                                      f"{commit[:10]}, {data.get('date', '')}).\n\n{table}\n")
    report.plot(data, out.with_suffix(".png"))
    print(f"\n## {model}\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
