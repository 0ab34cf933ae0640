"""Swap the linear layers of a model's transformer blocks for FP8 ones, as the precision config asks.

Embedding, norms, attention (softmax(QK^T)V) and the output layer stay in BF16, as in Transformer Engine's
recipes; `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16` keep whole blocks in BF16 as well, and
`precision.modules` gives any linear its own recipe (recipes.config.precision_of).
Each linear's recipe is the one the config assigns it, never another one and never BF16 (see recipes.fp8.linear).
With `bf16_linears`, the blocks' BF16 linears (all of them for precision=bf16) become `Bf16Linear`s, which can
cast their weights once per optimizer step and accumulate weight gradients in FP32 inside the GEMM.
With `precision.fused_kernels`, each MLP of per-tensor or blockwise FP8 linears (or of Bf16Linears) becomes
recipes.fp8.mlp's fused form (fc1, activation and fc2 in one function; the same parameters and buffers under the
same names)."""

from __future__ import annotations

from torch import nn

from recipes.config import PrecisionConfig, Recipe, module_precision, precision_of
from recipes.fp8.linear import Bf16Linear, Fp8Linear, recipe_from_config
from recipes.fp8.mlp import fused_mlp


def convert_to_fp8(layers: nn.ModuleList, precision: PrecisionConfig, bf16_linears: bool = False) -> int:
    """Replace nn.Linear modules inside `layers` by FP8 linears in the recipe each one is assigned (recipes.config's
    precision_of: precision.modules, then the BF16 layers at the start and end, then the run's precision), the
    others (with `bf16_linears`) by Bf16Linear; returns how many became FP8 linears."""
    recipes = {}  # conf/precision option -> its recipe (None: BF16), one object for all its linears
    replaced = 0
    for index, layer in enumerate(layers):
        converted = False
        for parent_name, parent in layer.named_modules():
            for name, child in parent.named_children():
                if type(child) is not nn.Linear:
                    continue
                full_name = ".".join(part for part in ("layers", str(index), parent_name, name) if part)
                option = precision_of(full_name, precision, len(layers))
                if option not in recipes:
                    assigned = module_precision(precision, option)
                    recipes[option] = None if assigned.recipe == Recipe.bf16 else recipe_from_config(assigned)
                if recipes[option] is not None:
                    setattr(parent, name, Fp8Linear(child, recipes[option]))
                    replaced += 1
                elif bf16_linears:
                    setattr(parent, name, Bf16Linear(child))
                else:
                    continue
                converted = True
        if precision.fused_kernels and converted:
            fuse_mlps(layer)
    return replaced


def fuse_mlps(layer: nn.Module) -> None:
    """Each MLP of `layer` that recipes.fp8.mlp has a fused form for becomes that form."""
    for parent in list(layer.modules()):
        for name, child in parent.named_children():
            fused = fused_mlp(child)
            if fused is not None:
                setattr(parent, name, fused)
