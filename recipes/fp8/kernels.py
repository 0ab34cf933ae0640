"""Triton kernels for the FP8 operands Inductor writes slowly: transposed copies, written in one pass.

    transpose_fp8(data)                    the per-tensor recipes' transposed operands whose row-major copy
                                           Inductor's cast writes (x^T for wgrad, W^T for dgrad; the operands
                                           recipes.fp8.fused_quantize writes come transposed from its kernel):
                                           the same FP8 bytes, laid out (K, rows)
    quantize_1x128_with_transpose(x, ...)  blockwise activations and gradients: x quantized in 1x128 blocks
                                           along K, and x^T in 1x128 blocks along the rows, from one read of x

Each produces exactly the bytes and scales of the reference path (recipes.fp8.current_scaling,
recipes.fp8.blockwise: the same FP32 operations in the same order), checked in tests/test_gpu.py. Inductor fuses
the row-major quantization into the kernel that produces the tensor; asked for the transposed copy as well, it
writes that with strided stores. These kernels tile through shared memory instead, as Transformer Engine's
cast-transpose kernels do. Both are opaque custom ops for torch.compile.

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
def _amax(magnitudes, axis: tl.constexpr):
    """Max along `axis`, NaN where any element is NaN (as torch.amax; the hardware's max ignores NaN)."""
    has_nan = tl.max((magnitudes != magnitudes).to(tl.int32), axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(magnitudes, axis))


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
    if SOFTWARE:
        return _fp8_bits(y, MANTISSA, BIAS)
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


@triton.jit
def _fp8_quantize_1x128_both_kernel(x, data, scale_inv, data_t, scale_inv_t, rows, cols, FP8_MAX: tl.constexpr,
                                MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr, SOFTWARE: tl.constexpr,
                                B: tl.constexpr):
    """One B x B tile: B row blocks (1 x B along K) and B column blocks (B x 1, i.e. 1 x B blocks of x^T)."""
    tile_r, tile_c = tl.program_id(0), tl.program_id(1)
    r = tile_r * B + tl.arange(0, B)
    c = tile_c * B + tl.arange(0, B)
    values = tl.load(x + r[:, None] * cols + c[None, :]).to(tl.float32)
    magnitudes = tl.abs(values)

    row_scale = _power_of_two_scale(_amax(magnitudes, 1), FP8_MAX)
    row_fp8 = _to_fp8(values * row_scale[:, None], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)
    tl.store(data + r[:, None] * cols + c[None, :], row_fp8)
    tl.store(scale_inv + r * (cols // B) + tile_c, tl.div_rn(tl.full(row_scale.shape, 1.0, tl.float32), row_scale))

    column_scale = _power_of_two_scale(_amax(magnitudes, 0), FP8_MAX)
    column_fp8 = _to_fp8(values * column_scale[None, :], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)
    tl.store(data_t + c[:, None] * rows + r[None, :], tl.trans(column_fp8))
    tl.store(scale_inv_t + c * (rows // B) + tile_r,
             tl.div_rn(tl.full(column_scale.shape, 1.0, tl.float32), column_scale))


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


@torch.library.custom_op("fp8_recipes::quantize_1x128_with_transpose", mutates_args=())
def quantize_1x128_with_transpose(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, K) in 1x128 blocks along K, and x^T (K, rows) in 1x128 blocks along rows, power-of-two scales:
    (data, scale_inv) and (data_t, scale_inv_t) as recipes.fp8.blockwise.quantize_blockwise gives them."""
    rows, cols = x.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"blockwise FP8 needs dimensions divisible by {BLOCK}, got {tuple(x.shape)}")
    data = torch.empty((rows, cols), dtype=dtype, device=x.device)
    data_t = torch.empty((cols, rows), dtype=dtype, device=x.device)
    scale_inv = torch.empty((rows, cols // BLOCK), dtype=torch.float32, device=x.device)
    scale_inv_t = torch.empty((cols, rows // BLOCK), dtype=torch.float32, device=x.device)
    _fp8_quantize_1x128_both_kernel[(rows // BLOCK, cols // BLOCK)](
        x.contiguous(), _bytes(data), scale_inv, _bytes(data_t), scale_inv_t, rows, cols, B=BLOCK,
        num_warps=8, **_format_args(dtype),
    )
    return data, scale_inv, data_t, scale_inv_t


@quantize_1x128_with_transpose.register_fake
def _(x, dtype):
    rows, cols = x.shape
    return (x.new_empty((rows, cols), dtype=dtype), x.new_empty((rows, cols // BLOCK), dtype=torch.float32),
            x.new_empty((cols, rows), dtype=dtype), x.new_empty((cols, rows // BLOCK), dtype=torch.float32))
