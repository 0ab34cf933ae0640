"""FP8 operands written by the kernel that produces them: the MLP's activation (forward and backward) and a
linear's incoming gradient (identity), both FP8 copies (row-major and transposed) from one read of the op's inputs,
with the operand's `scale_inv` (1 / scale; per 1x128 block in blockwise scaling), in one launch.

    produce_fp8_current(op, a, b, dtype)         current scaling: op(a, b) in FP8, row-major and transposed, and
                                                 scale_inv, the scale computed in the casting kernel from the amax
                                                 of a first pass: produced_amax for a materialized tensor (op
                                                 "identity"), else produce_bf16_with_amax, whose BF16 values the
                                                 second pass casts (the op, compute-heavy for SwiGLU, runs once)
    produce_fp8_recording_amax(op, a, b, scale, dtype, history, slot)
                                                 delayed scaling: op(a, b) * scale in FP8 (both layouts) and
                                                 scale_inv, op(a, b)'s amax max-ed into history[slot]: the scale
                                                 is known, so one pass does it all
    produce_fp8_current_into, produce_fp8_recording_amax_into
                                                 the same, written into given tensors (a weight cache's buffers)
    produce_bf16(op, a, b)                       op(a, b) in BF16 (the BF16 MLP's backward)
    produced_amax(op, a, b)                      the amax of op(a, b), without writing it
    produce_bf16_with_amax(op, a, b)             op(a, b) in BF16 and its amax
    produce_fp8_1x128(op, a, b, dtype)           blockwise scaling: op(a, b) in 1x128 blocks along its rows and its
                                                 transpose in 1x128 blocks along its rows (each cast by its own
                                                 blocks' power-of-two scales), with both scale_invs: a block lies
                                                 inside one program's 128 x 128 tile, so no pass over the tensor
                                                 comes first

The ops (recipes.fp8.activation_ops) are computed with the BF16 roundings of the eager model, so that the FP8
bytes are those of the unfused reference, `reference_output` quantized:

    identity               a
    swiglu                 bf16(bf16(silu(g)) * u)              a = fc1's output [g | u]
    squared_relu           bf16(relu(a) * relu(a))
    swiglu_backward        [bf16(silu'(g) * bf16(dh * u)) | bf16(dh * bf16(silu(g)))]     a = dh, b = [g | u]
    squared_relu_backward  relu(b) > 0 ? 2 * bf16(dh * relu(b)) : 0                        a = dh, b = fc1's output

silu and its derivative are computed as ATen's CUDA kernels compute them (libdevice's expf, IEEE division, and the
one fused multiply-add nvcc makes of `1 + x * (1 - s)`). The amax is a max over FP32 bit patterns of |value|,
which orders as the values do and keeps NaN (as torch.amax). The tile sizes are autotuned on GPUs; under Triton's
CPU interpreter the kernels run with one tile size and NumPy's exp (recipes.fp8.kernels says how FP8 is
converted there).

Each program writes its row-major FP8 tiles, then, after a barrier, reads those bytes back (from L2: it has just
written them) and stores them transposed, as recipes.fp8.kernels' transpose kernel moves bytes. It does not
transpose the registers the FP8 conversion wrote: on an H200 (Triton 3.6.0) every tile that did (FP8 or FP32
transposed, cast before or after) wrote up to a quarter of the transposed bytes wrong for SwiGLU, its gradient and
squared ReLU's gradient, while the plain transpose kernel writes every byte (docs/results, issue 24; compare
triton-lang/triton#11111). Against that kernel run separately, this saves a launch and a read of the FP8 tensor
from memory. The blockwise kernel's transpose is cast by other scales than its row-major copy. It writes each
128 x 128 tile's rows in strips, then its columns in strips of 128 rows by a few columns, each column cast by its
block's scale: the FP8 values bitcast to uint8 first (that wrote every byte right on the H200 for every op), packed
four rows to an int32 word and transposed as words. The autotuner picks per shape and op among three forms
(docs/results, issue 25): kept, a program per tile keeps the op's values in a BF16 scratch between its row and
its column strips (the op computed once; L2 holds them for the column strips); recomputed, a program per tile
whose column strips compute the op again from its inputs; split, a program per strip.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from recipes.fp8.activation_ops import OPS
from recipes.fp8.kernels import (
    BLOCK, INTERPRETED, _bytes, _format_args, _power_of_two_scale, _tensorwise_scale, _to_fp8,
)

# Globals a Triton kernel reads must be constexprs; Python code compares their `.value`.
IDENTITY, SWIGLU, SQUARED_RELU, SWIGLU_BACKWARD, SQUARED_RELU_BACKWARD = (tl.constexpr(i) for i in range(len(OPS)))
# What the FP8 kernel does: the amax only; cast with the scale of an amax it is given; cast with a given scale and
# record the amax.
AMAX_ONLY, CAST_BY_AMAX, CAST_AND_RECORD = (tl.constexpr(i) for i in range(3))

if not INTERPRETED:
    from triton.language.extra import libdevice


@triton.jit
def _bf16(v, SOFTWARE: tl.constexpr):
    """FP32 rounded to BF16 (nearest, ties to even) and back, as c10::BFloat16 rounds: the hardware's cvt on GPUs,
    integer arithmetic in the interpreter (NumPy has no BF16). NaN stays NaN (its payload may differ)."""
    if SOFTWARE:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        result = tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))
    else:
        result = v.to(tl.bfloat16).to(tl.float32)
    return result


@triton.jit
def _exp(x, SOFTWARE: tl.constexpr):
    if SOFTWARE:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _relu(x):
    return tl.where(x < 0, 0.0, x)  # NaN stays NaN, as torch.relu


@triton.jit
def _produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP: tl.constexpr, SOFTWARE: tl.constexpr):
    """The op's values at rows r, columns c of its first output tile, and of its second (columns cols + c; only
    swiglu_backward has one, else the first again)."""
    first = tl.load(a + r[:, None] * a_cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    second = first
    if OP == SWIGLU:
        up = tl.load(a + r[:, None] * a_cols + cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        silu = _bf16(tl.div_rn(first, 1.0 + _exp(-first, SOFTWARE)), SOFTWARE)
        first = _bf16(silu * up, SOFTWARE)
        second = first
    elif OP == SQUARED_RELU:
        relu = _relu(first)
        first = _bf16(relu * relu, SOFTWARE)
        second = first
    elif OP == SWIGLU_BACKWARD:
        gate = tl.load(b + r[:, None] * b_cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(b + r[:, None] * b_cols + cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        e = _exp(-gate, SOFTWARE)
        silu = _bf16(tl.div_rn(gate, 1.0 + e), SOFTWARE)
        sigmoid = tl.div_rn(1.0, 1.0 + e)
        second = _bf16(first * silu, SOFTWARE)  # d_up
        first = _bf16(_bf16(first * up, SOFTWARE) * sigmoid * tl.fma(gate, 1.0 - sigmoid, 1.0), SOFTWARE)  # d_gate
    elif OP == SQUARED_RELU_BACKWARD:
        relu = _relu(tl.load(b + r[:, None] * b_cols + c[None, :], mask=mask, other=0.0).to(tl.float32))
        product = _bf16(first * relu, SOFTWARE)
        first = tl.where(relu <= 0, 0.0, product + product)
        second = first
    return first, second


@triton.jit
def _magnitude_bits(values, mask):
    """|value| as FP32 bits (NaN above inf; masked elements 0): a max over them orders as torch.amax does."""
    return tl.where(mask, values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def _running_amax(amax, first, second, mask, OP: tl.constexpr):
    """The element-wise running max of |value| bits over a program's tiles (reduced once, at its end)."""
    amax = tl.maximum(amax, _magnitude_bits(first, mask))
    if OP == SWIGLU_BACKWARD:
        amax = tl.maximum(amax, _magnitude_bits(second, mask))
    return amax


