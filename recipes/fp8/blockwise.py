"""Sub-channel (blockwise) scaling, as Transformer Engine's Float8BlockScaling and DeepSeek-V3 define it.

Each operand of a linear in blocks of 1 x 128 along K or of 128 x 128, TE's x/w/grad_block_scaling_dim (1 or 2;
recipes.config). The default, TE's and DeepSeek-V3's: activations and gradients in 1 x 128 blocks, weights in
128 x 128, so the transposed weight that dgrad needs reuses the same quantization (as does any 128 x 128 operand).
Each scale is fp8_max / amax of its block, rounded down to a power of two by default (then scaling is exact in
binary and never overflows), as TE's compute_scale_from_types (common/recipe/recipe_common.cuh) computes it: a
block amax so tiny that the FP32 quotient overflows gets the input dtype's largest value as its scale (then its
power-of-two floor).
"""

from __future__ import annotations

import torch

from recipes.fp8.current_scaling import cast_to_fp8, tensorwise_scale
from recipes.fp8.tensor import Float8Tensor

ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)
BLOCKS = {1: ACTIVATION_BLOCK, 2: WEIGHT_BLOCK}  # a block_scaling_dim's blocks


def power_of_two_floor(scale: torch.Tensor) -> torch.Tensor:
    """2**floor(log2(scale)), read off the FP32 exponent bits (exact, unlike log2); NaN stays NaN."""
    exponent_only = scale.view(torch.int32) & 0x7F800000
    return torch.where(torch.isfinite(scale) & (scale > 0), exponent_only.view(torch.float32), scale)


def quantize_blockwise(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], power_of_2_scales: bool = True
) -> Float8Tensor:
    rows, cols = x.shape
    block_rows, block_cols = block
    if rows % block_rows or cols % block_cols:
        raise ValueError(f"blockwise FP8 needs dimensions divisible by its {block} blocks, got {tuple(x.shape)}")
    blocks = x.float().view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    scale = tensorwise_scale(blocks.abs().amax(dim=(1, 3)), dtype, torch.finfo(x.dtype).max)
    if power_of_2_scales:
        scale = power_of_two_floor(scale)
    data = cast_to_fp8(blocks, scale[:, None, :, None], dtype).view(rows, cols)
    return Float8Tensor(data, scale.reciprocal(), block)
