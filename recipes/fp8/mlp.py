"""An MLP as one autograd function, so that its activation is written by one kernel in the form the next GEMM
takes. FP8 (`Fp8Mlp`): the activation quantized by the kernel that computes it; in delayed scaling (scale known
beforehand) neither its output nor its gradient is written in BF16:

    forward   x -> FP8 (x, x^T) -> fc1 GEMM -> fc1's output (BF16, saved)
                 -> activation + FP8 h in one pass (h^T from h's bytes) -> fc2 GEMM -> y
    backward  dy -> FP8 (dy, dy^T) -> fc2 dgrad -> dh (BF16)
                 -> activation's backward + FP8 d in one pass (d^T from d's bytes) -> fc1 dgrad -> dx;
                 wgrads from the FP8 pairs

Current scaling needs the amax before the cast: the op's kernel writes it in BF16 with its amax, and a second
pass casts those values (the op, compute-heavy for SwiGLU, runs once; the cast reads 2 bytes per element).
Blockwise scaling's 1x128 blocks lie inside the kernel's tiles: one pass writes h (or d) in FP8 both ways, its
transpose cast by its own blocks' scales.

BF16 (`Bf16Mlp`, the BF16 blocks of the fused linears): the activation's backward writes both halves of SwiGLU's
gradient from one read of its inputs (Inductor's kernel reads every input twice, once per half).

The two linears keep their modules (recipes.fp8.linear's Fp8Linear or Bf16Linear: weight, scaling state, weight
cache, main gradient), so checkpoints and the FP8 object see the same layers as without the fusion. Transformer
Engine's LayerNormMLP fuses the same way. FP8: per-tensor and blockwise recipes with FP8 weight gradients only
(`fused_mlp`). The kernels are recipes.fp8.fused_quantize's, on CUDA; elsewhere the same values come from PyTorch's
operators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recipes.config import Activation
from recipes.fp8.activation_ops import FORWARD_AND_BACKWARD, reference_output
from recipes.fp8 import linear
from recipes.fp8.linear import (
    CACHE_REUSE, CACHE_TENSORS, GRAD, INPUT, Bf16Linear, BlockwiseScaling, Fp8Linear, Fp8Recipe, PerTensorScaling,
    bf16_weight, bf16_weight_gradient, cache_arguments, cache_tensors, dgrad, fprop, saved_operand, saved_tensors,
    weight_gradient,
)

ACTIVATION_OPS = {Activation.swiglu: "swiglu", Activation.squared_relu: "squared_relu"}


def fused_mlp(module: nn.Module):
    """The fused form of an MLP (a module that names its `activation`) whose fc1 and fc2 are both Bf16Linear, or
    both Fp8Linear of one per-tensor or blockwise recipe with FP8 weight gradients; None for anything else."""
    fc1, fc2 = getattr(module, "fc1", None), getattr(module, "fc2", None)
    if getattr(module, "activation", None) not in ACTIVATION_OPS or type(fc1) is not type(fc2):
        return None
    if type(fc1) is Bf16Linear:
        return Bf16Mlp(module)
    if (type(fc1) is Fp8Linear and isinstance(fc1.recipe, (PerTensorScaling, BlockwiseScaling))
            and fc1.recipe.fp8_wgrad and fc2.recipe == fc1.recipe):  # per-module precision may give them two
        return Fp8Mlp(module)
    return None


class _Fp8MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, recipe: Fp8Recipe, op: str, modes: tuple, blocks: tuple, main_grad1,
                main_grad2, state_len: int, *tensors):
        # Tensors one by one, as recipes.fp8.linear's function takes them, so that Dynamo traces this whole.
        cache1, cache2 = tensors[:CACHE_TENSORS], tensors[CACHE_TENSORS:2 * CACHE_TENSORS]
        states = tensors[2 * CACHE_TENSORS:]
        state1, state2 = states[:state_len] or None, states[state_len:] or None
        x_fp8, x_t = recipe.quantize_with_transpose(x, INPUT, state1)
        fc1_out, saved_w1, transposed1 = fprop(recipe, x_fp8, w1, state1, modes[0], cache1, blocks[0], x.dtype)
        h_fp8, h_t = recipe.quantize_produced(op, fc1_out, None, INPUT, state2)
        y, saved_w2, transposed2 = fprop(recipe, h_fp8, w2, state2, modes[1], cache2, blocks[1], x.dtype)
        ctx.recipe, ctx.op, ctx.states, ctx.transposed = recipe, op, (state1, state2), (transposed1, transposed2)
        ctx.accumulate = tuple(mode == CACHE_REUSE for mode in modes)
        ctx.weight_dtypes = (w1.dtype, w2.dtype)
        ctx.blocks = (x_t.block, saved_w1.block, h_t.block, saved_w2.block)  # the saved operands' scale blocks
        ctx.save_for_backward(*saved_tensors(x_t), *saved_tensors(saved_w1), *saved_tensors(h_t),
                              *saved_tensors(saved_w2), fc1_out, w1, w2, main_grad1, main_grad2)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x, w1_fp8, h, w2_fp8 = (saved_operand(saved[3 * i:3 * i + 3], block) for i, block in enumerate(ctx.blocks))
        fc1_out, w1, w2, main_grad1, main_grad2 = saved[12:]
        recipe: Fp8Recipe = ctx.recipe
        (state1, state2), (transposed1, transposed2) = ctx.states, ctx.transposed
        dy = dy.contiguous()
        dy_fp8, dy_t = recipe.quantize_with_transpose(dy, GRAD, state2)
        dh = dgrad(recipe, dy_fp8, w2_fp8, transposed2, w2, state2, dy.dtype)
        dw2 = weight_gradient(recipe, dy_t, h, main_grad2, ctx.accumulate[1], ctx.weight_dtypes[1])
        d_fp8, d_t = recipe.quantize_produced(FORWARD_AND_BACKWARD[ctx.op], dh, fc1_out, GRAD, state1)
        dx = dgrad(recipe, d_fp8, w1_fp8, transposed1, w1, state1, dy.dtype)
        dw1 = weight_gradient(recipe, d_t, x, main_grad1, ctx.accumulate[0], ctx.weight_dtypes[0])
        return (dx, dw1, dw2) + (None,) * (len(ctx.needs_input_grad) - 3)


class _FusedMlp(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.activation = mlp.activation
        self.fc1, self.fc2 = mlp.fc1, mlp.fc2


class Fp8Mlp(_FusedMlp):
    """fc1 -> activation -> fc2 of an MLP whose linears recipes.fp8.convert made FP8, as one fused function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        x2d = x.reshape(-1, x.shape[-1])
        states = (fc1.state_tensors(), fc2.state_tensors())
        (mode1, blocks1), (mode2, blocks2) = cache_arguments(fc1.weight_cache), cache_arguments(fc2.weight_cache)
        y = _Fp8MlpFunction.apply(
            x2d, fc1.weight, fc2.weight, fc1.recipe, ACTIVATION_OPS[self.activation], (mode1, mode2),
            (blocks1, blocks2), fc1.main_grad, fc2.main_grad, len(states[0]), *cache_tensors(fc1.weight_cache),
            *cache_tensors(fc2.weight_cache), *states[0], *states[1],
        )
        return y.view(*x.shape[:-1], fc2.out_features)


