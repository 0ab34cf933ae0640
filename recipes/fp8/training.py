"""FP8 training in the torch engine: what walks the model and is called at the points of the training loop.

Weight caches (recipes.fp8.linear's Fp8WeightCache): attached to every FP8 linear under gradient accumulation and
switched between refresh, reuse and off as the step's micro-batches go. Delayed scaling: each micro-batch's amaxes
of every layer folded into the scales at once (recipes.fp8.delayed_scaling). FSDP2's FP8 all-gather: the FP8
linears' weights made master shards (recipes.fp8.all_gather) and their scales set from the whole weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import Config, Recipe
from recipes.fp8.all_gather import Fp8ShardedWeight, local_shard, shard_amax
from recipes.fp8.current_scaling import tensorwise_scale
from recipes.fp8.delayed_scaling import NUM_ROLES, update_delayed_scaling
from recipes.fp8.formats import E4M3
from recipes.fp8.linear import WEIGHT, CurrentScaling, DelayedScaling, Fp8Linear, Fp8WeightCache

FP8_ALL_GATHER_RECIPES = (Recipe.tensorwise, Recipe.delayed)


def fp8_all_gather_applies(cfg: Config, processes: int) -> bool:
    """Whether the torch engine all-gathers the weights in FP8: asked for, and FSDP2 at work (several processes).
    recipes.plan.validate refuses the option for recipes outside FP8_ALL_GATHER_RECIPES."""
    return processes > 1 and cfg.trainer.fsdp_fp8_all_gather and cfg.precision.recipe in FP8_ALL_GATHER_RECIPES


def _fp8_linears(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def _weight_scale(layer: nn.Module) -> torch.Tensor:
    """The buffer whose value encodes a layer's FP8-gathered weight: delayed scaling's weight scale, or (current
    scaling) the `all_gather_scale` that update_all_gather_scales sets."""
    return layer.all_gather_scale if layer.fp8_state is None else layer.fp8_state.scale[WEIGHT]


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Before fully_shard: make every per-tensor FP8 linear's weight a master shard that FSDP2 all-gathers in FP8.
    Returns how many; the caller keeps BF16 all-gather for block-scaled recipes (0 here)."""
    layers = [m for m in _fp8_linears(model) if isinstance(m.recipe, (CurrentScaling, DelayedScaling))]
    for layer in layers:
        if layer.recipe.forward_dtype != E4M3:
            raise ValueError("FP8 all-gather casts weights to E4M3; this recipe's forward format is not E4M3")
        if layer.fp8_state is None:
            # NaN until update_all_gather_scales sets it: a forgotten update makes the loss NaN, not silently wrong.
            nan = torch.full((), float("nan"), device=layer.weight.device)
            layer.register_buffer("all_gather_scale", nan, persistent=False)
        master = Fp8ShardedWeight(layer.weight.data, _weight_scale(layer))
        layer.weight = nn.Parameter(master, requires_grad=layer.weight.requires_grad)
    return len(layers)


def rebind_all_gather_scales(model: nn.Module) -> None:
    """After `model.to_empty()` (a model sharded on the meta device, then materialised): point each master shard
    at its layer's new scale buffer, and make that NaN until update_all_gather_scales."""
    for layer in _fp8_linears(model):
        local = local_shard(layer.weight)
        if isinstance(local, Fp8ShardedWeight):
            if layer.fp8_state is None:
                layer.all_gather_scale.fill_(float("nan"))
            local._scale = _weight_scale(layer)


@torch.no_grad()
def update_all_gather_scales(model: nn.Module) -> None:
    """Current scaling: each FP8-all-gathered weight's scale from its whole FP32 weight, one all-reduce (max) for
    all of them. Call after every optimizer step and before the first forward (and after restoring weights)."""
    layers = [m for m in _fp8_linears(model) if hasattr(m, "all_gather_scale")]
    if not layers:
        return
    amax = torch.stack([shard_amax(m.weight) for m in layers])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scales = tensorwise_scale(amax, E4M3, layers[0].recipe.margin)
    torch._foreach_copy_([m.all_gather_scale for m in layers], list(scales.unbind(0)))


def attach_weight_caches(model: nn.Module) -> int:
    """Give every FP8 linear of `model` a weight cache (before compiling it); returns how many got one. Costs two
    bytes per weight element (the FP8 weight and its transpose)."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.weight_cache = Fp8WeightCache(layer.weight, layer.recipe, layer.state_tensors() or None)
    return len(layers)


def set_weight_cache_mode(model: nn.Module, mode: str) -> None:
    """CACHE_REFRESH for the first micro-batch of an optimizer step, CACHE_REUSE for the rest, CACHE_OFF outside."""
    for layer in model.modules():
        if isinstance(layer, Fp8Linear) and layer.weight_cache is not None:
            layer.weight_cache.mode = mode


def update_fp8_scaling(model: nn.Module) -> None:
    """Once after each micro-batch's backward: the delayed-scaling layers of `model` fold this micro-batch's amaxes
    into their histories and scales, reduced over the data-parallel ranks (recipes.fp8.delayed_scaling). Nothing
    to do for the other recipes, whose scales come from the tensor at hand."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fp8_state is not None]
    for layer in layers:  # weights FSDP2 all-gathers in FP8: their shards' amaxes (recipes.fp8.all_gather)
        amax = shard_amax(layer.weight)
        if amax is not None:
            slot = layer.fp8_state.amax_history[WEIGHT, 0]
            slot.copy_(torch.maximum(slot, amax))
    if layers:
        recipe = layers[0].recipe  # convert_to_fp8 gives every layer of a model the same recipe
        dtypes = tuple(recipe.dtype(role) for role in range(NUM_ROLES))
        update_delayed_scaling([m.fp8_state for m in layers], dtypes, recipe.amax_compute_algo, recipe.margin)
