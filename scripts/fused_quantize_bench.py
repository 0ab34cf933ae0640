"""Time each kernel of recipes.fp8.fused_quantize at a model's MLP shapes, against an element-wise copy's bandwidth.

    python scripts/fused_quantize_bench.py --model llama3_8b --model nemotron4_15b --out docs/results/fused_quantize

One row per op and mode, as recipes.fp8.mlp and recipes.fp8.linear call them for one micro-batch (the model's
sequence length): the activation forward on fc1's output, its backward on (dh, fc1's output), and the identity
cast-transpose of a linear's incoming gradient; modes `current` and `delayed` (the recipe's own fused cast,
recipes.fp8.linear's `fused_cast`: every pass it makes, the FP8 transpose included), `blockwise` (1x128 blocks both
ways, E4M3, as fp8_blockwise runs them: `quantize_produced`) and, for the backward ops, `bf16` (the BF16 MLP's).
The time is GPU kernel time per call (every kernel of the call, listed in results.json), from the profiler over
--iterations calls after --warmup (autotuning included in warm-up). GB/s counts the bytes each call must move (its
inputs read once, its outputs written once, the transposed copy and blockwise scales included); `of copy` divides
that by an element-wise kernel's rate (a BF16 negation) measured the same way. Without CUDA the kernels run in
Triton's interpreter (TRITON_INTERPRET=1) and the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from recipes.config import ModelConfig, load_option
from recipes.fp8.activation_ops import FORWARD_AND_BACKWARD
from recipes.fp8.delayed_scaling import DelayedScalingState
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.linear import GRAD, INPUT, BlockwiseScaling, DelayedScaling, TensorwiseScaling
from recipes.fp8.mlp import ACTIVATION_OPS
from recipes.profiling import profile_kernels
from recipes.provenance import provenance

MODES = ("current", "delayed", "blockwise", "bf16")


def op_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[str, tuple[int, int], tuple[int, int] | None, int]]:
    """(op, a's shape, b's shape or None, output columns) of one micro-batch's MLP."""
    forward = ACTIVATION_OPS[cfg.activation]
    fc1_cols = 2 * cfg.ffn_hidden_size if forward == "swiglu" else cfg.ffn_hidden_size
    return [
        (forward, (tokens, fc1_cols), None, cfg.ffn_hidden_size),
        (FORWARD_AND_BACKWARD[forward], (tokens, cfg.ffn_hidden_size if forward == "swiglu" else fc1_cols),
         (tokens, fc1_cols), fc1_cols),
        ("identity", (tokens, cfg.hidden_size), None, cfg.hidden_size),
    ]


def _call(kernels, op: str, mode: str, a, b, dtype) -> Callable[[], object]:
    if mode == "bf16":
        return lambda: kernels.produce_bf16(op, a, b)
    role = GRAD if dtype == E5M2 else INPUT
    if mode == "blockwise":
        blockwise = BlockwiseScaling(E4M3, E4M3, fused_kernels=True)
        return lambda: blockwise.quantize_produced(op, a, b, role, None)
    recipe = {"current": TensorwiseScaling, "delayed": DelayedScaling}[mode](E4M3, E5M2, fused_kernels=True)
    state = DelayedScalingState(16).to(a.device)
    return lambda: recipe.fused_cast(kernels, op, a, b, dtype, state.tensors(), role)


def kernel_ms(fn: Callable[[], object], warmup: int, iterations: int, device: torch.device) -> tuple[float, list]:
    """GPU kernel time per call: every kernel of `iterations` calls under the profiler, summed, over `iterations`
    (the host's launch overhead is left out: in a training step it overlaps the GPU's work), and [kernel, ms per
    call] of each kernel. Without CUDA, the median wall time of a call and no kernels."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        profile = profile_kernels(lambda: [fn() for _ in range(iterations)])
        kernels = [[k["name"], round(k["ms"] / iterations, 4)] for k in profile["top_kernels"]]
        return profile["total_ms"] / iterations, kernels
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), []


def copy_gb_per_s(device: torch.device, warmup: int, iterations: int) -> float:
    """An element-wise kernel's rate (bytes read plus written: a BF16 negation), the roof for these kernels."""
    src = torch.zeros(128 << 20 if device.type == "cuda" else 1 << 16, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / kernel_ms(lambda: torch.neg(src, out=dst), warmup, iterations, device)[0] / 1e6


def bench_model(cfg: ModelConfig, name: str, args, device: torch.device, copy_rate: float) -> list[dict]:
    from recipes.fp8 import fused_quantize as kernels

    rows = []
    for op, a_shape, b_shape, out_cols in op_shapes(cfg, args.seq_length or cfg.seq_length):
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(a_shape, generator=generator, device=device).to(torch.bfloat16)
        b = None if b_shape is None else torch.randn(b_shape, generator=generator, device=device).to(torch.bfloat16)
        backward = op.endswith("_backward") or op == "identity"
        dtype = E5M2 if backward else E4M3
        read = a.numel() * 2 + (0 if b is None else b.numel() * 2)
        for mode in MODES:
            if mode == "bf16" and not op.endswith("_backward"):
                continue
            written = 2 * a_shape[0] * out_cols  # FP8 and its transpose, or BF16
            if mode == "blockwise":
                written += 2 * 4 * a_shape[0] * out_cols // 128  # an FP32 scale_inv per 1x128 block, both ways
            ms, launched = kernel_ms(_call(kernels, op, mode, a, b, dtype), args.warmup, args.iterations, device)
            gb_per_s = (read + written) / ms / 1e6
            rows.append({"model": name, "op": op, "mode": mode, "a": list(a_shape), "b": b_shape and list(b_shape),
                         "ms": round(ms, 4), "bytes": read + written,
                         "gb_per_s": round(gb_per_s, 1), "of_copy": round(gb_per_s / copy_rate, 3),
                         "kernels": launched})
            print(f"{name} {op} {mode}: {ms:.3f} ms, {gb_per_s:.0f} GB/s ({gb_per_s / copy_rate:.2f} of copy); "
                  + ", ".join(f"{k} {t:.3f}" for k, t in launched), flush=True)
    return rows


def markdown(rows: list[dict], copy_rate: float) -> str:
    lines = [f"Element-wise copy (BF16 negation): {copy_rate:.0f} GB/s", "",
             "| model | op | mode | a | ms | GB | GB/s | of copy | kernels (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = ", ".join(f"{k[:40]} {t:.3f}" for k, t in r["kernels"])
        lines.append(f"| {r['model']} | {r['op']} | {r['mode']} | {'x'.join(map(str, r['a']))} | {r['ms']:.3f} | "
                     f"{r['bytes'] / 1e9:.3f} | {r['gb_per_s']:.0f} | {r['of_copy']:.2f} | {kernels} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="conf/model option(s) (default llama3_8b)")
    parser.add_argument("--seq-length", type=int, help="tokens per call instead of the model's sequence length")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, help="directory for results.json and results.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.model or ["llama3_8b"]
    configs = [load_option("model", name) for name in names]
    copy_rate = copy_gb_per_s(device, args.warmup, args.iterations)
    print(f"element-wise copy: {copy_rate:.0f} GB/s", flush=True)
    rows = [row for cfg, name in zip(configs, names) for row in bench_model(cfg, name, args, device, copy_rate)]
    table = markdown(rows, copy_rate)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"copy_gb_per_s": copy_rate, "rows": rows}, indent=1))
        (args.out / "results.md").write_text(table)
        (args.out / "provenance.json").write_text(json.dumps({"command": sys.argv, **provenance()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
