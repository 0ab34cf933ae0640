"""FP8 training in the torch engine: one object, `Fp8Training`, which the engine builds from the run's config and
calls at a handful of points of its training loop, as torchtitan's Float8 converter. The engine knows nothing else
of FP8; the plan asks the same object what it will do.

    fp8 = Fp8Training.for_run(cfg, processes, device)
    fp8.convert(model)                before compiling: the blocks' linears become FP8 ones (recipes.fp8.convert),
                                      with weight caches when micro-batches accumulate (and with the fused
                                      linears, the BF16 blocks' and the output layer become Bf16Linear, all with
                                      FP32 main gradients)
    fp8.prepare_for_sharding(model)   before fully_shard: FSDP2 will all-gather the FP8 linears' weights in FP8
    fp8.materialized(model)           after to_empty of a model sharded on the meta device
    fp8.micro_batch(model, index, step)  before each micro-batch: the first quantizes each weight into its cache,
                                      the others reuse it (weights do not change within an optimizer step);
                                      stochastic rounding's draw
    fp8.after_backward(model)         after each micro-batch's backward: delayed scaling folds its amaxes in
    fp8.after_micro_batches(model)    after the step's last backward: the main gradients become the weights' .grad
    fp8.amaxes_finite(model)          with the loss, before the optimizer step: no inf/NaN amax in delayed scaling
                                      (non_finite_amaxes names them for the error)
    fp8.weights_changed(model)        after initialisation, a restore and every optimizer step: the caches are
                                      stale; the FP8 all-gather's scales are the new weights'

What it owns, below it: the weight caches (recipes.fp8.linear's WeightCache), the FP32 main gradients that the
fused linears' GEMMs sum into (precision.fused_kernels, one process on CUDA), delayed scaling's update of every
layer at once (recipes.fp8.delayed_scaling), and FSDP2's FP8 all-gather (the master-shard tensors of
recipes.fp8.all_gather, and the scales of the whole weights). Each FP8 linear's three GEMMs: recipes.fp8.linear,
recipes.fp8.gemm (with recipes.fp8.kernels and recipes.fp8.cublaslt where they run).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import (
    Config, ConfigError, PrecisionConfig, Recipe, assigned_options, check_modules, module_precision,
)
from recipes.fp8.all_gather import Fp8GatheredWeight, Fp8ShardedWeight, local_shard, shard_amax
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.current_scaling import tensorwise_scale
from recipes.fp8.delayed_scaling import NUM_ROLES, ROLE_NAMES, update_delayed_scaling
from recipes.fp8.formats import E4M3
from recipes.fp8.gemm import nvfp4_gemm_available
from recipes.fp8.linear import (
    CACHE_OFF, CACHE_REFRESH, CACHE_REUSE, GRAD, WEIGHT, Bf16Linear, CachedWeightLinear, DelayedScaling, Fp8Linear,
    TensorwiseScaling, check_block_dims, check_nvfp4_knobs, recipe_from_config,
)

FP8_ALL_GATHER_RECIPES = (Recipe.tensorwise, Recipe.delayed)


class Fp8Training:
    """The FP8 of one run of the torch engine (see the module's doc): `precision`'s recipe on the blocks' linears,
    weights quantized once per optimizer step over `micro_batches`; with `fsdp_fp8_all_gather` (FSDP2 at work, a
    per-tensor recipe: recipes.plan.checks refuses the others) all-gathered in FP8; with `fused_linears`
    (fused_linears_apply) the BF16 blocks' linears and the output layer converted too and every weight gradient
    summed into an FP32 main gradient inside its GEMM."""

    def __init__(self, precision: PrecisionConfig, micro_batches: int = 1, fsdp_fp8_all_gather: bool = False,
                 fused_linears: bool = False, seed: int = 0):
        self.precision = precision
        self.micro_batches, self.seed = micro_batches, seed  # stochastic rounding's draws (seed_rounding)
        assigned = [module_precision(precision, option) for option in assigned_options(precision)]
        self.enabled = any(option.recipe != Recipe.bf16 for option in assigned)
        # NVFP4's stochastic rounding, somewhere in the model: each micro-batch then sets its draw
        self.rounds_stochastically = any(option.recipe == Recipe.nvfp4 and not option.disable_stochastic_rounding
                                         for option in assigned)
        self.fused_linears = fused_linears
        self.gathers_weights_in_fp8 = fsdp_fp8_all_gather and precision.recipe in FP8_ALL_GATHER_RECIPES
        # FP8-gathered weights arrive quantized: nothing to cache.
        converts = self.enabled or fused_linears
        self.caches_weights = converts and micro_batches > 1 and not self.gathers_weights_in_fp8

    @classmethod
    def for_run(cls, cfg: Config, processes: int, device: Optional[torch.device] = None) -> "Fp8Training":
        """The run's FP8 on `processes` data-parallel processes (FSDP2 when more than one), each accumulating its
        share of the global batch in micro-batches, on `device` (None: not known, as in the plan; no fused
        linears then)."""
        micro_batches = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * processes)
        fused = device is not None and fused_linears_apply(cfg.precision, device, processes)
        return cls(cfg.precision, micro_batches, processes > 1 and cfg.trainer.fsdp_fp8_all_gather, fused,
                   cfg.trainer.seed)

    @classmethod
    def for_one_process(cls, precision: PrecisionConfig, micro_batches: int, device: torch.device) -> "Fp8Training":
        return cls(precision, micro_batches, fused_linears=fused_linears_apply(precision, device, processes=1))

    @staticmethod
    def check(cfg: Config) -> None:
        """ConfigError, before launch, for FP8 that `cfg` asks for and no recipe computes (recipe_from_config: a
        margin outside delayed scaling, no FP8 format; check_block_dims: block dimensions outside blockwise scaling
        or that no kernel takes), or an FP8 all-gather of weights that are not per-tensor."""
        if cfg.trainer.fsdp_fp8_all_gather and cfg.precision.recipe not in FP8_ALL_GATHER_RECIPES:
            raise ConfigError(f"trainer.fsdp_fp8_all_gather needs a per-tensor FP8 recipe (fp8_current, "
                              f"fp8_delayed), not precision={cfg.precision.name}: block-scaled weights are quantized "
                              "after the gather")
        check_modules(cfg.precision, cfg.model.num_layers)
        for option in assigned_options(cfg.precision):  # the run's precision and each one precision.modules names
            precision = module_precision(cfg.precision, option)
            check_block_dims(precision)
            check_nvfp4_knobs(precision)
            if precision.recipe != Recipe.bf16:
                recipe_from_config(precision)

    @staticmethod
    def check_this_pytorch(cfg: Config) -> None:
        """ConfigError for a run on this machine whose native GEMMs this PyTorch lacks: NVFP4's (scaled_mm's
        two-level NVFP4 scaling) wherever a linear trains in NVFP4 without emulation."""
        nvfp4 = [option for option in assigned_options(cfg.precision)
                 if module_precision(cfg.precision, option).recipe == Recipe.nvfp4]
        if nvfp4 and not cfg.precision.emulate and not nvfp4_gemm_available():
            raise ConfigError(f"precision={nvfp4[0]}: this PyTorch ({torch.__version__}) has no NVFP4 GEMM "
                              "(torch.nn.functional.scaled_mm with BlockWise1x16 and TensorWise scales); install a "
                              "newer PyTorch, or use engine=megatron")

    def convert(self, model: nn.Module) -> None:
        convert_to_fp8(model.layers, self.precision, bf16_linears=self.fused_linears)
        if self.fused_linears and type(getattr(model, "output", None)) is nn.Linear:
            model.output = Bf16Linear(model.output)  # the output layer (BF16 in every recipe) too
        if self.caches_weights:
            attach_weight_caches(model)
        if self.fused_linears:
            attach_main_grads(model)
        seed_rounding(model, self.seed)

    def prepare_for_sharding(self, model: nn.Module) -> None:
        if self.gathers_weights_in_fp8:
            enable_fp8_all_gather(model)

    def materialized(self, model: nn.Module) -> None:
        if self.gathers_weights_in_fp8:
            rebind_all_gather_scales(model)

    def micro_batch(self, model: nn.Module, index: int, step: int = 0) -> None:
        if self.caches_weights:  # the mode also says whether a weight gradient starts or adds to its main gradient
            set_weight_cache_mode(model, CACHE_REFRESH if index == 0 else CACHE_REUSE)
        if self.rounds_stochastically:
            set_rounding_draw(model, step * self.micro_batches + index)

    def after_backward(self, model: nn.Module) -> None:
        if self.enabled:
            update_fp8_scaling(model)

    def after_micro_batches(self, model: nn.Module) -> None:
        if self.fused_linears:
            expose_main_grads(model)  # the main gradients the GEMMs summed, as the weights' .grad

    def amaxes_finite(self, model: nn.Module) -> torch.Tensor | bool:
        return fp8_amaxes_finite(model) if self.enabled else True

    def non_finite_amaxes(self, model: nn.Module) -> str:
        return non_finite_amaxes(model) if self.enabled else ""

    def weights_changed(self, model: nn.Module) -> None:
        if self.caches_weights:
            set_weight_cache_mode(model, CACHE_OFF)  # a forward outside a step quantizes afresh
        if self.gathers_weights_in_fp8:
            update_all_gather_scales(model)


def fused_linears_apply(precision: PrecisionConfig, device: torch.device, processes: int) -> bool:
    """Whether the blocks' BF16 linears become recipes.fp8.linear.Bf16Linear and every converted linear writes its
    weight gradient into an FP32 main gradient: `precision.fused_kernels`, on CUDA, in one process (under FSDP2
    the gradients must reach FSDP through autograd)."""
    return precision.fused_kernels and device.type == "cuda" and processes == 1


def _fp8_linears(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def _rounding_linears(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in _fp8_linears(model) if m.rounding_seed is not None]


@torch.no_grad()
def seed_rounding(model: nn.Module, seed: int) -> None:
    """Each stochastically rounding linear's seed: the run's, then its place among them (recipes.fp8.nvfp4.uniform)."""
    for index, layer in enumerate(_rounding_linears(model)):
        layer.rounding_seed.copy_(torch.tensor([seed, index, 0]))


@torch.no_grad()
def set_rounding_draw(model: nn.Module, draw: int) -> None:
    """The draw of the micro-batch about to run (step * micro-batches + index): a resumed run draws the same
    numbers as one that never stopped."""
    for layer in _rounding_linears(model):
        layer.rounding_seed[2].fill_(draw)


def _weight_scale(layer: nn.Module) -> torch.Tensor:
    """The buffer whose value encodes a layer's FP8-gathered weight: delayed scaling's weight scale, or (current
    scaling) the `all_gather_scale` that update_all_gather_scales sets."""
    return layer.all_gather_scale if layer.fp8_state is None else layer.fp8_state.scale[WEIGHT]


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Before fully_shard: make every per-tensor FP8 linear's weight a master shard that FSDP2 all-gathers in FP8.
    Returns how many; the caller keeps BF16 all-gather for block-scaled recipes (0 here)."""
    layers = [m for m in _fp8_linears(model) if isinstance(m.recipe, (TensorwiseScaling, DelayedScaling))]
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
    """The amaxes of the FP8-all-gathered weights, from their shards with one all-reduce (max) for all of them:
    current scaling's weight scales, delayed scaling's weight amaxes (into the open history slot, as a cached
    weight's, once per optimizer step). Call after every optimizer step and before the first forward (and after
    restoring weights)."""
    layers = [m for m in _fp8_linears(model)
              if isinstance(local_shard(m.weight), (Fp8ShardedWeight, Fp8GatheredWeight))]
    if not layers:
        return
    amax = torch.stack([shard_amax(m.weight) for m in layers])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    current = [i for i, m in enumerate(layers) if m.fp8_state is None]  # per-module precision may mix the two
    delayed = [i for i, m in enumerate(layers) if m.fp8_state is not None]
    if current:
        scales = tensorwise_scale(amax[current], E4M3)
        torch._foreach_copy_([layers[i].all_gather_scale for i in current], list(scales.unbind(0)))
    if delayed:
        targets = [layers[i].fp8_state.amax_history[WEIGHT, 0] for i in delayed]
        values = torch.maximum(torch.stack(targets), amax[delayed])
        torch._foreach_copy_(targets, list(values.unbind(0)))


