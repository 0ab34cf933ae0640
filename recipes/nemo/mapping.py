"""The resolved config as fields of NeMo 2's pretraining recipe for the model.

The starting point is `pretrain_recipe(performance_mode=True)`, as NVIDIA's performance scripts start
(NeMo scripts/performance/llm/pretrain_<model>.py); the fields below are what those scripts' helpers
(scripts/performance/helpers.py: set_primary_perf_configs, set_precision_configs, set_mcore_fsdp_configs,
set_exp_logging_configs) set on it, with this run's values. Everything NeMo's recipe sets and no field names stays
NeMo's: the model class (norms, activation, RoPE, init std, fusions), the Adam flavour, communication overlap.

A field is a dotted path into the recipe (`trainer.strategy.tensor_model_parallel_size`), or into the callback of
one class in `trainer.callbacks` (`trainer.callbacks[MegatronCommOverlapCallback].overlap_param_gather`). Nothing
here imports NeMo: recipes.nemo.build writes the fields onto the real recipe inside the container.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from recipes.config import Config, DataKind, Recipe, Recompute
from recipes.run_files import NEMO_LOGS

# conf/model option -> module of nemo.collections.llm.recipes (present from NeMo 2.0 to 2.7; 3.0 dropped them).
RECIPE_MODULES = {name: name for name in ("llama3_8b", "llama3_70b", "llama31_405b", "nemotron4_15b", "nemotron4_340b")}


@dataclass(frozen=True)
class Preset:
    """A precision plugin of nemo.collections.llm.recipes.precision.mixed_precision and what it needs."""

    function: str
    nemo: tuple[int, int]  # the first NeMo release that has it
    megatron_core: Optional[tuple[int, int]] = None  # the first megatron-core that runs it, where NeMo's is not enough


PRESETS = {
    Recipe.bf16: Preset("bf16_mixed", (2, 0)),
    Recipe.delayed: Preset("bf16_with_fp8_mixed", (2, 0)),
    Recipe.tensorwise: Preset("bf16_with_fp8_current_scaling_mixed", (2, 3)),
    Recipe.blockwise: Preset("bf16_with_fp8_subchannel_scaling_mixed", (2, 4), megatron_core=(0, 13)),
    Recipe.mxfp8: Preset("bf16_with_mxfp8_mixed", (2, 3)),
}
# Every precision sets MegatronMixedPrecision's fp8_recipe / fp8_param_gather / num_layers_at_*_in_bf16 (delayed and
# bf16 too, to say what runs), which NeMo has from 2.3 on; 3.0 has no nemo.collections.llm.
ENGINE_NEMO = (2, 3)
NEMO_WITHOUT_LLM = (3, 0)

# Fields that older NeMo lacks (2.3 and 2.4: no reuse_grad_buf_for_mxfp8_param_ag). Written where the container's
# NeMo has them, skipped with a note where it does not: they save memory and change no number.
OPTIONAL_FIELDS = ("trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag",)

# conf/model fields written onto NeMo's model config; every other architecture field is the model class's own.
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "seq_length")

PLUGIN = "trainer.plugins"
COMM_OVERLAP = "trainer.callbacks[MegatronCommOverlapCallback]"


def recipe_fields(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Every field the run sets on NeMo's recipe, by dotted path."""
    return {**trainer_fields(cfg), **parallel_fields(cfg), **precision_fields(cfg), **model_fields(cfg),
            **optimizer_fields(cfg), **log_fields(cfg, run_dir)}


def trainer_fields(cfg: Config) -> dict[str, Any]:
    t = cfg.trainer
    return {
        "trainer.num_nodes": cfg.executor.nodes,
        "trainer.devices": cfg.executor.gpus,
        "trainer.max_steps": t.max_steps,
        # No validation or test passes: every step trains (the performance scripts do the same).
        "trainer.val_check_interval": t.max_steps,
        "trainer.limit_val_batches": 0,
        "trainer.limit_test_batches": 0,
        "trainer.log_every_n_steps": t.log_interval,
        "trainer.strategy.progress_interval": t.log_interval,  # NeMo's "Training epoch 0, iteration ..." line
    }


