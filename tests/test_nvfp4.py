"""NVFP4 (recipes.fp8.nvfp4, precision=nvfp4) against an independent reference written from Transformer Engine
2.20's code: its pure-PyTorch reference quantizer (custom_recipes/reference_nvfp4.py: the global and block scales,
the E2M1 rounding table, the nibble packing), its sign vector and Hadamard matrix (tensor/nvfp4_tensor.py), and its
pure stochastic rounding (jax/quantize/quantizer.py). The reference here is NumPy in float32, step for step, with
E4M3 rounding decoded from the E4M3 bit patterns (not a torch cast). On a GPU with TE, tests/test_gpu.py holds the
quantizer to TE's own reference class too.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recipes.config import ConfigError, load_option
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.formats import E4M3
from recipes.fp8.linear import Fp8Linear, Nvfp4Scaling, recipe_from_config
from recipes.fp8.nvfp4 import (
    RHT_SIGNS, hadamard_matrix, quantize_nvfp4, quantize_nvfp4_op, random_hadamard_transform, uniform,
)
from recipes.fp8.tensor import Float8Tensor
from recipes.fp8.training import Fp8Training
from recipes.models.transformer import Transformer

from nvfp4_checks import adversarial, check_decode_kernel, check_hadamard_kernel, check_kernel_bytes

F32 = np.float32
F32_MAX = np.finfo(np.float32).max


# ---- the reference ----


def e4m3_grid() -> np.ndarray:
    """Every finite non-negative E4M3 value in code order (code = index): subnormals m/8 * 2**-6, normals
    (1 + m/8) * 2**(e - 7), 0x7F (e = 15, m = 7) being NaN."""
    values = [m / 8 * 2.0**-6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return np.array(values[:127], dtype=np.float64)


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round to nearest E4M3 (|v| <= 448 here), ties to the even code; NaN stays NaN."""
    grid = e4m3_grid()
    magnitude = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(grid, np.nan_to_num(magnitude), side="left"), 1, len(grid) - 1)
    lo = hi - 1
    below, above = magnitude - grid[lo], grid[hi] - magnitude
    pick_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    rounded = np.where(pick_hi, grid[hi], grid[lo]) * np.sign(v)
    return np.where(np.isnan(v), np.nan, rounded).astype(F32)


def te_fp4_codes(x: np.ndarray) -> np.ndarray:
    """TE's reference cast_to_fp4x2 table, comparison for comparison (NaN matches none: code 0)."""
    r = np.zeros(x.shape, dtype=np.uint8)
    intervals = [((x >= 0.0) & (x <= 0.25), 0), ((x > 0.25) & (x < 0.75), 1), ((x >= 0.75) & (x <= 1.25), 2),
                 ((x > 1.25) & (x < 1.75), 3), ((x >= 1.75) & (x <= 2.5), 4), ((x > 2.5) & (x < 3.5), 5),
                 ((x >= 3.5) & (x <= 5.0), 6), (x > 5.0, 7),
                 ((x >= -0.25) & (x < -0.0), 8), ((x < -0.25) & (x > -0.75), 9), ((x <= -0.75) & (x >= -1.25), 10),
                 ((x < -1.25) & (x > -1.75), 11), ((x <= -1.75) & (x >= -2.5), 12), ((x < -2.5) & (x > -3.5), 13),
                 ((x <= -3.5) & (x >= -5.0), 14), (x < -5.0, 15)]
    for where, code in intervals:
        r[where] = code
    return r


def te_stochastic(scaled: np.ndarray, u: np.ndarray) -> np.ndarray:
    """TE's pure stochastic rounding (JAX quantizer): the E2M1 value chosen for each scaled value, before clipping."""
    a = np.abs(scaled)
    floor = ((a >= 0.5) * F32(0.5) + (a >= 1) * F32(0.5) + (a >= 2) * F32(1) + (a >= 3) * F32(1) + (a >= 4) * F32(1)
             + (a >= 6) * F32(2)).astype(F32)
    ceil = (F32(0.5) + (a > 0.5) * F32(0.5) + (a > 1) * F32(1) + (a > 2) * F32(1) + (a > 3) * F32(1)
            + (a > 4) * F32(2)).astype(F32)
    frac = ((a - floor) / (ceil - floor)).astype(F32)
    return np.where(frac >= u, ceil, floor).astype(F32)


