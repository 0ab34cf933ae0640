"""What cannot run, refused before launch with a message that names the fix: the launch, the model's shape, the
parallel layout, the precision on this GPU (a recipe is never silently replaced by another precision), the
batch sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from pathlib import Path

import torch

from recipes.compute import check_compute_dtype
from recipes.config import (
    CONF_DIR, DEFAULT_BLOCK_DIMS, Config, ConfigError, DataKind, Engine, ExecutorName, Fp8Format, GradReduce,
    MegatronConfig, ModelConfig, PrecisionConfig, Recipe, Tunnel, check_values, gemms_of_two_2d_operands, load_option,
    module_assignment, module_precision,
)
from recipes.folders import check_writable
from recipes.data.index_check import check_one_sample, existing_prefix, token_count
from recipes.fp8 import Fp8Training
from recipes.metrics import check_loggers
from recipes.nemo import preflight as nemo_preflight
from recipes.plan.parallel import data_parallel_size, model_parallel_size, world_size
from recipes.plan.run_dir import check_outside_source
from recipes.trainer.checkpoints import checkpoint_dir

# Engines that train megatron-core models with Transformer Engine: megatron-core's layout and FP8 rules apply.
MEGATRON_CORE_ENGINES = (Engine.megatron, Engine.nemo)


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first thing that cannot run."""
    check_values(cfg)
    _validate_launch(cfg)
    check_compute_dtype(cfg)
    if cfg.executor.name == ExecutorName.local:  # on Slurm the job's Python (a container's) decides, at its start
        check_loggers(cfg)
    _validate_model(cfg.model)
    _validate_parallel(cfg)
    _validate_precision(cfg)
    _validate_batch(cfg)
    if cfg.executor.name == ExecutorName.local:  # on Slurm the path is the compute nodes' (the engine checks it there)
        _validate_data(cfg)
    _validate_folders(cfg)


def _validate_data(cfg: Config) -> None:
    """An indexed dataset that is missing, damaged or shorter than one sample, before launch
    (recipes.data.index_check)."""
    if cfg.data.kind == DataKind.indexed and cfg.data.path is not None:
        prefix = existing_prefix(cfg.data.path)
        check_one_sample(token_count(prefix), cfg.model.seq_length, prefix)


def _check_recipe_is_named(precision: PrecisionConfig) -> None:
    """The recipe is the one its name says (conf/precision/NAME.yaml's): reports and pairings go by the name, so
    precision.recipe=bf16 under precision=fp8_current would train BF16 reported as FP8."""
    try:
        option = load_option("precision", precision.name)
    except ConfigError:
        return  # a name of no option: a config.yaml written by hand, read by the engine (Hydra knows only options)
    if option.recipe != precision.recipe:
        named = [path.stem for path in sorted((CONF_DIR / "precision").glob("*.yaml"))
                 if load_option("precision", path.stem).recipe == precision.recipe]
        raise ConfigError(f"precision.recipe={precision.recipe.value} under precision={precision.name}, whose recipe "
                          f"is {option.recipe.value}: the run would be reported as {precision.name}; choose the "
                          f"option of that recipe (precision={' or '.join(named) or '...'}) instead")


def _validate_folders(cfg: Config) -> None:
    """The folders this machine writes besides the run directory (launch/run.py checks that one): nemo-run's
    records, and for a run here the corpus cache and the checkpoints. Each can be written, and is outside this
    checkout's sources (and the first two outside the run directory: recipes.plan.run_dir)."""
    slurm = cfg.executor.slurm
    check_outside_source(Path(cfg.executor.nemo_run_home), "executor.nemo_run_home")
    if cfg.executor.name == ExecutorName.local or (slurm is not None and slurm.tunnel == Tunnel.local):
        check_writable("executor.nemo_run_home", cfg.executor.nemo_run_home)
        if cfg.trainer.checkpoint.dir:  # the default is the run directory's, checked with it
            check_outside_source(checkpoint_dir(cfg, Path(cfg.run.dir)), "trainer.checkpoint.dir")
    if cfg.executor.name != ExecutorName.local:
        return
    if cfg.data.kind == DataKind.indexed and cfg.data.path is None:
        check_outside_source(Path(cfg.data.cache_dir), "data.cache_dir")
        check_writable("data.cache_dir (FP8_RECIPES_CACHE)", cfg.data.cache_dir)
    if cfg.trainer.checkpoint.dir is not None and not cfg.trainer.checkpoint.dir.strip():
        raise ConfigError("trainer.checkpoint.dir is empty: it would be the run directory itself; leave it unset "
                          "(RUN_DIR/checkpoints) or give a folder")
    if cfg.trainer.checkpoint.interval > 0:
        check_writable("trainer.checkpoint.dir", str(checkpoint_dir(cfg, Path(cfg.run.dir))))


