"""One FP8 GEMM, `a @ b^T` with a (M, K) and b (N, K) both row-major (K-major, the "TN" layout FP8 tensor cores
take), dispatched on the operands' scaling granularity:

- per-tensor scales: torch._scaled_mm (cuBLAS on GPUs; PyTorch's CPU kernel elsewhere);
- 1x128 / 128x128 blocks: torch.nn.functional.scaled_mm on Hopper (cuBLAS block scaling, CUDA >= 12.9);
- 1x32 MX blocks: torch.nn.functional.scaled_mm with E8M0 scales in the 32_4_4 layout on Blackwell;
- emulated (only when the precision asks for it): the operands dequantized to FP32 and multiplied in FP32, the
  same numbers a native block-scaled GEMM computes up to the order of FP32 accumulation.

There is no silent fallback: a block-scaled GEMM without a native kernel and without emulation raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK
from recipes.fp8.mxfp8 import MX_BLOCK, swizzle_32_4_4, to_e8m0
from recipes.fp8.tensor import Float8Tensor


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, fast_accum: bool, emulate: bool) -> torch.Tensor:
    if a.block is None and b.block is None:
        return torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    if emulate:
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    if not a.data.is_cuda:
        raise RuntimeError(
            f"no native {a.block} x {b.block} block-scaled FP8 GEMM on {a.data.device}; "
            "set precision.emulate=true to emulate it"
        )
    if a.block == MX_BLOCK:
        return _mx_gemm(a, b, out_dtype)
    return _blockwise_gemm(a, b, out_dtype)


def _blockwise_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS block scaling on sm90: a 1x128; b 1x128 or 128x128; E4M3 operands only. Scales are outer-dim-major
    (column-major) for a 1x128 operand; a 128x128 operand's scale grid is K-block-major with rows padded to a
    multiple of 4 (layouts checked against the emulation on an H200: tests/test_gpu.py)."""
    recipe = {ACTIVATION_BLOCK: F.ScalingType.BlockWise1x128, WEIGHT_BLOCK: F.ScalingType.BlockWise128x128}
    return F.scaled_mm(
        a.data, b.data.t(),
        _native_block_scale(a), recipe[a.block],
        _native_block_scale(b), recipe[b.block],
        output_dtype=out_dtype,
    )


def _native_block_scale(operand: Float8Tensor) -> torch.Tensor:
    scale = operand.scale_inv
    if operand.block == ACTIVATION_BLOCK:
        return scale.t().contiguous().t()  # (rows, K/128), stride (1, rows)
    padded = F.pad(scale, (0, -scale.shape[1] % 4))  # (N/128, L4), L4 = K/128 rounded up to 4
    return padded.t()  # (L4, N/128), stride (1, L4)


def _mx_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Blackwell (sm100) MXFP8: E8M0 scales, swizzled. Not run on this project's machines yet (no Blackwell)."""
    return F.scaled_mm(
        a.data, b.data.t(),
        _native_mx_scale(a), F.ScalingType.BlockWise1x32,
        _native_mx_scale(b), F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


def _native_mx_scale(operand: Float8Tensor) -> torch.Tensor:
    return swizzle_32_4_4(to_e8m0(operand.scale_inv)).flatten().view(torch.float8_e8m0fnu)