def reference_nvfp4(x: torch.Tensor, tile_rows: int, u: np.ndarray | None = None):
    """(codes (rows, K) uint8, block scales float32 (E4M3 values), amax) as TE's reference computes them; with
    `u`, stochastic rounding (a value that rounds to zero keeps the sign of a negative input, code 8, as the
    table gives x in [-0.25, 0))."""
    v = x.float().numpy().astype(F32)
    rows, cols = v.shape
    with np.errstate(all="ignore"):
        amax = F32(np.max(np.abs(v)))
        s_enc = np.minimum(F32(448.0 * 6.0) / amax, F32_MAX).astype(F32)
        s_enc = F32(1.0) if s_enc == 0 else s_enc
        s_dec = F32(F32(1.0) / s_enc)
        blocks = v.reshape(rows // tile_rows, tile_rows, cols // 16, 16)
        vec_max = np.max(np.abs(blocks), axis=(1, 3)).astype(F32)
        multiplier = F32(s_enc * (F32(1.0) / F32(6.0)))
        decode = np.clip(np.minimum(vec_max * multiplier, F32_MAX), -448.0, 448.0).astype(F32)
        decode = e4m3_round(decode)
        encode = np.minimum(F32(1.0) / (decode * s_dec), F32_MAX).astype(F32)
        scaled = (blocks * encode[:, None, :, None]).astype(F32).reshape(rows, cols)
        if u is None:
            codes = te_fp4_codes(np.clip(scaled, -6.0, 6.0))
        else:
            magnitude = np.clip(te_stochastic(scaled, u), 0.0, 6.0)
            codes = te_fp4_codes(magnitude) | ((scaled < 0) << 3).astype(np.uint8)
            codes[np.isnan(scaled)] = 0
    return codes, decode, amax


def unpacked(codes: torch.Tensor) -> np.ndarray:
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).numpy()


CASES = [pytest.param(dtype, rows, id=f"{str(dtype)[6:]}-{rows}x16")
         for dtype in (torch.bfloat16, torch.float32) for rows in (1, 16)]


# ---- the quantizer ----


@pytest.mark.parametrize("dtype,tile_rows", CASES)
def test_quantizer_matches_te_reference_bit_for_bit(dtype, tile_rows):
    x = adversarial(dtype)
    q = quantize_nvfp4(x, (tile_rows, 16))
    codes, scales, amax = reference_nvfp4(x, tile_rows)
    assert np.array_equal(unpacked(q.codes), codes)
    assert np.array_equal(q.block_scale.float().numpy(), scales)
    assert q.amax.item() == amax
    # the adversarial rows reach what they were made for: every E2M1 code (1x16 blocks), subnormal and zero scales
    assert tile_rows == 16 or set(np.unique(codes)) == set(range(16))
    assert (scales == 0).any() and ((scales > 0) & (scales < 2.0**-6)).any()


@pytest.mark.parametrize("special", ["inf", "nan"])
def test_infinities_and_nan_follow_te_reference(special):
    x = adversarial(torch.float32)
    x[9, 5] = float(special)
    for tile_rows in (1, 16):
        q = quantize_nvfp4(x, (tile_rows, 16))
        codes, scales, amax = reference_nvfp4(x, tile_rows)
        assert np.array_equal(unpacked(q.codes), codes)
        assert np.array_equal(q.block_scale.float().numpy(), scales, equal_nan=True)
        assert np.array_equal(q.amax.numpy(), amax, equal_nan=True)


# ---- the Triton kernel (CUDA's quantizer; here in Triton's CPU interpreter) ----