def _validate_launch(cfg: Config) -> None:
    if cfg.executor.name == ExecutorName.local and cfg.executor.nodes != 1:
        raise ConfigError(f"executor=local runs on this machine only: set executor.nodes=1 (got {cfg.executor.nodes})")
    if cfg.executor.name == ExecutorName.slurm and cfg.executor.slurm is None:
        raise ConfigError("executor.slurm is missing: choose executor=slurm (conf/executor/slurm.yaml) rather than "
                          "executor.name=slurm")
    if cfg.engine == Engine.megatron:
        _validate_megatron_runtime(cfg)
        megatron_tuning(cfg)
        if cfg.trainer.grad_reduce != GradReduce.per_step:
            raise ConfigError("trainer.grad_reduce is the torch engine's (FSDP2); engine=megatron reduces gradients "
                              "through its DDP/distributed optimizer (parallel.* settings)")
        if cfg.trainer.fsdp_fp8_all_gather:
            raise ConfigError("trainer.fsdp_fp8_all_gather is the torch engine's (FSDP2); on engine=megatron use "
                              "precision.fp8_param_gather")
        if not cfg.trainer.fused_loss:
            raise ConfigError("trainer.fused_loss is the torch engine's; on engine=megatron use "
                              "megatron.cross_entropy_loss_fusion=false")
    elif cfg.megatron != MegatronConfig():
        raise ConfigError(f"megatron.* switches are engine=megatron's; engine={cfg.engine.value} does not read them: "
                          "set engine=megatron or leave them at their defaults")
    if cfg.engine == Engine.nemo:
        nemo_preflight.validate(cfg)
    if _runs_here(cfg):
        available = torch.cuda.device_count()
        if available == 0:
            raise ConfigError(f"gpu={cfg.gpu.name} but this machine has no GPU: choose gpu=cpu (or gpu=auto, which "
                              "detects it), or dryrun=true to see the plan for that GPU")
        if cfg.executor.gpus > available:
            raise ConfigError(f"executor.gpus={cfg.executor.gpus} but this machine has {available} GPU(s): set "
                              f"executor.gpus to at most {available}")
        if cfg.engine == Engine.torch:
            Fp8Training.check_this_pytorch(cfg)


def _validate_megatron_runtime(cfg: Config) -> None:
    if cfg.gpu.arch == "cpu" and not cfg.dryrun:
        raise ConfigError("engine=megatron needs CUDA GPUs (megatron-core's rotary embedding and RNG tracker call "
                          "torch.cuda); on this machine use engine=torch, or dryrun=true to see the plan")
    if cfg.trainer.checkpoint.interval and _runs_here(cfg) and importlib.util.find_spec("psutil") is None:
        raise ConfigError("trainer.checkpoint.interval on engine=megatron: megatron-core's distributed checkpoints "
                          "need psutil (pip install psutil), or set trainer.checkpoint.interval=0")


def megatron_tuning(cfg: Config) -> str:
    """engine=megatron's fusions and overlaps (cfg.megatron) resolved with this Python's kernels when the job runs
    here, left to the job's machine otherwise, as one line; ConfigError for a switch that cannot run."""
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its import logs Megatron-FSDP's backend at INFO
    from recipes.megatron.translate import available_kernels, describe_tuning

    return describe_tuning(cfg, available_kernels() if _runs_here(cfg) else None)


def _validate_model(model: ModelConfig) -> None:
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={model.num_query_groups}"
        )
    rotary_dim = model.kv_channels * model.rotary_percent
    if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
        raise ConfigError(f"model.kv_channels * model.rotary_percent = {rotary_dim} must be an even integer")


