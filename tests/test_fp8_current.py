"""Per-tensor current scaling FP8 (recipes/fp8), checked against independent float64 references.

Notation: u = 2**-24 is the FP32 unit roundoff; an FP8 format with m explicit mantissa bits rounds a value t in its
normal range to within half an ulp, which is <= 2**-(m+1) * |t| (ulp(t) = 2**(floor(log2|t|) - m) <= 2**-m * |t|),
and >= 2**-(m+2) * |t|. In the subnormal range the step is constant (E4M3: 2**-9, E5M2: 2**-16), so the error is
<= half that step. The formats' constants below are taken from the OCP FP8 spec, not from torch.finfo.

Every bound is stated next to its assertion, with its derivation.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recipes.config import ConfigError, Fp8Format, ModelConfig, PrecisionConfig, Recipe
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.current_scaling import Float8Tensor, quantize_tensorwise, tensorwise_scale
from recipes.fp8.formats import E4M3, E5M2, forward_and_backward_dtypes
from recipes.fp8.linear import BlockwiseScaling, TensorwiseScaling, DelayedScaling, MXFP8Scaling, Fp8Linear, fp8_linear, recipe_from_config
from recipes.models.transformer import Transformer

U = 2.0**-24  # FP32 unit roundoff
U_BF16 = 2.0**-8  # BF16 unit roundoff (8 significant bits)

# OCP FP8: largest finite value, explicit mantissa bits, smallest normal, subnormal step.
SPEC = {
    E4M3: dict(max=448.0, m=3, min_normal=2.0**-6, sub_step=2.0**-9),
    E5M2: dict(max=57344.0, m=2, min_normal=2.0**-14, sub_step=2.0**-16),
}
FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """All finite values of an FP8 format, sorted, in float64: decoded from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    return torch.unique(values[torch.isfinite(values)])  # +0 and -0 collapse; NaN / inf dropped


def ref_round_candidates(t: torch.Tensor, dtype: torch.dtype, tie_tol: float):
    """Float64 round-to-nearest onto the FP8 grid, saturating at +-max (the cast the recipe asks for).

    Returns (nearest, other, ambiguous): where |t| lies within tie_tol*|t| of the midpoint of its two neighbours,
    either neighbour is accepted (`other` is the second one).
    """
    grid = fp8_grid(dtype)
    t = t.clamp(grid[0].item(), grid[-1].item())
    hi_idx = torch.searchsorted(grid, t).clamp(max=grid.numel() - 1)
    lo_idx = (hi_idx - 1).clamp(min=0)
    lo, hi = grid[lo_idx], grid[hi_idx]
    nearest = torch.where((t - lo).abs() <= (hi - t).abs(), lo, hi)
    other = torch.where(nearest == lo, hi, lo)
    ambiguous = (t - (lo + hi) / 2).abs() <= tie_tol * t.abs()
    return nearest, other, ambiguous


