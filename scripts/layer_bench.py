"""Time training steps of N decoder layers with a full model's shapes, in BF16 and FP8 recipes, in one process.

    python scripts/layer_bench.py --model llama3_8b --layers 4 --precisions bf16,fp8_current --out docs/results/layer_bench

One step = forward and backward of `--micro-batches` micro-batches (gradient accumulation, micro-batch 1, the
model's sequence length, random BF16 activations in place of the embedding) then one AdamW step, exactly the
engine's `optimizer_step`. No embedding or output layer: the blocks are what FP8 changes. Blocks are compiled
as in the engine. Each precision gets the same model code, compile settings, batch and seed. Model TFLOP/s use
`recipes.metrics.flops_per_token` without the output layer, with causal attention counted half (Megatron-LM); a
second column counts it whole (PaLM, torchtitan). Writes results.csv, results.md and provenance.json (command,
date, versions, device, and the commit: git's, FP8_RECIPES_COMMIT's in a copy without .git, else "unknown") into
--out; the console says the commit first.

How columns are timed: in each of `--rounds` rounds (default 2) every column is built, warmed up (`--warmup`
steps), timed for `--steps` steps and freed, in the order given in even rounds and in reverse in odd ones, so that
no column always runs first and a steady drift of the GPU's clock or temperature over the study falls on every
column alike. One column is built at a time, since a large proxy's columns do not fit in one GPU together
(nemotron4_340b's one layer peaks near 70 GiB); built again, a column is the same (same seed; compiled graphs come
from the compile caches). A row gives the median over all the column's timed steps (`--steps` x `--rounds`, 10 by
default) beside their spread (min-max), and the median SM clock and power over them: on a GPU nvidia-smi samples
them during the timed steps (recipes.profiling.gpu_telemetry), and each step's time is printed with the clock and
power it ran at, since the same kernels run a few percent slower while the GPU holds its clock down under its
power limit.

`--peer torchao` adds torchao's float8 training (`convert_to_float8_training`) on the same blocks in the same
process, a column per recipe of `--torchao-recipes` (default all: "tensorwise", the outside reference for the
per-tensor recipes; "rowwise" and "rowwise_with_gw_hp", for precision=fp8_rowwise and fp8_rowwise_gw_hp). The
other peers have a column in each of TE's recipes (or those `--te-recipes` names; blockwise_1d1d, TE's
Float8BlockScaling with 1x128 weight blocks as precision=fp8_blockwise_1d1d has them, only when named), with the
same shapes, micro-batches, inputs, loss, optimizer hyper-parameters (TRAINER's; weight decay on matrices only)
and timing:
- `--peer te`: Transformer Engine's layers (scripts/te_peer.py) with BF16 parameters and BF16 gradients summed by
  autograd, torch's fused AdamW on the BF16 parameters (TE's examples);
- `--peer te_megatron`: the same layers trained as Megatron-LM trains them: FP32 main gradients summed inside
  TE's weight-gradient GEMMs, clipped as ours; TE's FusedAdam with FP32 master weights: with BF16 weights it keeps
  the masters itself (as the 16 bits the BF16 weights lack) and writes the BF16 weights in its kernel; with FP8
  primary weights, where Megatron's preset keeps them (current and delayed scaling, MXFP8; TE's FP8 model init),
  FusedAdam steps the masters and they are cast into the FP8 weights as megatron-core's distributed optimizer casts
  them, with engine=megatron's row-wise cast (recipes.megatron.master_cast);
- `--peer megatron_layer`: megatron-core's own TransformerLayers with Transformer Engine's spec
  (scripts/megatron_layer_peer.py), configured by recipes.megatron.translate as engine=megatron configures them,
  trained by megatron-core's DistributedDataParallel, schedule and distributed optimizer on one GPU;
- `--peer megatron_layer_fp32_grads`: the same with an FP32 gradient buffer (megatron.grad_reduce_in_fp32=true)
  where NVIDIA's setting, engine=megatron's default, is BF16: the precision in which ours and te_megatron sum the
  weight gradients over micro-batches, so that the one setting where megatron_layer's work differs from ours is
  measured both ways.
How a TE column differs from ours beyond that: eager (ours: each block compiled), TE's fused kernels and its
attention backend choice (cuDNN fused attention on Hopper; ours: PyTorch SDPA under the model's own order,
cuDNN's fused attention first: recipes.models.attention), activations in (seq, batch, hidden) (ours: batch
first); the optimizer: TE's FusedAdam (ours: torch's fused AdamW on FP32 weights, which the forward casts to BF16
or quantizes to FP8 once per step), and in te_megatron's current and delayed columns FP8 weights between steps.
A megatron_layer column further: megatron-core's layer code, its fusions as translate resolves them and its
gradient buffer's precision (cfg.megatron's defaults: printed when the column is built), its gradient hooks and
schedule, and its optimizer: FusedAdam on FP32 masters, then the BF16 weights copied from them (or the FP8
weights cast) in a pass of their own.

With `--profile`, one more step per column (in the last round) has its kernel time split into GEMMs / attention /
FP8 quantization / other (recipes.profiling), the time the GPU sat idle split into gaps between queued kernels and
waits for the host, and the "limit" column is the step speedup if every linear-layer GEMM ran at the FP8/BF16 rate
ratio that `scripts/gemm_bench.py` measures for this model's four fprop GEMM shapes (per-tensor, timed here in the
same process) and quantization cost nothing: bf16_kernels / (bf16_kernels - gemm + gemm / ratio). dgrad and wgrad
have the same FLOPs as fprop with transposed shapes; the fprop ratio stands in for theirs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

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
from te_peer import (
    DEFAULT_TE_RECIPES, TE_RECIPES, MegatronStyleTraining, TeDecoderStack, fp8_primary_weights,
    import_transformer_engine, one_process_group, te_recipe,
)

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearConfig.from_recipe_name's; column
# name: f"torchao_{recipe}"
MEGATRON_PEERS = ("megatron_layer", "megatron_layer_fp32_grads")  # megatron-core's layers: TE needed beyond BF16
RECIPE_PEERS = ("te", "te_megatron", *MEGATRON_PEERS)  # a column per TE recipe (--te-recipes)
PEERS = ("torchao", *RECIPE_PEERS)  # torchao: a column per torchao recipe (--torchao-recipes)
# Every column's optimizer: AdamW's betas, epsilon, weight decay and clipping are TrainerConfig's defaults.
TRAINER = TrainerConfig(lr=1e-5, warmup_steps=0)

Step = Callable[[Sequence[torch.Tensor]], torch.Tensor]
"""A built column's training step: forward and backward of each micro-batch input (batch, seq, hidden), the update;
returns the step's loss, the mean over the micro-batches of the mean squared output."""


