"""What engine=nemo refuses before launch, and the plan's lines about the recipe it will build.

Nothing here imports NeMo: the job builds the recipe with the container's NeMo, which the submitting machine
need not have. Where the job runs on this machine (executor=local), this machine's NeMo is checked here; on Slurm
the container's NeMo is known only inside the job, which checks it (check_versions) before building anything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from typing import Optional

from recipes.config import (
    DEFAULT_BLOCK_DIMS, Config, ConfigError, ExecutorName, GradReduce, ModelConfig, load_option,
)
from recipes.nemo.mapping import (
    ENGINE_NEMO, NEMO_WITHOUT_LLM, PLUGIN, PRESETS, RECIPE_MODULES, SHAPE_FIELDS, precision_fields, recipe_name,
)

NEMO_SEED = 1234  # nemo.lightning._strategy_lib.init_parallel_ranks seeds megatron-core's RNGs with it, unconfigurably


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first thing engine=nemo cannot run (the plan's megatron-core checks of layout
    and precision apply as well)."""
    _validate_model(cfg)
    _validate_options(cfg)
    if _runs_here(cfg):
        check_versions(cfg, *local_versions())
    if cfg.gpu.arch == "cpu" and not cfg.dryrun:
        raise ConfigError("engine=nemo needs CUDA GPUs (NeMo's recipes train on GPUs with Transformer Engine); on this "
                          "machine use engine=torch, or dryrun=true to see the plan")


def _validate_model(cfg: Config) -> None:
    name = cfg.model.name
    if name not in RECIPE_MODULES:
        raise ConfigError(f"engine=nemo runs NeMo's own recipe for the model, and NeMo has none for model={name}: "
                          f"choose {', '.join(RECIPE_MODULES)} (model.num_layers=N makes a smaller proxy of one), "
                          "or engine=torch / engine=megatron for any model")
    published = load_option("model", name)
    fixed = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in (*SHAPE_FIELDS, "name", "vocab_size")]
    changed = [f"model.{field}" for field in fixed if getattr(cfg.model, field) != getattr(published, field)]
    if changed:
        raise ConfigError(f"engine=nemo keeps NeMo's model class for {name}, which fixes {', '.join(changed)}; "
                          f"this engine changes only model.{', model.'.join(SHAPE_FIELDS)} and model.vocab_size "
                          "(engine=megatron takes every model.* field)")


def _validate_options(cfg: Config) -> None:
    """Settings of the other engines that NeMo's recipe has no field for: refused, never silently dropped."""
    t = cfg.trainer
    unmapped = {
        "trainer.activation_checkpointing=true": (t.activation_checkpointing, "use parallel.recompute=full"),
        "trainer.compile=true": (t.compile is True, "NeMo runs Transformer Engine's fused kernels uncompiled"),
        f"trainer.grad_reduce={t.grad_reduce.value}": (t.grad_reduce != GradReduce.per_step,
                                                       "NeMo reduces gradients through megatron-core's DDP"),
        "trainer.fsdp_fp8_all_gather=true": (t.fsdp_fp8_all_gather, "use precision.fp8_param_gather"),
        "trainer.fused_loss=false": (not t.fused_loss, "NeMo's recipe sets megatron-core's cross-entropy fusion"),
        f"trainer.profile_step={t.profile_step}": (t.profile_step is not None,
                                                   "profile NeMo with nsys (NeMo's NsysPlugin)"),
        f"trainer.seed={t.seed}": (t.seed != NEMO_SEED, f"NeMo seeds the model's weights with {NEMO_SEED} whatever "
                                                        "the run says; use engine=megatron or engine=torch for seeds"),
        f"precision.x/w/grad_block_scaling_dim = {list(cfg.precision.block_dims)}": (
            cfg.precision.block_dims != DEFAULT_BLOCK_DIMS,
            "NeMo's plugin builds Transformer Engine's Float8BlockScaling with its default blocks; use engine=megatron "
            "or engine=torch"),
    }
    for setting, (given, fix) in unmapped.items():
        if given:
            raise ConfigError(f"{setting} has no counterpart in NeMo's recipe on engine=nemo: {fix}")


