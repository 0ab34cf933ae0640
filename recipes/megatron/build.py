"""Parallel state and the GPT model chunks of this rank, from the translated config.

Transformer Engine's layer spec when TE is importable (the NeMo container, or TE installed with pip; required for
FP8), megatron-core's local spec otherwise. The local spec's norms are torch's own unless Apex is installed: no
sequence parallelism, and no zero-centred gamma (Nemotron-4's layernorm1p) without Apex. Those limits are checked
here, with the fix, before megatron-core would assert deep inside a layer. The kernel fusions of cfg.megatron are
resolved against the kernels found here (available_kernels), where the model is built.
"""

from __future__ import annotations

import importlib.util

import torch

from recipes.config import Config, ConfigError, Normalization, Recipe
from recipes.megatron import master_cast, parallel_state, te_recipe, wgrad
from recipes.megatron.translate import available_kernels, gpt_model_kwargs, transformer_config
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec


def have_apex() -> bool:
    return importlib.util.find_spec("apex") is not None


def layer_spec(cfg: Config, use_te: bool) -> ModuleSpec:
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec()
    if cfg.precision.recipe != Recipe.bf16:
        raise ConfigError(f"precision={cfg.precision.name} on engine=megatron needs Transformer Engine (the NeMo "
                          "container); without it only precision=bf16 runs")
    if cfg.parallel.sequence_parallel and not have_apex():
        raise ConfigError("sequence parallelism needs Transformer Engine or Apex norms (megatron-core's local spec "
                          "uses torch's norms, which cannot split the sequence): set parallel.sp=false")
    if cfg.model.normalization == Normalization.layernorm1p and not have_apex():
        raise ConfigError(f"model={cfg.model.name}: layernorm1p (zero-centred gamma) needs Transformer Engine or "
                          "Apex; megatron-core's local spec with torch's LayerNorm cannot hold it")
    normalization = "RMSNorm" if cfg.model.normalization == Normalization.rmsnorm else "LayerNorm"
    return get_gpt_layer_local_spec(normalization=normalization)


def initialize_parallel_state(cfg: Config) -> None:
    """Tensor, pipeline (virtual), context and data-parallel groups over the initialized default process group."""
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vp if p.vp > 1 else None,
        context_parallel_size=p.cp,
    )


def build_model_chunks(cfg: Config, config: TransformerConfig, spec: ModuleSpec) -> list[GPTModel]:
    """This rank's model chunks: one, or parallel.vp with the interleaved schedule; the first chunk of the first
    stage holds the embedding, the last chunk of the last stage the output layer and loss."""
    kwargs = gpt_model_kwargs(cfg)
    chunks = []
    for vp_stage in range(cfg.parallel.vp) if cfg.parallel.vp > 1 else [None]:
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            **kwargs,
        ))
    return chunks


def initialize_tp_comm_overlap(cfg: Config, config: TransformerConfig) -> None:
    """Transformer Engine's userbuffers for overlapping tensor-parallel communication with the GEMMs, before the
    model is built, as Megatron-LM's _initialize_tp_communicators does (NCCL bootstrap, TE's default splits)."""
    from transformer_engine.pytorch.module import base

    modes = [base.UserBufferQuantizationMode.FP8 if config.fp8 else base.UserBufferQuantizationMode.NONE]
    if config.fp8 and config.first_last_layers_bf16:
        modes.append(base.UserBufferQuantizationMode.NONE)  # the BF16 layers' buffers
    tokens = cfg.model.seq_length * cfg.trainer.micro_batch_size // cfg.parallel.cp
    base.initialize_ub(shape=[tokens, cfg.model.hidden_size], tp_size=cfg.parallel.tp, quantization_modes=modes,
                       bootstrap_backend="nccl")


def configure(cfg: Config, device: torch.device, compute: torch.dtype = torch.bfloat16
              ) -> tuple[TransformerConfig, ModuleSpec]:
    """The TransformerConfig and layer spec of cfg for a model on `device` computing in `compute`
    (recipes.compute), with the kernels megatron-core's layers then call made ready: the wgrad accumulation of its
    own linears (recipes.megatron.wgrad), the row-wise cast of FP8 weights' master shards
    (recipes.megatron.master_cast), and blockwise scaling's block dimensions and NVFP4's parts in TE's recipes
    (recipes.megatron.te_recipe)."""
    kernels = available_kernels()
    spec = layer_spec(cfg, kernels.transformer_engine)
    config = transformer_config(cfg, kernels, use_cpu_initialization=device.type == "cpu", compute=compute)
    if config.gradient_accumulation_fusion:
        wgrad.install()  # megatron-core's own linears (the output layer) need it built in, unless Apex is there
    if config.fp8_param:
        master_cast.install()
    te_recipe.install_block_dims(cfg.precision.block_dims)  # TE's defaults outside blockwise scaling (check_block_dims)
    if config.fp4:
        te_recipe.install_nvfp4_parts(cfg.precision.nvfp4_parts_disabled)
    return config, spec


def build(cfg: Config, device: torch.device, compute: torch.dtype = torch.bfloat16
          ) -> tuple[TransformerConfig, list[GPTModel]]:
    """The TransformerConfig and this rank's model chunks on `device` (parallel state must be initialized),
    computing in `compute` (recipes.compute)."""
    config, spec = configure(cfg, device, compute)
    if config.tp_comm_overlap:
        initialize_tp_comm_overlap(cfg, config)
    chunks = build_model_chunks(cfg, config, spec)
    return config, [chunk.to(device) for chunk in chunks]
