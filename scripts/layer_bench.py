"""Time training steps of N decoder layers with a full model's shapes, in BF16 and FP8 recipes, in one process.

    python scripts/layer_bench.py --model llama3_8b --layers 4 --precisions bf16,fp8_current --out docs/results/layer_bench

One step = forward and backward of `--micro-batches` micro-batches (gradient accumulation, micro-batch 1, the
model's sequence length, random BF16 activations in place of the embedding) then one AdamW step, exactly the
engine's `optimizer_step`. No embedding or output layer: the blocks are what FP8 changes. Blocks are compiled
as in the engine. Each precision gets the same model code, compile settings, batch and seed; reported numbers
are medians over the steps after warm-up. Model TFLOP/s use `recipes.metrics.flops_per_token` without the
output layer, with causal attention counted half (Megatron-LM); a second column counts it whole (PaLM, torchtitan). Writes results.csv, results.md and provenance.json into --out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.config import ConfigError, ModelConfig, PrecisionConfig, TrainerConfig, load_option  # noqa: E402
from recipes.engine.training import build_optimizer, compile_blocks, optimizer_step  # noqa: E402
from recipes.fp8 import convert_to_fp8  # noqa: E402
from recipes.metrics import flops_per_token  # noqa: E402
from recipes.models.transformer import RotaryEmbedding, TransformerBlock, init_weights  # noqa: E402
from recipes.profiling import profile_kernels  # noqa: E402
from recipes.provenance import provenance  # noqa: E402


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg, rotary) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def bench_one(model_cfg: ModelConfig, precision: PrecisionConfig, args, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    with torch.device(device):
        stack = DecoderStack(model_cfg)
    init_weights(stack, model_cfg)
    convert_to_fp8(stack.layers, precision)
    if args.compile:
        compile_blocks(stack.layers)
    trainer = TrainerConfig(lr=1e-5, warmup_steps=0, max_steps=args.steps)
    optimizer = build_optimizer(stack, trainer, device)
    shape = (1, model_cfg.seq_length, model_cfg.hidden_size)
    # A few distinct inputs, rotated, so no step reuses the previous step's activations.
    inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4)]

    def micro_batch_loss(micro: int) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = stack(inputs[micro % len(inputs)])
        return out.float().square().mean()

    def training_step():
        return optimizer_step(micro_batch_loss, args.micro_batches, stack, optimizer, trainer.lr, trainer.grad_clip)

    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        _synchronize(device)
        start = time.perf_counter()
        loss, _ = training_step()
        _synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        print(f"  {precision.name:>14} step {step + 1}/{args.warmup + args.steps}: {time.perf_counter() - start:.3f} s", flush=True)
    step_time = statistics.median(times)
    kernel_profile = None
    if args.profile and device.type == "cuda":
        kernel_profile = profile_kernels(training_step)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in kernel_profile["share"].items())
        print(f"  {precision.name:>14} profile: {kernel_profile['total_ms']:.1f} ms of kernels: {shares}", flush=True)
        for kernel in kernel_profile["top_kernels"][:12]:
            print(f"      {kernel['ms']:8.2f} ms  {kernel['category']:>9}  {kernel['name']}")
    tokens = args.micro_batches * model_cfg.seq_length
    tflops = tokens * flops_per_token(model_cfg, include_output_layer=False) / step_time / 1e12
    tflops_full = tokens * flops_per_token(model_cfg, include_output_layer=False, causal=False) / step_time / 1e12
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del stack, optimizer, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        **row_identity(model_cfg, precision, args),
        "median_step_s": step_time,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "model_tflops": tflops,
        "model_tflops_full_attention": tflops_full,
        "tokens_per_s": tokens / step_time,
        "peak_memory_gib": peak,
        "last_loss": losses[-1],
        "profile": kernel_profile,
    }


def bench_or_report(model_cfg: ModelConfig, precision: PrecisionConfig, args, device: torch.device) -> dict:
    """A recipe that fails (no kernel, a compile error) is reported in the table, and the study goes on."""
    try:
        return bench_one(model_cfg, precision, args, device)
    except Exception as error:  # noqa: BLE001 - any failure of one recipe is a result to report
        print(f"  {precision.name:>14} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {**row_identity(model_cfg, precision, args), "error": str(error)[:500]}


def row_identity(model_cfg: ModelConfig, precision: PrecisionConfig, args) -> dict:
    """The columns that say what a result row measured."""
    return {
        "model": model_cfg.name,
        "layers": model_cfg.num_layers,
        "seq_length": model_cfg.seq_length,
        "micro_batches": args.micro_batches,
        "precision": precision.name,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="conf/model option(s); repeat for several (default llama3_8b)")
    parser.add_argument("--layers", type=int, action="append", help="decoder layers per --model, same order (default 4)")
    parser.add_argument("--precisions", default="bf16,fp8_current", help="comma-separated conf/precision options")
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--seq-length", type=int, help="override the model's sequence length (for quick checks)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run eagerly")
    parser.add_argument("--profile", action="store_true", help="profile one more step: GEMM / attention / other")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="directory for results.csv, results.md, provenance.json")
    args = parser.parse_args(argv)
    args.model = args.model or ["llama3_8b"]
    args.layers = args.layers or [4] * len(args.model)
    if len(args.layers) != len(args.model):
        parser.error("give one --layers per --model")
    return args


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| model | layers | seq | precision | median step (ms) | model TFLOP/s (Megatron, causal) | "
        "TFLOP/s (full attention) | speedup vs bf16 | peak mem (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['layers']} | {row['seq_length']} | {row['precision']} | "
                         f"failed: {row['error'].splitlines()[0][:80]} | | | | |")
            continue
        speedup = f"{row['speedup_vs_bf16']:.3f}x" if row["speedup_vs_bf16"] is not None else "n/a"
        lines.append(
            f"| {row['model']} | {row['layers']} | {row['seq_length']} | {row['precision']} | "
            f"{row['median_step_s'] * 1e3:.1f} | {row['model_tflops']:.1f} | {row['model_tflops_full_attention']:.1f} | "
            f"{speedup} | {row['peak_memory_gib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        precisions = [load_option("precision", name) for name in args.precisions.split(",")]
        models = [load_option("model", name) for name in args.model]
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = []
    for model_cfg, layers in zip(models, args.layers):
        model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
        if args.seq_length:
            model_cfg = dataclasses.replace(model_cfg, seq_length=args.seq_length)
        print(f"{model_cfg.name}: {layers} layers, seq {model_cfg.seq_length}, {args.micro_batches} micro-batches/step", flush=True)
        results = [bench_or_report(model_cfg, precision, args, device) for precision in precisions]
        baseline = next((r for r in results if r["precision"] == "bf16" and "error" not in r), None)
        for result in results:
            timed = baseline and "error" not in result
            result["speedup_vs_bf16"] = baseline["median_step_s"] / result["median_step_s"] if timed else None
        rows += results
    table = markdown_table(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.csv").open("w", newline="") as f:
            fields = list(dict.fromkeys(key for row in rows for key in row if key != "profile"))
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows({key: value for key, value in row.items() if key != "profile"} for row in rows)
        profiles = {f"{row['model']}/{row['precision']}": row["profile"] for row in rows if row.get("profile")}
        if profiles:
            (args.out / "profiles.json").write_text(json.dumps(profiles, indent=2) + "\n")
        (args.out / "results.md").write_text(table + "\n")
        command = "python scripts/layer_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
        (args.out / "provenance.json").write_text(json.dumps({"command": command, **provenance()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