class Variant(NamedTuple):
    """One column of the study: a name and how it builds its layers and their training for a model on a device."""

    name: str
    build: Callable[[ModelConfig, argparse.Namespace, torch.device], Step]


def squared_output(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def engine_step(model: nn.Module, fp8: Fp8Training, loss_of: Callable[[torch.Tensor, int], torch.Tensor],
                device: torch.device) -> Step:
    """The torch engine's step (recipes.engine.training.optimizer_step) on `model`: AdamW on its parameters,
    `fp8`'s hooks, `loss_of(x, micro)` the loss of micro-batch `micro` with input x."""
    optimizer = build_optimizer(model, TRAINER, device)

    def step(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        loss, _ = optimizer_step(lambda micro: loss_of(inputs[micro], micro) / len(inputs), len(inputs), model, fp8,
                                 optimizer, TRAINER.lr, TRAINER.grad_clip)
        return loss

    return step


def ours(name: str, convert: Callable[[nn.Module, int, torch.device], Fp8Training]) -> Variant:
    """Our blocks (recipes.models) converted by `convert` (for steps of so many micro-batches on the device; it
    returns the FP8 object of the step), then compiled as the torch engine does it in one process; BF16 autocast
    (none with --compute-dtype resolving to FP32, as the engine on a CPU without native BF16)."""

    def build(model_cfg: ModelConfig, args, device: torch.device) -> Step:
        with torch.device(device):
            stack = DecoderStack(model_cfg)
        init_weights(stack, model_cfg)
        fp8 = convert(stack, args.micro_batches, device)
        if args.compile:
            compile_blocks(stack.layers)

        def loss_of(x: torch.Tensor, micro: int) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == torch.bfloat16):
                return squared_output(stack(x))

        return engine_step(stack, fp8, loss_of, device)

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


def torchao_variant(recipe: str) -> Variant:
    def convert(stack: nn.Module, micro_batches: int, device: torch.device) -> Fp8Training:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(stack.layers, config=Float8LinearConfig.from_recipe_name(recipe))
        return Fp8Training(load_option("precision", "bf16"))  # torchao's FP8 needs no call from the step

    return ours(f"torchao_{recipe}", convert)


def te_variant(peer: str, recipe_name: str) -> Variant:
    """Transformer Engine's layers (scripts/te_peer.py), eager, in TE's recipe `recipe_name`; trained with BF16
    gradients and parameters (peer "te") or as Megatron-LM trains them (peer "te_megatron": FP8 weights where
    Megatron's preset keeps them)."""
    column = f"{peer}_{recipe_name}"

    def build(model_cfg: ModelConfig, args, device: torch.device) -> Step:
        te = import_transformer_engine()
        recipe = te_recipe(recipe_name, column)
        megatron_style = peer == "te_megatron"
        fp8_weights = megatron_style and fp8_primary_weights(recipe_name)
        stack = TeDecoderStack(model_cfg, fuse_wgrad_accumulation=megatron_style,
                               fp8_weights_recipe=recipe if fp8_weights else None)

        def loss_of(x: torch.Tensor, micro: int) -> torch.Tensor:
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                out = stack(x, is_first_microbatch=micro == 0)
            return squared_output(out)

        if not megatron_style:  # TE's FP8 is in its layers: the step's FP8 object is BF16's, which does nothing
            return engine_step(stack, Fp8Training(load_option("precision", "bf16")), loss_of, device)
        training = MegatronStyleTraining(stack, TRAINER, one_process_group(device))
        return lambda inputs: training.step(lambda micro: loss_of(inputs[micro], micro) / len(inputs), len(inputs))

    return Variant(column, build)


def megatron_layer_variant(recipe_name: str, fp32_grads: bool = False) -> Variant:
    """megatron-core's own layers (scripts/megatron_layer_peer.py) with the conf/precision preset of TE's recipe
    `recipe_name`, trained as engine=megatron trains them; `fp32_grads`: with an FP32 gradient buffer."""
    column = f"megatron_layer_{'fp32_grads_' if fp32_grads else ''}{recipe_name}"

    def build(model_cfg: ModelConfig, args, device: torch.device) -> Step:
        from megatron_layer_peer import MegatronLayerTraining, megatron_config

        if recipe_name != "bf16":
            te_recipe(recipe_name, column)  # refuses a recipe TE cannot run here, naming the column
        cfg = megatron_config(model_cfg, recipe_name, TRAINER, args.micro_batches)
        if fp32_grads:
            cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, grad_reduce_in_fp32=True))
        training = MegatronLayerTraining(cfg, device, args.dtype, squared_output)
        print(f"  {column:>24} {training.description}", flush=True)
        return training.step

    return Variant(column, build)


