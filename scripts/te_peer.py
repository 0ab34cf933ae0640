"""Transformer Engine's decoder layers as a peer column of scripts/layer_bench.py (`--peer te`).

The same block as recipes.models.transformer.TransformerBlock, built from `te.TransformerLayer`: pre-norm, fused
QKV projection with grouped-query attention, RoPE from the model's own frequency table (Llama 3.1 scaling
included), causal attention, no biases, no dropout; Llama with RMSNorm and SwiGLU, Nemotron-4 with LayerNorm1p
(`zero_centered_gamma`) and squared ReLU (`srelu`) on half of each head's dimensions. Parameters in BF16 (TE's
usual setting: no FP32 master weights), weights initialised like ours. FP8 through `te.autocast` with TE's own
recipe objects; each micro-batch after the first reuses the FP8 weights (`is_first_microbatch`). Eager: TE's
modules are not compiled.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from recipes.config import Activation, ModelConfig, Normalization
from recipes.models.transformer import rope_inverse_frequencies

# Column name -> the TE recipe that column runs (None: BF16).
TE_COLUMNS = ("te_bf16", "te_current", "te_delayed", "te_blockwise", "te_mxfp8")


def import_transformer_engine():
    """transformer_engine.pytorch, or a one-line error saying how to get it."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as error:
        raise RuntimeError(f"--peer te needs Transformer Engine (pip install transformer-engine[pytorch]): {error}") from None
    return te


def te_recipe(column: str):
    """TE's recipe object for a column, as REFERENCE.md section 9 sets them; None for te_bf16. Refuses a recipe
    TE cannot run on this GPU (TE's own check) rather than measure something else."""
    te = import_transformer_engine()
    from transformer_engine.common import recipe

    if column == "te_bf16":
        return None
    make, available = {
        "te_current": (lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID), te.is_fp8_available),
        "te_delayed": (lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024,
                                                     amax_compute_algo="max"), te.is_fp8_available),
        "te_blockwise": (lambda: recipe.Float8BlockScaling(fp8_format=recipe.Format.E4M3),
                         te.is_fp8_block_scaling_available),
        "te_mxfp8": (lambda: recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3), te.is_mxfp8_available),
    }[column]
    ok, reason = available(return_reason=True)
    if not ok:
        raise RuntimeError(f"{column}: Transformer Engine cannot run this recipe here: {reason}")
    return make()


def _normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda weight: nn.init.normal_(weight, 0.0, std)


class TeDecoderStack(nn.Module):
    """N `te.TransformerLayer`s laid out as our block; `forward(x, is_first_microbatch)` takes (batch, seq, hidden)."""

    def __init__(self, cfg: ModelConfig):
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
