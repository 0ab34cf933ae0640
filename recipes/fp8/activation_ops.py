"""The MLP's activations, forward and backward, as element-wise ops of one or two BF16 tensors: what
recipes.fp8.fused_quantize's kernels compute and quantize in one pass, and (`reference_output`) the same values from
PyTorch's operators, which is where those kernels do not run and what their bytes are checked against."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

OPS = ("identity", "swiglu", "squared_relu", "swiglu_backward", "squared_relu_backward")
FORWARD_AND_BACKWARD = {"swiglu": "swiglu_backward", "squared_relu": "squared_relu_backward"}


def reference_output(op: str, a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """op(a, b) in BF16 with PyTorch's operators, as the eager model computes it (recipes.models.transformer.MLP,
    autograd's backward): what the kernels' FP8 bytes are checked against, and the path where they do not run."""
    if op == "identity":
        return a
    if op == "swiglu":
        gate, up = a.chunk(2, dim=-1)
        return F.silu(gate) * up
    if op == "squared_relu":
        relu = torch.relu(a)
        return relu * relu
    if op == "swiglu_backward":
        gate, up = b.chunk(2, dim=-1)
        d_gate = torch.ops.aten.silu_backward(a * up, gate)
        return torch.cat([d_gate, a * F.silu(gate)], dim=-1)
    if op == "squared_relu_backward":
        relu = torch.relu(b)
        product = a * relu
        return torch.ops.aten.threshold_backward(product + product, relu, 0)
    raise ValueError(f"unknown op {op!r}; one of {OPS}")
