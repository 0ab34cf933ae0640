"""engine=megatron's NVFP4 parts (precision.disable_rht / disable_stochastic_rounding / disable_2d_quantization) in
Transformer Engine's recipe.

megatron-core 0.16 builds TE's NVFP4BlockScaling in one place, fp4_utils.get_fp4_recipe, with TE's defaults (every
part on, unless TE's NVTE_NVFP4_DISABLE_* variables were set when TE was imported) and no setting for them.
`install(disabled)` wraps that function so the recipe it returns carries the run's knobs as TE's own fields, as
recipes.megatron.block_dims does for blockwise scaling's blocks.
"""

from __future__ import annotations

import dataclasses
import functools


def with_parts_disabled(make_recipe, disabled: tuple[str, ...]):
    """`make_recipe` (megatron-core's get_fp4_recipe) whose NVFP4BlockScaling recipes have the `disabled` knobs set
    true and the others false; any other recipe unchanged."""
    from recipes.config import NVFP4_KNOBS

    @functools.wraps(make_recipe)
    def make(config):
        recipe = make_recipe(config)
        if recipe is None or not type(recipe).nvfp4():
            return recipe
        return dataclasses.replace(recipe, **{knob: knob in disabled for knob in NVFP4_KNOBS})

    make.megatron_core = make_recipe
    return make


def install(disabled: list[str]) -> None:
    """megatron-core's get_fp4_recipe with the run's knobs, every one of them (TE's environment variables do not
    override a run's config); a process that builds several models, as the tests do, gets each one's."""
    from megatron.core import fp4_utils

    make_recipe = getattr(fp4_utils.get_fp4_recipe, "megatron_core", fp4_utils.get_fp4_recipe)
    fp4_utils.get_fp4_recipe = with_parts_disabled(make_recipe, tuple(disabled))
