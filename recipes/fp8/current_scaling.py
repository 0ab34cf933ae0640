"""Per-tensor current scaling (Transformer Engine's Float8CurrentScaling).

Every operand is quantized with a scale computed from its own absolute maximum, now:

    scale = fp8_max / amax        x_fp8 = cast(x * scale)        x ~= x_fp8 / scale

The GEMM receives `scale_inv = 1 / scale` and undoes it in its epilogue. An all-zero tensor gets scale 1. As in
TE there is no margin (precision.margin is delayed scaling's; recipes.plan refuses it here).
A tensor holding inf or NaN gets a NaN scale, so the NaN reaches the output and the loss instead of being
saturated silently to +-fp8_max; the training loop stops on a non-finite loss or gradient norm. (TE's kernels
instead drop NaN from the amax and give an inf amax scale 1, saturating inf to +-fp8_max.)
"""

from __future__ import annotations

import torch

from recipes.fp8.formats import fp8_max
from recipes.fp8.tensor import Float8Tensor

FP32_MAX = torch.finfo(torch.float32).max


def tensorwise_scale(amax: torch.Tensor, dtype: torch.dtype, max_scale: float = FP32_MAX) -> torch.Tensor:
    """fp8_max / amax in FP32, as TE's compute_scale_from_amax (common/recipe/recipe_common.cuh) computes it.

    A finite but tiny amax overflows the quotient; `max_scale` replaces the inf (TE: FP32's max for current
    scaling, the input dtype's max for blockwise) rather than let inf * 0 make NaN. amax 0 gives scale 1."""
    amax = amax.float()
    scale = fp32_quotient(fp8_max(dtype), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, max_scale), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def fp32_quotient(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator (FP32) correctly rounded to FP32, as TE's __fdiv_rn: divided in float64, whose one
    rounding to FP32 is exact for a quotient of FP32 values, eager and compiled alike. (Triton compiles an FP32
    division to an approximate one, an ulp off for some amaxes; Python-float / tensor rounds twice via the
    reciprocal.)"""
    return (torch.full_like(denominator, numerator, dtype=torch.float64) / denominator.double()).float()


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale rounded to the FP8 type, saturating at +-fp8_max like TE's casts (inf included); NaN stays NaN."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> Float8Tensor:
    scale = tensorwise_scale(x.abs().amax(), dtype)
    return Float8Tensor(cast_to_fp8(x, scale, dtype), fp32_quotient(1.0, scale))
