"""Where a step spends its time: torch.profiler's kernel time (GPU) or operator time (CPU), split into
communication, attention, GEMMs, FP8 quantization and the rest.

`profile_kernels` runs one callable under the profiler (scripts/layer_bench.py); `profile_step_if_due` profiles
the engines' optimizer step `trainer.profile_step` and writes a Chrome trace and the split into RUN_DIR/profile;
`gpu_telemetry` records the clock and power the GPU ran at meanwhile (nvidia-smi).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from recipes.folders import check_regular_or_absent, write_file
from recipes.metrics import RunDirGone
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
    # The loss's kernels (cross-entropy, softmax) and Adam's.
    ("loss", re.compile(r"cross_entropy|nll_loss|log_softmax|logsumexp", re.I)),  # ours: Inductor's, "..._logsumexp_..."
    ("optimizer", re.compile(r"adam", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|cublas|^triton_tem_|^aten::(_scaled_)?(mm|addmm|bmm)\b"
                        r"|^fp8_recipes::\w*mm\b", re.I)),
    ("quantization", re.compile(r"amax|quantiz|cast_transpose|fp8|float8|e4m3|e5m2|scaled_mm|compute_scale|kernel_bulk",
                                re.I)),
)

# Ranges the engines open around the output layer with the loss and around the optimizer step, which a trace shows
# (Perfetto). The split goes by kernel names only, so the output layer's GEMMs count under "gemm": on an H200
# (torch 2.11) the profiler's link from a CPU range to the kernels launched under it counted kernels twice.
OPTIMIZER, OUTPUT_AND_LOSS = "optimizer", "output_and_loss"
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + ("other",)


def kernel_category(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def time_split(prof: profile, device_type: str) -> dict:
    """Self time per kernel (CUDA) or per operator (CPU) of a finished profile, by category, in ms. On a GPU the kernels only:
    with CPU activity recorded, ranges such as `nccl:_all_gather_base` or `Optimizer.step#...` also appear on the
    GPU timeline (user annotations) and would count their kernels twice. Kernels on different streams overlap
    (communication beside compute), so the total can exceed the step's wall time."""
    kernels: dict[str, float] = {}
    calls: dict[str, int] = {}
    for event in prof.key_averages():
        if device_type == "cuda":
            on_device = event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation
            ms = event.self_device_time_total / 1e3
        else:
            on_device, ms = event.device_type == torch.autograd.DeviceType.CPU, event.self_cpu_time_total / 1e3
        if on_device and ms > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + ms
            calls[event.key] = calls.get(event.key, 0) + event.count
    by_category = {category: 0.0 for category in CATEGORY_NAMES}
    for name, ms in kernels.items():
        by_category[kernel_category(name)] += ms
    total = sum(by_category.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:30]
    most_called = sorted(calls.items(), key=lambda item: -item[1])[:15]  # where the launches go
    return {
        "timed": "kernels" if device_type == "cuda" else "operators",
        "total_ms": total,
        "ms": by_category,
        "share": {category: ms / total for category, ms in by_category.items()} if total else {},
        "top_kernels": [{"name": name[:120], "ms": ms, "calls": calls[name], "category": kernel_category(name)}
                        for name, ms in top],
        "most_called": [{"name": name[:120], "calls": count, "ms": kernels[name]} for name, count in most_called],
    }


