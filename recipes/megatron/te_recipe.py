"""The run's Transformer Engine recipe fields in the recipes megatron-core builds: blockwise scaling's block
dimensions (precision.x/w/grad_block_scaling_dim) and NVFP4's parts (precision.disable_rht /
disable_stochastic_rounding / disable_2d_quantization).

megatron-core 0.16 builds TE's Float8BlockScaling in one place, fp8_utils.get_fp8_recipe, and its NVFP4BlockScaling
in another, fp4_utils.get_fp4_recipe, each with TE's defaults and no setting for these fields (NVFP4's, unless TE's
NVTE_NVFP4_DISABLE_* variables were set when TE was imported). `install` wraps such a function so the recipe it
returns carries the run's fields, as TE's own fields: megatron-core's quantization contexts and its CUDA graphs
look the function up when they call it, so both get the run's recipe. TE checks the fields itself (its
__post_init__ refuses two 128x128 operands in one GEMM).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Optional

from recipes.config import DEFAULT_BLOCK_DIMS, NVFP4_KNOBS


def with_fields(make_recipe, kind: str, fields: dict):
    """`make_recipe` (a megatron-core recipe builder) whose recipes of `kind` (TE's recipe-type test,
    float8_block_scaling or nvfp4) have `fields`; its other recipes, and None (no TE), unchanged."""

    @functools.wraps(make_recipe)
    def make(config):
        recipe = make_recipe(config)
        if recipe is None or not getattr(type(recipe), kind)():
            return recipe
        return dataclasses.replace(recipe, **fields)

    make.megatron_core = make_recipe
    return make


def install(module: ModuleType, name: str, kind: str, fields: Optional[dict]) -> None:
    """module.name (megatron-core's builder) wrapped to give its `kind` recipes `fields`, or megatron-core's own
    function back for None: a process that builds several models, as the tests do, gets each one's fields, never
    a wrapper of a wrapper."""
    make_recipe = getattr(getattr(module, name), "megatron_core", getattr(module, name))
    setattr(module, name, make_recipe if fields is None else with_fields(make_recipe, kind, fields))


def install_block_dims(block_dims: tuple[int, int, int]) -> None:
    """get_fp8_recipe's Float8BlockScaling with the run's (input, weight, gradient) blocks; TE's defaults put
    megatron-core's own function back."""
    from megatron.core import fp8_utils

    x, w, grad = block_dims
    fields = dict(x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=grad)
    install(fp8_utils, "get_fp8_recipe", "float8_block_scaling", None if tuple(block_dims) == DEFAULT_BLOCK_DIMS
            else fields)


def install_nvfp4_parts(disabled: list[str]) -> None:
    """get_fp4_recipe's NVFP4BlockScaling with the run's knobs, every one of them set (true for those `disabled`):
    TE's environment variables do not override a run's config."""
    from megatron.core import fp4_utils

    install(fp4_utils, "get_fp4_recipe", "nvfp4", {knob: knob in disabled for knob in NVFP4_KNOBS})
