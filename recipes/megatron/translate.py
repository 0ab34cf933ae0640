"""The resolved Config as megatron-core objects: what Megatron-LM's argument parser would build from the same run.

    transformer_config(cfg)   TransformerConfig: the architecture (conf/model), the FP8 recipe (conf/precision),
                              the model-parallel layout (cfg.parallel), recomputation and the kernel fusions
    gpt_model_kwargs(cfg)     GPTModel's own arguments: vocabulary, context length, rotary embedding
    ddp_config(cfg)           DistributedDataParallelConfig: gradient reduction, FP8 parameter all-gather, FSDP
    optimizer_config(cfg)     OptimizerConfig: Adam with decoupled weight decay, clipping, distributed optimizer
    fusions(cfg, kernels)     cfg.megatron's fusion switches resolved against the kernels this Python can load

megatron-core validates each object when it is built (TransformerConfig.__post_init__), so a config that passed
recipes.plan.checks.validate and still fails here is a gap in that preflight.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from packaging.version import Version

from recipes.config import (
    OUTPUT_LAYER, Activation, Config, ConfigError, Normalization, Recipe, Recompute, RopeScaling, module_assignment,
    module_precision,
)
from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.quantization.quant_config import RecipeConfig
from megatron.core.transformer import TransformerConfig


def architecture(cfg: Config) -> dict:
    """Llama 3: RMSNorm, SwiGLU (gated SiLU), GQA. Nemotron-4: LayerNorm with zero-centred gamma ("layernorm1p",
    Megatron-LM's --apply-layernorm-1p), squared ReLU, not gated. Neither has biases or dropout."""
    m = cfg.model
    return dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization="RMSNorm" if m.normalization == Normalization.rmsnorm else "LayerNorm",
        layernorm_zero_centered_gamma=m.normalization == Normalization.layernorm1p,
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=m.activation == Activation.swiglu,
        activation_func=F.silu if m.activation == Activation.swiglu else squared_relu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
    )


def fp8_fields(cfg: Config) -> dict:
    """The precision's FP8 recipe as TransformerConfig fields (REFERENCE section 4); nothing for BF16."""
    p = cfg.precision
    if p.recipe == Recipe.bf16:
        return {}
    bf16_layers = dict(first_last_layers_bf16=bool(p.num_layers_at_start_in_bf16 or p.num_layers_at_end_in_bf16),
                       num_layers_at_start_in_bf16=p.num_layers_at_start_in_bf16,
                       num_layers_at_end_in_bf16=p.num_layers_at_end_in_bf16)
    if p.recipe == Recipe.nvfp4:  # megatron-core's FP4 path: TE's NVFP4BlockScaling (recipes.megatron.te_recipe)
        return dict(fp4="e2m1", fp4_recipe="nvfp4", fp4_param=p.fp8_param_gather, **bf16_layers)
    fields = dict(
        fp8=p.fp8_format.value,
        fp8_recipe=p.recipe.value,
        fp8_margin=p.margin,
        fp8_wgrad=p.fp8_wgrad,
        fp8_param=p.fp8_param_gather,  # Megatron-LM's --fp8-param-gather sets both this and the DDP field
        **bf16_layers,
    )
    if p.recipe == Recipe.delayed:  # the amax history is delayed scaling's alone
        fields.update(fp8_amax_history_len=p.amax_history_len, fp8_amax_compute_algo=p.amax_compute_algo.value)
    return fields


def parallel_fields(cfg: Config) -> dict:
    p = cfg.parallel
    return dict(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vp if p.vp > 1 else None,
        context_parallel_size=p.cp,
        sequence_parallel=p.sequence_parallel,
        account_for_embedding_in_pipeline_split=p.pp_embedding_loss_as_layers,
        account_for_loss_in_pipeline_split=p.pp_embedding_loss_as_layers,
    )


def recompute_fields(cfg: Config) -> dict:
    recompute = cfg.parallel.recompute
    if recompute == Recompute.full:  # every layer: keep its input, recompute the rest in the backward
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == Recompute.selective:
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


