"""The study's figures, drawn with matplotlib's Agg backend (no screen needed).

- speedup of each FP8 recipe over BF16 against model size, one panel per GPU (the model-size figures);
- loss curves of each recipe over its BF16 baseline, with the relative difference below (the loss-curve figure);
- GEMM speedup over BF16 against K, from the GEMM benchmark's CSV (the GEMM figure).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from recipes.folders import write_file  # noqa: E402
from recipes.report.gemm import group_name  # noqa: E402
from recipes.report.metadata import PRECISION_ORDER, describe_layout  # noqa: E402
from recipes.report.table import Result, precision_label, run_state  # noqa: E402

COLORS = {
    "bf16": "black",
    "fp8_delayed": "tab:blue",
    "fp8_current": "tab:orange",
    "fp8_blockwise": "tab:green",
    "mxfp8": "tab:red",
    "fp8": "tab:purple",
}
EXTRA_COLORS = ["tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
FIGSIZE, DPI = (8, 5), 100


def _color(name: str, seen: dict[str, str]) -> str:
    if name in COLORS:
        return COLORS[name]
    return seen.setdefault(name, EXTRA_COLORS[len(seen) % len(EXTRA_COLORS)])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    write_file(path, png.getvalue())
    return path


def speedup_vs_model_size(results: list[Result], path: Path) -> Optional[Path]:
    points = [r for r in results if r.speedup is not None and r.meta.get("params")]
    if not points:
        return None
    gpus = sorted({r.meta["gpu"] for r in points})
    fig, axes = plt.subplots(
        1, len(gpus), figsize=(FIGSIZE[0] * max(1, len(gpus)) * 0.7, FIGSIZE[1]), squeeze=False, sharey=True
    )
    extra: dict[str, str] = {}
    for ax, gpu in zip(axes[0], gpus):
        on_gpu = [r for r in points if r.meta["gpu"] == gpu]
        labels = sorted({precision_label(r.meta) for r in on_gpu}, key=_rank)
        for label in labels:
            series = sorted((r for r in on_gpu if precision_label(r.meta) == label), key=lambda r: r.meta["params"])
            xs = [r.meta["params"] / 1e9 for r in series]
            ys = [r.speedup for r in series]
            color = _color(series[0].meta.get("precision", ""), extra)
            ax.plot(xs, ys, marker="o", color=color, label=label)
            for x, y, r in zip(xs, ys, series):
                ax.annotate(f"{y:.2f}x{_state_mark(r)}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8, color=color)
        models = {r.meta["params"] / 1e9: r.meta.get("model", "") for r in on_gpu}
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_xticks(sorted(models), [f"{models[x]}\n{_size(x)}" for x in sorted(models)], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("model (parameters)")
        ax.set_title(f"{gpu}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over BF16 (step time)")
    fig.suptitle("FP8 speedup over BF16 vs model size")
    return _save(fig, path)


def _state_mark(result: Result) -> str:
    """A run (or its BF16 baseline) that did not finish cleanly, marked where it is drawn."""
    marked = [r for r in (result, result.baseline) if r is not None and r.state]
    return "".join(f" [{'BF16 ' if r is not result else ''}{run_state(r)}]" for r in marked)


def _size(billions: float) -> str:
    return f"{billions:.3g}B" if billions >= 1 else f"{billions * 1e3:.3g}M"


def _rank(label: str) -> tuple:
    name = label.split(" ")[0]
    return (PRECISION_ORDER.index(name) if name in PRECISION_ORDER else len(PRECISION_ORDER), label)


@dataclass
class Curve:
    """One plotted line: a run's loss (top panel) or its relative difference to BF16 (bottom panel)."""

    run: Result
    panel: str  # "loss" or "relative difference to bf16"
    steps: list[int]
    values: list[float]


def loss_curve_data(baseline: Result, others: list[Result]) -> list[Curve]:
    """The lines of the loss-curve figure, in drawing order: BF16's loss, then each recipe's loss and its relative
    difference to BF16 (at BF16's logged steps, the recipe's loss interpolated linearly between its own)."""
    base_steps, base_loss = _curve(baseline)
    curves = [Curve(baseline, "loss", base_steps, base_loss)]
    for other in sorted(others, key=lambda r: _rank(precision_label(r.meta))):
        steps, loss = _curve(other)
        xs, rel = _relative_difference(steps, loss, base_steps, base_loss)
        curves += [Curve(other, "loss", steps, loss), Curve(other, "relative difference to bf16", xs, rel)]
    return curves


