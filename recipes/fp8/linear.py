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
the others: `WeightCache`, attached and switched by recipes.fp8.training for the training loop. Transformer Engine
caches FP8 weights across micro-batches the same way (`is_first_microbatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from recipes.compute import mm_into
from recipes.config import (
    DEFAULT_BLOCK_DIMS, AmaxComputeAlgo, ConfigError, PrecisionConfig, Recipe, gemms_of_two_2d_operands,
)
from recipes.fp8.all_gather import Fp8GatheredWeight
from recipes.fp8.blockwise import ACTIVATION_BLOCK, BLOCKS, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.current_scaling import quantize_tensorwise
from recipes.fp8.delayed_scaling import GRAD, INPUT, WEIGHT, DelayedScalingState, open_slot, quantize_delayed
from recipes.fp8.formats import forward_and_backward_dtypes
from recipes.fp8.activation_ops import reference_output
from recipes.fp8.gemm import fp8_gemm, fp8_gemm_into
from recipes.fp8.mxfp8 import quantize_mx
from recipes.fp8.nvfp4 import NVFP4_BLOCK, WEIGHT_2D_BLOCK, quantize_nvfp4_op
from recipes.fp8.rowwise import quantize_rowwise
from recipes.fp8.tensor import Float8Tensor

CACHE_OFF, CACHE_REFRESH, CACHE_REUSE = "off", "refresh", "reuse"  # quantize W each call / and store it / reuse it


@dataclass(frozen=True)
class Fp8Recipe:
    """What every recipe shares: FP8 types, FP8 wgrad on/off, emulation of block-scaled GEMMs."""

    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    fp8_wgrad: bool = True
    emulate: bool = False
    fused_kernels: bool = False  # Triton kernels for transposed operands where they run (recipes.fp8.kernels)

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

    def transposed(self, quantized: Float8Tensor, source: torch.Tensor, role: int, state) -> Float8Tensor:
        """The operand for a GEMM contracting `source`'s first dimension: `quantized`'s bytes transposed where the
        scale grid allows it, else `source^T` quantized along its new K (as Transformer Engine does)."""
        if not self.transpose_reuses_quantization(role):
            return self.quantize(source.t().contiguous(), role, state)
        kernels = _kernels_for(quantized.data) if self.fused_kernels else None
        if kernels is None:
            return quantized.transpose()
        scale_inv = quantized.scale_inv if quantized.block is None else quantized.scale_inv.t().contiguous()
        return Float8Tensor(kernels.transpose_fp8(quantized.data), scale_inv, quantized.block)

    def quantize_with_transpose(self, t: torch.Tensor, role: int, state) -> tuple[Float8Tensor, Float8Tensor]:
        """t quantized for a GEMM contracting its last dimension, and for one contracting its first."""
        quantized = self.quantize(t, role, state)
        if self.fused_kernels and self.transpose_reuses_quantization(role):
            quantized = written_once(quantized)
        return quantized, self.transposed(quantized, t, role, state)

    def quantize_into(self, t: torch.Tensor, role: int, state,
                      cached: tuple[Float8Tensor, Float8Tensor]) -> tuple[Float8Tensor, Float8Tensor]:
        """quantize_with_transpose written into `cached`'s buffers (a weight cache, filled in place)."""
        for buffer, value in zip(cached, self.quantize_with_transpose(t, role, state)):
            for into, tensor in zip(saved_tensors(buffer), saved_tensors(value)):
                if tensor is not None:
                    into.copy_(tensor)
        return cached

    def quantize_produced(self, op: str, a: torch.Tensor, b: Optional[torch.Tensor], role: int,
                          state) -> tuple[Float8Tensor, Float8Tensor]:
        """quantize_with_transpose of recipes.fp8.fused_quantize's op(a, b) (an MLP activation, forward or
        backward), from the kernel that computes it where the recipe has one."""
        return self.quantize_with_transpose(reference_output(op, a, b), role, state)

    def _fused(self, t: torch.Tensor):
        """recipes.fp8.fused_quantize where this recipe uses its kernels for t (on CUDA), else None."""
        return fused_quantize_for(t) if self.fused_kernels else None


def written_once(quantized: Float8Tensor) -> Float8Tensor:
    """`quantized` with its FP8 bytes fixed as one buffer under torch.compile. Inductor gives a cast that two extern
    kernels read (the GEMM and the transpose kernel) a copy each, written by the same fused kernel: one more write
    of every such tensor. Eager: unchanged."""
    if not torch.compiler.is_compiling():
        return quantized
    data = torch.ops.prims.inductor_force_stride_order(quantized.data, quantized.data.stride())
    return quantized._replace(data=data)


def _kernels_for(t: torch.Tensor):
    """recipes.fp8.kernels where its kernels run on t's device (CUDA GPUs), else None."""
    if not t.is_cuda:
        return None
    from recipes.fp8 import kernels

    return kernels


def fused_quantize_for(t: torch.Tensor):
    """recipes.fp8.fused_quantize where its kernels run on t's device (CUDA GPUs), else None."""
    if not t.is_cuda:
        return None
    from recipes.fp8 import fused_quantize

    return fused_quantize


class PerTensorScaling(Fp8Recipe):
    """What the per-tensor recipes share: one scale per tensor, so the transposed copy reuses the bytes, and with
    the fused kernels an activation (forward or backward) and a linear's incoming gradient are written in FP8, in
    both layouts, by the kernel that computes them (recipes.fp8.fused_quantize), and so is a weight into its cache
    for the step's micro-batches. A linear's input keeps the cast Inductor fuses into the kernel that produces it
    (a norm, attention's layout copy)."""

    def quantize_with_transpose(self, t, role, state):
        if role == GRAD and self._fused(t) is not None:  # a gradient arrives materialized
            return self.quantize_produced("identity", t, None, role, state)
        return super().quantize_with_transpose(t, role, state)

    def quantize_produced(self, op, a, b, role, state):
        kernels = self._fused(a)
        if kernels is None:
            return super().quantize_produced(op, a, b, role, state)
        data, data_t, scale_inv = self.fused_cast(kernels, op, a, b, self.dtype(role), state, role)
        return Float8Tensor(data, scale_inv), Float8Tensor(data_t, scale_inv)

    def quantize_into(self, t, role, state, cached):
        kernels = self._fused(t)
        if kernels is None:
            return super().quantize_into(t, role, state, cached)
        # One read of the weight writes both buffers (and, in delayed scaling, records its amax).
        self.fused_cast(kernels, "identity", t, None, self.dtype(role), state, role,
                        into=(cached[0].data, cached[1].data, cached[0].scale_inv))
        cached[1].scale_inv.copy_(cached[0].scale_inv)
        return cached

    def fused_cast(self, kernels, op, a, b, dtype, state, role,
                   into: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(FP8 data, its transpose, scale_inv) of op(a, b) from recipes.fp8.fused_quantize, written into `into`'s
        three tensors where given (then in their FP8 type)."""
        raise NotImplementedError


class TensorwiseScaling(PerTensorScaling):
    """Per-tensor current scaling (TE Float8CurrentScaling; precision=fp8_current): the scale from each tensor's amax
    now. Fused: an activation is computed once, in BF16 with its amax, then cast; a materialized tensor (op
    "identity") is read once for the amax and once for the cast."""

    def quantize(self, t, role, state):
        return quantize_tensorwise(t, self.dtype(role))

    def fused_cast(self, kernels, op, a, b, dtype, state, role, into=None):
        if into is None:
            return kernels.produce_fp8_current(op, a, b, dtype)
        kernels.produce_fp8_current_into(op, a, b, *into)
        return into


@dataclass(frozen=True)
class DelayedScaling(PerTensorScaling):
    """Per-tensor delayed scaling (TE DelayedScaling): the scale from an amax history of earlier steps."""

    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max
    margin: int = 0  # scale = fp8_max * 2**-margin / amax
    stateful = True

    def quantize(self, t, role, state):
        return quantize_delayed(t, self.dtype(role), state, role)

    def fused_cast(self, kernels, op, a, b, dtype, state, role, into=None):
        # The scale is known: one pass casts and records the amax.
        if into is None:
            return kernels.produce_fp8_recording_amax(op, a, b, state[1][role], dtype, *open_slot(state, role))
        kernels.produce_fp8_recording_amax_into(op, a, b, state[1][role], *open_slot(state, role), *into)
        return into


@dataclass(frozen=True)
class BlockwiseScaling(Fp8Recipe):
    """Sub-channel scaling (TE Float8BlockScaling): each operand in 1x128 blocks along K or in 128x128 blocks,
    `block_dims` (input, weight, gradient; TE's x/w/grad_block_scaling_dim, by default 1x128 activations and
    gradients and 128x128 weights), with power-of-two scales as TE's recipe makes them (then exact in BF16, which an
    emulated GEMM uses: recipes.fp8.gemm). A 128x128 operand's transpose reuses its bytes; a 1x128 one is quantized
    again along its new K. With the fused kernels, an activation or gradient in 1x128 blocks and its
    transpose are quantized from one read, by the kernel that computes it where it is an MLP activation
    (recipes.fp8.fused_quantize's produce_fp8_1x128); in 128x128 blocks it is computed, then quantized."""

    block_dims: tuple[int, int, int] = DEFAULT_BLOCK_DIMS
    fast_accum_fprop = False  # cuBLAS block scaling has no fast-accumulation mode

    def block(self, role: int) -> tuple[int, int]:
        return BLOCKS[self.block_dims[(INPUT, WEIGHT, GRAD).index(role)]]

    def quantize(self, t, role, state):
        return quantize_blockwise(t, self.dtype(role), self.block(role))

    def transpose_reuses_quantization(self, role):
        return self.block(role) == WEIGHT_BLOCK

    def quantize_with_transpose(self, t, role, state):
        if self._produces(role) and self._fused(t) is not None:
            return self.quantize_produced("identity", t, None, role, state)
        return super().quantize_with_transpose(t, role, state)

    def quantize_produced(self, op, a, b, role, state):
        kernels = self._fused(a) if self._produces(role) else None
        if kernels is None:
            return super().quantize_produced(op, a, b, role, state)
        data, scale_inv, data_t, scale_inv_t = kernels.produce_fp8_1x128(op, a, b, self.dtype(role))
        return Float8Tensor(data, scale_inv, ACTIVATION_BLOCK), Float8Tensor(data_t, scale_inv_t, ACTIVATION_BLOCK)

    def _produces(self, role: int) -> bool:
        """An activation or gradient in 1x128 blocks: what produce_fp8_1x128 writes, both ways."""
        return role != WEIGHT and self.block(role) == ACTIVATION_BLOCK


class MXFP8Scaling(Fp8Recipe):
    """MXFP8 (TE MXFP8BlockScaling): 1x32 blocks along K, E8M0 scales."""

    fast_accum_fprop = False

    def quantize(self, t, role, state):
        return quantize_mx(t, self.dtype(role))

    def transpose_reuses_quantization(self, role):
        return False


class RowwiseScaling(Fp8Recipe):
    """Row-wise scaling (torchao's "rowwise" recipe; with fp8_wgrad off its "rowwise_with_gw_hp"): one scale per row
    of each operand along its GEMM's K (recipes.fp8.rowwise), every operand E4M3, fast accumulation in fprop only
    as torchao configures its GEMMs. A transposed use has other rows: quantized again from the high-precision
    tensor, as torchao does."""

    def quantize(self, t, role, state):
        return quantize_rowwise(t, self.dtype(role))

    def transpose_reuses_quantization(self, role):
        return False


@dataclass(frozen=True)
class Nvfp4Scaling(Fp8Recipe):
    """NVFP4 (TE NVFP4BlockScaling; recipes.fp8.nvfp4): every operand in E2M1 with E4M3 scales of 1x16 blocks along
    K and an FP32 scale per tensor; weights in 16x16 blocks (`weight_2d`), whose transpose reuses the bytes; the
    input and the output gradient laid out for the weight gradient Hadamard-transformed first (`hadamard`); output
    gradients rounded stochastically (`stochastic_rounding`) with random numbers from the layer's seed (`state`:
    its rounding_seed). Each transposed use other than the weight's is quantized again from the high-precision
    tensor, as TE does. GEMMs: cuBLAS's NVFP4 GEMM on Blackwell, emulated elsewhere (recipes.fp8.gemm)."""

    hadamard: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    fast_accum_fprop = False

    def block(self, role: int) -> tuple[int, int]:
        return WEIGHT_2D_BLOCK if role == WEIGHT and self.weight_2d else NVFP4_BLOCK

    def quantize(self, t, role, state):
        return self._quantize(t, role, state, transposed=False)

    def transpose_reuses_quantization(self, role):
        return self.block(role) == WEIGHT_2D_BLOCK

    def transposed(self, quantized, source, role, state):
        if self.transpose_reuses_quantization(role):
            return quantized.transpose()
        return self._quantize(source.t(), role, state, transposed=True)

    def _quantize(self, t: torch.Tensor, role: int, state, transposed: bool) -> Float8Tensor:
        """t in NVFP4 for a GEMM contracting its last dimension; `transposed`: the layout the weight gradient takes
        (the Hadamard transform's, and the second of a gradient's two random draws)."""
        seed = state[0] if role == GRAD and self.stochastic_rounding else None
        hadamard = transposed and self.hadamard and role != WEIGHT
        codes, block_scale, tensor_scale_inv = quantize_nvfp4_op(t, self.block(role)[0], hadamard, seed,
                                                                 int(transposed), self.fused_kernels)
        return Float8Tensor(codes, block_scale, self.block(role), tensor_scale_inv)


def check_nvfp4_knobs(precision: PrecisionConfig) -> None:
    """ConfigError for NVFP4's disable_* knobs set outside NVFP4."""
    if precision.recipe != Recipe.nvfp4 and precision.nvfp4_parts_disabled:
        raise ConfigError(f"precision.{precision.nvfp4_parts_disabled[0]}=true is NVFP4's (TE's NVFP4BlockScaling): "
                          f"precision={precision.name} has no such part; leave it false or use precision=nvfp4")


def check_block_dims(precision: PrecisionConfig) -> None:
    """ConfigError for block dimensions no recipe or kernel takes: other than TE's default outside blockwise
    scaling, and two 128x128 operands in one GEMM without emulation (no native kernel anywhere)."""
    if precision.recipe != Recipe.blockwise and precision.block_dims != DEFAULT_BLOCK_DIMS:
        raise ConfigError(f"precision.x/w/grad_block_scaling_dim = {list(precision.block_dims)} are blockwise "
                          f"scaling's: precision={precision.name} has no such blocks; leave them at "
                          f"{list(DEFAULT_BLOCK_DIMS)} or use precision=fp8_blockwise")
    both_2d = gemms_of_two_2d_operands(precision.block_dims)
    if precision.recipe == Recipe.blockwise and both_2d and not precision.emulate:
        raise ConfigError(f"precision.x/w/grad_block_scaling_dim = {list(precision.block_dims)}: {both_2d[0]} would "
                          "multiply two 128x128-block operands, which no GEMM kernel takes (cuBLAS; Transformer "
                          "Engine refuses it); set precision.emulate=true to emulate it (engine=torch; slow, "
                          "labelled), or make one of them 1")


def recipe_from_config(precision: PrecisionConfig) -> Fp8Recipe:
    if precision.fp8_format is None:
        raise ConfigError(f"precision={precision.name}: set precision.fp8_format (hybrid or e4m3)")
    check_block_dims(precision)
    check_nvfp4_knobs(precision)
    shared = dict(zip(("forward_dtype", "backward_dtype"), forward_and_backward_dtypes(precision.fp8_format)))
    shared.update(fp8_wgrad=precision.fp8_wgrad, emulate=precision.emulate, fused_kernels=precision.fused_kernels)
    if precision.recipe == Recipe.delayed:
        return DelayedScaling(
            **shared, amax_history_len=precision.amax_history_len, amax_compute_algo=precision.amax_compute_algo,
            margin=precision.margin,
        )
    if precision.margin:  # TE's Float8CurrentScaling, Float8BlockScaling and MXFP8 quantizers have none
        raise ConfigError(f"precision.margin={precision.margin} is delayed scaling's: precision={precision.name} "
                          "has no margin (none in Transformer Engine either); set precision.margin=0 or use "
                          "precision=fp8_delayed")
    if precision.recipe == Recipe.tensorwise:
        return TensorwiseScaling(**shared)
    if precision.recipe == Recipe.blockwise:
        return BlockwiseScaling(**shared, block_dims=precision.block_dims)
    if precision.recipe == Recipe.mxfp8:
        return MXFP8Scaling(**shared)
    if precision.recipe == Recipe.rowwise:
        return RowwiseScaling(**shared)
    if precision.recipe == Recipe.nvfp4:
        return Nvfp4Scaling(**shared, hadamard=not precision.disable_rht,
                            stochastic_rounding=not precision.disable_stochastic_rounding,
                            weight_2d=not precision.disable_2d_quantization)
    raise ConfigError(f"precision={precision.name}: recipe '{precision.recipe.value}' is not an FP8 recipe")


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, cache_mode: str, cache_blocks, main_grad, *cache_and_state):
        # Tensors are passed one by one (not as a module or tuple) so that Dynamo traces this function whole.
        cache, state = cache_and_state[:CACHE_TENSORS], cache_and_state[CACHE_TENSORS:] or None
        if recipe.fp8_wgrad:
            x_fp8, x_t = recipe.quantize_with_transpose(x, INPUT, state)
            saved_x, ctx.x_block = saved_tensors(x_t), x_t.block
        else:
            x_fp8, saved_x = recipe.quantize(x, INPUT, state), (x, None, None)
        y, saved_w, ctx.w_is_transposed = fprop(recipe, x_fp8, weight, state, cache_mode, cache, cache_blocks,
                                                x.dtype)
        ctx.recipe, ctx.state, ctx.weight_dtype, ctx.w_block = recipe, state, weight.dtype, saved_w.block
        ctx.accumulate = cache_mode == CACHE_REUSE  # not the step's first micro-batch: add to main_grad
        ctx.save_for_backward(*saved_x, *saved_tensors(saved_w), weight, main_grad)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        saved = ctx.saved_tensors
        x_saved, w_saved, (weight, main_grad) = saved[:3], saved[3:6], saved[6:]
        x_data = x_saved[0]
        recipe: Fp8Recipe = ctx.recipe
        dy = dy.contiguous()
        if recipe.fp8_wgrad:
            dy_fp8, dy_t = recipe.quantize_with_transpose(dy, GRAD, ctx.state)
        else:
            dy_fp8 = recipe.quantize(dy, GRAD, ctx.state)
        dx = dgrad(recipe, dy_fp8, saved_operand(w_saved, ctx.w_block), ctx.w_is_transposed, weight, ctx.state,
                   dy.dtype)
        dw = None
        if recipe.fp8_wgrad:
            dw = weight_gradient(recipe, dy_t, saved_operand(x_saved, ctx.x_block), main_grad, ctx.accumulate,
                                 ctx.weight_dtype)
        elif main_grad is not None:
            mm_into(dy.t(), x_data.to(dy.dtype).t(), main_grad, ctx.accumulate)
        else:
            dw = (dy.t() @ x_data.to(dy.dtype)).to(ctx.weight_dtype)
        return (dx, dw) + (None,) * (len(ctx.needs_input_grad) - 2)


def saved_tensors(operand: Float8Tensor) -> tuple:
    """An operand's tensors for save_for_backward (its block goes on ctx): values, scales, and NVFP4's tensor scale
    (None for the others)."""
    return operand.data, operand.scale_inv, operand.tensor_scale_inv


def saved_operand(tensors: tuple, block: Optional[tuple[int, int]]) -> Float8Tensor:
    data, scale_inv, tensor_scale_inv = tensors
    return Float8Tensor(data, scale_inv, block, tensor_scale_inv)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, state: tuple = (),
               cache: Optional["WeightCache"] = None, main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight^T with the three GEMMs in FP8. `state`: a stateful recipe's buffers (DelayedScalingState's).
    With `main_grad` the weight gradient goes into it (written in the step's first micro-batch, added in the
    others, inside the GEMM where it can) instead of to autograd."""
    return _Fp8LinearFunction.apply(x, weight, recipe, *cache_arguments(cache), main_grad, *cache_tensors(cache),
                                    *state)


def cache_arguments(cache: Optional["WeightCache"]) -> tuple[str, tuple]:
    return (CACHE_OFF, (None, None)) if cache is None else (cache.mode, cache.blocks)


CACHE_TENSORS = 6


def cache_tensors(cache: Optional["WeightCache"]) -> tuple:
    """The cache's six buffers (saved_tensors of the FP8 weight, then of its transpose), None each without one."""
    return (None,) * CACHE_TENSORS if cache is None else cache.tensors()


def fprop(recipe: Fp8Recipe, x_fp8: Float8Tensor, weight: torch.Tensor, state, cache_mode: str, cache: tuple,
          cache_blocks: tuple, out_dtype: torch.dtype) -> tuple[torch.Tensor, Float8Tensor, bool]:
    """y = x @ W^T for a quantized x; `cache`: the weight cache's six buffers (cache_tensors), `cache_blocks`
    their scale blocks (cache_arguments). Returns y, the weight operand to save for dgrad, and whether that is
    already W^T."""
    cached = (saved_operand(cache[:3], cache_blocks[0]), saved_operand(cache[3:], cache_blocks[1]))
    w_fp8, w_t = _weight_operands(recipe, weight, state, cache_mode, cached)
    y = fp8_gemm(x_fp8, w_fp8, out_dtype, recipe.fast_accum_fprop, recipe.emulate)
    return y, (w_fp8 if w_t is None else w_t), w_t is not None


def dgrad(recipe: Fp8Recipe, dy_fp8: Float8Tensor, saved_w: Float8Tensor, is_transposed: bool, weight: torch.Tensor,
          state, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = dy @ W, with what fprop saved (W^T already, or W to transpose now)."""
    w_t = saved_w if is_transposed else recipe.transposed(saved_w, weight, WEIGHT, state)
    return fp8_gemm(dy_fp8, w_t, out_dtype, False, recipe.emulate)


def weight_gradient(recipe: Fp8Recipe, dy_t: Float8Tensor, x_t: Float8Tensor, main_grad: Optional[torch.Tensor],
                    accumulate: bool, weight_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """wgrad in FP8: into `main_grad` (written, or added to when `accumulate`) and None, else dW for autograd."""
    if main_grad is not None:
        fp8_gemm_into(dy_t, x_t, main_grad, accumulate, recipe.emulate)
        return None
    return fp8_gemm(dy_t, x_t, weight_dtype, False, recipe.emulate)


def _weight_operands(recipe, weight, state, cache_mode, cached) -> tuple[Float8Tensor, Optional[Float8Tensor]]:
    """The FP8 weight for fprop, and its transpose for dgrad where the cache holds it (None: backward makes it).
    `cached`: the cache's (weight, transpose) buffers, read in CACHE_REUSE and filled in place in CACHE_REFRESH."""
    if isinstance(weight, Fp8GatheredWeight):  # FSDP2 all-gathered it in FP8 (recipes.fp8.all_gather)
        return weight.as_float8(), None
    if cache_mode == CACHE_REUSE:
        return cached
    if cache_mode != CACHE_REFRESH:
        return recipe.quantize(weight, WEIGHT, state), None
    return recipe.quantize_into(weight, WEIGHT, state, cached)


class WeightCache(nn.Module):
    """One layer's low-precision copies of its weight (FP8 and its transpose, or BF16), made in the first micro-batch
    of an optimizer step and read by the others. Fixed buffers (filled in place), so a compiled block keeps its
    graph; not saved in checkpoints."""

    def __init__(self, like: dict[str, torch.Tensor], device: torch.device, blocks: Optional[tuple] = None):
        super().__init__()
        for name, tensor in like.items():  # None: a buffer this format has not (NVFP4's tensor scales)
            self.register_buffer(name, None if tensor is None else torch.empty_like(tensor, device=device),
                                 persistent=False)
        self.blocks = blocks  # the FP8 weight's and its transpose's scale blocks (Float8Tensor.block)
        self.mode = CACHE_OFF

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._buffers.values())


def fp8_weight_cache(weight: torch.Tensor, recipe: Fp8Recipe, state: Optional[tuple]) -> WeightCache:
    """The FP8 weight and its transpose, shaped by a quantization on the meta device (no memory, no state change)."""
    meta_state = None if state is None else tuple(torch.empty_like(t, device="meta") for t in state)
    meta_weight = torch.empty_like(weight, device="meta")
    w_fp8 = recipe.quantize(meta_weight, WEIGHT, meta_state)
    w_t = recipe.transposed(w_fp8, meta_weight, WEIGHT, meta_state)
    names = ("data", "scale_inv", "tensor_scale_inv")
    like = dict(zip(names, saved_tensors(w_fp8))) | dict(zip(("t_" + name for name in names), saved_tensors(w_t)))
    return WeightCache(like, weight.device, (w_fp8.block, w_t.block))


class CachedWeightLinear(nn.Linear):
    """nn.Linear (no bias) that shares its weight Parameter with the layer it replaces and can cache a
    low-precision copy of it per optimizer step (`weight_cache`) and write its gradient into an FP32 `main_grad`
    (one process: `attach_main_grads`) instead of returning it to autograd."""

    def __init__(self, linear: nn.Linear):
        if linear.bias is not None:
            raise ValueError(f"{type(self).__name__} supports linear layers without bias only (Llama 3 and "
                             "Nemotron-4 have none)")
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.weight_cache: Optional[WeightCache] = None  # attach_weight_caches
        self.register_buffer("main_grad", None, persistent=False)  # attach_main_grads

    def make_weight_cache(self) -> WeightCache:
        raise NotImplementedError


class Fp8Linear(CachedWeightLinear):
    """A linear layer computing its three GEMMs in FP8; a stateful recipe (delayed scaling) keeps its amax
    histories in the `fp8_state` buffers."""

    def __init__(self, linear: nn.Linear, recipe: Fp8Recipe):
        super().__init__(linear)
        self.recipe = recipe
        self.fp8_state = (
            DelayedScalingState(recipe.amax_history_len).to(linear.weight.device) if recipe.stateful else None
        )
        # Stochastic rounding's seed (recipes.fp8.nvfp4.uniform): run seed, this layer, draw; set by
        # recipes.fp8.training (seed_rounding, and each micro-batch's draw), derived again on a resume.
        rounds_stochastically = getattr(recipe, "stochastic_rounding", False)
        self.register_buffer("rounding_seed", torch.zeros(3, dtype=torch.int64, device=linear.weight.device)
                             if rounds_stochastically else None, persistent=False)

    def state_tensors(self) -> tuple:
        if self.fp8_state is not None:
            return self.fp8_state.tensors()
        return () if self.rounding_seed is None else (self.rounding_seed,)

    def make_weight_cache(self) -> WeightCache:
        return fp8_weight_cache(self.weight, self.recipe, self.state_tensors() or None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = fp8_linear(x2d, self.weight, self.recipe, self.state_tensors(), self.weight_cache, self.main_grad)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


class _Bf16LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache_mode: str, cached, main_grad):
        w = bf16_weight(weight, cache_mode, cached)
        x = x.to(torch.bfloat16)
        ctx.weight_dtype, ctx.accumulate = weight.dtype, cache_mode == CACHE_REUSE
        ctx.save_for_backward(x, w, main_grad)
        return F.linear(x, w)  # the call autocast makes

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, main_grad = ctx.saved_tensors
        dw = bf16_weight_gradient(dy, x, main_grad, ctx.accumulate, ctx.weight_dtype)
        return dy @ w, dw, None, None, None


def bf16_weight(weight: torch.Tensor, cache_mode: str, cached: Optional[torch.Tensor]) -> torch.Tensor:
    """The BF16 weight: the cache's (CACHE_REUSE), else cast now (and stored in the cache on CACHE_REFRESH)."""
    w = cached if cache_mode == CACHE_REUSE else weight.to(torch.bfloat16)
    if cache_mode == CACHE_REFRESH:
        cached.data.copy_(w)
    return w


def bf16_weight_gradient(dy: torch.Tensor, x: torch.Tensor, main_grad: Optional[torch.Tensor], accumulate: bool,
                         weight_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """dy^T @ x into `main_grad` (FP32, inside the GEMM) and None, else as dW for autograd."""
    if main_grad is None:
        return (dy.t() @ x).to(weight_dtype)
    mm_into(dy.t(), x.t(), main_grad, accumulate)
    return None


class Bf16Linear(CachedWeightLinear):
    """A linear layer in BF16 as autocast computes it (x and W cast to BF16, one BF16 GEMM each way), whose BF16
    weight can be cast once per optimizer step and whose weight gradient can accumulate in FP32 inside the GEMM:
    the BF16 baseline without the two passes per micro-batch that plain autocast adds (cast W, cast-and-add dW)."""

    def make_weight_cache(self) -> WeightCache:
        return WeightCache({"weight": torch.empty_like(self.weight, dtype=torch.bfloat16, device="meta")},
                           self.weight.device)

    def cache_mode(self) -> tuple[str, Optional[torch.Tensor]]:
        cache = self.weight_cache
        return (CACHE_OFF, None) if cache is None else (cache.mode, cache.weight)

    def gemm_state(self) -> tuple[Optional[torch.Tensor], bool, Optional[torch.Tensor], bool]:
        """For a caller that runs this layer's GEMMs itself (recipes.models.loss, the output layer): the BF16 weight
        cache to use (None: cast the weight), whether to refresh it from the weight first, the FP32 main gradient
        to write the weight gradient into (None: return it to autograd), and whether to add to it."""
        mode, cached = self.cache_mode()
        return (None if mode == CACHE_OFF else cached), mode == CACHE_REFRESH, self.main_grad, mode == CACHE_REUSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        mode, cached = self.cache_mode()
        y = _Bf16LinearFunction.apply(x2d, self.weight, mode, cached, self.main_grad)
        return y.view(*x.shape[:-1], self.out_features)
