"""What a run was: model, precision, GPU, layout, batch, from whichever source knows it.

A run directory carries its resolved config; a raw log carries little. Each source yields a partial dict of the
keys in `KEYS`; they are merged in this order, the first source that knows a key winning:

    1. label      --label FILE:key=value,...  (what the user says)
    2. config     config.yaml / summary.json in the run directory, or the nearest config.yaml above a log
    3. header     the log's own lines: Megatron's argument dump (parallel sizes, batch, fp8), global batch size
    4. file name  recognisable tokens: conf/model names, precision names and short forms, GPU names, tp2, 8nodes ...
    5. format     the log format implies the engine (Megatron lines -> megatron, NeMo 2 lines -> nemo)

then values that follow from others are derived (world size = nodes x GPUs per node, DP = world / (TP PP CP),
parameter count from the model's dimensions (recipes.metrics) where summary.json has none, the GPU's BF16 peak from
conf/gpu). Nothing else is guessed: a key no source knows stays unknown. Each value keeps its source in words a
user can check (`sources`): the --label, the config key, the log's line and printed key, the file name, the
derivation.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import yaml

from recipes.config import CONF_DIR, ConfigError, ModelConfig, from_dict
from recipes.metrics import count_parameters as model_parameters
from recipes.run_files import CONFIG, SUMMARY

# conf/ is the one place that names the models, GPUs and precisions; a file that cannot be read reads as empty.
@functools.lru_cache(maxsize=None)
def _conf_file(group: str, name: str) -> tuple:
    path = CONF_DIR / group / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        data = None
    return tuple((data or {}).items()) if isinstance(data, dict) else ()


def _conf(group: str, name: str) -> dict:
    return dict(_conf_file(group, name))


def _conf_names(group: str) -> list[str]:
    folder = CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


# Precision names (conf/precision) -> their scaling recipe (megatron-core's fp8_recipe names).
PRECISIONS = {name: _conf("precision", name)["recipe"] for name in _conf_names("precision")}
# A log that names only its recipe (megatron-core's fp8_recipe, torchtitan's recipe_name) ran that recipe's own
# preset, not a variant of it that no log names: blockwise scaling's other block layouts (fp8_blockwise_1d1d,
# _2d2d), row-wise scaling with a BF16 weight gradient (fp8_rowwise_gw_hp).
VARIANT_KEYS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim", "fp8_wgrad")
RECIPE_TO_PRECISION = {recipe: name for name, recipe in PRECISIONS.items()
                       if not any(key in _conf("precision", name) for key in VARIANT_KEYS)}
# Short forms of NeMo/Megatron-Bridge performance scripts (ds, cs, ss = delayed, current, sub-channel scaling).
# A bare "fp8" names no recipe: it stays "fp8" and compares with BF16 like any FP8 run.
SHORT_PRECISIONS = {
    "fp8ds": "fp8_delayed",
    "fp8cs": "fp8_current",
    "fp8ss": "fp8_blockwise",
    "fp8mx": "mxfp8",
    "fp8": "fp8",
}
# FP8 precisions of other tools that are none of conf/precision's, each with its scaling recipe: compared with BF16
# like any FP8 run (a bare "fp8" names no recipe).
OTHER_FP8 = {"fp8": "fp8"}
PRECISION_ORDER = ["bf16", "fp8_delayed", "fp8_current", "fp8_blockwise", "mxfp8", "fp8_rowwise", "fp8"]


INT_KEYS = ["nodes", "gpus_per_node", "world_size", "tp", "pp", "cp", "vp", "dp", "mbs", "gbs", "seq", "seed", "steps"]
FLOAT_KEYS = ["params", "peak_tflops_bf16"]
TEXT_KEYS = ["name", "model", "precision", "gpu", "engine"]
KEYS = TEXT_KEYS + ["recipe", "emulated"] + INT_KEYS + FLOAT_KEYS
LABEL_ALIASES = {"gpus": "gpus_per_node", "micro_batch_size": "mbs", "global_batch_size": "gbs", "seq_length": "seq"}
SIZE_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


class LabelError(ValueError):
    pass


# ---- 1. labels ----


def parse_label(text: str) -> tuple[str, dict[str, Any]]:
    """`FILE:key=value,...` -> (FILE, {key: value}); FILE may be a glob pattern."""
    equals = text.find("=")
    colon = text.rfind(":", 0, equals) if equals > 0 else -1
    if colon <= 0:
        raise LabelError(f"--label {text!r}: expected FILE:key=value[,key=value...]")
    target, values = text[:colon], {}
    for item in text[colon + 1 :].split(","):
        key, sep, value = item.partition("=")
        key = LABEL_ALIASES.get(key.strip().lower(), key.strip().lower())
        if not sep or not value.strip():
            raise LabelError(f"--label {text!r}: {item!r} is not key=value")
        if key not in KEYS or key == "recipe":
            allowed = ", ".join(k for k in KEYS if k != "recipe")
            raise LabelError(f"--label {text!r}: unknown key {key!r}; known keys: {allowed}")
        values[key] = _label_value(key, value.strip(), text)
    return target, values


def _label_value(key: str, value: str, text: str) -> Any:
    try:
        if key in INT_KEYS:
            return int(value)
        if key == "params" and value[-1:].lower() in SIZE_SUFFIX:
            return float(value[:-1]) * SIZE_SUFFIX[value[-1].lower()]
        if key in FLOAT_KEYS:
            return float(value)
    except ValueError:
        raise LabelError(f"--label {text!r}: {key}={value!r} is not a number") from None
    if key == "emulated":
        return value.lower() in ("1", "true", "yes")
    return value.lower() if key in ("model", "precision", "gpu", "engine") else value


# ---- 2. resolved config and summary ----

# Where a run directory (or the config.yaml above a log) states each key: the first of these places that is set.
CONFIG_KEYS: dict[str, list[tuple[str, str]]] = {
    "model": [("config", "model.name"), ("summary", "model")],
    "params": [("summary", "parameters")],  # else counted from the config's model (from_config)
    "precision": [("config", "precision.name"), ("summary", "precision")],
    "recipe": [("config", "precision.recipe"), ("summary", "recipe")],
    "emulated": [("summary", "emulated"), ("config", "precision.emulate")],
    "gpu": [("config", "gpu.name"), ("summary", "gpu")],
    "peak_tflops_bf16": [("config", "gpu.peak_tflops_bf16")],
    "engine": [("config", "engine"), ("summary", "engine")],
    "nodes": [("config", "executor.nodes"), ("summary", "nodes")],
    "gpus_per_node": [("config", "executor.gpus")],
    "world_size": [("summary", "world_size")],
    "mbs": [("config", "trainer.micro_batch_size"), ("summary", "micro_batch_size")],
    "gbs": [("config", "trainer.global_batch_size"), ("summary", "global_batch_size")],
    "seq": [("config", "model.seq_length"), ("summary", "seq_length")],
    "seed": [("config", "trainer.seed")],
    "steps": [("config", "trainer.max_steps")],  # the planned length, which the learning-rate schedule depends on
    **{key: [("config", f"parallel.{key}")] for key in ("tp", "pp", "cp", "vp", "dp")},
}


def from_config(config: dict, summary: dict, names: tuple[str, str] = (CONFIG, SUMMARY)
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """The project's config.yaml (resolved) and summary.json, either may be empty: metadata, and each key's source
    (`config.yaml (trainer.max_steps)`), the files named as `names` says."""
    files = {"config": (config, names[0]), "summary": (summary, names[1])}
    meta: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, places in CONFIG_KEYS.items():
        for file, dotted in places:
            data, name = files[file]
            value = _dig(data, dotted)
            if value is not None and not (key == "gpu" and value == "auto"):  # auto: not resolved, unknown
                meta[key], sources[key] = value, f"{name} ({dotted})"
                break
    if "params" not in meta:
        meta["params"], sources["params"] = count_parameters(_section(config, "model")), f"{names[0]} (model)"
    if not _section(config, "parallel") and meta.get("engine") == "torch":
        for key in ("tp", "pp", "cp", "vp"):  # the PyTorch engine shards data only (FSDP)
            meta[key], sources[key] = 1, f"{names[0]} (engine: torch, data parallel only)"
    meta = _clean(meta)
    return meta, {key: sources[key] for key in meta}


def _dig(data: dict, dotted: str) -> Any:
    *sections, key = dotted.split(".")
    for name in sections:
        data = _section(data, name)
    return data.get(key)


def _section(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


# ---- 3. the log's own header lines ----


def from_header(header: dict[str, Any], header_sources: dict[str, str], batch_sizes: list[int],
                batch_source: str = "") -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """What the log's printed configuration says (parse.HeaderReader), each key's source (the line and the key it
    was read from; the global batch's, `batch_source`, the iteration lines), and notes where its records disagree.

    FP8 only when the log says it is on (`fp8: hybrid|e4m3`, `--fp8-format`, a Bridge preset naming FP8): a
    recipe name alone (`fp8_recipe: delayed` is Transformer Engine's default, printed by BF16 runs too) is not.
    """
    keys = ("tp", "pp", "cp", "vp", "dp", "world_size", "nodes", "gpus_per_node", "mbs", "gbs", "seq", "seed", "steps")
    meta = {key: header.get(key) for key in keys}
    meta["model"] = header.get("model")  # torchtitan's model name and flavor, where they name one of conf/model
    meta["gpu"] = gpu_of_device(header.get("device"))  # torchtitan's `CUDA capacity: NVIDIA B200 ...`
    used = {key: [key] for key in keys + ("model",)}
    used["gpu"] = ["device"]
    notes: list[str] = []
    if header.get("data_seq"):
        meta["seq"], used["seq"] = header["data_seq"], ["data_seq"]  # Bridge's dataset length: what each sample holds
    meta["precision"], used["precision"] = _header_precision(header)
    sources = {key: "; ".join(header_sources[k] for k in used[key] if k in header_sources) for key in used}
    if batch_sizes:
        logged = max(set(batch_sizes), key=batch_sizes.count)  # as printed on the iteration lines: what ran
        if meta["gbs"] is not None and meta["gbs"] != logged:
            notes.append(f"the printed config says global batch {meta['gbs']}, the iteration lines {logged}: "
                         f"{logged} used")
        meta["gbs"], sources["gbs"] = logged, batch_source
    meta = _clean(meta)
    return meta, {key: sources[key] for key in meta}, notes


def _header_precision(header: dict[str, Any]) -> tuple[Optional[str], list[str]]:
    """The precision the printed configuration states, and the header keys it rests on."""
    preset, fp8, fp4 = header.get("precision_preset"), header.get("fp8"), header.get("fp4")
    fp8_keys = ["fp8"]
    if fp8 is None and ("fp8_e4m3" in header or "fp8_hybrid" in header):
        fp8 = "e4m3" if header.get("fp8_e4m3") else "hybrid" if header.get("fp8_hybrid") else "none"
        fp8_keys = ["fp8_e4m3", "fp8_hybrid"]
    if preset:
        return preset_precision(preset), ["precision_preset"]
    if fp8 not in (None, "none"):
        return RECIPE_TO_PRECISION.get(header.get("fp8_recipe"), "fp8"), fp8_keys + ["fp8_recipe"]
    if fp4 not in (None, "none"):
        return "nvfp4", ["fp4"]  # megatron-core's FP4 path names no recipe of its own: TE's NVFP4BlockScaling
    if fp8 == "none" and header.get("bf16"):
        return "bf16", fp8_keys + ["bf16"]
    return None, []


def gpu_of_device(device: Optional[str]) -> Optional[str]:
    """A device's name as the system gives it (`NVIDIA H100 80GB HBM3`, `NVIDIA GB200`) -> conf/gpu's name, where it
    names exactly one."""
    found = _words(str(device).lower(), {name: name for name in gpu_names()}) if device else set()
    return found.pop() if len(found) == 1 else None


# Megatron-Bridge's mixed-precision presets (megatron.bridge.training.mixed_precision), by the words in their names.
PRESET_WORDS = [
    ("mxfp8", "mxfp8"),
    ("fp8_delayed", "fp8_delayed"),
    ("fp8_current", "fp8_current"),
    ("fp8_subchannel", "fp8_blockwise"),
    ("fp8_blockwise", "fp8_blockwise"),
    ("fp8_rowwise", "fp8_rowwise"),  # torchtitan's float8 rowwise recipe
    ("nvfp4", "nvfp4"),
    ("fp8", "fp8"),
    ("bf16", "bf16"),
]


def preset_precision(preset: str) -> Optional[str]:
    """`bf16_with_fp8_current_scaling_mixed` -> fp8_current, `bf16_mixed` -> bf16; None for any other name."""
    return next((precision for word, precision in PRESET_WORDS if word in preset), None)


# ---- 4. tokens in the file name ----

LAYOUT_TOKENS = {
    "tp": r"tp(\d+)",
    "pp": r"pp(\d+)",
    "cp": r"cp(\d+)",
    "vp": r"vp(\d+)",
    "nodes": r"(\d+)nodes?",
    "mbs": r"(\d+)mbs",
    "gbs": r"(\d+)gbs",
}


def from_file_name(name: str) -> tuple[dict[str, Any], list[str]]:
    """Known words in a file or directory name; a category with two different matches stays unknown (noted)."""
    text = name.lower()
    meta: dict[str, Any] = {}
    notes: list[str] = []
    vocabularies = {
        "model": {m: m for m in model_names()},
        "precision": {**{p: p for p in PRECISIONS}, **SHORT_PRECISIONS},
        "gpu": {g: g for g in gpu_names()},
    }
    for key, vocabulary in vocabularies.items():
        found = _words(text, vocabulary)
        if len(found) == 1:
            meta[key] = found.pop()
        elif found:
            notes.append(f"file name {name!r} names several {key}s ({', '.join(sorted(found))}): {key} left unknown")
    for key, pattern in LAYOUT_TOKENS.items():
        values = {int(m) for m in re.findall(rf"(?<![a-z0-9]){pattern}(?![a-z0-9])", text)}
        if len(values) == 1:
            meta[key] = values.pop()
    return meta, notes


def _words(text: str, vocabulary: dict[str, str]) -> set[str]:
    """Values of the vocabulary words found in text as whole words; a word inside a longer match does not count."""
    spans = []
    for word in sorted(vocabulary, key=len, reverse=True):
        for m in re.finditer(rf"(?<![a-z0-9]){re.escape(word)}(?![a-z0-9])", text):
            if not any(start <= m.start() and m.end() <= end for start, end, _ in spans):
                spans.append((m.start(), m.end(), vocabulary[word]))
    return {value for _, _, value in spans}


# ---- merging and deriving ----


def merge(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Layers in precedence order -> (metadata, key -> name of the layer it came from)."""
    meta: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for layer_name, values in layers:
        for key, value in values.items():
            if value is not None and key not in meta:
                meta[key], origin[key] = value, layer_name
    derive(meta, origin)
    return meta, origin


# How derive() computes each key it fills (conf/ files named by the values they depend on)
DERIVATIONS = {
    "recipe": "the precision (conf/precision)",
    "world_size": "nodes x GPUs per node",
    "gpus_per_node": "world size / nodes",
    "dp": "world size / (TP x PP x CP)",
    "params": "conf/model/{model}.yaml (the model's dimensions)",
    "peak_tflops_bf16": "conf/gpu/{gpu}.yaml (peak_tflops_bf16)",
}


def derive(meta: dict[str, Any], origin: dict[str, str]) -> None:
    def put(key: str, value: Any) -> None:
        if meta.get(key) is None and value is not None:
            meta[key], origin[key] = value, "derived"

    if meta.get("precision"):
        precision = canonical_precision(meta["precision"])
        meta["precision"] = precision
        put("recipe", PRECISIONS.get(precision, OTHER_FP8.get(precision)))
    nodes, per_node, world = meta.get("nodes"), meta.get("gpus_per_node"), meta.get("world_size")
    if nodes and per_node:
        put("world_size", nodes * per_node)
    if world and nodes and world % nodes == 0:
        put("gpus_per_node", world // nodes)
    world = meta.get("world_size")
    model_parallel = [meta.get(k) for k in ("tp", "pp", "cp")]
    if world and all(model_parallel) and world % (model_parallel[0] * model_parallel[1] * model_parallel[2]) == 0:
        put("dp", world // (model_parallel[0] * model_parallel[1] * model_parallel[2]))
    if meta.get("model"):
        put("params", count_parameters(_conf("model", meta["model"])))
    if meta.get("gpu"):
        put("peak_tflops_bf16", _conf("gpu", meta["gpu"]).get("peak_tflops_bf16"))


def sources(meta: dict[str, Any], origin: dict[str, str], details: dict[str, dict[str, str]]) -> dict[str, str]:
    """Each metadata key's source: the detail its layer gives (`details`: layer -> key -> `run.log line 12
    (tensor_model_parallel_size)`, `config.yaml (trainer.max_steps)`), or how it was derived."""
    out = {}
    for key in meta:
        layer = origin.get(key, "")
        if layer == "derived":
            out[key] = "derived from " + DERIVATIONS[key].format(**meta)
        else:
            out[key] = details.get(layer, {}).get(key) or layer
    return out


def canonical_precision(value: str) -> str:
    value = str(value).lower()
    return SHORT_PRECISIONS.get(value) or RECIPE_TO_PRECISION.get(value) or value


def count_parameters(model: dict) -> Optional[float]:
    """Exact parameter count from the model code itself; None when the dict does not describe a whole model."""
    try:
        config = from_dict(ModelConfig, model, "model")
    except (ConfigError, TypeError):
        return None
    return float(model_parameters(config))


def model_names() -> list[str]:
    return _conf_names("model")


def gpu_names() -> list[str]:
    return [name for name in _conf_names("gpu") if name != "auto"]


def _clean(meta: dict[str, Any]) -> dict[str, Any]:
    """Drop unknowns; coerce numbers written as strings in hand-edited files."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if value is None or value == "":
            continue
        if key in INT_KEYS:
            try:
                value = int(value)
            except (TypeError, ValueError):
                continue
        elif key in FLOAT_KEYS:
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
        elif key in TEXT_KEYS or key == "recipe":
            value = str(value).lower() if key != "name" else str(value)
        out[key] = value
    return out


def describe_layout(meta: dict[str, Any]) -> str:
    parts = [
        (label, meta.get(key)) for label, key in (("TP", "tp"), ("PP", "pp"), ("CP", "cp"), ("VP", "vp"), ("DP", "dp"))
    ]
    if all(value is None for _, value in parts):
        return "unknown"
    return " ".join(f"{label}{'?' if value is None else value}" for label, value in parts)