def native_archs(recipe: Recipe, megatron: bool = False) -> tuple[str, ...] | None:
    """The GPU architectures with native GEMMs for a block-scaled recipe (None: a recipe native everywhere). MXFP8:
    Blackwell. Blockwise: Hopper in the torch engine (cuBLAS's sm90 block scaling), Hopper and Blackwell through
    Transformer Engine (engine=megatron). Elsewhere the torch engine emulates them if asked (precision.emulate)."""
    if recipe == Recipe.mxfp8:
        return ("blackwell",)
    if recipe == Recipe.blockwise:
        return ("hopper", "blackwell") if megatron else ("hopper",)
    if recipe == Recipe.rowwise:  # torch._scaled_mm's row-wise scales (sm89 and later)
        return ("hopper", "blackwell")
    if recipe == Recipe.nvfp4:  # FP4 tensor cores: Blackwell (TE's kernels; torch's two-level NVFP4 scaled_mm)
        return ("blackwell",)
    return None


def _native_fp8_options(arch: str, megatron: bool) -> list[str]:
    """The conf/precision options with native kernels on `arch`: what to suggest instead of one without."""
    options = ["fp8_current", "fp8_delayed"]
    return options + (["fp8_blockwise"] if arch in native_archs(Recipe.blockwise, megatron) else [])


def _validate_precision(cfg: Config) -> None:
    """The run's precision, and each one precision.modules assigns (every check below, on a copy of the config)."""
    _validate_one_precision(cfg)
    if cfg.precision.modules:
        _validate_modules(cfg)


def _validate_modules(cfg: Config) -> None:
    precision = cfg.precision
    if cfg.engine == Engine.nemo:
        raise ConfigError("precision.modules on engine=nemo: NeMo's recipes give every linear the run's precision "
                          "(its plugins have no per-module setting this project maps); use engine=megatron or "
                          "engine=torch")
    assignment = module_assignment(precision, cfg.model.num_layers)
    for option in dict.fromkeys(assignment.values()):
        if option != precision.name:
            _validate_one_precision(dataclasses.replace(cfg, precision=module_precision(precision, option)))
    if cfg.engine == Engine.megatron:
        _validate_megatron_modules(cfg, assignment)


def _validate_megatron_modules(cfg: Config, assignment: dict[str, str]) -> None:
    """What megatron-core's per-module recipes (its quant_recipe, --te-precision-config-file) cannot express."""
    precision, p = cfg.precision, cfg.parallel
    if p.pp > 1 or p.vp > 1:
        raise ConfigError("precision.modules with parallel.pp > 1 on engine=megatron: megatron-core matches module "
                          "paths, whose layer numbers restart in every pipeline stage; use parallel.pp=1")
    if precision.fp8_param_gather:
        raise ConfigError("precision.modules with precision.fp8_param_gather=true on engine=megatron: FP8 weights "
                          "are made in the run's recipe for every layer; set precision.fp8_param_gather=false")
    for option in dict.fromkeys(assignment.values()):
        assigned = module_precision(precision, option)
        if assigned.recipe == Recipe.delayed:
            raise ConfigError(f"precision.modules on engine=megatron: a linear in {option} (delayed scaling), which "
                              "megatron-core's per-module recipes leave out; use fp8_current or engine=torch")
        if assigned.block_dims != DEFAULT_BLOCK_DIMS or assigned.nvfp4_parts_disabled or not assigned.fp8_wgrad:
            raise ConfigError(f"precision.modules on engine=megatron: {option} changes Transformer Engine's recipe "
                              "defaults (blocks, NVFP4 parts or the FP8 weight gradient), which megatron-core's "
                              "per-module recipes build without; use engine=torch")


