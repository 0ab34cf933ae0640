"""The study's GEMM figure on the local GPU: BF16 against each FP8 scaling granularity, over K and the models' shapes.

    python scripts/gemm_bench.py --out docs/results/h200_gemm
    python scripts/gemm_bench.py --out OUT --shapes sweep:8192,llama3_8b,llama3_8b/wgrad \
        --variants bf16,1x128_x_128x128,cutlass_tma_scales_1x128_x_128x128        # a part of it

Variants: bf16 (torch.mm), tensorwise (one scale per operand), rowwise (per-channel: one scale per row of A and per
column of B, as precision=fp8_rowwise quantizes them), 1x128 x 128x128, 1x128 x 1x128 and 128x128 x 1x128 blocks
(cuBLAS block scaling, Hopper; every pair the blockwise block dimensions train with), and the same three pairs
through issue 49's kernels of our own, not yet in the training path: recipes.fp8.block_gemm's in Triton (`triton_*`,
its tiles autotuned per shape in the warm-up) and recipes.fp8.cute_block_gemm's in CUTLASS's Python DSL
(`cutlass_*`, compiled per shape in the warm-up; `cutlass_multicast_*`: CTAs in pairs sharing their B tiles;
`cutlass_tma_scales_*`: 1x128-block scales copied by TMA with the tiles, from the producer kernel's column-major
layout; `cutlass_multicast_tma_scales_*`: both).
Operands are quantized by the recipes' own functions before timing: this measures the GEMMs, not quantization.
Per-tensor and per-channel GEMMs use fast accumulation (as fprop does in TE); block-scaled GEMMs have none. Shapes:
M = N = 8192 with a K sweep, and each model's four linear-layer GEMMs (QKV, attention output, fc1, fc2) at one
micro-batch of its sequence length; `--shapes` takes a part of them (shape_set), and the weight-gradient GEMMs too
(`MODEL/wgrad`: M and N the linear's output and input features, K its tokens), `--variants` a part of the variants
(BF16, every row's baseline, always among them). Times are medians of `--repeats`
CUDA-event-timed runs after warm-up, rotating between two input sets so no run reads the previous run's operands
from L2; nvidia-smi samples the SM clock and power meanwhile (every 20 ms: each row has the medians of the samples
taken while its variant was timed, empty where there were none). Writes gemm.csv (every shape, the format
scripts/compare.py --gemm reads), gemm_k_sweep.csv, gemm_speedup_vs_k.png and provenance.json (command, commit,
date, versions, device).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from recipes.config import Activation, load_option
from recipes.fp8.block_gemm import block_scaled_gemm
from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.current_scaling import quantize_tensorwise
from recipes.fp8.formats import E4M3
from recipes.fp8.gemm import fp8_gemm
from recipes.fp8.rowwise import quantize_rowwise
from recipes.profiling import describe_telemetry, gpu_telemetry, window_telemetry
from recipes.provenance import provenance
from recipes.report.gemm import read_gemm_csv
from recipes.report.plots import gemm_speedup_vs_k

MODELS = ["llama3_8b", "llama3_70b", "llama31_405b", "nemotron4_15b", "nemotron4_340b"]
K_SWEEP = [1024, 2048, 4096, 8192, 16384]


def model_gemm_shapes(name: str) -> list[tuple[str, int, int, int]]:
    """(label, M, N, K) of the fprop GEMMs of one transformer block at micro-batch 1."""
    m = load_option("model", name)
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    fc1 = 2 * m.ffn_hidden_size if m.activation == Activation.swiglu else m.ffn_hidden_size
    tokens = m.seq_length
    return [
        (f"{name}/qkv", tokens, q + 2 * kv, m.hidden_size),
        (f"{name}/out", tokens, m.hidden_size, q),
        (f"{name}/fc1", tokens, fc1, m.hidden_size),
        (f"{name}/fc2", tokens, m.hidden_size, m.ffn_hidden_size),
    ]


PAIRS = ("1x128_x_128x128", "1x128_x_1x128", "128x128_x_1x128")
VARIANTS = ("bf16", "tensorwise", "rowwise", *PAIRS,
            *(f"{kernel}_{p}" for kernel in ("triton", "cutlass", "cutlass_multicast", "cutlass_tma_scales",
                                             "cutlass_multicast_tma_scales") for p in PAIRS))


def variants(a: torch.Tensor, b: torch.Tensor,
             names: tuple[str, ...] = VARIANTS) -> dict[str, Callable[[], torch.Tensor]]:
    """a (M, K), b (N, K) in BF16 -> one zero-argument GEMM per variant in `names`, operands already quantized as the
    recipes quantize them (recipes.fp8) and multiplied by the product's own GEMM dispatch (recipes.fp8.gemm), or by
    issue 49's kernels of our own (`triton_*` and the `cutlass_*` variants)."""
    a8, b8 = quantize_tensorwise(a, E4M3), quantize_tensorwise(b, E4M3)
    a_rows, b_rows = quantize_rowwise(a, E4M3), quantize_rowwise(b, E4M3)
    a_1d, a_2d = quantize_blockwise(a, E4M3, ACTIVATION_BLOCK), quantize_blockwise(a, E4M3, WEIGHT_BLOCK)
    b_1d, b_2d = quantize_blockwise(b, E4M3, ACTIVATION_BLOCK), quantize_blockwise(b, E4M3, WEIGHT_BLOCK)
    # the block layouts a linear's GEMMs take (precision.x/w/grad_block_scaling_dim): fprop and dgrad of the default
    # 1D2D, every GEMM of fp8_blockwise_1d1d, fprop with 128x128 inputs (x dim 2)
    pairs = dict(zip(PAIRS, ((a_1d, b_2d), (a_1d, b_1d), (a_2d, b_1d))))
    bf16 = torch.bfloat16
    gemms = {
        "bf16": lambda: a @ b.t(),
        "tensorwise": lambda: fp8_gemm(a8, b8, bf16, fast_accum=True, emulate=False),
        "rowwise": lambda: fp8_gemm(a_rows, b_rows, bf16, fast_accum=True, emulate=False),  # precision=fp8_rowwise
    }
    for pair, (x, y) in pairs.items():
        gemms[pair] = lambda x=x, y=y: fp8_gemm(x, y, bf16, fast_accum=False, emulate=False)
        gemms[f"triton_{pair}"] = lambda x=x, y=y: block_scaled_gemm(x, y, bf16)
    if any(name.startswith("cutlass_") for name in names):
        # imported only for its columns: layer_bench times two variants and needs no CUTLASS DSL on the machine
        from recipes.fp8.cute_block_gemm import cute_block_scaled_gemm, kernel_scales

        for pair, (x, y) in pairs.items():
            gemms[f"cutlass_{pair}"] = lambda x=x, y=y: cute_block_scaled_gemm(x, y, bf16)
            gemms[f"cutlass_multicast_{pair}"] = lambda x=x, y=y: cute_block_scaled_gemm(x, y, bf16, cluster_m=2)
            # the scales as the producer kernel lays them out (column-major), so that the timed call copies none
            x_c, y_c = (t._replace(scale_inv=kernel_scales(t, True)) for t in (x, y))
            gemms[f"cutlass_tma_scales_{pair}"] = lambda x=x_c, y=y_c: cute_block_scaled_gemm(x, y, bf16,
                                                                                               scales_by_tma=True)
            gemms[f"cutlass_multicast_tma_scales_{pair}"] = lambda x=x_c, y=y_c: cute_block_scaled_gemm(
                x, y, bf16, cluster_m=2, scales_by_tma=True)
    return {name: gemms[name] for name in names}


