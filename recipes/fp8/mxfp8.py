"""MXFP8 (OCP Microscaling Formats v1.0): 32 consecutive elements along K share one E8M0 scale, a power of two.

Scale exponent, "RCEIL" as NVIDIA's Transformer Engine and torchao compute it: the smallest power of two that
maps the block's amax into E4M3's range, 2**ceil(log2(amax / 448)), clamped to E8M0's [-127, 127]. (The OCP text
instead uses 2**(floor(log2(amax)) - 8), which can saturate the largest element; we follow NVIDIA.)

Native GEMMs (Blackwell, cuBLAS) take the scales as E8M0 bytes in a swizzled "32_4_4" tile layout:
`to_e8m0` and `swizzle_32_4_4` produce them. Elsewhere the GEMM is emulated from `dequantize()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.fp8.current_scaling import cast_to_fp8
from recipes.fp8.formats import fp8_max
from recipes.fp8.tensor import Float8Tensor

MX_BLOCK = (1, 32)
E8M0_BIAS = 127


def mx_scale_exponent(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ceil(log2(amax / fp8_max)), exactly (frexp, not log2), clamped to [-127, 127]; all-zero blocks get -127."""
    # In float64: an FP32 quotient underflows to 0 for amax below ~2**-141, and frexp(0) has exponent 0.
    mantissa, exponent = torch.frexp(amax.double() / fp8_max(dtype))  # value = mantissa * 2**exponent, 0.5 <= m < 1
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two needs no rounding up
    return torch.where(amax > 0, ceil_log2, torch.full_like(ceil_log2, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype) -> Float8Tensor:
    rows, cols = x.shape
    if cols % MX_BLOCK[1]:
        raise ValueError(f"MXFP8 needs K divisible by {MX_BLOCK[1]}, got {tuple(x.shape)}")
    blocks = x.float().view(rows, cols // MX_BLOCK[1], MX_BLOCK[1])
    amax = blocks.abs().amax(dim=-1)
    scale_inv = torch.ldexp(torch.ones_like(amax), mx_scale_exponent(amax, dtype))
    scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.full_like(scale_inv, float("nan")))
    data = cast_to_fp8(blocks, scale_inv.reciprocal()[..., None], dtype).view(rows, cols)
    return Float8Tensor(data, scale_inv, MX_BLOCK)


def to_e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8; view as torch.float8_e8m0fnu for a GEMM): the biased exponent of each power-of-two
    scale, 255 encoding NaN."""
    _, exponent = torch.frexp(scale_inv)
    biased = (exponent - 1 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)
    return torch.where(torch.isnan(scale_inv), torch.full_like(biased, 255), biased)


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling-factor layout: the (rows, K/32) scale matrix, padded to 128 x 4 tiles; each tile is
    stored as 32 rows of 16 bytes, row r of the tile at (r % 32) * 16 + (r // 32) * 4, its 4 columns adjacent."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = F.pad(scales, (0, col_tiles * 4 - cols, 0, row_tiles * 128 - rows))
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)  # (tile r, tile c, r%32, r//32, c)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)
