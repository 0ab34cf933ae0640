"""Weight-gradient accumulation inside the GEMM for megatron-core's own linear layers, without Apex.

megatron-core has one switch for it (TransformerConfig.gradient_accumulation_fusion): Transformer Engine's layers
then add each weight gradient into its FP32 `main_grad` inside TE's GEMM, and megatron-core's own ColumnParallel /
RowParallelLinear (the output layer; every linear of the local spec) call Apex's extension
`fused_weight_gradient_mlp_cuda`, and refuse to build where it is missing (pip installs, no NeMo container).
Unfused, the output layer's gradient is written in BF16 and added into main_grad by a separate mixed-dtype kernel:
35 ms per step on the 8-layer llama3_8b proxy, 103 ms on nemotron4_15b (256k vocabulary).

`install()` gives megatron-core this module in place of Apex's extension: its two calls on cuBLAS's GEMM with beta =
1, reading BF16 and writing the FP32 gradient (recipes.compute.mm_into, the torch engine's own). Apex's
extension, where it is importable, stays. The wgrad runs only where megatron-core's backward can: on CUDA (it
allocates its dummy gradient on the current CUDA device).
"""

from __future__ import annotations

import sys

import torch

from recipes.compute import mm_into


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (out, in; FP32) += grad_output (tokens, out)^T @ total_input (tokens, in): BF16 products summed in
    FP32 and added into main_grad in one GEMM, as Apex's kernel does."""
    mm_into(grad_output.t(), total_input.t(), main_grad, True)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a BF16 (or FP16) main_grad: the gradient buffer of megatron.grad_reduce_in_fp32=false, NVIDIA's
    performance setting. FP32 sums inside the GEMM, rounded once into the buffer, as Apex's kernel does."""
    main_grad.addmm_(grad_output.t(), total_input)


def install() -> None:
    """Give megatron-core's linear layers this module as their Apex extension, unless Apex's own is importable."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        layers._grad_accum_fusion_available = True
