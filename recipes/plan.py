"""Preflight: resolve what the config leaves open, reject what cannot run, and say what will run.

Everything here happens before launch, so a bad combination fails with a message naming the fix instead of a
stack trace from inside an engine, and a recipe is never silently replaced by another precision.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.config import Config, ConfigError, Fp8Format, GradReduce, ModelConfig, Recipe, Recompute, load_option
from recipes.fp8.all_gather import FP8_ALL_GATHER_RECIPES, fp8_all_gather_applies
from recipes.models.transformer import count_parameters
from recipes.nemo import preflight as nemo_preflight

ENGINE_MODULE = {"torch": "recipes.engine.torch_engine", "megatron": "recipes.engine.megatron_engine",
                 "nemo": "recipes.engine.nemo_engine"}
# Engines that train megatron-core models with Transformer Engine: megatron-core's layout and FP8 rules apply.
MEGATRON_CORE_ENGINES = ("megatron", "nemo")

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


def model_parallel_size(cfg: Config) -> int:
    """GPUs that hold one copy of the model: tensor x pipeline x context parallel (1 for the torch engine)."""
    return cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp


def data_parallel_size(cfg: Config) -> int:
    return world_size(cfg) // model_parallel_size(cfg)


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first thing that cannot run."""
    _validate_launch(cfg)
    _validate_model(cfg.model)
    _validate_parallel(cfg)
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
    if cfg.engine == "megatron":
        _validate_megatron_runtime(cfg)
        if cfg.trainer.grad_reduce != GradReduce.per_step:
            raise ConfigError("trainer.grad_reduce is the torch engine's (FSDP2); engine=megatron reduces gradients "
                              "through its DDP/distributed optimizer (parallel.* settings)")
        if cfg.trainer.fsdp_fp8_all_gather:
            raise ConfigError("trainer.fsdp_fp8_all_gather is the torch engine's (FSDP2); on engine=megatron use "
                              "precision.fp8_param_gather")
    if cfg.engine == "nemo":
        nemo_preflight.validate(cfg)
    if cfg.trainer.fsdp_fp8_all_gather and cfg.precision.recipe not in FP8_ALL_GATHER_RECIPES:
        raise ConfigError(f"trainer.fsdp_fp8_all_gather needs a per-tensor FP8 recipe (fp8_current, fp8_delayed), "
                          f"not precision={cfg.precision.name}: block-scaled weights are quantized after the gather")
    if cfg.executor.gpus < 1:
        raise ConfigError(f"executor.gpus must be at least 1 (got {cfg.executor.gpus})")
    if cfg.executor.name == "local" and cfg.gpu.arch != "cpu" and not cfg.dryrun:
        available = torch.cuda.device_count()
        if cfg.executor.gpus > available:
            raise ConfigError(f"executor.gpus={cfg.executor.gpus} but this machine has {available} GPU(s)")


def _validate_megatron_runtime(cfg: Config) -> None:
    if cfg.gpu.arch == "cpu" and not cfg.dryrun:
        raise ConfigError("engine=megatron needs CUDA GPUs (megatron-core's rotary embedding and RNG tracker call "
                          "torch.cuda); on this machine use engine=torch, or dryrun=true to see the plan")
    if cfg.trainer.checkpoint.interval and _runs_here(cfg) and importlib.util.find_spec("psutil") is None:
        raise ConfigError("trainer.checkpoint.interval on engine=megatron: megatron-core's distributed checkpoints "
                          "need psutil (pip install psutil), or set trainer.checkpoint.interval=0")


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


def native_archs(recipe: Recipe, megatron: bool = False) -> tuple[str, ...] | None:
    """The GPU architectures with native GEMMs for a block-scaled recipe (None: a recipe native everywhere). MXFP8:
    Blackwell. Blockwise: Hopper in the torch engine (cuBLAS's sm90 block scaling), Hopper and Blackwell through
    Transformer Engine (engine=megatron). Elsewhere the torch engine emulates them if asked (precision.emulate)."""
    if recipe == Recipe.mxfp8:
        return ("blackwell",)
    if recipe == Recipe.blockwise:
        return ("hopper", "blackwell") if megatron else ("hopper",)
    return None


