"""The resolved Config as megatron-core objects: what Megatron-LM's argument parser would build from the same run.

    transformer_config(cfg)   TransformerConfig: the architecture (conf/model), the FP8 recipe (conf/precision),
                              the model-parallel layout (cfg.parallel) and recomputation
    gpt_model_kwargs(cfg)     GPTModel's own arguments: vocabulary, context length, rotary embedding
    ddp_config(cfg)           DistributedDataParallelConfig: gradient reduction, FP8 parameter all-gather, FSDP
    optimizer_config(cfg)     OptimizerConfig: Adam with decoupled weight decay, clipping, distributed optimizer

megatron-core validates each object when it is built (TransformerConfig.__post_init__), so a config that passed
recipes.plan.checks.validate and still fails here is a gap in that preflight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.config import Activation, Config, ConfigError, Normalization, Recipe, Recompute, RopeScaling
from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
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
    fields = dict(
        fp8=p.fp8_format.value,
        fp8_recipe=p.recipe.value,
        fp8_margin=p.margin,
        fp8_wgrad=p.fp8_wgrad,
        fp8_param=p.fp8_param_gather,  # Megatron-LM's --fp8-param-gather sets both this and the DDP field
        first_last_layers_bf16=bool(p.num_layers_at_start_in_bf16 or p.num_layers_at_end_in_bf16),
        num_layers_at_start_in_bf16=p.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=p.num_layers_at_end_in_bf16,
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


def transformer_config(cfg: Config, *, use_cpu_initialization: bool = False, fused_kernels: bool = False) -> TransformerConfig:
    """BF16 parameters and compute (the optimizer keeps FP32 master weights), as NeMo's bf16 mixed precision.
    `fused_kernels`: Transformer Engine/Apex gradient-accumulation fusion (wgrad accumulated into the FP32 main_grad
    inside the GEMM); only where those kernels exist."""
    return TransformerConfig(
        **architecture(cfg),
        **fp8_fields(cfg),
        **parallel_fields(cfg),
        **recompute_fields(cfg),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        gradient_accumulation_fusion=fused_kernels,
        use_cpu_initialization=use_cpu_initialization,
    )


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
    """Gradients reduced in FP32 (NeMo's bf16 preset); gradient reduction and parameter all-gather overlapped
    with compute; FP8 weights all-gathered as FP8 where the precision asks (MXFP8 reuses the gradient buffer for
    it, as NeMo's preset does)."""
    p, precision = cfg.parallel, cfg.precision
    fp8_param_gather = precision.recipe != Recipe.bf16 and precision.fp8_param_gather
    sharded = p.distributed_optimizer or p.fsdp
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=sharded,
        use_distributed_optimizer=sharded,
        fp8_param_gather=fp8_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=fp8_param_gather and precision.recipe == Recipe.mxfp8,
        use_megatron_fsdp=p.fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if p.fsdp else "no_shard",
        # A NaN or inf is the engine's to record in metrics.jsonl and stop on (as the torch engine does), not a
        # stack trace from inside the gradient reduction.
        check_for_nan_in_grad=False,
    )


def optimizer_config(cfg: Config) -> OptimizerConfig:
    t, p, precision = cfg.trainer, cfg.parallel, cfg.precision
    fp8_param_gather = precision.recipe != Recipe.bf16 and precision.fp8_param_gather
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.grad_clip,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=p.distributed_optimizer or p.fsdp,
        overlap_param_gather=p.distributed_optimizer or p.fsdp,
        fp8_recipe=precision.recipe.value if precision.recipe != Recipe.bf16 else None,
        reuse_grad_buf_for_mxfp8_param_ag=fp8_param_gather and precision.recipe == Recipe.mxfp8,
    )