def median_ms(gemms: list[Callable[[], torch.Tensor]], warmup: int, repeats: int) -> tuple[float, tuple]:
    """The median time of `repeats` calls after `warmup` (a kernel's compilation or autotuning happens there), and
    the (start, end) of the timed calls in time.time() seconds, for the clock they ran at."""
    for i in range(warmup):
        gemms[i % len(gemms)]()
    torch.cuda.synchronize()
    started = time.time()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemms[i % len(gemms)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (started, time.time())


LINEARS = ("qkv", "out", "fc1", "fc2")


def shape_set(spec: str) -> list[tuple[str, int, int, int]]:
    """The shapes one `--shapes` item names: `sweep` (M = N = 8192 over K_SWEEP) or `sweep:K`; a model's four fprop
    GEMMs (`llama3_8b`) or one (`llama3_8b/fc1`); with `/wgrad` after either, their weight-gradient GEMMs
    (label/wgrad, N, K, M: the linear's output gradient^T times its input, K the tokens). ValueError otherwise."""
    if spec == "sweep":
        return [("sweep M=N=8192", 8192, 8192, k) for k in K_SWEEP]
    if spec.startswith("sweep:"):
        k = spec.split(":", 1)[1]
        if not k.isdigit() or int(k) == 0:
            raise ValueError(f"--shapes {spec!r}: sweep takes one K as sweep:K, a positive integer")
        return [("sweep M=N=8192", 8192, 8192, int(k))]
    name, *rest = spec.split("/")
    wgrad = rest[-1:] == ["wgrad"]
    linear = rest[:-1] if wgrad else rest
    if name not in MODELS or len(linear) > 1 or (linear and linear[0] not in LINEARS):
        raise ValueError(f"--shapes {spec!r}: a shape set is sweep, sweep:K, MODEL, MODEL/LINEAR, or either with "
                         f"/wgrad (MODEL one of {', '.join(MODELS)}; LINEAR one of {', '.join(LINEARS)})")
    shapes = [s for s in model_gemm_shapes(name) if not linear or s[0] == f"{name}/{linear[0]}"]
    return [(f"{label}/wgrad", n, k, m) for label, m, n, k in shapes] if wgrad else shapes


def bench_shape(label: str, m: int, n: int, k: int, warmup: int = 5, repeats: int = 30,
                names: tuple[str, ...] = VARIANTS) -> list[dict]:
    input_sets = [
        variants(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16), names)
        for _ in range(2)
    ]
    rows, windows = [], []
    with gpu_telemetry(torch.device("cuda"), interval_ms=20) as telemetry:  # the clock each variant's calls ran at
        for variant in input_sets[0]:
            ms, window = median_ms([inputs[variant] for inputs in input_sets], warmup, repeats)
            windows.append(window)
            rows.append({"shape": label, "M": m, "N": n, "K": k, "variant": variant, "ms": ms,
                         "tflops": 2 * m * n * k / ms / 1e9})
    baseline = rows[0]["ms"]
    for row, window in zip(rows, windows):
        row["speedup"] = baseline / row["ms"]
        # nvidia-smi's samples while the variant was timed (none where its calls took under a sample's interval)
        clock = window_telemetry(telemetry, *window) or {}
        row["sm_clock_mhz"], row["power_w"] = clock.get("sm_clock_mhz"), clock.get("power_w")
    print(f"{label:>28}  M={m:<6} N={n:<6} K={k:<6} " + "  ".join(f"{r['variant']} {r['tflops']:.0f}" for r in rows)
          + f"  ({describe_telemetry(telemetry)})", flush=True)
    return rows