def parallel_fields(cfg: Config) -> dict[str, Any]:
    p = cfg.parallel
    data_parallel = cfg.executor.gpus * cfg.executor.nodes // (p.tp * p.pp * p.cp)
    fields = {
        "trainer.strategy.tensor_model_parallel_size": p.tp,
        "trainer.strategy.pipeline_model_parallel_size": p.pp,
        "trainer.strategy.virtual_pipeline_model_parallel_size": p.vp if p.vp > 1 else None,
        "trainer.strategy.context_parallel_size": p.cp,
        "trainer.strategy.sequence_parallel": p.sequence_parallel,
        "trainer.strategy.pipeline_dtype": torch.bfloat16 if p.pp > 1 else None,  # NeMo requires it with PP
        "trainer.strategy.account_for_embedding_in_pipeline_split": p.pp_embedding_loss_as_layers,
        "trainer.strategy.account_for_loss_in_pipeline_split": p.pp_embedding_loss_as_layers,
        "optim.config.use_distributed_optimizer": p.distributed_optimizer or p.fsdp,
        # As set_primary_perf_configs does, except with checkpoints, which NeMo's recipes say it breaks.
        f"{COMM_OVERLAP}.overlap_param_gather_with_optimizer_step":
            data_parallel > 1 and p.pp > 1 and p.vp > 1 and cfg.trainer.checkpoint.interval == 0,
        **recompute_fields(cfg),
    }
    if p.fsdp:  # set_mcore_fsdp_configs
        fields.update({
            "trainer.strategy.fsdp": "megatron",
            "trainer.strategy.ddp.data_parallel_sharding_strategy": "optim_grads_params",
            "model.config.init_model_with_meta_device": True,
            "model.config.gradient_accumulation_fusion": False,
            f"{COMM_OVERLAP}.defer_embedding_wgrad_compute": False,  # cannot work with FSDP
        })
    return fields


def recompute_fields(cfg: Config) -> dict[str, Any]:
    """parallel.recompute as megatron-core's fields, as recipes.megatron.translate sets them on TransformerConfig
    (not imported from there: it imports megatron-core modules the container's older release may lack)."""
    recompute, prefix = cfg.parallel.recompute, "model.config."
    if recompute == Recompute.full:
        return {prefix + "recompute_granularity": "full", prefix + "recompute_method": "uniform",
                prefix + "recompute_num_layers": 1}
    if recompute == Recompute.selective:
        return {prefix + "recompute_granularity": "selective", prefix + "recompute_modules": ["core_attn"]}
    return {prefix + "recompute_granularity": None}


def precision_fields(cfg: Config) -> dict[str, Any]:
    """The precision's settings on NeMo's MegatronMixedPrecision plugin (its preset is PRESETS[recipe]).

    set_precision_configs reduces gradients in BF16 for every precision, and uses the precision-aware optimizer
    for BF16 only (performance_mode turns it off, and FP8 keeps it off)."""
    p = cfg.precision
    fields: dict[str, Any] = {
        f"{PLUGIN}.grad_reduce_in_fp32": False,
        "optim.config.use_precision_aware_optimizer": p.recipe == Recipe.bf16,
    }
    if p.recipe == Recipe.bf16:
        return fields
    fields.update({
        f"{PLUGIN}.fp8": p.fp8_format.value,
        f"{PLUGIN}.fp8_recipe": p.recipe.value,
        f"{PLUGIN}.fp8_margin": p.margin,
        f"{PLUGIN}.fp8_wgrad": p.fp8_wgrad,
        f"{PLUGIN}.fp8_param_gather": p.fp8_param_gather,
        # The current-scaling preset keeps the first and last layer in BF16; set_precision_configs turns that off
        # for benchmarking, and so does conf/precision/fp8_current.yaml: these come from the precision config.
        f"{PLUGIN}.first_last_layers_bf16": bool(p.num_layers_at_start_in_bf16 or p.num_layers_at_end_in_bf16),
        f"{PLUGIN}.num_layers_at_start_in_bf16": p.num_layers_at_start_in_bf16,
        f"{PLUGIN}.num_layers_at_end_in_bf16": p.num_layers_at_end_in_bf16,
    })
    if p.recipe == Recipe.delayed:
        fields.update({f"{PLUGIN}.fp8_amax_history_len": p.amax_history_len,
                       f"{PLUGIN}.fp8_amax_compute_algo": p.amax_compute_algo.value})
    if p.recipe == Recipe.mxfp8:
        # megatron-core reuses the gradient buffer for the MXFP8 all-gather only with FP8 parameters, and that reuse
        # cannot overlap the all-gather (set_precision_configs)
        fields[f"{PLUGIN}.reuse_grad_buf_for_mxfp8_param_ag"] = p.fp8_param_gather
        if p.fp8_param_gather:
            fields[f"{COMM_OVERLAP}.overlap_param_gather"] = False
    return fields