@pytest.mark.parametrize("hadamard", [False, True], ids=["", "hadamard"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("tile_rows", [1, 16])
def test_triton_kernel_writes_the_reference_bytes(tile_rows, stochastic, hadamard):
    """recipes.fp8.nvfp4_kernels.quantize (the quantizer on CUDA) against quantize_nvfp4 byte for byte
    (nvfp4_checks.check_kernel_bytes; on a GPU in tests/test_gpu.py)."""
    pytest.importorskip("triton")
    check_kernel_bytes("cpu", tile_rows, stochastic, hadamard)


def test_triton_hadamard_kernel_is_the_reference_transform_bit_for_bit():
    """recipes.fp8.nvfp4_kernels.hadamard_transform against random_hadamard_transform, bit for bit, and its amax
    (nvfp4_checks.check_hadamard_kernel; on a GPU in tests/test_gpu.py)."""
    pytest.importorskip("triton")
    check_hadamard_kernel("cpu")


def test_triton_kernel_decodes_the_emulated_gemms_exact_bf16_inputs():
    """recipes.fp8.nvfp4_kernels.block_scaled_bf16 (the emulated GEMM's input on CUDA) equals Float8Tensor's
    block_scaled() in BF16 (nvfp4_checks.check_decode_kernel; on a GPU in tests/test_gpu.py)."""
    pytest.importorskip("triton")
    check_decode_kernel("cpu")


NVFP4_HOPPER_COMPILE = r"""
import sys
from pathlib import Path
from hopper_compile import compile_for_hopper
from recipes.fp8 import nvfp4_kernels as k
from recipes.fp8.nvfp4 import RHT_SIGNS

quantize = {"x": "*bf16", "amax": "*fp32", "seed": "*i64", "codes": "*u8", "scales": "*u8", "decode_out": "*fp32",
            "rows": "i32", "cols": "i32", "operand": "i32"}
decode = {"codes": "*u8", "scales": "*u8", "out": "*bf16", "rows": "i32", "cols": "i32"}
hadamard = {"x": "*bf16", "out": "*bf16", "amax_bits": "*i32", "rows": "i32", "cols": "i32"}
tile = dict(TILE_R=k.TILE_R, TILE_C=k.TILE_C)
constants = dict(NEGATIVE=k.negative_bits(RHT_SIGNS), TO_BF16=True, SOFTWARE=False, **tile)
_, spilled, registers = compile_for_hopper(k._hadamard_kernel, hadamard, constants, Path(sys.argv[1]))
print("_hadamard_kernel registers", registers, "spilled", spilled, flush=True)
assert spilled == 0, f"_hadamard_kernel spills {spilled} bytes"
for rows in (1, 16):
    runs = [(k._nvfp4_kernel, quantize, dict(BLOCK_ROWS=rows, STOCHASTIC=stochastic, **tile))
            for stochastic in (False, True)] + [(k._block_scaled_kernel, decode, dict(BLOCK_ROWS=rows, SOFTWARE=False, **tile))]
    for kernel, signature, constants in runs:
        _, spilled, registers = compile_for_hopper(kernel, signature, constants, Path(sys.argv[1]))
        print(kernel.__name__, constants, "registers", registers, "spilled", spilled, flush=True)
        assert spilled == 0, f"{kernel.__name__} {constants} spills {spilled} bytes"
"""


def test_triton_kernels_compile_for_hopper_without_spills(tmp_path):
    """The quantizer (both block shapes, with and without stochastic rounding) and the decoder, compiled for sm_90a
    by Triton's own ptxas (no GPU needed): they compile, the argument the hash reads is not specialized away, and
    no register is spilled."""
    pytest.importorskip("triton")
    from hopper_compile import run_compiled

    run_compiled(NVFP4_HOPPER_COMPILE, tmp_path)


def test_packing_puts_the_even_element_in_the_low_nibble():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 15] = 6.0, -1.0, 0.5  # S_enc = 448, block scale 448: encode exactly 1 / 1
    q = quantize_nvfp4(x, (1, 16))
    assert q.codes[0, 0].item() == 0x7 | (0xA << 4) and q.codes[0, 7].item() == 0x1 << 4


@pytest.mark.parametrize("tile_rows", [1, 16])
def test_the_gemm_operand_is_exact_and_dequantizes_within_half_an_e2m1_step(tile_rows):
    """The GEMM operand: the packed codes, the E4M3 block scales and 1 / S_enc, as cuBLAS's NVFP4 GEMM reads them;
    its values times their block scales exact in BF16 (what the emulated GEMM multiplies; checked in float64 against
    the codes and scales); each element within half the widest E2M1 step (4 -> 6: one unit of its block, block
    scale / S_enc) of the input."""
    x = adversarial(torch.float32)
    q = quantize_nvfp4(x, (tile_rows, 16))
    operand = q.as_operand()
    scales = q.block_scale.double().repeat_interleave(tile_rows, 0).repeat_interleave(16, 1)
    assert operand.is_fp4 and operand.block == (tile_rows, 16)
    assert torch.equal(operand.data, q.codes) and torch.equal(operand.scale_inv.view(torch.uint8),
                                                              q.block_scale.view(torch.uint8))
    assert torch.equal(operand.block_scaled().bfloat16().double(), q.values().double() * scales)
    decode = 1.0 / (448.0 * 6.0 / q.amax.double())
    assert operand.tensor_scale_inv.dim() == 0
    assert abs(operand.tensor_scale_inv.double() - decode) <= 2.0**-23 * decode
    normal = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))  # no block scale under- or overflows
    q = quantize_nvfp4(normal, (tile_rows, 16))
    operand = q.as_operand()
    scales = q.block_scale.double().repeat_interleave(tile_rows, 0).repeat_interleave(16, 1)
    error = (operand.dequantize().double() - normal.double()).abs()
    assert (error <= scales * operand.tensor_scale_inv.double() * (1 + 2.0**-20)).all()


