"""engine=megatron's blockwise block dimensions (precision.x/w/grad_block_scaling_dim) in Transformer Engine's recipe.

megatron-core 0.16 builds TE's Float8BlockScaling in one place, fp8_utils.get_fp8_recipe, with TE's default blocks
(1x128 activations and gradients, 128x128 weights) and no setting for them. `install(block_dims)` wraps that
function so the recipe it returns carries the run's three dimensions, as TE's own fields: megatron-core's FP8
contexts (fp8_utils.get_fp8_context) and its CUDA graphs look the function up when they call it, so both get the
run's recipe. TE checks the dimensions itself (its __post_init__ refuses two 128x128 operands in one GEMM).
"""

from __future__ import annotations

import dataclasses
import functools

from recipes.config import DEFAULT_BLOCK_DIMS


def with_block_dims(make_recipe, block_dims: tuple[int, int, int]):
    """`make_recipe` (megatron-core's get_fp8_recipe) whose Float8BlockScaling recipes have `block_dims` (input,
    weight, gradient); its other recipes unchanged."""
    x, w, grad = block_dims

    @functools.wraps(make_recipe)
    def make(config):
        recipe = make_recipe(config)
        if recipe is None or not type(recipe).float8_block_scaling():
            return recipe
        return dataclasses.replace(recipe, x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=grad)

    make.megatron_core = make_recipe
    return make


def install(block_dims: tuple[int, int, int]) -> None:
    """megatron-core's get_fp8_recipe with `block_dims`; TE's defaults put megatron-core's own function back (a
    process that builds several models, as the tests do, gets each one's dimensions)."""
    from megatron.core import fp8_utils

    make_recipe = getattr(fp8_utils.get_fp8_recipe, "megatron_core", fp8_utils.get_fp8_recipe)
    fp8_utils.get_fp8_recipe = (make_recipe if tuple(block_dims) == DEFAULT_BLOCK_DIMS
                                else with_block_dims(make_recipe, tuple(block_dims)))
