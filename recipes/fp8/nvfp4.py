"""NVFP4 as Transformer Engine 2.20's NVFP4BlockScaling computes it: E2M1 values (2 bits of exponent, 1 of mantissa:
0, 0.5, 1, 1.5, 2, 3, 4, 6), 16 consecutive elements along K sharing one E4M3 scale, and one FP32 scale per tensor.

The numbers follow TE's pure-PyTorch reference quantizer (transformer_engine/pytorch/custom_recipes/
reference_nvfp4.py, which TE's tests hold its kernels to), step for step in FP32:
    S_enc = 448 * 6 / amax(tensor)          FP32; FP32's largest value where that overflows, 1 where it is 0 (amax inf)
    block scale = E4M3(amax(block) * (S_enc * fl32(1/6)))      clamped to +-448, rounded to nearest even
    encode = 1 / (block scale * (1 / S_enc))                     FP32, at most FP32's largest value
    value  = E2M1(clamp(x * encode, -6, 6))                      round to nearest, ties to even
and a tensor dequantizes as value * block scale * (1 / S_enc). The parts of TE's recipe, by operand of a linear:
- weights: one E4M3 scale per 16 x 16 block (`disable_2d_quantization` off), so the transposed weight that dgrad
  needs is the same quantization;
- the input and output gradient laid out for the weight gradient (tokens along K): a random Hadamard transform of
  every 16 tokens first (`disable_rht` off): x^T times diag(s) H16 / 4, H16 Sylvester's 16 x 16 Hadamard matrix and
  s TE's fixed sign vector, computed exactly and rounded once to the tensor's own dtype (TE's reference multiplies
  in that dtype), the tensor's amax taken after it. Both operands of that GEMM are transformed, and
  (diag(s) H16 / 4) is orthogonal, so the product is unchanged up to rounding;
- output gradients, both layouts: stochastic rounding (`disable_stochastic_rounding` off) as TE's own pure
  implementation (transformer_engine/jax/quantize/quantizer.py) computes it: with the two E2M1 neighbours lo <= |x|
  <= hi and u uniform in [0, 1), |x| becomes hi when (|x| - lo) / (hi - lo) >= u, else lo. TE's CUDA kernels draw u
  from Philox inside the kernel; here u comes from a counter-based hash of (run seed, layer, draw, operand, element),
  so a run's rounding is the same on a resume and on any device (`uniform`).
A negative input keeps its sign bit when it rounds to zero (TE's reference: code 8 for x in [-0.25, 0)); NaN
becomes code 0 (the reference compares and finds no interval). E2M1 codes are packed two per byte, the even
element in the low nibble, as TE's reference packs them (recipes.fp8.formats).

For the GEMMs an operand is handed on as a recipes.fp8.tensor.Float8Tensor (`as_operand`): the packed codes, the
E4M3 block scales and the tensor's decode scale 1 / S_enc, what cuBLAS's NVFP4 GEMM reads on Blackwell
(recipes.fp8.gemm); elsewhere the torch engine emulates that GEMM from the same operand.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from recipes.fp8.formats import E4M3, e2m1_values, pack_e2m1
from recipes.fp8.tensor import Float8Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = (1, 16)  # activations and gradients: 16 consecutive elements along K
WEIGHT_2D_BLOCK = (16, 16)  # weights with TE's 2D quantization
HADAMARD_SIZE = 16
# TE's sign vector for the random Hadamard transform (nvfp4_tensor.get_wgrad_sign_vector)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# Round to nearest, ties to even: the magnitude code is how many of these a magnitude passes (strictly above a
# bound that rounds down to an even code, at or above one that rounds up to it): TE's reference's intervals.
_ABOVE = (0.25, 1.25, 2.5, 5.0)
_AT_OR_ABOVE = (0.75, 1.75, 3.5)
FP32_MAX = torch.finfo(torch.float32).max


class Nvfp4Quantized(NamedTuple):
    """A tensor (rows, K) in NVFP4, as TE stores it."""

    codes: torch.Tensor  # uint8 (rows, K / 2): two E2M1 codes a byte, the even element in the low nibble
    block_scale: torch.Tensor  # float8_e4m3fn, one per block: (rows, K / 16) or (rows / 16, K / 16)
    amax: torch.Tensor  # FP32 scalar: the tensor's amax, whose S_enc = 448 * 6 / amax is the second level
    block: tuple[int, int]

    def values(self) -> torch.Tensor:
        """The E2M1 values (rows, K) in FP32."""
        return e2m1_values(self.codes)

    def as_operand(self) -> Float8Tensor:
        """The GEMM operand: codes, block scales and the tensor's decode scale 1 / S_enc (recipes.fp8.tensor)."""
        return Float8Tensor(self.codes, self.block_scale, self.block, torch.div(1.0, global_encode_scale(self.amax)))


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax in FP32: FP32's largest value where it overflows (amax 0), 1 where it is 0 (amax inf)."""
    scale = torch.minimum(torch.div(torch.tensor(E4M3_MAX * E2M1_MAX), amax.float()), torch.tensor(FP32_MAX))
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def magnitude_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude codes (0-7) of magnitudes in [0, 6], rounded to nearest, ties to even."""
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for bound in _ABOVE:
        code += (magnitude > bound).to(torch.uint8)
    for bound in _AT_OR_ABOVE:
        code += (magnitude >= bound).to(torch.uint8)
    return code


def stochastic_magnitudes(magnitude: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """TE's stochastic rounding of magnitudes to E2M1 values: the neighbours lo <= m <= hi (hi = lo on the grid and
    at 6 and beyond), hi where (m - lo) / (hi - lo) >= u, all in FP32."""
    lo = ((magnitude >= 0.5) * 0.5 + (magnitude >= 1) * 0.5 + (magnitude >= 2) * 1.0 + (magnitude >= 3) * 1.0
          + (magnitude >= 4) * 1.0 + (magnitude >= 6) * 2.0)
    hi = (0.5 + (magnitude > 0.5) * 0.5 + (magnitude > 1) * 1.0 + (magnitude > 2) * 1.0 + (magnitude > 3) * 1.0
          + (magnitude > 4) * 2.0)
    fraction = (magnitude - lo) / (hi - lo)  # NaN on the grid (0 / 0): lo
    return torch.where(fraction >= uniform, hi, lo)


def e2m1_codes(scaled: torch.Tensor, uniform: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes 0-15 of FP32 values already multiplied by their block's encode scale: clamped to +-6 and rounded to
    nearest even, or stochastically with `uniform` (then clamped, as TE's pure implementation orders it)."""
    magnitude = scaled.abs()
    if uniform is not None:
        magnitude = stochastic_magnitudes(magnitude, uniform)
    code = magnitude_codes(magnitude.clamp(max=E2M1_MAX))
    code = code | ((scaled < 0).to(torch.uint8) << 3)
    return torch.where(torch.isnan(scaled), torch.zeros_like(code), code)


