"""Readers: the project's metrics.jsonl and line-based training logs, one module per format family behind this
one interface:

    read_metrics_jsonl(path, where) -> FileRead     formats/rundir.py      this project's run directories
    read_log(path, where) -> FileRead               the families below, whichever wrote the file
        formats/megatron.py     Megatron-LM, Megatron-Bridge, AMD's Primus
        formats/deepspeed.py    Megatron-DeepSpeed (Megatron's iteration line, fields of its own)
        formats/nemo.py         NeMo 2, NeMo 1 / PyTorch Lightning progress bars
        formats/torchtitan.py   torchtitan

A `FileRead` is the records in the order they were written, the configuration the file prints (`header`), the run's
planned length where its records print it, and notes on what was skipped; every record keeps its line, every
configuration value the line and key it was read from (`header_sources`). A family (formats/base.py `Family`) is
data: the patterns that start its records, its field names, its config dumps, and where needed a reader of its own
other lines; adding a format is adding a family to `FAMILIES`. Launchers' prefixes (pdsh's host, srun's task,
torchrun's rank: formats/prefixes.py) are stripped from every line before any family sees it.

Rules that keep a broken file from producing wrong numbers:
- a last line without a newline was cut off mid-write: skipped;
- a line holding two record starts is the output of two processes interleaved: skipped;
- a loss or step time that does not parse as a number: the record is skipped (NaN and inf do parse: they are
  kept and flagged later); a progress bar's record stands on its count alone (its fields may all be cut off);
- a record that repeats an earlier one of the same process exactly (same step, same values: two loggers printing one
  line, as Primus does) is one record; a step that does not follow the previous one with other values starts a new
  segment (a restart), its first record warm-up;
- a file whose lines have a shape other tools print too (Megatron's iteration line), without a record naming its
  loss as a family here does, is a format this reader does not claim: it is read as the format its lines look like,
  said so, for its records' fields except TFLOP/s (whose FLOP count is the tool's own), and none of its printed
  configuration (whose keys may mean something else there: DeepSpeed's world_size is its data-parallel size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from recipes.report.formats.base import FileRead, LineFormat, empty_note, make_record, mark_restarts
from recipes.report.formats.base import parse_fields, read_lines
from recipes.report.formats.config_dump import HeaderReader, Sourced
from recipes.report.formats.deepspeed import DEEPSPEED
from recipes.report.formats.megatron import MEGATRON
from recipes.report.formats.nemo import NEMO
from recipes.report.formats.prefixes import describe, strip_launcher_prefixes
from recipes.report.formats.rundir import read_metrics_jsonl
from recipes.report.formats.torchtitan import TORCHTITAN
from recipes.report.records import Skips, Step

FAMILIES = [MEGATRON, DEEPSPEED, NEMO, TORCHTITAN]
LINE_FORMATS = list(dict.fromkeys(fmt for family in FAMILIES for fmt in family.formats))
READERS_OF = {fmt: [family for family in FAMILIES if fmt in family.formats] for fmt in LINE_FORMATS}  # whose fields

__all__ = ["FileRead", "read_log", "read_metrics_jsonl", "FAMILIES"]


def read_log(path: Path, where: str) -> FileRead:
    raw_lines, cut = read_lines(path)
    lines, origins = strip_launcher_prefixes(raw_lines)
    skips = Skips(where)
    steps: list[Step] = []
    header = HeaderReader([kind for family in FAMILIES for kind in family.dumps])
    sides = [family.side() for family in FAMILIES if family.side is not None]
    per_format = {fmt.name: 0 for fmt in LINE_FORMATS}
    families_seen: set[str] = set()
    other_losses: set[str] = set()
    field_keys: dict[str, str] = {}
    planned: Optional[tuple[int, str]] = None
    redraw: Optional[Step] = None  # the record a progress bar drew last: a redraw of its step replaces it
    readings: set[tuple] = set()  # what each record of this process said: one printed again is not a second record
    repeats = 0
    for line_no, (line, origin) in enumerate(zip(lines, origins), 1):
        at = f"{where} line {line_no}" + (f" [{origin}]" if origin else "")
        if any(side.line(line, at) for side in sides):
            continue
        starts = [(fmt, m) for fmt in LINE_FORMATS for m in fmt.start.finditer(line)]
        if not starts:
            header.feed(line, at)
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
        if "loss" not in parsed.values and "time_s" not in parsed.values and not fmt.redrawn:
            skips.add("neither a loss nor a step time", line_no)
            continue
        families_seen |= parsed.families
        for attribute, key in parsed.keys.items():
            field_keys.setdefault(attribute, key)
        record = make_record(fmt, int(match["it"]), parsed.values, where, line_no)
        if match.groupdict().get("total"):
            total = int(match["total"]) + (1 if fmt.zero_based else 0)
            planned = (total, f"{at} (record {match['it']}/{match['total']})")
        if fmt.redrawn and steps and steps[-1] is redraw and redraw.step == record.step:
            steps[-1] = record  # the bar drawn again for the same step, its fields updated after its count
        elif record.reading() in readings:
            repeats += 1
            continue
        else:
            if steps and record.step <= steps[-1].step:
                readings = set()  # a restart: a step it redoes alike is its own record, not a second print
            steps.append(record)
            per_format[fmt.name] += 1
        readings.add(record.reading())
        redraw = record if fmt.redrawn else None
        for side in sides:
            side.record(fmt, record)
    mark_restarts(steps)
    sourced = header.header()
    for side in sides:
        for key, value in side.header().items():
            sourced.setdefault(key, value)
    notes = skips.notes() + empty_note(where, lines, steps) + [note for side in sides for note in side.notes(where)]
    notes += describe(origins, where)
    if repeats:
        notes.append(f"{where}: {repeats} record(s) printed again with the same step and values (two loggers): "
                     "read once")
    fmt_name = max(per_format, key=per_format.get) if steps else None
    claimed = _claimed(fmt_name, steps)
    if not claimed:
        notes.append(_assumed(where, fmt_name, other_losses))
        sourced = {}  # its keys may mean something else in that tool
        for record in steps:
            record.tflops_per_gpu = None  # counted by that tool's own FLOP formula
        field_keys.pop("tflops_per_gpu", None)
    for family in FAMILIES:
        if claimed and family.finish is not None and family.name in families_seen:
            notes += family.finish(steps, _values(sourced), where)
    start = sourced.pop("start_step", None)
    return FileRead(fmt_name, steps, header=_values(sourced), notes=notes, other_losses=other_losses,
                    planned_steps=planned[0] if planned else None, skipped_records=skips.count(),
                    start_step=start[0] if start else None, claimed=claimed,
                    header_sources={key: source for key, (_, source) in sourced.items()},
                    field_keys=field_keys, planned_source=planned[1] if planned else "")


def _values(sourced: dict[str, Sourced]) -> dict[str, Any]:
    return {key: value for key, (value, _) in sourced.items()}


def _claimed(fmt_name: Optional[str], steps: list[Step]) -> bool:
    """Whether a family here wrote the file: a line shape only it prints, or a record naming the loss as it does."""
    fmt = next((f for f in LINE_FORMATS if f.name == fmt_name), None)
    return fmt is None or not fmt.shape_shared or any(record.loss is not None for record in steps)


def _assumed(where: str, fmt_name: str, other_losses: set[str]) -> str:
    named = f" (its records name {', '.join(sorted(other_losses))})" if other_losses else ""
    return (f"{where}: a format this reader does not claim: no record names its loss as Megatron-LM, "
            f"Megatron-Bridge, Primus or Megatron-DeepSpeed do{named}; read as {fmt_name}'s lines for their step, "
            "step time and the fields named as there, not their TFLOP/s (the tool's own FLOP count), and none of "
            "the configuration it prints: supply what it ran with --label")


def _fields_text(fmt: LineFormat, match, line: str) -> str:
    """A record's fields: its `fields` group, or the rest of the line. A bar cut at the terminal's width (no
    closing bracket) loses its last field, which may be cut mid-value."""
    if "fields" not in match.groupdict():
        return line[match.end() - 1 :]
    fields = match["fields"]
    if "close" in match.groupdict() and match["close"] is None:
        fields = fields.rpartition(fmt.separator)[0]
    return fields
