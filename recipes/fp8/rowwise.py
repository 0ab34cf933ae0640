"""Row-wise (per-channel) scaling, as torchao's float8 training computes it: Float8LinearConfig's "rowwise" and
"rowwise_with_gw_hp" recipes, which torchtitan trains with on Hopper.

Each row of an operand laid out (rows, K) for a GEMM contracting K gets its own scale: the input's and the output
gradient's tokens, the weight's output channels (fprop) or input channels (dgrad, the weight transposed), and in
wgrad the gradient's output channels and the input's features. As torchao's tensor_to_scale and
hp_tensor_and_scale_to_float8 compute it: the row's amax in the tensor's own dtype, scale = fp8_max / max(amax,
1e-12) in float64, rounded to float32 and down to a power of two as torchao rounds it (exp2(floor(log2(scale)))
in float32, whose log2 takes a scale within about 2**-19 below a power of two up to it, not down), then the values
in float32 times the scale, clamped to +-fp8_max and cast. Every operand in E4M3 (tests/test_fp8_recipes.py checks
the bytes and scales against torchao's own functions).
"""

from __future__ import annotations

import torch

from recipes.fp8.tensor import ROW_BLOCK, Float8Tensor

AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero row gets a finite scale


def rowwise_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1) float32 power-of-two scales of x's rows, torchao's amax_to_scale with its power-of-two rounding."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype) -> Float8Tensor:
    """x (rows, K) in FP8 with one scale per row."""
    scale = rowwise_scale(x, dtype)
    fp8_max = torch.finfo(dtype).max
    data = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return Float8Tensor(data, scale.reciprocal(), ROW_BLOCK)