@triton.jit
def _record_amax(amax, amax_bits):
    """amax_bits = max(it, the program's max |value| as FP32 bits): one atomic per program."""
    tl.atomic_max(amax_bits, tl.max(tl.max(amax, 1), 0))


@triton.jit
def _store_fp8(values, scale, out, r, c, mask, out_cols, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
               BIAS: tl.constexpr, OUT: tl.constexpr, SOFTWARE: tl.constexpr):
    tl.store(out + r[:, None] * out_cols + c[None, :], _to_fp8(values * scale, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE),
             mask=mask)


@triton.jit
def _tile(rows, cols, step, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """Rows, columns and mask of this program's tile number `step` (its GROUP tiles lie one below the other);
    the mask a constant where the tiles divide the output (EVEN), so that the compiler drops the bounds checks."""
    r = (tl.program_id(0) * GROUP + step) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if EVEN:
        mask = tl.full((BLOCK_R, BLOCK_C), 1, tl.int1)
    else:
        mask = (r[:, None] < rows) & (c[None, :] < cols)
    return r, c, mask


@triton.jit
def _store_transposed(out, out_t, rows, cols, out_cols, offset, step, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      GROUP: tl.constexpr, EVEN: tl.constexpr):
    """out_t[offset + c, r] = out[r, offset + c] over tile `step` of this program, read back as bytes from `out`,
    as recipes.fp8.kernels' transpose kernel moves them."""
    r, c, mask = _tile(rows, cols, step, BLOCK_R, BLOCK_C, GROUP, EVEN)
    tile = tl.load(out.to(tl.pointer_type(tl.uint8)) + r[:, None] * out_cols + offset + c[None, :], mask=mask)
    tl.store(out_t.to(tl.pointer_type(tl.uint8)) + (offset + c)[:, None] * rows + r[None, :], tl.trans(tile),
             mask=tl.trans(mask))


@triton.jit
def _fp8_producer_kernel(a, b, out, out_t, scale_ptr, scale_inv, amax_bits, rows, cols, a_cols, b_cols,
                         OP: tl.constexpr, MODE: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                         BIAS: tl.constexpr, OUT: tl.constexpr, SOFTWARE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """GROUP BLOCK_R x BLOCK_C tiles of the op's output, one below the other (two for swiglu_backward: columns c
    and cols + c), row-major into `out` and transposed into `out_t`. `scale_ptr`: the amax to scale by
    (CAST_BY_AMAX) or the scale (CAST_AND_RECORD); the first program writes 1 / scale to `scale_inv`."""
    if MODE != AMAX_ONLY:
        if MODE == CAST_BY_AMAX:
            scale = _tensorwise_scale(tl.load(scale_ptr), FP8_MAX)
        else:
            scale = tl.load(scale_ptr)
        first_program = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        tl.store(scale_inv, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=first_program)
    out_cols = 2 * cols if OP == SWIGLU_BACKWARD else cols
    amax = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    for step in range(GROUP):
        r, c, mask = _tile(rows, cols, step, BLOCK_R, BLOCK_C, GROUP, EVEN)
        first, second = _produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
        if MODE != CAST_BY_AMAX:
            amax = _running_amax(amax, first, second, mask, OP)
        if MODE != AMAX_ONLY:
            _store_fp8(first, scale, out, r, c, mask, out_cols, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)
            if OP == SWIGLU_BACKWARD:
                _store_fp8(second, scale, out, r, cols + c, mask, out_cols, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)
    if MODE != CAST_BY_AMAX:
        _record_amax(amax, amax_bits)
    if MODE != AMAX_ONLY:
        # The transposed copy from the bytes just stored (this program's, still in L2) after a barrier that makes
        # them visible to all its threads, not from the registers the FP8 conversion wrote (module doc).
        tl.debug_barrier()
        for step in range(GROUP):
            _store_transposed(out, out_t, rows, cols, out_cols, 0, step, BLOCK_R, BLOCK_C, GROUP, EVEN)
            if OP == SWIGLU_BACKWARD:
                _store_transposed(out, out_t, rows, cols, out_cols, cols, step, BLOCK_R, BLOCK_C, GROUP, EVEN)


@triton.jit
def _store_bf16(pointers, values, mask, SOFTWARE: tl.constexpr):
    """Store values that are BF16 already. The interpreter gets int16 storage and their top halves (its own BF16
    conversion flushes subnormals)."""
    if SOFTWARE:
        tl.store(pointers, (values.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(pointers, values.to(tl.bfloat16), mask=mask)


@triton.jit
def _bf16_producer_kernel(a, b, out, amax_bits, rows, cols, a_cols, b_cols, OP: tl.constexpr,
                          RECORD_AMAX: tl.constexpr, SOFTWARE: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """The same tiles, stored in BF16 (row-major only), and their amax max-ed into amax_bits if RECORD_AMAX."""
    amax = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    for step in range(GROUP):
        r, c, mask = _tile(rows, cols, step, BLOCK_R, BLOCK_C, GROUP, EVEN)
        first, second = _produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
        if RECORD_AMAX:
            amax = _running_amax(amax, first, second, mask, OP)
        out_cols = 2 * cols if OP == SWIGLU_BACKWARD else cols
        _store_bf16(out + r[:, None] * out_cols + c[None, :], first, mask, SOFTWARE)
        if OP == SWIGLU_BACKWARD:
            _store_bf16(out + r[:, None] * out_cols + cols + c[None, :], second, mask, SOFTWARE)
    if RECORD_AMAX:
        _record_amax(amax, amax_bits)


# Few elements per thread, so that no op spills registers (ptxas for sm_90a: 64x128 tiles with 4 warps spilled
# 236-2284 bytes per thread); several tiles per program (GROUP) so that the amax costs one reduction across the
# program's threads and one atomic per GROUP tiles. The H200 tests check every tile byte for byte (docs/results,
# issue 24).
_TILES = [triton.Config({"BLOCK_R": r, "BLOCK_C": c, "GROUP": g}, num_warps=w)
          for r, c, g, w in ((32, 64, 1, 4), (32, 32, 1, 4), (32, 128, 1, 8), (16, 128, 1, 4), (32, 64, 4, 4),
                             (16, 128, 4, 4), (32, 128, 2, 8))]
_INTERPRETED_TILE = {"BLOCK_R": 64, "BLOCK_C": 64, "GROUP": 2}


def _tuned(kernel, key: list[str]):
    """The kernel autotuned over _TILES on GPUs (reruns are harmless: its stores and maxes repeat), as is under
    the interpreter; EVEN where the tiles divide the output."""
    even = triton.heuristics({"EVEN": lambda args: args["rows"] % (args["BLOCK_R"] * args["GROUP"]) == 0
                              and args["cols"] % args["BLOCK_C"] == 0})(kernel)
    return even if INTERPRETED else triton.autotune(_TILES, key=key)(even)


_FP8_KERNEL = _tuned(_fp8_producer_kernel, ["rows", "cols", "OP", "MODE"])
_BF16_KERNEL = _tuned(_bf16_producer_kernel, ["rows", "cols", "OP", "RECORD_AMAX"])


def _widths(op: int, a: torch.Tensor, b: Optional[torch.Tensor]) -> tuple[int, int]:
    """(columns each program's tiles step over, the output's width)."""
    if op == SWIGLU.value:
        return a.shape[1] // 2, a.shape[1] // 2
    if op == SWIGLU_BACKWARD.value:
        return a.shape[1], 2 * a.shape[1]
    return a.shape[1], a.shape[1]


def _operands(op_name: str, a: torch.Tensor, b: Optional[torch.Tensor]):
    """(op code, a, b (a where the op has one input), rows, columns the tiles step over, output width, grid)."""
    op = OPS.index(op_name)
    a = a.contiguous()
    b = a if b is None else b.contiguous()
    (cols, width), rows = _widths(op, a, b), a.shape[0]
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"] * meta["GROUP"]),  # noqa: E731
                         triton.cdiv(cols, meta["BLOCK_C"]))
    return op, a, b, rows, cols, width, grid


def _launch(op_name: str, a: torch.Tensor, b: Optional[torch.Tensor], mode: int, scale: torch.Tensor,
            amax_bits: torch.Tensor, dtype: torch.dtype,
            into: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the FP8 output (rows, width), its (width, rows) copy, its scale_inv), written into `into`'s three tensors
    where given; empty outputs for AMAX_ONLY."""
    op, a, b, rows, cols, width, grid = _operands(op_name, a, b)
    written = 0 if mode == AMAX_ONLY.value else width
    out, out_t, scale_inv = into or (torch.empty((rows, written), dtype=dtype, device=a.device),
                                     torch.empty((written, rows), dtype=dtype, device=a.device),
                                     torch.empty((), dtype=torch.float32, device=a.device))
    _FP8_KERNEL[grid](a, b, _bytes(out), _bytes(out_t), scale, scale_inv, amax_bits, rows, cols, a.shape[1],
                      b.shape[1], OP=op, MODE=mode, **_format_args(dtype),
                      **(_INTERPRETED_TILE if INTERPRETED else {}))
    return out, out_t, scale_inv


def produced_amax(op: str, a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """max |op(a, b)| as an FP32 scalar (NaN if any value is NaN)."""
    amax = torch.zeros((), dtype=torch.float32, device=a.device)
    _launch(op, a, b, AMAX_ONLY.value, amax, amax.view(torch.int32), torch.float8_e4m3fn)
    return amax


def _current(op: str, a: torch.Tensor, b: Optional[torch.Tensor], dtype: torch.dtype, into: Optional[tuple] = None):
    if op == "identity":
        amax = produced_amax(op, a, b)
    else:
        (a, amax), op, b = produce_bf16_with_amax(op, a, b), "identity", None
    return _launch(op, a, b, CAST_BY_AMAX.value, amax, amax.view(torch.int32), dtype, into)


@torch.library.custom_op("fp8_recipes::produce_fp8_current", mutates_args=())
def produce_fp8_current(op: str, a: torch.Tensor, b: Optional[torch.Tensor],
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """op(a, b) in `dtype` with current scaling (recipes.fp8.current_scaling: its scale from its own amax,
    saturating, NaN stays NaN): (rows, width), its (width, rows) copy, and scale_inv."""
    return _current(op, a, b, dtype)


@torch.library.custom_op("fp8_recipes::produce_fp8_current_into", mutates_args=("out", "out_t", "scale_inv"))
def produce_fp8_current_into(op: str, a: torch.Tensor, b: Optional[torch.Tensor], out: torch.Tensor,
                             out_t: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """produce_fp8_current written into existing tensors (a weight cache's buffers), in out's FP8 type."""
    _current(op, a, b, out.dtype, (out, out_t, scale_inv))


@torch.library.custom_op("fp8_recipes::produce_fp8_recording_amax", mutates_args=("history",))
def produce_fp8_recording_amax(op: str, a: torch.Tensor, b: Optional[torch.Tensor], scale: torch.Tensor,
                               dtype: torch.dtype, history: torch.Tensor,
                               slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """op(a, b) * scale in `dtype` (saturating, NaN stays NaN): (rows, width), its (width, rows) copy and
    scale_inv; and history.view(-1)[slot] = max(it, max |op(a, b)|): delayed scaling's open history slot."""
    return _launch(op, a, b, CAST_AND_RECORD.value, scale, history.view(-1)[slot:].view(torch.int32), dtype)


@torch.library.custom_op("fp8_recipes::produce_fp8_recording_amax_into",
                         mutates_args=("history", "out", "out_t", "scale_inv"))
def produce_fp8_recording_amax_into(op: str, a: torch.Tensor, b: Optional[torch.Tensor], scale: torch.Tensor,
                                    history: torch.Tensor, slot: int, out: torch.Tensor, out_t: torch.Tensor,
                                    scale_inv: torch.Tensor) -> None:
    """produce_fp8_recording_amax written into existing tensors (a weight cache's buffers), in out's FP8 type."""
    _launch(op, a, b, CAST_AND_RECORD.value, scale, history.view(-1)[slot:].view(torch.int32), out.dtype,
            (out, out_t, scale_inv))


@triton.jit
def _row_blocks(a, b, out, scale_inv, scratch, r, tile_c, rows, cols, a_cols, b_cols, out_cols, OP: tl.constexpr,
                FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                SOFTWARE: tl.constexpr, B: tl.constexpr, KEEP: tl.constexpr):
    """The op's rows r, in tile column tile_c, cast by their 1 x B blocks' scales into `out` (row-major), the
    scales' inverses into `scale_inv`; for swiglu_backward also its second output's tile. KEEP: the values also
    into `scratch` as BF16 bits (exact: the ops round to BF16), for the tile's column blocks."""
    c = tile_c * B + tl.arange(0, B)
    mask = tl.full((r.shape[0], B), 1, tl.int1)
    first, second = _produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
    for half in tl.static_range(2 if OP == SWIGLU_BACKWARD else 1):
        values = second if half else first
        scale = _power_of_two_scale(tl.max(_magnitude_bits(values, mask), 1).to(tl.float32, bitcast=True), FP8_MAX)
        _store_fp8(values, scale[:, None], out, r, half * cols + c, mask, out_cols, FP8_MAX, MANTISSA, BIAS, OUT,
                   SOFTWARE)
        tl.store(scale_inv + (half * (cols // B) + tile_c) * rows + r,
                 tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
        if KEEP:
            tl.store(scratch + r[:, None] * out_cols + (half * cols + c)[None, :],
                     (values.to(tl.int32, bitcast=True) >> 16).to(tl.int16))


@triton.jit
def _kept(scratch, r, c, out_cols):
    """The values _row_blocks kept at rows r, columns c."""
    bits = tl.load(scratch + r[:, None] * out_cols + c[None, :]).to(tl.int32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_byte(y, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
              SOFTWARE: tl.constexpr):
    """The FP8 bit pattern of y, zero-extended to int32 (bitcast to bytes first: module doc)."""
    return _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _transposed_blocks(v0, v1, v2, v3, out_t, scale_inv_t, tile_r, c, rows, out_cols, FP8_MAX: tl.constexpr,
                       MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr, SOFTWARE: tl.constexpr,
                       B: tl.constexpr):
    """Columns c of tile row tile_r, given as its rows 4i + j (vj: four (B / 4, SUB) tiles of one layout), cast by
    their B x 1 blocks' scales and stored transposed into `out_t` as int32 words: a thread holds the 4 bytes of one
    word, so the transpose moves words, not bytes. The scales' inverses into `scale_inv_t`."""
    mask = tl.full(v0.shape, 1, tl.int1)
    bits = tl.maximum(tl.maximum(_magnitude_bits(v0, mask), _magnitude_bits(v1, mask)),
                      tl.maximum(_magnitude_bits(v2, mask), _magnitude_bits(v3, mask)))
    scale = _power_of_two_scale(tl.max(bits, 0).to(tl.float32, bitcast=True), FP8_MAX)
    word = (_fp8_byte(v0 * scale[None, :], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)
            | (_fp8_byte(v1 * scale[None, :], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE) << 8)
            | (_fp8_byte(v2 * scale[None, :], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE) << 16)
            | (_fp8_byte(v3 * scale[None, :], FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE) << 24))
    words = tile_r * (B // 4) + tl.arange(0, B // 4)
    tl.store(out_t + c[:, None] * (rows // 4) + words[None, :], tl.trans(word))
    tl.store(scale_inv_t + tile_r * out_cols + c, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def _column_blocks(a, b, out_t, scale_inv_t, scratch, tile_r, c, rows, cols, a_cols, b_cols, out_cols,
                   OP: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                   OUT: tl.constexpr, SOFTWARE: tl.constexpr, B: tl.constexpr, KEEP: tl.constexpr):
    """The op's columns c in tile row tile_r cast by their B x 1 blocks' scales and stored transposed; for
    swiglu_backward also its second output's tile. KEEP: the values read from `scratch`, else computed again from
    the op's inputs (from L2: this program, or the programs of its tile's row strips, have just read them)."""
    quarter = tile_r * B + 4 * tl.arange(0, B // 4)
    if not KEEP:
        mask = tl.full((B // 4, c.shape[0]), 1, tl.int1)
        f0, s0 = _produced_tiles(a, b, quarter, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
        f1, s1 = _produced_tiles(a, b, quarter + 1, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
        f2, s2 = _produced_tiles(a, b, quarter + 2, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
        f3, s3 = _produced_tiles(a, b, quarter + 3, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
    for half in tl.static_range(2 if OP == SWIGLU_BACKWARD else 1):
        at = half * cols + c
        if KEEP:
            v0, v1 = _kept(scratch, quarter, at, out_cols), _kept(scratch, quarter + 1, at, out_cols)
            v2, v3 = _kept(scratch, quarter + 2, at, out_cols), _kept(scratch, quarter + 3, at, out_cols)
        else:
            v0, v1, v2, v3 = (s0, s1, s2, s3) if half else (f0, f1, f2, f3)
        _transposed_blocks(v0, v1, v2, v3, out_t, scale_inv_t, tile_r, at, rows, out_cols, FP8_MAX, MANTISSA, BIAS,
                           OUT, SOFTWARE, B)


@triton.jit
def _fp8_1x128_producer_kernel(a, b, out, scale_inv, out_t, scale_inv_t, scratch, rows, cols, a_cols, b_cols,
                               OP: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                               OUT: tl.constexpr, SOFTWARE: tl.constexpr, B: tl.constexpr, SUB: tl.constexpr,
                               KEEP: tl.constexpr, SPLIT: tl.constexpr):
    """A B x B tile of the op's output (two tiles for swiglu_backward: columns c and cols + c), in strips of SUB: its
    rows in their 1 x B blocks into `out`, its columns in their B x 1 blocks into `out_t` (transposed). The tiles
    are numbered down the tile columns.
    - KEEP (not identity, whose input is its output): a program per tile computes the op once, keeping its values
      in `scratch` (from L2: it reads them back at once) between its row and its column strips.
    - SPLIT: a program per strip, row or column, each computing the op from the inputs.
    - else a program per tile, its column strips computing the op again."""
    out_cols = 2 * cols if OP == SWIGLU_BACKWARD else cols
    strips: tl.constexpr = B // SUB
    keep: tl.constexpr = KEEP and OP != IDENTITY  # (the autotuner does not run identity's kept forms)
    if SPLIT:
        tile, strip = tl.program_id(0) // (2 * strips), tl.program_id(0) % (2 * strips)
        tile_r, tile_c = tile % (rows // B), tile // (rows // B)
        if strip < strips:
            _row_blocks(a, b, out, scale_inv, scratch, tile_r * B + strip * SUB + tl.arange(0, SUB), tile_c, rows,
                        cols, a_cols, b_cols, out_cols, OP, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, B, False)
        else:
            _column_blocks(a, b, out_t, scale_inv_t, scratch, tile_r,
                           tile_c * B + (strip - strips) * SUB + tl.arange(0, SUB), rows, cols, a_cols, b_cols,
                           out_cols, OP, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, B, False)
    else:
        tile_r, tile_c = tl.program_id(0) % (rows // B), tl.program_id(0) // (rows // B)
        for strip in range(strips):
            _row_blocks(a, b, out, scale_inv, scratch, tile_r * B + strip * SUB + tl.arange(0, SUB), tile_c, rows,
                        cols, a_cols, b_cols, out_cols, OP, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, B, keep)
        if keep:
            tl.debug_barrier()  # the kept values visible to every thread of the program
        for strip in range(strips):
            _column_blocks(a, b, out_t, scale_inv_t, scratch, tile_r, tile_c * B + strip * SUB + tl.arange(0, SUB),
                           rows, cols, a_cols, b_cols, out_cols, OP, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, B, keep)


def _1x128_programs(meta: dict, rows: int, cols: int) -> int:
    """The kernel's grid: a program per tile, or per strip (SPLIT)."""
    return (rows // BLOCK) * (cols // BLOCK) * (2 * BLOCK // meta["SUB"] if meta["SPLIT"] else 1)


def _1x128_forms(configs: list, named_args: dict, **kwargs) -> list:
    """Identity's input is its output: nothing to keep."""
    return [c for c in configs if not (c.kwargs["KEEP"] and kwargs["OP"] == IDENTITY.value)]


# The blockwise kernel's strip widths, warps and form (kept, split or recomputed: the kernel's doc), autotuned per
# shape and op on GPUs: configurations that compile without spills for every op (sm_90a, Triton 3.9).
_1X128_TILES = [triton.Config({"SUB": sub, "KEEP": keep, "SPLIT": split}, num_warps=w)
                for sub, w in ((16, 4), (32, 4), (32, 8), (16, 8)) for keep, split in ((1, 0), (0, 0), (0, 1))]
_INTERPRETED_1X128_TILE = {"SUB": 32, "KEEP": 1, "SPLIT": 0}
_FP8_1X128_KERNEL = (_fp8_1x128_producer_kernel if INTERPRETED else
                     triton.autotune(_1X128_TILES, key=["rows", "cols", "OP"],
                                     prune_configs_by={"early_config_prune": _1x128_forms})(_fp8_1x128_producer_kernel))


@torch.library.custom_op("fp8_recipes::produce_fp8_1x128", mutates_args=())
def produce_fp8_1x128(op: str, a: torch.Tensor, b: Optional[torch.Tensor],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """op(a, b) (rows, width) in 1 x 128 blocks along its rows, and its transpose (width, rows) in 1 x 128 blocks
    along its rows, power-of-two scales: (data, scale_inv, data_t, scale_inv_t) as recipes.fp8.blockwise's
    quantize_blockwise gives them for op(a, b) and op(a, b)^T. The scale_invs are stored with their rows contiguous
    (strides (1, rows)), the layout cuBLAS's block scaling reads, so that the GEMMs need no copy of them."""
    op_code, a, b, rows, cols, width, _ = _operands(op, a, b)
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"blockwise FP8 needs dimensions divisible by {BLOCK}, got {(rows, width)} for {op}")
    data, data_t = (torch.empty(shape, dtype=dtype, device=a.device) for shape in ((rows, width), (width, rows)))
    scale_inv, scale_inv_t = (torch.empty_strided(shape, (1, shape[0]), dtype=torch.float32, device=a.device)
                              for shape in ((rows, width // BLOCK), (width, rows // BLOCK)))
    # The op's values between the row and the column casts (identity's are its input); BF16 bits.
    scratch = a if op == "identity" else torch.empty((rows, width), dtype=torch.int16, device=a.device)
    _FP8_1X128_KERNEL[lambda meta: (_1x128_programs(meta, rows, cols),)](
        a, b, _bytes(data), scale_inv, data_t.view(torch.int32), scale_inv_t, scratch, rows, cols, a.shape[1],
        b.shape[1],
        OP=op_code, B=BLOCK, **_format_args(dtype), **(_INTERPRETED_1X128_TILE if INTERPRETED else {}),
    )
    return data, scale_inv, data_t, scale_inv_t


@produce_fp8_1x128.register_fake
def _(op, a, b, dtype):
    rows, width = a.shape[0], _widths(OPS.index(op), a, b)[1]
    scale_inv, scale_inv_t = (a.new_empty_strided(shape, (1, shape[0]), dtype=torch.float32)
                              for shape in ((rows, width // BLOCK), (width, rows // BLOCK)))
    return a.new_empty((rows, width), dtype=dtype), scale_inv, a.new_empty((width, rows), dtype=dtype), scale_inv_t


def _launch_bf16(op_name: str, a: torch.Tensor, b: Optional[torch.Tensor],
                 amax: Optional[torch.Tensor]) -> torch.Tensor:
    op, a, b, rows, cols, width, grid = _operands(op_name, a, b)
    out = torch.empty((rows, width), dtype=torch.bfloat16, device=a.device)
    stored = out.view(torch.int16) if INTERPRETED else out
    _BF16_KERNEL[grid](a, b, stored, out if amax is None else amax.view(torch.int32), rows, cols, a.shape[1],
                       b.shape[1], OP=op, RECORD_AMAX=amax is not None, SOFTWARE=INTERPRETED,
                       **(_INTERPRETED_TILE if INTERPRETED else {}))
    return out


@torch.library.custom_op("fp8_recipes::produce_bf16", mutates_args=())
def produce_bf16(op: str, a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """op(a, b) in BF16, one pass (the BF16 blocks' MLP backward: both halves of SwiGLU's gradient from one read)."""
    return _launch_bf16(op, a, b, None)


def produce_bf16_with_amax(op: str, a: torch.Tensor,
                           b: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(op(a, b) in BF16, its amax as an FP32 scalar), one pass: the BF16 values are exactly the op's (it rounds
    to BF16), so a cast of them is the op's cast."""
    amax = torch.zeros((), dtype=torch.float32, device=a.device)
    return _launch_bf16(op, a, b, amax), amax


@produce_bf16.register_fake
def _(op, a, b):
    return a.new_empty((a.shape[0], _widths(OPS.index(op), a, b)[1]), dtype=torch.bfloat16)


def _fake_fp8(op, a, b, dtype):
    width = _widths(OPS.index(op), a, b)[1]
    return (a.new_empty((a.shape[0], width), dtype=dtype), a.new_empty((width, a.shape[0]), dtype=dtype),
            a.new_empty((), dtype=torch.float32))


@produce_fp8_current.register_fake
def _(op, a, b, dtype):
    return _fake_fp8(op, a, b, dtype)


@produce_fp8_recording_amax.register_fake
def _(op, a, b, scale, dtype, history, slot):
    return _fake_fp8(op, a, b, dtype)


@produce_fp8_current_into.register_fake
def _(op, a, b, out, out_t, scale_inv):
    return None


@produce_fp8_recording_amax_into.register_fake
def _(op, a, b, scale, history, slot, out, out_t, scale_inv):
    return None
