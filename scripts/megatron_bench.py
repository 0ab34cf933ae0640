"""engine=megatron with Transformer Engine on one GPU: every Hopper recipe with NVIDIA's tuning, what each tuning
switch buys, the torch engine beside it; or the loss of each recipe over 500 steps.

    python scripts/megatron_bench.py prepare --dir bench/speed                    # here, with Hydra: the run dirs
    python scripts/megatron_bench.py run --dir bench/speed --out OUT --parts precisions,torch,nemotron   # GPU
    python scripts/megatron_bench.py run --dir bench/speed --out OUT2 --parts ablations --best fp8_current
    python scripts/megatron_bench.py prepare --study loss --dir bench/loss
    python scripts/megatron_bench.py run --dir bench/loss --out OUT3
    python scripts/megatron_bench.py prepare --study nvfp4 --dir bench/nvfp4       # or --study granularity
    python scripts/megatron_bench.py run --dir bench/nvfp4 --out OUT4 --budget-s 560   # again until all finish

`prepare` composes each configuration as `launch/run.py ... dryrun=true run.dir=DIR/<name>` does (Hydra, the
plan's checks, the plan into plan.txt, config.yaml for the engine) and lists them in DIR/study.json. `run` starts
each as its own process, `python -m <engine module> DIR/<name>/config.yaml` (the plan's command), so a crash
stops only that configuration; it needs only what the engines need (torch, PyYAML, rich, megatron-core, Transformer
Engine for FP8), not Hydra or nemo-run.

The speed study (llama3_8b with 8 layers, full vocabulary, mock data, seq 8192, micro-batch 1 x 8 per step), its
columns in this order:
  precisions  engine=megatron bf16, fp8_current, fp8_delayed, fp8_blockwise with the tuned defaults (cfg.megatron),
  torch       each beside engine=torch in the same recipe on the same model and batch (compiled)
  nemotron    nemotron4_15b, 4 layers, fp8_current, on both engines: LayerNorm1p and squared ReLU
  fsdp        Megatron-FSDP in bf16 and fp8_current on the precisions' model, beside DDP's step time and memory
  functional  side by side (checks, not timings): a resume from a distributed checkpoint in every Hopper recipe
              and bf16, with the distributed optimizer and without, and under Megatron-FSDP in bf16, fp8_current and
              fp8_delayed (llama3_100m): run to step 6 with checkpoints at 3 and 6, cut back to step 3, run again;
              steps 4-6 repeat, and the run is failed unless each one's loss and gradient norm equal the
              uninterrupted run's
  ablations   the fastest FP8 recipe of `precisions` in this call (or --best) as tuned, and with one switch changed
              at a time, most telling first (ABLATIONS)

How a column is timed. It runs in rounds (prepare --rounds, default 2), each its own process in its own run dir
(DIR/<name>, then DIR/<name>.round2, ...): warm-up steps (2; 6 with CUDA graphs, which are captured in the first
steps), then the timed steps (prepare --steps, default 5: 10 per column). Round 1 then profiles one more step
(`trainer.profile_step`, left out of the timing); later rounds stop after their timed steps. The timed columns of
a call go round-robin: round 1 in the order above (megatron-bf16, torch-bf16, megatron-fp8_current,
torch-fp8_current, ..., the nemotron pair, Megatron-FSDP), round 2 in the reverse order, and so on, so the two
engines of one configuration always run one after the other and no column always goes first; the ablations go
round-robin among themselves, their tuned run with them. A column's s/step is the median of the timed steps of all
its rounds, its spread their min-max. While a timed process runs, nvidia-smi samples the GPU every 200 ms
(recipes.profiling.gpu_telemetry): a column's SM clock and power are the medians of the samples taken during its
timed steps. The engines record no clock time, so the bench watches each metrics.jsonl (a line is written and
flushed as its step ends) every 50 ms: the timed steps ran from the moment the line of the step before them
appeared to the moment the last one's did.

The tables split the profiled step's kernel time by kernel name (GEMM, the output layer's included; attention;
quantization; loss; optimizer; other: recipes.profiling); a targets table says, met or missed, whether the torch
engine is at least as fast as engine=megatron in each recipe with no more memory, and its fp8_current speedup over
its own bf16; a note names the settings in which the two engines differ. Before a group of timed columns starts,
the columns that fit in what is left of --budget-s are chosen in order, a configuration's two engines together (a
process's cost is estimated from the finished ones of the same engine and model); the others are listed as not
run, for another call with --parts or --only.

The loss study: llama3_100m on the bundled text, 500 steps, bf16 and each Hopper FP8 recipe on both engines, all at
once (losses, not timings). Its table gives each run's mean loss over the last 100 steps against the BF16 run of
the same engine and the torch engine's run of the same recipe; `scripts/compare.py OUT/runs` makes the report.

The recipe studies (issues 50 and 51): llama3_100m on the bundled text with the convergence study's settings
(docs/results/convergence.md), 2000 steps, three seeds (prepare --seeds), the torch engine, the runs side by side:
`nvfp4` (BF16, fp8_current, NVFP4 emulated, and NVFP4 without its Hadamard transform, without stochastic
rounding, without its BF16 last layers) and `granularity` (BF16, fp8_current, fp8_rowwise, fp8_rowwise_gw_hp,
fp8_blockwise, fp8_blockwise_1d1d, fp8_blockwise_2d2d emulated). Each run checkpoints every 500 steps (the last
only kept) and, at the end of --budget-s, at the step it is asked to stop after (STOP_GRACE_S), so a call cut short
is continued by the same command: each run resumes from its newest checkpoint, and a run that finished is reported
from its files, not started again (finished_earlier). The run folders must stay as the call left them: a copy of
DIR put over them (a fresh checkout, a sync from elsewhere) takes the checkpoints away, and the runs start again
from step 1. A later session's machine has none of those checkpoints: `adopt --dir DIR --runs OUT/runs.tar.gz`
brings the finished runs' files from an earlier call's archive into DIR, and `run` then starts only the others.
Side-by-side runs share the GPU as far as its free memory holds them (the plan's estimate of each, recorded by
prepare, and PROCESS_OVERHEAD_GIB a process): on an H200 every run of a study at once, on an 80 GB H100 about half of
them, the next starting as soon as one ends (side_by_side_slots). The table gives each run's mean loss over its last
100 steps against the BF16 run of its seed, and the mean of those gaps over the seeds against RECIPE_STUDY_TARGET; its
step times are taken while the runs share the GPU, so they rank the recipes' cost but are not their speed alone.

Every run sees the same Python: with Transformer Engine installed (megatron-core's FP8 needs it), the torch engine's
runs import it too, through megatron-core, as in a NeMo container; results.md says whether it was importable.
OUT receives results.md and results.csv (written again after every process: a call cut short keeps what it
measured), provenance.json (the commit of the code that ran: FP8_RECIPES_COMMIT, or HEAD of this checkout, or
unknown; and the commit the configs were prepared at), runs.tar.gz (each round's config.yaml, plan.txt,
metrics.jsonl, summary.json, logs and time split; no checkpoints) and traces.tar.gz (the Chrome trace of each
engine=megatron column's profiled step).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

from recipes.config import REPO_ROOT, load_config, load_option
from recipes.plan import launch_command
from recipes.profiling import CATEGORY_NAMES, gpu_telemetry, window_telemetry
from recipes.provenance import git_commit, provenance
from recipes.run_files import CONFIG, METRICS, PROFILE, SUMMARY, TRAIN_LOG

FP8_RECIPES = ("fp8_current", "fp8_delayed", "fp8_blockwise")  # the Hopper ones: MXFP8 needs Blackwell
SPEED_PARTS = ("precisions", "torch", "nemotron", "fsdp", "functional", "ablations")
WARMUP_STEPS = 2  # compilation, the first FP8 casts
GRAPHS_WARMUP_STEPS = 6  # megatron-core captures its CUDA graphs in the first steps
TIMED_STEPS, ROUNDS = 5, 2  # per round, and rounds per column: 10 timed steps from two processes
# A process's cost before any of its engine and model has finished: on an H200, runs of 6-7 steps of this study took
# 39-56 s (engine=megatron) and 39-70 s (the torch engine, torch.compile included), start-up most of it.
FIRST_GUESS_S = {"megatron": 55.0, "torch": 65.0}
POLL_S = 0.05  # how often the bench looks for a new step in metrics.jsonl
# A process out of time is asked to stop this long before it is killed: the engine ends its step and writes the
# checkpoint of that step (recipes.trainer.stopping), so a recipe study's next call resumes there and not at the
# last 500-step checkpoint. Nine llama3_100m runs writing their ~1.2 GB checkpoints at once need some seconds.
STOP_GRACE_S = 45.0
TELEMETRY_MS = 200  # nvidia-smi's sampling interval: a window of 5 steps holds ~35 samples
# What a side-by-side process holds beyond the plan's estimate of its model, gradients, optimizer and activations:
# the CUDA context, cuBLAS's and Triton's workspaces, the caching allocator's slack. The convergence study's runs of
# llama3_100m peaked at 3.2-4.2 GiB of PyTorch's own memory against the plan's 4.4; the context adds ~0.5 GiB.
PROCESS_OVERHEAD_GIB = 1.0
GPU_MEMORY_SHARE = 0.9  # of the memory free when a group starts, what its side-by-side processes may plan to fill
PROFILE_SPLIT = f"{PROFILE}/time_rank0.json"  # recipes.profiling's split of the profiled step
PROFILE_TRACE = f"{PROFILE}/trace_rank0.json"  # and its Chrome trace
KEPT_FILES = (CONFIG, "plan.txt", METRICS, "metrics_uninterrupted.jsonl", SUMMARY, TRAIN_LOG,
              "train_resumed.log", PROFILE_SPLIT)
CURRENT_OVER_BF16_TARGET = 1.30  # the torch engine's fp8_current speedup over its own bf16
LOSS_WINDOW = 100  # the loss study compares the mean loss of the last 100 steps
LOSS_GAP_TARGET = 0.02  # each FP8 recipe's mean loss within 2% of its references' (loss_references)
RECIPE_STUDY_TARGET = 0.015  # the recipe studies: the mean over seeds of a recipe's gap to BF16 within 1.5%
SEEDS = (1234, 2, 3)
# The recipe studies' configurations: label -> precision overrides (recipe_study_runs).
RECIPE_STUDIES = {
    "nvfp4": {
        "bf16": ("precision=bf16",),
        "fp8_current": ("precision=fp8_current",),
        "nvfp4": ("precision=nvfp4", "precision.emulate=true"),
        "nvfp4-no_rht": ("precision=nvfp4", "precision.emulate=true", "precision.disable_rht=true"),
        "nvfp4-no_stochastic_rounding": ("precision=nvfp4", "precision.emulate=true",
                                         "precision.disable_stochastic_rounding=true"),
        "nvfp4-no_bf16_last_layers": ("precision=nvfp4", "precision.emulate=true",
                                      "precision.num_layers_at_end_in_bf16=0"),
    },
    "granularity": {
        "bf16": ("precision=bf16",),
        "fp8_current": ("precision=fp8_current",),
        "fp8_rowwise": ("precision=fp8_rowwise",),
        "fp8_rowwise_gw_hp": ("precision=fp8_rowwise_gw_hp",),
        "fp8_blockwise": ("precision=fp8_blockwise",),
        "fp8_blockwise_1d1d": ("precision=fp8_blockwise_1d1d",),
        "fp8_blockwise_2d2d": ("precision=fp8_blockwise_2d2d", "precision.emulate=true"),
    },
}


@dataclass(frozen=True)
class Run:
    """A column of the study: one configuration, run in `rounds` processes."""

    name: str
    part: str
    engine: str
    precision: str
    overrides: tuple[str, ...]  # launch/run.py arguments of round 1 (round_overrides: the others')
    switch: str = ""  # an ablation: what differs from the tuned run of the same precision
    side_by_side: bool = False  # shares the GPU with the other side-by-side runs: a check or a loss, not a timing
    warmup: int = WARMUP_STEPS  # steps left out of the timing
    rounds: int = 1  # processes, each in its own run dir (round_dir), interleaved with the other columns'
    resume: bool = False  # run again from the checkpoint before the last, which is removed first
    profile_step: Optional[int] = None  # round 1's last step, profiled (trainer.profile_step): not timed
    timeout_s: float = 300.0  # a hung process is stopped, then killed (watch_steps; never later than the budget allows)
    seed: Optional[int] = None  # a recipe study's run: trainer.seed, and the BF16 run it is compared with
    memory_gib: Optional[float] = None  # the plan's GPU memory estimate of round 1 (prepare): side_by_side_slots

    @property
    def model(self) -> str:
        return next(o.split("=", 1)[1] for o in self.overrides if o.startswith("model="))

    @property
    def max_steps(self) -> int:
        return int(next(o.split("=", 1)[1] for o in self.overrides if o.startswith("trainer.max_steps=")))

    @property
    def configuration(self) -> str:
        """What the column shares with its twin on the other engine (`megatron-bf16` and `torch-bf16`: `bf16`)."""
        return self.name.split("-", 1)[1]


def round_dir(directory: Path, run: Run, round_: int) -> Path:
    """Round 1's run dir is named after the column (its profiled step is there), a later round's after both."""
    return directory / (run.name if round_ == 1 else f"{run.name}.round{round_}")


def round_overrides(run: Run, round_: int) -> tuple[str, ...]:
    """Round 1 as planned; a later round stops after its timed steps, so a column's step is profiled once."""
    if round_ == 1 or run.profile_step is None:
        return run.overrides
    last = f"trainer.max_steps={run.profile_step - 1}"
    return tuple(last if o.startswith("trainer.max_steps=") else o for o in run.overrides
                 if not o.startswith("trainer.profile_step="))


