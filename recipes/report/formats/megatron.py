"""Megatron-LM, Megatron-Bridge and AMD's Primus (Megatron-LM behind a patch of its log line).

- The iteration line every log interval (Megatron-LM training.py `training_log`, printed by the last rank):
  ` [2024-05-01 12:00:00] iteration      100/    1000 | consumed samples: ... | elapsed time per iteration (ms):
  1234.5 | throughput per GPU (TFLOP/s/GPU): 456.7 | ... | lm loss: 2.345678E+00 | ... |`. Primus writes the time,
  TFLOP/s and tokens/s as `this interval/running average` (`32208.7/32208.7`, `456.7 (avg 455.0)`): the first is
  Megatron's own figure, the one read. On one node Primus also forwards the last rank's line to rank 0
  (primus/backends/megatron/patches/training_log/print_rank_last_patches.py `_forward_single_node_training_log`),
  so each line is printed twice with the same values: one record (parse.py).
- Other tools print lines of this shape (GPT-NeoX, a fork of Megatron, its `lm_loss` and `approx flops per GPU`): a
  file is read as one of the formats here only where a record names its loss `lm loss` (`lm-loss`); otherwise its
  format is one this reader does not claim, and it yields only what it states unambiguously (parse.py).
- Megatron-Bridge prints its throughput on a line of its own (`Step Time : 1.23s GPU utilization:
  456.7MODEL_TFLOP/s/GPU`), from rank 0, next to the iteration line of the same interval that the last rank prints:
  the two are paired in the order they come, and only when their step times agree (`StepTimePairs`).
- Config dumps: Megatron-LM's argument list, Bridge's ConfigContainer YAML and its summary of non-default values,
  Primus's `log_dict_aligned` list (primus/core/utils/module_utils.py: `Final backend args (after patches): (N
  parameters)`, then `  key : value (type)` lines, then a line of dashes).
"""

from __future__ import annotations

import re
from typing import Optional

from recipes.report.formats.base import Family, LineFormat
from recipes.report.formats.config_dump import DumpKind, Sourced
from recipes.report.records import Step

ITERATION = LineFormat(
    "megatron",
    # not NeMo 2's ", iteration"
    re.compile(r"(?<!,\s)\biteration\s+(?P<it>\d+)\s*/\s*(?P<total>\d+)\s*\|"),
    zero_based=False,
    shape_shared=True,
)

FIELDS = [
    (re.compile(r"elapsed time(?: per iteration)?(?: \((?P<unit>ms|s)\))?"), "time_s"),
    # Megatron-LM's "lm loss"; "lm-loss" where a Megatron-DeepSpeed loss function names it as training.py's
    # docstring does
    (re.compile(r"lm[ -]loss"), "loss"),
    (re.compile(r"(?:throughput|compute) per gpu \(tflop/s/gpu\)"), "tflops_per_gpu"),
    (re.compile(r"tokens per gpu \(tokens/s/gpu\)|tokens/s/gpu inst/harmonic mean"), "tokens_per_s_per_gpu"),
    (re.compile(r"global batch size"), "global_batch_size"),
    (re.compile(r"number of nan iterations"), "nan_iterations"),
    (re.compile(r"grad norm"), "grad_norm"),
]

DUMPS = [
    DumpKind("megatron arguments", re.compile(r"-{3,}\s*arguments\s*-{3,}"), re.compile(r"-{3,}\s*end of arguments")),
    DumpKind("bridge config", re.compile(r"^\s*_target_:\s*megatron\.bridge\.training\.config\.ConfigContainer\s*$"),
             None),
    DumpKind("bridge summary", re.compile(r"Configuration Summary \(Non-Default Values"), re.compile(r"^\s*={10,}\s*$"),
             fp8_absent_means_off=True),
    DumpKind("primus arguments", re.compile(r": \(\d+ parameters\)\s*$"), re.compile(r"-{40,}\s*$")),
]

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

    def line(self, line: str, where: str) -> bool:
        match = STEP_TIME.search(line)
        if not match:
            return False
        tokens = TOKENS_PER_GPU.search(match["rest"])
        printed = (float(match["time"]), float(match["tflops"]), float(tokens["tokens"]) if tokens else None)
        if self.waiting is not None and self._pair(self.waiting, printed):
            self.waiting = None
        else:
            self.unpaired += self.pending is not None
            self.pending = printed
        return True

    def record(self, fmt: LineFormat, record: Step) -> None:
        if fmt is not ITERATION:
            return
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

    def notes(self, where: str) -> list[str]:
        unpaired = self.unpaired + (self.pending is not None)
        if not unpaired:
            return []
        return [f"{where}: {unpaired} 'Step Time' line(s) not paired with an iteration line of the same step time: "
                "their TFLOP/s not used"]

    def header(self) -> dict[str, Sourced]:
        return {}


MEGATRON = Family("Megatron-LM / Megatron-Bridge", formats=[ITERATION], fields=FIELDS, dumps=DUMPS, side=StepTimePairs)