# Built once per device (each quantization uses it: no host-to-device copy per call); never written.
@functools.lru_cache(maxsize=None)
def hadamard_matrix(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """diag(TE's signs) @ H16 / 4, in float64 (exact): orthogonal."""
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (torch.tensor(RHT_SIGNS, dtype=torch.float64)[:, None] * h / HADAMARD_SIZE**0.5).to(device)


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Every 16 consecutive elements of x's rows times diag(s) H16 / 4: computed exactly (float64: 16 products of
    x's values and +-1/4) and rounded once to x's dtype."""
    rows, cols = x.shape
    if cols % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform needs K divisible by {HADAMARD_SIZE}, got {tuple(x.shape)}")
    blocks = x.double().reshape(-1, HADAMARD_SIZE) @ hadamard_matrix(x.device)
    return blocks.reshape(rows, cols).to(x.dtype)


def quantize_nvfp4(x: torch.Tensor, block: tuple[int, int], uniform: Optional[torch.Tensor] = None) -> Nvfp4Quantized:
    """x (rows, K) in NVFP4 with one scale per `block` (1 x 16 or 16 x 16), rounded stochastically where `uniform`
    (x's shape, values in [0, 1)) is given."""
    rows, cols = x.shape
    block_rows, block_cols = block
    if rows % block_rows or cols % block_cols:
        raise ValueError(f"NVFP4 needs dimensions divisible by its {block} blocks, got {tuple(x.shape)}")
    values = x.float()
    amax = values.abs().amax()
    encode_global = global_encode_scale(amax)
    decode_global = torch.div(1.0, encode_global)
    blocks = values.view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    block_amax = blocks.abs().amax(dim=(1, 3))
    multiplier = encode_global * torch.reciprocal(torch.tensor(E2M1_MAX))
    block_scale = torch.minimum(block_amax * multiplier, torch.tensor(FP32_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    encode = torch.minimum(torch.div(1.0, block_scale.float() * decode_global), torch.tensor(FP32_MAX))
    scaled = (blocks * encode[:, None, :, None]).view(rows, cols)
    codes = e2m1_codes(scaled, uniform)
    return Nvfp4Quantized(pack_e2m1(codes), block_scale, amax, block)


# ---- the random numbers of stochastic rounding ----

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values below 2**32: no product
    overflows int64, so every device computes the same bits."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, operand: int, shape: torch.Size) -> torch.Tensor:
    """FP32 values in [0, 1) on a grid of 2**-24, one per element of `shape`, from `seed` (int64: run seed, layer,
    draw) and `operand` (which of the layer's quantizations of this draw): the same numbers for the same inputs on
    every device and in every process."""
    key = seed.new_zeros(())
    for word in (*seed.unbind(), seed.new_tensor(operand)):
        key = _mix32(key ^ _mix32(word))
    index = torch.arange(shape.numel(), device=seed.device, dtype=torch.int64)
    bits = _mix32(_mix32(index) ^ key)
    return ((bits >> 8).to(torch.float32) * 2.0**-24).view(shape)


# An opaque op for torch.compile, as recipes.fp8.mxfp8's quantization: eager kernels, the same on every device.
@torch.library.custom_op("fp8_recipes::quantize_nvfp4", mutates_args=())
def quantize_nvfp4_op(x: torch.Tensor, block_rows: int, hadamard: bool, seed: Optional[torch.Tensor],
                      operand: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, K) as a GEMM operand (Nvfp4Quantized.as_operand: codes, block scales, decode scale),
    Hadamard-transformed first where `hadamard`, rounded stochastically where a `seed` is given (`uniform`'s, with
    `operand`); on CUDA with `fused`, by recipes.fp8.nvfp4_kernels's kernels (the same bytes: the transform's,
    then the quantizer's)."""
    x = x.contiguous()
    if fused and x.is_cuda:
        from recipes.fp8 import nvfp4_kernels

        return nvfp4_kernels.quantize(x, block_rows, seed, operand, RHT_SIGNS if hadamard else None)
    if hadamard:
        x = random_hadamard_transform(x)
    random = None if seed is None else uniform(seed, operand, x.shape)
    quantized = quantize_nvfp4(x, (block_rows, NVFP4_BLOCK[1]), random).as_operand()
    return quantized.data, quantized.scale_inv, quantized.tensor_scale_inv


@quantize_nvfp4_op.register_fake
def _(x, block_rows, hadamard, seed, operand, fused):
    rows, cols = x.shape
    return (x.new_empty((rows, cols // 2), dtype=torch.uint8),
            x.new_empty((rows // block_rows, cols // NVFP4_BLOCK[1]), dtype=E4M3), x.new_empty((), dtype=torch.float32))
