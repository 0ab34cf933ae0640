"""Where a step spends its time: torch.profiler's kernel time (GPU) or operator time (CPU), split into
communication, attention, GEMMs, FP8 quantization and the rest.

`profile_kernels` runs one callable under the profiler (scripts/layer_bench.py); `profile_step_if_due` profiles
the engines' optimizer step `trainer.profile_step` and writes a Chrome trace and the split into RUN_DIR/profile.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from recipes.run_files import PROFILE

# Name patterns, in this order: collectives (NCCL kernels, Gloo/c10d ops); attention (cuDNN's fused attention
# kernels also carry GEMM-like names, "..._sdpa_sm90_flash_bprop_wgmma..."); GEMMs: cuBLAS/cuBLASLt (nvjet, xmma),
# CUTLASS, Inductor's GEMM templates (triton_tem_) on GPUs, the matmul operators on CPUs (`fp8_recipes::` ops ending
# in mm are this project's GEMMs); FP8 quantization: amax reductions, casts and cast-transposes, scale updates -
# Inductor names a kernel after the ops it fuses, so one that feeds an FP8 GEMM carries `_scaled_mm` in its name
# and counts here even where it also computes a norm or an activation (so do TE's kernels that write FP8).
CATEGORIES = (
    ("communication", re.compile(r"nccl|gloo|c10d::|all_?gather|reduce_?scatter|all_?reduce", re.I)),
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    # The loss's and the optimizer's own kernels, wherever they were launched (Transformer Engine's cross-entropy
    # and Adam are launched outside any PyTorch operator, so REGIONS below cannot place them).
    ("output_and_loss", re.compile(r"cross_entropy|nll_loss|log_softmax", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|cublas|^triton_tem_|^aten::(_scaled_)?(mm|addmm|bmm)\b"
                        r"|^fp8_recipes::\w*mm\b", re.I)),
    ("quantization", re.compile(r"amax|quantiz|cast_transpose|fp8|float8|e4m3|e5m2|scaled_mm|compute_scale|kernel_bulk",
                                re.I)),
)

# Regions of the step, by the operators a kernel (or CPU operator) was launched under: the optimizer (torch.optim's
# `Optimizer.step#...` ranges, the engines' OPTIMIZER range) and the output layer with the loss (the model's
# OUTPUT_AND_LOSS range; megatron-core's output layer, `LinearWithGradAccumulationAndAsyncCommunication`, the only
# layer of a Transformer Engine model that is not TE's, and cross-entropy functions, forward and backward). A
# kernel launched in a region counts there, whatever its name. Kernels that an extension launches outside any
# PyTorch operator (Transformer Engine's GEMMs) have no launch site in the profile and count by name.
OPTIMIZER, OUTPUT_AND_LOSS = "optimizer", "output_and_loss"
REGIONS = (
    (OPTIMIZER, re.compile(rf"^Optimizer\.step#|^{OPTIMIZER}$")),
    (OUTPUT_AND_LOSS, re.compile(rf"^{OUTPUT_AND_LOSS}$|LinearWithGradAccumulationAndAsyncCommunication|CrossEntropy"
                                 r"|_LinearCrossEntropy|NllLoss|LogSoftmaxBackward")),
)
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + ("other",)
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def kernel_category(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def region_of(event, memo: dict) -> str | None:
    """The region (REGIONS) of a profiled CPU event: that of the innermost enclosing event named for one."""
    if event is None:
        return None
    if id(event) not in memo:
        own = next((region for region, pattern in REGIONS if pattern.search(event.name)), None)
        memo[id(event)] = own or region_of(event.cpu_parent, memo)
    return memo[id(event)]


def time_split(prof: profile, device_type: str) -> dict:
    """Self time per kernel (CUDA) or per operator (CPU) of a finished profile, by category, in ms: a kernel launched
    under a region of the step (REGIONS) counts there, the others by name (CATEGORIES). On a GPU the kernels only:
    with CPU activity recorded, ranges such as `nccl:_all_gather_base` or `Optimizer.step#...` also appear on the
    GPU timeline (user annotations) and would count their kernels twice. Kernels on different streams overlap
    (communication beside compute), so the total can exceed the step's wall time."""
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if device_type == "cuda":
            on_device = event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation
            ms = event.self_device_time_total / 1e3
        else:
            on_device, ms = event.device_type == torch.autograd.DeviceType.CPU, event.self_cpu_time_total / 1e3
        if on_device and ms > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + ms
    by_category = {category: 0.0 for category in CATEGORY_NAMES}
    for name, ms in kernels.items():
        by_category[kernel_category(name)] += ms
    memo: dict = {}
    for event in prof.events():  # move what was launched under a region out of its name's category
        if RUNTIME_CALL.match(event.name):
            continue  # a CUDA runtime or driver call: its id is CUPTI's, which can equal an operator's by chance
        if device_type == "cuda":
            # A CPU range's `kernels` also list its own span on the GPU timeline (a user annotation): not a kernel.
            launched = [(k.name, k.duration / 1e3) for k in event.kernels if k.name in kernels]
        else:
            on_cpu = event.device_type == torch.autograd.DeviceType.CPU
            launched = [(event.key, event.self_cpu_time_total / 1e3)] if on_cpu else []
        region = region_of(event, memo) if launched else None
        for name, ms in launched if region else ():
            by_category[kernel_category(name)] -= ms
            by_category[region] += ms
    total = sum(by_category.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:30]
    return {
        "timed": "kernels" if device_type == "cuda" else "operators",
        "total_ms": total,
        "ms": by_category,
        "share": {category: ms / total for category, ms in by_category.items()} if total else {},
        "top_kernels": [{"name": name[:120], "ms": ms, "category": kernel_category(name)} for name, ms in top],
    }


def profile_kernels(run: Callable[[], None]) -> dict:
    """Run `run` once under the profiler on the GPU; the kernel time per category and the top kernels (ms)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return time_split(prof, "cuda")


def describe_time_split(split: dict) -> str:
    parts = ", ".join(f"{category} {split['ms'][category]:.1f} ({split['share'].get(category, 0):.0%})"
                      for category in CATEGORY_NAMES)
    return f"{split['total_ms']:.1f} ms of {split['timed']}: {parts}"


@contextlib.contextmanager
def profile_step_if_due(step: int, profile_step: int | None, run_dir: Path, rank: int,
                        device: torch.device) -> Iterator[None]:
    """Profile the body if `step` is `profile_step`: RUN_DIR/profile/trace_rank{R}.json (Chrome trace, for
    Perfetto or chrome://tracing) and time_rank{R}.json (the split of `time_split`); rank 0 prints the split."""
    if step != profile_step:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    folder = run_dir / PROFILE
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"trace_rank{rank}.json"))
    split = {"step": step, "rank": rank, **time_split(prof, device.type)}
    (folder / f"time_rank{rank}.json").write_text(json.dumps(split, indent=2) + "\n")
    if rank == 0:
        print(f"profile of step {step} (rank 0): {describe_time_split(split)}; trace in {folder}", flush=True)
