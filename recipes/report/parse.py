"""Readers: the project's metrics.jsonl, and line-based training logs (Megatron-LM / Megatron-Bridge, NeMo 2).

Every reader returns the same thing, a `FileRead`: the records in the order they were written, metadata found in
the file itself (parallel sizes from header lines), and notes on what was skipped. Line-based logs share one
mechanism: a format is only the pattern that starts a record and how its iteration counts; the fields after it
are `key: value` pairs separated by `|`, looked up in one table (`FIELDS`) that also converts units.

Rules that keep a broken file from producing wrong numbers:
- a last line without a newline was cut off mid-write: skipped;
- a line holding two record starts is the output of two processes interleaved: skipped;
- a loss or step time that does not parse as a number: the record is skipped (NaN and inf do parse: they are
  kept and flagged later);
- a step that does not follow the previous one starts a new segment (a restart); its first record is warm-up.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from recipes.report.records import Skips, Step


@dataclass
class FileRead:
    format: Optional[str]
    steps: list[Step]  # in the order written; repeats not yet removed
    header: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def number(value: Any) -> Optional[float]:
    """A float from a JSON value or a log token; None when it is not a number (NaN and inf are numbers)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def mark_restarts(steps: list[Step]) -> None:
    """First record of a file, and every record whose step does not advance, begin a process's output."""
    previous = None
    for record in steps:
        record.fresh = previous is None or record.step <= previous
        previous = record.step


