"""torchtitan (pytorch/torchtitan torchtitan/train.py and components/metrics.py `MetricsProcessor.log`).

- Its step line every `metrics.log_freq` steps (and at step 1), behind the logger's `[titan] <time> - root - INFO - `
  and in terminal colours: `step: 10  loss:  7.8653  grad_norm:  1.2345  memory: 37.57GiB(39.55%)  tps: 6,862
  tflops: 397.31  mfu: 40.17%` (2024: `wps` for tps, no grad_norm or tflops). tps is tokens per second per GPU over
  the interval; `validate step: ...` lines are validation, not read. Its tflops and mfu count the
  whole attention matrix (not causal; recipes.metrics.flops_per_token), so they are not read: the TFLOP/s/GPU
  column stays empty and tokens/s/GPU is the figure to compare. It prints no step time: a speedup over BF16 is then
  the ratio of tokens/s/GPU (table.py).
- What ran, from its settings, wherever the log shows them: the job config it resolved (`Running with args: {...}`,
  with `--job.print_args`), the flags of its launch line (run_train.sh runs with `set -x`: `+ torchrun ... -m
  torchtitan.train --job.config_file llama3_8b.toml --training.dtype=bfloat16`) and the TOML file echoed into the log
  (`[training]` then `dtype = "bfloat16"`), the resolved config first, then the flags over the TOML (as torchtitan
  reads them): model name and flavor, `model.converters` naming the float8 or mx converter (`quantize.linear.float8`
  from late 2025), `float8.recipe_name`, `mx.recipe_name`, 2024's `float8.enable_float8_linear` and
  `scaling_type_input`, `training.dtype` and `training.mixed_precision_param`, the parallel degrees, sequence length
  and steps.
- Its own lines: the converter's (components/quantization: `Float8 training active with recipe rowwise`, `Float8
  tensorwise scaled training active`, 2024's bare `Float8 training active` (FP8 without its scaling), `MX training
  active with recipe mxfp8_cublas`, `Swapped to MXLinear layers`, `Converted modules to use dynamic mxfp8_rceil
  quantization ...`), the GPU (components/metrics.py `build_device_memory_monitor`: `CUDA capacity: NVIDIA B200 with
  178.35GiB memory`), the device mesh (`Building 1-D device mesh with ['dp_shard'], [8]`; 2026's `Building device
  mesh with parallelism: pp=1, dp_replicate=1, dp_shard=8, ...`: the GPU count), the model (`Building llama3 8B`),
  the trainer's summary (global batch, sequence length, total steps) and `Training starts at step N` (N > 1: resumed
  from a checkpoint).
- The precision: a converter's named recipe, wherever stated (the converter's line first: what ran); else FP8 with
  its recipe unknown where a converter is on without one; else BF16 where `training.dtype` or
  `mixed_precision_param` is bfloat16 and nothing says a converter is on (it would print its line). Never from a file
  name that says otherwise.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Callable, Optional

from recipes.report.formats.base import Family, LineFormat
from recipes.report.formats.config_dump import Sourced
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
# tyro's `--section.key value` or `--section.key=value`, hyphens or underscores; a value never begins with `--`
LAUNCH_FLAG = re.compile(r"--(?P<key>(?:model|training|parallelism|float8|mx|quantize\.linear\.(?:float8|mx))"
                         r"\.[a-z_-]+)(?:=|\s+)(?P<value>\"[^\"]*\"|'[^']*'|\[[^\]]*\]|[^\s\"'-][^\s\"']*)")
TOML_SECTION = re.compile(r"^\s*\[(?P<section>[A-Za-z_][\w.]*)\]\s*(?:#.*)?$")
TOML_KEY = re.compile(r"^\s*(?P<key>[A-Za-z_]\w*)\s*=\s*(?P<value>\"[^\"]*\"|'[^']*'|\[[^\]]*\]|[^#\s]+)\s*(?:#.*)?$")
TOML_OTHER = re.compile(r"^\s*(?:#.*)?$")  # a blank line or a comment goes on with the section
FLOAT8 = re.compile(r"Float8 (?:(?P<tensorwise>tensorwise) scaled training"
                    r"|training active(?: with recipe (?P<recipe>\w+))?)")
MX = re.compile(r"MX training active with recipe (?P<recipe>\w+)|Swapped to MXLinear layers"
                r"|Converted Linear layers to MXFP8Linear"
                r"|Converted (?:modules|layers matching FQNS .*?) to use dynamic (?P<dynamic>\w+) quantization")
DEVICE = re.compile(r"CUDA capacity: (?P<device>.+?) with [\d.]+GiB memory")
MESH = re.compile(r"Building \d+-D device mesh with \[[^\]]*\], \[(?P<dims>[\d, ]+)\]")
# 2026: `Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1, ep=1, etp=1` (experts'
# ep and etp split the others' GPUs, adding none)
MESH_DEGREES = re.compile(r"Building device mesh with parallelism: (?P<degrees>(?:\w+=\d+(?:, )?)+)")
TRAINER = re.compile(r"Trainer is initialized with .*?global batch size (?P<gbs>\d+),.*?sequence length (?P<seq>\d+), "
                     r"total steps (?P<steps>\d+)")
MODEL = re.compile(r"Building (?P<name>\w+) (?P<flavor>\w+)(?: with |\s*$)")  # 2026: `Building llama3 8B`
START = re.compile(r"Training starts at step (?P<step>\d+)")

# torchtitan's (model name, flavor) -> conf/model's name
MODELS = {("llama3", "8b"): "llama3_8b", ("llama3", "70b"): "llama3_70b", ("llama3", "405b"): "llama31_405b"}
UNNAMED = {"fp8", "bf16"}  # precisions that name no FP8 recipe: a named one wins over them


def quantized_precision(recipe: Optional[str]) -> str:
    """A float8 or MX recipe name as torchtitan's converters take it -> the precision it trains in."""
    if recipe is None or recipe == "tensorwise":
        return "fp8_current"  # per-tensor scales from the current tensor: TE's Float8CurrentScaling
    if recipe.startswith("mxfp8"):
        return "mxfp8"  # mxfp8, mxfp8_cublas, mxfp8_rceil: 32-element blocks with E8M0 scales
    return f"fp8_{recipe}" if not recipe.startswith("fp8") else recipe  # rowwise: not a recipe of this project