def test_a_16x16_operand_transposes_to_the_quantization_of_the_transpose():
    """dgrad's weight: the 16 x 16-block operand's codes moved (unpacked, transposed, packed again) and its scale
    grid transposed are exactly the quantization of W^T, as TE's 2D weights reuse their quantization."""
    w = adversarial(torch.float32)
    transposed = quantize_nvfp4(w, (16, 16)).as_operand().transpose()
    direct = quantize_nvfp4(w.t().contiguous(), (16, 16)).as_operand()
    assert torch.equal(transposed.data, direct.data)
    assert torch.equal(transposed.scale_inv.view(torch.uint8), direct.scale_inv.view(torch.uint8))
    assert torch.equal(transposed.tensor_scale_inv, direct.tensor_scale_inv)
    with pytest.raises(ValueError, match="quantized again"):
        quantize_nvfp4(w, (1, 16)).as_operand().transpose()


# ---- the native GEMM's arguments (cuBLAS's NVFP4 GEMM on Blackwell; no Blackwell here) ----


def cublas_scale_offset(row: int, col: int, cols: int) -> int:
    """Where cuBLAS's block-scaling layout keeps the scale of (row, col) of a (rows, cols) scale matrix (CUDA docs,
    "1D block scaling factors layout"): 128 x 4 tiles in row-major order of tiles, 512 bytes each, the tile's row r
    at (r % 32) * 16 + (r // 32) * 4 and its columns adjacent."""
    col_tiles = -(-cols // 4)
    return (row // 128) * col_tiles * 512 + (col // 4) * 512 + (row % 32) * 16 + (row % 128) // 32 * 4 + col % 4


def reference_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                        swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
                        use_fast_accum=False):
    """What cuBLAS's two-level NVFP4 GEMM computes from scaled_mm's arguments, decoded by the documented layouts
    alone, in float64: E2M1 pairs low nibble first, block scales at cublas_scale_offset, the tensor scales last."""
    assert scale_recipe_a == scale_recipe_b == [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    assert swizzle_a == swizzle_b == [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    table = torch.cat([table, -table])

    def decode(packed, scales):
        packed = packed.view(torch.uint8)
        rows, half_k = packed.shape
        values = table[torch.stack((packed & 0xF, packed >> 4), dim=-1).long()].view(rows, 2 * half_k)
        blocks = half_k * 2 // 16
        flat = scales[0].view(torch.uint8)
        index = torch.tensor([[cublas_scale_offset(r, c, blocks) for c in range(blocks)] for r in range(rows)])
        block_scale = flat[index].view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
        return values * block_scale * scales[1].double()

    return (decode(mat_a, scale_a) @ decode(mat_b.t(), scale_b).t()).to(output_dtype)


NATIVE_GEMMS = {  # (rows of a, its block rows), (rows of b, its block rows): the linear's three GEMMs, K = 96
    "fprop": ((48, 1), (80, 16)),
    "dgrad": ((48, 1), (80, 16)),  # the weight's transpose: the same 16 x 16 quantization, moved
    "wgrad": ((80, 1), (144, 1)),
}


def native_operands(gemm: str):
    (rows_a, block_a), (rows_b, block_b) = NATIVE_GEMMS[gemm]
    g = torch.Generator().manual_seed(len(gemm))
    a = quantize_nvfp4(torch.randn(rows_a, 96, generator=g), (block_a, 16)).as_operand()
    if gemm == "dgrad":
        return a, quantize_nvfp4(torch.randn(96, rows_b, generator=g), (16, 16)).as_operand().transpose()
    return a, quantize_nvfp4(torch.randn(rows_b, 96, generator=g) * 300, (block_b, 16)).as_operand()


@pytest.mark.parametrize("gemm", NATIVE_GEMMS)
def test_native_gemm_arguments_decode_to_the_emulated_gemm(gemm, monkeypatch):
    """The arguments the torch engine hands cuBLAS's NVFP4 GEMM on Blackwell (packed codes, block scales swizzled
    and a 16 x 16 block's scale repeated over its rows, tensor scales), decoded by the documented layouts alone,
    multiply to the emulated GEMM's result: the same operands. The GEMM itself cannot run here (no Blackwell)."""
    from recipes.fp8 import gemm as gemm_module

    a, b = native_operands(gemm)
    monkeypatch.setattr(F, "scaled_mm", reference_scaled_mm)
    native = gemm_module.native_nvfp4_gemm(a, b, torch.float32).double()
    emulated = gemm_module.emulated_nvfp4_gemm(a, b, torch.float32).double()
    exact = a.dequantize().double() @ b.dequantize().double().t()
    for result in (native, emulated):  # FP32 outputs (and the emulation's FP32 sums); a misplaced scale is O(1)
        torch.testing.assert_close(result, exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())


@pytest.mark.parametrize("gemm", NATIVE_GEMMS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_native_gemm_arguments_pass_pytorchs_own_checks(gemm, out_dtype):
    """PyTorch's shape, type and layout rules for its NVFP4 scaled_mm, run on the meta device (what a Blackwell
    GPU would be handed), accept every GEMM of the linear, rows not a multiple of 128 included; the probe the plan
    asks says so for this PyTorch, and a wrong argument is refused by the same rules."""
    from recipes.fp8.gemm import native_nvfp4_gemm, nvfp4_gemm_available

    def on_meta(operand):
        return operand._replace(**{field: getattr(operand, field).to("meta")
                                   for field in ("data", "scale_inv", "tensor_scale_inv")})

    a, b = (on_meta(operand) for operand in native_operands(gemm))
    out = native_nvfp4_gemm(a, b, out_dtype)
    assert out.shape == (a.data.shape[0], b.data.shape[0]) and out.dtype == out_dtype
    assert nvfp4_gemm_available()
    with pytest.raises(RuntimeError, match="NV scaling"):
        native_nvfp4_gemm(a._replace(scale_inv=torch.empty(a.scale_inv.shape[0], 9, dtype=E4M3, device="meta")),
                          b, out_dtype)


def test_native_scale_layout_is_torchaos_to_blocked():
    """The swizzled block scales equal torchao's to_blocked (its NVFP4 GEMM's layout) of the per-row scales."""
    to_blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked
    from recipes.fp8.gemm import native_nvfp4_scale

    g = torch.Generator().manual_seed(0)
    for rows, block_rows in ((48, 1), (144, 1), (160, 16)):
        operand = quantize_nvfp4(torch.randn(rows, 96, generator=g), (block_rows, 16)).as_operand()
        per_row = operand.scale_inv.view(torch.uint8).repeat_interleave(block_rows, dim=0)
        assert torch.equal(native_nvfp4_scale(operand).view(torch.uint8), to_blocked(per_row))


# ---- stochastic rounding and its random numbers ----


def test_stochastic_rounding_matches_te_rule_given_the_same_numbers():
    x = adversarial(torch.float32)
    seed = torch.tensor([7, 3, 11])
    u = uniform(seed, 1, x.shape)
    q = quantize_nvfp4(x, (1, 16), u)
    codes, scales, _ = reference_nvfp4(x, 1, u.numpy())
    assert np.array_equal(unpacked(q.codes), codes)
    assert np.array_equal(q.block_scale.float().numpy(), scales)
    assert not np.array_equal(codes, reference_nvfp4(x, 1)[0])  # it did round differently from nearest


def test_stochastic_rounding_is_unbiased():
    """Over 4000 draws each value's mean rounding is the value: within 4 standard errors of a two-point choice
    (step <= 2 units, so sd <= 1 unit / draw)."""
    x = torch.linspace(-5.9, 5.9, 64).view(4, 16)
    x[:, 0] = 6.0  # every block's amax 6: block scale 1, encode 1 (S_enc = 448)
    x[0, 0] = 448.0 * 6.0 / 448.0
    draws = 4000
    total = torch.zeros_like(x)
    for draw in range(draws):
        q = quantize_nvfp4(x, (1, 16), uniform(torch.tensor([0, 0, draw]), 0, x.shape))
        total += q.as_operand().dequantize()
    assert ((total / draws - x).abs() <= 4 / draws**0.5).all()


def test_uniform_numbers_are_reproducible_distinct_and_uniform():
    shape = torch.Size([256, 256])
    u = uniform(torch.tensor([1234, 5, 9]), 0, shape)
    assert torch.equal(u, uniform(torch.tensor([1234, 5, 9]), 0, shape))
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    for other in (([1234, 5, 10], 0), ([1234, 6, 9], 0), ([1235, 5, 9], 0), ([1234, 5, 9], 1)):
        assert (uniform(torch.tensor(other[0]), other[1], shape) != u).float().mean() > 0.99
    counts = torch.histc(u, bins=16, min=0, max=1)  # 4096 expected per bin, sd 62
    assert ((counts - 4096).abs() < 6 * 62).all()
    assert abs(u.mean().item() - 0.5) < 6 * (1 / 12 / u.numel()) ** 0.5


# ---- the random Hadamard transform ----


def test_hadamard_matrix_is_te_signs_times_sylvester_and_orthogonal():
    h = hadamard_matrix()
    sylvester = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)],
                             dtype=torch.float64)
    assert torch.equal(h, torch.tensor(RHT_SIGNS, dtype=torch.float64)[:, None] * sylvester / 4)
    assert torch.equal(h @ h.t(), torch.eye(16, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hadamard_transform_is_exact_then_rounded_once(dtype):
    x = adversarial(dtype)[:, :64]
    expected = (x.double().view(-1, 16) @ hadamard_matrix()).view(x.shape).to(dtype)
    assert torch.equal(random_hadamard_transform(x), expected)
    # both operands of the weight gradient transformed: the product is unchanged
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(4, 64, dtype=torch.float64)
    ha = (a.view(-1, 16) @ hadamard_matrix()).view(a.shape)
    hb = (b.view(-1, 16) @ hadamard_matrix()).view(b.shape)
    torch.testing.assert_close(ha @ hb.t(), a @ b.t(), rtol=1e-12, atol=1e-12)


# ---- the recipe in a linear layer ----


def nvfp4_precision(**changes):
    return dataclasses.replace(load_option("precision", "nvfp4"), emulate=True, **changes)


def operand(t: torch.Tensor, rows: int, hadamard: bool = False, seed=None, which: int = 0) -> torch.Tensor:
    """The operand the recipe's op makes, dequantized in float64."""
    codes, block_scale, tensor_scale_inv = quantize_nvfp4_op(t, rows, hadamard, seed, which, False)
    return Float8Tensor(codes, block_scale, (rows, 16), tensor_scale_inv).dequantize().double()


def test_linear_runs_te_recipe_operand_by_operand():
    """The three GEMMs of an NVFP4 linear equal FP64 products of the operands TE's recipe quantizes (up to FP32
    accumulation): weights in 16x16 blocks (their transpose the same bytes), the input and gradient in 1x16 blocks,
    the weight gradient's two operands Hadamard-transformed along the tokens, gradients rounded with the layer's
    seed (draw 0 for dgrad's operand, 1 for wgrad's). A recipe without its Hadamard transform gives another weight
    gradient."""
    torch.manual_seed(0)
    recipe = recipe_from_config(nvfp4_precision())
    assert recipe == Nvfp4Scaling(E4M3, E4M3, emulate=True, fused_kernels=True)
    layer = Fp8Linear(torch.nn.Linear(64, 48, bias=False), recipe)
    layer.rounding_seed.copy_(torch.tensor([5, 1, 2]))
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    y = layer(x)
    y.backward(dy)
    w = layer.weight.detach()
    seed = layer.rounding_seed
    expected_y = operand(x.detach(), 1) @ operand(w, 16).t()
    expected_dw = operand(dy.t(), 1, True, seed, 1) @ operand(x.detach().t(), 1, True).t()
    for got, expected in ((y, expected_y), (x.grad, operand(dy, 1, seed=seed) @ operand(w, 16)),
                          (layer.weight.grad, expected_dw)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    no_hadamard = operand(dy.t(), 1, False, seed, 1) @ operand(x.detach().t(), 1, False).t()
    assert (layer.weight.grad.double() - no_hadamard).abs().max() > 1e-3 * no_hadamard.abs().max()


def gradients(layer: Fp8Linear, training: Fp8Training, step: int) -> torch.Tensor:
    layer.weight.grad = None
    training.micro_batch(layer, 0, step)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    layer(x).square().sum().backward()
    return layer.weight.grad.clone()


def test_rounding_draws_follow_the_step_so_a_resume_draws_the_same():
    precision = nvfp4_precision()
    model = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))])
    training = Fp8Training(precision, micro_batches=2, seed=99)
    torch.manual_seed(0)
    assert convert_to_fp8(model, dataclasses.replace(precision, num_layers_at_end_in_bf16=0)) == 1
    layer = model[0][0]
    from recipes.fp8.training import seed_rounding
    seed_rounding(model, 99)
    first = gradients(layer, training, step=3)
    assert layer.rounding_seed.tolist() == [99, 0, 6]  # step 3 x 2 micro-batches + micro-batch 0
    assert torch.equal(gradients(layer, training, step=3), first)  # as a resumed run recomputes step 3
    assert not torch.equal(gradients(layer, training, step=4), first)
    deterministic = Fp8Linear(torch.nn.Linear(64, 48, bias=False), recipe_from_config(
        nvfp4_precision(disable_stochastic_rounding=True)))
    assert deterministic.rounding_seed is None and deterministic.state_tensors() == ()


