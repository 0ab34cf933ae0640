"""Preflight: resolve what the config leaves open, reject what cannot run, and say what will run.

Everything here happens before launch, so a bad combination fails with a message naming the fix instead of a
stack trace from inside an engine, and a recipe is never silently replaced by another precision.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.config import Config, ConfigError, Fp8Format, ModelConfig, Recipe, load_option
from recipes.models.transformer import count_parameters

ENGINE_MODULE = {"torch": "recipes.engine.torch_engine"}

# Substrings of torch.cuda.get_device_name() -> conf/gpu option; "gb200" before "b200" (it contains it).
KNOWN_GPUS = (("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"))


def detect_gpu() -> str:
    """The conf/gpu option of the local device: cpu without CUDA; an unknown GPU is an error, not a guess."""
    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name()
    for token, option in KNOWN_GPUS:
        if token in device_name.lower():
            return option
    raise ConfigError(
        f"gpu=auto found '{device_name}', which has no file in conf/gpu; pass gpu=<one of "
        f"{', '.join(option for _, option in KNOWN_GPUS)}, cpu> or add conf/gpu/<name>.yaml with its peaks"
    )


def resolve(cfg: Config) -> Config:
    """Fill in what is decided at launch: the detected GPU for gpu=auto."""
    if cfg.gpu.name == "auto" and cfg.executor.name == "slurm":
        raise ConfigError("executor=slurm: name the cluster's GPU (gpu=h100, h200, b200, gb200 or cpu); gpu=auto "
                          "would detect this machine's device, not the compute nodes'")
    if cfg.gpu.name == "auto":
        cfg = dataclasses.replace(cfg, gpu=load_option("gpu", detect_gpu()))
    return cfg


def world_size(cfg: Config) -> int:
    return cfg.executor.gpus * cfg.executor.nodes


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first thing that cannot run."""
    _validate_launch(cfg)
    _validate_model(cfg.model)
    _validate_precision(cfg)
    _validate_batch(cfg)


def _validate_launch(cfg: Config) -> None:
    if cfg.engine not in ENGINE_MODULE:
        raise ConfigError(f"engine={cfg.engine} is not available; valid engines: {', '.join(ENGINE_MODULE)}")
    if cfg.executor.name == "local" and cfg.executor.nodes != 1:
        raise ConfigError(f"executor=local runs on this machine only: set executor.nodes=1 (got {cfg.executor.nodes})")
    if cfg.executor.name == "slurm" and cfg.executor.slurm is None:
        raise ConfigError("executor.slurm is missing: choose executor=slurm (conf/executor/slurm.yaml) rather than "
                          "executor.name=slurm")
    if cfg.executor.gpus < 1:
        raise ConfigError(f"executor.gpus must be at least 1 (got {cfg.executor.gpus})")
    if cfg.executor.name == "local" and cfg.gpu.arch != "cpu" and not cfg.dryrun:
        available = torch.cuda.device_count()
        if cfg.executor.gpus > available:
            raise ConfigError(f"executor.gpus={cfg.executor.gpus} but this machine has {available} GPU(s)")


def _validate_model(model: ModelConfig) -> None:
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={model.num_query_groups}"
        )
    rotary_dim = model.kv_channels * model.rotary_percent
    if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
        raise ConfigError(f"model.kv_channels * model.rotary_percent = {rotary_dim} must be an even integer")
    if model.num_layers < 1:
        raise ConfigError(f"model.num_layers must be at least 1 (got {model.num_layers})")


