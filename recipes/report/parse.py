"""Readers: the project's metrics.jsonl, and line-based training logs (Megatron-LM, Megatron-DeepSpeed,
Megatron-Bridge, NeMo 2, and NeMo 1 / PyTorch Lightning progress bars).

Every reader returns the same thing, a `FileRead`: the records in the order they were written, metadata found in
the file itself (the configuration it printed), and notes on what was skipped. Line-based logs share one
mechanism: a format is only the pattern that starts a record, how its iteration counts and how its fields are
written (`key: value | ...` for Megatron and NeMo 2, `key=value, ...` inside a progress bar's brackets); the
fields are looked up in one table (`FIELDS`) that also converts units. A progress bar is redrawn in place
(carriage returns): each redraw is a line, and a redraw of the step just read replaces it.

Megatron-Bridge prints its throughput on a line of its own (`Step Time : 1.23s GPU utilization:
456.7MODEL_TFLOP/s/GPU`), from rank 0, next to the iteration line of the same interval that the last rank prints:
the two are paired in the order they come, and only when their step times agree.

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
    other_losses: set[str] = field(default_factory=set)  # record keys naming a loss that is not the training loss


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
    start: re.Pattern  # matches where a record begins; group "it" is its iteration; group "fields" (if any) its fields
    zero_based: bool  # NeMo 2 counts iterations from 0, Megatron from 1 (a NeMo 1 bar counts finished steps)
    separator: str = "|"  # between fields
    assign: str = ":"  # between a field's key and its value
    redrawn: bool = False  # a progress bar: drawn again for the same step as its fields update


LINE_FORMATS = [
    # ` [2024-05-01 12:00:00] iteration      100/    1000 | consumed samples: ... |`; not NeMo's ", iteration"
    LineFormat("megatron", re.compile(r"(?<!,\s)\biteration\s+(?P<it>\d+)\s*/\s*\d+\s*\|"), zero_based=False),
    # `Training epoch 0, iteration 99/999 | lr: 0.0001 | global_step: 99 | reduced_train_loss: 2.346 | ...`
    LineFormat("nemo2", re.compile(r"Training epoch \d+, iteration (?P<it>\d+)/\d+\s*\|"), zero_based=True),
    # NeMo 1 (PyTorch Lightning's tqdm bar): `Epoch 0: : 12%|█▏  | 6/50 [00:41<05:02, reduced_train_loss=10.80,
    # global_step=5.000, consumed_samples=1536.0, train_step_timing in s=6.300]`, or `1it [00:04, 4.36s/it, ...]`
    # without a total. A bar without `key=value` fields (its first draw) is not a record.
    LineFormat(
        "nemo1",
        re.compile(r"(?<![A-Za-z])Epoch \d+:[^\[\]]*?(?:\|\s*|\s)(?P<it>\d+)(?:/(?:\d+|\?)|it)\s*"
                   r"\[[^\],]*,(?P<fields>[^\]]*=[^\]]*)\]"),
        zero_based=False,
        separator=",",
        assign="=",
        redrawn=True,
    ),
]

# Field name (lower case) -> Step attribute. A unit in the name, "(ms)", "in s", ..., scales the value to seconds.
FIELDS = [
    (re.compile(r"elapsed time per iteration(?: \((?P<unit>ms|s)\))?"), "time_s"),
    (re.compile(r"train_step_timing(?: in (?P<unit>ms|s))?"), "time_s"),
    # Megatron-LM's "lm loss"; "lm-loss" where a Megatron-DeepSpeed loss function names it as training.py's
    # docstring does
    (re.compile(r"lm[ -]loss|reduced_train_loss|train_loss|loss"), "loss"),
    (re.compile(r"throughput per gpu \(tflop/s/gpu\)|tflops_per_gpu|tflops per gpu"), "tflops_per_gpu"),
    # Megatron-DeepSpeed. Its "TFLOPs" is not read: it counts recomputation (hardware, not model, FLOPs).
    (re.compile(r"tokens per gpu per second \(tgs\)"), "tokens_per_s_per_gpu"),
    (re.compile(r"global batch size|global_batch_size"), "global_batch_size"),
    (re.compile(r"number of nan iterations"), "nan_iterations"),
    (re.compile(r"global_step"), "global_step"),
]
UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, None: 1.0}
VALUE = re.compile(r"(?P<number>[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))\s*(?P<unit>ms|s)?", re.I)
CORE_FIELDS = {"loss": "loss", "time_s": "step time"}  # a record without a readable one of these is skipped


def _parse_fields(text: str, fmt: LineFormat) -> tuple[dict[str, float], list[str], set[str]]:
    """`key: value | key: value | ...` (or the format's own separators) -> ({attribute: value in base units}, the
    core fields that were unreadable, keys naming a loss that no attribute takes)."""
    values: dict[str, float] = {}
    unreadable: list[str] = []
    other_losses: set[str] = set()
    for part in text.split(fmt.separator):
        key, sep, raw = part.partition(fmt.assign)
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
        else:
            if "loss" in key:
                other_losses.add(key)
    return values, [CORE_FIELDS[a] for a in unreadable if a in CORE_FIELDS], other_losses


# Megatron-Bridge's throughput line; `tok/s/gpu` appears in some versions.
STEP_TIME = re.compile(
    r"Step Time\s*:\s*(?P<time>\d+(?:\.\d*)?)\s*s\b(?P<rest>.*?)GPU utilization\s*:\s*"
    r"(?P<tflops>\d+(?:\.\d*)?)\s*(?:MODEL_)?TFLOP/s/GPU",
    re.I,
)
TOKENS_PER_GPU = re.compile(r"(?P<tokens>\d+(?:\.\d*)?)\s*tok/s/gpu", re.I)


class StepTimePairs:
    """Pairs Megatron-Bridge's `Step Time` lines with the iteration records of the same interval: whichever of the
    two comes first waits for the other; they pair when their step times agree (the throughput line prints rank
    0's seconds with 2 decimals, the iteration line the last rank's milliseconds)."""

    def __init__(self):
        self.pending: Optional[tuple[float, float, Optional[float]]] = None  # a Step Time line waiting
        self.waiting: Optional[Step] = None  # an iteration record waiting
        self.unpaired = 0

    def throughput(self, match: re.Match) -> None:
        tokens = TOKENS_PER_GPU.search(match["rest"])
        printed = (float(match["time"]), float(match["tflops"]), float(tokens["tokens"]) if tokens else None)
        if self.waiting is not None and self._pair(self.waiting, printed):
            self.waiting = None
        else:
            self.unpaired += self.pending is not None
            self.pending = printed

    def iteration(self, record: Step) -> None:
        if self.pending is not None and self._pair(record, self.pending):
            self.waiting = None
        else:
            self.unpaired += self.pending is not None
            self.waiting = record
        self.pending = None

    @staticmethod
    def _pair(record: Step, printed: tuple[float, float, Optional[float]]) -> bool:
        seconds, tflops, tokens = printed
        if record.time_s is None or abs(seconds - record.time_s) > 0.0051 + 0.02 * record.time_s:
            return False
        if record.tflops_per_gpu is None:  # unless the iteration line has its own (logger.log_throughput)
            record.tflops_per_gpu = tflops
        if record.tokens_per_s_per_gpu is None:
            record.tokens_per_s_per_gpu = tokens
        return True

    def note(self, where: str) -> list[str]:
        unpaired = self.unpaired + (self.pending is not None)
        if not unpaired:
            return []
        return [f"{where}: {unpaired} 'Step Time' line(s) not paired with an iteration line of the same step time: "
                "their TFLOP/s not used"]


def _record(fmt: LineFormat, iteration: int, values: dict[str, float]) -> Step:
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
        global_batch_size=int(gbs) if gbs is not None and math.isfinite(gbs) else None,
        nan_iterations=int(nan_its) if nan_its is not None and math.isfinite(nan_its) else 0,
    )


# ---- the configuration a log prints ----
#
# Config dumps: Megatron-LM's argument list, the YAML of Megatron-Bridge's ConfigContainer (printed once with the
# recipe's defaults and again as it ran) and of a NeMo 1 experiment, and Bridge's summary of non-default values.
# The last dump that gives a key wins; the precision keys are taken together from the last dump that says
# anything about FP8, so a later dump's `fp8: null` is never mixed with an earlier one's recipe. Lines outside any
# dump (a bare `key: value`, `--fp8-format hybrid` on an echoed command line) only fill keys no dump gives, the
# first such line winning.


@dataclass(frozen=True)
class DumpKind:
    name: str
    start: re.Pattern
    end: Optional[re.Pattern]  # None: the dump is YAML and ends at its first line that is not
    fp8_absent_means_off: bool = False  # Bridge's summary lists fp8 only when it differs from megatron-core's None


DUMP_KINDS = [
    DumpKind("megatron arguments", re.compile(r"-{3,}\s*arguments\s*-{3,}"), re.compile(r"-{3,}\s*end of arguments")),
    DumpKind("bridge config", re.compile(r"^\s*_target_:\s*megatron\.bridge\.training\.config\.ConfigContainer\s*$"),
             None),
    DumpKind("nemo experiment", re.compile(r"\*{3,}\s*Experiment configuration\s*\*{3,}"), None),
    DumpKind("bridge summary", re.compile(r"Configuration Summary \(Non-Default Values"), re.compile(r"^\s*={10,}\s*$"),
             fp8_absent_means_off=True),
]
# Megatron's argument dump (`  tensor_model_parallel_size ........ 2`) or a `key: value` line (YAML, a summary's
# `  fp8: 'hybrid'  (Mcore default: None)`).
HEADER_LINE = re.compile(
    r"^\s*(?:\d+:\s*)?(?:\[[^\]]*\]\s*)*(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*(?:\s\.{2,}\s|[:=])\s*"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,|'\"]+)\s*(?:\(Mcore default: [^)]*\)\s*)?$"
)
YAML_LINE = re.compile(r"^\s*(?:$|- |-$|[A-Za-z_][\w.-]*:(?:\s|$))")
COMMAND_FLAG = re.compile(r"--(?P<key>fp8-format|fp8-recipe)[ =](?P<value>[A-Za-z0-9_]+)")
HEADER_KEYS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "virtual_pipeline_model_parallel_size": "vp",
    "data_parallel_size": "dp",
    "world_size": "world_size",
    "num_nodes": "nodes",  # NeMo 1's trainer
    "devices": "gpus_per_node",  # NeMo 1's trainer
    "micro_batch_size": "mbs",
    "global_batch_size": "gbs",
    "seq_length": "seq",
    "encoder_seq_length": "seq",  # NeMo 1
    "sequence_length": "data_seq",  # Bridge's dataset: the tokens per sample actually trained
    "seed": "seed",
    "train_iters": "steps",
    "fp8": "fp8",  # hybrid / e4m3 (Megatron), true / false (NeMo 1), None / null: off
    "fp8_format": "fp8",  # --fp8-format on a command line
    "fp8_recipe": "fp8_recipe",
    "fp8_e4m3": "fp8_e4m3",  # Megatron-DeepSpeed's --fp8-e4m3 / --fp8-hybrid (NeMo 1 has them too, under its fp8)
    "fp8_hybrid": "fp8_hybrid",
    "fp4": "fp4",
    "bf16": "bf16",
    "precision": "bf16",  # NeMo 1's trainer.precision: bf16, bf16-mixed, 16, 32
    "mixed_precision": "precision_preset",  # Bridge: a preset's name, e.g. bf16_with_fp8_current_scaling_mixed
}
PRECISION_KEYS = {"fp8", "fp8_recipe", "fp8_e4m3", "fp8_hybrid", "fp4", "bf16", "precision_preset"}
OFF = {"none", "null", "false", "~", ""}
FP8_ON = {"e4m3", "hybrid", "true"}


def _header_value(key: str, raw: str) -> Any:
    raw = raw.strip("'\"")
    low = raw.lower()
    if key in ("fp8", "fp4"):
        return "none" if low in OFF else (low if key == "fp4" or low in FP8_ON else None)
    if key in ("fp8_recipe", "precision_preset"):
        return None if low in OFF else low.replace("-", "_")
    if key == "bf16":
        return "bf16" in low or low == "true"
    if key in ("fp8_e4m3", "fp8_hybrid"):
        return low == "true"
    if key == "vp" and low in OFF:
        return 1  # Megatron: no virtual pipeline = one stage per rank
    return int(raw) if raw.isdigit() else None


def _header_item(line: str) -> Optional[tuple[str, Any]]:
    match = HEADER_LINE.match(line)
    if not match or match["key"].lower() not in HEADER_KEYS:
        return None
    key = HEADER_KEYS[match["key"].lower()]
    value = _header_value(key, match["value"])
    return None if value is None else (key, value)


class HeaderReader:
    """Collects a log's configuration, line by line, from its dumps and loose lines (see above)."""

    def __init__(self):
        self.loose: dict[str, Any] = {}
        self.dumps: list[tuple[DumpKind, dict[str, Any]]] = []
        self.kind: Optional[DumpKind] = None
        self.in_yaml = False  # the YAML dump's first line has been seen
        self.since_start = 0

    def feed(self, line: str) -> None:
        if self.kind is not None and self._inside(line):
            item = _header_item(line)
            if item is not None:
                self.dumps[-1][1].setdefault(*item)  # inside one dump a key's first value (mixed_precision's, not
                # the model's copy of it) is the one that was configured
            return
        for kind in DUMP_KINDS:
            if kind.start.search(line):
                self.kind, self.in_yaml, self.since_start = kind, False, 0
                self.dumps.append((kind, {}))
                if kind.end is None:
                    self._inside(line)
                return
        for flag in COMMAND_FLAG.finditer(line):
            key = HEADER_KEYS[flag["key"].replace("-", "_")]
            value = _header_value(key, flag["value"])
            if value is not None:
                self.loose.setdefault(key, value)
        item = _header_item(line)
        if item is not None:
            self.loose.setdefault(*item)

    def _inside(self, line: str) -> bool:
        """Whether the open dump goes on with this line; closes it when not."""
        self.since_start += 1
        if self.kind.end is not None:
            if self.kind.end.search(line) and self.since_start > 2:  # a summary's own "====" under its title
                self.kind = None
            return self.kind is not None
        if YAML_LINE.match(line):
            self.in_yaml = self.in_yaml or bool(line.strip())
            return True
        if not self.in_yaml and self.since_start <= 3:
            return True  # the logger's prefix line between NeMo's title and the YAML
        self.kind = None
        return False

    def header(self) -> dict[str, Any]:
        merged = dict(self.loose)
        dumps = [{"fp8": "none", **values} if kind.fp8_absent_means_off else values for kind, values in self.dumps]
        for dump in dumps:
            merged.update({key: value for key, value in dump.items() if key not in PRECISION_KEYS})
        deciding = [d for d in dumps if d.keys() & (PRECISION_KEYS - {"fp8_recipe", "bf16"})]
        if deciding:
            for key in PRECISION_KEYS:
                merged.pop(key, None)
            merged.update({key: value for key, value in deciding[-1].items() if key in PRECISION_KEYS})
        return merged


