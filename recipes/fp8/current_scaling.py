"""Per-tensor current scaling (Transformer Engine's Float8CurrentScaling).

Every operand is quantized with a scale computed from its own absolute maximum, now:

    scale = fp8_max / amax / 2**margin        x_fp8 = cast(x * scale)        x ~= x_fp8 / scale

The GEMM receives `scale_inv = 1 / scale` and undoes it in its epilogue. An all-zero tensor gets scale 1.
A tensor holding inf or NaN gets a NaN scale, so the NaN reaches the output and the loss instead of being
saturated silently to +-fp8_max; the training loop stops on a non-finite loss or gradient norm.
"""

from __future__ import annotations

import torch

from recipes.fp8.formats import fp8_max
from recipes.fp8.tensor import Float8Tensor


def tensorwise_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    amax = amax.float()
    # A true FP32 division (Python-float / tensor would round twice via the reciprocal), as TE computes it.
    scale = torch.full_like(amax, fp8_max(dtype)) / amax / (2.0**margin)
    # A finite but tiny amax overflows the scale; TE clamps it to FP32's max rather than produce inf * 0 = NaN.
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale rounded to the FP8 type; the clamp guards against FP32 rounding past fp8_max (never hides NaN)."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> Float8Tensor:
    scale = tensorwise_scale(x.abs().amax(), dtype, margin)
    return Float8Tensor(cast_to_fp8(x, scale, dtype), scale.reciprocal())
