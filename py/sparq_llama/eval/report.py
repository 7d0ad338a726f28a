"""Tables, target checks and plots from a results dict (`runner.run` / bench/results/quality_*.json)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .runner import summaries
from .settings import HEADLINE, ratio_label

log = logging.getLogger(__name__)

HEAD = f"sparq-{ratio_label(HEADLINE)}"
TASK_ORDER = ("ppl", "retrieval", "repetition")
# the targets at 1/8 transfer: (task, minimum of `rel` for higher-is-better, maximum for ppl)
REL_TARGETS = {"ppl": ("<=", 1.02), "retrieval": (">=", 0.98), "repetition": (">=", 0.90)}


def _restricted(data: dict[str, Any], setting: str) -> list[dict[str, Any]]:
    """Summaries over only the examples `setting` ran on (a ratio can be unreachable at short lengths),
    so that settings are compared on the same examples."""
    examples = {r["example"] for r in data["records"].values() if r["setting"] == setting}
    sub = {"records": {k: r for k, r in data["records"].items() if r["example"] in examples}}
    return [s for s in summaries(sub) if s["length"] is None]


def _points(task: str, s: dict[str, Any]) -> float:
    """Score in points where higher is better: accuracy in %, else % of dense (ppl: 200 - % of dense)."""
    if task == "retrieval":
        return 100.0 * s["value"]
    if task == "ppl":
        return 100.0 * (2.0 - s["rel"])
    return 100.0 * s["rel"]


def targets(data: dict[str, Any], setting: str = HEAD) -> list[dict[str, Any]]:
    """The issue's targets for `setting` (default SparQ at 1/8), each with its measured value and verdict."""
    rows = _restricted(data, setting)
    by = {(s["task"], s["setting"]): s for s in rows}
    out = []
    for task in TASK_ORDER:
        s = by.get((task, setting))
        if s is None:
            continue
        op, bound = REL_TARGETS[task]
        met = s["rel"] <= bound if op == "<=" else s["rel"] >= bound
        out.append({"task": task, "check": f"{setting} vs dense: rel {op} {bound}", "value": s["rel"],
                    "se": s["rel_se"], "met": bool(met)})
        for base, check in (("window", "SparQ >= window"), ("exact", "SparQ within 1 point of exact top-k")):
            b = by.get((task, base))
            if b is None:
                continue
            gap = _points(task, s) - _points(task, b)
            met = gap >= 0 if base == "window" else gap >= -1.0
            out.append({"task": task, "check": check, "value": gap, "se": None, "met": bool(met),
                        "detail": f"{setting} {_points(task, s):.2f} vs {base} {_points(task, b):.2f} points"})
    return out


def _fmt(task: str, s: dict[str, Any]) -> str:
    if task == "ppl":
        return f"{s['value']:.3f} ± {s['se']:.3f} ({100 * (s['rel'] - 1):+.1f}% ± {100 * s['rel_se']:.1f})"
    if task == "retrieval":
        return f"{100 * s['value']:.1f}% ± {100 * s['se']:.1f}"
    return f"{s['value']:.1f} ± {s['se']:.1f} ({100 * s['rel']:.0f}% ± {100 * s['rel_se']:.0f})"


def markdown(data: dict[str, Any]) -> str:
    """The paper's Table 2 layout: one row per setting, one column per task, value ± SE (vs dense)."""
    rows = [s for s in data.get("summary") or summaries(data) if s["length"] is None]
    tasks = [t for t in TASK_ORDER if any(s["task"] == t for s in rows)]
    names = sorted({s["setting"] for s in rows}, key=_setting_order)
    by = {(s["task"], s["setting"]): s for s in rows}
    titles = {"ppl": "perplexity ↓ (vs dense)", "retrieval": "retrieval accuracy ↑",
              "repetition": "repetition chars ↑ (% of dense)"}
    lines = []
    if tasks:
        lines += ["| setting | transfer | " + " | ".join(titles[t] for t in tasks) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in tasks) + " |"]
    for name in names if tasks else []:
        cells, transfer = [], []
        for t in tasks:
            s = by.get((t, name))
            cells.append(_fmt(t, s) if s else "n/a")
            if s:
                transfer.append(s["transfer"])
        tr = "1" if name == "dense" else f"{sum(transfer) / len(transfer):.3f}"
        lines.append(f"| {name} | {tr} | " + " | ".join(cells) + " |")
    bpc = [s for s in rows if s["task"] == "ppl" and s["bpc"] is not None]
    if bpc:
        lines += ["", "Bits per character: " + ", ".join(f"{s['setting']} {s['bpc']:.4f} ± {s['bpc_se']:.4f}"
                                                        for s in sorted(bpc, key=lambda s: _setting_order(s['setting'])))]
    agree = (data.get("agreement") or {}).get("summary") or {}
    for length, by_ratio in sorted(agree.items(), key=lambda kv: int(kv[0])):
        if lines:
            lines.append("")
        parts = [f"{label} (k1={v['k1']}, {v['index']} index, select {v['select']}): {100 * v['mean']:.1f}% ± "
                 f"{100 * v['se']:.1f} (lowest: layer "
                 f"{v['min_layer']}, {100 * v['per_layer'][v['min_layer']]:.0f}%)" for label, v in by_ratio.items()]
        n_sparq = len(next(iter(by_ratio.values()))["sparq_layers"])
        lines += [f"Selection agreement at {length} tokens (share of the exact top-128 found, over the {n_sparq} "
                      f"layers SparQ runs on): " + "; ".join(parts)]
    lines += _per_length(data)
    checks = targets(data)
    if checks:
        lines += ["", "| target (SparQ at 1/8, same examples) | task | measured | met |", "| --- | --- | --- | --- |"]
        for c in checks:
            v = f"{c['value']:+.2f} points" if c["se"] is None else f"{c['value']:.3f} ± {c['se']:.3f}"
            lines.append(f"| {c['check']} | {c['task']} | {v} | {'yes' if c['met'] else '**no**'} |")
    skipped = sorted({note for note in (data.get("skipped") or {}).values()})
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped)]
    return "\n".join(lines)