def test_nvfp4_knobs_switch_the_parts_and_are_refused_elsewhere():
    recipe = recipe_from_config(nvfp4_precision(disable_rht=True, disable_2d_quantization=True))
    assert (recipe.hadamard, recipe.weight_2d, recipe.stochastic_rounding) == (False, False, True)
    assert recipe.block(1) == (1, 16) and not recipe.transpose_reuses_quantization(1)
    with pytest.raises(ConfigError, match=r"precision.disable_rht=true is NVFP4's .* use precision=nvfp4"):
        recipe_from_config(dataclasses.replace(load_option("precision", "fp8_current"), disable_rht=True))


# ---- training, planning, the other engines ----


def test_a_tiny_transformer_trains_in_nvfp4():
    """Overfitting one batch: the loss falls below a third of its start in 12 steps, and NVFP4 changed the numbers
    (a silent BF16 fallback would reproduce BF16's losses exactly)."""
    cfg = dataclasses.replace(load_option("model", "tiny_llama"), num_layers=2, hidden_size=128, ffn_hidden_size=256,
                              num_attention_heads=2, num_query_groups=2, kv_channels=64, seq_length=64,
                              vocab_size=256, init_std=0.1)
    torch.manual_seed(0)
    base = Transformer(cfg)
    base.init_weights(torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab_size, (1, cfg.seq_length), generator=g)
    targets = torch.randint(cfg.vocab_size, (1, cfg.seq_length), generator=g)

    def losses(model):
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        out = []
        for _ in range(12):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), targets.view(-1))
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    bf16 = losses(copy.deepcopy(base))
    model = copy.deepcopy(base)
    assert convert_to_fp8(model.layers, nvfp4_precision(num_layers_at_end_in_bf16=0)) == 2 * 4
    from recipes.fp8.training import seed_rounding
    seed_rounding(model, 1)
    fp4 = losses(model)
    assert fp4[-1] < fp4[0] / 3, fp4
    assert fp4[0] != bf16[0] and abs(fp4[0] - bf16[0]) < 0.05 * bf16[0]


