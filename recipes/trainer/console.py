"""What a training run prints: a progress line every log interval and a summary table at the end."""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipes.compute import NAMES, run_compute_dtype
from recipes.config import Config, Engine
from recipes.metrics import StepMetrics, summarize, write_summary
from recipes.provenance import provenance
from recipes.run_files import METRICS, SUMMARY

console = Console(highlight=False, soft_wrap=True)


def eta(step_times: list[float], steps_left: int) -> str:
    """Time to the run's last step at the recent pace, H:MM:SS: the median of the last (up to) 20 step times, so a
    slow first step (compilation) or a profiled one barely moves it, times the steps left."""
    recent = step_times[-20:]
    return str(datetime.timedelta(seconds=round(statistics.median(recent) * steps_left if recent else 0)))


def step_line(history: list[StepMetrics], max_steps: int, cpu_processes: int = 0) -> str:
    """The torch engine's progress line for the last step in `history` (the run's steps so far). On a CPU
    (`cpu_processes`: the run's processes there, 0 on GPUs) the run's tokens/s, and no TFLOP/s: a CPU has no
    peak to hold them against."""
    m = history[-1]
    if cpu_processes:
        speed = f"{m.tokens_per_s_per_gpu * cpu_processes:,.0f} tokens/s"
    else:
        mfu = f" | MFU {m.mfu:.1%}" if m.mfu is not None else ""
        speed = f"{m.tokens_per_s_per_gpu:,.0f} tokens/s/GPU | {m.model_tflops_per_gpu:.2f} TFLOP/s/GPU{mfu}"
    return (
        f"step {m.step:>5}/{max_steps} | loss {m.loss:.4f} | grad norm {m.grad_norm:.3f} | lr {m.lr:.2e} | "
        f"{m.step_time_s:.3f} s/step | {speed} | peak mem {m.peak_memory_gib:.2f} GiB | "
        f"ETA {eta([h.step_time_s for h in history], max_steps - m.step)}"
    )


def print_step(history: list[StepMetrics], max_steps: int, cpu_processes: int = 0) -> None:
    console.print(step_line(history, max_steps, cpu_processes))


def megatron_iteration_line(interval: list[StepMetrics], max_steps: int, global_batch_size: int,
                            history: list[StepMetrics]) -> str:
    """Megatron-LM's iteration line (training.py training_log) for the steps since the last one (`interval`, the
    end of `history`, the run's steps so far): time, throughput and loss averaged over them, learning rate and
    gradient norm of the last. BF16 has no loss scaling (1.0). Megatron prints no time left; `ETA` at the end is
    ours (a field that readers of this line skip), from the run's recent steps as the torch engine's line."""
    last = interval[-1]
    nan = sum(1 for m in interval if m.loss != m.loss or m.grad_norm != m.grad_norm)
    return (
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {last.step:8d}/{max_steps:8d} |"
        f" consumed samples: {last.step * global_batch_size:12d} |"
        f" elapsed time per iteration (ms): {1000 * statistics.fmean(m.step_time_s for m in interval):.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {statistics.fmean(m.model_tflops_per_gpu for m in interval):.1f} |"
        f" learning rate: {last.lr:.6E} |"
        f" global batch size: {global_batch_size:5d} |"
        f" lm loss: {statistics.fmean(m.loss for m in interval):.6E} |"
        f" loss scale: 1.0 |"
        f" grad norm: {last.grad_norm:.3f} |"
        f" number of skipped iterations: {0:3d} |"
        f" number of nan iterations: {nan:3d} |"
        f" ETA: {eta([m.step_time_s for m in history], max_steps - last.step)} |"
    )


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"{summary['model']} / {summary['precision']} on {summary['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    mfu = summary["mfu"]
    rows = [
        ("steps (warm-up excluded)", f"{summary['steps']} ({summary['warmup_steps_excluded']})"),
        ("median step time", f"{summary['median_step_time_s']:.3f} s"),
    ]
    if summary["gpu"] == "cpu":  # the run's throughput; no TFLOP/s or MFU without a peak to hold them against
        rows.append(("tokens/s", f"{summary['tokens_per_s_per_gpu'] * summary['world_size']:,.0f}"))
    else:
        rows += [
            ("tokens/s/GPU", f"{summary['tokens_per_s_per_gpu']:,.0f}"),
            ("model TFLOP/s/GPU", f"{summary['model_tflops_per_gpu']:.2f}"),
            ("MFU (vs BF16 peak)", f"{mfu:.1%}" if mfu is not None else "n/a (no peak for this device)"),
        ]
    if "compute_dtype" in summary:
        rows.append(("compute (what GPUs run in BF16)", summary["compute_dtype"]))
    if "attention" in summary:
        rows.append(("attention kernel (SDPA)", summary["attention"]))
    if "fused_loss" in summary:
        rows.append(("output layer + loss", "fused, in chunks" if summary["fused_loss"] else "logits in FP32"))
    rows += [
        ("peak memory", f"{summary['peak_memory_gib']:.2f} GiB"),
        ("final loss", f"{summary['final_loss']:.4f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"metrics: {run_dir / METRICS}\nsummary: {run_dir / SUMMARY}")


def finish_run(cfg: Config, history: list[StepMetrics], world_size: int, run_dir: Path,
               facts: dict | None = None) -> dict:
    """Both engines' last act on the logging rank: summary.json (with provenance, the engine's `facts` and, but for
    NeMo's own BF16, the compute dtype) written, and shown."""
    compute = {} if cfg.engine == Engine.nemo else {"compute_dtype": NAMES[run_compute_dtype(cfg)]}
    summary = summarize(cfg, history, world_size, {**provenance(), **compute, **(facts or {})})
    write_summary(run_dir, summary)
    print_summary(summary, run_dir)
    return summary