# megatron-core's unsharded optimizer, which updates no FP8 weights (so none kept): an ablation, and the resume
# checks' second optimizer.
WITHOUT_DISTRIBUTED_OPTIMIZER = ("parallel.distributed_optimizer=false", "precision.fp8_param_gather=false")
# Megatron-FSDP: timed beside DDP in the recipes the issue names; resumed in those and in delayed scaling, whose amax
# histories are the state Megatron-LM's fsdp_dtensor checkpoint drops and ours keeps.
FSDP_TIMED = ("bf16", "fp8_current")
FSDP_RESUMES = ("bf16", "fp8_current", "fp8_delayed")

# One switch at a time on the fastest FP8 recipe, most telling first (the budget may stop the list early): the two
# whose result sets a default (the FP32 gradient buffer, like-for-like with the torch engine's FP32 main gradients,
# against NVIDIA's BF16 one; CUDA graphs, with the wgrad fusion kept), then what each fusion buys.
ABLATIONS = (
    ("grad_reduce_in_fp32=true", ("megatron.grad_reduce_in_fp32=true",)),
    ("cuda_graphs=true", ("megatron.cuda_graphs=true",)),
    ("gradient_accumulation_fusion=false", ("megatron.gradient_accumulation_fusion=false",)),
    ("fp8_param_gather=false", ("precision.fp8_param_gather=false",)),
    ("cross_entropy_loss_fusion=false", ("megatron.cross_entropy_loss_fusion=false",)),
    ("apply_rope_fusion=false", ("megatron.apply_rope_fusion=false",)),
    ("bias_activation_fusion=false", ("megatron.bias_activation_fusion=false",)),
    ("distributed_optimizer=false", WITHOUT_DISTRIBUTED_OPTIMIZER),
    ("bias_dropout_fusion=false", ("megatron.bias_dropout_fusion=false",)),
    ("overlaps=false", ("megatron.overlap_grad_reduce=false", "megatron.overlap_param_gather=false")),
)