def peer_columns(peer: str, recipes: list[str] | None = None) -> list[Variant]:
    """A peer's column in each of `recipes` (default: DEFAULT_TE_RECIPES, MXFP8 only where TE says it runs:
    Blackwell). TE's own layers need TE here; megatron-core's, given BF16 alone, build without it (its local spec)."""
    if recipes is None:
        te = import_transformer_engine()
        recipes = [name for name in DEFAULT_TE_RECIPES if name != "mxfp8" or te.is_mxfp8_available()]
    elif peer not in MEGATRON_PEERS:
        import_transformer_engine()
    if peer in MEGATRON_PEERS:
        return [megatron_layer_variant(name, fp32_grads=peer == "megatron_layer_fp32_grads") for name in recipes]
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


def bench_model(model_cfg: ModelConfig, variants: list[Variant], args, device: torch.device,
                progress: Callable[[list[dict]], None]) -> list[dict]:
    """Every column's row for one model, timed over args.rounds rounds (the module's doc); a column that fails (no
    kernel, a compile error, out of memory) is reported in its row and left out of the later rounds. `progress`
    gets the rows so far after each column of each round."""
    rounds: dict[str, list[dict]] = {variant.name: [] for variant in variants}
    errors: dict[str, str] = {}

    def rows() -> list[dict]:
        return [column_row(model_cfg, variant, rounds[variant.name], errors.get(variant.name), args)
                for variant in variants if rounds[variant.name] or variant.name in errors]

    for index in range(args.rounds):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            if variant.name in errors:
                continue
            try:
                rounds[variant.name].append(time_column(model_cfg, variant, args, device, index))
            except Exception as error:  # noqa: BLE001 - any failure of one column is a result to report
                print(f"  {variant.name:>24} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                      flush=True)
                errors[variant.name] = f"round {index + 1}: {error}"[:500]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            progress(rows())
    return rows()


def time_column(model_cfg: ModelConfig, variant: Variant, args, device: torch.device, round_index: int) -> dict:
    """One round of one column: build it, warm it up, time args.steps steps (with the clock and power of each),
    profile one more step in the last round with --profile; then free it."""
    torch.manual_seed(args.seed)
    torch._dynamo.reset()
    counters.clear()
    # The previous column's model and optimizer hold reference cycles: freed only by the collector, whose timing
    # would otherwise put their memory into this column's peak.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step = variant.build(model_cfg, args, device)
    shape = (1, model_cfg.seq_length, model_cfg.hidden_size)
    # A few distinct inputs, rotated, so no micro-batch reuses the previous one's activations.
    inputs = [torch.randn(shape, device=device, dtype=args.dtype) for _ in range(4)]
    micro_batches = [inputs[micro % len(inputs)] for micro in range(args.micro_batches)]
    label = f"  {variant.name:>24} round {round_index + 1}/{args.rounds}"

    def timed_step(index: int) -> tuple[float, float, tuple[float, float]]:
        """(seconds, loss, (start, end) in time.time()) of one training step."""
        _synchronize(device)
        start, wall_start = time.perf_counter(), time.time()
        loss = step(micro_batches)
        _synchronize(device)
        seconds = time.perf_counter() - start
        print(f"{label} step {index + 1}/{args.warmup + args.steps}: {seconds:.3f} s", flush=True)
        return seconds, loss.item(), (wall_start, time.time())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for index in range(args.warmup):
        timed_step(index)
    with gpu_telemetry(device) as telemetry:  # the clock and power of the timed steps
        times, losses, windows = zip(*(timed_step(index) for index in range(args.warmup, args.warmup + args.steps)))
    print(f"{label} {describe_telemetry(telemetry)}", flush=True)
    step_clocks = [window_telemetry(telemetry, *window) for window in windows]
    if any(step_clocks):
        print(f"{label} per step: " + ", ".join(
            f"{seconds * 1e3:.1f} ms" + (f" at {clock['sm_clock_mhz']:.0f} MHz, {clock['power_w']:.0f} W" if clock
                                          else "") for seconds, clock in zip(times, step_clocks)), flush=True)
    kernel_profile = None
    if args.profile and device.type == "cuda" and round_index == args.rounds - 1:
        kernel_profile = profile_kernels(lambda: step(micro_batches))
        print_profile(variant.name, kernel_profile)
    return {
        "times": list(times),
        "last_loss": losses[-1],
        "telemetry": telemetry,
        "step_clocks": step_clocks,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan,
        "graph_breaks": sum(counters["graph_break"].values()),
        "profile": kernel_profile,
    }


def print_profile(name: str, kernel_profile: dict) -> None:
    print(f"  {name:>24} profile: {describe_time_split(kernel_profile)}", flush=True)
    for kernel in kernel_profile["top_kernels"][:12]:
        print(f"      {kernel['ms']:8.2f} ms  {kernel['calls']:5d} calls  {kernel['category']:>9}  {kernel['name']}")
    for kernel in kernel_profile["most_called"][:5]:
        print(f"      {kernel['calls']:5d} calls  {kernel['ms']:8.2f} ms  (most called)  {kernel['name']}")
    print(f"  {name:>24} timeline: {describe_idle(kernel_profile['idle'])}", flush=True)
    for gap in kernel_profile["idle"]["longest_gaps"][:4]:
        print(f"      {gap['ms']:8.3f} ms idle at {gap['at_ms']:.1f} ms, after {gap['after'][:50]}, before "
              f"{gap['before'][:50]}")


def column_row(model_cfg: ModelConfig, variant: Variant, rounds: list[dict], error: str | None, args) -> dict:
    """A column's row from its rounds: the median, mean and spread of all its timed steps, the medians of the
    clock and power samples taken during them, the highest peak memory; or its error."""
    if error is not None:
        return {**row_identity(model_cfg, variant, args), "rounds": len(rounds), "error": error}
    times = [seconds for timed in rounds for seconds in timed["times"]]
    step_time = statistics.median(times)
    tokens = args.micro_batches * model_cfg.seq_length
    tflops = tokens * flops_per_token(model_cfg, include_output_layer=False) / step_time / 1e12
    tflops_full = tokens * flops_per_token(model_cfg, include_output_layer=False, causal=False) / step_time / 1e12
    telemetry = pooled_telemetry([timed["telemetry"] for timed in rounds])
    return {
        **row_identity(model_cfg, variant, args),
        "rounds": len(rounds),
        "timed_steps": len(times),
        "graph_breaks": max(timed["graph_breaks"] for timed in rounds),
        "median_step_s": step_time,
        "mean_step_s": statistics.mean(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "round_median_ms": [round(statistics.median(timed["times"]) * 1e3, 2) for timed in rounds],
        "model_tflops": tflops,
        "model_tflops_full_attention": tflops_full,
        "tokens_per_s": tokens / step_time,
        "peak_memory_gib": max(timed["peak_memory_gib"] for timed in rounds),
        "last_loss": rounds[-1]["last_loss"],
        **{key: telemetry.get(key) for key in ("sm_clock_mhz", "power_w", "power_limit_w", "temperature_c",
                                               "power_capped_share")},
        "step_ms": [round(seconds * 1e3, 2) for seconds in times],
        "step_sm_clock_mhz": [clock and clock["sm_clock_mhz"] for timed in rounds for clock in timed["step_clocks"]],
        "profile": rounds[-1]["profile"],
    }


def pooled_telemetry(telemetries: list[dict]) -> dict:
    """A column's clock and power over all its rounds: the medians of every sample taken during its timed steps;
    or why there are none."""
    samples = [sample for telemetry in telemetries for sample in telemetry.get("timeline", ())]
    pooled = window_telemetry({"timeline": samples}, -math.inf, math.inf)
    return pooled or {"unavailable": telemetries[0].get("unavailable", "no samples")}


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
    timed = ("bf16", "tensorwise")
    shapes = [row for shape in model_gemm_shapes(model_name) for row in bench_shape(*shape, names=timed)]
    ms = {variant: sum(r["ms"] for r in shapes if r["variant"] == variant) for variant in timed}
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
    parser.add_argument("--peer", choices=PEERS, action="append",
                        help="add peer columns: torchao's float8 training (torchao_tensorwise, torchao_rowwise, "
                             "...); Transformer Engine's layers "
                             "with BF16 gradients (te_bf16, te_current, te_delayed, te_blockwise, te_mxfp8 on "
                             "Blackwell) or trained as Megatron-LM trains them (te_megatron_bf16, ...); "
                             "megatron-core's own layers trained by megatron-core (megatron_layer_bf16, ...), "
                             "or with an FP32 gradient buffer (megatron_layer_fp32_grads_bf16, ...); "
                             "repeatable")
    parser.add_argument("--te-recipes", help=f"comma-separated TE recipes of the {', '.join(RECIPE_PEERS)} columns, "
                                             f"of {','.join(TE_RECIPES)} (default: {','.join(DEFAULT_TE_RECIPES)}, "
                                             "those that run on this GPU)")
    parser.add_argument("--torchao-recipes", help=f"comma-separated recipes of the torchao columns, of "
                                                  f"{','.join(TORCHAO_RECIPES)} (default: all)")
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per column in each round")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds over all columns, in order then reversed (each column built anew in each)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, in each round (compilation, autotuning)")
    parser.add_argument("--seq-length", type=int, help="override the model's sequence length (for quick checks)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run eagerly")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step per column, in the last round: GEMM / attention / other")
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
        if unknown or not args.peer or not set(RECIPE_PEERS) & set(args.peer):
            parser.error(f"--te-recipes {','.join(args.te_recipes)}: give TE recipes of {', '.join(TE_RECIPES)}, "
                         f"with --peer {' or --peer '.join(RECIPE_PEERS)}")
    if args.torchao_recipes is not None:
        unknown = [name for name in args.torchao_recipes.split(",") if name not in TORCHAO_RECIPES]
        if unknown or "torchao" not in (args.peer or []):
            parser.error(f"--torchao-recipes {args.torchao_recipes}: give torchao recipes of "
                         f"{', '.join(TORCHAO_RECIPES)}, with --peer torchao")
    args.torchao_recipes = (args.torchao_recipes or ",".join(TORCHAO_RECIPES)).split(",")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}: time at least one step, "
                     "after 0 or more warm-up, in at least one round")
    return args


