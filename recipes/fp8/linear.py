"""A linear layer whose three GEMMs run in FP8, with the scaling recipe the precision config names.

    fprop  y  = x  @ W^T     x (E4M3), W (E4M3)      fast accumulation where the recipe allows, as TE does
    dgrad  dx = dy @ W       dy (E5M2 in HYBRID), W^T
    wgrad  dW = dy^T @ x     dy^T, x^T               (in BF16 when fp8_wgrad is off)

Every GEMM is `a @ b^T` with both operands K-major (see recipes.fp8.gemm), so dgrad and wgrad need W, dy and x
transposed. Scales run along K, so a transposed operand reuses its quantization only where the scale grid is
symmetric (per-tensor recipes; 128x128 weight blocks); otherwise it is quantized again along its new K, from the
high-precision tensor, as Transformer Engine does. The forward saves x (already transposed for wgrad) and W in FP8.

Weights do not change between the micro-batches of one optimizer step, so with gradient accumulation each layer
can quantize its weight (and the transpose dgrad needs) once per step, in the first micro-batch, and reuse it in
the others: `Fp8WeightCache`, attached and switched by recipes.fp8.training for the training loop. Transformer Engine
caches FP8 weights across micro-batches the same way (`is_first_microbatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from recipes.config import AmaxComputeAlgo, ConfigError, PrecisionConfig, Recipe
from recipes.fp8.all_gather import Fp8GatheredWeight
from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.current_scaling import quantize_tensorwise
from recipes.fp8.delayed_scaling import DelayedScalingState, quantize_delayed
from recipes.fp8.formats import forward_and_backward_dtypes
from recipes.fp8.gemm import fp8_gemm
from recipes.fp8.mxfp8 import quantize_mx
from recipes.fp8.tensor import Float8Tensor

INPUT, WEIGHT, GRAD = 0, 1, 2
CACHE_OFF, CACHE_REFRESH, CACHE_REUSE = "off", "refresh", "reuse"  # quantize W each call / and store it / reuse it


@dataclass(frozen=True)
class Fp8Recipe:
    """What every recipe shares: FP8 types, margin, FP8 wgrad on/off, emulation of block-scaled GEMMs."""

    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    margin: int = 0
    fp8_wgrad: bool = True
    emulate: bool = False

    fast_accum_fprop = True  # per-tensor GEMMs: TE uses fast accumulation in fprop only
    stateful = False

    def dtype(self, role: int) -> torch.dtype:
        return self.backward_dtype if role == GRAD else self.forward_dtype

    def quantize(self, t: torch.Tensor, role: int, state: Optional[tuple]) -> Float8Tensor:
        """Quantize t, laid out (rows, K), for a GEMM contracting its last dimension. `state`: stateful recipes'
        buffers, None otherwise."""
        raise NotImplementedError

    def transpose_reuses_quantization(self, role: int) -> bool:
        return True


class TensorwiseScaling(Fp8Recipe):
    """Per-tensor current scaling (TE Float8CurrentScaling; precision=fp8_current): the scale from each tensor's amax
    now."""

    def quantize(self, t, role, state):
        return quantize_tensorwise(t, self.dtype(role), self.margin)


@dataclass(frozen=True)
class DelayedScaling(Fp8Recipe):
    """Per-tensor delayed scaling (TE DelayedScaling): the scale from an amax history of earlier steps."""

    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max
    stateful = True

    def quantize(self, t, role, state):
        return quantize_delayed(t, self.dtype(role), state, role)


@dataclass(frozen=True)
class BlockwiseScaling(Fp8Recipe):
    """Sub-channel scaling (TE Float8BlockScaling): 1x128 activation/gradient blocks, 128x128 weight blocks."""

    power_of_2_scales: bool = True
    fast_accum_fprop = False  # cuBLAS block scaling has no fast-accumulation mode

    def quantize(self, t, role, state):
        block = WEIGHT_BLOCK if role == WEIGHT else ACTIVATION_BLOCK
        return quantize_blockwise(t, self.dtype(role), block, self.power_of_2_scales)

    def transpose_reuses_quantization(self, role):
        return role == WEIGHT


class MXFP8Scaling(Fp8Recipe):
    """MXFP8 (TE MXFP8BlockScaling): 1x32 blocks along K, E8M0 scales."""

    fast_accum_fprop = False

    def quantize(self, t, role, state):
        return quantize_mx(t, self.dtype(role))

    def transpose_reuses_quantization(self, role):
        return False


def recipe_from_config(precision: PrecisionConfig) -> Fp8Recipe:
    if precision.fp8_format is None:
        raise ConfigError(f"precision={precision.name}: set precision.fp8_format (hybrid or e4m3)")
    shared = dict(zip(("forward_dtype", "backward_dtype"), forward_and_backward_dtypes(precision.fp8_format)))
    shared.update(margin=precision.margin, fp8_wgrad=precision.fp8_wgrad, emulate=precision.emulate)
    if precision.recipe == Recipe.tensorwise:
        return TensorwiseScaling(**shared)
    if precision.recipe == Recipe.delayed:
        return DelayedScaling(
            **shared, amax_history_len=precision.amax_history_len, amax_compute_algo=precision.amax_compute_algo
        )
    if precision.recipe == Recipe.blockwise:
        return BlockwiseScaling(**shared)
    if precision.recipe == Recipe.mxfp8:
        return MXFP8Scaling(**shared)
    raise ConfigError(f"precision={precision.name}: recipe '{precision.recipe.value}' is not an FP8 recipe")


def _transposed(recipe: Fp8Recipe, quantized: Float8Tensor, source: torch.Tensor, role: int, state) -> Float8Tensor:
    if recipe.transpose_reuses_quantization(role):
        return quantized.transpose()
    return recipe.quantize(source.t().contiguous(), role, state)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, cache_mode: str, cache_block, *cache_and_state):
        # Tensors are passed one by one (not as a module or tuple) so that Dynamo traces this function whole.
        (data, scale_inv, t_data, t_scale_inv), state = cache_and_state[:4], cache_and_state[4:] or None
        cached = Float8Tensor(data, scale_inv, cache_block), Float8Tensor(t_data, t_scale_inv, cache_block)
        x_fp8 = recipe.quantize(x, INPUT, state)
        w_fp8, w_t = _weight_operands(recipe, weight, state, cache_mode, cached)
        y = fp8_gemm(x_fp8, w_fp8, x.dtype, recipe.fast_accum_fprop, recipe.emulate)
        if recipe.fp8_wgrad:
            x_t = _transposed(recipe, x_fp8, x, INPUT, state)
            saved_x, ctx.x_block = (x_t.data, x_t.scale_inv), x_t.block
        else:
            saved_x = (x, x.new_empty(()))
        saved_w = w_fp8 if w_t is None else w_t
        ctx.recipe, ctx.state, ctx.weight_dtype, ctx.w_block = recipe, state, weight.dtype, saved_w.block
        ctx.w_is_transposed = w_t is not None
        ctx.save_for_backward(*saved_x, saved_w.data, saved_w.scale_inv, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_data, x_scale_inv, w_data, w_scale_inv, weight = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        dy = dy.contiguous()
        dy_fp8 = recipe.quantize(dy, GRAD, ctx.state)
        w_saved = Float8Tensor(w_data, w_scale_inv, ctx.w_block)
        w_t = w_saved if ctx.w_is_transposed else _transposed(recipe, w_saved, weight, WEIGHT, ctx.state)
        dx = fp8_gemm(dy_fp8, w_t, dy.dtype, False, recipe.emulate)
        if recipe.fp8_wgrad:
            dy_t = _transposed(recipe, dy_fp8, dy, GRAD, ctx.state)
            x_t = Float8Tensor(x_data, x_scale_inv, ctx.x_block)
            dw = fp8_gemm(dy_t, x_t, ctx.weight_dtype, False, recipe.emulate)
        else:
            dw = (dy.t() @ x_data.to(dy.dtype)).to(ctx.weight_dtype)
        return (dx, dw) + (None,) * (len(ctx.needs_input_grad) - 2)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, state: tuple = (),
               cache: Optional["Fp8WeightCache"] = None) -> torch.Tensor:
    """y = x @ weight^T with the three GEMMs in FP8. `state`: a stateful recipe's (amax_history, scale) buffers."""
    if cache is None:
        return _Fp8LinearFunction.apply(x, weight, recipe, CACHE_OFF, None, *(None,) * 4, *state)
    return _Fp8LinearFunction.apply(x, weight, recipe, cache.mode, cache.block, *cache.tensors(), *state)