@dataclass(frozen=True)
class Kernels:
    """The fused kernels the Python that builds the model can load (available_kernels)."""

    transformer_engine: bool  # TE's layers, fused RoPE and cross-entropy, and its own wgrad accumulation
    # wgrad accumulation in megatron-core's own linears: Apex's fused_weight_gradient_mlp_cuda, or on CUDA without
    # Apex recipes.megatron.wgrad (megatron-core's fused backward allocates on the CUDA device: not on a CPU)
    wgrad_accumulation: bool
    apex_softmax: bool  # Apex's fused softmax kernels: megatron-core's local attention
    # megatron-core's layer graphs replay with TE's FP8 weights: before 0.19.0 each replay copies every captured
    # weight onto itself, which TE's Float8Tensor turns into a copy of its bytes onto themselves that CUDA refuses
    # ("invalid argument"; fixed by Megatron-LM #5451, which skips inputs already in place)
    graphs_take_fp8_weights: bool


NO_KERNELS = Kernels(transformer_engine=False, wgrad_accumulation=False, apex_softmax=False,
                     graphs_take_fp8_weights=False)
GRAPHS_TAKE_FP8_WEIGHTS_FROM = Version("0.19.0")


def available_kernels() -> Kernels:
    """This Python's: Transformer Engine, the Apex extensions megatron-core's own layers import by these names, and
    CUDA (the wgrad accumulation without Apex)."""
    def found(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return Kernels(transformer_engine=found("transformer_engine"),
                   wgrad_accumulation=found("fused_weight_gradient_mlp_cuda") or torch.cuda.is_available(),
                   apex_softmax=found("scaled_upper_triang_masked_softmax_cuda"),
                   graphs_take_fp8_weights=Version(metadata.version("megatron-core")) >= GRAPHS_TAKE_FP8_WEIGHTS_FROM)


@dataclass(frozen=True)
class Fusions:
    """cfg.megatron's kernel switches resolved; None: left to auto, and the kernels are those of another machine
    (the job runs elsewhere), so it is decided there."""

    gradient_accumulation_fusion: Optional[bool]
    cross_entropy_loss_fusion: Optional[bool]
    apply_rope_fusion: Optional[bool]
    bias_activation_fusion: Optional[bool]
    bias_dropout_fusion: Optional[bool]
    masked_softmax_fusion: Optional[bool]


def fusions(cfg: Config, kernels: Optional[Kernels]) -> Fusions:
    """Each switch as set, or for auto: on with Transformer Engine (the fused softmax: with Apex, which only
    megatron-core's local attention uses). A switch set true that cannot run raises ConfigError: for this model or
    layout always, for a missing kernel when `kernels` are known (None: they are another machine's)."""
    m, model = cfg.megatron, cfg.model
    te = kernels.transformer_engine if kernels else None

    def needing_te(name: str) -> Optional[bool]:
        value = getattr(m, name)
        if value and kernels and not kernels.transformer_engine:
            raise ConfigError(f"megatron.{name}=true needs Transformer Engine, which this Python lacks: install it, "
                              f"or leave megatron.{name} unset (on wherever Transformer Engine is)")
        return te if value is None else value

    swiglu = model.activation == Activation.swiglu
    if m.bias_activation_fusion and not swiglu:
        raise ConfigError(f"megatron.bias_activation_fusion=true: megatron-core fuses (Swi)GLU and GeLU, not "
                          f"model={model.name}'s {model.activation.value}; set it false or leave it unset")
    softmax = m.masked_softmax_fusion
    if softmax and kernels and not (kernels.transformer_engine or kernels.apex_softmax):
        raise ConfigError("megatron.masked_softmax_fusion=true needs Apex's fused softmax kernels for megatron-core's "
                          "local attention, which this Python lacks: set it false or leave it unset")
    return Fusions(
        gradient_accumulation_fusion=wgrad_fusion(cfg, kernels),
        cross_entropy_loss_fusion=needing_te("cross_entropy_loss_fusion"),
        apply_rope_fusion=needing_te("apply_rope_fusion"),
        bias_activation_fusion=(te if swiglu else False) if m.bias_activation_fusion is None
        else m.bias_activation_fusion,
        bias_dropout_fusion=te if m.bias_dropout_fusion is None else m.bias_dropout_fusion,
        masked_softmax_fusion=(kernels.apex_softmax if kernels else None) if softmax is None else softmax,
    )


def wgrad_fusion(cfg: Config, kernels: Optional[Kernels]) -> Optional[bool]:
    """megatron-core's one flag: every linear accumulates its weight gradient into main_grad inside the GEMM,
    Transformer Engine's layers with TE's kernel, megatron-core's own (the output layer) with Apex's or, without
    Apex, recipes.megatron.wgrad. Auto: on wherever CUDA runs the model; off under Megatron-FSDP (as NeMo's
    performance scripts)."""
    value = cfg.megatron.gradient_accumulation_fusion
    if value is False:
        return False
    if value:
        if kernels and not kernels.wgrad_accumulation:
            raise ConfigError(
                "megatron.gradient_accumulation_fusion=true: megatron-core's fused weight-gradient backward runs on "
                "CUDA GPUs (this machine has none) or with Apex's fused_weight_gradient_mlp_cuda; leave it unset or "
                "set it false")
        return True
    if cfg.parallel.fsdp:
        return False
    return kernels.wgrad_accumulation if kernels else None


def check_overlaps(cfg: Config, kernels: Optional[Kernels]) -> None:
    """What megatron-core (or Megatron-LM's argument checks) would reject among the communication and graph
    switches and the FP8 weight all-gather, with the fix."""
    m, p, precision = cfg.megatron, cfg.parallel, cfg.precision
    missing_te = kernels is not None and not kernels.transformer_engine
    if precision.recipe != Recipe.bf16 and precision.fp8_param_gather and not (p.distributed_optimizer or p.fsdp):
        raise ConfigError(f"precision.fp8_param_gather=true (precision={precision.name}) keeps FP8 weights that only "
                          "the distributed optimizer or Megatron-FSDP can update: set parallel.distributed_optimizer="
                          "true, or precision.fp8_param_gather=false")
    if m.tp_comm_overlap:
        if p.tp == 1 or not p.sequence_parallel:
            raise ConfigError("megatron.tp_comm_overlap=true overlaps tensor-parallel communication: it needs "
                              "parallel.tp > 1 with sequence parallelism (parallel.sp unset or true)")
        if missing_te:
            raise ConfigError("megatron.tp_comm_overlap=true needs Transformer Engine's userbuffers, which this "
                              "Python lacks: set it false")
    if m.cuda_graphs:
        if p.fsdp:
            raise ConfigError("megatron.cuda_graphs=true is not supported with Megatron-FSDP (NeMo's performance "
                              "scripts turn graphs off there): set one of them false")
        if p.recompute == Recompute.full:
            raise ConfigError("megatron.cuda_graphs=true captures each layer, which full recomputation cannot "
                              "(megatron-core allows it only with whole-iteration graphs): set parallel.recompute="
                              "selective or none, or megatron.cuda_graphs=false")
        if missing_te:
            raise ConfigError("megatron.cuda_graphs=true needs Transformer Engine's graph-safe RNG tracker, which "
                              "this Python lacks: set it false")
        if (precision.recipe != Recipe.bf16 and precision.fp8_param_gather and kernels is not None
                and not kernels.graphs_take_fp8_weights):
            raise ConfigError(f"megatron.cuda_graphs=true with FP8 weights (precision={precision.name} keeps them: "
                              f"fp8_param_gather): megatron-core {metadata.version('megatron-core')} copies each "
                              f"weight onto itself at every graph replay, which TE's FP8 weights fail (fixed in "
                              f"{GRAPHS_TAKE_FP8_WEIGHTS_FROM}); set precision.fp8_param_gather=false or "
                              "megatron.cuda_graphs=false")


FUSION_NAMES = {"gradient_accumulation_fusion": "wgrad accumulation", "cross_entropy_loss_fusion": "cross-entropy",
                "apply_rope_fusion": "RoPE", "bias_activation_fusion": "SwiGLU", "bias_dropout_fusion": "residual add",
                "masked_softmax_fusion": "softmax"}


def describe_tuning(cfg: Config, kernels: Optional[Kernels]) -> str:
    """The plan's line: which fusions are on, off, or decided where the job runs (`kernels` None), and the
    communication settings. Raises ConfigError as fusions and check_overlaps do."""
    check_overlaps(cfg, kernels)
    fused = fusions(cfg, kernels)
    groups: dict[Optional[bool], list[str]] = {True: [], False: [], None: []}
    for name, label in FUSION_NAMES.items():
        groups[getattr(fused, name)].append(label)
    m = cfg.megatron
    titles = {True: "fused", False: "unfused",
              None: "decided where it runs (on with Transformer Engine; wgrad accumulation: on CUDA; softmax: Apex)"}
    parts = [f"{titles[key]}: {', '.join(names)}" for key, names in groups.items() if names]
    parts += [f"grads reduced in {'FP32' if m.grad_reduce_in_fp32 else 'BF16'}"
              + (", overlapped" if m.overlap_grad_reduce else ", not overlapped"),
              f"param all-gather {'overlapped' if overlap_param_gather(cfg) else 'not overlapped'}"
              + (", aligned over stages" if align_param_gather(cfg) else ""),
              f"CUDA graphs {'on' if m.cuda_graphs else 'off'}",
              f"TP comm overlap {'on' if m.tp_comm_overlap else 'off'}"]
    return "; ".join(parts + (["deterministic"] if m.deterministic else []))


def overlap_param_gather(cfg: Config) -> bool:
    """The sharded weights' all-gather overlapped with the next forward: only where weights are sharded, and not
    where MXFP8 reuses the gradient buffer for it (megatron-core cannot overlap that, NeMo turns it off)."""
    sharded = cfg.parallel.distributed_optimizer or cfg.parallel.fsdp
    return cfg.megatron.overlap_param_gather and sharded and not reuse_grad_buf_for_mxfp8(cfg)


def align_param_gather(cfg: Config) -> bool:
    """Auto: with interleaved pipeline stages (vp > 1), as NeMo's communication-overlap callback sets it."""
    value = cfg.megatron.align_param_gather
    return overlap_param_gather(cfg) and (cfg.parallel.vp > 1 if value is None else value)


def reuse_grad_buf_for_mxfp8(cfg: Config) -> bool:
    precision = cfg.precision
    return precision.recipe == Recipe.mxfp8 and precision.fp8_param_gather


def transformer_config(cfg: Config, kernels: Kernels = NO_KERNELS, *, use_cpu_initialization: bool = False,
                       compute: torch.dtype = torch.bfloat16) -> TransformerConfig:
    """BF16 parameters and compute (the optimizer keeps FP32 master weights), as NeMo's bf16 mixed precision (FP32
    with `compute` FP32: recipes.compute, a CPU without native BF16), with
    cfg.megatron's fusions resolved against `kernels` (the default: a Python without Transformer Engine, Apex or
    CUDA)."""
    check_overlaps(cfg, kernels)
    fused = fusions(cfg, kernels)
    cuda_graphs = cfg.megatron.cuda_graphs
    return TransformerConfig(
        **architecture(cfg),
        **fp8_fields(cfg),
        **parallel_fields(cfg),
        **recompute_fields(cfg),
        bf16=compute == torch.bfloat16,
        params_dtype=compute,
        pipeline_dtype=compute,
        gradient_accumulation_fusion=bool(fused.gradient_accumulation_fusion),
        cross_entropy_loss_fusion=fused.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl="te",
        apply_rope_fusion=fused.apply_rope_fusion,
        bias_activation_fusion=fused.bias_activation_fusion,
        bias_dropout_fusion=fused.bias_dropout_fusion,
        masked_softmax_fusion=fused.masked_softmax_fusion,
        tp_comm_overlap=cfg.megatron.tp_comm_overlap,
        cuda_graph_impl="local" if cuda_graphs else "none",
        use_te_rng_tracker=cuda_graphs,  # graph-safe RNG states (the engine seeds that tracker)
        deterministic_mode=cfg.megatron.deterministic,
        use_cpu_initialization=use_cpu_initialization,
        quant_recipe=quant_recipe(cfg),
    )


def quant_recipe(cfg: Config) -> Optional[RecipeConfig]:
    """megatron-core's per-module recipe of te_precision_config (what it loads from that file), or None."""
    config = te_precision_config(cfg)
    return None if config is None else RecipeConfig.from_config_dict(config)


# Our linear names (recipes.config.LINEAR_KINDS) as megatron-core's GPTModel names its modules with the TE spec.
MEGATRON_LINEARS = {"attention.qkv": "self_attention.linear_qkv", "attention.out": "self_attention.linear_proj",
                    "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
TE_CONFIG_TYPE = {"transformer_engine_config_type": "TEQuantizationParams"}
TE_FP8_RECIPES = {Recipe.tensorwise: "tensorwise", Recipe.blockwise: "blockwise", Recipe.mxfp8: "mxfp8"}


def te_precision_config(cfg: Config) -> Optional[dict]:
    """precision.modules as megatron-core's per-module precision file (--te-precision-config-file, its quant_recipe):
    a config per precision option, TE's recipe or BF16 overriding the model's own in both directions, and a glob
    matcher per linear layer, each naming its module path exactly. None without precision.modules. Layers keep
    the numbers they have in one pipeline stage (recipes.plan.checks refuses parallel.pp > 1)."""
    precision = cfg.precision
    if not precision.modules:
        return None
    assignment = module_assignment(precision, cfg.model.num_layers)
    configs = {}
    for option in dict.fromkeys(assignment.values()):
        assigned = module_precision(precision, option)
        recipe = dict(override_quantized_autocast=True, override_nonquantized_autocast=True)
        if assigned.recipe == Recipe.nvfp4:
            recipe["fp4_quantization_recipe"] = "nvfp4"
        elif assigned.recipe != Recipe.bf16:  # delayed scaling: refused before (recipes.plan.checks)
            recipe.update(fp8_quantization_recipe=TE_FP8_RECIPES[assigned.recipe], fp8_format=assigned.fp8_format.value)
        configs[option] = {**TE_CONFIG_TYPE, "training_recipe": recipe}
    matchers = {}
    for name, option in assignment.items():
        if name != OUTPUT_LAYER:  # megatron-core's own linear, BF16: no per-module recipe
            layer, kind = name.removeprefix("layers.").split(".", 1)
            path = f"decoder.layers.{layer}.{MEGATRON_LINEARS[kind]}"
            matchers[path] = dict(type="glob", pattern=path, config=option, enabled=True)
    return dict(configs=configs, matchers=matchers)


def gpt_model_kwargs(cfg: Config) -> dict:
    """GPTModel's arguments beyond the TransformerConfig: untied embeddings, RoPE over rotary_percent of each head
    (Nemotron-4: half, base 10000; Llama 3: all, base 500000, and for 3.1 the frequency scaling)."""
    m = cfg.model
    # Megatron's rotary embedding applies the Llama 3.1 scaling with RopeScaling's default constants, taking only
    # the factor from its caller.
    if m.rope_scaling is not None and m.rope_scaling != RopeScaling(factor=m.rope_scaling.factor):
        raise ConfigError(
            f"model.rope_scaling={m.rope_scaling}: megatron-core's Llama 3.1 scaling fixes low_freq_factor=1, "
            "high_freq_factor=4 and original_max_position_embeddings=8192 and takes only the factor"
        )
    return dict(
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        position_embedding_type="rope",
        rotary_percent=m.rotary_percent,
        rotary_base=int(m.rope_base),
        rope_scaling=m.rope_scaling is not None,
        rope_scaling_factor=m.rope_scaling.factor if m.rope_scaling else 8.0,
        share_embeddings_and_output_weights=False,
    )


def ddp_config(cfg: Config) -> DistributedDataParallelConfig:
    """Gradients reduced in BF16 (megatron.grad_reduce_in_fp32=false, as every NVIDIA performance recipe; true:
    FP32, NeMo's bf16 preset and the torch engine's main gradients); gradient reduction and parameter all-gather
    overlapped with compute (cfg.megatron); FP8 weights all-gathered as FP8 where the precision asks (MXFP8 reuses
    the gradient buffer for it, as NeMo's preset does)."""
    p, precision, m = cfg.parallel, cfg.precision, cfg.megatron
    check_overlaps(cfg, None)
    fp8_param_gather = precision.recipe != Recipe.bf16 and precision.fp8_param_gather
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=m.grad_reduce_in_fp32,
        overlap_grad_reduce=m.overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather(cfg),
        align_param_gather=align_param_gather(cfg),
        use_distributed_optimizer=p.distributed_optimizer or p.fsdp,
        fp8_param_gather=fp8_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=reuse_grad_buf_for_mxfp8(cfg),
        use_megatron_fsdp=p.fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if p.fsdp else "no_shard",
        # A NaN or inf is the engine's to record in metrics.jsonl and stop on (as the torch engine does), not a
        # stack trace from inside the gradient reduction.
        check_for_nan_in_grad=False,
    )


def optimizer_config(cfg: Config, compute: torch.dtype = torch.bfloat16) -> OptimizerConfig:
    t, p, precision = cfg.trainer, cfg.parallel, cfg.precision
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.grad_clip,
        bf16=compute == torch.bfloat16,
        params_dtype=compute,
        use_distributed_optimizer=p.distributed_optimizer or p.fsdp,
        overlap_param_gather=overlap_param_gather(cfg),
        fp8_recipe=precision.recipe.value if precision.recipe != Recipe.bf16 else None,
        reuse_grad_buf_for_mxfp8_param_ag=reuse_grad_buf_for_mxfp8(cfg),
    )