def _validate_precision(cfg: Config) -> None:
    precision, gpu = cfg.precision, cfg.gpu
    if precision.fp8_param_gather and cfg.engine == "torch" and world_size(cfg) > 1:
        raise ConfigError(
            f"precision.fp8_param_gather=true (NeMo's {precision.name} preset) is not supported by the torch engine: "
            "its FSDP2 all-gathers BF16 weights and each FP8 layer quantizes the gathered weight. "
            "Set precision.fp8_param_gather=false."
        )
    if precision.recipe == Recipe.bf16:
        return
    if precision.fp8_format is None:
        raise ConfigError(f"precision={precision.name}: set precision.fp8_format (hybrid or e4m3)")
    if precision.recipe == Recipe.mxfp8 and gpu.arch != "blackwell" and not precision.emulate:
        raise ConfigError(
            f"precision=mxfp8 runs natively only on Blackwell GPUs (b200, gb200); gpu={gpu.name} is {gpu.arch}. "
            "Choose fp8_current or fp8_blockwise, or set precision.emulate=true to emulate it (slow; labelled)."
        )
    if precision.recipe == Recipe.blockwise and gpu.arch != "hopper" and not precision.emulate:
        raise ConfigError(
            f"precision=fp8_blockwise runs natively on Hopper GPUs (h100, h200; cuBLAS block scaling, CUDA >= 12.9); "
            f"gpu={gpu.name} is {gpu.arch}. Set precision.emulate=true to emulate it (slow; labelled)."
        )
    if precision.recipe == Recipe.blockwise and precision.fp8_format != Fp8Format.e4m3 and not precision.emulate:
        raise ConfigError(
            "precision=fp8_blockwise: cuBLAS block-scaled GEMMs on Hopper take E4M3 operands only (no E5M2 "
            "gradients); set precision.fp8_format=e4m3, as conf/precision/fp8_blockwise.yaml does"
        )
    bf16_layers = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if bf16_layers > cfg.model.num_layers:
        raise ConfigError(
            f"precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16 = {bf16_layers} is more "
            f"than model.num_layers={cfg.model.num_layers}"
        )
    _validate_gemm_dims(cfg)


# Every dimension an FP8 GEMM contracts or produces must be a multiple of the recipe's block (16 for cuBLAS's
# per-tensor FP8 GEMMs); the token count is the K of wgrad.
GEMM_MULTIPLE = {Recipe.tensorwise: 16, Recipe.delayed: 16, Recipe.blockwise: 128, Recipe.mxfp8: 32}


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


def _validate_batch(cfg: Config) -> None:
    trainer, dp = cfg.trainer, world_size(cfg)
    per_step = trainer.micro_batch_size * dp
    if trainer.global_batch_size % per_step:
        fixed = max(per_step, round(trainer.global_batch_size / per_step) * per_step)
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} must be a multiple of micro_batch_size x "
            f"data-parallel size = {trainer.micro_batch_size} x {dp} = {per_step}; "
            f"e.g. trainer.global_batch_size={fixed}"
        )
    if trainer.max_steps < 1:
        raise ConfigError(f"trainer.max_steps must be at least 1 (got {trainer.max_steps})")