def profile_kernels(run: Callable[[], None]) -> dict:
    """Run `run` once under the profiler on the GPU; the kernel time per category and the top kernels (ms), and
    where the GPU sat idle between them (`gpu_idle`)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    return {**time_split(prof, "cuda"), "idle": gpu_idle(kernels)}


# A gap up to this long is the GPU's own latency between queued kernels; a longer one, a wait for the host.
QUEUED_GAP_US = 10.0


def gpu_idle(kernels: list[tuple[float, float, str]]) -> dict:
    """Where the GPU did nothing between the first kernel's start and the last one's end, from the kernels'
    (start_us, end_us, name): the idle time in gaps up to QUEUED_GAP_US (kernels queued back to back; their
    number sets it) and in longer gaps (the host fell behind, or waited), and the longest gaps, each with when it
    began (ms from the first kernel) and the kernels on either side. Overlapping kernels (other streams) count
    once."""
    kernels = sorted(kernels)
    gaps, (_, busy_until, last_name) = [], kernels[0]
    for start, end, name in kernels[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, last_name, name, busy_until - kernels[0][0]))
        if end > busy_until:
            busy_until, last_name = end, name
    queued = [gap[0] for gap in gaps if gap[0] <= QUEUED_GAP_US]
    waits = sorted((g for g in gaps if g[0] > QUEUED_GAP_US), key=lambda g: -g[0])
    return {
        "kernels": len(kernels),
        "span_ms": (busy_until - kernels[0][0]) / 1e3,
        "queued_gaps_ms": sum(queued) / 1e3,
        "wait_gaps": len(waits),
        "wait_gaps_ms": sum(gap[0] for gap in waits) / 1e3,
        "longest_gaps": [{"ms": gap / 1e3, "at_ms": at / 1e3, "after": after[:100], "before": before[:100]}
                         for gap, after, before, at in waits[:8]],
    }


# What nvidia-smi samples: when (its local time, to the millisecond), the SM clock (MHz), the board's power draw and
# the limit the driver enforces (W), the temperature (C), and whether the driver is holding the clocks down to stay
# under that limit.
TELEMETRY_QUERY = ("timestamp,clocks.sm,power.draw,enforced.power.limit,temperature.gpu,"
                   "clocks_event_reasons.sw_power_cap")


@contextlib.contextmanager
def gpu_telemetry(device: torch.device, interval_ms: int = 100) -> Iterator[dict]:
    """While the body runs, nvidia-smi samples `device` every `interval_ms`; on exit the dict holds
    summarize_telemetry's figures, or {"unavailable": why} (no nvidia-smi, not a GPU, a query the driver refuses).
    The same kernels run a few percent slower when the GPU holds its clock down under its power limit; this says
    whether a column ran at the clock of the others, and `window_telemetry` at what clock each of its steps ran."""
    telemetry: dict = {}
    smi = shutil.which("nvidia-smi")
    if device.type != "cuda" or smi is None:
        telemetry["unavailable"] = "not a CUDA device" if device.type != "cuda" else "no nvidia-smi on PATH"
        yield telemetry
        return
    props = torch.cuda.get_device_properties(device)
    pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    # The device as nvidia-smi names it (its PCI address; CUDA's numbering may differ); without one, every GPU.
    which = [f"--id={pci[0]:08X}:{pci[1]:02X}:{pci[2]:02X}.0"] if all(isinstance(i, int) for i in pci) else []
    command = [smi, *which, f"--query-gpu={TELEMETRY_QUERY}", "--format=csv,noheader,nounits",
               f"--loop-ms={interval_ms}"]
    with sampler_output(command) as output:
        yield telemetry
    telemetry.update(summarize_telemetry(output["text"]))


@contextlib.contextmanager
def sampler_output(command: list[str]) -> Iterator[dict]:
    """`command` runs while the body does, then is stopped; on exit the dict's "text" is all it printed. Into a
    file, not a pipe: a pipe read only at the end fills (64 KiB, about 100 s of nvidia-smi's samples) and stops
    the sampler mid-run."""
    output: dict = {}
    with tempfile.TemporaryFile("w+") as printed:
        sampler = subprocess.Popen(command, stdout=printed, stderr=subprocess.STDOUT, text=True)
        try:
            yield output
        finally:
            sampler.terminate()
            try:
                sampler.wait(timeout=10)
            except subprocess.TimeoutExpired:  # leave no sampler behind
                sampler.kill()
                sampler.wait()
            printed.seek(0)
            output["text"] = printed.read()


def summarize_telemetry(output: str) -> dict:
    """From nvidia-smi's CSV lines (TELEMETRY_QUERY, no header, no units): the median SM clock, power, power
    limit and temperature, the share of samples with the power cap slowing the clock, and the number of samples;
    or {"unavailable": nvidia-smi's first line} where no line parses."""
    samples = []
    for line in output.splitlines():
        fields = [field.strip() for field in line.split(",")]
        try:
            when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, *(float(field) for field in fields[1:5]), fields[5] == "Active"))
        except (IndexError, ValueError):
            continue
    if not samples:
        return {"unavailable": (output.strip().splitlines() or ["nvidia-smi printed nothing"])[0][:200]}
    return {**_medians(samples), "timeline": samples}


def _medians(samples: list[tuple]) -> dict:
    _, clock, power, limit, temperature, capped = zip(*samples)
    return {"sm_clock_mhz": statistics.median(clock), "power_w": statistics.median(power),
            "power_limit_w": statistics.median(limit), "temperature_c": statistics.median(temperature),
            "power_capped_share": sum(capped) / len(samples), "samples": len(samples)}


def window_telemetry(telemetry: dict, start: float, end: float) -> dict | None:
    """summarize_telemetry's medians over the samples taken between `start` and `end` (time.time() seconds), None
    where there are none."""
    inside = [sample for sample in telemetry.get("timeline", ()) if start <= sample[0] <= end]
    return _medians(inside) if inside else None


def describe_telemetry(telemetry: dict) -> str:
    if "unavailable" in telemetry:
        return f"GPU clock and power not recorded: {telemetry['unavailable']}"
    return (f"SM clock {telemetry['sm_clock_mhz']:.0f} MHz, {telemetry['power_w']:.0f} W of a "
            f"{telemetry['power_limit_w']:.0f} W limit, {telemetry['temperature_c']:.0f} C, power cap slowing the "
            f"clock in {telemetry['power_capped_share']:.0%} of {telemetry['samples']} samples (medians)")


def describe_idle(idle: dict) -> str:
    return (f"{idle['kernels']} kernels over {idle['span_ms']:.1f} ms; GPU idle {idle['queued_gaps_ms']:.1f} ms "
            f"between queued kernels, {idle['wait_gaps_ms']:.1f} ms in {idle['wait_gaps']} waits over "
            f"{QUEUED_GAP_US:.0f} us")


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
    try:
        folder.mkdir(exist_ok=True)  # not its parents: a run directory gone meanwhile is not made again
    except FileNotFoundError:
        raise RunDirGone(run_dir) from None
    trace = folder / f"trace_rank{rank}.json"
    check_regular_or_absent(trace)  # the profiler opens the name it is given: never a link planted there
    prof.export_chrome_trace(str(trace))
    split = {"step": step, "rank": rank, **time_split(prof, device.type)}
    write_file(folder / f"time_rank{rank}.json", json.dumps(split, indent=2) + "\n")
    if rank == 0:
        print(f"profile of step {step} (rank 0): {describe_time_split(split)}; trace in {folder}", flush=True)
