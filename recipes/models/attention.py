"""Which kernel runs the model's attention: the order in which it asks PyTorch's scaled_dot_product_attention (SDPA)
for its kernels, and the one SDPA picks under that order.

PyTorch's own choice depends on the process, not only on the GPU: once Transformer Engine is imported (megatron-core
imports it, and the NeMo container has it), SDPA on an H200 picks its flash kernels over cuDNN's fused attention,
which runs the same causal attention in about half the time there (docs/results). So the model names the order
itself, the same in every process: on CUDA GPUs cuDNN's fused attention first, then flash, memory-efficient and
math (SDPA takes the first whose constraints the call meets); on a CPU PyTorch's default order.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from recipes.config import ModelConfig

CUDA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH]
CPU_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
NAMES = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
         SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}


def attention_order(on_cuda: bool) -> list[SDPBackend]:
    return CUDA_ORDER if on_cuda else CPU_ORDER


def describe_order(on_cuda: bool) -> str:
    """The plan's words for the order: "cudnn, then flash, efficient, math"."""
    first, *rest = (NAMES[backend] for backend in attention_order(on_cuda) if backend in NAMES)
    return f"{first}, then {', '.join(rest)}"


def attention_kernel(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel SDPA runs, under the model's order, for the causal attention of `cfg` (micro-batch 1) in `dtype` on
    `device`: "cudnn", "flash", "efficient" or "math". Asks SDPA's own selection (`torch._fused_sdp_choice`) with
    empty tensors of the model's shapes; nothing is computed."""
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    q = torch.empty(1, heads, cfg.seq_length, cfg.kv_channels, device=device, dtype=dtype)
    kv = torch.empty(1, groups, cfg.seq_length, cfg.kv_channels, device=device, dtype=dtype)
    with sdpa_kernel(attention_order(device.type == "cuda"), set_priority=True):
        choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=groups != heads)
    return NAMES.get(SDPBackend(choice), SDPBackend(choice).name.lower())