def speed_runs(gpu: str, steps: int = TIMED_STEPS, rounds: int = ROUNDS) -> list[Run]:
    """The speed study's columns in its order, each with `steps` timed steps in each of `rounds` processes."""
    def column(name: str, part: str, engine: str, precision: str, model: str = "llama3_8b", layers: int = 8,
               extra: tuple[str, ...] = (), switch: str = "", warmup: int = WARMUP_STEPS,
               profiled: bool = True) -> Run:
        """Warm-up steps, the timed ones, and in round 1 one more profiled (not the ablations': they are compared
        with each other, not split by kernel)."""
        last = warmup + steps + profiled
        overrides = (f"engine={engine}", f"gpu={gpu}", f"model={model}", f"model.num_layers={layers}", "data=mock",
                     "trainer.micro_batch_size=1", "trainer.global_batch_size=8", f"trainer.max_steps={last}",
                     "trainer.log_interval=1", *((f"trainer.profile_step={last}",) if profiled else ()),
                     f"precision={precision}", *extra)
        return Run(name, part, engine, precision, overrides, switch=switch, warmup=warmup, rounds=rounds,
                   profile_step=last if profiled else None)

    runs = [column(f"{engine}-{p}", part, engine, p) for p in ("bf16", *FP8_RECIPES)
            for engine, part in (("megatron", "precisions"), ("torch", "torch"))]
    runs += [column(f"{engine}-nemotron4_15b-fp8_current", "nemotron", engine, "fp8_current", "nemotron4_15b", 4)
             for engine in ("megatron", "torch")]
    runs += [column(f"megatron-fsdp-{p}", "fsdp", "megatron", p, extra=("parallel.fsdp=true",)) for p in FSDP_TIMED]
    # Side-by-side runs each keep megatron-core's sample index in their own folder (relative to the run dir, where
    # the engine runs): two building one file at once would race.
    own_cache = ("data.cache_dir=cache",)
    resume = ("engine=megatron", f"gpu={gpu}", "model=llama3_100m", "data=mock", "trainer.micro_batch_size=8",
              "trainer.global_batch_size=8", "trainer.max_steps=6", "trainer.checkpoint.interval=3",
              "trainer.log_interval=1", "megatron.deterministic=true", *own_cache)
    for optimizer, switch, precisions in (("", (), ("bf16", *FP8_RECIPES)),
                                          ("-no_distopt", WITHOUT_DISTRIBUTED_OPTIMIZER, ("bf16", *FP8_RECIPES)),
                                          ("-fsdp", ("parallel.fsdp=true",), FSDP_RESUMES)):
        runs += [Run(f"resume-llama3_100m-{p}{optimizer}", "functional", "megatron", p,
                     (*resume, f"precision={p}", *switch), side_by_side=True, resume=True)
                 for p in precisions]
    for recipe in FP8_RECIPES:
        runs.append(column(f"megatron-{recipe}--tuned", "ablations", "megatron", recipe, profiled=False))
        fp8_weights = load_option("precision", recipe).fp8_param_gather
        for switch, overrides in ABLATIONS:
            if switch == "fp8_param_gather=false" and not fp8_weights:
                continue  # already off in this recipe's preset
            graphs = switch == "cuda_graphs=true"
            if graphs and fp8_weights:  # megatron-core 0.16 cannot replay its graphs over FP8 weights (check_overlaps)
                switch, overrides = f"{switch},fp8_param_gather=false", (*overrides, "precision.fp8_param_gather=false")
            runs.append(column(f"megatron-{recipe}--{switch.split('=')[0]}", "ablations", "megatron", recipe,
                               extra=overrides, switch=switch, profiled=False,
                               warmup=GRAPHS_WARMUP_STEPS if graphs else WARMUP_STEPS))
    return runs


def loss_runs(gpu: str, steps: int) -> list[Run]:
    """The convergence study's settings (docs/results), 500 steps: seq 1024, micro = global batch 8, lr 1e-3."""
    return [Run(f"{engine}-llama3_100m-{p}", "loss", engine, p,
                (f"engine={engine}", f"gpu={gpu}", "model=llama3_100m", "data=text", f"precision={p}",
                 "trainer.micro_batch_size=8", "trainer.global_batch_size=8", f"trainer.max_steps={steps}",
                 "trainer.warmup_steps=100", "trainer.log_interval=50", "data.cache_dir=cache"),
                side_by_side=True, timeout_s=3600.0)
            for engine in ("megatron", "torch") for p in ("bf16", *FP8_RECIPES)]


def recipe_study_runs(study: str, gpu: str, steps: int, seeds: tuple[int, ...] = SEEDS) -> list[Run]:
    """A recipe study's runs (RECIPE_STUDIES), the convergence study's settings, each configuration with each seed:
    all side by side, checkpointed so that a later call continues them."""
    return [Run(f"torch-llama3_100m-{label}-seed{seed}", "loss", "torch", label,
                ("engine=torch", f"gpu={gpu}", "model=llama3_100m", "data=text", *overrides,
                 "trainer.micro_batch_size=8", "trainer.global_batch_size=8", f"trainer.max_steps={steps}",
                 "trainer.warmup_steps=100", f"trainer.seed={seed}", "trainer.log_interval=50",
                 "trainer.checkpoint.interval=500", "trainer.checkpoint.keep_last=1", "data.cache_dir=cache"),
                side_by_side=True, timeout_s=7200.0, seed=seed)
            for seed in seeds for label, overrides in RECIPE_STUDIES[study].items()]


def study_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs measured together, in the study's order: consecutive timed columns round-robin, each recipe's
    ablations among themselves (the recipe may be the fastest of a group before), consecutive side-by-side runs
    together (as many at once as the GPU holds: side_by_side_slots)."""
    return [list(group) for _, group in itertools.groupby(
        runs, lambda run: (run.side_by_side, run.precision if run.part == "ablations" else None))]


def side_by_side_slots(group: list[Run], free_gib: Optional[float]) -> int:
    """How many of a group's side-by-side runs share the GPU at once, the next starting as one ends: as many as the
    GPU's free memory holds by the plan's estimates (each with PROCESS_OVERHEAD_GIB, within GPU_MEMORY_SHARE of
    `free_gib`), spread evenly over the fewest rounds that takes (a recipe study's 16-21 runs of ~5.4 GiB on an 80 GB
    H100: 8-11 at once, where 13 would fit by the estimates). Not more: seven runs already keep an H100 busy (BF16's
    llama3_100m step took 0.181 s with nine runs sharing it and 0.140 s with seven, ~20 ms of GPU time either way),
    and the estimates run low (BF16 peaked at 4.7 GiB against 3.9 planned in the NVFP4 study). All at once where the
    memory free or a run's estimate is unknown (no GPU; a study prepared before estimates were recorded), one for
    none (every run finished in an earlier call)."""
    if not group or free_gib is None or any(run.memory_gib is None for run in group):
        return max(len(group), 1)  # a pool has at least one worker
    largest = max(run.memory_gib for run in group) + PROCESS_OVERHEAD_GIB
    fit = max(1, int(free_gib * GPU_MEMORY_SHARE // largest))
    rounds = math.ceil(len(group) / fit)
    return math.ceil(len(group) / rounds)


def round_robin(columns: list[Run]) -> list[tuple[Run, int]]:
    """(column, round) in the order the processes run: round 1 in the columns' order, each later round in the
    reverse of the round before, so that no column always goes first and twins listed together stay together."""
    order = []
    for round_ in range(1, max((run.rounds for run in columns), default=0) + 1):
        ordered = columns if round_ % 2 else columns[::-1]
        order += [(run, round_) for run in ordered if round_ <= run.rounds]
    return order


# ---- prepare (here, with Hydra) ----


def prepare(study: str, runs: list[Run], directory: Path) -> None:
    """Each round's config.yaml and plan.txt, composed and checked as launch/run.py does with dryrun=true, and
    DIR/study.json listing the runs in order, and their processes in the order they run."""
    from hydra import compose, initialize_config_dir

    from recipes.config import CONF_DIR
    from recipes.folders import save_config
    from recipes.hydra_schema import check_override_keys, register_schema, to_config
    from recipes.plan import make_plan
    from recipes.plan.describe import describe
    from recipes.plan.gpu import resolve

    register_schema()
    directory.mkdir(parents=True, exist_ok=True)
    planned = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for run in runs:
            for round_ in range(1, run.rounds + 1):
                run_dir = round_dir(directory, run, round_).resolve()
                overrides = [*round_overrides(run, round_), "dryrun=true", f"run.dir={run_dir}"]
                check_override_keys(overrides)
                cfg = resolve(to_config(compose("config", overrides=overrides)))
                plan = make_plan(cfg, run_dir / CONFIG)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "plan.txt").write_text(describe(plan) + "\n")
                save_config(dataclasses.replace(cfg, dryrun=False), run_dir / CONFIG)
                if round_ == 1:
                    planned.append(dataclasses.replace(run, memory_gib=round(plan.memory.total / 2**30, 2)))
    runs = planned
    order = [[round_dir(directory, run, k).name for run, k in round_robin(group)]
             for group in study_groups(runs) if not group[0].side_by_side]
    record = {"study": study, "commit": git_commit(), "runs": [dataclasses.asdict(run) for run in runs],
              "order": order}  # the run dirs of each timed group in the order `run` starts them (all parts)
    (directory / "study.json").write_text(json.dumps(record, indent=1) + "\n")


def load_study(directory: Path) -> tuple[str, str, list[Run]]:
    """The study, the commit its configs were prepared at, its runs."""
    record = json.loads((directory / "study.json").read_text())
    runs = [Run(**{**fields, "overrides": tuple(fields["overrides"])}) for fields in record["runs"]]
    return record["study"], record["commit"], runs


# ---- run (on the GPU machine) ----


@dataclass
class Outcome:
    """One process of a column (a resume run: its two starts)."""

    status: str  # ok, failed (exit status), timeout, not run (why)
    wall_s: float = 0.0
    error: str = ""
    steps_seen: dict[int, float] = field(default_factory=dict)  # step -> time.time() its line appeared; 0: the start
    gpu: dict = field(default_factory=dict)  # gpu_telemetry's record of a timed process: its samples, or why none
    note: str = ""  # a run reported from an earlier call's files: which (finished_earlier)


def last_error(log: Path) -> str:
    """The last line of a log that says what went wrong (the engines print `error: ...`; Python a traceback)."""
    if not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    flagged = [line for line in lines if line.startswith("error:") or "Error" in line or "error" in line]
    return (flagged or lines or [""])[-1][:300]


def steps_written(metrics_file: Path) -> list[int]:
    """The steps of metrics.jsonl's complete lines (one being written has no newline yet)."""
    try:
        return steps_in(metrics_file.read_text())[0]
    except FileNotFoundError:
        return []


