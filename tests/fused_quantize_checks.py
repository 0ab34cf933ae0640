"""The checks of recipes.fp8.fused_quantize's kernels, shared by the CPU suite (Triton's interpreter,
tests/test_fused_linears.py) and the GPU suite (tests/test_gpu.py): for every op, the amax, the FP8 bytes in both
orientations, the recorded history slot and the BF16 values with their amax equal the unfused reference's, on plain
and on awkward inputs."""

from __future__ import annotations

import torch

from recipes.fp8.activation_ops import reference_output
from recipes.fp8.current_scaling import cast_to_fp8, tensorwise_scale


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
    functions = (kernels.produced_amax, kernels.produce_fp8, kernels.produce_fp8_recording_amax,
                 kernels.produce_bf16_with_amax)
    if compiled:
        functions = tuple(torch.compile(f) for f in functions)
    produced_amax, produce_fp8, recording, bf16_with_amax = functions
    ref = reference_output(op, a, b)
    ref_amax = ref.abs().amax().float()
    assert same_float(produced_amax(op, a, b), ref_amax), op
    values, amax = bf16_with_amax(op, a, b)
    assert values.dtype == torch.bfloat16 and same_float(values, ref) and same_float(amax, ref_amax), op
    finite = ref.float().nan_to_num(0.0, 0.0, 0.0).abs().amax()  # a finite scale, so NaN and inf meet a real cast
    scale = tensorwise_scale(finite, dtype)
    expected = cast_to_fp8(ref, scale, dtype)
    data, data_t = produce_fp8(op, a, b, scale, dtype)
    assert data.dtype == dtype and same_fp8(data, expected), op
    assert same_fp8(data_t, expected.t().contiguous()), op
    history = torch.full((3, 4), 0.5, device=a.device)
    before = history.clone()
    data, data_t = recording(op, a, b, scale, dtype, history, 4)
    assert same_fp8(data, expected) and same_fp8(data_t, expected.t().contiguous()), op
    before[1, 0] = torch.maximum(before[1, 0], ref_amax)
    assert same_float(history, before), op