class StartupLines:
    """torchtitan's startup lines -> the header keys they state, each with the line that states it."""

    def __init__(self):
        self.stated: dict[str, Sourced] = {}  # from its own lines, the first line stating a key winning
        self.precisions: list[Sourced] = []  # what each converter line says, in the order written
        self.resolved: dict[str, Sourced] = {}  # the job config it printed: dotted key -> value
        self.flags: dict[str, Sourced] = {}
        self.toml: dict[str, Sourced] = {}
        self.section: Optional[str] = None  # the TOML section being echoed

    def line(self, line: str, where: str) -> bool:
        printed = ARGS.search(line)
        if printed:
            self.resolved = _printed_config(printed["args"], where)
            return bool(self.resolved)
        if self._toml(line, where):
            return True
        for pattern, label, read in READERS:
            match = pattern.search(line)
            if match:
                for key, value in read(match).items():
                    if value is not None and key == "precision_preset":
                        self.precisions.append((value, f"{where} ({label})"))
                    elif value is not None:
                        self.stated.setdefault(key, (value, f"{where} ({label})"))
                return True
        flags = [flag for flag in LAUNCH_FLAG.finditer(line) if flag["key"].replace("-", "_") in SETTINGS]
        for flag in flags:
            key = flag["key"].replace("-", "_")
            self.flags.setdefault(key, (_unquoted(flag["value"]), f"{where} (--{flag['key']})"))
        return bool(flags)

    def _toml(self, line: str, where: str) -> bool:
        """A line of an echoed TOML file, read where its section is torchtitan's and its key one read here."""
        section = TOML_SECTION.match(line)
        if section:
            self.section = section["section"]
            return False
        item = TOML_KEY.match(line) if self.section else None
        if item is None:
            self.section = self.section if TOML_OTHER.match(line) else None
            return False
        key = f"{self.section}.{item['key']}"
        if key not in SETTINGS:
            return False
        self.toml.setdefault(key, (_unquoted(item["value"]), f"{where} ([{self.section}] {item['key']})"))
        return True

    def record(self, fmt: LineFormat, record: Step) -> None:
        pass

    def notes(self, where: str) -> list[str]:
        return []

    def header(self) -> dict[str, Sourced]:
        stated = dict(self.stated)
        launched = {**self.toml, **self.flags}  # a flag overrides the TOML file it names, as torchtitan reads them
        for settings in (self.resolved, launched):
            for key, value in _settings_header(settings).items():
                stated.setdefault(key, value)
        said = self.precisions + [p for p in (_settings_precision(self.resolved), _settings_precision(launched)) if p]
        named = [p for p in said if p[0] not in UNNAMED]
        fp8 = [p for p in said if p[0] == "fp8"]
        chosen = (named or fp8 or said or [None])[0]
        if chosen is not None:
            stated["precision_preset"] = chosen
        return stated


# The settings read from a launch line or an echoed TOML file (the printed job config is read whole)
SETTINGS = {
    "model.name", "model.flavor", "model.converters", "training.dtype", "training.mixed_precision_param",
    "training.seq_len", "training.steps", "float8.recipe_name", "mx.recipe_name",
    "quantize.linear.float8.recipe_name", "quantize.linear.mx.recipe_name",
    "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
    "parallelism.context_parallel_degree",
}


def _unquoted(value: str) -> str:
    return value.strip("'\"")


def _printed_config(text: str, where: str) -> dict[str, Sourced]:
    """`Running with args: {...}` -> dotted key -> (value, its source: the line and the key)."""
    try:
        config = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {}
    flat: dict[str, Sourced] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items() if isinstance(node, dict) else []:
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            else:
                flat[dotted] = (value, f"{where} (Running with args: {dotted})")

    walk(config, "")
    return flat