def steps_in(metrics_text: str) -> tuple[list[int], int]:
    """The steps of a metrics.jsonl text's complete lines that parse, and how many complete lines it has."""
    lines = metrics_text.split("\n")[:-1]
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return steps, len(lines)


def watch_steps(process: subprocess.Popen, metrics_file: Path, timeout_s: float,
                grace_s: float = STOP_GRACE_S) -> tuple[dict[int, float], str]:
    """Wait for `process`, noting when each step's line appears in its metrics.jsonl: {step: time.time()}, 0 for
    the start (within POLL_S); and how it ended: "finished" by itself, "stopped" (asked with SIGTERM `grace_s`
    before `timeout_s`, or at half of it where that is shorter: the engine ends its step and writes its checkpoint,
    recipes.trainer.stopping) or "killed" at `timeout_s`, still running."""
    seen = {0: time.time()}
    started = time.monotonic()
    ask_at, kill_at = started + max(timeout_s - grace_s, timeout_s / 2), started + timeout_s
    asked = False
    while True:
        finished = process.poll() is not None
        now = time.time()
        for step in steps_written(metrics_file):
            seen.setdefault(step, now)
        if finished:
            return seen, "stopped" if asked and process.returncode != 0 else "finished"
        if time.monotonic() > kill_at:
            process.kill()
            process.wait()
            return seen, "killed"
        if not asked and time.monotonic() > ask_at:
            process.send_signal(signal.SIGTERM)
            asked = True
        time.sleep(POLL_S)


def launch(run_dir: Path, log_name: str, timeout_s: float) -> tuple[str, str, dict[int, float]]:
    """The engine on run_dir/config.yaml, the command the plan prints, in run_dir (its relative cache folder):
    status, error and when each step ended (watch_steps). The engine finds its commit itself (recipes.provenance):
    the one the configs were prepared at need not be the code's that runs."""
    config = run_dir / CONFIG
    command = launch_command(load_config(config), config)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    log = run_dir / log_name
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
        seen, ended = watch_steps(process, run_dir / METRICS, max(timeout_s, 1))
    if ended != "finished":
        return "timeout", f"{ended} at step {max(seen)}, out of its {timeout_s:.0f} s", seen
    status = process.returncode
    return ("ok", "", seen) if status == 0 else (f"failed ({status})", last_error(log), seen)


def execute(run: Run, run_dir: Path, timeout_s: float) -> Outcome:
    """One process of a column; a resume run twice: to the end, then again from its next-to-last checkpoint."""
    started = time.monotonic()
    (run_dir / METRICS).unlink(missing_ok=True)  # an earlier call's steps would pass for this one's
    shutil.rmtree(run_dir / PROFILE, ignore_errors=True)
    if run.resume:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # an earlier call's would be resumed from
    status, error, seen = launch(run_dir, TRAIN_LOG, timeout_s)
    if status == "ok" and run.resume:
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        shutil.copy(run_dir / METRICS, run_dir / "metrics_uninterrupted.jsonl")
        shutil.rmtree(checkpoints[-1])
        status, error, _ = launch(run_dir, "train_resumed.log", timeout_s - (time.monotonic() - started))
    return Outcome(status, time.monotonic() - started, error, seen)


def finished_steps(metrics_text: str, summary_text: Optional[str], steps: int) -> bool:
    """Whether a run's files say it finished: a summary.json, and a metrics.jsonl of every step 1..`steps`, each
    complete line one of them."""
    found, lines = steps_in(metrics_text)
    return summary_text is not None and lines == steps and found == list(range(1, steps + 1))


def finished_earlier(run: Run, run_dir: Path) -> Optional[Outcome]:
    """A recipe study's run that an earlier call finished, on this machine or on another (its files brought here by
    `adopt`): reported from its files, not started again. Started, it would only resume at its last step where its
    checkpoints stayed on this machine, and train from the start where they did not (a later session's machine)."""
    metrics_file, summary_file = run_dir / METRICS, run_dir / SUMMARY
    if run.seed is None or not (metrics_file.is_file() and summary_file.is_file()):
        return None
    summary = summary_file.read_text()
    if not finished_steps(metrics_file.read_text(), summary, run.max_steps):
        return None
    record = json.loads(summary)
    return Outcome("ok", note=f"finished in an earlier call: commit {str(record.get('commit'))[:12]}, "
                              f"{record.get('device', 'device not recorded')}")


def adopt(directory: Path, archive: Path) -> list[str]:
    """The files of the recipe study's runs that an earlier call finished, from its OUT/runs.tar.gz into their run
    dirs here, so that `run` reports them and starts only the others: how a study goes on in a later session, whose
    machine holds none of the earlier one's checkpoints. A run is taken only where its archived config.yaml is the
    one prepared here and its files say it finished (finished_steps); only regular files of KEPT_FILES, each
    written as a run writes its own (recipes.folders.write_file: never through a link). Returns the runs taken."""
    from recipes.folders import write_file

    taken = []
    with tarfile.open(archive) as tar:
        members = {member.name: member for member in tar.getmembers() if member.isfile()}
        for run in load_study(directory)[2]:
            run_dir = round_dir(directory, run, 1)
            files = {name: tar.extractfile(members[f"runs/{run.name}/{name}"]).read() for name in KEPT_FILES
                     if f"runs/{run.name}/{name}" in members}
            prepared = run_dir / CONFIG
            if run.seed is None or not prepared.is_file() or files.get(CONFIG) != prepared.read_bytes():
                continue
            summary = files.get(SUMMARY)
            if not finished_steps(files.get(METRICS, b"").decode(), summary and summary.decode(), run.max_steps):
                continue
            for name, data in files.items():
                write_file(run_dir / name, data)
            taken.append(run.name)
    return taken


def estimate_s(run: Run, finished: list[tuple[Run, Outcome]]) -> float:
    """The longest finished process of a timed column of the same engine and model, or a first guess."""
    alike = [outcome.wall_s for other, outcome in finished if outcome.status == "ok" and not other.side_by_side
             and (other.engine, other.model) == (run.engine, run.model)]
    return max(alike, default=FIRST_GUESS_S[run.engine])


def metrics(run_dir: Path, name: str = METRICS) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def timed_steps(run: Run, records: list[dict]) -> list[dict]:
    """A round's timed steps: those after the warm-up, the profiled one left out."""
    return [r for r in records[run.warmup:] if r["step"] != run.profile_step]


def timed_window(timed: list[dict], seen: dict[int, float]) -> Optional[tuple[float, float]]:
    """When a round's timed steps ran (time.time()): from the moment the line of the step before them appeared in
    metrics.jsonl (or the process started) to the moment the last one's did; None where either was not seen."""
    if not timed:
        return None
    start, end = seen.get(timed[0]["step"] - 1), seen.get(timed[-1]["step"])
    return (start, end) if start is not None and end is not None else None


