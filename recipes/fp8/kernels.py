"""Triton kernels for the FP8 operands Inductor writes slowly, and the FP32 -> FP8 conversion and scales the other
kernels share (recipes.fp8.fused_quantize).

    transpose_fp8(data)    the per-tensor recipes' transposed operands whose row-major copy Inductor's cast writes
                           (x^T for wgrad, W^T for dgrad; the operands recipes.fp8.fused_quantize writes come
                           transposed from its kernels): the same FP8 bytes, laid out (K, rows)

It produces exactly the bytes of the reference path, checked in tests/test_gpu.py. Asked for a transposed copy,
Inductor writes it with strided stores; this kernel tiles through shared memory instead, as Transformer Engine's
cast-transpose kernels do. It is an opaque custom op for torch.compile.

Under Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is first imported; the CPU tests set it) the
FP32 -> FP8 conversion is done in integer arithmetic instead of the hardware's `cvt` (the interpreter's own
conversion truncates); on GPUs the hardware converts, round-to-nearest-even and saturating as torch's cast does
after the reference's clamp.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from recipes.fp8.formats import E4M3, E5M2, fp8_max

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 128  # the blockwise recipe's 1x128 blocks; a 128 x 128 tile holds 128 of them in each orientation
_FORMAT = {E4M3: (3, 7, tl.float8e4nv), E5M2: (2, 15, tl.float8e5)}  # mantissa bits, exponent bias, Triton type


@triton.jit
def _fp8_bits(y, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """FP8 bit patterns (uint8) of FP32 values already clamped to the format's range: round to nearest, ties to
    even, on the FP8 grid (subnormals included), in integer arithmetic. NaN -> 0x7F with the sign."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)
    quantum = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)  # the grid's spacing here
    steps = (a / quantum + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds to an integer, ties to even
    carry = steps >= (2 << MANTISSA)
    exponent = tl.where(carry, exponent + 1, exponent)
    steps = tl.where(carry, steps * 0.5, steps).to(tl.int32)
    normal = steps >= (1 << MANTISSA)
    code = tl.where(normal, ((exponent + BIAS) << MANTISSA) | (steps - (1 << MANTISSA)), steps)
    code = tl.where(a != a, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _to_fp8(y, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
            SOFTWARE: tl.constexpr):
    """The reference's `(y).clamp(-max, max).to(fp8)`: NaN stays NaN (its comparisons are false), infinities
    saturate. Compare-and-select rather than NaN-propagating min/max, the form triton-lang/triton#11111 reports
    corrupting a later store (it did not cause this project's wrong transposed bytes: docs/results, issue 24)."""
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    if SOFTWARE:  # an else, not a return after the if: Triton compiles that too, and its type is not uint8's
        return _fp8_bits(y, MANTISSA, BIAS)
    else:
        return y.to(OUT, fp_downcast_rounding="rtne")


@triton.jit
def _tensorwise_scale(amax, FP8_MAX: tl.constexpr):
    """recipes.fp8.current_scaling's tensorwise_scale: fp8_max / amax correctly rounded; FP32's max where that
    overflows; 1 for amax 0; NaN for a non-finite amax."""
    scale = tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    scale = tl.where(amax == 0, 1.0, scale)
    return tl.where((amax == amax) & (amax != float("inf")), scale, float("nan"))


@triton.jit
def _power_of_two_scale(amax, FP8_MAX: tl.constexpr):
    """recipes.fp8.blockwise's scale of a block with this amax: _tensorwise_scale, then power_of_two_floor."""
    scale = _tensorwise_scale(amax, FP8_MAX)
    exponent_only = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where((scale == scale) & (scale != float("inf")) & (scale > 0), exponent_only, scale)


@triton.jit
def _fp8_transpose_kernel(src, dst, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src + r[:, None] * cols + c[None, :], mask=mask)
    tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def _format_args(dtype: torch.dtype) -> dict:
    mantissa, bias, triton_type = _FORMAT[dtype]
    return dict(FP8_MAX=fp8_max(dtype), MANTISSA=mantissa, BIAS=bias, OUT=triton_type, SOFTWARE=INTERPRETED)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The kernels' view of FP8 data: bytes under the interpreter (it writes bit patterns), FP8 otherwise."""
    return t.view(torch.uint8) if INTERPRETED else t


# Tiles of the transpose, autotuned per shape on GPUs (a 64 x 64 tile moved 2.1-2.8 TB/s of an H200's ~4); the
# GPU suite checks every one.
TRANSPOSE_TILES = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                   for r, c, w in ((64, 64, 4), (128, 128, 8), (128, 128, 4), (64, 128, 4), (128, 64, 4))]
_TRANSPOSE = (_fp8_transpose_kernel if INTERPRETED
              else triton.autotune(TRANSPOSE_TILES, key=["rows", "cols"])(_fp8_transpose_kernel))


@torch.library.custom_op("fp8_recipes::transpose_fp8", mutates_args=())
def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """The (K, rows) row-major copy of a (rows, K) row-major FP8 tensor."""
    rows, cols = data.shape
    out = torch.empty((cols, rows), dtype=data.dtype, device=data.device)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(cols, meta["BLOCK_C"]))  # noqa: E731
    _TRANSPOSE[grid](data.contiguous().view(torch.uint8), out.view(torch.uint8), rows, cols,
                     **({"BLOCK_R": 64, "BLOCK_C": 64} if INTERPRETED else {}))
    return out


@transpose_fp8.register_fake
def _(data):
    return data.new_empty((data.shape[1], data.shape[0]))