def _per_length(data: dict[str, Any]) -> list[str]:
    """Task x length rows of the main settings' scores relative to dense (ppl: % change; others: % of dense)."""
    rows = [s for s in data.get("summary") or summaries(data) if s["length"] is not None]
    main = ["sparq-1/2", "sparq-1/4", "sparq-1/8", "exact", "window"]
    by = {(s["task"], s["length"], s["setting"]): s for s in rows}
    keys = sorted({(s["task"], s["length"]) for s in rows}, key=lambda k: (TASK_ORDER.index(k[0]), k[1]))
    if not keys:
        return []
    title = ("Per context length, relative to dense on the same examples (perplexity: change; accuracy and "
             "repetition: share of dense's; n = examples):")
    out = ["", title, "",
           "| task | length | n | dense | " + " | ".join(main) + " |", "| --- | --- | --- | --- | " +
           " | ".join("---" for _ in main) + " |"]
    for task, length in keys:
        d = by.get((task, length, "dense"))
        if d is None:
            continue
        dense = f"{d['value']:.2f}" if task != "retrieval" else f"{100 * d['value']:.0f}%"
        cells = []
        for name in main:
            s = by.get((task, length, name))
            if s is None:
                cells.append("n/a")
            elif task == "ppl":
                cells.append(f"{100 * (s['rel'] - 1):+.1f}% ± {100 * s['rel_se']:.1f}")
            else:
                cells.append(f"{100 * s['rel']:.0f}% ± {100 * s['rel_se']:.0f}")
        out.append(f"| {task} | {length} | {d['n']} | {dense} | " + " | ".join(cells) + " |")
    return out


def _setting_order(name: str) -> tuple[int, str]:
    order = ["dense", "sparq-1/2", "sparq-1/4", "sparq-1/8", "sparq-1/4-f16-q", "sparq-1/8-f16-q", "sparq-q4", "exact",
             "window"]
    return (order.index(name), name) if name in order else (len(order), name)


def plot(data: dict[str, Any], path: Path) -> bool:
    """Each metric vs transfer ratio (SparQ with ±1 SE bands, exact, window, dense), plus per-layer
    agreement; False (and a log line) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.error("matplotlib is not installed (pip install 'sparq-llama[bench]'): no plot written to %s", path)
        return False
    rows = [s for s in data.get("summary") or summaries(data) if s["length"] is None]
    tasks = [t for t in TASK_ORDER if any(s["task"] == t for s in rows)]
    agree = (data.get("agreement") or {}).get("summary") or {}
    n = len(tasks) + (1 if agree else 0)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    ylabels = {"ppl": "perplexity / dense", "retrieval": "accuracy", "repetition": "matched chars / dense"}
    for ax, task in zip(axes[0], tasks):
        ts = [s for s in rows if s["task"] == task]
        key = "value" if task == "retrieval" else "rel"
        err = "se" if task == "retrieval" else "rel_se"
        sparq = sorted((s for s in ts if s["family"] == "sparq"), key=lambda s: s["transfer"])
        if sparq:
            x = [s["transfer"] for s in sparq]
            y = [s[key] for s in sparq]
            e = [s[err] for s in sparq]
            ax.plot(x, y, "o-", label="SparQ")
            ax.fill_between(x, [a - b for a, b in zip(y, e)], [a + b for a, b in zip(y, e)], alpha=0.25)
        paper = sorted((s for s in ts if s["setting"].endswith("-f16-q")), key=lambda s: s["transfer"])
        if paper:
            x, y, e = [s["transfer"] for s in paper], [s[key] for s in paper], [s[err] for s in paper]
            ax.plot(x, y, "x--", label="SparQ, f16 index, |q|")
            ax.fill_between(x, [a - b for a, b in zip(y, e)], [a + b for a, b in zip(y, e)], alpha=0.15)
        for fam, marker in (("exact", "s"), ("window", "^")):
            for s in ts:
                if s["family"] == fam:
                    ax.errorbar([s["transfer"]], [s[key]], yerr=[s[err]], fmt=marker, label=fam, capsize=3)
        for s in ts:
            if s["setting"] == "sparq-q4":
                ax.errorbar([s["transfer"]], [s[key]], yerr=[s[err]], fmt="D", label="SparQ, q4 index", capsize=3)
        dense = [s for s in ts if s["setting"] == "dense"]
        if dense:
            ax.axhline(dense[0][key], color="k", ls="--", lw=1, label="dense")
        for r in (1 / 2, 1 / 4, 1 / 8):
            ax.axvline(r, color="grey", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("attention transfer / dense")
        ax.set_ylabel(ylabels[task])
        ax.set_title(task)
        ax.legend(fontsize=7)
    if agree:
        ax = axes[0][-1]
        for length, by_ratio in sorted(agree.items(), key=lambda kv: int(kv[0])):
            for label, v in by_ratio.items():
                ax.plot(v["per_layer"], label=f"{length} tok, {label} (k1={v['k1']})")
        ax.set_xlabel("layer")
        ax.set_ylabel("top-k agreement")
        ax.set_ylim(0, 1.02)
        ax.set_title("selection agreement")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['model']['name']}: quality vs attention transfer")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