def _validate_one_precision(cfg: Config) -> None:
    precision, gpu, megatron = cfg.precision, cfg.gpu, cfg.engine in MEGATRON_CORE_ENGINES
    _check_recipe_is_named(precision)
    Fp8Training.check(cfg)  # what no recipe computes (a margin outside delayed scaling), an FP8 all-gather it cannot
    if megatron and precision.recipe == Recipe.rowwise:
        raise ConfigError(f"precision={precision.name} is torchao's row-wise recipe, which Transformer Engine does not "
                          f"have (engine={cfg.engine.value} trains with TE's recipes): use engine=torch")
    if precision.recipe == Recipe.nvfp4 and cfg.engine == Engine.nemo:
        raise ConfigError(f"precision={precision.name} on engine=nemo: this project maps no NVFP4 plugin of NeMo 2's "
                          "recipes; use engine=megatron (Transformer Engine's NVFP4BlockScaling, Blackwell) or "
                          "engine=torch with precision.emulate=true")
    if precision.recipe == Recipe.rowwise and precision.fp8_format != Fp8Format.e4m3:
        raise ConfigError(f"precision={precision.name}: torchao's row-wise recipe casts every operand, gradients "
                          "included, to E4M3; set precision.fp8_format=e4m3")
    both_2d = gemms_of_two_2d_operands(precision.block_dims)
    if megatron and both_2d:
        raise ConfigError(f"precision={precision.name} on engine={cfg.engine.value}: {both_2d[0]} would multiply two "
                          "128x128-block operands, which Transformer Engine refuses (no kernel takes them); "
                          "engine=torch emulates it")
    if megatron and precision.emulate:
        raise ConfigError(f"precision.emulate=true is the torch engine's (engine=torch): engine={cfg.engine.value} "
                          "runs Transformer Engine's kernels, which are native or absent")
    # Two 128x128-block operands in one GEMM have no kernel anywhere (check_block_dims): emulated everywhere.
    archs = () if both_2d else native_archs(precision.recipe)
    if precision.emulate and (archs is None or gpu.arch in archs):
        raise ConfigError(f"precision.emulate=true, but precision={precision.name} runs natively on gpu={gpu.name}: "
                          "nothing would be emulated, and the run would be labelled so; leave precision.emulate "
                          "unset (false)")
    if precision.recipe == Recipe.bf16:
        return
    if precision.recipe == Recipe.mxfp8 and gpu.arch not in native_archs(Recipe.mxfp8) and not precision.emulate:
        raise ConfigError(
            f"precision=mxfp8 runs natively only on Blackwell GPUs (b200, gb200); gpu={gpu.name} is {gpu.arch}. "
            f"Choose {' or '.join(_native_fp8_options(gpu.arch, megatron))}"
            + (f" (engine={cfg.engine.value} cannot emulate)." if megatron else ", or set precision.emulate=true to emulate it (slow; labelled).")
        )
    if precision.recipe == Recipe.rowwise and gpu.arch not in native_archs(Recipe.rowwise) and not precision.emulate:
        raise ConfigError(f"precision={precision.name} runs natively on Hopper and Blackwell GPUs (torch._scaled_mm's "
                          f"row-wise scales); gpu={gpu.name} is {gpu.arch}. Set precision.emulate=true to emulate it "
                          "(slow; labelled).")
    if precision.recipe == Recipe.nvfp4 and gpu.arch not in native_archs(Recipe.nvfp4) and not precision.emulate:
        raise ConfigError(
            f"precision={precision.name} runs natively only on Blackwell GPUs (b200, gb200, FP4 tensor cores); "
            f"gpu={gpu.name} is {gpu.arch}."
            + (f" (engine={cfg.engine.value} cannot emulate)" if megatron else " Set precision.emulate=true to emulate "
               "it (NVFP4 values and scales exact, GEMMs on those exact values in BF16 with FP32 sums; labelled)."))
    block_archs = native_archs(Recipe.blockwise, megatron)
    if precision.recipe == Recipe.blockwise and gpu.arch not in block_archs and not precision.emulate:
        raise ConfigError(
            f"precision=fp8_blockwise runs natively on {' and '.join(a.capitalize() for a in block_archs)} GPUs with "
            f"CUDA >= 12.9 (block-scaled "
            f"GEMMs); gpu={gpu.name} is {gpu.arch}."
            + ("" if megatron else " Set precision.emulate=true to emulate it (slow; labelled).")
        )
    if precision.recipe == Recipe.blockwise and _runs_here(cfg):
        _require_cuda(12, 9, "precision=fp8_blockwise (cuBLAS block scaling)")
    if (precision.recipe == Recipe.blockwise and not megatron and precision.fp8_format != Fp8Format.e4m3
            and not precision.emulate):
        raise ConfigError(
            "precision=fp8_blockwise: cuBLAS block-scaled GEMMs on Hopper take E4M3 operands only (no E5M2 "
            "gradients); set precision.fp8_format=e4m3, as conf/precision/fp8_blockwise.yaml does"
        )
    if megatron:
        _validate_megatron_fp8(cfg)
    _validate_gemm_dims(cfg)


