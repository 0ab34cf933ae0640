"""What a training run prints: a progress line every log interval and a summary table at the end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipes.metrics import StepMetrics

console = Console(highlight=False, soft_wrap=True)


def print_step(m: StepMetrics, max_steps: int) -> None:
    mfu = f" | MFU {m.mfu:.1%}" if m.mfu is not None else ""
    console.print(
        f"step {m.step:>5}/{max_steps} | loss {m.loss:.4f} | grad norm {m.grad_norm:.3f} | lr {m.lr:.2e} | "
        f"{m.step_time_s:.3f} s/step | {m.tokens_per_s_per_gpu:,.0f} tokens/s/GPU | "
        f"{m.model_tflops_per_gpu:.2f} TFLOP/s/GPU{mfu} | peak mem {m.peak_memory_gib:.2f} GiB"
    )


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"{summary['model']} / {summary['precision']} on {summary['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    mfu = summary["mfu"]
    rows = [
        ("steps (warm-up excluded)", f"{summary['steps']} ({summary['warmup_steps_excluded']})"),
        ("median step time", f"{summary['median_step_time_s']:.3f} s"),
        ("tokens/s/GPU", f"{summary['tokens_per_s_per_gpu']:,.0f}"),
        ("model TFLOP/s/GPU", f"{summary['model_tflops_per_gpu']:.2f}"),
        ("MFU (vs BF16 peak)", f"{mfu:.1%}" if mfu is not None else "n/a (no peak for this device)"),
        ("peak memory", f"{summary['peak_memory_gib']:.2f} GiB"),
        ("final loss", f"{summary['final_loss']:.4f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}\nsummary: {run_dir / 'summary.json'}")