def _weight_operands(recipe, weight, state, cache_mode, cached) -> tuple[Float8Tensor, Optional[Float8Tensor]]:
    """The FP8 weight for fprop, and its transpose for dgrad where the cache holds it (None: backward makes it).
    `cached`: the cache's (weight, transpose) buffers, read in CACHE_REUSE and filled in place in CACHE_REFRESH."""
    if isinstance(weight, Fp8GatheredWeight):  # FSDP2 all-gathered it in FP8 (recipes.fp8.all_gather)
        return weight.as_float8(), None
    if cache_mode == CACHE_REUSE:
        return cached
    w_fp8 = recipe.quantize(weight, WEIGHT, state)
    if cache_mode != CACHE_REFRESH:
        return w_fp8, None
    w_t = _transposed(recipe, w_fp8, weight, WEIGHT, state)
    for buffer, value in zip(cached, (w_fp8, w_t)):
        buffer.data.copy_(value.data)
        buffer.scale_inv.copy_(value.scale_inv)
    return w_fp8, w_t


class Fp8WeightCache(nn.Module):
    """One layer's FP8 weight and its transpose, quantized in the first micro-batch of an optimizer step and read by
    the others. Fixed buffers (filled in place), so a compiled block keeps its graph; not saved in checkpoints."""

    def __init__(self, weight: torch.Tensor, recipe: Fp8Recipe, state: Optional[tuple]):
        super().__init__()
        # The shapes of the quantized operands, from a quantization on the meta device (no memory, no state change).
        meta_state = None if state is None else tuple(torch.empty_like(t, device="meta") for t in state)
        meta_weight = torch.empty_like(weight, device="meta")
        w_fp8 = recipe.quantize(meta_weight, WEIGHT, meta_state)
        w_t = _transposed(recipe, w_fp8, meta_weight, WEIGHT, meta_state)
        for name, like in (("data", w_fp8.data), ("scale_inv", w_fp8.scale_inv),
                           ("t_data", w_t.data), ("t_scale_inv", w_t.scale_inv)):
            self.register_buffer(name, torch.empty_like(like, device=weight.device), persistent=False)
        assert w_fp8.block == w_t.block  # per tensor, 128x128 and 1x32 blocks alike: fprop's and dgrad's agree
        self.block = w_fp8.block
        self.mode = CACHE_OFF

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.data, self.scale_inv, self.t_data, self.t_scale_inv


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) computing its three GEMMs in FP8. Shares its weight Parameter with the layer it replaces;
    a stateful recipe (delayed scaling) keeps its amax histories in the `fp8_state` buffers."""

    def __init__(self, linear: nn.Linear, recipe: Fp8Recipe):
        if linear.bias is not None:
            raise ValueError("Fp8Linear supports linear layers without bias only (Llama 3 and Nemotron-4 have none)")
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.recipe = recipe
        self.fp8_state = (
            DelayedScalingState(recipe.amax_history_len).to(linear.weight.device) if recipe.stateful else None
        )
        self.weight_cache: Optional[Fp8WeightCache] = None  # recipes.fp8.training.attach_weight_caches

    def state_tensors(self) -> tuple:
        return (self.fp8_state.amax_history, self.fp8_state.scale) if self.fp8_state is not None else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = fp8_linear(x2d, self.weight, self.recipe, self.state_tensors(), self.weight_cache)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