def clock_and_power(samples: list[tuple], windows: list[tuple[float, float]]) -> dict:
    """The median SM clock (MHz) and power (W) of the GPU samples (gpu_telemetry's timeline) taken within any of
    `windows`: a column's timed steps over its rounds; None without samples (no nvidia-smi, a CPU, no window)."""
    inside = [sample for sample in samples if any(a <= sample[0] <= b for a, b in windows)]
    medians = window_telemetry({"timeline": inside}, -math.inf, math.inf)  # the medians of those samples
    return {"sm_clock_mhz": medians["sm_clock_mhz"] if medians else None,
            "power_w": medians["power_w"] if medians else None, "gpu_samples": medians["samples"] if medians else 0}


def profile_split(run_dir: Optional[Path]) -> dict[str, Optional[float]]:
    """The profiled step's kernel time per category (ms), and in all; None where the run wrote no profile."""
    path = run_dir / PROFILE_SPLIT if run_dir else None
    split = json.loads(path.read_text()) if path and path.is_file() else None
    return {f"{category}_ms": split["ms"].get(category) if split else None for category in CATEGORY_NAMES} | \
        {"kernels_ms": split["total_ms"] if split else None}


def engine_settings(run: Run, run_dir: Path) -> dict:
    """engine=megatron's settings in which the engines may differ, from the config it ran: its gradient buffer (the
    torch engine keeps FP32 main gradients) and its FP8 weights."""
    if run.engine != "megatron" or not (run_dir / CONFIG).is_file():
        return {"grad_reduce_in_fp32": None, "fp8_param_gather": None}
    cfg = load_config(run_dir / CONFIG)
    return {"grad_reduce_in_fp32": cfg.megatron.grad_reduce_in_fp32,
            "fp8_param_gather": cfg.precision.fp8_param_gather}


def fastest_fp8(runs: list[Run], rows: dict[str, dict]) -> Optional[str]:
    timed = [(rows[r.name]["step_s"], r.precision) for r in runs
             if r.part == "precisions" and r.precision in FP8_RECIPES and rows.get(r.name, {}).get("step_s")]
    return min(timed)[1] if timed else None


def column_status(rounds: list[tuple[Path, Outcome]]) -> tuple[str, str]:
    """ok where every round finished; else the first round that did not (named where one of several)."""
    bad = [(k, outcome) for k, (_, outcome) in enumerate(rounds, 1) if outcome.status != "ok"]
    if not bad:
        return "ok", ""
    k, outcome = bad[0]
    if len(bad) == len(rounds):
        return outcome.status, outcome.error
    return f"{outcome.status} in round {k} of {len(rounds)}", outcome.error


def row(run: Run, rounds: list[tuple[Path, Outcome]]) -> dict:
    """One line of results.csv: a column's identity, outcome and steady-state numbers over the timed steps of its
    rounds that finished (a timed column's only), its rounds (one at least) given as (run dir, outcome)."""
    records = [[] if outcome.status.startswith("not run") else metrics(run_dir)  # not an earlier call's
               for run_dir, outcome in rounds]
    finished = [(timed_steps(run, found), outcome) for found, (_, outcome) in zip(records, rounds)
                if outcome.status == "ok" and not run.side_by_side]
    timed = [step for steps, _ in finished for step in steps]
    windows = [window for steps, outcome in finished if (window := timed_window(steps, outcome.steps_seen))]
    first_dir, first = rounds[0][0], records[0]  # round 1: the losses and the profiled step

    def median(field_name: str, steps: list[dict] = timed) -> Optional[float]:
        values = [r[field_name] for r in steps if r.get(field_name) is not None]
        return statistics.median(values) if values else None

    status, error = column_status(rounds)
    every = [r for found in records for r in found]
    times = [r["step_time_s"] for r in timed]
    result = {
        "name": run.name, "part": run.part, "engine": run.engine, "model": run.model, "precision": run.precision,
        "switch": run.switch, "status": status, "error": error, "rounds": len(finished), "steps": len(every),
        "timed_steps": len(timed), "step_s": median("step_time_s"), "step_min_s": min(times, default=None),
        "step_max_s": max(times, default=None),
        "round_step_s": " ".join(f"{median('step_time_s', steps):.4f}" for steps, _ in finished if steps),
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"), "tflops_per_gpu": median("model_tflops_per_gpu"),
        "mfu": median("mfu"), "peak_gib": max((r["peak_memory_gib"] for r in every), default=None),
        **clock_and_power([sample for _, outcome in finished for sample in outcome.gpu.get("timeline", ())], windows),
        "median_step_s": median("step_time_s", first[run.warmup:]),  # a side-by-side run's too (shared GPU)
        "final_loss": first[-1]["loss"] if first else None,
        "mean_loss_last_100": statistics.fmean(r["loss"] for r in first[-LOSS_WINDOW:]) if first else None,
        "wall_s": round(sum(outcome.wall_s for _, outcome in rounds), 1), "note": rounds[0][1].note,
        **engine_settings(run, first_dir),
        **profile_split(first_dir if run.profile_step and first else None),
    }
    if run.resume and status == "ok":
        result["note"], exact = resume_check(first_dir)
        if not exact:
            result["status"] = "failed (resume not exact)"
    return result


def resume_check(run_dir: Path) -> tuple[str, bool]:
    """What the second start of a resume run did, and whether it repeated the uninterrupted run exactly: the step it
    resumed from (the engine's `resuming from step N of DIR` line), and each repeated step's loss and gradient norm
    against the uninterrupted run's. On one GPU a resume repeats the same kernels on the same data and state, so the
    bound is equality of the recorded numbers; a step missing from either run fails too."""
    log = (run_dir / "train_resumed.log").read_text(errors="replace")
    line = next((line for line in log.splitlines() if line.startswith("resuming from step ")), None)
    if line is None:
        return "did not resume: no 'resuming from step' line in train_resumed.log", False
    first = int(line.split()[3])
    resumed = {m["step"]: m for m in metrics(run_dir)}
    repeated = [m for m in metrics(run_dir, "metrics_uninterrupted.jsonl") if m["step"] > first]
    missing = [m["step"] for m in repeated if m["step"] not in resumed]
    if not repeated or missing:
        return f"resumed from step {first}; steps missing from the resumed run: {missing or 'all'}", False

    def largest(field: str) -> float:
        return max(abs(resumed[m["step"]][field] - m[field]) / abs(m[field]) for m in repeated)

    loss, grad_norm = largest("loss"), largest("grad_norm")
    return (f"resumed from step {first}; steps {repeated[0]['step']}-{repeated[-1]['step']} repeated, "
            f"max rel. diff: loss {loss:.2e}, grad norm {grad_norm:.2e}"), loss == 0 and grad_norm == 0