def _cached_weight_linears(model: nn.Module) -> list[CachedWeightLinear]:
    return [m for m in model.modules() if isinstance(m, CachedWeightLinear)]


def attach_weight_caches(model: nn.Module) -> int:
    """Give every converted linear of `model` a weight cache (before compiling it); returns how many got one.
    Costs two bytes per weight element (the FP8 weight and its transpose, or the BF16 weight)."""
    layers = _cached_weight_linears(model)
    for layer in layers:
        layer.weight_cache = layer.make_weight_cache()
    return len(layers)


def set_weight_cache_mode(model: nn.Module, mode: str) -> None:
    """CACHE_REFRESH for the first micro-batch of an optimizer step, CACHE_REUSE for the rest, CACHE_OFF outside.
    The mode also says whether a weight gradient starts or adds to `main_grad`."""
    for layer in _cached_weight_linears(model):
        if layer.weight_cache is not None:
            layer.weight_cache.mode = mode


def attach_main_grads(model: nn.Module) -> int:
    """One process only (FSDP2 needs the gradients from autograd): give every converted linear an FP32 `main_grad`
    that its backward writes (first micro-batch) or adds to (the others) inside the weight-gradient GEMM, as
    Megatron's `gradient_accumulation_fusion` does; `expose_main_grads` hands them to the optimizer. Returns how
    many. Costs nothing extra at the peak: the FP32 gradients exist during accumulation either way."""
    layers = _cached_weight_linears(model)
    for layer in layers:
        layer.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    return len(layers)


