"""Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed megatron/training.py `training_log`): Megatron's iteration line
and argument dump, with fields of its own at the end of the line:

    ... | samples per second: 256.000 | tokens per gpu per second (tgs): 64000.000 | TFLOPs: 150.00 |

`TFLOPs` is megatron/utils.py `throughput_calculator`: per GPU, the whole S x S attention matrix counted (not
causal), and the recomputed forward added when `--checkpoint-activations` or `--recompute-granularity` is on. Without
recomputation it is model FLOPs (by its own formula) and is read; with it, it counts hardware FLOPs and is dropped,
saying so. Tokens/s/GPU (its tgs, or samples per second x sequence / GPUs) is the figure to compare across tools.

DeepSpeed prints its engine's configuration too (deepspeed/runtime/config.py `DeepSpeedConfig.print`, every line
behind its logger's `[config.py:1000:print]`): its `world_size` is the data-parallel size (`mpu.
get_data_parallel_world_size()`), not the run's GPUs, so none of its values is read as the run's. Launched on
several nodes through pdsh, every line carries the host's name (formats/prefixes.py).
"""

from __future__ import annotations

import re
from typing import Any

from recipes.report.formats.base import Family
from recipes.report.formats.config_dump import DumpKind
from recipes.report.formats.megatron import ITERATION
from recipes.report.records import Step

FIELDS = [
    (re.compile(r"tokens per gpu per second \(tgs\)"), "tokens_per_s_per_gpu"),
    (re.compile(r"samples per second"), "samples_per_s"),
    (re.compile(r"tflops"), "tflops_per_gpu"),
]


def finish(steps: list[Step], header: dict[str, Any], where: str) -> list[str]:
    read = [record for record in steps if record.tflops_per_gpu is not None]
    if not read:
        return []
    recompute = [key for key in ("checkpoint_activations", "recompute_granularity") if header.get(key)]
    if recompute:
        for record in read:
            record.tflops_per_gpu = None
        return [f"{where}: Megatron-DeepSpeed's TFLOPs not used: with {' and '.join(recompute)} on they count the "
                "recomputed forward (hardware, not model, FLOPs)"]
    return [f"{where}: TFLOP/s/GPU are Megatron-DeepSpeed's own (the whole attention matrix counted, where Megatron-LM "
            "and NeMo count half): compare tokens/s/GPU across tools"]


# Each line of it, its title `DeepSpeedEngine configuration:` among them, so a log cut before the title is read alike
ENGINE_CONFIG_LINE = re.compile(r"\[config\.py:\d+:print\]")
DUMPS = [DumpKind("deepspeed engine config", ENGINE_CONFIG_LINE, None, marked=ENGINE_CONFIG_LINE, the_runs=False)]

DEEPSPEED = Family("Megatron-DeepSpeed", formats=[ITERATION], fields=FIELDS, dumps=DUMPS, finish=finish)