def _validate_megatron_fp8(cfg: Config) -> None:
    """What megatron-core's TransformerConfig would reject, and FP8 without Transformer Engine."""
    precision = cfg.precision
    bf16_layers = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if bf16_layers and precision.recipe == Recipe.delayed:
        raise ConfigError(f"engine={cfg.engine.value}: delayed scaling cannot keep first/last layers in BF16 "
                          "(megatron-core rejects it); set precision.num_layers_at_start_in_bf16=0 "
                          "precision.num_layers_at_end_in_bf16=0")
    per_stage = cfg.model.num_layers // cfg.parallel.pp
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if getattr(precision, name) > per_stage:
            raise ConfigError(f"engine={cfg.engine.value}: precision.{name}={getattr(precision, name)} is more than "
                              f"the {per_stage} layers of one pipeline stage (model.num_layers / parallel.pp)")
    if _runs_here(cfg) and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(f"precision={precision.name} on engine={cfg.engine.value} needs Transformer Engine, which "
                          "this Python lacks: run it in the NeMo container (executor=slurm), use precision=bf16, or "
                          "engine=torch for its own FP8 recipes")


def _runs_here(cfg: Config) -> bool:
    """The job will run on this machine's GPUs: what this Python can do is what the job can do."""
    return cfg.executor.name == ExecutorName.local and cfg.gpu.arch != "cpu" and not cfg.dryrun


def _require_cuda(major: int, minor: int, what: str) -> None:
    version = torch.version.cuda
    if version is None or tuple(int(v) for v in version.split(".")[:2]) < (major, minor):
        raise ConfigError(f"{what} needs CUDA >= {major}.{minor}; this PyTorch is built with CUDA {version}. "
                          "Install a PyTorch built for CUDA 12.9 or newer, or choose fp8_current")


# Every dimension an FP8 GEMM contracts or produces must be a multiple of the recipe's block (16 for cuBLAS's
# per-tensor FP8 GEMMs); the token count is the K of wgrad.
# NVFP4: 16 x 16 weight blocks, and K a multiple of 32 in TE's FP4 GEMMs.
GEMM_MULTIPLE = {Recipe.tensorwise: 16, Recipe.delayed: 16, Recipe.blockwise: 128, Recipe.mxfp8: 32, Recipe.rowwise: 16,
                 Recipe.nvfp4: 32}


def _validate_gemm_dims(cfg: Config) -> None:
    model, multiple = cfg.model, GEMM_MULTIPLE[cfg.precision.recipe]
    gemm_dims = {
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads * kv_channels": model.num_attention_heads * model.kv_channels,
        "num_query_groups * kv_channels": model.num_query_groups * model.kv_channels,
        "micro_batch_size * seq_length": cfg.trainer.micro_batch_size * model.seq_length,
    }
    for name, value in gemm_dims.items():
        if value % multiple:
            raise ConfigError(
                f"precision={cfg.precision.name} needs GEMM dimensions divisible by {multiple}: {name} = {value}"
            )