def read_lines(path: Path) -> tuple[list[str], bool]:
    """The file's lines (undecodable bytes replaced) and whether its last line was cut off (no final newline)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    cut = bool(text) and not text.endswith("\n")
    return text.splitlines(), cut


# ---- the project's metrics.jsonl ----

JSONL_FIELDS = {
    "loss": "loss",
    "step_time_s": "time_s",
    "tokens_per_s_per_gpu": "tokens_per_s_per_gpu",
    "model_tflops_per_gpu": "tflops_per_gpu",
    "mfu": "mfu",
}


def read_metrics_jsonl(path: Path, where: str) -> FileRead:
    lines, cut = read_lines(path)
    skips = Skips(where)
    steps: list[Step] = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if cut and line_no == len(lines):
            skips.add("cut off (no newline at the end of the file)", line_no)
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            skips.add("not valid JSON", line_no)
            continue
        step = obj.get("step") if isinstance(obj, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            skips.add("no positive integer 'step'", line_no)
            continue
        record = Step(step=step)
        unreadable = [key for key in ("loss", "step_time_s") if obj.get(key) is not None and number(obj[key]) is None]
        unreadable = [key.replace("step_time_s", "step time") for key in unreadable]
        if unreadable:
            skips.add(f"unreadable {' and '.join(unreadable)}", line_no)
            continue
        for key, attribute in JSONL_FIELDS.items():
            setattr(record, attribute, number(obj.get(key)))
        steps.append(record)
    mark_restarts(steps)
    return FileRead("metrics.jsonl", steps, notes=skips.notes() + _empty_note(where, lines, steps))


def _empty_note(where: str, lines: list[str], steps: list[Step]) -> list[str]:
    if steps:
        return []
    return [f"{where}: {'empty file' if not any(line.strip() for line in lines) else 'no training records found'}"]


# ---- line-based logs ----


@dataclass(frozen=True)
class LineFormat:
    name: str
    start: re.Pattern  # matches where a record begins; group "it" is its iteration
    zero_based: bool  # NeMo 2 counts iterations from 0, Megatron from 1


LINE_FORMATS = [
    # ` [2024-05-01 12:00:00] iteration      100/    1000 | consumed samples: ... |`; not NeMo's ", iteration"
    LineFormat("megatron", re.compile(r"(?<!,\s)\biteration\s+(?P<it>\d+)\s*/\s*\d+\s*\|"), zero_based=False),
    # `Training epoch 0, iteration 99/999 | lr: 0.0001 | global_step: 99 | reduced_train_loss: 2.346 | ...`
    LineFormat("nemo2", re.compile(r"Training epoch \d+, iteration (?P<it>\d+)/\d+\s*\|"), zero_based=True),
]

# Field name (lower case) -> Step attribute. A unit in the name, "(ms)", "in s", ..., scales the value to seconds.
FIELDS = [
    (re.compile(r"elapsed time per iteration(?: \((?P<unit>ms|s)\))?"), "time_s"),
    (re.compile(r"train_step_timing(?: in (?P<unit>ms|s))?"), "time_s"),
    (re.compile(r"lm loss|reduced_train_loss|train_loss|loss"), "loss"),
    (re.compile(r"throughput per gpu \(tflop/s/gpu\)|tflops_per_gpu|tflops per gpu"), "tflops_per_gpu"),
    (re.compile(r"global batch size|global_batch_size"), "global_batch_size"),
    (re.compile(r"number of nan iterations"), "nan_iterations"),
    (re.compile(r"global_step"), "global_step"),
]
UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, None: 1.0}
VALUE = re.compile(r"(?P<number>[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))\s*(?P<unit>ms|s)?", re.I)
CORE_FIELDS = {"loss": "loss", "time_s": "step time"}  # a record without a readable one of these is skipped


def _parse_fields(text: str) -> tuple[dict[str, float], list[str]]:
    """`key: value | key: value | ...` -> {attribute: value in base units}, and the core fields that were unreadable."""
    values: dict[str, float] = {}
    unreadable: list[str] = []
    for part in text.split("|"):
        key, sep, raw = part.partition(":")
        if not sep:
            continue
        key = " ".join(key.lower().split())
        for pattern, attribute in FIELDS:
            name = pattern.fullmatch(key)
            if not name:
                continue
            value = VALUE.fullmatch(raw.strip())
            if value is None:
                unreadable.append(attribute)
            elif attribute not in values:
                unit = value["unit"].lower() if value["unit"] else name.groupdict().get("unit")
                scale = UNIT_SECONDS[unit] if attribute == "time_s" else 1.0
                values[attribute] = float(value["number"]) * scale
            break
    return values, [CORE_FIELDS[a] for a in unreadable if a in CORE_FIELDS]


def _record(fmt: LineFormat, iteration: int, values: dict[str, float]) -> Step:
    if "global_step" in values and math.isfinite(values["global_step"]):
        step = int(values["global_step"]) + 1  # NeMo's global_step is 0-based like its iteration
    else:
        step = iteration + 1 if fmt.zero_based else iteration
    gbs = values.get("global_batch_size")
    nan_its = values.get("nan_iterations")
    return Step(
        step=step,
        loss=values.get("loss"),
        time_s=values.get("time_s"),
        tflops_per_gpu=values.get("tflops_per_gpu"),
        global_batch_size=int(gbs) if gbs is not None and math.isfinite(gbs) else None,
        nan_iterations=int(nan_its) if nan_its is not None and math.isfinite(nan_its) else 0,
    )


# Header lines: Megatron's argument dump (`  tensor_model_parallel_size ........ 2`) or a bare `key: value` line.
HEADER_LINE = re.compile(
    r"^\s*(?:\d+:\s*)?(?:\[[^\]]*\]\s*)*(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*(?:\s\.{2,}\s|[:=])\s*(?P<value>[^\s,|]+)\s*$"
)
HEADER_KEYS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "virtual_pipeline_model_parallel_size": "vp",
    "data_parallel_size": "dp",
    "world_size": "world_size",
    "micro_batch_size": "mbs",
    "global_batch_size": "gbs",
    "seq_length": "seq",
    "seed": "seed",
    "fp8": "fp8",  # hybrid / e4m3 / None
    "fp8_recipe": "fp8_recipe",
    "bf16": "bf16",
}


def _header_value(key: str, raw: str) -> Any:
    if key in ("fp8", "fp8_recipe"):
        return raw.lower()  # fp8 "none": a BF16 run
    if key == "bf16":
        return raw.lower() == "true"
    if key == "vp" and raw.lower() == "none":
        return 1  # Megatron: no virtual pipeline = one stage per rank
    return int(raw) if raw.isdigit() else None


def read_log(path: Path, where: str) -> FileRead:
    lines, cut = read_lines(path)
    skips = Skips(where)
    steps: list[Step] = []
    header: dict[str, Any] = {}
    per_format = {fmt.name: 0 for fmt in LINE_FORMATS}
    for line_no, line in enumerate(lines, 1):
        starts = [(fmt, m) for fmt in LINE_FORMATS for m in fmt.start.finditer(line)]
        if not starts:
            _read_header(line, header)
            continue
        if cut and line_no == len(lines):
            skips.add("cut off (no newline at the end of the file)", line_no)
        elif len(starts) > 1:
            skips.add("two records on one line (output of two processes interleaved)", line_no)
        else:
            fmt, match = starts[0]
            values, unreadable = _parse_fields(line[match.end() - 1 :])
            if unreadable:
                skips.add(f"unreadable {' and '.join(unreadable)}", line_no)
            elif "loss" not in values and "time_s" not in values:
                skips.add("neither a loss nor a step time", line_no)
            else:
                steps.append(_record(fmt, int(match["it"]), values))
                per_format[fmt.name] += 1
    mark_restarts(steps)
    fmt_name = max(per_format, key=per_format.get) if steps else None
    return FileRead(fmt_name, steps, header=header, notes=skips.notes() + _empty_note(where, lines, steps))


def _read_header(line: str, header: dict[str, Any]) -> None:
    match = HEADER_LINE.match(line)
    if not match or match["key"].lower() not in HEADER_KEYS:
        return
    key = HEADER_KEYS[match["key"].lower()]
    value = _header_value(key, match["value"])
    if value is not None:
        header.setdefault(key, value)  # the first value printed is the run's setting