def ref_scale(amax: float, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2**margin in float64, rounded once to FP32. (Rounding the exact quotient to float64 and
    then to FP32 equals the correctly rounded FP32 division: 53 >= 2*24 + 2, so double rounding is innocuous.)"""
    return torch.tensor(fp8_max / amax / 2.0**margin, dtype=torch.float64).float()


def wide_range_tensor(shape, magnitude: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values times 2**U(-34, 0): spans the normal range, the subnormal range and flush-to-zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * 2.0 ** (-34 * torch.rand(shape, generator=g, dtype=torch.float64)) * magnitude
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# 1. Quantization
# ---------------------------------------------------------------------------------------------------------------


def test_fp8_grid_matches_ocp_spec():
    # The reference grid decoded from torch's bit patterns must agree with the spec constants used below.
    for dtype, spec in SPEC.items():
        grid = fp8_grid(dtype)
        assert grid[-1].item() == spec["max"] and grid[0].item() == -spec["max"]
        positive = grid[grid > 0]
        assert positive[0].item() == spec["sub_step"]  # smallest subnormal
        assert (positive < spec["min_normal"]).sum().item() == 2 ** spec["m"] - 1  # 2**m - 1 subnormals
    assert fp8_grid(E4M3).numel() == 253  # 256 codes - 2 NaN - one duplicate zero
    assert fp8_grid(E5M2).numel() == 247  # 256 codes - 6 NaN - 2 inf - one duplicate zero


@pytest.mark.parametrize("dtype", FORMATS)
def test_scale_is_correctly_rounded(dtype):
    # scale == fl32(fp8_max / amax) bitwise, as Transformer Engine computes it, for 2000 random amax values over
    # 1e-3 .. 1e4 (ref_scale: float64 quotient rounded once to FP32, equal to the correctly rounded FP32 division).
    g = torch.Generator().manual_seed(21)
    amaxes = (10.0 ** (7 * torch.rand(2000, generator=g, dtype=torch.float64) - 3)).float()
    got = torch.stack([tensorwise_scale(a, dtype) for a in amaxes])
    expected = torch.stack([ref_scale(a.item(), SPEC[dtype]["max"]) for a in amaxes])
    mismatches = (got != expected).sum().item()
    assert mismatches == 0, f"{mismatches}/2000 scales are not the correctly rounded FP32 quotient"


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("magnitude", [1e-3, 1e-1, 1.0, 1e2, 1e4])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_scale_rounding_and_bounds(dtype, magnitude, in_dtype):
    spec = SPEC[dtype]
    x = wide_range_tensor((48, 80), magnitude, in_dtype, seed=int(magnitude * 1000) % 9973 + 7)
    x64 = x.double()
    amax = x64.abs().max().item()
    q = quantize_tensorwise(x, dtype)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.dim() == 0

    # Scale: fp8_max / amax in FP32. The exact (correctly rounded) check is test_scale_is_correctly_rounded
    # below; here within 2u relative (two FP32 roundings, which is what `python_float / tensor` does: it computes
    # reciprocal(amax) * fp8_max). scale_inv is the FP32 reciprocal of the scale used, bitwise.
    scale = tensorwise_scale(x.abs().amax(), dtype)
    expected = ref_scale(amax, spec["max"]).double()
    assert abs(scale.double() - expected).item() <= 2 * U * expected.item()
    assert torch.equal(q.scale_inv, scale.reciprocal())

    data = q.data.double()
    assert torch.isfinite(data).all() and data.abs().max().item() <= spec["max"]

    # Round to nearest, exactly: the quantized value is the grid point nearest to t = x * scale (exact in float64,
    # a 24-bit by 24-bit product). The code rounds fl32(x * scale), which is within u*|t| of t, so where t lies
    # within 2u*|t| of a midpoint (u for that rounding, doubled for safety) either neighbour is accepted
    # (this also accepts either choice at exact ties).
    t = x64 * scale.double()
    nearest, other, ambiguous = ref_round_candidates(t, dtype, tie_tol=2 * U)
    ok = (data == nearest) | (ambiguous & (data == other))
    assert ok.all(), f"{(~ok).sum().item()} elements not rounded to nearest, e.g. t={t[~ok][:4].tolist()}"

    # The element with |x| = amax maps to exactly +-fp8_max, with its sign.
    at_max = x64.abs() == amax
    assert torch.equal(data[at_max], torch.sign(x64[at_max]) * spec["max"])

    # Dequantized error. Three FP32 roundings besides the FP8 one (x*scale, 1/scale, data*scale_inv), each <= u
    # relative, give the slack 4u*|x|.
    #   normal range (|t| >= min_normal):  |deq - x| <= 2**-(m+1) * |x| + 4u*|x|
    #   subnormal range:                    |deq - x| <= sub_step/2 * scale_inv * (1 + 4u) + 4u*|x|
    deq = q.dequantize().double()
    err = (deq - x64).abs()
    normal = t.abs() >= spec["min_normal"]
    bound_normal = (2.0 ** -(spec["m"] + 1) + 4 * U) * x64.abs()
    bound_sub = spec["sub_step"] / 2 * q.scale_inv.double() * (1 + 4 * U) + 4 * U * x64.abs()
    assert (err[normal] <= bound_normal[normal]).all(), (err / x64.abs())[normal].max().item()
    assert (err[~normal] <= bound_sub[~normal]).all()
    # Both ranges are exercised (the data spans 34 binades below amax; E5M2 subnormals start 29.8 below).
    assert normal.sum() > 100 and (~normal).sum() > 100
    assert ((t.abs() < spec["min_normal"]) & (data != 0)).sum() > 0  # some subnormals are kept, not flushed


# ---------------------------------------------------------------------------------------------------------------
# 2. Edge cases
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_zero_tensor(dtype, in_dtype):
    x = torch.zeros(16, 32, dtype=in_dtype)
    q = quantize_tensorwise(x, dtype)
    assert q.scale_inv.item() == 1.0  # scale 1 by definition for amax == 0
    assert tensorwise_scale(torch.tensor(0.0), dtype).item() == 1.0
    assert (q.data.float() == 0).all()
    deq = q.dequantize()
    assert not torch.isnan(deq).any() and (deq == 0).all()


@pytest.mark.parametrize("dtype", FORMATS)
def test_one_huge_outlier(dtype):
    spec = SPEC[dtype]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4096, generator=g) * 1e-3
    x[1234] = -1e4
    q = quantize_tensorwise(x, dtype)
    data, deq, x64 = q.data.double(), q.dequantize().double(), x.double()
    assert torch.isfinite(data).all() and torch.isfinite(deq).all()
    assert data[1234].item() == -spec["max"]  # the outlier maps to exactly -fp8_max
    assert abs(deq[1234].item() - (-1e4)) <= 4 * U * 1e4  # and comes back within the FP32 slack
    t = x64 * (spec["max"] / 1e4)
    small = torch.arange(4096) != 1234
    # Small values: normal-range ones within 2**-(m+1) relative, subnormal ones within half a subnormal step
    # times scale_inv (same slack as in test 1), values below half the smallest subnormal flush to exactly zero
    # (round to nearest; at the exact tie, to the even code 0).
    normal = small & (t.abs() >= spec["min_normal"])
    sub = small & ~normal
    err = (deq - x64).abs()
    assert (err[normal] <= (2.0 ** -(spec["m"] + 1) + 4 * U) * x64.abs()[normal]).all()
    assert (err[sub] <= spec["sub_step"] / 2 * q.scale_inv.item() * (1 + 4 * U) + 4 * U * x64.abs()[sub]).all()
    flushed = small & (t.abs() < spec["sub_step"] / 2 * (1 - 2 * U))
    assert (data[flushed] == 0).all()
    if dtype == E4M3:
        # E4M3: 1e-3 * 448/1e4 ~ 4.5e-5 << 2**-10: every small value flushes to zero.
        assert flushed.sum().item() > 4000
    else:
        # E5M2: 1e-3 * 57344/1e4 ~ 5.7e-3 > 2**-14: most small values stay normal (the range E5M2 is for).
        assert normal.sum().item() > 3500


def test_values_near_e4m3_subnormal_range():
    # amax = 448 gives scale exactly 1, so the quantized values are the OCP round-to-nearest-even results.
    s = 2.0**-9  # smallest subnormal
    cases = [  # (input, expected E4M3 value)
        (448.0, 448.0),
        (2.0**-6, 2.0**-6),  # smallest normal
        (2.0**-6 + 2.0**-10, 2.0**-6),  # tie between 2**-6 (even mantissa) and 2**-6 + 2**-9 -> even
        (7 * s, 7 * s),  # largest subnormal
        (-5 * s, -5 * s),
        (s, s),  # smallest subnormal
        (1.5 * s, 2 * s),  # tie between codes 1 and 2 -> even (2)
        (2.5 * s, 2 * s),  # tie between codes 2 and 3 -> even (2)
        (s / 2 * 1.01, s),  # just above half the smallest subnormal -> rounds up
        (s / 2, 0.0),  # tie between 0 and s -> even (0)
        (s / 2 * 0.99, 0.0),
        (2.0**-12, 0.0),
        (-(2.0**-12), 0.0),
    ]
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    expected = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    q = quantize_tensorwise(x, E4M3)
    assert q.scale_inv.item() == 1.0
    assert torch.equal(q.data.double(), expected), list(zip(x.tolist(), q.data.double().tolist()))
    assert torch.equal(q.dequantize().double(), expected)
    # And the subnormal absolute bound |deq - x| <= 2**-10 * scale_inv holds for the subnormal inputs.
    sub = x.double().abs() < 2.0**-6
    assert ((q.dequantize().double() - x.double()).abs()[sub] <= 2.0**-10).all()


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_finite_input_gives_nan_not_saturation(dtype, bad, in_dtype):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).to(in_dtype)
    x[3, 5] = bad
    q = quantize_tensorwise(x, dtype)
    assert torch.isnan(q.scale_inv)
    assert torch.isnan(q.data.double()).all()  # NaN scale poisons every element ...
    assert not (q.data.double().abs() == SPEC[dtype]["max"]).any()  # ... none is silently saturated to +-max
    assert torch.isnan(q.dequantize()).all()


@pytest.mark.parametrize("dtype", FORMATS)
def test_tiny_finite_amax_stays_finite(dtype):
    # A finite, tiny (but FP32-normal) tensor must quantize to finite values: the loop would otherwise stop on a
    # NaN that no tensor contained. 1e-37 < 448 / 3.4e38 = 1.3e-36 (E4M3) and < 57344 / 3.4e38 (E5M2).
    x = torch.tensor([1e-37, 0.0, -5e-38], dtype=torch.float32)
    q = quantize_tensorwise(x, dtype)
    assert torch.isfinite(q.scale_inv) and q.scale_inv.item() > 0
    assert torch.isfinite(q.dequantize()).all()
    assert q.dequantize()[1].item() == 0.0
    assert (q.dequantize().double() - x.double()).abs().max().item() <= 2.0 ** -(SPEC[dtype]["m"] + 1) * 1e-37


# ---------------------------------------------------------------------------------------------------------------
# 3. The three GEMMs of fp8_linear
# ---------------------------------------------------------------------------------------------------------------

M, K, N = 256, 192, 160  # tokens, in_features, out_features


def precision(fmt: Fp8Format = Fp8Format.hybrid, **kw) -> PrecisionConfig:
    return PrecisionConfig(name="fp8_current", recipe=Recipe.tensorwise, fp8_format=fmt, **kw)


def hybrid(**kw) -> TensorwiseScaling:
    return recipe_from_config(precision(Fp8Format.hybrid, **kw))


def all_e4m3(**kw) -> TensorwiseScaling:
    return recipe_from_config(precision(Fp8Format.e4m3, **kw))


@pytest.fixture(scope="module")
def operands():
    """x bf16 (activations), W fp32 (master weights, init-like scale), dy bf16 (upstream gradient)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g) * 0.02
    dy = (torch.randn(M, N, generator=g) * 1e-3).bfloat16()
    return x, w, dy


