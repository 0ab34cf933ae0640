"""Time training steps of N decoder layers with a full model's shapes, in BF16 and FP8 recipes, in one process.

    python scripts/layer_bench.py --model llama3_8b --layers 4 --precisions bf16,fp8_current --out docs/results/layer_bench

One step = forward and backward of `--micro-batches` micro-batches (gradient accumulation, micro-batch 1, the
model's sequence length, random BF16 activations in place of the embedding) then one AdamW step, exactly the
engine's `optimizer_step`. No embedding or output layer: the blocks are what FP8 changes. Blocks are compiled
as in the engine. Each precision gets the same model code, compile settings, batch and seed; reported numbers
are medians over the steps after warm-up. Model TFLOP/s use `recipes.metrics.flops_per_token` without the
output layer, with causal attention counted half (Megatron-LM); a second column counts it whole (PaLM, torchtitan). Writes results.csv, results.md and provenance.json (command, commit, date, versions, device) into --out.

`--peer torchao` adds torchao's float8 tensorwise training (`convert_to_float8_training`, recipe "tensorwise") on
the same blocks in the same process, as the outside reference for the per-tensor recipes. `--peer te` adds
Transformer Engine's layers (scripts/te_peer.py) in each of TE's recipes (or those `--te-recipes` names), with the
same shapes, micro-batches, inputs, loss, AdamW (fused, weight decay on matrices) and timing, trained with BF16
parameters and BF16 gradients summed by autograd; `--peer te_megatron` adds them trained as Megatron-LM trains
them, with the work ours does: FP32 main gradients summed inside TE's weight-gradient GEMMs and FP32 master
weights. How a TE column differs from ours beyond that: eager (ours: each block compiled), TE's fused kernels and
its attention backend choice (cuDNN fused attention on Hopper; ours: PyTorch SDPA under the model's own order,
cuDNN's fused attention first: recipes.models.attention).

With `--profile`, each step's kernel time is split into GEMMs / attention / FP8 quantization / other (recipes.profiling),
the time the GPU sat idle is split into gaps between queued kernels and waits for the host, and the "limit" column is
the step speedup if every linear-layer GEMM ran at the FP8/BF16 rate ratio that `scripts/gemm_bench.py` measures
for this model's four fprop GEMM shapes (per-tensor, timed here in the same process) and quantization cost
nothing: bf16_kernels / (bf16_kernels - gemm + gemm / ratio). dgrad and wgrad have the same FLOPs as fprop with
transposed shapes; the fprop ratio stands in for theirs. On a GPU, nvidia-smi samples the SM clock and power
during the timed steps of each column (recipes.profiling.gpu_telemetry), and each step's time is printed with the
clock and power it ran at: the same kernels run a few percent slower while the GPU holds its clock down under its
power limit.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import yaml
from torch import nn
from torch._dynamo.utils import counters

from recipes.compute import compute_dtype
from recipes.config import ComputeDtype, ConfigError, ModelConfig, TrainerConfig, load_option
from recipes.engine.training import build_optimizer, compile_blocks, optimizer_step
from recipes.fp8 import Fp8Training
from recipes.metrics import flops_per_token
from recipes.models.transformer import RotaryEmbedding, TransformerBlock, init_weights
from recipes.profiling import (
    describe_idle, describe_telemetry, describe_time_split, gpu_telemetry, profile_kernels, window_telemetry,
)
from recipes.provenance import provenance

# Sibling scripts: scripts/, this script's folder, is on sys.path.
from gemm_bench import bench_shape, model_gemm_shapes
from te_peer import TE_RECIPES, MegatronStyleTraining, TeDecoderStack, import_transformer_engine, te_recipe

TORCHAO_PEER = "torchao_tensorwise"


class Trainee(NamedTuple):
    """What a column trains: the module whose parameters the optimizer updates (the blocks, or the FP32 master
    weights of TE's BF16 layers), the loss of one micro-batch (input, micro-batch index), and the object whose
    hooks the engine's optimizer step calls (the FP8 object; BF16's, which does nothing, for TE's own FP8)."""

    model: nn.Module
    loss: Callable[[torch.Tensor, int], torch.Tensor]
    fp8: Fp8Training


class Variant(NamedTuple):
    """One column of the study: a name and how it builds its blocks for a model on a device."""

    name: str
    build: Callable[[ModelConfig, argparse.Namespace, torch.device], Trainee]


def squared_output(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def ours(name: str, convert: Callable[[nn.Module, int, torch.device], Fp8Training]) -> Variant:
    """Our blocks (recipes.models) converted by `convert` (for steps of so many micro-batches on the device; it
    returns the FP8 object of the step), then compiled as the torch engine does it in one process; BF16 autocast
    (none with --compute-dtype resolving to FP32, as the engine on a CPU without native BF16)."""

    def build(model_cfg: ModelConfig, args, device: torch.device) -> Trainee:
        with torch.device(device):
            stack = DecoderStack(model_cfg)
        init_weights(stack, model_cfg)
        fp8 = convert(stack, args.micro_batches, device)
        if args.compile:
            compile_blocks(stack.layers)

        def loss(x: torch.Tensor, micro: int) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == torch.bfloat16):
                return squared_output(stack(x))

        return Trainee(stack, loss, fp8)

    return Variant(name, build)


def precision_variant(spec: str) -> Variant:
    """A conf/precision option, optionally with field overrides: `fp8_current`, `bf16:fused_kernels=false`."""
    name, *overrides = spec.split(":")
    precision = load_option("precision", name)
    for override in overrides:
        key, _, value = override.partition("=")
        if key not in {f.name for f in dataclasses.fields(precision)}:
            raise ConfigError(f"--precisions {spec}: precision has no field '{key}'")
        precision = dataclasses.replace(precision, **{key: yaml.safe_load(value)})

    def convert(stack: nn.Module, micro_batches: int, device: torch.device) -> Fp8Training:
        fp8 = Fp8Training.for_one_process(precision, micro_batches, device)
        fp8.convert(stack)
        return fp8

    return ours(spec, convert)


def torchao_variant() -> Variant:
    def convert(stack: nn.Module, micro_batches: int, device: torch.device) -> Fp8Training:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(stack.layers, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        return Fp8Training(load_option("precision", "bf16"))  # torchao's FP8 needs no call from the step

    return ours(TORCHAO_PEER, convert)


def te_variant(peer: str, recipe_name: str) -> Variant:
    """Transformer Engine's layers (scripts/te_peer.py), eager, in TE's recipe `recipe_name`; trained with BF16
    gradients and parameters (peer "te") or as Megatron-LM trains them (peer "te_megatron")."""
    column = f"{peer}_{recipe_name}"

    def build(model_cfg: ModelConfig, args, device: torch.device) -> Trainee:
        te = import_transformer_engine()
        recipe = te_recipe(recipe_name, column)
        megatron_style = peer == "te_megatron"
        stack = TeDecoderStack(model_cfg, fuse_wgrad_accumulation=megatron_style)

        def loss(x: torch.Tensor, micro: int) -> torch.Tensor:
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                out = stack(x, is_first_microbatch=micro == 0)
            return squared_output(out)

        if megatron_style:
            training = MegatronStyleTraining(stack)
            return Trainee(training.masters, loss, training)
        return Trainee(stack, loss, Fp8Training(load_option("precision", "bf16")))  # TE's FP8: in its layers

    return Variant(column, build)


def te_columns(peer: str, recipes: list[str] | None = None) -> list[Variant]:
    """The peer's column in each of `recipes` (default: TE_RECIPES, MXFP8 only where TE says it runs: Blackwell)."""
    te = import_transformer_engine()
    if recipes is None:
        recipes = [name for name in TE_RECIPES if name != "mxfp8" or te.is_mxfp8_available()]
    return [te_variant(peer, name) for name in recipes]


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg, rotary) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def bench_one(model_cfg: ModelConfig, variant: Variant, args, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    torch._dynamo.reset()
    counters.clear()
    # The previous column's model and optimizer hold reference cycles: freed only by the collector, whose timing
    # would otherwise put their memory into this column's peak.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trainee = variant.build(model_cfg, args, device)
    stack = trainee.model
    trainer = TrainerConfig(lr=1e-5, warmup_steps=0, max_steps=args.steps)
    optimizer = build_optimizer(stack, trainer, device)
    shape = (1, model_cfg.seq_length, model_cfg.hidden_size)
    # A few distinct inputs, rotated, so no step reuses the previous step's activations.
    inputs = [torch.randn(shape, device=device, dtype=args.dtype) for _ in range(4)]

    def micro_batch_loss(micro: int) -> torch.Tensor:
        return trainee.loss(inputs[micro % len(inputs)], micro) / args.micro_batches

    def training_step():
        return optimizer_step(micro_batch_loss, args.micro_batches, stack, trainee.fp8, optimizer, trainer.lr,
                              trainer.grad_clip)

    def timed_step(step: int) -> tuple[float, float, tuple[float, float]]:
        """(seconds, loss, (start, end) in time.time()) of one training step."""
        _synchronize(device)
        start, wall_start = time.perf_counter(), time.time()
        loss, _ = training_step()
        _synchronize(device)
        seconds = time.perf_counter() - start
        print(f"  {variant.name:>18} step {step + 1}/{args.warmup + args.steps}: {seconds:.3f} s", flush=True)
        return seconds, loss.item(), (wall_start, time.time())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup):
        timed_step(step)
    with gpu_telemetry(device) as telemetry:  # the clock and power of the timed steps
        times, losses, windows = zip(*(timed_step(step) for step in range(args.warmup, args.warmup + args.steps)))
    print(f"  {variant.name:>18} {describe_telemetry(telemetry)}", flush=True)
    step_clocks = [window_telemetry(telemetry, *window) for window in windows]
    if any(step_clocks):
        print(f"  {variant.name:>18} per step: " + ", ".join(
            f"{seconds * 1e3:.1f} ms" + (f" at {clock['sm_clock_mhz']:.0f} MHz, {clock['power_w']:.0f} W" if clock
                                          else "") for seconds, clock in zip(times, step_clocks)), flush=True)
    step_time = statistics.median(times)
    kernel_profile = None
    if args.profile and device.type == "cuda":
        kernel_profile = profile_kernels(training_step)
        print(f"  {variant.name:>18} profile: {describe_time_split(kernel_profile)}", flush=True)
        for kernel in kernel_profile["top_kernels"][:12]:
            print(f"      {kernel['ms']:8.2f} ms  {kernel['calls']:5d} calls  {kernel['category']:>9}  "
                  f"{kernel['name']}")
        for kernel in kernel_profile["most_called"][:5]:
            print(f"      {kernel['calls']:5d} calls  {kernel['ms']:8.2f} ms  (most called)  {kernel['name']}")
        print(f"  {variant.name:>18} timeline: {describe_idle(kernel_profile['idle'])}", flush=True)
        for gap in kernel_profile["idle"]["longest_gaps"][:4]:
            print(f"      {gap['ms']:8.3f} ms idle at {gap['at_ms']:.1f} ms, after {gap['after'][:50]}, before "
                  f"{gap['before'][:50]}")
    tokens = args.micro_batches * model_cfg.seq_length
    tflops = tokens * flops_per_token(model_cfg, include_output_layer=False) / step_time / 1e12
    tflops_full = tokens * flops_per_token(model_cfg, include_output_layer=False, causal=False) / step_time / 1e12
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del trainee, stack, optimizer, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        **row_identity(model_cfg, variant, args),
        "graph_breaks": sum(counters["graph_break"].values()),
        "median_step_s": step_time,
        "mean_step_s": statistics.mean(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "model_tflops": tflops,
        "model_tflops_full_attention": tflops_full,
        "tokens_per_s": tokens / step_time,
        "peak_memory_gib": peak,
        "last_loss": losses[-1],
        **{key: telemetry.get(key) for key in ("sm_clock_mhz", "power_w", "power_limit_w", "temperature_c",
                                               "power_capped_share")},
        "step_ms": [round(seconds * 1e3, 2) for seconds in times],
        "step_sm_clock_mhz": [clock and clock["sm_clock_mhz"] for clock in step_clocks],
        "profile": kernel_profile,
    }


def bench_or_report(model_cfg: ModelConfig, variant: Variant, args, device: torch.device) -> dict:
    """A recipe that fails (no kernel, a compile error) is reported in the table, and the study goes on."""
    try:
        return bench_one(model_cfg, variant, args, device)
    except Exception as error:  # noqa: BLE001 - any failure of one recipe is a result to report
        print(f"  {variant.name:>18} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {**row_identity(model_cfg, variant, args), "error": str(error)[:500]}


def compare_to_bf16(model_cfg: ModelConfig, results: list[dict]) -> None:
    """Each row's speedup over the fastest BF16 column, and the GEMM limit from our BF16 column's profile."""
    baseline = strongest_bf16(results)
    ours_bf16 = next((r for r in results if r["precision"] == "bf16" and "error" not in r), None)
    limit = gemm_limit(model_cfg.name, ours_bf16["profile"]) if ours_bf16 and ours_bf16["profile"] else {}
    if baseline:
        print(f"  BF16 baseline: {baseline['precision']} ({baseline['median_step_s'] * 1e3:.1f} ms), the fastest "
              "BF16 column of this run", flush=True)
    if limit:
        print(f"  GEMM share of the bf16 step {limit['gemm_share']:.0%}, per-tensor FP8/BF16 GEMM ratio "
              f"{limit['gemm_fp8_ratio']:.2f}: limit {limit['limit']:.3f}x", flush=True)
    for result in results:
        timed = baseline and "error" not in result
        result["speedup_vs_bf16"] = baseline["median_step_s"] / result["median_step_s"] if timed else None
        result["bf16_baseline"] = baseline["precision"] if baseline else None
        result.update(limit)
        if limit and result["speedup_vs_bf16"] is not None:
            result["gain_captured"] = (result["speedup_vs_bf16"] - 1) / (limit["limit"] - 1)


def strongest_bf16(results: list[dict]) -> dict | None:
    """The fastest BF16 column (ours in any variant, or a peer's): every speedup of the run is against it."""
    bf16 = [r for r in results if "error" not in r and r["precision"].split(":")[0].endswith("bf16")]
    return min(bf16, key=lambda r: r["median_step_s"], default=None)


def gemm_limit(model_name: str, bf16_profile: dict) -> dict:
    """The FP8 step-speedup limit from the BF16 profile's GEMM share and the per-tensor GEMM ratio (module doc)."""
    shapes = [row for shape in model_gemm_shapes(model_name) for row in bench_shape(*shape)]
    ms = {variant: sum(r["ms"] for r in shapes if r["variant"] == variant) for variant in ("bf16", "tensorwise")}
    ratio = ms["bf16"] / ms["tensorwise"]
    total, gemm = bf16_profile["total_ms"], bf16_profile["ms"]["gemm"]
    return {"gemm_share": gemm / total, "gemm_fp8_ratio": ratio, "limit": total / (total - gemm + gemm / ratio)}


def row_identity(model_cfg: ModelConfig, variant: Variant, args) -> dict:
    """The columns that say what a result row measured."""
    return {
        "model": model_cfg.name,
        "layers": model_cfg.num_layers,
        "seq_length": model_cfg.seq_length,
        "micro_batches": args.micro_batches,
        "precision": variant.name,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="conf/model option(s); repeat for several (default llama3_8b)")
    parser.add_argument("--layers", type=int, action="append", help="decoder layers per --model, same order (default 4)")
    parser.add_argument("--precisions", default="bf16,fp8_current",
                        help="comma-separated conf/precision options, each optionally with field overrides, e.g. "
                             "bf16:fused_kernels=false")
    parser.add_argument("--peer", choices=["torchao", "te", "te_megatron"], action="append",
                        help="add peer columns: torchao's float8 tensorwise training; Transformer Engine's layers "
                             "with BF16 gradients (te_bf16, te_current, te_delayed, te_blockwise, te_mxfp8 on "
                             "Blackwell) or trained as Megatron-LM trains them (te_megatron_bf16, ...); repeatable")
    parser.add_argument("--te-recipes", help=f"comma-separated TE recipes of the te and te_megatron columns, of "
                                             f"{','.join(TE_RECIPES)} (default: all that run on this GPU)")
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--seq-length", type=int, help="override the model's sequence length (for quick checks)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run eagerly")
    parser.add_argument("--profile", action="store_true", help="profile one more step: GEMM / attention / other")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute-dtype", type=ComputeDtype, choices=list(ComputeDtype), default=ComputeDtype.auto,
                        help="as trainer.compute_dtype: auto (BF16; FP32 on a CPU without native BF16), bf16, fp32")
    parser.add_argument("--out", type=Path, help="directory for results.csv, results.md, provenance.json")
    args = parser.parse_args(argv)
    args.model = args.model or ["llama3_8b"]
    args.layers = args.layers or [4] * len(args.model)
    if len(args.layers) != len(args.model):
        parser.error("give one --layers per --model")
    if args.te_recipes is not None:
        args.te_recipes = args.te_recipes.split(",")
        unknown = [name for name in args.te_recipes if name not in TE_RECIPES]
        if unknown or not args.peer or not {"te", "te_megatron"} & set(args.peer):
            parser.error(f"--te-recipes {','.join(args.te_recipes)}: give TE recipes of {', '.join(TE_RECIPES)}, "
                         "with --peer te or --peer te_megatron")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} --warmup {args.warmup}: time at least one step, after 0 or more warm-up")
    return args


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| model | layers | seq | precision | median step (ms) | model TFLOP/s (Megatron, causal) | "
        "TFLOP/s (full attention) | speedup vs fastest bf16 | limit | gain captured | peak mem (GiB) | "
        "kernels: GEMM / attention / quantization / other (ms) | GPU idle: queued / waits (ms) | "
        "SM clock (MHz) / power (W) | graph breaks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['layers']} | {row['seq_length']} | {row['precision']} | "
                         f"failed: {row['error'].splitlines()[0][:80]} | | | | | | | | | | |")
            continue
        speedup = f"{row['speedup_vs_bf16']:.3f}x" if row.get("speedup_vs_bf16") is not None else "n/a"
        limit = f"{row['limit']:.3f}x" if row.get("limit") else "n/a"
        captured = f"{row['gain_captured']:.0%}" if row.get("gain_captured") is not None else "n/a"
        split = " / ".join(f"{row['profile']['ms'][k]:.1f}" for k in ("gemm", "attention", "quantization", "other")) if row.get("profile") else "n/a"
        idle = (f"{row['profile']['idle']['queued_gaps_ms']:.1f} / {row['profile']['idle']['wait_gaps_ms']:.1f}"
                if row.get("profile") else "n/a")
        clock = f"{row['sm_clock_mhz']:.0f} / {row['power_w']:.0f}" if row.get("sm_clock_mhz") is not None else "n/a"
        lines.append(
            f"| {row['model']} | {row['layers']} | {row['seq_length']} | {row['precision']} | "
            f"{row['median_step_s'] * 1e3:.1f} | {row['model_tflops']:.1f} | {row['model_tflops_full_attention']:.1f} | "
            f"{speedup} | {limit} | {captured} | {row['peak_memory_gib']:.1f} | {split} | {idle} | {clock} | "
            f"{row['graph_breaks']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        args.dtype = compute_dtype(args.compute_dtype, device.type)
        variants = [precision_variant(name) for name in args.precisions.split(",")]
        models = [load_option("model", name) for name in args.model]
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    peers = args.peer or []
    if "torchao" in peers:
        variants.append(torchao_variant())
    for peer in ("te", "te_megatron"):
        if peer in peers:
            try:
                variants += te_columns(peer, args.te_recipes)
            except RuntimeError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
    rows = []
    for model_cfg, layers in zip(models, args.layers):
        model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
        if args.seq_length:
            model_cfg = dataclasses.replace(model_cfg, seq_length=args.seq_length)
        print(f"{model_cfg.name}: {layers} layers, seq {model_cfg.seq_length}, {args.micro_batches} micro-batches/step", flush=True)
        results = []
        for variant in variants:
            results.append(bench_or_report(model_cfg, variant, args, device))
            if args.out:  # after every column, so a run cut short keeps what it measured
                write_results(rows + results, args, argv)
        compare_to_bf16(model_cfg, results)
        rows += results
        if args.out:
            write_results(rows, args, argv)
    print(markdown_table(rows))
    return 0


def write_results(rows: list[dict], args, argv: list[str] | None) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.csv").open("w", newline="") as f:
        fields = list(dict.fromkeys(key for row in rows for key in row if key != "profile"))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({key: value for key, value in row.items() if key != "profile"} for row in rows)
    profiles = {f"{row['model']}/{row['precision']}": row["profile"] for row in rows if row.get("profile")}
    if profiles:
        (args.out / "profiles.json").write_text(json.dumps(profiles, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown_table(rows) + "\n")
    command = "python scripts/layer_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **provenance()}
    (args.out / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
