"""The plan as launch/run.py prints it: model, precision, GPUs, layout, batch, data, memory, run dir, command."""

from __future__ import annotations

import shlex

from recipes.compute import describe_compute
from recipes.models.attention import describe_order
from recipes.config import (
    NVFP4_KNOBS, Config, Engine, ExecutorName, GradReduce, PrecisionConfig, Recipe, module_assignment,
)
from recipes.fp8 import Fp8Training
from recipes.plan import Plan
from recipes.nemo import preflight as nemo_preflight
from recipes.plan.checks import MEGATRON_CORE_ENGINES, megatron_tuning
from recipes.plan.parallel import data_parallel_size
from recipes.trainer.loop import learning_rate


def describe_blocks(block_dims: tuple[int, int, int]) -> str:
    """Blockwise scaling's blocks per operand, as the plan prints them: input 1x128, weight 128x128, grad 1x128."""
    return ", ".join(f"{role} {'128x128' if dim == 2 else '1x128'}" for role, dim in zip(("input", "weight", "grad"),
                                                                                    block_dims))


def describe_nvfp4(precision: PrecisionConfig) -> str:
    """NVFP4's parts as the plan prints them: E2M1 in 1x16 blocks with E4M3 scales, weights 16x16, Hadamard
    transform on, stochastic rounding on."""
    on = {knob: "off" if knob in precision.nvfp4_parts_disabled else "on" for knob in NVFP4_KNOBS}
    return (f"E2M1 in 1x16 blocks with E4M3 scales, weights "
            f"{'1x16' if on['disable_2d_quantization'] == 'off' else '16x16'}, Hadamard transform "
            f"{on['disable_rht']}, stochastic rounding {on['disable_stochastic_rounding']}")


def describe_modules(precision: PrecisionConfig, num_layers: int) -> str:
    """Every linear's precision option, compactly: fp8_current: layers 1-6 attention.qkv, attention.out, mlp.fc1,
    mlp.fc2 | bf16: layers 0, 7 attention.qkv, ...; output_layer (recipes.config.module_assignment)."""
    kinds: dict[str, dict[str, list[int]]] = {}
    for name, option in module_assignment(precision, num_layers).items():
        layer, _, kind = name.removeprefix("layers.").partition(".")
        kinds.setdefault(option, {}).setdefault(kind or name, []).append(int(layer) if kind else -1)
    parts = []
    for option, by_kind in kinds.items():
        groups: dict[tuple[int, ...], list[str]] = {}
        for kind, layers in by_kind.items():
            groups.setdefault(tuple(layers), []).append(kind)
        parts.append(f"{option}: " + "; ".join(
            ", ".join(names) if layers == (-1,) else f"layers {_ranges(layers)} {', '.join(names)}"
            for layers, names in groups.items()))
    return " | ".join(parts)


