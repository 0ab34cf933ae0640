"""Swap the linear layers of a model's transformer blocks for FP8 ones, as the precision config asks.

Embedding, norms, attention (softmax(QK^T)V) and the output layer stay in BF16, as in Transformer Engine's
recipes; `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16` keep whole blocks in BF16 as well.
A recipe this engine does not implement raises ConfigError: it never falls back to BF16 or to another recipe.
"""

from __future__ import annotations

from torch import nn

from recipes.config import ConfigError, PrecisionConfig, Recipe
from recipes.fp8.linear import CurrentScaling, Fp8Linear

IMPLEMENTED_RECIPES = (Recipe.bf16, Recipe.tensorwise)


def check_recipe_implemented(precision: PrecisionConfig) -> None:
    if precision.recipe not in IMPLEMENTED_RECIPES:
        raise ConfigError(
            f"precision={precision.name} (recipe '{precision.recipe.value}') is not implemented in engine=torch yet; "
            f"choose one of: bf16, fp8_current. It never falls back to another recipe."
        )


def fp8_layer_indices(num_layers: int, precision: PrecisionConfig) -> range:
    return range(precision.num_layers_at_start_in_bf16, num_layers - precision.num_layers_at_end_in_bf16)


def convert_to_fp8(layers: nn.ModuleList, precision: PrecisionConfig) -> int:
    """Replace nn.Linear modules inside the FP8 blocks of `layers`; returns how many were replaced."""
    check_recipe_implemented(precision)
    if precision.recipe == Recipe.bf16:
        return 0
    recipe = CurrentScaling.from_config(precision)
    replaced = 0
    for index in fp8_layer_indices(len(layers), precision):
        for parent in layers[index].modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    setattr(parent, name, Fp8Linear(child, recipe))
                    replaced += 1
    return replaced