def loss_curves(curves: list[Curve], path: Path, tolerance: float) -> Path:
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(FIGSIZE[0], FIGSIZE[1] * 1.3), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    baseline = curves[0]
    top.plot(baseline.steps, baseline.values, color="black", linewidth=1.2,
             label=precision_label(baseline.run.meta) + _state_mark(baseline.run))
    extra: dict[str, str] = {}
    labels = _legend_labels([curve.run for curve in curves[1:]])
    for curve in curves[1:]:
        other = curve.run
        label = labels[id(other)]
        by_precision = f"({other.run.name})" not in label  # one line of its precision: the precision's colour
        color = _color(other.meta.get("precision", "") if by_precision else label, extra)
        if curve.panel != "loss":
            bottom.plot(curve.steps, [100 * d for d in curve.values], color=color, linewidth=1.0, label=label)
            continue
        top.plot(curve.steps, curve.values, color=color, linewidth=1.0, label=label)
        if other.first_bad_step is not None:
            top.axvline(
                other.first_bad_step,
                color=color,
                linestyle=":",
                label=f"{label}: NaN/inf from step {other.first_bad_step}",
            )
    bottom.axhline(0.0, color="black", linewidth=0.8)
    for sign in (1, -1):
        bottom.axhline(sign * 100 * tolerance, color="gray", linewidth=0.8, linestyle="--")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    top.grid(True, alpha=0.3)
    bottom.set_ylabel("(loss - BF16) / BF16 (%)")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    m = baseline.run.meta
    top.set_title(f"{m.get('model', 'unknown')} on {m.get('gpu', 'unknown')}, {describe_layout(m)}: loss vs BF16")
    return _save(fig, path)


def _legend_labels(results: list[Result]) -> dict[int, str]:
    """Each run's legend entry: its precision, and its run name where another run of the figure has the same
    precision (one entry per line, never two alike)."""
    counts = Counter(precision_label(r.meta) for r in {id(r): r for r in results}.values())
    return {id(r): precision_label(r.meta) + (f" ({r.run.name})" if counts[precision_label(r.meta)] > 1 else "")
            + (f" [{run_state(r)}]" if r.state else "") for r in results}


def write_curve_csv(curves: list[Curve], path: Path) -> Path:
    """The numbers behind a figure's lines, one row per point: run, precision, its run state, panel, step, value."""
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["run", "precision", "run_state", "panel", "step", "value"])
    for curve in curves:
        label, state = precision_label(curve.run.meta), run_state(curve.run)
        writer.writerows([curve.run.run.name, label, state, curve.panel, step, format(value, ".10g")]
                         for step, value in zip(curve.steps, curve.values))
    write_file(path, text.getvalue())
    return path


def _curve(result: Result) -> tuple[list[int], list[float]]:
    pairs = [(r.step, r.loss) for r in result.run.steps if r.loss is not None and math.isfinite(r.loss)]
    return [step for step, _ in pairs], [loss for _, loss in pairs]


def _relative_difference(steps, loss, base_steps, base_loss) -> tuple[list[int], list[float]]:
    """(loss - BF16) / BF16 at the baseline's logged steps inside both curves' range; the recipe's loss is
    interpolated linearly between its logged steps (exact where both logged the same step)."""
    if not steps or not base_steps:
        return [], []
    lo, hi = max(steps[0], base_steps[0]), min(steps[-1], base_steps[-1])
    pairs = [(x, b) for x, b in zip(base_steps, base_loss) if lo <= x <= hi and b != 0]
    xs = [x for x, _ in pairs]
    ours = np.interp(xs, steps, loss) if xs else []
    return xs, [(y - b) / b for y, (_, b) in zip(ours, pairs)]


def gemm_speedup_vs_k(rows: list[dict], path: Path) -> Optional[Path]:
    """rows: {"variant", "k", "speedup", "group"}; one colour per variant, one line per (variant, group)."""
    rows = [r for r in rows if r["speedup"] is not None and r["variant"] != "bf16"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    extra: dict[str, str] = {}
    groups = list(dict.fromkeys(r["group"] for r in rows))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        color = _color(variant, extra)
        for index, group in enumerate(groups):
            series = sorted((r for r in rows if r["variant"] == variant and r["group"] == group), key=lambda r: r["k"])
            if series:
                label = variant if len(groups) == 1 else f"{variant}, {group_name(group)}"
                marker = GROUP_MARKERS[index % len(GROUP_MARKERS)]
                ax.plot(
                    [r["k"] for r in series], [r["speedup"] for r in series], marker=marker, color=color, label=label
                )
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ks = sorted({r["k"] for r in rows})
    ax.set_xticks(ks, [str(k) for k in ks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("K (contraction dimension)")
    ax.set_ylabel("speedup over BF16 GEMM")
    ax.set_title("FP8 GEMM speedup over BF16 vs K")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


GROUP_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def safe_name(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(str(p) for p in parts)).strip("-")