def model_fields(cfg: Config) -> dict[str, Any]:
    """The model's shape (the published one, or a proxy such as model.num_layers=4); the vocabulary is the
    tokenizer's (data_modules)."""
    return {f"model.config.{name}": getattr(cfg.model, name) for name in SHAPE_FIELDS}


def optimizer_fields(cfg: Config) -> dict[str, Any]:
    t = cfg.trainer
    return {
        "optim.config.lr": t.lr,
        "optim.config.weight_decay": t.weight_decay,
        "optim.config.adam_beta1": t.adam_beta1,
        "optim.config.adam_beta2": t.adam_beta2,
        "optim.config.adam_eps": t.adam_eps,
        "optim.config.clip_grad": t.grad_clip,
        # NeMo's warm-up + cosine; its scheduler decays over 10 steps unless given max_steps
        "optim.lr_scheduler.max_steps": t.max_steps,
        "optim.lr_scheduler.warmup_steps": t.warmup_steps,
        "optim.lr_scheduler.constant_steps": 0,
        "optim.lr_scheduler.min_lr": t.min_lr,
    }


def log_fields(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """NeMo's own files go to RUN_DIR/nemo; checkpoints where the other engines put theirs
    (recipes.trainer.checkpoints.checkpoint_dir), and a restart resumes from the newest there (AutoResume)."""
    from recipes.trainer.checkpoints import checkpoint_dir

    ckpt, checkpoints = cfg.trainer.checkpoint, str(checkpoint_dir(cfg, run_dir))
    fields: dict[str, Any] = {
        "log.explicit_log_dir": str(run_dir / NEMO_LOGS),
        # NeMo's TensorBoard logger off, as set_exp_logging_configs does (it costs step time); the run's scalars
        # go to RUN_DIR/tensorboard through recipes.nemo.callback (trainer.tensorboard), as the other engines'.
        "log.tensorboard": None,
        "trainer.logger": False,
        "trainer.enable_checkpointing": ckpt.interval > 0,
        "resume.resume_from_directory": checkpoints,
    }
    if not ckpt.interval:
        return {**fields, "log.ckpt": None}
    return {
        **fields,
        "log.ckpt.dirpath": checkpoints,
        "log.ckpt.every_n_train_steps": ckpt.interval,
        "log.ckpt.train_time_interval": None,  # Lightning takes one trigger: the step interval
        # No validation loss to rank checkpoints by: keep the newest (NeMo logs "step" every step).
        "log.ckpt.monitor": "step",
        "log.ckpt.mode": "max",
        "log.ckpt.save_top_k": ckpt.keep_last or -1,
    }


def tokenizer_vocab_size(cfg: Config) -> int:
    """NeMo's NullTokenizer adds one id (end of document) to the size it is given: one less makes the model's
    vocabulary exactly model.vocab_size. (The performance scripts pass 128256, which NeMo pads to 128384.)"""
    return cfg.model.vocab_size - 1


def data_module(cfg: Config, prefix: Optional[str]) -> tuple[str, dict[str, Any]]:
    """(class of nemo.collections.llm, its arguments) for the run's data: MockDataModule for data=mock, else
    PreTrainingDataModule over the Megatron indexed dataset at `prefix`, every document for training."""
    t = cfg.trainer
    batches = dict(seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
                   global_batch_size=t.global_batch_size)
    if cfg.data.kind == DataKind.mock:
        return "MockDataModule", {**batches, "num_train_samples": t.max_steps * t.global_batch_size}
    index_cache = Path(cfg.data.cache_dir).expanduser() / "megatron-index"
    return "PreTrainingDataModule", {**batches, "paths": [prefix], "seed": t.seed, "split": "100,0,0",
                                     "index_mapping_dir": str(index_cache)}


def recipe_name(cfg: Config) -> str:
    return f"nemo.collections.llm.recipes.{RECIPE_MODULES[cfg.model.name]}.pretrain_recipe(performance_mode=True)"