def run_study(directory: Path, out: Path, parts: tuple[str, ...], budget_s: float, best: Optional[str],
              only: tuple[str, ...] = ()) -> int:
    """The study's runs of `parts` (those whose names match an `only` pattern, where given), group by group
    (study_groups): timed columns round-robin, each process alone on the GPU; side-by-side runs together; only
    what fits in what is left of the budget. The GPU's clock and power are sampled during each timed process."""
    directory = directory.resolve()  # each engine runs in its run dir, given its config by absolute path
    study, prepared_at, runs = load_study(directory)
    started = time.monotonic()
    outcomes: dict[str, list[Outcome]] = {}  # a column's rounds, in order
    finished: list[tuple[Run, Outcome]] = []

    def left_s() -> float:
        return budget_s - (time.monotonic() - started)

    def rows() -> dict[str, dict]:
        return {run.name: row(run, [(round_dir(directory, run, k), outcome)
                                    for k, outcome in enumerate(outcomes[run.name], 1)])
                for run in runs if run.name in outcomes}

    def record(run: Run, outcome: Outcome) -> None:
        outcomes.setdefault(run.name, []).append(outcome)
        finished.append((run, outcome))
        print(f"[{time.monotonic() - started:4.0f} s] {run.name} round {len(outcomes[run.name])}/{run.rounds}: "
              f"{outcome.status} in {outcome.wall_s:.0f} s {outcome.error}{outcome.note}", flush=True)
        write_results(study, [r for r in runs if r.name in outcomes], rows(), out, directory, best, prepared_at,
                      clock_note(finished), archives=False)  # a call cut short keeps what it measured

    def not_run(needed: float) -> Outcome:
        return Outcome(f"not run (budget: ~{needed:.0f} s needed, {max(left_s(), 0):.0f} s left)")

    def side_by_side(group: list[Run]) -> None:
        """The group's runs in the study's order, side_by_side_slots of them at once, each started when a slot frees
        while the budget lasts (so no slot waits for the slowest run of a batch): a recipe study's runs are
        checkpointed, so the next call continues the runs cut short and starts the ones not run."""
        earlier = {run.name: outcome for run in group
                   if (outcome := finished_earlier(run, round_dir(directory, run, 1)))}
        for run in group:
            if run.name in earlier:
                record(run, earlier[run.name])
        group = [run for run in group if run.name not in earlier]
        free_gib = torch.cuda.mem_get_info()[0] / 2**30 if device.type == "cuda" else None

        def start(run: Run) -> Outcome:
            needed = estimate_s(run, finished)
            if left_s() < needed:
                return not_run(needed)
            return execute(run, round_dir(directory, run, 1), min(run.timeout_s, left_s()))

        with ThreadPoolExecutor(side_by_side_slots(group, free_gib)) as pool:
            futures = {pool.submit(start, run): run for run in group}  # started in submission order
            for future in as_completed(futures):
                record(futures[future], future.result())

    def interleaved(group: list[Run]) -> None:
        """The configurations whose rounds all fit, from the first on (a configuration's engines together), then
        their processes round-robin; one that no longer fits is not run."""
        chosen: list[Run] = []
        fits = True
        for _, same in itertools.groupby(group, lambda run: run.configuration):
            same = list(same)
            needed = sum(run.rounds * estimate_s(run, finished) for run in chosen + same)
            fits = fits and needed <= left_s()
            if fits:
                chosen += same
            else:
                for run in same:
                    for _ in range(run.rounds):
                        record(run, not_run(needed))
        for run, round_ in round_robin(chosen):
            needed = estimate_s(run, finished)
            record(run, not_run(needed) if left_s() < needed else sampled(run, round_))

    def sampled(run: Run, round_: int) -> Outcome:
        """A timed process, with nvidia-smi sampling the GPU meanwhile (a sampler per process: TELEMETRY_MS)."""
        with gpu_telemetry(device, interval_ms=TELEMETRY_MS) as gpu:
            outcome = execute(run, round_dir(directory, run, round_), min(run.timeout_s, left_s()))
        return dataclasses.replace(outcome, gpu=gpu)

    def wanted(run: Run) -> bool:
        return run.part in parts and (run.part != "ablations" or run.precision == best)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for group in study_groups(runs):
        if group[0].part == "ablations" and "ablations" in parts:
            best = best or fastest_fp8(runs, rows())
        chosen = [run for run in group if wanted(run) and (
            not only or any(fnmatch.fnmatchcase(run.name, pattern) for pattern in only))]
        if any(run.switch for run in chosen):  # ablations are measured beside their tuned run, whatever `only` says
            chosen = [run for run in group if run in chosen or (wanted(run) and not run.switch)]
        if chosen:
            (side_by_side if chosen[0].side_by_side else interleaved)(chosen)

    done = [run for run in runs if run.name in outcomes]
    final = rows()
    if study == "loss":
        judge_losses(done, final)
    write_results(study, done, final, out, directory, best, prepared_at, clock_note(finished))
    print((out / "results.md").read_text())
    return 0 if all(final[run.name]["status"] == "ok" for run in done) else 1


# ---- tables ----


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


