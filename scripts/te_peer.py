"""Transformer Engine's decoder layers as a peer column of scripts/layer_bench.py (`--peer te`).

The same block as recipes.models.transformer.TransformerBlock, built from `te.TransformerLayer`: pre-norm, fused
QKV projection with grouped-query attention, RoPE from the model's own frequency table (Llama 3.1 scaling
included), causal attention, no biases, no dropout; Llama with RMSNorm and SwiGLU, Nemotron-4 with LayerNorm1p
(`zero_centered_gamma`) and squared ReLU (`srelu`) on half of each head's dimensions. Parameters in BF16, weights
initialised like ours. FP8 through `te.autocast` with TE's own recipe objects; each micro-batch after the first
reuses the FP8 weights (`is_first_microbatch`). Eager: TE's modules are not compiled.

Two ways to train them, each a set of columns:
- `te_*`: BF16 gradients, summed over the micro-batches by autograd, and AdamW on the BF16 parameters (TE's
  examples);
- `te_megatron_*`: as Megatron-LM trains TE's layers (`MegatronStyleTraining`): FP32 main gradients written inside
  TE's weight-gradient GEMMs (`fuse_wgrad_accumulation`), FP32 master weights in AdamW. That is the work our
  engine does too (FP32 master weights, FP32 main gradients summed inside the GEMMs).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from recipes.config import Activation, ModelConfig, Normalization
from recipes.models.transformer import rope_inverse_frequencies

TE_RECIPES = ("bf16", "current", "delayed", "blockwise", "mxfp8")  # column name: f"{peer}_{recipe}"


def import_transformer_engine():
    """transformer_engine.pytorch, or a one-line error saying how to get it."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as error:
        raise RuntimeError(f"--peer te needs Transformer Engine (pip install transformer-engine[pytorch]): {error}") from None
    return te


def te_recipe(name: str, column: str):
    """TE's recipe object for one of TE_RECIPES, as REFERENCE.md section 9 sets them; None for bf16. Refuses a
    recipe TE cannot run on this GPU (TE's own check, naming the column) rather than measure something else."""
    te = import_transformer_engine()
    from transformer_engine.common import recipe

    if name == "bf16":
        return None
    make, available = {
        "current": (lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID), te.is_fp8_available),
        "delayed": (lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024,
                                                  amax_compute_algo="max"), te.is_fp8_available),
        "blockwise": (lambda: recipe.Float8BlockScaling(fp8_format=recipe.Format.E4M3),
                      te.is_fp8_block_scaling_available),
        "mxfp8": (lambda: recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3), te.is_mxfp8_available),
    }[name]
    ok, reason = available(return_reason=True)
    if not ok:
        raise RuntimeError(f"{column}: Transformer Engine cannot run this recipe here: {reason}")
    return make()


def _normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda weight: nn.init.normal_(weight, 0.0, std)


class TeDecoderStack(nn.Module):
    """N `te.TransformerLayer`s laid out as our block; `forward(x, is_first_microbatch)` takes (batch, seq, hidden).
    With `fuse_wgrad_accumulation`, each linear's weight gradient goes into its weight's `main_grad` (FP32) inside
    the GEMM: written in the first micro-batch, added to in the others."""

    def __init__(self, cfg: ModelConfig, fuse_wgrad_accumulation: bool = False):
        super().__init__()
        te = import_transformer_engine()
        llama = cfg.normalization == Normalization.rmsnorm
        self.layers = nn.ModuleList(
            te.TransformerLayer(
                hidden_size=cfg.hidden_size,
                ffn_hidden_size=cfg.ffn_hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                num_gqa_groups=cfg.num_query_groups,
                kv_channels=cfg.kv_channels,
                layernorm_epsilon=cfg.norm_eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                init_method=_normal(cfg.init_std),
                output_layer_init_method=_normal(cfg.init_std / math.sqrt(2 * cfg.num_layers)),
                layer_number=index + 1,
                self_attn_mask_type="causal",
                params_dtype=torch.bfloat16,
                seq_length=cfg.seq_length,
                micro_batch_size=1,
                fuse_qkv_params=True,
                fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                bias=False,
                normalization="RMSNorm" if llama else "LayerNorm",
                zero_centered_gamma=cfg.normalization == Normalization.layernorm1p,
                activation="swiglu" if cfg.activation == Activation.swiglu else "srelu",
                attn_input_format="bshd",
                device="cuda",
            )
            for index in range(cfg.num_layers)
        )
        # TE's layout of the RoPE table: (seq, 1, 1, rotary_dim) angles, rotate-half, applied to each head's
        # first rotary_dim dimensions; from our frequencies so that Llama 3.1's scaling is the same.
        rotary_dim = int(cfg.kv_channels * cfg.rotary_percent)
        inv_freq = rope_inverse_frequencies(rotary_dim, cfg.rope_base, cfg.rope_scaling).cuda()
        angles = torch.outer(torch.arange(cfg.seq_length, device="cuda", dtype=torch.float32), inv_freq)
        self.register_buffer("rotary", torch.cat([angles, angles], dim=-1)[:, None, None, :], persistent=False)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rotary, is_first_microbatch=is_first_microbatch)
        return x


class MegatronStyleTraining:
    """How Megatron-LM trains TE's layers (its DistributedDataParallel and mixed-precision optimizer), for the
    `te_megatron_*` columns. Every parameter of `model` (BF16) gets an FP32 `main_grad`: TE's weight-gradient
    GEMMs write it (`fuse_wgrad_accumulation`), and the other parameters' BF16 gradients (the norms') are added
    to it after each backward, as Megatron's gradient hooks do. Clipping and AdamW see FP32 master weights
    (`masters`), which are copied into the BF16 parameters after each step. The methods are the engine's
    training-step hooks (those of recipes.fp8.training.Fp8Training), so the engine's `optimizer_step`, given
    `masters` as its model, trains TE's layers this way unchanged."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        for param in self.params:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        self.masters = nn.ParameterList(nn.Parameter(p.detach().float()) for p in self.params)
        self.first_micro_batch = True

    def micro_batch(self, model: nn.Module, index: int) -> None:
        self.first_micro_batch = index == 0

    @torch.no_grad()
    def after_backward(self, model: nn.Module) -> None:
        for param in self.params:
            if param.grad is not None:  # a gradient the GEMM did not write (TE leaves those None)
                if self.first_micro_batch:
                    param.main_grad.copy_(param.grad)
                else:
                    param.main_grad.add_(param.grad)
                param.grad = None

    def after_micro_batches(self, model: nn.Module) -> None:
        for master, param in zip(self.masters, self.params):
            master.grad = param.main_grad

    def amaxes_finite(self, model: nn.Module) -> bool:
        return True  # TE's recipes keep their own amaxes

    def non_finite_amaxes(self, model: nn.Module) -> str:
        return ""

    @torch.no_grad()
    def weights_changed(self, model: nn.Module) -> None:
        torch._foreach_copy_(self.params, list(self.masters))
