"""The checks of recipes.fp8.fused_quantize's kernels, shared by the CPU suite (Triton's interpreter,
tests/test_fused_linears.py) and the GPU suite (tests/test_gpu.py): for every op, the amax, the FP8 bytes in both
orientations (per tensor and in 1x128 blocks), the scales, the recorded history slot and the BF16 values with their
amax equal the unfused reference's, on plain and on awkward inputs."""

from __future__ import annotations

import torch

from recipes.fp8.activation_ops import reference_output
from recipes.fp8.blockwise import quantize_blockwise
from recipes.fp8.current_scaling import cast_to_fp8, fp32_quotient, quantize_tensorwise, tensorwise_scale
from recipes.fp8.formats import E4M3, E5M2


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, NaN positions equal whatever their sign and payload."""
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    return bool(torch.equal(nan_a, nan_b) and (a.view(torch.uint8) == b.view(torch.uint8))[~nan_a].all())


def same_float(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def op_inputs(op: str, rows: int, cols: int, device, seed: int, awkward: bool) -> tuple:
    """(a, b) for op with a `cols`-wide output half: fc1's output [g | u] (2 * cols wide for SwiGLU) and dh. Awkward:
    values over 40 binades, an all-zero tile, NaN and infinities in each input."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(width: int, scale: float) -> torch.Tensor:
        t = torch.randn(rows, width, generator=generator) * scale
        if awkward:
            t = t * torch.logspace(-20, 20, width)
            t[: rows // 2, : width // 3] = 0
            t[rows - 1, width - 1], t[1, width // 2], t[rows // 2, 1] = float("nan"), float("inf"), -float("inf")
        return t.to(torch.bfloat16).to(device)

    fc1_width = 2 * cols if op.startswith("swiglu") else cols
    if op.endswith("backward"):
        return tensor(cols, 1e-3), tensor(fc1_width, 3.0)
    return tensor(fc1_width, 3.0), None


def check_op(kernels, op: str, a: torch.Tensor, b, dtype: torch.dtype, compiled: bool = False) -> None:
    current, recording = kernels.produce_fp8_current, kernels.produce_fp8_recording_amax
    if compiled:
        current, recording = torch.compile(current), torch.compile(recording)
    ref = reference_output(op, a, b)
    ref_amax = ref.abs().amax().float()
    assert same_float(kernels.produced_amax(op, a, b), ref_amax), op
    values, amax = kernels.produce_bf16_with_amax(op, a, b)
    assert values.dtype == torch.bfloat16 and same_float(values, ref) and same_float(amax, ref_amax), op
    check_current(current(op, a, b, dtype), ref, dtype, op)
    finite = ref.float().nan_to_num(0.0, 0.0, 0.0).abs().amax()  # a finite scale, so NaN and inf meet a real cast
    scale = tensorwise_scale(finite, dtype)
    expected = cast_to_fp8(ref, scale, dtype)
    history = torch.full((3, 4), 0.5, device=a.device)
    before = history.clone()
    data, data_t, scale_inv = recording(op, a, b, scale, dtype, history, 4)
    assert same_fp8(data, expected) and same_fp8(data_t, expected.t().contiguous()), op
    assert same_float(scale_inv, fp32_quotient(1.0, scale)), op
    before[1, 0] = torch.maximum(before[1, 0], ref_amax)
    assert same_float(history, before), op


def check_1x128(kernels, op: str, a: torch.Tensor, b, dtype: torch.dtype, compiled: bool = False) -> None:
    """produce_fp8_1x128's (data, scale_inv, data_t, scale_inv_t) against the unfused blockwise quantization of the
    op's output and of its transpose; the scale_invs with their rows contiguous (cuBLAS's layout)."""
    produce = torch.compile(kernels.produce_fp8_1x128) if compiled else kernels.produce_fp8_1x128
    ref = reference_output(op, a, b)
    data, scale_inv, data_t, scale_inv_t = produce(op, a, b, dtype)
    for (d, s), expected in (((data, scale_inv), quantize_blockwise(ref, dtype, (1, 128))),
                             ((data_t, scale_inv_t), quantize_blockwise(ref.t().contiguous(), dtype, (1, 128)))):
        assert d.dtype == dtype and same_fp8(d, expected.data), op
        assert same_float(s, expected.scale_inv) and s.stride() == (1, s.shape[0]), op


def check_current(produced: tuple, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """produce_fp8_current's (data, data_t, scale_inv) against the unfused current scaling of the op's output."""
    data, data_t, scale_inv = produced
    expected = quantize_tensorwise(ref, dtype)
    assert data.dtype == dtype and same_fp8(data, expected.data), what
    assert same_fp8(data_t, expected.data.t().contiguous()), what
    assert same_float(scale_inv, expected.scale_inv), what


def check_scale_edge_cases(kernels, device) -> None:
    """produce_fp8_current on scale_edge_cases, through both of its paths (an amax pass over a materialized
    tensor; an op's BF16 values with their amax)."""
    for name, t in scale_edge_cases(device).items():
        for op in ("identity", "squared_relu"):
            for dtype in (E4M3, E5M2):
                check_current(kernels.produce_fp8_current(op, t, None, dtype), reference_output(op, t, None), dtype,
                              f"{name} {op} {dtype}")


def scale_edge_cases(device) -> dict[str, torch.Tensor]:
    """Tensors whose amax takes current scaling's scale through each of its cases: zero (scale 1), tiny (the
    quotient overflows: FP32's max; normal numbers, as Triton's interpreter loads BF16 subnormals wrong), huge (a
    scale below 1), inf and NaN (NaN)."""
    plain = torch.randn(48, 80, generator=torch.Generator().manual_seed(3))
    cases = {"zero": torch.zeros(48, 80), "tiny": (plain + plain.sign()) * 1e-37, "huge": plain * 1e37, "plain": plain}
    for name, value in (("inf", float("inf")), ("nan", float("nan"))):
        cases[name] = plain.clone()
        cases[name][5, 7] = value
    return {name: t.to(torch.bfloat16).to(device) for name, t in cases.items()}