def write_records(rows: list[dict], out: Path, argv: list[str] | None) -> None:
    """gemm.csv (every shape), gemm_k_sweep.csv and its plot, and provenance.json: the command, commit, date (UTC),
    versions and device."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gemm.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    sweep_csv = out / "gemm_k_sweep.csv"
    with sweep_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if r["shape"].startswith("sweep"))
    sweep_rows, _ = read_gemm_csv(sweep_csv, str(sweep_csv))  # the compare tool's reader, so both plot alike
    if sweep_rows:
        gemm_speedup_vs_k(sweep_rows, out / "gemm_speedup_vs_k.png")
    command = "python scripts/gemm_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **provenance()}
    (out / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gemm.csv, the PNG and provenance.json")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", default=",".join(["sweep", *MODELS]),
                        help="comma-separated shape sets (shape_set): sweep, sweep:K, MODEL, MODEL/LINEAR, with "
                             "/wgrad for the weight-gradient GEMMs; default: the figure's, sweep and every model")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to time (bf16, the baseline, always); default: all")
    args = parser.parse_args(argv)
    try:
        shapes = [shape for spec in args.shapes.split(",") for shape in shape_set(spec)]
    except ValueError as error:
        parser.error(str(error))
    names = ("bf16", *dict.fromkeys(v for v in args.variants.split(",") if v != "bf16"))
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; the variants: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        print("error: the GEMM benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [row for shape in shapes for row in bench_shape(*shape, args.warmup, args.repeats, names)]
    write_records(rows, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