def expose_main_grads(model: nn.Module) -> None:
    """After the last micro-batch's backward: each main_grad becomes its weight's .grad (the same memory), for
    clipping and the optimizer; zero_grad(set_to_none=True) drops the alias again."""
    for layer in _cached_weight_linears(model):
        if layer.main_grad is not None:
            layer.weight.grad = layer.main_grad


def update_fp8_scaling(model: nn.Module) -> None:
    """Once after each micro-batch's backward: the delayed-scaling layers of `model` fold this micro-batch's amaxes
    into their histories and scales, reduced over the data-parallel ranks (recipes.fp8.delayed_scaling). Nothing
    to do for the other recipes, whose scales come from the tensor at hand."""
    by_recipe: dict[DelayedScaling, list[Fp8Linear]] = {}
    for layer in _delayed_layers(model):  # one recipe, or several under per-module precision
        by_recipe.setdefault(layer.recipe, []).append(layer)
    for recipe, layers in by_recipe.items():
        dtypes = tuple(recipe.dtype(role) for role in range(NUM_ROLES))
        update_delayed_scaling([m.fp8_state for m in layers], dtypes, recipe.amax_compute_algo, recipe.margin)


def fp8_amaxes_finite(model: nn.Module) -> torch.Tensor | bool:
    """On the device, without a host sync: whether every amax that delayed scaling recorded was finite (True
    without delayed scaling). The training loop reads it once per optimizer step, with the loss."""
    layers = _delayed_layers(model)
    if not layers:
        return True
    return torch.stack([m.fp8_state.nonfinite for m in layers]).amax() == 0


def non_finite_amaxes(model: nn.Module) -> str:
    """The layers and roles whose recorded amax was inf or NaN, for the error message ("" if none). First the one
    where it most likely arose: the first in forward order among inputs and weights, else the first in backward
    order among gradients (a NaN spreads downstream, and a NaN loss to every gradient)."""
    forward, backward = [], []
    for name, layer in model.named_modules():
        if isinstance(layer, Fp8Linear) and layer.fp8_state is not None:
            name = name.replace("_checkpoint_wrapped_module.", "")  # activation checkpointing's wrapper
            for role in layer.fp8_state.nonfinite.nonzero().flatten().tolist():
                tensor = f"{name}'s {ROLE_NAMES[role]}" if name else ROLE_NAMES[role]
                (backward if role == GRAD else forward).append(tensor)
    found = forward + backward[::-1]
    if len(found) > 1:
        return f"{found[0]} (and {len(found) - 1} more)"
    return "".join(found)


def _delayed_layers(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fp8_state is not None]
