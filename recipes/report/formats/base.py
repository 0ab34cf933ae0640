"""What every format family shares: the `FileRead` a reader returns, the `Family` a format family declares, and the
reading of one record's `key: value` fields (units converted, thousands separators dropped).

A family is data: the patterns that start its records (`LineFormat`), the field names it writes (`FIELDS`, each
mapped to a `Step` attribute), the configuration dumps it prints (config_dump.DumpKind), and, where it needs one, a
reader of its own other lines (`SideLines`: Megatron-Bridge's throughput lines, torchtitan's startup lines) and a
last look at what was read (`finish`: Megatron-DeepSpeed's TFLOPs, kept only where they are model FLOPs).
Everything read keeps where it was read: a record its line, a configuration value its line and printed key.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from recipes.report.formats.config_dump import DumpKind, Sourced
from recipes.report.records import Step


@dataclass
class FileRead:
    format: Optional[str]
    steps: list[Step]  # in the order written; repeats not yet removed
    header: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    other_losses: set[str] = field(default_factory=set)  # record keys naming a loss that is not the training loss
    planned_steps: Optional[int] = None  # the run's length as its records print it (`iteration 10/ 100`)
    skipped_records: int = 0  # records (lines, for a log) that could not be read
    start_step: Optional[int] = None  # the step the log says training started at (torchtitan: > 1 when resumed)
    header_sources: dict[str, str] = field(default_factory=dict)  # header key -> `run.log line 12 (printed key)`
    field_keys: dict[str, str] = field(default_factory=dict)  # Step attribute -> the name the records print it under
    planned_source: str = ""  # the line that printed planned_steps
    claimed: bool = True  # False: a format this reader does not claim, read as the one its lines look like (`format`)


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


ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # torchtitan colours its step line; a log file keeps the codes


# A log of a million steps at a few hundred bytes a line is well under 1 GiB; a file past 2 GiB is no training log
# (a core dump, a disk image, a runaway process's output), and read_lines would hold several times its size in memory.
MAX_INPUT_BYTES = 2 * 2**30


class UnusableFile(ValueError):
    """An input file that is not read: not a regular file, larger than MAX_INPUT_BYTES, or refused by the system (a
    symbolic link loop, no permission). The message says which."""


def file_problem(info: os.stat_result) -> Optional[str]:
    """Why a file of this status is not read as an input, or None: a FIFO would block the read until a writer came,
    a device (/dev/zero) would never end, and a file past MAX_INPUT_BYTES would fill the memory."""
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device file")
        return f"{kind}, not a regular file"
    if info.st_size > MAX_INPUT_BYTES:
        return f"{info.st_size:,} bytes, more than the {MAX_INPUT_BYTES // 2**30} GiB an input file may be"
    return None


def system_reason(error: OSError) -> str:
    """An OSError's reason in a note's words; ELOOP named for what it is."""
    return "a symbolic link loop" if error.errno == errno.ELOOP else error.strerror.lower()


def read_input(path: Path) -> bytes:
    """The bytes of the input file `path`; UnusableFile where file_problem or the system refuses it. Opened without
    blocking (a FIFO would wait for a writer) and checked on the open file, so that what is read is what was checked;
    read up to the bound, should the file grow meanwhile."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            problem = file_problem(os.fstat(file.fileno()))
            if problem:
                raise UnusableFile(problem)
            return file.read(MAX_INPUT_BYTES)
    except OSError as error:
        raise UnusableFile(system_reason(error)) from None


def read_lines(path: Path) -> tuple[list[str], bool]:
    """The file's lines (undecodable bytes replaced, terminal colour codes removed) and whether its last line was
    cut off (no final newline). UnusableFile where it cannot be read (read_input)."""
    text = read_input(path).decode("utf-8", errors="replace")
    cut = bool(text) and not text.endswith("\n")
    return ANSI_COLOUR.sub("", text).splitlines(), cut


def empty_note(where: str, lines: list[str], steps: list[Step]) -> list[str]:
    if steps:
        return []
    return [f"{where}: {'empty file' if not any(line.strip() for line in lines) else 'no training records found'}"]


@dataclass(frozen=True)
class LineFormat:
    name: str
    # Where a record begins: group "it" its iteration, "total" (if any) the planned iterations, "fields" (if any) its
    # fields (else the rest of the line), "close" (if any) the bracket that ends them (absent: the line was cut).
    start: re.Pattern
    zero_based: bool  # NeMo 2 counts iterations from 0, Megatron from 1 (a NeMo 1 bar counts finished steps)
    separator: str = "|"  # between fields
    assign: str = ":"  # between a field's key and its value
    redrawn: bool = False  # a progress bar: drawn again for the same step as its fields update
    pairs: Optional[re.Pattern] = None  # fields as `key: value` matches where no separator splits them (torchtitan)
    # Tools this reader does not claim print lines of the same shape (GPT-NeoX forked Megatron's iteration line): a
    # file of it is claimed only where a record names its loss as a family here does
    shape_shared: bool = False


