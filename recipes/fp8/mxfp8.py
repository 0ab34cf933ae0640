"""MXFP8 (OCP Microscaling Formats v1.0): 32 consecutive elements along K share one E8M0 scale, a power of two.

Scale exponent as NVIDIA's Transformer Engine computes it on every GPU, and Blackwell's E8M0 conversion
(`cvt.rp.satfinite.ue8m0x2.f32`) rounds: the FP32 product amax * fl32(1 / fp8_max), rounded up to a power of two.
That is 2**ceil(log2(amax / fp8_max)), "RCEIL", the smallest power of two that maps the block's amax into the
FP8 range, clamped to E8M0's [2**-127, 2**127], for every FP32 amax but one per format: the float just above
fp8_max * 2**-127, whose product rounds down to 2**-127, so its largest element lands a hair above fp8_max and
saturates to it. (The OCP text instead uses 2**(floor(log2(amax)) - 8), which can saturate the largest element
of any block; we follow NVIDIA.)

Native GEMMs (Blackwell, cuBLAS) take the scales as E8M0 bytes in a swizzled "32_4_4" tile layout:
`to_e8m0` and `swizzle_32_4_4` produce them. Elsewhere the GEMM is emulated from `dequantize()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.fp8.current_scaling import cast_to_fp8
from recipes.fp8.formats import E4M3, E5M2, fp8_max
from recipes.fp8.tensor import Float8Tensor

MX_BLOCK = (1, 32)
E8M0_BIAS = 127
# TE's Quantized_Limits<OType>::max_norm_rcp: 1 / fp8_max rounded to FP32. As a Python float holding an FP32
# value, its product with an FP32 amax is the FP32 product however a backend evaluates it (in FP32, or exactly
# in float64 and rounded once).
MAX_NORM_RCP = {dtype: torch.tensor(1.0 / fp8_max(dtype), dtype=torch.float32).item() for dtype in (E4M3, E5M2)}


def mx_scale_exponent(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block's scale exponent k (scale_inv = 2**k, k in [-127, 127]) for a finite amax; all-zero blocks get -127.

    TE cast/mxfp8/quantize_mxfp8.cuh: ptx::float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp), with
    util/ptx_arch_spec.cuh's float_to_e8m0 (the biased exponent, plus one unless the mantissa is 0 or the product
    is at most 2**-127). Read off the FP32 bits rather than computed with log2 or frexp: log2 rounds, and
    Inductor's CPU backend fails to compile frexp/ldexp. The product is subnormal for amax < fp8_max * 2**-126,
    which float_to_e8m0 expects as IEEE FP32 (no flush to zero; quantize_mx_op runs eager kernels).
    """
    product = amax.float() * MAX_NORM_RCP[dtype]
    bits = product.view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    round_up = (mantissa > 0) & (biased != 0xFE) & ~((biased == 0) & (mantissa <= 0x400000))
    return biased + round_up.to(torch.int32) - E8M0_BIAS


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2.0**exponent in FP32 for integer exponents in [-127, 127], built from bits (2**-127 is FP32-subnormal)."""
    normal = ((exponent.clamp(min=-126) + 127) << 23).view(torch.float32)
    return torch.where(exponent == -127, torch.full_like(normal, 2.0**-127), normal)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype) -> Float8Tensor:
    rows, cols = x.shape
    if cols % MX_BLOCK[1]:
        raise ValueError(f"MXFP8 needs K divisible by {MX_BLOCK[1]}, got {tuple(x.shape)}")
    data, scale_inv = quantize_mx_op(x, dtype)
    return Float8Tensor(data, scale_inv, MX_BLOCK)


# An opaque op for torch.compile: Inductor mis-fuses the two MX quantizations of one tensor that an FP8 linear
# makes (along K for fprop, along the tokens for wgrad); compiling a model on a CPU (torch 2.13) fails with an
# Inductor assertion on their fused index ranges. Eager kernels here, the same on every device.
@torch.library.custom_op("fp8_recipes::quantize_mx", mutates_args=())
def quantize_mx_op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    blocks = x.float().view(rows, cols // MX_BLOCK[1], MX_BLOCK[1])
    amax = blocks.abs().amax(dim=-1)
    scale_inv = power_of_two(mx_scale_exponent(amax, dtype))
    scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.full_like(scale_inv, float("nan")))
    data = cast_to_fp8(blocks, scale_inv.reciprocal()[..., None], dtype).view(rows, cols)
    return data, scale_inv


@quantize_mx_op.register_fake
def _(x, dtype):
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty((rows, cols // MX_BLOCK[1]), dtype=torch.float32)


def to_e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8; view as torch.float8_e8m0fnu for a GEMM): the biased exponent of each power-of-two
    scale, 255 encoding NaN. For 2**k, k >= -126, the FP32 exponent field is already k + 127; 2**-127 is 0."""
    field = (scale_inv.float().view(torch.int32) >> 23) & 0xFF
    return torch.where(torch.isnan(scale_inv), torch.full_like(field, 255), field).to(torch.uint8)


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling-factor layout (MXFP8's 1x32 blocks, NVFP4's 1x16): the (rows, K/block) scale matrix,
    padded to 128 x 4 tiles; each tile is stored as 32 rows of 16 bytes, row r of the tile at (r % 32) * 16 +
    (r // 32) * 4, its 4 columns adjacent."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = F.pad(scales, (0, col_tiles * 4 - cols, 0, row_tiles * 128 - rows))
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)  # (tile r, tile c, r%32, r//32, c)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)