TABLE_COLUMNS = (
    "model", "layers", "seq", "precision", "median step (ms)", "min-max (ms)", "timed steps (rounds)",
    "model TFLOP/s (Megatron, causal)", "TFLOP/s (full attention)", "speedup vs fastest bf16", "limit",
    "gain captured", "peak mem (GiB)", "kernels: GEMM / attention / quantization / other (ms)",
    "GPU idle: queued / waits (ms)", "SM clock (MHz) / power (W)", "graph breaks",
)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for row in rows:
        identity = [row["model"], row["layers"], row["seq_length"], row["precision"]]
        if "error" in row:
            cells = [*identity, f"failed: {row['error'].splitlines()[0][:80]}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |" + " |" * (len(TABLE_COLUMNS) - len(cells)))
            continue
        profile = row.get("profile")
        cells = [
            *identity,
            f"{row['median_step_s'] * 1e3:.1f}",
            f"{row['min_step_s'] * 1e3:.1f}-{row['max_step_s'] * 1e3:.1f}" if row.get("min_step_s") else "n/a",
            f"{row['timed_steps']} ({row['rounds']})" if row.get("rounds") else "n/a",
            f"{row['model_tflops']:.1f}",
            f"{row['model_tflops_full_attention']:.1f}",
            f"{row['speedup_vs_bf16']:.3f}x" if row.get("speedup_vs_bf16") is not None else "n/a",
            f"{row['limit']:.3f}x" if row.get("limit") else "n/a",
            f"{row['gain_captured']:.0%}" if row.get("gain_captured") is not None else "n/a",
            f"{row['peak_memory_gib']:.1f}",
            " / ".join(f"{profile['ms'][k]:.1f}" for k in ("gemm", "attention", "quantization", "other"))
            if profile else "n/a",
            f"{profile['idle']['queued_gaps_ms']:.1f} / {profile['idle']['wait_gaps_ms']:.1f}" if profile else "n/a",
            f"{row['sm_clock_mhz']:.0f} / {row['power_w']:.0f}" if row.get("sm_clock_mhz") is not None else "n/a",
            row["graph_breaks"],
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
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
        variants += [torchao_variant(recipe) for recipe in args.torchao_recipes]
    for peer in RECIPE_PEERS:
        if peer in peers:
            try:
                variants += peer_columns(peer, args.te_recipes)
            except RuntimeError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
    record = provenance()
    print(f"commit {record['commit']} on {record['device']}; "
          + ", ".join(f"{name} {version}" for name, version in record["versions"].items()), flush=True)
    rows: list[dict] = []
    for model_cfg, layers in zip(models, args.layers):
        model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
        if args.seq_length:
            model_cfg = dataclasses.replace(model_cfg, seq_length=args.seq_length)
        print(f"{model_cfg.name}: {layers} layers, seq {model_cfg.seq_length}, {args.micro_batches} micro-batches/"
              f"step, {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps per column", flush=True)

        def progress(results: list[dict]) -> None:
            if args.out:  # after every column, so a run cut short keeps what it measured
                write_results(rows + results, args, argv)

        results = bench_model(model_cfg, variants, args, device, progress)
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