def test_plan_runs_nvfp4_natively_on_blackwell_and_emulated_elsewhere(hydra_compose, monkeypatch):
    from recipes.plan.checks import validate

    base = ("model=llama3_8b", "model.num_layers=8", "precision=nvfp4", "dryrun=true")
    validate(hydra_compose(*base, "gpu=h200", "precision.emulate=true"))
    validate(hydra_compose(*base, "gpu=b200", "engine=megatron"))
    validate(hydra_compose(*base, "gpu=b200"))  # the torch engine: PyTorch's NVFP4 scaled_mm (cuBLAS)
    refused = {
        ("gpu=h200",): "runs natively only on Blackwell GPUs .*; gpu=h200 is hopper. Set precision.emulate=true",
        ("gpu=b200", "precision.emulate=true"): "runs natively on gpu=b200: nothing would be emulated",
        ("gpu=h200", "engine=megatron"): r"runs natively only on Blackwell GPUs .* \(engine=megatron cannot emulate\)",
        ("gpu=b200", "engine=megatron", "precision.emulate=true"): "precision.emulate=true is the torch engine's",
        ("gpu=b200", "engine=nemo"): "this project maps no NVFP4 plugin",
        ("gpu=h200", "precision=fp8_current", "precision.disable_rht=true"): "is NVFP4's",
    }
    for overrides, message in refused.items():
        with pytest.raises(ConfigError, match=message) as error:
            validate(hydra_compose(*base, *overrides))
        assert "\n" not in str(error.value)
    # A job for this machine with a PyTorch whose scaled_mm has no NVFP4 (before 2.10): refused before it starts.
    from recipes.fp8 import training

    monkeypatch.setattr(training, "nvfp4_gemm_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # as on a one-GPU Blackwell machine
    here = hydra_compose("model=llama3_8b", "model.num_layers=8", "precision=nvfp4", "gpu=b200")
    with pytest.raises(ConfigError, match=r"this PyTorch \(.*\) has no NVFP4 GEMM"):
        validate(here)
    validate(dataclasses.replace(here, dryrun=True))  # a dry run for another machine leaves it to that machine


def test_engine_megatron_gets_te_nvfp4_recipe_with_the_run_parts(hydra_compose, monkeypatch):
    translate = pytest.importorskip("recipes.megatron.translate")
    from megatron.core import fp4_utils

    from recipes.megatron import te_recipe

    cfg = hydra_compose("engine=megatron", "gpu=b200", "model=llama3_8b", "model.num_layers=8", "precision=nvfp4",
                        "precision.disable_stochastic_rounding=true", "dryrun=true")
    assert translate.fp8_fields(cfg) == dict(fp4="e2m1", fp4_recipe="nvfp4", fp4_param=False,
                                             first_last_layers_bf16=True, num_layers_at_start_in_bf16=0,
                                             num_layers_at_end_in_bf16=4)
    kernels = translate.Kernels(transformer_engine=False, wgrad_accumulation=True, apex_softmax=False,
                                graphs_take_fp8_weights=False)
    built = translate.transformer_config(cfg, kernels)  # megatron-core's own checks of the FP4 fields
    assert (built.fp4, built.fp8, built.num_layers_at_end_in_bf16) == ("e2m1", None, 4)

    @dataclasses.dataclass
    class Nvfp4Stand:  # TE's NVFP4BlockScaling's three knobs, and its recipe-type test
        disable_rht: bool = False
        disable_stochastic_rounding: bool = False
        disable_2d_quantization: bool = True  # as if TE's environment variable had switched it off

        @classmethod
        def nvfp4(cls):
            return True

    megatron_core = lambda config: Nvfp4Stand()  # noqa: E731
    monkeypatch.setattr(fp4_utils, "get_fp4_recipe", megatron_core)  # as megatron-core's FP4 context looks it up
    te_recipe.install_nvfp4_parts(cfg.precision.nvfp4_parts_disabled)
    assert fp4_utils.get_fp4_recipe(None) == Nvfp4Stand(disable_stochastic_rounding=True, disable_2d_quantization=False)
    te_recipe.install_nvfp4_parts([])  # a second model in the process: its own knobs, not wrapped twice
    assert fp4_utils.get_fp4_recipe(None) == Nvfp4Stand(disable_2d_quantization=False)
    assert fp4_utils.get_fp4_recipe.megatron_core is megatron_core