def number(value: Optional[float], spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def engine_pair(name: str) -> str:
    """The name of the same configuration on the other engine (the torch engine's and megatron's runs are named
    alike: `<engine>-<precision>`, `<engine>-nemotron4_15b-<precision>`)."""
    engine, rest = name.split("-", 1)
    return f"{'torch' if engine == 'megatron' else 'megatron'}-{rest}"


def timing(r: dict) -> str:
    """The cells s/step | spread | timed steps (rounds) | SM MHz | W of a timed column's row."""
    spread = f"{r['step_min_s']:.3f}-{r['step_max_s']:.3f}" if r.get("step_min_s") is not None else "-"
    return (f"{number(r.get('step_s'), '.3f')} | {spread} | {r.get('timed_steps', 0)} ({r.get('rounds', 0)}) | "
            f"{number(r.get('sm_clock_mhz'), '.0f')} | {number(r.get('power_w'), '.0f')}")


def speed_tables(runs: list[Run], rows: dict[str, dict], best: Optional[str]) -> list[str]:
    def step(name: str) -> Optional[float]:
        return rows.get(name, {}).get("step_s")

    compared = [r for r in runs if r.part in ("precisions", "torch", "nemotron") and r.name in rows]
    lines = ["## Precisions (llama3_8b, 8 layers, full vocabulary, mock data, seq 8192, micro-batch 1 x 8 per step)",
             "", "| engine | precision | s/step | spread | timed steps (rounds) | SM MHz | W | tokens/s/GPU | "
             "TFLOP/s/GPU | MFU | peak GiB | vs own bf16 | torch vs megatron | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in compared:
        r = rows[run.name]
        bf16 = step(f"{run.engine}-bf16") if run.part != "nemotron" else None
        lines.append(
            f"| {run.engine}{' (' + run.model + ', 4 layers)' if run.part == 'nemotron' else ''} | {run.precision} | "
            f"{timing(r)} | {number(r['tokens_per_s_per_gpu'], ',.0f')} | {number(r['tflops_per_gpu'], '.0f')} | "
            f"{number(r['mfu'], '.1%')} | {number(r['peak_gib'], '.1f')} | "
            f"{ratio(bf16, r['step_s']) if run.precision != 'bf16' else '-'} | "
            f"{ratio(step(engine_pair(run.name)), r['step_s']) if run.engine == 'torch' else '-'} | "
            f"{r['status']} {r['error']} |")
    lines += ["", "s/step: the median of the timed steps of all rounds (each round its own process; the columns "
              "round-robin, the order reversed every round), spread: their min-max; SM clock and power: medians of "
              "nvidia-smi's samples during those steps. \"torch vs megatron\": engine=megatron's s/step over the "
              "torch engine's, same recipe and model (above 1: the torch engine is faster).",
              *engine_differences(compared, rows), "",
              "## Where the profiled step's GPU time goes (ms of kernels, recipes.profiling; round 1)", "",
              "| run | " + " | ".join(CATEGORY_NAMES) + " | all kernels |",
              "|---|" + "---|" * (len(CATEGORY_NAMES) + 1)]
    for run in compared:
        r = rows[run.name]
        lines.append(f"| {run.name} | " + " | ".join(number(r.get(f"{c}_ms"), '.1f') for c in CATEGORY_NAMES)
                     + f" | {number(r.get('kernels_ms'), '.1f')} |")
    lines += ["", *target_table(compared, rows)]
    ablations = [r for r in runs if r.part == "ablations" and r.name in rows]
    if ablations:
        lines += ["", *ablation_table(ablations, rows, best)]
    fsdp = [r for r in runs if r.part == "fsdp" and r.name in rows]
    if fsdp:
        lines += ["", "## Megatron-FSDP beside DDP with the distributed optimizer (same model and batch, one GPU)", "",
                  "| precision | FSDP s/step | DDP s/step | FSDP / DDP time | FSDP peak GiB | DDP peak GiB | status |",
                  "|---|---|---|---|---|---|---|"]
        for run in fsdp:
            r, ddp = rows[run.name], rows.get(f"megatron-{run.precision}", {})
            lines.append(f"| {run.precision} | {number(r['step_s'], '.3f')} | {number(ddp.get('step_s'), '.3f')} | "
                         f"{ratio(r['step_s'], ddp.get('step_s'))} | {number(r['peak_gib'], '.1f')} | "
                         f"{number(ddp.get('peak_gib'), '.1f')} | {r['status']} {r['error']} |")
    functional = [r for r in runs if r.part == "functional" and r.name in rows]
    if functional:
        lines += ["", "## Functional checks (side by side on the GPU: no timings)", "",
                  "| run | steps | final loss | result | status |", "|---|---|---|---|---|"]
        for run in functional:
            r = rows[run.name]
            lines.append(f"| {run.name} | {r['steps']} | {number(r['final_loss'], '.4f')} | {r['note'] or '-'} | "
                         f"{r['status']} {r['error']} |")
    return lines


def engine_differences(compared: list[Run], rows: dict[str, dict]) -> list[str]:
    """The settings in which engine=megatron's columns differ from the torch engine's, from the configs they ran."""
    megatron = [rows[r.name] for r in compared if r.engine == "megatron"]
    buffers = sorted({"FP32" if r.get("grad_reduce_in_fp32") else "BF16" for r in megatron
                      if r.get("grad_reduce_in_fp32") is not None})
    fp8_weights = [r["precision"] for r in megatron if r.get("fp8_param_gather")]
    if not buffers:
        return []
    like = "" if buffers == ["FP32"] else " (like-for-like with it: the ablation grad_reduce_in_fp32=true)"
    return ["", "Where the engines differ here: engine=megatron sums and reduces gradients in a "
            f"{' or '.join(buffers)} buffer (megatron.grad_reduce_in_fp32; BF16 is NVIDIA's performance recipes' "
            f"setting), the torch engine in FP32 main gradients{like}; "
            "engine=megatron holds its weights as FP8 tensors between steps (precision.fp8_param_gather) in "
            f"{', '.join(sorted(set(fp8_weights))) or 'none of these'} (ablation fp8_param_gather=false); "
            "engine=megatron runs Transformer Engine's layers eagerly (TE's attention, fused RoPE and "
            "cross-entropy), the torch engine compiles each block (torch.compile; SDPA's cuDNN attention, its own "
            "fused output layer and loss)."]


def ablation_table(ablations: list[Run], rows: dict[str, dict], best: Optional[str]) -> list[str]:
    """Each switch beside the tuned run measured in the same round-robin, and which gradient buffer is the torch
    engine's like-for-like."""
    tuned = next((rows[r.name] for r in ablations if not r.switch), {})
    lines = [f"## Tuning switches, one at a time on megatron {best}, round-robin with the tuned run", "",
             "| switch | s/step | spread | timed steps (rounds) | SM MHz | W | vs tuned | status |",
             "|---|---|---|---|---|---|---|---|"]
    for run in ablations:
        r = rows[run.name]
        change = f"{r['step_s'] / tuned['step_s'] - 1:+.1%}" if r.get("step_s") and tuned.get("step_s") and run.switch \
            else "-"
        lines.append(f"| {run.switch or '(tuned)'} | {timing(r)} | {change} | {r['status']} {r['error']} |")
    if tuned.get("grad_reduce_in_fp32") is not None:
        fp32 = tuned["grad_reduce_in_fp32"]
        lines += ["", f"The tuned run reduces gradients in {'FP32' if fp32 else 'BF16'} "
                  f"(megatron.grad_reduce_in_fp32={str(fp32).lower()}); the torch engine keeps FP32 main gradients, "
                  f"so {'the tuned run' if fp32 else 'grad_reduce_in_fp32=true'} is the like-for-like one."]
    return lines


def target_table(compared: list[Run], rows: dict[str, dict]) -> list[str]:
    """The torch engine against engine=megatron, met or missed: step time and peak memory in each recipe, and the
    torch engine's fp8_current speedup over its own bf16; missing where a run has no timing."""
    def verdict(met: Optional[bool]) -> str:
        return "-" if met is None else "met" if met else "missed"

    lines = ["## Targets (the torch engine against engine=megatron, this call)", "", "| target | measured | result |",
             "|---|---|---|"]
    for run in (r for r in compared if r.engine == "torch"):
        ours, theirs = rows[run.name], rows.get(engine_pair(run.name), {})
        for what, column, spec in (("s/step", "step_s", ".3f"), ("peak GiB", "peak_gib", ".1f")):
            a, b = ours.get(column), theirs.get(column)
            lines.append(f"| {run.name}: {what} <= megatron's | {number(a, spec)} vs {number(b, spec)} | "
                         f"{verdict(a <= b if a and b else None)} |")
    bf16, current = (rows.get(f"torch-{p}", {}).get("step_s") for p in ("bf16", "fp8_current"))
    speedup = bf16 / current if bf16 and current else None
    lines.append(f"| torch fp8_current over torch bf16 >= {CURRENT_OVER_BF16_TARGET:.2f}x | "
                 f"{number(speedup, '.3f')}x | {verdict(speedup >= CURRENT_OVER_BF16_TARGET if speedup else None)} |")
    return lines


SAME_ENGINE_BF16, TORCH_SAME_RECIPE, SAME_SEED_BF16 = "same engine's bf16", "torch engine, same recipe", "bf16"


def loss_references(run: Run) -> dict[str, str]:
    """What a loss-study run is compared with: its engine's BF16 run (of its seed, in a recipe study) and, on
    engine=megatron, the torch engine's run of the same recipe (label: run name)."""
    if run.seed is not None:
        return {} if run.precision == "bf16" else {SAME_SEED_BF16: f"torch-llama3_100m-bf16-seed{run.seed}"}
    references = {} if run.precision == "bf16" else {SAME_ENGINE_BF16: f"{run.engine}-llama3_100m-bf16"}
    if run.engine != "torch":
        references[TORCH_SAME_RECIPE] = f"torch-llama3_100m-{run.precision}"
    return references


def loss_gap(rows: dict[str, dict], name: str, reference: str) -> Optional[float]:
    own, theirs = (rows.get(n, {}).get("mean_loss_last_100") for n in (name, reference))
    return own / theirs - 1 if own and theirs else None


def judge_losses(runs: list[Run], rows: dict[str, dict]) -> None:
    """An FP8 run of the loss study that finished is failed where its mean loss is more than LOSS_GAP_TARGET away
    from a reference's (loss_references), or where a reference has no loss to compare with."""
    for run in runs:
        if run.precision == "bf16" or rows[run.name]["status"] != "ok":
            continue
        gaps = [loss_gap(rows, run.name, reference) for reference in loss_references(run).values()]
        if any(gap is None or abs(gap) > LOSS_GAP_TARGET for gap in gaps):
            rows[run.name]["status"] = f"failed (loss gap over {LOSS_GAP_TARGET:.0%} or no reference)"


def loss_tables(runs: list[Run], rows: dict[str, dict]) -> list[str]:
    def gap(run: Run, label: str) -> str:
        reference = loss_references(run).get(label)
        value = loss_gap(rows, run.name, reference) if reference else None
        return "-" if reference is None else f"{value:+.2%}" if value is not None else "no loss"

    lines = [f"## Loss: llama3_100m on the bundled text, mean loss of the last {LOSS_WINDOW} steps", "",
             f"An FP8 run is failed where it is more than {LOSS_GAP_TARGET:.0%} from its engine's BF16 run or, on "
             "engine=megatron, from the torch engine's run of the same recipe.", "",
             "| engine | precision | steps | mean loss | vs same engine's bf16 | vs torch engine, same recipe "
             "| status |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        r = rows[run.name]
        lines.append(f"| {run.engine} | {run.precision} | {r['steps']} | {number(r['mean_loss_last_100'], '.4f')} | "
                     f"{gap(run, SAME_ENGINE_BF16)} | {gap(run, TORCH_SAME_RECIPE)} | "
                     f"{r['status']} {r['error']} |")
    return lines


def recipe_study_tables(runs: list[Run], rows: dict[str, dict]) -> list[str]:
    """Each run against the BF16 run of its seed, then each configuration's gaps over the seeds."""
    lines = [f"## Loss: llama3_100m on the bundled text, mean loss of the last {LOSS_WINDOW} steps, against BF16 "
             "of the same seed", "",
             "Step times are medians while every run of the study shared the GPU: they rank the recipes' cost, not "
             "their speed alone.", "",
             "| configuration | seed | steps | mean loss | vs bf16 | s/step (shared GPU) | status |",
             "|---|---|---|---|---|---|---|"]
    gaps: dict[str, list[float]] = {}
    for run in runs:
        r = rows[run.name]
        reference = loss_references(run).get(SAME_SEED_BF16)
        gap = loss_gap(rows, run.name, reference) if reference else None
        if gap is not None and r["status"] == "ok":
            gaps.setdefault(run.precision, []).append(gap)
        cell = "-" if reference is None else f"{gap:+.2%}" if gap is not None else "no loss"
        note = f"({r['note']})" if r.get("note") else ""
        lines.append(f"| {run.precision} | {run.seed} | {r['steps']} | {number(r['mean_loss_last_100'], '.4f')} | "
                     f"{cell} | {number(r.get('median_step_s'), '.3f')} | {r['status']} {r['error']}{note} |")
    lines += ["", f"Across seeds (runs that finished), against the target of {RECIPE_STUDY_TARGET:.1%}:", "",
              "| configuration | seeds | mean gap | min | max | within target |", "|---|---|---|---|---|---|"]
    for label in dict.fromkeys(run.precision for run in runs if run.precision != "bf16"):
        found = gaps.get(label, [])
        mean = statistics.fmean(found) if found else None
        verdict = "-" if mean is None else "yes" if abs(mean) <= RECIPE_STUDY_TARGET else "no"
        lines.append(f"| {label} | {len(found)} | {'-' if mean is None else f'{mean:+.2%}'} | "
                     f"{f'{min(found):+.2%}' if found else '-'} | {f'{max(found):+.2%}' if found else '-'} | "
                     f"{verdict} |")
    return lines


def clock_note(finished: list[tuple[Run, Outcome]]) -> str:
    """results.md's line on the GPU's clock and power: how they were sampled, or why they were not."""
    gpus = [outcome.gpu for _, outcome in finished if outcome.gpu]
    if any("timeline" in gpu for gpu in gpus):
        return (f"GPU clock and power: nvidia-smi every {TELEMETRY_MS} ms (recipes.profiling.gpu_telemetry), "
                "medians over each column's timed steps")
    why = sorted({gpu["unavailable"] for gpu in gpus if "unavailable" in gpu})
    return f"GPU clock and power not recorded: {'; '.join(why)}" if why else ""


def write_results(study: str, runs: list[Run], rows: dict[str, dict], out: Path, directory: Path,
                  best: Optional[str], prepared_at: str, clock: str = "", archives: bool = True) -> None:
    """results.md and results.csv, provenance.json (command, commit, date, versions, device); with `archives`,
    runs.tar.gz of the rounds' small files (a checkpoint is gigabytes) and traces.tar.gz of engine=megatron's
    profiled steps (Transformer Engine's kernels one by one, for Perfetto; apart, as they can be large)."""
    out.mkdir(parents=True, exist_ok=True)
    tables = (speed_tables(runs, rows, best) if study == "speed" else loss_tables(runs, rows) if study == "loss"
              else recipe_study_tables(runs, rows))
    info = provenance()  # the commit of the code that runs here, or unknown: not the one prepare ran at
    te = info["versions"].get("transformer_engine") or (
        "(version unknown)" if importlib.util.find_spec("transformer_engine") else None)
    commit = ("The project's commit is unknown: this tree is not its own git checkout and FP8_RECIPES_COMMIT is "
              f"not set. The configs were prepared at commit {prepared_at}." if info["commit"] == "unknown" else
              f"The configs were prepared at commit {prepared_at}.")
    footer = ["", f"commit {info['commit']}; {info['device']}; versions {info['versions']}", commit,
              *([clock] if clock else []),
              f"Transformer Engine {te + ' importable by every run' if te else 'not installed'} (the torch engine's "
              "runs import it through megatron-core, as in a NeMo container)", f"command: {' '.join(sys.argv)}"]
    title = f"# scripts/megatron_bench.py: {study} study"
    (out / "results.md").write_text("\n".join([title, "", *tables, *footer]) + "\n")
    record = {"command": "python scripts/megatron_bench.py " + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **info,
              "prepared_at_commit": prepared_at, "transformer_engine_importable": bool(te)}
    (out / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[runs[0].name]) if runs else ["name"])
        writer.writeheader()
        writer.writerows(rows[r.name] for r in runs)
    if not archives:
        return
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for run in runs:
            for folder in (round_dir(directory, run, k) for k in range(1, run.rounds + 1)):
                for name in KEPT_FILES:
                    if (folder / name).is_file():
                        tar.add(folder / name, arcname=f"runs/{folder.name}/{name}")
    traces = [(run.name, directory / run.name / PROFILE_TRACE) for run in runs
              if run.engine == "megatron" and rows[run.name].get("kernels_ms") is not None]  # profiled in this call
    if traces:
        with tarfile.open(out / "traces.tar.gz", "w:gz", compresslevel=6) as tar:
            for name, trace in traces:
                if trace.is_file():
                    tar.add(trace, arcname=f"runs/{name}/{PROFILE_TRACE}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="compose every run's config.yaml (needs Hydra: run it here)")
    prep.add_argument("--dir", type=Path, required=True)
    prep.add_argument("--study", choices=("speed", "loss", *RECIPE_STUDIES), default="speed")
    prep.add_argument("--gpu", default="h200", help="conf/gpu option of the GPU machine (peaks for MFU)")
    prep.add_argument("--steps", type=int, help=f"speed: timed steps per round (default {TIMED_STEPS}); loss: steps "
                                                "(default 500); a recipe study: steps (default 2000)")
    prep.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="a recipe study's seeds (trainer.seed)")
    prep.add_argument("--rounds", type=int, default=ROUNDS, help="speed: processes per timed column")
    take = commands.add_parser("adopt", help="a recipe study's runs that an earlier call finished, from its "
                                             "runs.tar.gz into --dir, so that `run` reports them (adopt)")
    take.add_argument("--dir", type=Path, required=True, help="the folder `prepare` wrote")
    take.add_argument("--runs", type=Path, required=True, help="OUT/runs.tar.gz of the earlier call")
    go = commands.add_parser("run", help="run the prepared configurations on this machine's GPU")
    go.add_argument("--dir", type=Path, required=True, help="the folder `prepare` wrote")
    go.add_argument("--out", type=Path, required=True, help="results.md, results.csv, runs.tar.gz, traces.tar.gz")
    go.add_argument("--parts", default=",".join(SPEED_PARTS), help=f"speed study: some of {','.join(SPEED_PARTS)}")
    go.add_argument("--only", default="",
                    help="of those, only the runs whose names match one of these comma-separated patterns "
                         "('*-bf16,*-fp8_current'; an ablation brings its tuned run)")
    go.add_argument("--budget-s", type=float, default=480.0, help="no run starts that would not finish within this")
    go.add_argument("--best", choices=FP8_RECIPES,
                    help="the FP8 recipe of the ablations (default: the fastest one measured in this call)")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        if args.study == "speed":
            runs = speed_runs(args.gpu, args.steps or TIMED_STEPS, args.rounds)
        elif args.study == "loss":
            runs = loss_runs(args.gpu, args.steps or 500)
        else:
            runs = recipe_study_runs(args.study, args.gpu, args.steps or 2000,
                                     tuple(int(seed) for seed in args.seeds.split(",")))
        prepare(args.study, runs, args.dir)
        print(f"prepared {args.dir}/study.json; on the GPU machine: "
              f"python scripts/megatron_bench.py run --dir {args.dir} --out OUT")
        return 0
    if not (args.dir / "study.json").is_file():
        parser.error(f"{args.dir}/study.json not found: run `prepare --dir {args.dir}` first (on a machine with Hydra)")
    if args.command == "adopt":
        taken = adopt(args.dir, args.runs)
        print(f"adopted {len(taken)} finished run(s) into {args.dir}: {', '.join(taken) or 'none'}")
        return 0
    study = load_study(args.dir)[0]
    parts = tuple(args.parts.split(",")) if study == "speed" else ("loss",)
    unknown = set(parts) - set(SPEED_PARTS) - {"loss"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose among {','.join(SPEED_PARTS)}")
    if "ablations" in parts and "precisions" not in parts and not args.best:
        parser.error("--parts ablations without precisions needs --best RECIPE (the FP8 recipe to vary)")
    fp8_megatron = any(r.engine == "megatron" and r.precision != "bf16" for r in load_study(args.dir)[2]
                       if r.part in parts)
    if fp8_megatron and importlib.util.find_spec("transformer_engine") is None:
        parser.error("engine=megatron's FP8 runs need Transformer Engine, which this Python cannot import: install "
                     "it (docs/engines.md, engine=megatron outside a container), or leave those parts out (--parts)")
    only = tuple(pattern for pattern in args.only.split(",") if pattern)
    return run_study(args.dir, args.out, parts, args.budget_s, args.best, only)


if __name__ == "__main__":
    sys.exit(main())