# ---- reading a log ----


def read_log(path: Path, where: str) -> FileRead:
    lines, cut = read_lines(path)
    skips = Skips(where)
    steps: list[Step] = []
    header = HeaderReader()
    pairs = StepTimePairs()
    per_format = {fmt.name: 0 for fmt in LINE_FORMATS}
    other_losses: set[str] = set()
    redraw: Optional[Step] = None  # the record a progress bar drew last: a redraw of its step replaces it
    for line_no, line in enumerate(lines, 1):
        throughput = STEP_TIME.search(line)
        if throughput:
            pairs.throughput(throughput)
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
        fields = match["fields"] if "fields" in match.groupdict() else line[match.end() - 1 :]
        values, unreadable, losses = _parse_fields(fields, fmt)
        other_losses |= losses
        if unreadable:
            skips.add(f"unreadable {' and '.join(unreadable)}", line_no)
            continue
        if "loss" not in values and "time_s" not in values:
            skips.add("neither a loss nor a step time", line_no)
            continue
        record = _record(fmt, int(match["it"]), values)
        if fmt.redrawn and steps and steps[-1] is redraw and redraw.step == record.step:
            steps[-1] = record  # the bar drawn again for the same step, its fields updated after its count
        else:
            steps.append(record)
            per_format[fmt.name] += 1
        redraw = record if fmt.redrawn else None
        if fmt.name == "megatron":
            pairs.iteration(record)
    mark_restarts(steps)
    fmt_name = max(per_format, key=per_format.get) if steps else None
    notes = skips.notes() + _empty_note(where, lines, steps) + pairs.note(where)
    return FileRead(fmt_name, steps, header=header.header(), notes=notes, other_losses=other_losses)
