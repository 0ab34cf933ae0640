"""NVFP4 quantization in one Triton kernel: recipes.fp8.nvfp4's quantize_nvfp4 (TE 2.20's reference quantizer),
the same bytes, for CUDA tensors; and the emulated GEMM's input, each E2M1 value times its E4M3 block scale in
BF16, in another (block_scaled_bf16).

The reference is some hundred elementwise PyTorch kernels a tensor (block amaxes, scales, the E2M1 rounding by
comparisons, stochastic rounding's random numbers), which made an emulated NVFP4 step launch-bound. Here one
program quantizes a tile of 16 rows: the blocks' amaxes, their E4M3 scales, the encode scales, the E2M1 codes
(rounded to nearest even, or stochastically with recipes.fp8.nvfp4.uniform's numbers, hashed in the kernel from
the same seed, operand and element index), packed two to a byte, and the tensor's decode scale. Every step is the
reference's, in FP32 with IEEE division (tl.div_rn); the E4M3 scales are clamped, rounded and decoded in integer
arithmetic (recipes.fp8.kernels._to_fp8 in its software form), so the bytes do not depend on the hardware's conversions. The tensor's amax (the
second level) is one PyTorch reduction before the kernel, or recorded by the kernel of the random Hadamard transform
(hadamard_transform) where the operand takes one: recipes.fp8.nvfp4's transform, the same bits, in one pass instead
of PyTorch's float64 copy, float64 GEMM and cast back (36 bytes moved an element instead of 4). tests/test_nvfp4.py
checks the kernels against the reference in Triton's CPU interpreter, tests/test_gpu.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recipes.fp8.formats import E4M3
from recipes.fp8.fused_quantize import _magnitude_bits, _record_amax, _store_bf16
from recipes.fp8.kernels import INTERPRETED, _to_fp8

BLOCK = 16  # elements along K sharing a scale (recipes.fp8.nvfp4.NVFP4_BLOCK, which imports this module)
TILE_R = 16  # a program's rows: one row of 16 x 16 blocks, or 16 rows of 1 x 16 blocks
TILE_C = 64  # and columns: 4 blocks along K
INTEGER_ROUNDING = tl.constexpr(True)  # E4M3 scales rounded in integer arithmetic on GPUs too (_to_fp8's SOFTWARE)


@triton.jit
def _mix32(x):
    """recipes.fp8.nvfp4._mix32 on uint32 (a product's low 32 bits are the reference's masked int64 product)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _low32(word):
    return (word.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _uniform(seed, operand, index):
    """recipes.fp8.nvfp4.uniform's number of each element `index` (uint32): the key from the seed's three words and
    the operand, then the element's hash, its top 24 bits scaled into [0, 1)."""
    key = _mix32(_mix32(_low32(tl.load(seed))))  # the reference starts from key 0
    key = _mix32(key ^ _mix32(_low32(tl.load(seed + 1))))
    key = _mix32(key ^ _mix32(_low32(tl.load(seed + 2))))
    key = _mix32(key ^ _mix32(_low32(operand)))
    bits = _mix32(_mix32(index) ^ key)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _e4m3_value(bits):
    """The FP32 value of E4M3 bit patterns (int32, 0-255): subnormal, normal, NaN."""
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    value = tl.where((bits & 0x80) != 0, -value, value)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _capped(v):
    """torch.minimum(v, FP32's largest): NaN stays NaN."""
    return tl.where(v > 3.4028234663852886e38, 3.4028234663852886e38, v)


@triton.jit
def _stochastic(magnitude, u):
    """recipes.fp8.nvfp4.stochastic_magnitudes."""
    lo = ((magnitude >= 0.5).to(tl.float32) * 0.5 + (magnitude >= 1).to(tl.float32) * 0.5
          + (magnitude >= 2).to(tl.float32) + (magnitude >= 3).to(tl.float32) + (magnitude >= 4).to(tl.float32)
          + (magnitude >= 6).to(tl.float32) * 2.0)
    hi = (0.5 + (magnitude > 0.5).to(tl.float32) * 0.5 + (magnitude > 1).to(tl.float32)
          + (magnitude > 2).to(tl.float32) + (magnitude > 3).to(tl.float32) + (magnitude > 4).to(tl.float32) * 2.0)
    fraction = tl.div_rn(magnitude - lo, hi - lo)
    return tl.where(fraction >= u, hi, lo)


@triton.jit
def _e2m1_codes(scaled, u, STOCHASTIC: tl.constexpr):
    """recipes.fp8.nvfp4.e2m1_codes (int32 codes 0-15)."""
    magnitude = tl.abs(scaled)
    if STOCHASTIC:
        magnitude = _stochastic(magnitude, u)
    magnitude = tl.where(magnitude > 6.0, 6.0, magnitude)
    code = ((magnitude > 0.25).to(tl.int32) + (magnitude > 1.25).to(tl.int32) + (magnitude > 2.5).to(tl.int32)
            + (magnitude > 5.0).to(tl.int32) + (magnitude >= 0.75).to(tl.int32) + (magnitude >= 1.75).to(tl.int32)
            + (magnitude >= 3.5).to(tl.int32))
    code = code | ((scaled < 0).to(tl.int32) << 3)
    return tl.where(scaled != scaled, 0, code)


@triton.jit(do_not_specialize=["operand"])  # Triton makes an int argument of 1 a constant; the hash needs a value
def _nvfp4_kernel(x, amax, seed, codes, scales, decode_out, rows, cols, operand,
                  BLOCK_ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    NB: tl.constexpr = TILE_C // 16
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    r = pid_r * TILE_R + tl.arange(0, TILE_R)
    c = pid_c * TILE_C + tl.arange(0, TILE_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    values = tl.load(x + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)

    # The second level: S_enc = 448 * 6 / amax (FP32's largest on overflow, 1 where 0), its decode scale 1 / S_enc.
    encode_global = _capped(tl.div_rn(tl.full((), 2688.0, tl.float32), tl.load(amax)))
    encode_global = tl.where(encode_global == 0, 1.0, encode_global)
    decode_global = tl.div_rn(tl.full((), 1.0, tl.float32), encode_global)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(decode_out, decode_global)
    multiplier = encode_global * tl.div_rn(tl.full((), 1.0, tl.float32), tl.full((), 6.0, tl.float32))

    # Each block's amax (NaN if it holds one, as torch's amax), E4M3 scale, and encode scale.
    magnitudes = tl.reshape(tl.abs(values), (TILE_R, NB, 16))
    nans = tl.reshape((values != values).to(tl.int32), (TILE_R, NB, 16))
    block_amax = tl.max(magnitudes, axis=2)
    has_nan = tl.max(nans, axis=2)
    if BLOCK_ROWS == 16:
        block_amax = tl.max(block_amax, axis=0)[None, :]
        has_nan = tl.max(has_nan, axis=0)[None, :]
    block_amax = tl.where(has_nan != 0, float("nan"), block_amax)
    scale_bits = _to_fp8(_capped(block_amax * multiplier), 448.0, 3, 7, tl.float8e4nv, INTEGER_ROUNDING).to(tl.int32)
    encode = _capped(tl.div_rn(tl.full(scale_bits.shape, 1.0, tl.float32), _e4m3_value(scale_bits) * decode_global))

    scaled = tl.reshape(tl.reshape(values, (TILE_R, NB, 16)) * encode[:, :, None], (TILE_R, TILE_C))
    u = scaled  # unused without stochastic rounding
    if STOCHASTIC:
        index = (r[:, None].to(tl.int64) * cols + c[None, :]) & 0xFFFFFFFF
        u = _uniform(seed, operand, index.to(tl.uint32))
    code = _e2m1_codes(scaled, u, STOCHASTIC)
    even, odd = tl.split(tl.reshape(code, (TILE_R, TILE_C // 2, 2)))
    half = pid_c * (TILE_C // 2) + tl.arange(0, TILE_C // 2)
    tl.store(codes + r[:, None].to(tl.int64) * (cols // 2) + half[None, :], (even | (odd << 4)).to(tl.uint8),
             mask=(r[:, None] < rows) & (half[None, :] < cols // 2))
    b = pid_c * NB + tl.arange(0, NB)
    if BLOCK_ROWS == 16:
        tl.store(scales + pid_r * (cols // 16) + b[None, :], scale_bits.to(tl.uint8), mask=b[None, :] < cols // 16)
    else:
        tl.store(scales + r[:, None].to(tl.int64) * (cols // 16) + b[None, :], scale_bits.to(tl.uint8),
                 mask=(r[:, None] < rows) & (b[None, :] < cols // 16))


@triton.jit
def _butterfly(v, H: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform: in each group of 2H columns its halves (a, b) become
    (a + b, a - b). Stages H = 8, 4, 2, 1 multiply every 16 columns by Sylvester's H16."""
    halves = tl.permute(tl.reshape(v, (TILE_R, TILE_C // (2 * H), 2, H)), (0, 1, 3, 2))
    a, b = tl.split(halves)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE_R, TILE_C))


@triton.jit
def _round_to_bf16(y):
    """FP32 values rounded to the nearest BF16, ties to even (NaN kept), as FP32: PyTorch's conversion, in integer
    arithmetic so that the interpreter rounds as a GPU does."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, rounded)


@triton.jit
def _hadamard_kernel(x, out, amax_bits, rows, cols, NEGATIVE: tl.constexpr, TO_BF16: tl.constexpr,
                     SOFTWARE: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """recipes.fp8.nvfp4.random_hadamard_transform of a tile: every 16 columns times diag(signs) H16 / 4 in float64
    (the signs negative where bit i of NEGATIVE is set), rounded once to FP32 and then, for a BF16 x, to BF16 (as
    PyTorch casts float64 to bfloat16, through float32); the tile's amax max-ed into amax_bits."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    r = pid_r * TILE_R + tl.arange(0, TILE_R)
    c = pid_c * TILE_C + tl.arange(0, TILE_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offsets = r[:, None].to(tl.int64) * cols + c[None, :]
    v = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float64)
    v = tl.where(((NEGATIVE >> (c % 16)) & 1)[None, :] != 0, -v, v)
    for h in tl.static_range(4):
        v = _butterfly(v, 8 >> h, TILE_R, TILE_C)
    y = (v * 0.25).to(tl.float32)
    if TO_BF16:
        y = _round_to_bf16(y)
        _store_bf16(out + offsets, y, mask, SOFTWARE)
    else:
        tl.store(out + offsets, y, mask=mask)
    _record_amax(_magnitude_bits(y, mask), amax_bits)


def negative_bits(signs: tuple[int, ...]) -> int:
    """_hadamard_kernel's NEGATIVE: bit i set where sign i is negative."""
    return sum(1 << i for i, sign in enumerate(signs) if sign < 0)


def hadamard_transform(x: torch.Tensor, signs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """recipes.fp8.nvfp4.random_hadamard_transform(x) of a BF16 or FP32 x (rows, K), K a multiple of 16, with the
    sign vector `signs` (16 of +-1), and its amax (FP32, 0-dim; NaN where it holds one, as torch.amax)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] % BLOCK:
        raise ValueError(f"the Hadamard transform's kernel takes BF16 or FP32 with K a multiple of {BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    grid = (triton.cdiv(rows, TILE_R), triton.cdiv(cols, TILE_C))
    _hadamard_kernel[grid](x, out.view(torch.int16) if bf16 and INTERPRETED else out, amax_bits, rows, cols,
                           NEGATIVE=negative_bits(signs), TO_BF16=bf16,
                           SOFTWARE=INTERPRETED, TILE_R=TILE_R, TILE_C=TILE_C)
    return out, amax_bits.view(torch.float32)


@triton.jit
def _e2m1_value(code):
    """The FP32 value of E2M1 codes (int32, 0-15): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    exponent = (code >> 1) & 3
    half = (code & 1).to(tl.float32) * 0.5
    power = (1 << tl.maximum(exponent - 1, 0)).to(tl.float32)
    magnitude = tl.where(exponent == 0, half, (1.0 + half) * power)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _block_scaled_kernel(codes, scales, out, rows, cols, BLOCK_ROWS: tl.constexpr, TILE_R: tl.constexpr,
                         TILE_C: tl.constexpr, SOFTWARE: tl.constexpr):
    NB: tl.constexpr = TILE_C // 16
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    r = pid_r * TILE_R + tl.arange(0, TILE_R)
    half = pid_c * (TILE_C // 2) + tl.arange(0, TILE_C // 2)
    packed = tl.load(codes + r[:, None].to(tl.int64) * (cols // 2) + half[None, :],
                     mask=(r[:, None] < rows) & (half[None, :] < cols // 2), other=0).to(tl.int32)
    values = tl.reshape(tl.join(_e2m1_value(packed & 0xF), _e2m1_value(packed >> 4)), (TILE_R, NB, 16))
    b = pid_c * NB + tl.arange(0, NB)
    if BLOCK_ROWS == 16:
        scale_bits = tl.load(scales + pid_r * (cols // 16) + b[None, :], mask=b[None, :] < cols // 16, other=0)
    else:
        scale_bits = tl.load(scales + r[:, None].to(tl.int64) * (cols // 16) + b[None, :],
                             mask=(r[:, None] < rows) & (b[None, :] < cols // 16), other=0)
    scaled = tl.reshape(values * _e4m3_value(scale_bits.to(tl.int32))[:, :, None], (TILE_R, TILE_C))
    c = pid_c * TILE_C + tl.arange(0, TILE_C)
    _store_bf16(out + r[:, None].to(tl.int64) * cols + c[None, :], scaled, (r[:, None] < rows) & (c[None, :] < cols),
                SOFTWARE)


def block_scaled_bf16(codes: torch.Tensor, scales: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Float8Tensor.block_scaled() of an NVFP4 operand in BF16 (exact: an E2M1 value times an E4M3 scale has at
    most 2 + 4 significant bits), in one kernel: the emulated GEMM's input."""
    rows, cols = codes.shape[0], codes.shape[1] * 2
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=codes.device)
    grid = (triton.cdiv(rows, TILE_R), triton.cdiv(cols, TILE_C))
    _block_scaled_kernel[grid](codes, scales.view(torch.uint8), out.view(torch.int16) if INTERPRETED else out, rows,
                               cols, BLOCK_ROWS=block_rows, TILE_R=TILE_R, TILE_C=TILE_C, SOFTWARE=INTERPRETED)
    return out


def quantize(x: torch.Tensor, block_rows: int, seed: torch.Tensor | None, operand: int,
             hadamard_signs: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_nvfp4(x, (block_rows, 16), uniform(seed, operand, x.shape) if seed is given) as a GEMM operand's
    tensors: codes (rows, K / 2) uint8, block scales (E4M3) and the decode scale 1 / S_enc (FP32, 0-dim); of x's
    random Hadamard transform with `hadamard_signs` where they are given."""
    x = x.contiguous()
    if hadamard_signs is not None:
        x, amax = hadamard_transform(x, hadamard_signs)
    else:
        amax = torch.linalg.vector_norm(x, float("inf")).float()  # torch.amax(|x|), NaN kept, without |x|'s copy
    rows, cols = x.shape
    codes = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((rows // block_rows, cols // BLOCK), dtype=torch.uint8, device=x.device)
    decode = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, TILE_R), triton.cdiv(cols, TILE_C))
    _nvfp4_kernel[grid](x, amax, codes if seed is None else seed, codes, scales, decode, rows, cols, operand,
                        BLOCK_ROWS=block_rows, STOCHASTIC=seed is not None, TILE_R=TILE_R, TILE_C=TILE_C)
    return codes, scales.view(E4M3), decode