@dataclass
class MemoryEstimate:
    """Per-GPU bytes: one process holds the whole model; several shard it (FSDP2, recipes.engine.fsdp)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def estimate_memory(cfg: Config, parameters: int) -> MemoryEstimate:
    """FP32 master weights and gradients, two FP32 Adam moments, and the tensors saved for the backward.

    Over N > 1 processes (FSDP2) each holds 1/N of the weights, gradients and moments, plus the BF16 weights
    all-gathered at a time (the root's embedding and output layer, a layer and the next one prefetched); with
    gradient accumulation the whole model's FP32 gradients are accumulated unsharded until the last
    micro-batch's reduce-scatter (no reduce-scatter per micro-batch: less traffic, more memory).

    Saved per token and layer (approximate; compilation can recompute some): the two norm inputs and the
    residual (3h), Q, K, V (q + 2kv), attention output and its softmax statistics (2q), fc1 output and the
    activation (fc1 + f); inputs of the four GEMMs are saved once more in FP8 (1 byte) by the FP8 recipes.
    With activation checkpointing only each layer's input (h) is kept, and one layer's tensors at a time.
    Plus the logits, in BF16 and as FP32 for the loss (6 bytes per vocabulary entry).
    """
    m, t = cfg.model, cfg.trainer
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    fc1 = 2 * m.ffn_hidden_size if m.activation.value == "swiglu" else m.ffn_hidden_size
    per_token_layer = 2 * (3 * m.hidden_size + q + 2 * kv + 2 * q + fc1 + m.ffn_hidden_size)
    if cfg.precision.recipe != Recipe.bf16:
        per_token_layer += 2 * m.hidden_size + q + m.ffn_hidden_size
    tokens = t.micro_batch_size * m.seq_length
    if t.activation_checkpointing:
        saved_layers = m.num_layers * 2 * m.hidden_size + per_token_layer
    else:
        saved_layers = m.num_layers * per_token_layer
    activations = tokens * (saved_layers + 6 * m.vocab_size)
    dp = world_size(cfg)
    if dp == 1:
        return MemoryEstimate(4.0 * parameters, 4.0 * parameters, 8.0 * parameters, float(activations))
    root = 2 * m.vocab_size * m.hidden_size
    gathered = 2.0 * (root + 2 * (parameters - root) / m.num_layers)
    accumulates = t.global_batch_size > t.micro_batch_size * dp
    # The sharded gradients exist only from the last micro-batch's reduce-scatter to the optimizer step, while
    # the unsharded ones are freed layer by layer: the peak is the larger of the two.
    gradients = 4.0 * parameters if accumulates else 4.0 * parameters / dp
    return MemoryEstimate(4.0 * parameters / dp + gathered, gradients, 8.0 * parameters / dp, float(activations))


@dataclass
class Plan:
    cfg: Config
    parameters: int
    memory: MemoryEstimate
    command: list[str]

    @property
    def processes(self) -> int:
        return world_size(self.cfg)


def engine_command(cfg: Config, config_path: Path) -> list[str]:
    module = ENGINE_MODULE[cfg.engine]
    if world_size(cfg) > 1:
        return ["torchrun", f"--nproc-per-node={cfg.executor.gpus}", f"--nnodes={cfg.executor.nodes}", "-m", module, str(config_path)]
    return [sys.executable, "-m", module, str(config_path)]


def make_plan(cfg: Config, config_path: Path) -> Plan:
    validate(cfg)
    parameters = count_parameters(cfg.model)
    return Plan(cfg, parameters, estimate_memory(cfg, parameters), engine_command(cfg, config_path))


def describe_executor(cfg: Config) -> str:
    slurm = cfg.executor.slurm
    if cfg.executor.name != "slurm" or slurm is None:
        return cfg.executor.name
    where = [f"partition {slurm.partition}" if slurm.partition else "default partition",
             f"account {slurm.account}" if slurm.account else None, f"time {slurm.time}",
             f"container {slurm.container_image}" if slurm.container_image else "no container"]
    return f"slurm ({', '.join(filter(None, where))})"


def describe(plan: Plan) -> str:
    cfg, mem = plan.cfg, plan.memory
    t = cfg.trainer
    accumulation = t.global_batch_size // (t.micro_batch_size * plan.processes)
    gib = 2**30
    capacity = f" of {cfg.gpu.memory_gb:.0f} GB" if cfg.gpu.memory_gb else ""
    over = (
        "  <- does not fit: use more GPUs (executor.gpus, executor.nodes), trainer.activation_checkpointing=true, "
        "fewer layers (model.num_layers=N) or a smaller trainer.micro_batch_size"
        if cfg.gpu.memory_gb and mem.total > cfg.gpu.memory_gb * 1e9
        else ""
    )
    lines = [
        f"model       {cfg.model.name}: {plan.parameters:,} parameters, {cfg.model.num_layers} layers, "
        f"hidden {cfg.model.hidden_size}, seq {cfg.model.seq_length}",
        f"precision   {cfg.precision.name} (recipe {cfg.precision.recipe.value}"
        + (f", format {cfg.precision.fp8_format.value}" if cfg.precision.fp8_format else "")
        + (", emulated" if cfg.precision.emulate else "")
        + ")",
        f"gpu         {cfg.gpu.name} ({cfg.gpu.arch}), {plan.processes} process(es) on {cfg.executor.nodes} node(s)"
        + (" sharding the model (FSDP2)" if plan.processes > 1 else "") + ", "
        f"executor {describe_executor(cfg)}, engine {cfg.engine}",
        f"batch       micro {t.micro_batch_size} x {plan.processes} processes x {accumulation} accumulation = "
        f"global {t.global_batch_size} sequences; {t.max_steps} steps, lr {t.lr} (warm-up {t.warmup_steps}, cosine to {t.min_lr})"
        + ("; activation checkpointing" if t.activation_checkpointing else ""),
        f"data        {cfg.data.name} ({cfg.data.kind.value}" + (f", {cfg.data.path}" if cfg.data.path else "") + ")",
        f"memory/GPU  ~{mem.total / gib:,.1f} GiB{capacity} (weights {mem.weights / gib:,.1f}, grads "
        f"{mem.gradients / gib:,.1f}, Adam {mem.optimizer / gib:,.1f}, activations {mem.activations / gib:,.1f}){over}",
        f"run dir     {cfg.run.dir}",
        f"command     {' '.join(plan.command)}",
    ]
    return "\n".join(lines)
