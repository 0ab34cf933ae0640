"""The common record every input format is turned into: a run's steps, its metadata and what was skipped, and where
in its files each came from (a line number, a config key), so that a surprising number is checked in one step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class Step:
    """One logged optimizer step, or one log interval ending at `step` (times are then interval averages)."""

    step: int  # 1-based number of the last optimizer step this record covers
    loss: Optional[float] = None
    time_s: Optional[float] = None  # seconds per optimizer step
    tokens_per_s_per_gpu: Optional[float] = None
    tflops_per_gpu: Optional[float] = None  # model TFLOP/s per GPU
    mfu: Optional[float] = None
    samples_per_s: Optional[float] = None  # Megatron-DeepSpeed's samples per second (all GPUs)
    grad_norm: Optional[float] = None
    global_batch_size: Optional[int] = None
    nan_iterations: int = 0  # Megatron's "number of nan iterations" in this interval
    fresh: bool = False  # first record a process wrote (start or restart): compilation and warm-up inside
    where: str = ""  # the file it was read from, as the report names it
    line: int = 0  # its line in that file

    def reading(self) -> tuple:
        """What the record says (its step and values, NaN written as text so that it equals itself): two records
        with the same reading are one record printed twice."""
        values = (self.step, self.loss, self.time_s, self.tokens_per_s_per_gpu, self.tflops_per_gpu, self.mfu,
                  self.samples_per_s, self.grad_norm, self.global_batch_size, self.nan_iterations)
        return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in values)

    @property
    def bad_loss(self) -> bool:
        return (self.loss is not None and not math.isfinite(self.loss)) or self.nan_iterations > 0

    @property
    def bad_grad_norm(self) -> bool:
        return self.grad_norm is not None and not math.isfinite(self.grad_norm)


@dataclass
class Run:
    name: str
    format: str  # "metrics.jsonl", "megatron", "nemo2"
    paths: list[Path]  # the files (or run directory) it was read from
    steps: list[Step]  # sorted by step, each step once
    meta: dict[str, Any] = field(default_factory=dict)  # merged metadata (see metadata.py)
    meta_origin: dict[str, str] = field(default_factory=dict)  # metadata key -> the source it came from (metadata.py)
    meta_source: dict[str, str] = field(default_factory=dict)  # metadata key -> its line or config key in that source
    field_keys: dict[str, str] = field(default_factory=dict)  # Step attribute -> the name its files print it under
    provenance: dict[str, Any] = field(default_factory=dict)  # commit, versions, device (run directories)
    notes: list[str] = field(default_factory=list)  # what was skipped and why
    label_target: str = ""  # the FILE of a --label that names this run (its first file, as given)
    skipped_records: int = 0  # record lines its files hold that could not be read (see Skips)
    resumed_at: list[int] = field(default_factory=list)  # the first step of each restart (a resume from a checkpoint)


def merge_steps(segments: list[list[Step]]) -> tuple[list[Step], int]:
    """Steps of several segments (in the order they were written) -> each step once, the last occurrence winning.

    Returns the sorted steps and how many records were dropped as repeats (a requeued job redoes the steps since
    its last checkpoint; the newest attempt is the one whose model state carried on).
    """
    by_step: dict[int, Step] = {}
    repeats = 0
    for segment in segments:
        for record in segment:
            if record.step in by_step:
                repeats += 1
                del by_step[record.step]  # re-insert so dict order tracks the newest write
            by_step[record.step] = record
    return [by_step[s] for s in sorted(by_step)], repeats


def lines_of(records: list[Step], printed_as: str = "") -> str:
    """Where records were read: `run.log lines 20-100 (elapsed time per iteration (ms))`, one range per file."""
    spans: dict[str, list[int]] = {}
    for record in records:
        spans.setdefault(record.where, []).append(record.line)
    ranges = [f"{where} line {min(lines)}" if min(lines) == max(lines) else f"{where} lines {min(lines)}-{max(lines)}"
              for where, lines in spans.items()]
    return "; ".join(ranges) + (f" ({printed_as})" if printed_as and ranges else "")


class Skips:
    """Records skipped while reading one file, grouped by reason, for the report's 'skipped' list."""

    def __init__(self, where: str):
        self.where = where
        self.lines: dict[str, list[int]] = {}

    def add(self, reason: str, line_no: int) -> None:
        self.lines.setdefault(reason, []).append(line_no)

    def count(self) -> int:
        return sum(len(numbers) for numbers in self.lines.values())

    def notes(self) -> list[str]:
        out = []
        for reason, numbers in self.lines.items():
            shown = ", ".join(str(n) for n in numbers[:5]) + (", ..." if len(numbers) > 5 else "")
            plural = "s" if len(numbers) > 1 else ""
            out.append(f"{self.where}: skipped {len(numbers)} line{plural} ({shown}): {reason}")
        return out
