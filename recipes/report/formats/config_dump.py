"""The configuration a log prints, read line by line into one dict of the keys the report knows (`HEADER_KEYS`), each
value with where it was read (`run.log line 12 (tensor_model_parallel_size)`).

Config dumps: Megatron-LM's argument list, AMD's Primus's `key : value (type)` list behind its logger's prefix
(`[...][INFO]     [------module_utils.py:227] :   fp8 : e4m3 (str)`; older versions without the type, or with
`[...module_utils.py:197]:`), the YAML of Megatron-Bridge's ConfigContainer (printed once with the recipe's defaults
and again as it ran) and of a NeMo 1 experiment, and Bridge's summary of non-default values; each family names the
dumps it prints (`DumpKind`), also those of another tool that are not the run's configuration (DeepSpeed's engine
config, whose world_size is the data-parallel size). The last dump that gives a key wins; the precision keys are
taken together from the last dump that says anything about FP8, so a later dump's `fp8: null` is never mixed with an
earlier one's recipe. Lines outside any dump (a bare `key: value`, `--fp8-format hybrid` on an echoed command line,
what a family's own lines state: `loose`) only fill keys no dump gives, the first such line winning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class DumpKind:
    name: str
    start: re.Pattern
    end: Optional[re.Pattern]  # None: the dump is YAML and ends at its first line that is not (unless `marked`)
    fp8_absent_means_off: bool = False  # Bridge's summary lists fp8 only when it differs from megatron-core's None
    marked: Optional[re.Pattern] = None  # every line of the dump carries this (its logger's prefix); ends without it
    the_runs: bool = True  # False: another tool's configuration, whose keys mean something else; none is read


Sourced = tuple[Any, str]  # a value and where it was read

# Megatron's argument dump (`  tensor_model_parallel_size ........ 2`) or a `key: value` line (YAML, a summary's
# `  fp8: 'hybrid'  (Mcore default: None)`, Primus's `fp8 : e4m3 (str)`), behind any `[...]` prefixes of a logger
# (Primus's `[------module_utils.py:227] : ` among them).
HEADER_LINE = re.compile(
    r"^\s*(?:\([^)]*\)\s*)?(?:\[[^\]]*\]\s*:?\s*)*(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*(?:\s\.{2,}\s|[:=])\s*"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,|'\"]+)\s*(?:\(Mcore default: [^)]*\)\s*)?"
    r"(?:\((?:str|int|float|bool|NoneType)\)\s*)?$"
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
    # Recomputation, which Megatron-DeepSpeed's TFLOPs count (deepspeed.py)
    "checkpoint_activations": "checkpoint_activations",
    "recompute_granularity": "recompute_granularity",
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
    if key in ("checkpoint_activations", "recompute_granularity"):  # True/False; full/selective/None
        return low not in OFF
    if key == "vp" and low in OFF:
        return 1  # Megatron: no virtual pipeline = one stage per rank
    return int(raw) if raw.isdigit() else None


def _header_item(line: str, where: str) -> Optional[tuple[str, Sourced]]:
    """A configuration line's (report key, (value, source)), or None."""
    match = HEADER_LINE.match(line)
    if not match or match["key"].lower() not in HEADER_KEYS:
        return None
    key = HEADER_KEYS[match["key"].lower()]
    value = _header_value(key, match["value"])
    return None if value is None else (key, (value, f"{where} ({match['key']})"))


class HeaderReader:
    """Collects a log's configuration, line by line, from its dumps and loose lines (see above)."""

    def __init__(self, kinds: list[DumpKind]):
        self.kinds = kinds
        self.loose: dict[str, Sourced] = {}
        self.dumps: list[tuple[DumpKind, dict[str, Sourced], str]] = []  # with where each began
        self.kind: Optional[DumpKind] = None
        self.in_yaml = False  # the YAML dump's first line has been seen
        self.since_start = 0

    def feed(self, line: str, where: str) -> None:
        """One line of the log; `where` names it (`run.log line 12`) in the sources of what it gives."""
        if self.kind is not None and self._inside(line):
            item = _header_item(line, where) if self.kind.the_runs else None
            if item is not None:
                self.dumps[-1][1].setdefault(*item)  # inside one dump a key's first value (mixed_precision's, not
                # the model's copy of it) is the one that was configured
            return
        for kind in self.kinds:
            if kind.start.search(line):
                self.kind, self.in_yaml, self.since_start = kind, False, 0
                self.dumps.append((kind, {}, where))
                if kind.end is None and kind.marked is None:
                    self._inside(line)
                return
        for flag in COMMAND_FLAG.finditer(line):
            key = HEADER_KEYS[flag["key"].replace("-", "_")]
            value = _header_value(key, flag["value"])
            if value is not None:
                self.loose.setdefault(key, (value, f"{where} (--{flag['key']})"))
        item = _header_item(line, where)
        if item is not None:
            self.loose.setdefault(*item)

    def state(self, key: str, value: Any, source: str) -> None:
        """What a family's own lines say of the configuration (torchtitan's startup lines): a loose line's value."""
        self.loose.setdefault(key, (value, source))

    def _inside(self, line: str) -> bool:
        """Whether the open dump goes on with this line; closes it when not."""
        self.since_start += 1
        if self.kind.marked is not None:
            if not self.kind.marked.search(line):
                self.kind = None
            return self.kind is not None
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

    def header(self) -> dict[str, Sourced]:
        """Each key's value and where it was read, by the rules above."""
        merged = dict(self.loose)
        dumps = [{"fp8": ("none", f"{began} ({kind.name}: no fp8 among its values)"), **values}
                 if kind.fp8_absent_means_off else values for kind, values, began in self.dumps]
        for dump in dumps:
            merged.update({key: value for key, value in dump.items() if key not in PRECISION_KEYS})
        deciding = [d for d in dumps if d.keys() & (PRECISION_KEYS - {"fp8_recipe", "bf16"})]
        if deciding:
            for key in PRECISION_KEYS:
                merged.pop(key, None)
            merged.update({key: value for key, value in deciding[-1].items() if key in PRECISION_KEYS})
        return merged
