"""torchtitan (pytorch/torchtitan torchtitan/train.py and components/metrics.py `MetricsProcessor.log`).

- Its step line every `metrics.log_freq` steps (and at step 1), behind the logger's `[titan] <time> - root - INFO - `
  and in terminal colours: `step: 10  loss:  7.8653  grad_norm:  1.2345  memory: 37.57GiB(39.55%)  tps: 6,862
  tflops: 397.31  mfu: 40.17%` (2024: `wps` for tps, no grad_norm or tflops). tps is tokens per second per GPU over
  the interval; `validate step: ...` lines are validation, not read. Its tflops and mfu count the
  whole attention matrix (not causal; recipes.metrics.flops_per_token), so they are not read: the TFLOP/s/GPU
  column stays empty and tokens/s/GPU is the figure to compare. It prints no step time: a speedup over BF16 is then
  the ratio of tokens/s/GPU (table.py).
- What ran, from its startup lines: the job config (`Running with args: {...}`, with `--job.print_args`: model name
  and flavor, `model.converters` naming the float8 or mx converter, `float8.recipe_name`, `mx.recipe_name`, 2024's
  `float8.enable_float8_linear` and `scaling_type_input`, the parallel degrees, sequence length and steps), the
  converter's own line (`Float8 training active with recipe rowwise`, `Float8 tensorwise scaled training active`;
  2024's bare `Float8 training active` says FP8 without its scaling), the device mesh (`Building 1-D device mesh with
  ['dp_shard'], [8]`: the GPU count), the trainer's summary (global batch, sequence length, total steps) and
  `Training starts at step N` (N > 1: resumed from a checkpoint). The precision comes from these, never from the
  file name where they say otherwise.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Optional

from recipes.report.formats.base import Family, LineFormat
from recipes.report.records import Step

STEP = LineFormat(
    "torchtitan",
    # not `validate step:` (its validation line)
    re.compile(r"(?<![\w.-])(?<!validate )step:\s*(?P<it>\d+)\s+(?=loss:)"),
    zero_based=False,
    pairs=re.compile(r"(?P<key>[a-z_]+):\s*(?P<value>\S+)"),
)

FIELDS = [
    (re.compile(r"loss"), "loss"),
    (re.compile(r"grad_norm"), "grad_norm"),
    (re.compile(r"tps|wps"), "tokens_per_s_per_gpu"),  # wps in 2024's versions: the same count
]

ARGS = re.compile(r"Running with args: (?P<args>\{.*\})\s*$")
FLOAT8 = re.compile(r"Float8 (?:(?P<tensorwise>tensorwise) scaled training"
                    r"|training active(?: with recipe (?P<recipe>\w+))?)")
MX = re.compile(r"Swapped to MXLinear layers|Converted Linear layers to MXFP8Linear")
MESH = re.compile(r"Building \d+-D device mesh with \[[^\]]*\], \[(?P<dims>[\d, ]+)\]")
TRAINER = re.compile(r"Trainer is initialized with .*?global batch size (?P<gbs>\d+),.*?sequence length (?P<seq>\d+), "
                     r"total steps (?P<steps>\d+)")
MODEL = re.compile(r"Building (?P<name>\w+) (?P<flavor>\w+) with ")
START = re.compile(r"Training starts at step (?P<step>\d+)")

# torchtitan's (model name, flavor) -> conf/model's name
MODELS = {("llama3", "8b"): "llama3_8b", ("llama3", "70b"): "llama3_70b", ("llama3", "405b"): "llama31_405b"}


def quantized_precision(recipe: Optional[str]) -> str:
    """A float8 or MX recipe name as torchtitan's converters take it -> the precision it trains in."""
    if recipe is None or recipe == "tensorwise":
        return "fp8_current"  # per-tensor scales from the current tensor: TE's Float8CurrentScaling
    if recipe.startswith("mxfp8"):
        return "mxfp8"  # mxfp8, mxfp8_cublas, mxfp8_rceil: 32-element blocks with E8M0 scales
    return f"fp8_{recipe}" if not recipe.startswith("fp8") else recipe  # rowwise: not a recipe of this project


class StartupLines:
    """torchtitan's startup lines -> the header keys they state."""

    def __init__(self):
        self.stated: dict[str, Any] = {}

    def line(self, line: str) -> bool:
        for pattern, read in READERS:
            match = pattern.search(line)
            if match:
                for key, value in read(match).items():
                    if value is not None:
                        self.stated.setdefault(key, value)
                return True
        return False

    def record(self, fmt: LineFormat, record: Step) -> None:
        pass

    def notes(self, where: str) -> list[str]:
        return []

    def header(self) -> dict[str, Any]:
        return self.stated


def _job_config(match: re.Match) -> dict[str, Any]:
    try:
        config = ast.literal_eval(match["args"])
    except (ValueError, SyntaxError):
        return {}

    def section(name: str) -> dict:
        return config.get(name) if isinstance(config.get(name), dict) else {}

    def degree(key: str) -> Optional[int]:  # -1: as many as the GPUs left (data parallel), not a stated size
        value = parallel.get(key)
        return value if isinstance(value, int) and value > 0 else None

    model, training, parallel = section("model"), section("training"), section("parallelism")
    converters = model.get("converters") or []
    float8 = section("float8")
    if "float8" in converters:
        precision = quantized_precision(float8.get("recipe_name"))
    elif float8.get("enable_float8_linear"):  # 2024's switch, its scaling per operand: dynamic (current) or delayed
        precision = "fp8_delayed" if float8.get("scaling_type_input") == "delayed" else "fp8_current"
    elif "mx" in converters:
        precision = quantized_precision(section("mx").get("recipe_name") or "mxfp8")
    elif not converters and training.get("mixed_precision_param") == "bfloat16":
        precision = "bf16"
    else:
        precision = None
    return {
        "precision_preset": precision,
        "model": MODELS.get((str(model.get("name")), str(model.get("flavor")).lower())),
        "tp": degree("tensor_parallel_degree"),
        "pp": degree("pipeline_parallel_degree"),
        "cp": degree("context_parallel_degree"),
        "seq": training.get("seq_len"),
        "steps": training.get("steps"),
    }


READERS = [
    (ARGS, _job_config),
    # 2024's bare `Float8 training active` names no scaling (dynamic or delayed): FP8, recipe unknown
    (FLOAT8, lambda m: {"precision_preset": quantized_precision(m["recipe"] or m["tensorwise"])
                        if m["recipe"] or m["tensorwise"] else "fp8"}),
    (MX, lambda m: {"precision_preset": "mxfp8"}),
    (MESH, lambda m: {"world_size": math.prod(int(d) for d in m["dims"].split(","))}),
    (TRAINER, lambda m: {"gbs": int(m["gbs"]), "seq": int(m["seq"]), "steps": int(m["steps"])}),
    (MODEL, lambda m: {"model": MODELS.get((m["name"], m["flavor"].lower()))}),
    (START, lambda m: {"start_step": int(m["step"])}),
]

TORCHTITAN = Family("torchtitan", formats=[STEP], fields=FIELDS, side=StartupLines)