Fields = list[tuple[re.Pattern, str]]  # field name (lower case) -> Step attribute


class SideLines(Protocol):
    """A family's reader of lines that are neither records nor configuration, and of the records they belong to."""

    # True: the line was this reader's (not a record, not configuration); `where` names it (`run.log line 12`)
    def line(self, line: str, where: str) -> bool: ...

    def record(self, fmt: LineFormat, record: Step) -> None: ...

    def notes(self, where: str) -> list[str]: ...

    def header(self) -> dict[str, Sourced]: ...  # what its lines state of the configuration, and where


@dataclass(frozen=True)
class Family:
    name: str  # as the report names it
    formats: list[LineFormat] = field(default_factory=list)
    fields: Fields = field(default_factory=list)
    dumps: list[DumpKind] = field(default_factory=list)
    side: Optional[Callable[[], SideLines]] = None  # a fresh reader for each file
    # (the file's records, its header, where) -> notes; may change the records (a field that is not what it seems)
    finish: Optional[Callable[[list[Step], dict[str, Any], str], list[str]]] = None


# A number, NaN or inf, with its own unit; `a/b` (AMD's Primus: this interval's value / its running average) and
# `a (avg b)` give the first.
VALUE = re.compile(
    r"(?P<number>[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))\s*(?P<unit>ms|s)?"
    r"(?:\s*/\s*[-+]?[\d.e+-]+|\s*\(avg\s*[-+]?[\d.e+-]+\))?%?",
    re.I,
)
UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, None: 1.0}
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
CORE_FIELDS = {"loss": "loss", "time_s": "step time"}  # a record without a readable one of these is skipped


@dataclass
class ParsedFields:
    values: dict[str, float]  # Step attribute -> value in base units
    unreadable: list[str]  # core fields whose value is no number
    other_losses: set[str]  # keys naming a loss that no attribute takes
    families: set[str]  # the families whose fields these are
    keys: dict[str, str]  # Step attribute -> the key it was read under, as printed


def parse_fields(text: str, fmt: LineFormat, families: list[Family]) -> ParsedFields:
    """`key: value | key: value | ...` (or the format's own separators), each key looked up in the families'
    field tables in turn."""
    values: dict[str, float] = {}
    unreadable: list[str] = []
    other_losses: set[str] = set()
    seen: set[str] = set()
    keys: dict[str, str] = {}
    fields = [(pattern, attribute, family.name) for family in families for pattern, attribute in family.fields]
    for printed, raw in _items(text, fmt):
        key = " ".join(printed.lower().split())
        for pattern, attribute, family in fields:
            name = pattern.fullmatch(key)
            if not name:
                continue
            seen.add(family)
            value = VALUE.fullmatch(raw.strip() if fmt.separator == "," else THOUSANDS.sub("", raw.strip()))
            if value is None:
                unreadable.append(attribute)
            elif attribute not in values:
                unit = value["unit"].lower() if value["unit"] else name.groupdict().get("unit")
                scale = UNIT_SECONDS[unit] if attribute == "time_s" else 1.0
                values[attribute] = float(value["number"]) * scale
                keys[attribute] = " ".join(printed.split())
            break
        else:
            if "loss" in key:
                other_losses.add(key)
    return ParsedFields(values, [CORE_FIELDS[a] for a in unreadable if a in CORE_FIELDS], other_losses, seen, keys)


def _items(text: str, fmt: LineFormat) -> list[tuple[str, str]]:
    if fmt.pairs is not None:
        return [(m["key"], m["value"]) for m in fmt.pairs.finditer(text)]
    items = []
    for part in text.split(fmt.separator):
        key, sep, raw = part.partition(fmt.assign)
        if sep:
            items.append((key, raw))
    return items


def make_record(fmt: LineFormat, iteration: int, values: dict[str, float], where: str, line: int) -> Step:
    step = iteration + 1 if fmt.zero_based else iteration
    if "global_step" in values and math.isfinite(values["global_step"]):
        # NeMo's global_step is 0-based like its iteration. A NeMo 1 bar is drawn once more after the last step's
        # validation with the trainer's global step by then (the count of finished steps): the count caps it.
        from_global = int(values["global_step"]) + 1
        step = min(from_global, step) if fmt.redrawn else from_global
    gbs = values.get("global_batch_size")
    nan_its = values.get("nan_iterations")
    return Step(
        step=step,
        loss=values.get("loss"),
        time_s=values.get("time_s"),
        tflops_per_gpu=values.get("tflops_per_gpu"),
        tokens_per_s_per_gpu=values.get("tokens_per_s_per_gpu"),
        samples_per_s=values.get("samples_per_s"),
        grad_norm=values.get("grad_norm"),
        global_batch_size=int(gbs) if gbs is not None and math.isfinite(gbs) else None,
        nan_iterations=int(nan_its) if nan_its is not None and math.isfinite(nan_its) else 0,
        where=where,
        line=line,
    )