class _Bf16MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, op: str, modes: tuple, cached1, cached2, main_grad1, main_grad2):
        w1_bf16, w2_bf16 = (bf16_weight(w, mode, cached) for w, mode, cached in zip((w1, w2), modes, (cached1, cached2)))
        x = x.to(torch.bfloat16)
        fc1_out = F.linear(x, w1_bf16)
        h = reference_output(op, fc1_out)  # Inductor fuses the forward well
        ctx.op, ctx.accumulate, ctx.weight_dtypes = op, tuple(m == CACHE_REUSE for m in modes), (w1.dtype, w2.dtype)
        ctx.save_for_backward(x, fc1_out, h, w1_bf16, w2_bf16, main_grad1, main_grad2)
        return F.linear(h, w2_bf16)

    @staticmethod
    def backward(ctx, dy):
        x, fc1_out, h, w1_bf16, w2_bf16, main_grad1, main_grad2 = ctx.saved_tensors
        dy = dy.contiguous()
        dw2 = bf16_weight_gradient(dy, h, main_grad2, ctx.accumulate[1], ctx.weight_dtypes[1])
        dh = dy @ w2_bf16
        backward_op = FORWARD_AND_BACKWARD[ctx.op]
        kernels = linear.fused_quantize_for(dh)
        d = reference_output(backward_op, dh, fc1_out) if kernels is None else kernels.produce_bf16(backward_op, dh,
                                                                                                   fc1_out)
        dw1 = bf16_weight_gradient(d, x, main_grad1, ctx.accumulate[0], ctx.weight_dtypes[0])
        return d @ w1_bf16, dw1, dw2, None, None, None, None, None, None


class Bf16Mlp(_FusedMlp):
    """fc1 -> activation -> fc2 of an MLP of Bf16Linears (recipes.fp8.convert's fused linears), as one function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        (mode1, cached1), (mode2, cached2) = fc1.cache_mode(), fc2.cache_mode()
        y = _Bf16MlpFunction.apply(x.reshape(-1, x.shape[-1]), fc1.weight, fc2.weight, ACTIVATION_OPS[self.activation],
                                   (mode1, mode2), cached1, cached2, fc1.main_grad, fc2.main_grad)
        return y.view(*x.shape[:-1], fc2.out_features)
