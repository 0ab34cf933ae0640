"""Readers: the project's metrics.jsonl and line-based training logs, one module per format family behind this
one interface:

    read_metrics_jsonl(path, where) -> FileRead     formats/rundir.py      this project's run directories
    read_log(path, where) -> FileRead               the families below, whichever wrote the file
        formats/megatron.py     Megatron-LM, Megatron-Bridge, AMD's Primus
        formats/deepspeed.py    Megatron-DeepSpeed (Megatron's iteration line, fields of its own)
        formats/nemo.py         NeMo 2, NeMo 1 / PyTorch Lightning progress bars
        formats/torchtitan.py   torchtitan

A `FileRead` is the records in the order they were written, the configuration the file prints (`header`), the run's
planned length where its records print it, and notes on what was skipped. A family (formats/base.py `Family`) is
data: the patterns that start its records, its field names, its config dumps, and where needed a reader of its own
other lines; adding a format is adding a family to `FAMILIES`.

Rules that keep a broken file from producing wrong numbers:
- a last line without a newline was cut off mid-write: skipped;
- a line holding two record starts is the output of two processes interleaved: skipped;
- a loss or step time that does not parse as a number: the record is skipped (NaN and inf do parse: they are
  kept and flagged later);
- a step that does not follow the previous one starts a new segment (a restart); its first record is warm-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from recipes.report.formats.base import FileRead, LineFormat, empty_note, make_record, mark_restarts
from recipes.report.formats.base import parse_fields, read_lines
from recipes.report.formats.config_dump import HeaderReader
from recipes.report.formats.deepspeed import DEEPSPEED
from recipes.report.formats.megatron import MEGATRON
from recipes.report.formats.nemo import NEMO
from recipes.report.formats.rundir import read_metrics_jsonl
from recipes.report.formats.torchtitan import TORCHTITAN
from recipes.report.records import Skips, Step

FAMILIES = [MEGATRON, DEEPSPEED, NEMO, TORCHTITAN]
LINE_FORMATS = list(dict.fromkeys(fmt for family in FAMILIES for fmt in family.formats))
READERS_OF = {fmt: [family for family in FAMILIES if fmt in family.formats] for fmt in LINE_FORMATS}  # whose fields

__all__ = ["FileRead", "read_log", "read_metrics_jsonl", "FAMILIES"]


def read_log(path: Path, where: str) -> FileRead:
    lines, cut = read_lines(path)
    skips = Skips(where)
    steps: list[Step] = []
    header = HeaderReader([kind for family in FAMILIES for kind in family.dumps])
    sides = [family.side() for family in FAMILIES if family.side is not None]
    per_format = {fmt.name: 0 for fmt in LINE_FORMATS}
    families_seen: set[str] = set()
    other_losses: set[str] = set()
    planned: Optional[int] = None
    redraw: Optional[Step] = None  # the record a progress bar drew last: a redraw of its step replaces it
    for line_no, line in enumerate(lines, 1):
        if any(side.line(line) for side in sides):
            continue
        starts = [(fmt, m) for fmt in LINE_FORMATS for m in fmt.start.finditer(line)]
        if not starts:
            header.feed(line)
            continue
        if cut and line_no == len(lines):
            skips.add("cut off (no newline at the end of the file)", line_no)
            continue
        if len(starts) > 1:
            skips.add("two records on one line (output of two processes interleaved)", line_no)
            continue
        fmt, match = starts[0]
        parsed = parse_fields(_fields_text(fmt, match, line), fmt, READERS_OF[fmt])
        other_losses |= parsed.other_losses
        if parsed.unreadable:
            skips.add(f"unreadable {' and '.join(parsed.unreadable)}", line_no)
            continue
        if "loss" not in parsed.values and "time_s" not in parsed.values:
            skips.add("neither a loss nor a step time", line_no)
            continue
        families_seen |= parsed.families
        record = make_record(fmt, int(match["it"]), parsed.values)
        if match.groupdict().get("total"):
            planned = int(match["total"]) + (1 if fmt.zero_based else 0)
        if fmt.redrawn and steps and steps[-1] is redraw and redraw.step == record.step:
            steps[-1] = record  # the bar drawn again for the same step, its fields updated after its count
        else:
            steps.append(record)
            per_format[fmt.name] += 1
        redraw = record if fmt.redrawn else None
        for side in sides:
            side.record(fmt, record)
    mark_restarts(steps)
    read_header = header.header()
    for side in sides:
        for key, value in side.header().items():
            read_header.setdefault(key, value)
    notes = skips.notes() + empty_note(where, lines, steps) + [note for side in sides for note in side.notes(where)]
    for family in FAMILIES:
        if family.finish is not None and family.name in families_seen:
            notes += family.finish(steps, read_header, where)
    fmt_name = max(per_format, key=per_format.get) if steps else None
    return FileRead(fmt_name, steps, header=read_header, notes=notes, other_losses=other_losses,
                    planned_steps=planned, skipped_records=skips.count(),
                    start_step=read_header.pop("start_step", None))


def _fields_text(fmt: LineFormat, match, line: str) -> str:
    """A record's fields: its `fields` group, or the rest of the line. A bar cut at the terminal's width (no
    closing bracket) loses its last field, which may be cut mid-value."""
    if "fields" not in match.groupdict():
        return line[match.end() - 1 :]
    fields = match["fields"]
    if "close" in match.groupdict() and match["close"] is None:
        fields = fields.rpartition(fmt.separator)[0]
    return fields
