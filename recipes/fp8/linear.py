"""A linear layer whose three GEMMs run in FP8 with per-tensor current scaling.

    fprop  y  = x  @ W^T     x (E4M3), W (E4M3)      fast accumulation, as Transformer Engine does
    dgrad  dx = dy @ W       dy (E5M2 in HYBRID), W
    wgrad  dW = dy^T @ x     dy, x                   (in BF16 when fp8_wgrad is off)

FP8 GEMMs on Hopper take both operands K-major ("TN"), so every GEMM here is `a @ b^T` with `a` (M, K) and `b`
(N, K) row-major; dgrad and wgrad need W, dy and x transposed. With one scale per tensor a transpose commutes
with quantization, so the transposed operands are the same FP8 bytes laid out again, not a second quantization.
The forward saves x and W in FP8 for the backward (half the bytes of BF16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from recipes.config import ConfigError, PrecisionConfig
from recipes.fp8.current_scaling import Float8Tensor, quantize_tensorwise
from recipes.fp8.formats import forward_and_backward_dtypes


@dataclass(frozen=True)
class CurrentScaling:
    """The recipe object: which FP8 types, which margin, and whether wgrad runs in FP8."""

    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    margin: int = 0
    fp8_wgrad: bool = True

    @classmethod
    def from_config(cls, precision: PrecisionConfig) -> "CurrentScaling":
        if precision.fp8_format is None:
            raise ConfigError(f"precision={precision.name}: set precision.fp8_format (hybrid or e4m3)")
        forward_dtype, backward_dtype = forward_and_backward_dtypes(precision.fp8_format)
        return cls(forward_dtype, backward_dtype, precision.margin, precision.fp8_wgrad)


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, both row-major, with their scales undone in the GEMM epilogue."""
    return torch._scaled_mm(
        a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def transposed(t: Float8Tensor) -> Float8Tensor:
    return Float8Tensor(t.data.t().contiguous(), t.scale_inv)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: CurrentScaling) -> torch.Tensor:
        x_fp8 = quantize_tensorwise(x, recipe.forward_dtype, recipe.margin)
        w_fp8 = quantize_tensorwise(weight, recipe.forward_dtype, recipe.margin)
        y = fp8_gemm(x_fp8, w_fp8, out_dtype=x.dtype, fast_accum=True)
        ctx.recipe, ctx.weight_dtype = recipe, weight.dtype
        saved_x = (x_fp8.data, x_fp8.scale_inv) if recipe.fp8_wgrad else (x, x.new_empty(()))
        ctx.save_for_backward(*saved_x, w_fp8.data, w_fp8.scale_inv)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        recipe: CurrentScaling = ctx.recipe
        dy = dy.contiguous()
        dy_fp8 = quantize_tensorwise(dy, recipe.backward_dtype, recipe.margin)
        w_fp8 = Float8Tensor(w_data, w_scale_inv)
        dx = fp8_gemm(dy_fp8, transposed(w_fp8), out_dtype=dy.dtype, fast_accum=False)
        if recipe.fp8_wgrad:
            x_fp8 = Float8Tensor(x_data, x_scale_inv)
            dw = fp8_gemm(transposed(dy_fp8), transposed(x_fp8), out_dtype=ctx.weight_dtype, fast_accum=False)
        else:
            dw = (dy.t() @ x_data.to(dy.dtype)).to(ctx.weight_dtype)
        return dx, dw, None


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) computing its three GEMMs in FP8. Shares its weight Parameter with the layer it replaces."""

    def __init__(self, linear: nn.Linear, recipe: CurrentScaling):
        if linear.bias is not None:
            raise ValueError("Fp8Linear supports linear layers without bias only (Llama 3 and Nemotron-4 have none)")
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.recipe = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = _Fp8LinearFunction.apply(x2d, self.weight, self.recipe)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
