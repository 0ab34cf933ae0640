"""This project's run directories: `metrics.jsonl`, one JSON object per optimizer step, as recipes.metrics writes
it (`StepMetrics`). A step the engine stopped on for a non-finite loss or gradient norm is its last line, with that
value NaN or inf (recipes.trainer.loop)."""

from __future__ import annotations

import json
from pathlib import Path

from recipes.report.formats.base import FileRead, empty_note, mark_restarts, number, read_lines
from recipes.report.records import Skips, Step

JSONL_FIELDS = {
    "loss": "loss",
    "step_time_s": "time_s",
    "tokens_per_s_per_gpu": "tokens_per_s_per_gpu",
    "model_tflops_per_gpu": "tflops_per_gpu",
    "mfu": "mfu",
    "grad_norm": "grad_norm",
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
        record = Step(step=step, where=where, line=line_no)
        unreadable = [key for key in ("loss", "step_time_s") if obj.get(key) is not None and number(obj[key]) is None]
        unreadable = [key.replace("step_time_s", "step time") for key in unreadable]
        if unreadable:
            skips.add(f"unreadable {' and '.join(unreadable)}", line_no)
            continue
        for key, attribute in JSONL_FIELDS.items():
            setattr(record, attribute, number(obj.get(key)))
        steps.append(record)
    mark_restarts(steps)
    keys = {attribute: key for key, attribute in JSONL_FIELDS.items()}
    return FileRead("metrics.jsonl", steps, notes=skips.notes() + empty_note(where, lines, steps),
                    skipped_records=skips.count(), field_keys=keys)
