"""Swap the linear layers of a model's transformer blocks for FP8 ones, as the precision config asks.

Embedding, norms, attention (softmax(QK^T)V) and the output layer stay in BF16, as in Transformer Engine's
recipes; `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16` keep whole blocks in BF16 as well.
The recipe is the one the config names, never another one and never BF16 (see recipes.fp8.linear).
With `bf16_linears`, the blocks' BF16 linears (all of them for precision=bf16) become `Bf16Linear`s, which can
cast their weights once per optimizer step and accumulate weight gradients in FP32 inside the GEMM.
With `precision.fused_kernels`, each MLP of per-tensor or blockwise FP8 linears (or of Bf16Linears) becomes
recipes.fp8.mlp's fused form (fc1, activation and fc2 in one function; the same parameters and buffers under the
same names)."""

from __future__ import annotations

from torch import nn

from recipes.config import PrecisionConfig, Recipe
from recipes.fp8.linear import Bf16Linear, Fp8Linear, recipe_from_config
from recipes.fp8.mlp import fused_mlp


def fp8_layer_indices(num_layers: int, precision: PrecisionConfig) -> range:
    if precision.recipe == Recipe.bf16:
        return range(0)
    return range(precision.num_layers_at_start_in_bf16, num_layers - precision.num_layers_at_end_in_bf16)


def convert_to_fp8(layers: nn.ModuleList, precision: PrecisionConfig, bf16_linears: bool = False) -> int:
    """Replace nn.Linear modules inside the FP8 blocks of `layers` (and, with `bf16_linears`, inside the BF16 ones);
    returns how many were replaced by FP8 linears."""
    fp8_blocks = fp8_layer_indices(len(layers), precision)
    recipe = recipe_from_config(precision) if fp8_blocks else None
    replaced = 0
    for index, layer in enumerate(layers):
        if index not in fp8_blocks and not bf16_linears:
            continue
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    setattr(parent, name, Fp8Linear(child, recipe) if index in fp8_blocks else Bf16Linear(child))
                    replaced += index in fp8_blocks
        if precision.fused_kernels and (index in fp8_blocks or bf16_linears):
            fuse_mlps(layer)
    return replaced


def fuse_mlps(layer: nn.Module) -> None:
    """Each MLP of `layer` that recipes.fp8.mlp has a fused form for becomes that form."""
    for parent in list(layer.modules()):
        for name, child in parent.named_children():
            fused = fused_mlp(child)
            if fused is not None:
                setattr(parent, name, fused)