def run_linear(x, w, dy, recipe):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fp8_linear(x, w, recipe)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.fixture(scope="module")
def hybrid_run(operands):
    return run_linear(*operands, hybrid())


def deq64(q: Float8Tensor) -> torch.Tensor:
    return q.data.double() * q.scale_inv.double()


def rel_fro(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def test_recipe_from_config():
    r = hybrid()
    assert (r.forward_dtype, r.backward_dtype, r.fp8_wgrad) == (E4M3, E5M2, True)
    assert forward_and_backward_dtypes(Fp8Format.hybrid) == (E4M3, E5M2)
    r = all_e4m3(fp8_wgrad=False)
    assert (r.forward_dtype, r.backward_dtype, r.fp8_wgrad) == (E4M3, E4M3, False)
    # TE's Float8CurrentScaling has no margin (its scale is compute_scale_from_amax's fp8_max / amax): refused,
    # not ignored.
    with pytest.raises(ConfigError, match=r"precision\.margin=2 is delayed scaling's.*precision=fp8_delayed"):
        hybrid(margin=2)


def assert_gemm_exact(out, a64, b64, out_unit_roundoff):
    """out ~= a64 @ b64 (the dequantized FP8 operands, float64).

    Bound per element: |out - ref| <= u_out*|ref| + (1 + u_out) * (K + 3) * u * (|a| @ |b|).
    (K + 3)u: the FP8 x FP8 products are exact in FP32 (4 x 4 significant bits), K - 1 FP32 additions in any order
    (Higham's gamma_{K-1}), plus <= 3 FP32 roundings applying the two scales; then one rounding to the output
    dtype (u_out = 2**-8 for BF16, 2**-24 for FP32).
    """
    ref = a64 @ b64
    k = a64.shape[1]
    slack = (1 + out_unit_roundoff) * (k + 3) * U * (a64.abs() @ b64.abs())
    bound = out_unit_roundoff * ref.abs() + slack
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max err/bound = {(err / bound).max().item():.3g}"


def test_gemms_exact_given_quantization(operands, hybrid_run):
    # The operands are quantized here with quantize_tensorwise and the formats HYBRID must use, hard-coded
    # (x, W: E4M3; dy: E5M2), independently of linear.py. A swapped format or a BF16 GEMM changes the operands by
    # ~2**-4 relative, far above these bounds (~2**-8).
    x, w, dy = operands
    y, dx, dw = hybrid_run
    xq, wq, dyq = quantize_tensorwise(x, E4M3), quantize_tensorwise(w, E4M3), quantize_tensorwise(dy, E5M2)
    assert_gemm_exact(y, deq64(xq), deq64(wq).T, U_BF16)  # fprop   y  = x @ W^T   (BF16 out)
    assert_gemm_exact(dx, deq64(dyq), deq64(wq), U_BF16)  # dgrad   dx = dy @ W    (BF16 out)
    assert_gemm_exact(dw, deq64(dyq).T, deq64(xq), U)  # wgrad   dW = dy^T @ x  (FP32 out, tight)


# Expected relative Frobenius error of C = A @ B with both operands quantized, for random (Gaussian) data:
# each operand's rounding error e is ~uniform on +-half ulp, with half ulp in [2**-(m+2), 2**-(m+1)] * |a|, so the
# operand's rms relative error rho lies in [2**-(m+2), 2**-(m+1)] / sqrt(3); independent zero-mean errors give
# ||dA B + A dB|| / ||A B|| ~= sqrt(rho_A**2 + rho_B**2) (the dA dB term is second order); BF16 output rounding
# adds at most 2**-8 / sqrt(3) in quadrature. Bounds: [lower / 1.25, upper * 1.25] (safety factor 1.25).
#   E4M3 x E4M3: [0.0255, 0.0510] -> asserted [0.0204, 0.0638]
#   E5M2 x E4M3: [0.0403, 0.0807] -> asserted [0.0323, 0.1009]
# A BF16 GEMM (operands rounded to 8 bits) gives <= sqrt(2 * 2**-16/3 + 2**-16/3) = 0.0039: below every floor.
# Swapped formats are caught exactly by test_gemms_exact_given_quantization and statistically by
# test_hybrid_uses_e5m2_for_gradients (the bands of E4M3 x E4M3 and E5M2 x E4M3 overlap, so not by these alone).


def rho_band(*mantissa_bits: int, out_unit_roundoff: float = 0.0) -> tuple[float, float]:
    lower = math.sqrt(sum((2.0 ** -(m + 2)) ** 2 / 3 for m in mantissa_bits))
    upper = math.sqrt(sum((2.0 ** -(m + 1)) ** 2 / 3 for m in mantissa_bits) + out_unit_roundoff**2 / 3)
    return lower / 1.25, upper * 1.25


def test_gemms_against_float64_reference(operands, hybrid_run):
    x, w, dy = operands
    y, dx, dw = hybrid_run
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    e_fprop = rel_fro(y, x64 @ w64.T)
    e_dgrad = rel_fro(dx, dy64 @ w64)
    e_wgrad = rel_fro(dw, dy64.T @ x64)
    lo, hi = rho_band(3, 3, out_unit_roundoff=U_BF16)  # x E4M3, W E4M3
    assert lo <= e_fprop <= hi, (lo, e_fprop, hi)
    lo, hi = rho_band(2, 3, out_unit_roundoff=U_BF16)  # dy E5M2, W E4M3
    assert lo <= e_dgrad <= hi, (lo, e_dgrad, hi)
    lo, hi = rho_band(2, 3)  # dy E5M2, x E4M3, FP32 out
    assert lo <= e_wgrad <= hi, (lo, e_wgrad, hi)


def test_hybrid_uses_e5m2_for_gradients(operands, hybrid_run):
    # Same data, HYBRID vs all-E4M3. Scaling maps amax to 1.75 * 2**8 (E4M3) or 1.75 * 2**15 (E5M2): the same
    # mantissas, rounded to 2 instead of 3 bits, so rho(E5M2) = 2 * rho(E4M3) and, dy and W/x both Gaussian
    # (equal rho), the dgrad/wgrad error ratio HYBRID / E4M3 is sqrt((4 + 1) / (1 + 1)) = 1.58. Asserted within
    # a factor 1.2: [1.32, 1.90]. Swapped or equal formats give 1.0.
    x, w, dy = operands
    y_h, dx_h, dw_h = hybrid_run
    y_e, dx_e, dw_e = run_linear(x, w, dy, all_e4m3())
    assert torch.equal(y_h, y_e)  # the forward is E4M3 in both formats: bitwise identical
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    expected = math.sqrt(5 / 2)
    ratio_dgrad = rel_fro(dx_h, dy64 @ w64) / rel_fro(dx_e, dy64 @ w64)
    ratio_wgrad = rel_fro(dw_h, dy64.T @ x64) / rel_fro(dw_e, dy64.T @ x64)
    assert expected / 1.2 <= ratio_dgrad <= expected * 1.2, ratio_dgrad
    assert expected / 1.2 <= ratio_wgrad <= expected * 1.2, ratio_wgrad


def test_wgrad_in_bf16_when_fp8_wgrad_off(operands, hybrid_run):
    x, w, dy = operands
    y_h, dx_h, dw_h = hybrid_run
    y, dx, dw = run_linear(x, w, dy, hybrid(fp8_wgrad=False))
    # fprop and dgrad are unchanged (bitwise).
    assert torch.equal(y, y_h) and torch.equal(dx, dx_h)
    assert dw.dtype == torch.float32
    # BF16 wgrad: x and dy are already BF16, so the inputs are exact; FP32 accumulation + BF16 output rounding:
    # per element |dW - ref| <= 2**-8 |ref| + (1 + 2**-8)(M + 3) u (|dy|^T |x|).
    dy64, x64 = dy.double(), x.double()
    assert_gemm_exact(dw, dy64.T, x64, U_BF16)
    # Frobenius: <= 2**-8 (rms of the output rounding is <= 2**-8/sqrt(3) = 0.0023), at least 10x below the FP8
    # wgrad's floor (0.0323): an FP8 wgrad in this mode fails, and so does a BF16 one in the FP8 mode (test above).
    e_bf16 = rel_fro(dw, dy64.T @ x64)
    e_fp8 = rel_fro(dw_h, dy64.T @ x64)
    assert e_bf16 <= U_BF16
    assert e_bf16 * 10 <= e_fp8


def test_output_dtypes_and_shapes(hybrid_run):
    y, dx, dw = hybrid_run
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert dx.dtype == torch.bfloat16 and dx.shape == (M, K)
    assert dw.dtype == torch.float32 and dw.shape == (N, K)  # the weight's dtype (FP32 master weights)


def test_fp8_linear_module_matches_function(operands):
    # Fp8Linear flattens leading dims and shares the weight Parameter; its results equal the Function's bitwise.
    x, w, dy = operands
    linear = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    module = Fp8Linear(linear, hybrid())
    assert module.weight is linear.weight and module.bias is None
    x3 = x.view(4, M // 4, K).clone().requires_grad_(True)
    y3 = module(x3)
    assert y3.shape == (4, M // 4, N) and y3.dtype == torch.bfloat16
    y3.backward(dy.view(4, M // 4, N))
    y, dx, dw = run_linear(x, w, dy, hybrid())
    assert torch.equal(y3.detach().view(M, N), y)
    assert torch.equal(x3.grad.view(M, K), dx)
    assert torch.equal(linear.weight.grad, dw)  # the gradient lands on the original Parameter
    with pytest.raises(ValueError):
        Fp8Linear(nn.Linear(K, N, bias=True), hybrid())


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_non_finite_propagates(operands, fp8_wgrad):
    x, w, dy = operands
    recipe = hybrid(fp8_wgrad=fp8_wgrad)
    x_bad = x.clone()
    x_bad[7, 3] = float("inf")
    y, dx, dw = run_linear(x_bad, w, dy, recipe)
    assert not torch.isfinite(y).any()  # NaN scale: the whole output, not a saturated +-448 * scale_inv
    assert not torch.isfinite(dw).all()  # x enters wgrad
    w_bad = w.clone()
    w_bad[2, 9] = float("nan")
    y, dx, dw = run_linear(x, w_bad, dy, recipe)
    assert not torch.isfinite(y).any() and not torch.isfinite(dx).any()
    dy_bad = dy.clone()
    dy_bad[0, 0] = float("-inf")
    y, dx, dw = run_linear(x, w, dy_bad, recipe)
    assert torch.isfinite(y).all()
    assert not torch.isfinite(dx).any() and not torch.isfinite(dw).all()


# ---------------------------------------------------------------------------------------------------------------
# 4. convert_to_fp8 on a tiny Transformer
# ---------------------------------------------------------------------------------------------------------------


def tiny_config() -> ModelConfig:
    # conf/model/tiny_llama.yaml, smaller: Llama 3 layout (RMSNorm, GQA, SwiGLU), 4 blocks. init_std 0.1 so the
    # logits are O(1) and the loss depends on them (at 0.02 it is ln(vocab) whatever the GEMMs compute).
    return ModelConfig(
        name="tiny_test",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=128,
        seq_length=32,
        norm_eps=1e-5,
        rope_base=500000.0,
        init_std=0.1,
    )


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config())
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}


LINEAR_NAMES = {"attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2"}


def test_convert_fp8_current_replaces_block_linears_only():
    model = tiny_model()
    weights_before = {i: {n: m.weight for n, m in block_linears(b).items()} for i, b in enumerate(model.layers)}
    params_before = [id(p) for p in model.parameters()]
    keys_before = list(model.state_dict())
    replaced = convert_to_fp8(model.layers, precision(Fp8Format.hybrid))
    assert replaced == 4 * len(LINEAR_NAMES)
    for i, block in enumerate(model.layers):
        linears = block_linears(block)
        assert set(linears) == LINEAR_NAMES
        for name, module in linears.items():
            assert type(module) is Fp8Linear, (i, name)
            assert module.weight is weights_before[i][name]  # the same Parameter object
            assert (module.recipe.forward_dtype, module.recipe.backward_dtype) == (E4M3, E5M2)
    assert type(model.output) is nn.Linear and type(model.embedding) is nn.Embedding
    assert [id(p) for p in model.parameters()] == params_before  # optimizer state stays attached
    assert list(model.state_dict()) == keys_before  # checkpoints unchanged


def test_convert_keeps_first_and_last_block_in_bf16():
    model = tiny_model()
    p = precision(Fp8Format.hybrid, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    assert convert_to_fp8(model.layers, p) == 2 * len(LINEAR_NAMES)
    kinds = [{type(m) for m in block_linears(b).values()} for b in model.layers]
    assert kinds == [{nn.Linear}, {Fp8Linear}, {Fp8Linear}, {nn.Linear}]


@pytest.mark.parametrize(
    "recipe,fmt,expected",
    [
        (Recipe.delayed, Fp8Format.hybrid, DelayedScaling),
        (Recipe.blockwise, Fp8Format.hybrid, BlockwiseScaling),
        (Recipe.mxfp8, Fp8Format.e4m3, MXFP8Scaling),
    ],
)
def test_each_recipe_converts_to_its_own_recipe(recipe, fmt, expected):
    # Never silently the per-tensor current recipe (nor BF16): each layer carries exactly the recipe named.
    model = tiny_model()
    precision_cfg = PrecisionConfig(name=f"fp8_{recipe.value}", recipe=recipe, fp8_format=fmt, emulate=True)
    assert convert_to_fp8(model.layers, precision_cfg) == len(model.layers) * len(LINEAR_NAMES)
    recipes = {type(m.recipe) for m in model.modules() if isinstance(m, Fp8Linear)}
    assert recipes == {expected}


def test_recipe_without_fp8_format_is_rejected():
    with pytest.raises(ConfigError, match="fp8_format"):
        recipe_from_config(PrecisionConfig(name="fp8_current", recipe=Recipe.tensorwise, fp8_format=None))


def test_bf16_replaces_nothing():
    model = tiny_model()
    assert convert_to_fp8(model.layers, PrecisionConfig(name="bf16", recipe=Recipe.bf16)) == 0
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def loss_and_grads(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.item(), logits.detach().float(), {n: p.grad for n, p in model.named_parameters()}


def test_converted_model_forward_backward():
    reference = tiny_model(seed=3)
    model = copy.deepcopy(reference)
    assert convert_to_fp8(model.layers, precision(Fp8Format.hybrid)) == 16
    g = torch.Generator().manual_seed(3)
    cfg = reference.cfg
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)
    targets = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)

    loss_ref, logits_ref, grads_ref = loss_and_grads(reference, tokens, targets)
    loss_fp8, logits_fp8, grads_fp8 = loss_and_grads(model, tokens, targets)

    for name, grad in grads_fp8.items():
        assert grad is not None, name
        assert torch.isfinite(grad).all(), name
    assert all(grads_fp8[n].abs().sum() > 0 for n in grads_fp8 if n.endswith(("qkv.weight", "fc2.weight")))

    # Logits. The forward path crosses 16 FP8 GEMMs in series (4 blocks x qkv, out, fc1, fc2), each adding an
    # independent relative error <= 2**-4*sqrt(2/3) = 0.051 (E4M3 x E4M3 upper band of test 3); compounded in
    # quadrature that is <= sqrt(16) * 0.051 = 0.204, asserted with the same factor 1.25: <= 0.255. Floor: the
    # reference runs the same BF16 autocast path, so a silent BF16 fallback would differ by ~0; FP8 adds at least
    # one E4M3 x E4M3 GEMM's lower band (0.0255 / 1.25 = 0.0204).
    logits_err = rel_fro(logits_fp8, logits_ref.double())
    assert 0.0204 <= logits_err <= 0.255, logits_err
    # Loss: cross-entropy is sqrt(2)-Lipschitz in each token's logits (its gradient p - onehot has norm <= sqrt 2),
    # and the first-order change mean_t (p_t - e_t) . dl_t averages terms of random sign; with logits of std ~0.8
    # and ~0.2 relative perturbation that is ~0.5 % of the loss. Asserted within 3 % ("a few %").
    assert loss_ref > math.log(cfg.vocab_size) * 1.05  # the loss does depend on the logits at this init
    assert abs(loss_fp8 - loss_ref) <= 0.03 * loss_ref, (loss_fp8, loss_ref)
    # Gradients: the backward crosses the same 16 GEMMs with E5M2 dy, each <= 0.0807 relative (E5M2 x E4M3 upper
    # band of test 3): <= sqrt(16) * 0.0807 * 1.25 = 0.40 relative error of the whole gradient, i.e. cosine
    # >= 1 - 0.40**2 / 2 = 0.92.
    flat_ref = torch.cat([grads_ref[n].flatten() for n in grads_ref]).double()
    flat_fp8 = torch.cat([grads_fp8[n].flatten() for n in grads_ref]).double()
    assert rel_fro(flat_fp8, flat_ref) <= 0.40
    assert F.cosine_similarity(flat_ref, flat_fp8, dim=0).item() >= 0.92