def _validate_precision(cfg: Config) -> None:
    precision, gpu, megatron = cfg.precision, cfg.gpu, cfg.engine in MEGATRON_CORE_ENGINES
    if precision.recipe == Recipe.bf16:
        return
    if precision.fp8_format is None:
        raise ConfigError(f"precision={precision.name}: set precision.fp8_format (hybrid or e4m3)")
    if megatron and precision.emulate:
        raise ConfigError(f"precision.emulate=true is the torch engine's (engine=torch): engine={cfg.engine} runs "
                          "Transformer Engine's kernels, which are native or absent")
    if precision.recipe == Recipe.mxfp8 and gpu.arch not in native_archs(Recipe.mxfp8) and not precision.emulate:
        raise ConfigError(
            f"precision=mxfp8 runs natively only on Blackwell GPUs (b200, gb200); gpu={gpu.name} is {gpu.arch}. "
            "Choose fp8_current or fp8_blockwise"
            + (f" (engine={cfg.engine} cannot emulate)." if megatron else ", or set precision.emulate=true to emulate it (slow; labelled).")
        )
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
    bf16_layers = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if bf16_layers > cfg.model.num_layers:
        raise ConfigError(
            f"precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16 = {bf16_layers} is more "
            f"than model.num_layers={cfg.model.num_layers}"
        )
    if megatron:
        _validate_megatron_fp8(cfg)
    _validate_gemm_dims(cfg)


def _validate_megatron_fp8(cfg: Config) -> None:
    """What megatron-core's TransformerConfig would reject, and FP8 without Transformer Engine."""
    precision = cfg.precision
    bf16_layers = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if bf16_layers and precision.recipe == Recipe.delayed:
        raise ConfigError(f"engine={cfg.engine}: delayed scaling cannot keep first/last layers in BF16 "
                          "(megatron-core rejects it); set precision.num_layers_at_start_in_bf16=0 "
                          "precision.num_layers_at_end_in_bf16=0")
    per_stage = cfg.model.num_layers // cfg.parallel.pp
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if getattr(precision, name) > per_stage:
            raise ConfigError(f"engine={cfg.engine}: precision.{name}={getattr(precision, name)} is more than the "
                              f"{per_stage} layers of one pipeline stage (model.num_layers / parallel.pp)")
    if _runs_here(cfg) and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(f"precision={precision.name} on engine={cfg.engine} needs Transformer Engine, which this "
                          "Python lacks: run it in the NeMo container (executor=slurm), use precision=bf16, or "
                          "engine=torch for its own FP8 recipes")


def _runs_here(cfg: Config) -> bool:
    """The job will run on this machine's GPUs: what this Python can do is what the job can do."""
    return cfg.executor.name == "local" and cfg.gpu.arch != "cpu" and not cfg.dryrun


def _require_cuda(major: int, minor: int, what: str) -> None:
    version = torch.version.cuda
    if version is None or tuple(int(v) for v in version.split(".")[:2]) < (major, minor):
        raise ConfigError(f"{what} needs CUDA >= {major}.{minor}; this PyTorch is built with CUDA {version}. "
                          "Install a PyTorch built for CUDA 12.9 or newer, or choose fp8_current")


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


def _validate_parallel(cfg: Config) -> None:
    """The parallel layout: what the torch engine cannot split, and what megatron-core cannot divide."""
    p, m = cfg.parallel, cfg.model
    sizes = {"tp": p.tp, "pp": p.pp, "vp": p.vp, "cp": p.cp}
    if cfg.engine == "torch":
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
    if trainer.max_steps < 1:
        raise ConfigError(f"trainer.max_steps must be at least 1 (got {trainer.max_steps})")
    if trainer.profile_step is not None and not 1 <= trainer.profile_step <= trainer.max_steps:
        raise ConfigError(f"trainer.profile_step={trainer.profile_step} is not a step of this run (1 to "
                          f"trainer.max_steps={trainer.max_steps}); a step after compilation and warm-up, such as "
                          f"{min(trainer.max_steps, 5)}, shows the steady state")


