"""The kernels of variants.py (issue 25 exploration at bd751c9; not part of the product or the suites)."""
import torch, triton
import triton.language as tl
from recipes.fp8 import fused_quantize as fq
from recipes.fp8.kernels import _power_of_two_scale, _to_fp8, _fp8_bits
from recipes.fp8.formats import E4M3
from recipes.fp8.activation_ops import OPS


@triton.jit
def _cols(values, mask, out_t, scale_inv_t, r, c, tile_r, rows, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
          BIAS: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, HW: tl.constexpr):
    scale = _power_of_two_scale(tl.max(fq._magnitude_bits(values, mask), 0).to(tl.float32, bitcast=True), FP8_MAX)
    y = values * scale[None, :]
    if HW:
        bits = _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, False).to(tl.uint8, bitcast=True)
    else:
        bits = _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, True)
    tl.store(out_t.to(tl.pointer_type(tl.uint8)) + c[:, None] * rows + r[None, :], tl.trans(bits))
    tl.store(scale_inv_t + c * (rows // B) + tile_r, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def _rows(values, mask, out, scale_inv, r, c, block, out_cols, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
          BIAS: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, SW: tl.constexpr):
    scale = _power_of_two_scale(tl.max(fq._magnitude_bits(values, mask), 1).to(tl.float32, bitcast=True), FP8_MAX)
    y = values * scale[:, None]
    if SW:
        tl.store(out.to(tl.pointer_type(tl.uint8)) + r[:, None] * out_cols + c[None, :], _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, True))
    else:
        tl.store(out + r[:, None] * out_cols + c[None, :], _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, False))
    tl.store(scale_inv + r * (out_cols // B) + block, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def _full_tile_kernel(a, b, out, scale_inv, out_t, scale_inv_t, rows, cols, a_cols, b_cols, OP: tl.constexpr,
                      FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                      B: tl.constexpr, HW: tl.constexpr, SW_ROWS: tl.constexpr):
    """One 128 x 128 tile: the op computed once, both orientations from the same registers."""
    tile_r, tile_c = tl.program_id(0), tl.program_id(1)
    r = tile_r * B + tl.arange(0, B)
    c = tile_c * B + tl.arange(0, B)
    mask = tl.full((B, B), 1, tl.int1)
    out_cols = 2 * cols if OP == 3 else cols
    first, second = fq._produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, False)
    for half in tl.static_range(2 if OP == 3 else 1):
        values = second if half else first
        _rows(values, mask, out, scale_inv, r, half * cols + c, half * (cols // B) + tile_c, out_cols, FP8_MAX, MANTISSA, BIAS, OUT, B, SW_ROWS)
        _cols(values, mask, out_t, scale_inv_t, r, half * cols + c, tile_r, rows, FP8_MAX, MANTISSA, BIAS, OUT, B, HW)


@triton.jit
def _strip_kernel(a, b, out, scale_inv, out_t, scale_inv_t, rows, cols, a_cols, b_cols, OP: tl.constexpr,
                  FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                  B: tl.constexpr, SUB: tl.constexpr, WHICH: tl.constexpr, HW: tl.constexpr):
    """The production layout of strips; WHICH 0 both, 1 rows only, 2 columns only; HW: hardware cvt for columns."""
    strips = B // SUB
    tile_r, strip, tile_c = tl.program_id(0) // (2 * strips), tl.program_id(0) % (2 * strips), tl.program_id(1)
    out_cols = 2 * cols if OP == 3 else cols
    if strip < strips:
        if WHICH != 2:
            r = tile_r * B + strip * SUB + tl.arange(0, SUB)
            c = tile_c * B + tl.arange(0, B)
            mask = tl.full((SUB, B), 1, tl.int1)
            first, second = fq._produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, False)
            for half in tl.static_range(2 if OP == 3 else 1):
                values = second if half else first
                _rows(values, mask, out, scale_inv, r, half * cols + c, half * (cols // B) + tile_c, out_cols, FP8_MAX, MANTISSA, BIAS, OUT, B, False)
    else:
        if WHICH != 1:
            r2 = tile_r * B + tl.arange(0, B)
            c2 = tile_c * B + (strip - strips) * SUB + tl.arange(0, SUB)
            mask2 = tl.full((B, SUB), 1, tl.int1)
            first2, second2 = fq._produced_tiles(a, b, r2, c2, mask2, cols, a_cols, b_cols, OP, False)
            for half in tl.static_range(2 if OP == 3 else 1):
                values2 = second2 if half else first2
                _cols(values2, mask2, out_t, scale_inv_t, r2, half * cols + c2, tile_r, rows, FP8_MAX, MANTISSA, BIAS, OUT, B, HW)


