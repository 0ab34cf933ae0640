"""Swap the linear layers of a model's transformer blocks for FP8 ones, as the precision config asks.

Embedding, norms, attention (softmax(QK^T)V) and the output layer stay in BF16, as in Transformer Engine's
recipes; `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16` keep whole blocks in BF16 as well.
The recipe is the one the config names, never another one and never BF16 (see recipes.fp8.linear).
"""

from __future__ import annotations

from torch import nn

from recipes.config import PrecisionConfig, Recipe
from recipes.fp8.linear import Fp8Linear, recipe_from_config


def fp8_layer_indices(num_layers: int, precision: PrecisionConfig) -> range:
    return range(precision.num_layers_at_start_in_bf16, num_layers - precision.num_layers_at_end_in_bf16)


def convert_to_fp8(layers: nn.ModuleList, precision: PrecisionConfig) -> int:
    """Replace nn.Linear modules inside the FP8 blocks of `layers`; returns how many were replaced."""
    if precision.recipe == Recipe.bf16:
        return 0
    recipe = recipe_from_config(precision)
    replaced = 0
    for index in fp8_layer_indices(len(layers), precision):
        for parent in layers[index].modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    setattr(parent, name, Fp8Linear(child, recipe))
                    replaced += 1
    return replaced
