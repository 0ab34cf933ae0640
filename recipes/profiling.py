"""Where a GPU step spends its time: kernel time from torch.profiler, split into GEMMs, attention and the rest."""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# Kernel-name patterns, attention first: cuDNN's fused attention kernels also carry GEMM-like names
# ("..._sdpa_sm90_flash_bprop_wgmma..."). GEMMs: cuBLAS/cuBLASLt (nvjet, xmma), CUTLASS.
CATEGORIES = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|cublas", re.I)),
)


def kernel_category(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def profile_kernels(run: Callable[[], None]) -> dict:
    """Run `run` once under the profiler; return total kernel time per category and the top kernels (ms)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + event.self_device_time_total / 1e3
    by_category = {category: 0.0 for category in ("gemm", "attention", "other")}
    for name, ms in kernels.items():
        by_category[kernel_category(name)] += ms
    total = sum(by_category.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:30]
    return {
        "total_ms": total,
        "ms": by_category,
        "share": {category: ms / total for category, ms in by_category.items()} if total else {},
        "top_kernels": [{"name": name[:120], "ms": ms, "category": kernel_category(name)} for name, ms in top],
    }
