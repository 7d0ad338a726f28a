#!/usr/bin/env python3
"""End-to-end decode speed, dense vs SparQ, with llama-bench at growing context depths.

Runs the installed llama-bench twice on the same model and threads (dense, then SparQ for each k1), e.g.

    llama-bench -m SmolLM2.gguf -p 0 -n 64 -d 0,2048,4096,8192 -sparq 0 -fa 1 -t 2 -r 3 -o json
    llama-bench -m SmolLM2.gguf -p 0 -n 64 -d 0,2048,4096,8192 -sparq 1 -k1 8,16 -k2 128 -fa 1 -t 2 -r 3 -o json

(two commands, because one `-sparq 0,1 -k1 8,16` would measure the dense rows once per k1), and derives
per depth: decode tokens/s, each k1's speedup over dense, and two model predictions of it:

* attention only: `transfer_ratio(n_kv=depth, head_dim, k1, k2, mean)`, the paper's data-transfer ratio of
  the attention step (1 where depth <= k2: SparQ attends to every cell there). Overstates end-to-end speed,
  since the weights are read at every step whatever the context.
* end to end: a dense step takes t0 + c * depth (least-squares fit of the dense rows: t0 the context-free
  part, c the per-cell attention cost); SparQ divides the attention part by the transfer ratio, so its
  step takes t0 + c * depth / ratio.

Writes bench/results/decode_cpu.json (machine, commit, commands, llama-bench's raw JSON, derived table)
and bench/results/decode_cpu.png (speedup vs depth: measured points per k1, the model curves).

    .venv/bin/python bench/decode_cpu.py [--depths 0,2048,4096,8192] [--k1 0] [--k2 128] [--threads 2]
    .venv/bin/python bench/decode_cpu.py --cache-type q8_0      # both runs with q8_0 K and V caches
    .venv/bin/python bench/decode_cpu.py --min-kv-crossover   # short depths, SparQ forced on: where it starts to pay
    .venv/bin/python bench/decode_cpu.py --from-json bench/results/decode_cpu.json   # plot again

--min-kv-crossover measures where SparQ starts to pay on this machine (the --sparq-min-kv default): depths
256..2048, the index's default k1, -sparq-min-kv 0, 32 generated tokens, into bench/results/decode_cpu_min_kv.json
(+ .png).

The plot needs matplotlib: pip install 'sparq-llama[bench]' (or matplotlib).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from record import RESULTS, provenance
from sparq_llama import models
from sparq_llama.sparq import DEFAULT_INDEX, DEFAULT_SELECT, INDEXES, SELECTS, default_k1, transfer_ratio

log = logging.getLogger("decode_cpu")
HEAD_DIM = {"smollm2": 64, "gemma3": 256}  # attention head size of the models in sparq_llama.models

Row = dict[str, Any]


# ---------------------------------------------------------------------------------------------------
# Running llama-bench


def find_llama_bench(explicit: str | None) -> Path:
    """llama-bench: the given path, else the one next to this interpreter (the venv), else on PATH."""
    if explicit:
        return Path(explicit)
    beside = Path(sys.executable).parent / "llama-bench"
    if beside.is_file():
        return beside
    found = shutil.which("llama-bench")
    if found is None:
        raise FileNotFoundError("llama-bench not found next to this Python nor on PATH: install sparq-llama "
                                "(make install) or pass --llama-bench")
    return Path(found)


def resolve_model(model: str, head_dim: int | None) -> tuple[str, Path, int]:
    """(name, GGUF path, head_dim) for a model name of sparq_llama.models or a path to a GGUF file."""
    if model in models.MODELS:
        return model, models.fetch(model), head_dim or HEAD_DIM[model]
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"--model {model!r} is neither a known model ({', '.join(models.MODELS)}) "
                                f"nor a file")
    if head_dim is None:
        raise ValueError(f"--model {model} is a file: give its attention head size with --head-dim")
    return path.stem, path, head_dim


def _csv(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def bench_commands(exe: Path, model_path: Path, args: argparse.Namespace) -> list[list[str]]:
    """The dense command and the SparQ command (all k1 values)."""
    common = [str(exe), "-m", str(model_path), "-p", "0", "-n", str(args.n_gen), "-d", _csv(args.depths),
              "-fa", "1", "-t", str(args.threads), "-r", str(args.reps), "-o", "json", "--progress",
              "-ctk", args.cache_type, "-ctv", args.cache_type]
    dense = [*common, "-sparq", "0"]
    sparq = [*common, "-sparq", "1", "-k1", _csv(args.k1), "-k2", str(args.k2), "-sparq-index", args.index,
             "-sparq-select", args.select]
    if args.min_kv is not None:
        sparq += ["-sparq-min-kv", str(args.min_kv)]
    return [dense, sparq]


def run_llama_bench(cmd: list[str]) -> list[Row]:
    """Run one llama-bench command; its progress goes to the log, its JSON output is returned."""
    log.info("running: %s", " ".join(cmd))
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        tail: list[str] = []
        for line in proc.stderr:
            log.info("  %s", line.rstrip())
            tail = (tail + [line])[-20:]
        if proc.wait() != 0:
            raise RuntimeError(f"llama-bench exited with {proc.returncode}:\n{''.join(tail)}")
        out.seek(0)
        text = out.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no valid JSON ({e}): {text[:500]!r}") from None


# ---------------------------------------------------------------------------------------------------
# Deriving the table


def attention_ratio(n_kv: int, head_dim: int, k1: int, k2: int, mean: bool, index: str = "f16",
                    kv_type: str = "f16") -> float:
    """Dense / SparQ KV bytes of one attention step; 1 where SparQ keeps every cell (n_kv <= k2)."""
    return 1.0 if n_kv <= k2 else transfer_ratio(n_kv, head_dim, k1, k2, mean=mean, index=index, kv_type=kv_type)


def _is_sparq(row: Row) -> bool:
    value = row.get("sparq", 0)
    return value.lower() in ("1", "true", "on") if isinstance(value, str) else bool(value)


def _samples(rows: list[Row]) -> list[float]:
    """Tokens/s of every repetition of these rows (duplicate configurations pooled)."""
    out: list[float] = []
    for r in rows:
        out.extend(float(x) for x in r.get("samples_ts") or [r["avg_ts"]])
    return out


def group_rows(raw: list[Row], head_dim: int, index: str = "f16"
               ) -> tuple[dict[int, list[float]], dict[tuple[int, int], list[float]]]:
    """Decode tokens/s samples: dense by depth, SparQ by (k1, depth). Prompt-only rows are skipped."""
    dense: dict[int, list[Row]] = {}
    sparq: dict[tuple[int, int], list[Row]] = {}
    for r in raw:
        if int(r.get("n_gen", 0)) <= 0 or int(r.get("n_prompt", 0)) != 0:
            continue
        depth = int(r.get("n_depth", 0))
        if _is_sparq(r):
            k1 = int(r.get("k1") or 0) or default_k1(head_dim, index)  # 0: the default
            sparq.setdefault((k1, depth), []).append(r)
        else:
            dense.setdefault(depth, []).append(r)
    return ({d: _samples(rs) for d, rs in dense.items()},
            {key: _samples(rs) for key, rs in sparq.items()})


def fit_dense(dense: dict[int, list[float]]) -> dict[str, float] | None:
    """Least-squares fit of the dense step time, t = t0 + c * depth (seconds); None with < 2 depths."""
    points = [(d, 1.0 / statistics.mean(ts)) for d, ts in sorted(dense.items())]
    if len(points) < 2:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    c = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    t0 = my - c * mx
    if t0 <= 0 or c <= 0:
        log.warning("dense step times do not fit t0 + c * depth with t0, c > 0 (t0=%.3g s, c=%.3g s): "
                    "no end-to-end model", t0, c)
        return None
    return {"t0_ms": 1e3 * t0, "per_kcell_ms": 1e6 * c}


def e2e_speedup(fit: dict[str, float] | None, depth: int, ratio: float) -> float | None:
    """Predicted end-to-end speedup: (t0 + c*depth) / (t0 + c*depth / ratio)."""
    if fit is None:
        return None
    t0, attn = fit["t0_ms"], fit["per_kcell_ms"] * depth / 1e3
    return (t0 + attn) / (t0 + attn / ratio)


def _mean_sd(ts: list[float]) -> tuple[float, float]:
    return statistics.mean(ts), (statistics.stdev(ts) if len(ts) > 1 else 0.0)


def derive(raw: list[Row], params: dict[str, Any]) -> dict[str, Any]:
    """The derived table: one row per (k1, depth) with dense and SparQ tokens/s, speedup, model ratios."""
    head_dim, k2, mean = params["head_dim"], params["k2"], params["mean"]
    index, kv_type = params.get("index", "f16"), params.get("cache_type", "f16")
    dense, sparq = group_rows(raw, head_dim, index)
    fit = fit_dense(dense)
    table = []
    for (k1, depth), ts in sorted(sparq.items()):
        if depth not in dense:
            log.warning("no dense measurement at depth %d: k1=%d skipped there", depth, k1)
            continue
        d_ts, d_sd = _mean_sd(dense[depth])
        s_ts, s_sd = _mean_sd(ts)
        ratio = attention_ratio(depth, head_dim, k1, k2, mean, index, kv_type)
        table.append({"depth": depth, "k1": k1, "k2": k2, "dense_ts": d_ts, "dense_sd": d_sd, "sparq_ts": s_ts,
                      "sparq_sd": s_sd, "speedup": s_ts / d_ts, "theory_attention": ratio,
                      "theory_e2e": e2e_speedup(fit, depth, ratio)})
    return {"fit": fit, "table": table}


def format_table(table: list[Row]) -> str:
    lines = [(f"{'depth':>6s} {'k1':>3s} {'dense t/s':>10s} {'SparQ t/s':>10s} {'speedup':>8s} "
              f"{'attn model':>10s} {'e2e model':>9s}")]
    for r in table:
        e2e = f"{r['theory_e2e']:8.2f}x" if r["theory_e2e"] is not None else f"{'-':>9s}"
        lines.append(f"{r['depth']:6d} {r['k1']:3d} {r['dense_ts']:10.2f} {r['sparq_ts']:10.2f} "
                     f"{r['speedup']:7.2f}x {r['theory_attention']:9.2f}x {e2e}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Recording and plotting


def _theory_grid(max_depth: int, k2: int) -> list[int]:
    step = max(1, max_depth // 200)
    return sorted({0, k2, k2 + 1, *range(0, max_depth + 1, step), max_depth})


def plot(result: dict[str, Any], path: Path) -> bool:
    """Speedup vs depth: measured points (error bars: one sd) and the two model curves per k1."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.error("matplotlib is missing, no plot written: pip install 'sparq-llama[bench]' (or matplotlib), "
                  "then: python bench/decode_cpu.py --from-json <json>")
        return False
    p, table, fit = result["params"], result["table"], result["fit"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    max_depth = max([r["depth"] for r in table] + [p["k2"] + 1])
    grid = _theory_grid(max_depth, p["k2"])
    for i, k1 in enumerate(sorted({r["k1"] for r in table})):
        color = f"C{i}"
        rows = [r for r in table if r["k1"] == k1]
        err = [r["speedup"] * ((r["sparq_sd"] / r["sparq_ts"]) ** 2 + (r["dense_sd"] / r["dense_ts"]) ** 2) ** 0.5
               for r in rows]
        ax.errorbar([r["depth"] for r in rows], [r["speedup"] for r in rows], yerr=err, fmt="o-", color=color,
                    capsize=3, label=f"measured, k1={k1}")
        ratios = [attention_ratio(d, p["head_dim"], k1, p["k2"], p["mean"], p.get("index", "f16"),
                                  p.get("cache_type", "f16")) for d in grid]
        ax.plot(grid, ratios, "--", color=color, alpha=0.7, label=f"attention transfer ratio, k1={k1}")
        if fit is not None:
            ax.plot(grid, [e2e_speedup(fit, d, r) for d, r in zip(grid, ratios)], ":", color=color,
                    label=f"end-to-end model, k1={k1}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(f"context depth (KV cells before the {p['n_gen']} generated tokens)")
    ax.set_ylabel("decode speedup over dense (×)")
    m = result.get("machine", {})
    ax.set_title(f"SparQ decode, {p['model']} (d={p['head_dim']}, k2={p['k2']}, {p.get('index', 'f16')} index, "
                 f"{p.get('cache_type', 'f16')} cache), {p['threads']} threads\n"
                 f"{m.get('cpu', '')}, {m.get('usable_cores', '?')} cores", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log.info("wrote %s", path)
    return True


# ---------------------------------------------------------------------------------------------------
# Command line


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=models.DEFAULT_MODEL,
                    help=f"a model of sparq_llama.models ({', '.join(models.MODELS)}) or a GGUF path")
    ap.add_argument("--head-dim", type=int, help="attention head size (default: known for the named models)")
    ap.add_argument("--mean", action="store_true",
                    help="the model has mean-value reallocation on (MHA); off for GQA models like SmolLM2")
    ap.add_argument("--depths", type=_ints, default=[0, 2048, 4096, 8192], help="context depths (-d)")
    ap.add_argument("--k1", type=_ints, default=[0], help="SparQ k1 values (0: the library's default for the index)")
    ap.add_argument("--k2", type=int, default=128, help="SparQ k2")
    ap.add_argument("--index", choices=INDEXES, default=DEFAULT_INDEX, help="SparQ's key index (-sparq-index)")
    ap.add_argument("--select", choices=SELECTS, default=DEFAULT_SELECT, help="SparQ's selection (-sparq-select)")
    ap.add_argument("--cache-type", default="f16", choices=("f16", "q8_0", "q4_0"),
                    help="K and V cache type (-ctk/-ctv), dense and SparQ alike; not f16: results named "
                         "decode_cpu_<type>.json")
    ap.add_argument("--min-kv", type=int, default=None,
                    help="SparQ dense below this many cells (-sparq-min-kv; default: the library's measured default)")
    ap.add_argument("--n-gen", type=int, default=64, help="tokens generated per measurement (-n)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (-t)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (-r)")
    ap.add_argument("--llama-bench", help="llama-bench binary (default: next to this Python, else on PATH)")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_cpu.json", help="JSON written")
    ap.add_argument("--png", type=Path, help="plot written (default: the JSON's path with .png)")
    ap.add_argument("--min-kv-crossover", action="store_true",
                    help="the crossover run: --depths 256,512,1024,2048 --k1 0 --min-kv 0 --n-gen 32, written to "
                         "decode_cpu_min_kv.json / .png")
    ap.add_argument("--from-json", type=Path, metavar="JSON",
                    help="do not run anything: derive and plot again from this earlier result")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    if args.cache_type != "f16" and args.out == RESULTS / "decode_cpu.json":
        args.out, args.png = RESULTS / f"decode_cpu_{args.cache_type}.json", RESULTS / f"decode_cpu_{args.cache_type}.png"
    if args.min_kv_crossover:
        args.depths, args.k1, args.min_kv, args.n_gen = [256, 512, 1024, 2048], [0], 0, 32
        args.out, args.png = RESULTS / "decode_cpu_min_kv.json", RESULTS / "decode_cpu_min_kv.png"
    if args.png is None:
        args.png = (args.from_json or args.out).with_suffix(".png")
    if any(d < 0 for d in args.depths) or any(k < 0 for k in args.k1) or min(args.k2, args.n_gen, args.threads,
                                                                              args.reps) < 1:
        ap.error("depths and k1 must be >= 0; k2, n-gen, threads and reps >= 1")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run both llama-bench commands; the result record (without the derived part)."""
    name, model_path, head_dim = resolve_model(args.model, args.head_dim)
    exe = find_llama_bench(args.llama_bench)
    runs = []
    for cmd in bench_commands(exe, model_path, args):
        t = time.monotonic()
        output = run_llama_bench(cmd)
        runs.append({"command": " ".join(cmd), "seconds": round(time.monotonic() - t, 1), "output": output})
    params = {"model": name, "model_file": model_path.name, "head_dim": head_dim, "mean": args.mean,
              "depths": args.depths, "k1": args.k1, "k2": args.k2, "n_gen": args.n_gen, "threads": args.threads,
              "reps": args.reps, "index": args.index, "select": args.select, "cache_type": args.cache_type}
    return {**provenance("decode_cpu_min_kv" if args.min_kv_crossover else "decode_cpu"), "params": params,
            "llama_bench": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        if args.from_json:
            result = json.loads(args.from_json.read_text())
        else:
            result = measure(args)
        raw = [row for run in result["llama_bench"] for row in run["output"]]
        result.update(derive(raw, result["params"]))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        log.error("error: %s", e)
        return 1
    if not args.from_json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        log.info("wrote %s", args.out)
    print(format_table(result["table"]))
    if result["fit"]:
        print(f"dense step fit: {result['fit']['t0_ms']:.2f} ms + {result['fit']['per_kcell_ms']:.3f} ms per 1k cells")
    return 0 if plot(result, args.png) or not args.from_json else 1


if __name__ == "__main__":
    sys.exit(main())