def _names(value: Any) -> list[str]:
    """A converters setting as printed (a list) or given (`float8`, `"float8,mx"`, `["float8"]`) -> its names."""
    if isinstance(value, (list, tuple)):
        return [str(name) for name in value]
    return [name.strip(" '\"") for name in str(value or "").strip("[]").split(",") if name.strip(" '\"")]


def _settings_precision(settings: dict[str, Sourced]) -> Optional[Sourced]:
    """The precision the settings state (module docstring), with the sources of the settings it rests on."""

    def stated(*keys: str) -> list[str]:
        return [key for key in keys if key in settings]

    def value(key: str) -> Any:
        return settings[key][0] if key in settings else None

    def sourced(precision: str, keys: list[str]) -> Sourced:
        return precision, "; ".join(dict.fromkeys(settings[key][1] for key in keys))

    converters = [name.rsplit(".", 1)[-1] for name in _names(value("model.converters"))]
    if "float8" in converters:
        recipe = stated("float8.recipe_name", "quantize.linear.float8.recipe_name")
        # a flag naming the converter but not its recipe leaves the recipe to a TOML file the log does not show
        precision = quantized_precision(value(recipe[0])) if recipe else "fp8"
        return sourced(precision, ["model.converters"] + recipe[:1])
    if value("float8.enable_float8_linear"):  # 2024's switch, its scaling per operand: dynamic (current) or delayed
        delayed = value("float8.scaling_type_input") == "delayed"
        return sourced("fp8_delayed" if delayed else "fp8_current",
                       ["float8.enable_float8_linear"] + stated("float8.scaling_type_input"))
    if "mx" in converters:
        recipe = stated("mx.recipe_name", "quantize.linear.mx.recipe_name")
        return sourced(quantized_precision(value(recipe[0]) if recipe else "mxfp8"), ["model.converters"] + recipe[:1])
    in_bf16 = [key for key in stated("training.dtype", "training.mixed_precision_param") if value(key) == "bfloat16"]
    if in_bf16 and not converters:
        return sourced("bf16", stated("model.converters") + in_bf16[:1])
    return None


def _settings_header(settings: dict[str, Sourced]) -> dict[str, Sourced]:
    """Model, parallel degrees, sequence length and steps, where the settings state them."""

    def integer(key: str, minimum: int) -> Optional[Sourced]:  # a degree of -1: as many as the GPUs left
        raw = settings.get(key, (None, ""))
        value = raw[0] if isinstance(raw[0], int) else int(raw[0]) if str(raw[0]).isdigit() else None
        return (value, raw[1]) if value is not None and value >= minimum else None

    header = {
        "tp": integer("parallelism.tensor_parallel_degree", 1),
        "pp": integer("parallelism.pipeline_parallel_degree", 1),
        "cp": integer("parallelism.context_parallel_degree", 1),
        "seq": integer("training.seq_len", 1),
        "steps": integer("training.steps", 1),
    }
    name, flavor = settings.get("model.name"), settings.get("model.flavor")
    if name and flavor and MODELS.get((str(name[0]), str(flavor[0]).lower())):
        header["model"] = (MODELS[(str(name[0]), str(flavor[0]).lower())], f"{name[1]}; {flavor[1]}")
    return {key: value for key, value in header.items() if value is not None}


def _mesh_degrees(text: str) -> dict[str, int]:
    degrees = {name: int(value) for name, value in (item.split("=") for item in text.split(", ") if "=" in item)}
    world = math.prod(degrees.get(name, 1) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return {"world_size": world, "tp": degrees.get("tp"), "pp": degrees.get("pp"), "cp": degrees.get("cp")}


# (pattern, how a source names it, the header keys it states)
READERS: list[tuple[re.Pattern, str, Callable[[re.Match], dict[str, Any]]]] = [
    # 2024's bare `Float8 training active` names no scaling (dynamic or delayed): FP8, recipe unknown
    (FLOAT8, "float8 converter", lambda m: {"precision_preset": quantized_precision(m["recipe"] or m["tensorwise"])
                                            if m["recipe"] or m["tensorwise"] else "fp8"}),
    (MX, "mx converter", lambda m: {"precision_preset": quantized_precision(m["recipe"] or m["dynamic"] or "mxfp8")}),
    (DEVICE, "CUDA capacity", lambda m: {"device": m["device"]}),
    (MESH, "device mesh", lambda m: {"world_size": math.prod(int(d) for d in m["dims"].split(","))}),
    (MESH_DEGREES, "device mesh", lambda m: _mesh_degrees(m["degrees"])),
    (TRAINER, "trainer summary", lambda m: {"gbs": int(m["gbs"]), "seq": int(m["seq"]), "steps": int(m["steps"])}),
    (MODEL, "model", lambda m: {"model": MODELS.get((m["name"], m["flavor"].lower()))}),
    (START, "training start", lambda m: {"start_step": int(m["step"])}),
]

TORCHTITAN = Family("torchtitan", formats=[STEP], fields=FIELDS, side=StartupLines)