def _ranges(indices: tuple[int, ...]) -> str:
    """0, 2-5, 7 for (0, 2, 3, 4, 5, 7)."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _torch_engine_weight_gather(cfg: Config, processes: int) -> str:
    if Fp8Training.for_run(cfg, processes).gathers_weights_in_fp8:
        return "; weights all-gathered in FP8 by FSDP2 (trainer.fsdp_fp8_all_gather)"
    if cfg.precision.fp8_param_gather:
        return ("; weights all-gathered in BF16 (precision.fp8_param_gather is engine=megatron's; "
                "trainer.fsdp_fp8_all_gather=true gathers FP8 here)")
    return ""


def describe_executor(cfg: Config) -> str:
    slurm = cfg.executor.slurm
    if cfg.executor.name != ExecutorName.slurm or slurm is None:
        return cfg.executor.name.value
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


def describe_torch_kernels(cfg: Config) -> str:
    """engine=torch: the attention kernels' order (recipes.models.attention) and the output layer's loss."""
    loss = ("fused, in chunks (trainer.fused_loss)" if cfg.trainer.fused_loss
            else "from FP32 logits (trainer.fused_loss=false)")
    return f"attention {describe_order(cfg.gpu.arch != 'cpu')} (SDPA, the first that runs); output layer + loss {loss}"


def describe(plan: Plan) -> str:
    cfg, mem = plan.cfg, plan.memory
    t = cfg.trainer
    dp = data_parallel_size(cfg)
    accumulation = t.global_batch_size // (t.micro_batch_size * dp)
    gib = 2**30
    capacity = f" of {cfg.gpu.memory_gb:.0f} GB" if cfg.gpu.memory_gb else ""
    megatron = cfg.engine in MEGATRON_CORE_ENGINES
    sharded = cfg.engine == Engine.torch and plan.processes > 1  # FSDP2
    # a CPU run's processes share the host's memory: no GPU wording there
    memory = (f"memory/GPU  ~{mem.total / gib:,.1f} GiB{capacity}" if cfg.gpu.arch != "cpu"
              else f"memory      ~{mem.total / gib:,.1f} GiB per process{capacity}")
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
        + (f", format {cfg.precision.fp8_format.value}" if cfg.precision.fp8_format
           and cfg.precision.recipe != Recipe.nvfp4 else "")
        + (f", blocks {describe_blocks(cfg.precision.block_dims)}" if cfg.precision.recipe == Recipe.blockwise else "")
        + (f", {describe_nvfp4(cfg.precision)}" if cfg.precision.recipe == Recipe.nvfp4 else "")
        + (", emulated" if cfg.precision.emulate else "")
        + ")"
        + (_torch_engine_weight_gather(cfg, plan.processes) if sharded else ""),
        *([f"modules     {describe_modules(cfg.precision, cfg.model.num_layers)}"]
          if cfg.precision.recipe != Recipe.bf16 or cfg.precision.modules else []),
        f"gpu         {cfg.gpu.name} ({cfg.gpu.arch}), {plan.processes} process(es) on {cfg.executor.nodes} node(s)"
        + (" sharding the model (FSDP2)" if sharded else "") + ", "
        f"executor {describe_executor(cfg)}, engine {cfg.engine.value}",
        *([f"compute     {describe_compute(cfg)}"] if cfg.engine != Engine.nemo else []),
        *([f"kernels     {describe_torch_kernels(cfg)}"] if cfg.engine == Engine.torch else []),
        *([f"layout      {describe_layout(cfg)}"] if megatron else []),
        *([f"tuning      {megatron_tuning(cfg)}"] if cfg.engine == Engine.megatron else []),
        *(nemo_preflight.describe(cfg) if cfg.engine == Engine.nemo else []),
        f"batch       micro {t.micro_batch_size} x {dp} data-parallel x {accumulation} accumulation = "
        f"global {t.global_batch_size} sequences; {t.max_steps} steps, lr {t.lr} (warm-up {t.warmup_steps}, cosine to {t.min_lr})"
        + (f"; the warm-up is longer than the run: the learning rate ends at {learning_rate(t.max_steps, t):.3g}, "
           "short of trainer.lr (trainer.warmup_steps)" if t.warmup_steps > t.max_steps else "")
        + ("; activation checkpointing" if t.activation_checkpointing else "")
        + ("; gradients reduce-scattered every micro-batch"
           if t.grad_reduce == GradReduce.per_micro_batch and plan.processes > 1 and accumulation > 1 else ""),
        f"data        {cfg.data.name} ({cfg.data.kind.value}" + (f", {cfg.data.path}" if cfg.data.path else "") + ")",
        f"{memory} (weights {mem.weights / gib:,.1f}, grads "
        f"{mem.gradients / gib:,.1f}, optimizer {mem.optimizer / gib:,.1f}, activations {mem.activations / gib:,.1f}; "
        f"{mem.activations_full_recompute / gib:,.1f} with full recompute){over}",
        f"run dir     {cfg.run.dir}" + (" (continues from its checkpoint)" if plan.resumes else ""),
        f"command     {shlex.join(plan.command)}",
    ]
    return "\n".join(lines)