def _runs_here(cfg: Config) -> bool:
    return cfg.executor.name == ExecutorName.local and not cfg.dryrun


def local_versions() -> tuple[str, Optional[str]]:
    """(NeMo, megatron-core) versions of this Python, read from their package_info.py (importing NeMo takes a
    minute; NeMo's containers install both from source, so package metadata may be missing)."""
    nemo = source_version("nemo")
    if nemo is None:
        raise ConfigError(f"engine=nemo with executor=local runs NeMo from this Python ({sys.executable}), which has "
                          "no NeMo: run inside the NeMo container, or use executor=slurm (it runs in "
                          "executor.slurm.container_image, NeMo's container by default)")
    return nemo, source_version("megatron.core")


def source_version(package: str) -> Optional[str]:
    """MAJOR.MINOR.PATCH of an installed package that keeps them in its package_info.py, as NeMo and megatron-core
    do; None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    info = Path(spec.submodule_search_locations[0]) / "package_info.py"
    parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info.read_text() if info.is_file() else "", re.M))
    if len(parts) != 3:
        raise ConfigError(f"engine=nemo: cannot read {package}'s version from {info}")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as 2.4.0rc1 or 0.13.0+abcdef."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ConfigError(f"cannot read the version {version!r}")
    return int(match[1]), int(match[2])


def check_versions(cfg: Config, nemo: str, megatron_core: Optional[str]) -> None:
    """Raise ConfigError when this NeMo (and megatron-core, where given) cannot run the run's precision."""
    shown = lambda version: ".".join(map(str, version))  # noqa: E731
    if release(nemo) >= NEMO_WITHOUT_LLM:
        raise ConfigError(f"engine=nemo needs NeMo 2 (nemo.collections.llm, NeMo {shown(ENGINE_NEMO)} to 2.7); NeMo "
                          f"{nemo} has no LLM recipes: use a NeMo 2 container, or engine=megatron")
    preset = PRESETS[cfg.precision.recipe]
    needed = max(ENGINE_NEMO, preset.nemo)
    if release(nemo) < needed:
        raise ConfigError(f"precision={cfg.precision.name} on engine=nemo needs NeMo >= {shown(needed)} "
                          f"({preset.function}); this NeMo is {nemo}: use a newer NeMo container "
                          "(executor.slurm.container_image)")
    if preset.megatron_core and megatron_core and release(megatron_core) < preset.megatron_core:
        raise ConfigError(f"precision={cfg.precision.name} on engine=nemo needs megatron-core >= "
                          f"{shown(preset.megatron_core)}; this megatron-core is {megatron_core}")


def requirement(cfg: Config) -> str:
    preset = PRESETS[cfg.precision.recipe]
    text = f"NeMo {'.'.join(map(str, max(ENGINE_NEMO, preset.nemo)))} to 2.7"
    if preset.megatron_core:
        text += f" with megatron-core >= {'.'.join(map(str, preset.megatron_core))}"
    return text


def describe(cfg: Config) -> list[str]:
    """The plan's lines: the recipe, its precision plugin and what it is set to, and where NeMo comes from."""
    plugin = {path[len(PLUGIN) + 1:]: value for path, value in precision_fields(cfg).items()
              if path.startswith(PLUGIN + ".")}
    slurm = cfg.executor.slurm
    if cfg.executor.name == ExecutorName.local:
        where = "this Python's NeMo" + (f" {local_versions()[0]}" if _runs_here(cfg) else "")
    elif slurm is not None and slurm.container_image:
        where = f"the NeMo of image {slurm.container_image}"
    else:
        where = "the NeMo of the nodes' Python (no container)"
    return [
        f"nemo        {recipe_name(cfg)}, built in the job by {where}; needs {requirement(cfg)} (checked there "
        "before anything is built)",
        f"plugin      {PRESETS[cfg.precision.recipe].function}() with "
        + ", ".join(f"{name}={value}" for name, value in plugin.items()),
    ]