@dataclass
class MemoryEstimate:
    """Per-GPU bytes on the busiest GPU: the torch engine's whole model, or 1/N of it under FSDP2; megatron-core's
    first pipeline stage, with the output layer's logits added."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # with the configured parallel.recompute
    activations_full_recompute: float  # what parallel.recompute=full would leave

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


# Bytes per parameter of (weights, gradients, optimizer states).
#   torch engine: FP32 master weights are the model's weights; FP32 gradients; two FP32 Adam moments.
#   megatron-core: BF16 weights (FP8 with fp8_param_gather), FP32 gradient buffer (main_grad), and FP32 master
#   weights + two moments in the optimizer, which the distributed optimizer shards over data parallel
#   (Megatron's 18 bytes per parameter become 6 + 12 / DP; Megatron-FSDP shards all three).
TORCH_BYTES = (4.0, 4.0, 8.0)
MEGATRON_BYTES = (2.0, 4.0, 12.0)


def activation_bytes_per_token_layer(cfg: Config) -> tuple[float, float]:
    """Bytes one token leaves saved for the backward in one layer: (replicated over TP ranks, split over them).

    The two norm inputs and the residual (3h) are replicated over TP ranks unless sequence parallelism splits
    them; Q, K, V (q + 2kv), the attention output and its softmax statistics (2q), fc1's output and the
    activation (fc1 + f) are split. The torch engine's FP8 recipes save the four GEMM inputs once more in FP8
    (1 byte); Transformer Engine saves the FP8 copy instead of the BF16 one, which is counted here as BF16 (an upper
    bound). Selective recompute drops the attention output and statistics.
    """
    m = cfg.model
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    fc1 = 2 * m.ffn_hidden_size if m.activation.value == "swiglu" else m.ffn_hidden_size
    attention_core = 0 if cfg.parallel.recompute == Recompute.selective else 2 * q
    norms_and_residual = 2.0 * 3 * m.hidden_size
    split = 2.0 * (q + 2 * kv + attention_core + fc1 + m.ffn_hidden_size)
    if cfg.precision.recipe != Recipe.bf16 and cfg.engine == "torch":
        norms_and_residual += 2 * m.hidden_size
        split += q + m.ffn_hidden_size
    return norms_and_residual, split


def estimate_memory(cfg: Config, parameters: int) -> MemoryEstimate:
    """Weights, gradients and optimizer states of the busiest GPU's share of the model, and the activations it
    keeps for the backward (approximate: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", with flash attention and GQA).

    With pipeline parallelism the first stage keeps activations of min(pp, micro-batches) micro-batches of its
    num_layers / pp layers, x (1 + (pp - 1) / (pp x vp)) with the interleaved schedule. The logits (BF16 and FP32
    for the loss: 6 bytes per vocabulary entry, split over TP) live on the last stage and are added as an
    upper bound.
    """
    if cfg.engine == "torch":
        return _torch_engine_memory(cfg, parameters)
    m, p = cfg.model, cfg.parallel
    embedding = m.vocab_size * m.hidden_size
    per_layer = (parameters - 2 * embedding) / m.num_layers  # final norm counted into the layers: negligible
    stage_layers = math.ceil(m.num_layers / p.pp)
    stage_parameters = (stage_layers * per_layer + embedding * (2 if p.pp == 1 else 1)) / p.tp
    weight_bytes, grad_bytes, optimizer_bytes = MEGATRON_BYTES
    if cfg.precision.recipe != Recipe.bf16 and cfg.precision.fp8_param_gather:
        weight_bytes = 1.0
    if cfg.engine == "nemo":
        grad_bytes = 2.0  # NeMo's gradient buffer is BF16: grad_reduce_in_fp32=False (recipes.nemo.mapping)
    shards = data_parallel_size(cfg) * p.cp  # megatron's data-parallel group for optimizer states includes CP
    if p.fsdp:
        weight_bytes, grad_bytes = weight_bytes / shards, grad_bytes / shards
    if p.distributed_optimizer or p.fsdp:
        optimizer_bytes /= shards

    tokens = cfg.trainer.micro_batch_size * m.seq_length / p.cp
    replicated, split = activation_bytes_per_token_layer(cfg)
    sp = p.sequence_parallel
    per_layer_activations = tokens * ((replicated / p.tp if sp else replicated) + split / p.tp)
    layer_input = tokens * 2.0 * m.hidden_size / (p.tp if sp else 1)  # all that full recompute keeps per layer
    micro_batches = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * data_parallel_size(cfg))
    in_flight = min(p.pp, micro_batches) * (1 + (p.pp - 1) / (p.pp * p.vp) if p.vp > 1 else 1)
    logits = tokens * 6.0 * m.vocab_size / p.tp
    kept = stage_layers * in_flight
    no_recompute = kept * per_layer_activations + logits
    full_recompute = kept * layer_input + per_layer_activations + logits  # plus the one layer being recomputed
    activations = full_recompute if p.recompute == Recompute.full else no_recompute
    return MemoryEstimate(
        weight_bytes * stage_parameters,
        grad_bytes * stage_parameters,
        optimizer_bytes * stage_parameters,
        float(activations),
        float(full_recompute),
    )


def _torch_engine_weight_gather(cfg: Config, processes: int) -> str:
    if fp8_all_gather_applies(cfg, processes):
        return "; weights all-gathered in FP8 by FSDP2 (trainer.fsdp_fp8_all_gather)"
    if cfg.precision.fp8_param_gather:
        return ("; weights all-gathered in BF16 (precision.fp8_param_gather is engine=megatron's; "
                "trainer.fsdp_fp8_all_gather=true gathers FP8 here)")
    return ""


def _torch_engine_memory(cfg: Config, parameters: int) -> MemoryEstimate:
    """FP32 master weights and gradients, two FP32 Adam moments, and the tensors saved for the backward
    (activation_bytes_per_token_layer, no tensor parallelism).

    Over N > 1 processes (FSDP2) each holds 1/N of the weights, gradients and moments, plus the BF16 weights
    all-gathered at a time (the root's embedding and output layer, a layer and the next one prefetched); with
    gradient accumulation the whole model's FP32 gradients are accumulated unsharded until the last
    micro-batch's reduce-scatter, unless trainer.grad_reduce=per_micro_batch. FP8 layers under accumulation keep
    their weights quantized (and transposed) for the step: 2 bytes per linear weight, unless FSDP2 all-gathers
    them in FP8 (then a gathered layer weighs 1 byte per weight and nothing is cached). With activation
    checkpointing only each layer's input (h) is kept, and one layer's tensors at a time.
    """
    m, t = cfg.model, cfg.trainer
    per_token_layer = sum(activation_bytes_per_token_layer(cfg))
    tokens = t.micro_batch_size * m.seq_length
    logits = tokens * 6.0 * m.vocab_size
    checkpointed = tokens * (m.num_layers * 2.0 * m.hidden_size + per_token_layer) + logits
    activations = checkpointed if t.activation_checkpointing else tokens * m.num_layers * per_token_layer + logits
    weights, gradients, optimizer = (b * parameters for b in TORCH_BYTES)
    dp = world_size(cfg)
    accumulates = t.global_batch_size > t.micro_batch_size * dp
    fp8_gather = fp8_all_gather_applies(cfg, dp)
    if dp > 1:
        root = 2 * m.vocab_size * m.hidden_size
        layer_bytes = 1.0 if fp8_gather else 2.0  # FP8 all-gather: the layers' weights arrive in one byte
        gathered = 2.0 * root + layer_bytes * 2 * (parameters - root) / m.num_layers
        unsharded = accumulates and t.grad_reduce == GradReduce.per_step
        # The sharded gradients exist only from the last micro-batch's reduce-scatter to the optimizer step, while
        # the unsharded ones are freed layer by layer: the peak is the larger of the two.
        weights, optimizer = weights / dp + gathered, optimizer / dp
        gradients = gradients if unsharded else gradients / dp
    if accumulates and cfg.precision.recipe != Recipe.bf16 and not fp8_gather:
        weights += 2.0 * (parameters - 2 * m.vocab_size * m.hidden_size)  # the FP8 weight caches
    return MemoryEstimate(weights, gradients, optimizer, float(activations), float(checkpointed))


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


def describe_layout(cfg: Config) -> str:
    p = cfg.parallel
    parts = [f"tp {p.tp}", f"pp {p.pp}" + (f" (vp {p.vp})" if p.vp > 1 else ""), f"cp {p.cp}", f"dp {data_parallel_size(cfg)}"]
    options = [name for name, on in (("sequence parallel", p.sequence_parallel), ("Megatron-FSDP", p.fsdp),
                                     ("distributed optimizer", p.distributed_optimizer and not p.fsdp),
                                     ("embedding and loss counted as layers", p.pp_embedding_loss_as_layers)) if on]
    return " x ".join(parts) + "".join(f", {o}" for o in options) + f", recompute {p.recompute.value}"


def describe(plan: Plan) -> str:
    cfg, mem = plan.cfg, plan.memory
    t = cfg.trainer
    dp = data_parallel_size(cfg)
    accumulation = t.global_batch_size // (t.micro_batch_size * dp)
    gib = 2**30
    capacity = f" of {cfg.gpu.memory_gb:.0f} GB" if cfg.gpu.memory_gb else ""
    megatron = cfg.engine in MEGATRON_CORE_ENGINES
    fixes = ("parallel.recompute=full, a larger parallel.tp or parallel.pp, " if megatron
             else "trainer.grad_reduce=per_micro_batch, "
             if plan.processes > 1 and accumulation > 1 and t.grad_reduce == GradReduce.per_step else "")
    over = (
        f"  <- does not fit: use more GPUs (executor.gpus, executor.nodes), {fixes}"
        f"{'' if megatron or t.activation_checkpointing else 'trainer.activation_checkpointing=true, '}"
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
        + ")"
        + (_torch_engine_weight_gather(cfg, plan.processes) if cfg.engine == "torch" and plan.processes > 1 else ""),
        f"gpu         {cfg.gpu.name} ({cfg.gpu.arch}), {plan.processes} process(es) on {cfg.executor.nodes} node(s)"
        + (" sharding the model (FSDP2)" if plan.processes > 1 and cfg.engine == "torch" else "") + ", "
        f"executor {describe_executor(cfg)}, engine {cfg.engine}",
        *([f"layout      {describe_layout(cfg)}"] if megatron else []),
        *(nemo_preflight.describe(cfg) if cfg.engine == "nemo" else []),
        f"batch       micro {t.micro_batch_size} x {dp} data-parallel x {accumulation} accumulation = "
        f"global {t.global_batch_size} sequences; {t.max_steps} steps, lr {t.lr} (warm-up {t.warmup_steps}, cosine to {t.min_lr})"
        + ("; activation checkpointing" if t.activation_checkpointing else "")
        + ("; gradients reduce-scattered every micro-batch"
           if t.grad_reduce == GradReduce.per_micro_batch and plan.processes > 1 and accumulation > 1 else ""),
        f"data        {cfg.data.name} ({cfg.data.kind.value}" + (f", {cfg.data.path}" if cfg.data.path else "") + ")",
        f"memory/GPU  ~{mem.total / gib:,.1f} GiB{capacity} (weights {mem.weights / gib:,.1f}, grads "
        f"{mem.gradients / gib:,.1f}, optimizer {mem.optimizer / gib:,.1f}, activations {mem.activations / gib:,.1f}; "
        f"{mem.activations_full_recompute / gib:,.1f} with full recompute){over}",
        f"run dir     {cfg.run.dir}",
        f"command     {' '.join(plan.command)}",
    ]
    return "\n".join(lines)