def _validate_parallel(cfg: Config) -> None:
    """The parallel layout: what the torch engine cannot split, and what megatron-core cannot divide."""
    p, m = cfg.parallel, cfg.model
    sizes = {"tp": p.tp, "pp": p.pp, "vp": p.vp, "cp": p.cp}
    if cfg.engine == Engine.torch:
        split = [f"parallel.{name}={size}" for name, size in sizes.items() if size != 1] + (["parallel.fsdp=true"] if p.fsdp else [])
        if split:
            raise ConfigError(f"engine=torch runs data-parallel only; {', '.join(split)} needs engine=megatron "
                              "(or layout=none for data parallelism on the torch engine)")
        return
    for name, size in sizes.items():
        if size < 1:
            raise ConfigError(f"parallel.{name} must be at least 1 (got {size})")
    world, model_parallel = world_size(cfg), model_parallel_size(cfg)
    if world % model_parallel:
        raise ConfigError(f"executor.gpus x executor.nodes = {world} GPUs is not a multiple of parallel.tp x pp x cp "
                          f"= {p.tp} x {p.pp} x {p.cp} = {model_parallel}; change executor.nodes or the layout")
    divisible = {
        "model.num_attention_heads": m.num_attention_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.vocab_size": m.vocab_size,  # the embedding and output layer are split over TP ranks by vocabulary
    }
    for name, value in divisible.items():
        if value % p.tp:
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={p.tp}: each tensor-parallel rank "
                              f"takes an equal share; choose parallel.tp among {_divisors(value, 8)}")
    # megatron-core splits query groups over TP ranks, or replicates them when there are fewer groups than ranks.
    if m.num_query_groups % p.tp and p.tp % m.num_query_groups:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} must be a multiple or a divisor of "
                          f"parallel.tp={p.tp}")
    if p.sp and p.tp == 1:
        raise ConfigError("parallel.sp=true needs tensor parallelism (parallel.tp > 1): sequence parallelism splits "
                          "what tensor parallelism replicates")
    if p.vp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vp={p.vp} interleaves pipeline stages and needs parallel.pp > 1; set parallel.vp=1")
    chunks = p.pp * p.vp
    split_layers = m.num_layers + (2 if p.pp_embedding_loss_as_layers else 0)
    if split_layers % chunks:
        counted = " (+ embedding and loss)" if p.pp_embedding_loss_as_layers else ""
        raise ConfigError(f"model.num_layers{counted} = {split_layers} is not divisible by parallel.pp x parallel.vp "
                          f"= {p.pp} x {p.vp} = {chunks} model chunks; change model.num_layers, parallel.pp or parallel.vp")
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        raise ConfigError(f"model.seq_length={m.seq_length} must be divisible by 2 x parallel.cp = {2 * p.cp}: context "
                          "parallelism gives each rank two chunks (one early, one late) to balance causal attention")


def _divisors(value: int, largest: int) -> list[int]:
    return [d for d in range(1, largest + 1) if value % d == 0]


def _validate_batch(cfg: Config) -> None:
    trainer, dp = cfg.trainer, data_parallel_size(cfg)
    per_step = trainer.micro_batch_size * dp
    if trainer.global_batch_size % per_step:
        fixed = max(per_step, round(trainer.global_batch_size / per_step) * per_step)
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} must be a multiple of micro_batch_size x "
            f"data-parallel size = {trainer.micro_batch_size} x {dp} = {per_step}; "
            f"e.g. trainer.global_batch_size={fixed}"
        )
    if trainer.profile_step is not None and not 1 <= trainer.profile_step <= trainer.max_steps:
        raise ConfigError(f"trainer.profile_step={trainer.profile_step} is not a step of this run (1 to "
                          f"trainer.max_steps={trainer.max_steps}); a step after compilation and warm-up, such as "
                          f"{min(trainer.max_steps, 5)}, shows the steady state")


def check_host_memory(cfg: Config, per_process_bytes: float, processes: int) -> None:
    """A CPU run on this machine whose memory estimate (recipes.plan.memory, per process) exceeds the machine's
    memory would allocate until the kernel kills it: refused before launch. A dry run only plans."""
    if not (cfg.executor.name == ExecutorName.local and cfg.gpu.arch == "cpu" and not cfg.dryrun):
        return
    needed, available = per_process_bytes * processes, host_memory_bytes()
    if needed > available:
        gib = 2**30
        raise ConfigError(
            f"model={cfg.model.name} on this CPU needs about {needed / gib:,.1f} GiB ({processes} process(es) x "
            f"{per_process_bytes / gib:,.1f} GiB: the plan's estimate of weights, gradients, optimizer states and "
            f"activations), more than this machine's {available / gib:,.1f} GiB; train a smaller proxy "
            f"(model.num_layers=N, a smaller trainer.micro_batch_size, trainer.activation_checkpointing=true, or "
            f"model=tiny_llama), or see the plan with dryrun=true"
        )


def host_memory_bytes() -> int:
    """This machine's memory: physical RAM, or the cgroup's limit (a container's) where that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical
