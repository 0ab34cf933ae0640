"""engine=megatron with Transformer Engine on one GPU: every Hopper recipe with NVIDIA's tuning, what each tuning
switch buys, the torch engine beside it; or the loss of each recipe over 500 steps.

    python scripts/megatron_bench.py prepare --dir bench/speed                    # here, with Hydra: the run dirs
    python scripts/megatron_bench.py run --dir bench/speed --out OUT              # on the GPU machine
    python scripts/megatron_bench.py run --dir bench/speed --out OUT2 --parts ablations --best fp8_current
    python scripts/megatron_bench.py prepare --study loss --dir bench/loss
    python scripts/megatron_bench.py run --dir bench/loss --out OUT3

`prepare` composes each configuration as `launch/run.py ... dryrun=true run.dir=DIR/<name>` does (Hydra, the
plan's checks, the plan into plan.txt, config.yaml for the engine) and lists them in DIR/study.json. `run` starts
each as its own process, `python -m <engine module> DIR/<name>/config.yaml` (the plan's command), so a crash
stops only that configuration; it needs only what the engines need (torch, PyYAML, rich, megatron-core, Transformer
Engine for FP8), not Hydra or nemo-run.

The speed study (llama3_8b with 8 layers, full vocabulary, mock data, seq 8192, micro-batch 1 x 8 per step), in
this order:
  precisions  engine=megatron bf16, fp8_current, fp8_delayed, fp8_blockwise with the tuned defaults (cfg.megatron)
  torch       engine=torch in the same four recipes on the same model and batch (compiled)
  functional  side by side (checks, not timings): a resume from a distributed checkpoint in every Hopper recipe
              and bf16, with the distributed optimizer and without, and under Megatron-FSDP in bf16, fp8_current and
              fp8_delayed (llama3_100m): run to step 6 with checkpoints at 3 and 6, cut back to step 3, run again;
              steps 4-6 repeat, and the run is failed unless each one's loss and gradient norm equal the
              uninterrupted run's
  nemotron    nemotron4_15b, 4 layers, fp8_current, on both engines: LayerNorm1p and squared ReLU
  fsdp        Megatron-FSDP in bf16 and fp8_current on the precisions' model, beside DDP's step time and memory
  ablations   the fastest FP8 recipe of `precisions` (or --best) with one switch changed at a time, most telling first
Every timed run profiles one step after its timed ones (`trainer.profile_step`, left out of the timing), and the
tables split its kernel time by kernel name (GEMM, the output layer's included; attention; quantization; loss;
optimizer; other: recipes.profiling); a targets table says, met or missed, whether the torch engine is at least as
fast as engine=megatron in each recipe with no more memory, and its fp8_current speedup over its own bf16.
Timed runs go one at a time, while --budget-s lasts (a run's cost is estimated from the finished runs of the same
engine and model); one that does not fit is listed as not run, for another call with --parts.

The loss study: llama3_100m on the bundled text, 500 steps, bf16 and each Hopper FP8 recipe on both engines, all at
once (losses, not timings). Its table gives each run's mean loss over the last 100 steps against the BF16 run of
the same engine and the torch engine's run of the same recipe; `scripts/compare.py OUT/runs` makes the report.

Timings are medians over the steps after each run's warm-up steps (compilation, first FP8 casts, CUDA graph capture).
Every run sees the same Python: with Transformer Engine installed (megatron-core's FP8 needs it), the torch engine's
runs import it too, through megatron-core, as in a NeMo container; results.md says whether it was importable.
OUT receives results.md, results.csv, provenance.json and runs.tar.gz (each run's config.yaml, plan.txt,
metrics.jsonl, summary.json and logs; no checkpoints).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from recipes.config import REPO_ROOT, load_config, load_option
from recipes.plan import launch_command
from recipes.profiling import CATEGORY_NAMES
from recipes.provenance import git_commit, provenance
from recipes.run_files import CONFIG, METRICS, SUMMARY, TRAIN_LOG

FP8_RECIPES = ("fp8_current", "fp8_delayed", "fp8_blockwise")  # the Hopper ones: MXFP8 needs Blackwell
SPEED_PARTS = ("functional", "precisions", "torch", "nemotron", "fsdp", "ablations")
FIRST_GUESS_S = {"megatron": 90.0, "torch": 150.0}  # a run's cost before any run of its kind has finished
PROFILE_SPLIT = "profile/time_rank0.json"  # recipes.profiling's split of the profiled step
KEPT_FILES = (CONFIG, "plan.txt", METRICS, "metrics_uninterrupted.jsonl", SUMMARY, TRAIN_LOG,
              "train_resumed.log", PROFILE_SPLIT)
CURRENT_OVER_BF16_TARGET = 1.30  # the torch engine's fp8_current speedup over its own bf16
LOSS_WINDOW = 100  # the loss study compares the mean loss of the last 100 steps
LOSS_GAP_TARGET = 0.02  # each FP8 recipe's mean loss within 2% of its references' (loss_references)


@dataclass(frozen=True)
class Run:
    name: str
    part: str
    engine: str
    precision: str
    overrides: tuple[str, ...]  # launch/run.py arguments
    switch: str = ""  # an ablation: what differs from the tuned run of the same precision
    side_by_side: bool = False  # shares the GPU with the other side-by-side runs: a check or a loss, not a timing
    warmup: int = 2  # steps left out of the timing
    resume: bool = False  # run again from the checkpoint before the last, which is removed first
    profile_step: Optional[int] = None  # profiled (trainer.profile_step), so left out of the timing
    timeout_s: float = 300.0  # a hung process is killed (and never later than the budget allows)

    @property
    def model(self) -> str:
        return next(o.split("=", 1)[1] for o in self.overrides if o.startswith("model="))


# megatron-core's unsharded optimizer, which updates no FP8 weights (so none kept): an ablation, and the resume
# checks' second optimizer.
WITHOUT_DISTRIBUTED_OPTIMIZER = ("parallel.distributed_optimizer=false", "precision.fp8_param_gather=false")
# Megatron-FSDP: timed beside DDP in the recipes the issue names; resumed in those and in delayed scaling, whose amax
# histories are the state Megatron-LM's fsdp_dtensor checkpoint drops and ours keeps.
FSDP_TIMED = ("bf16", "fp8_current")
FSDP_RESUMES = ("bf16", "fp8_current", "fp8_delayed")

# One switch at a time on the fastest FP8 recipe, most telling first (the budget may stop the list early).
ABLATIONS = (
    ("gradient_accumulation_fusion=false", ("megatron.gradient_accumulation_fusion=false",)),
    ("cross_entropy_loss_fusion=false", ("megatron.cross_entropy_loss_fusion=false",)),
    ("fp8_param_gather=false", ("precision.fp8_param_gather=false",)),
    ("apply_rope_fusion=false", ("megatron.apply_rope_fusion=false",)),
    ("bias_activation_fusion=false", ("megatron.bias_activation_fusion=false",)),
    ("grad_reduce_in_fp32=false", ("megatron.grad_reduce_in_fp32=false",)),  # NeMo's performance scripts' value
    ("cuda_graphs=true", ("megatron.cuda_graphs=true",)),
    ("distributed_optimizer=false", WITHOUT_DISTRIBUTED_OPTIMIZER),
    ("bias_dropout_fusion=false", ("megatron.bias_dropout_fusion=false",)),
    ("overlaps=false", ("megatron.overlap_grad_reduce=false", "megatron.overlap_param_gather=false")),
)


def speed_runs(gpu: str, steps: int) -> list[Run]:
    def proxy(model: str, layers: int, engine: str = "megatron", max_steps: int = steps) -> tuple[str, ...]:
        return (f"engine={engine}", f"gpu={gpu}", f"model={model}", f"model.num_layers={layers}", "data=mock",
                "trainer.micro_batch_size=1", "trainer.global_batch_size=8", f"trainer.max_steps={max_steps}",
                "trainer.log_interval=1")

    def profiled(name: str, part: str, engine: str, precision: str, model: str, layers: int, *extra: str) -> Run:
        """A timed run, then one more step profiled."""
        overrides = (*proxy(model, layers, engine, steps + 1), f"trainer.profile_step={steps + 1}",
                     f"precision={precision}", *extra)
        return Run(name, part, engine, precision, overrides, profile_step=steps + 1)

    runs = [profiled(f"{engine}-{p}", part, engine, p, "llama3_8b", 8)
            for engine, part in (("megatron", "precisions"), ("torch", "torch")) for p in ("bf16", *FP8_RECIPES)]
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
    runs += [profiled(f"{engine}-nemotron4_15b-fp8_current", "nemotron", engine, "fp8_current", "nemotron4_15b", 4)
             for engine in ("megatron", "torch")]
    runs += [profiled(f"megatron-fsdp-{p}", "fsdp", "megatron", p, "llama3_8b", 8, "parallel.fsdp=true")
             for p in FSDP_TIMED]
    for recipe in FP8_RECIPES:
        for switch, overrides in ABLATIONS:
            if switch == "fp8_param_gather=false" and not load_option("precision", recipe).fp8_param_gather:
                continue  # already off in this recipe's preset
            graphs = switch == "cuda_graphs=true"  # capture happens in the first steps: time more of them
            runs.append(Run(f"megatron-{recipe}--{switch.split('=')[0]}", "ablations", "megatron", recipe,
                            (*proxy("llama3_8b", 8, max_steps=steps + 4 if graphs else steps), f"precision={recipe}",
                             *overrides), switch=switch, warmup=6 if graphs else 2))
    return runs


def loss_runs(gpu: str, steps: int) -> list[Run]:
    """The convergence study's settings (docs/results), 500 steps: seq 1024, micro = global batch 8, lr 1e-3."""
    return [Run(f"{engine}-llama3_100m-{p}", "loss", engine, p,
                (f"engine={engine}", f"gpu={gpu}", "model=llama3_100m", "data=text", f"precision={p}",
                 "trainer.micro_batch_size=8", "trainer.global_batch_size=8", f"trainer.max_steps={steps}",
                 "trainer.warmup_steps=100", "trainer.log_interval=50", "data.cache_dir=cache"),
                side_by_side=True, timeout_s=3600.0)
            for engine in ("megatron", "torch") for p in ("bf16", *FP8_RECIPES)]


# ---- prepare (here, with Hydra) ----


def prepare(study: str, runs: list[Run], directory: Path) -> None:
    """Each run's config.yaml and plan.txt, composed and checked as launch/run.py does with dryrun=true, and
    DIR/study.json listing the runs in order."""
    from hydra import compose, initialize_config_dir

    from recipes.config import CONF_DIR
    from recipes.folders import save_config
    from recipes.hydra_schema import check_override_keys, register_schema, to_config
    from recipes.plan import make_plan
    from recipes.plan.describe import describe
    from recipes.plan.gpu import resolve

    register_schema()
    directory.mkdir(parents=True, exist_ok=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for run in runs:
            run_dir = (directory / run.name).resolve()
            overrides = [*run.overrides, "dryrun=true", f"run.dir={run_dir}"]
            check_override_keys(overrides)
            cfg = resolve(to_config(compose("config", overrides=overrides)))
            plan = make_plan(cfg, run_dir / CONFIG)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "plan.txt").write_text(describe(plan) + "\n")
            save_config(dataclasses.replace(cfg, dryrun=False), run_dir / CONFIG)
    record = {"study": study, "commit": git_commit(), "runs": [dataclasses.asdict(run) for run in runs]}
    (directory / "study.json").write_text(json.dumps(record, indent=1) + "\n")


def load_study(directory: Path) -> tuple[str, str, list[Run]]:
    record = json.loads((directory / "study.json").read_text())
    runs = [Run(**{**fields, "overrides": tuple(fields["overrides"])}) for fields in record["runs"]]
    return record["study"], record["commit"], runs


# ---- run (on the GPU machine) ----


@dataclass
class Outcome:
    status: str  # ok, failed (exit status), timeout, not run (why)
    wall_s: float = 0.0
    error: str = ""


def last_error(log: Path) -> str:
    """The last line of a log that says what went wrong (the engines print `error: ...`; Python a traceback)."""
    if not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    flagged = [line for line in lines if line.startswith("error:") or "Error" in line or "error" in line]
    return (flagged or lines or [""])[-1][:300]


def launch(run_dir: Path, log_name: str, timeout_s: float, commit: str) -> tuple[str, str]:
    """The engine on run_dir/config.yaml, the command the plan prints, in run_dir (its relative cache folder)."""
    config = run_dir / CONFIG
    command = launch_command(load_config(config), config)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FP8_RECIPES_COMMIT": os.environ.get("FP8_RECIPES_COMMIT", commit),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    log = run_dir / log_name
    with open(log, "w") as out:
        try:
            status = subprocess.run(command, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            return "timeout", f"killed after {timeout_s:.0f} s"
    return ("ok", "") if status == 0 else (f"failed ({status})", last_error(log))


def execute(run: Run, run_dir: Path, timeout_s: float, commit: str) -> Outcome:
    """One run; a resume run twice: to the end, then again from its next-to-last checkpoint."""
    started = time.monotonic()
    if run.resume:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # an earlier call's would be resumed from
    status, error = launch(run_dir, TRAIN_LOG, timeout_s, commit)
    if status == "ok" and run.resume:
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        shutil.copy(run_dir / METRICS, run_dir / "metrics_uninterrupted.jsonl")
        shutil.rmtree(checkpoints[-1])
        status, error = launch(run_dir, "train_resumed.log", timeout_s - (time.monotonic() - started), commit)
    return Outcome(status, time.monotonic() - started, error)


def estimate_s(run: Run, runs: list[Run], outcomes: dict[str, Outcome]) -> float:
    """The longest finished run of the same engine and model, or a first guess."""
    alike = [outcomes[r.name].wall_s for r in runs if r.name in outcomes and outcomes[r.name].status == "ok"
             and not r.side_by_side and (r.engine, r.model) == (run.engine, run.model)]
    return max(alike, default=FIRST_GUESS_S[run.engine])


def metrics(run_dir: Path, name: str = METRICS) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def median_after_warmup(records: list[dict], warmup: int, field: str, profiled: Optional[int] = None) -> Optional[float]:
    timed = [r[field] for r in records[warmup:] if r.get(field) is not None and r["step"] != profiled]
    return statistics.median(timed) if timed else None


def profile_split(run_dir: Optional[Path]) -> dict[str, Optional[float]]:
    """The profiled step's kernel time per category (ms), and in all; None where the run wrote no profile."""
    path = run_dir / PROFILE_SPLIT if run_dir else None
    split = json.loads(path.read_text()) if path and path.is_file() else None
    return {f"{category}_ms": split["ms"].get(category) if split else None for category in CATEGORY_NAMES} | \
        {"kernels_ms": split["total_ms"] if split else None}


def fastest_fp8(runs: list[Run], rows: dict[str, dict]) -> Optional[str]:
    timed = [(rows[r.name]["step_s"], r.precision) for r in runs
             if r.part == "precisions" and r.precision in FP8_RECIPES and rows.get(r.name, {}).get("step_s")]
    return min(timed)[1] if timed else None


def row(run: Run, run_dir: Path, outcome: Outcome) -> dict:
    """One line of results.csv: the run's identity, outcome and steady-state numbers (timings only of a timed run
    that finished)."""
    records = [] if outcome.status.startswith("not run") else metrics(run_dir)  # not an earlier call's
    timed = not run.side_by_side and outcome.status == "ok"

    def median(field: str) -> Optional[float]:
        return median_after_warmup(records, run.warmup, field, run.profile_step) if timed else None

    timed_steps = [r for r in records[run.warmup:] if r["step"] != run.profile_step]
    result = {
        "name": run.name, "part": run.part, "engine": run.engine, "model": run.model, "precision": run.precision,
        "switch": run.switch, "status": outcome.status, "error": outcome.error, "steps": len(records),
        "timed_steps": len(timed_steps) if timed else 0, "step_s": median("step_time_s"),
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"), "tflops_per_gpu": median("model_tflops_per_gpu"),
        "mfu": median("mfu"), "peak_gib": max((r["peak_memory_gib"] for r in records), default=None),
        "final_loss": records[-1]["loss"] if records else None,
        "mean_loss_last_100": statistics.fmean(r["loss"] for r in records[-LOSS_WINDOW:]) if records else None,
        "wall_s": round(outcome.wall_s, 1), "note": "",
        **profile_split(run_dir if run.profile_step and records else None),
    }
    if run.resume and outcome.status == "ok":
        result["note"], exact = resume_check(run_dir)
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


def run_study(directory: Path, out: Path, parts: tuple[str, ...], budget_s: float, best: Optional[str]) -> int:
    """The study's runs of `parts`, in its order: a timed run alone, consecutive side-by-side runs together; each
    only if its estimated cost fits in what is left of the budget."""
    directory = directory.resolve()  # each engine runs in its run dir, given its config by absolute path
    study, commit, runs = load_study(directory)
    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    rows: dict[str, dict] = {}

    def record(run: Run, outcome: Outcome) -> None:
        outcomes[run.name] = outcome
        rows[run.name] = row(run, directory / run.name, outcome)
        print(f"[{time.monotonic() - started:4.0f} s] {run.name}: {outcome.status} in {outcome.wall_s:.0f} s "
              f"{outcome.error}", flush=True)

    def wanted(run: Run) -> bool:
        nonlocal best
        if run.part == "ablations" and run.part in parts:
            best = best or fastest_fp8(runs, rows)
            return run.precision == best
        if run.part == "precisions" and run.part not in parts:
            return "ablations" in parts and run.precision == best  # the tuned run the ablations are measured against
        return run.part in parts

    def start(group: list[Run]) -> None:
        left = budget_s - (time.monotonic() - started)
        needed = max(estimate_s(run, runs, outcomes) for run in group)
        if left < needed:
            for run in group:
                record(run, Outcome(f"not run (budget: ~{needed:.0f} s needed, {max(left, 0):.0f} s left)"))
            return
        with ThreadPoolExecutor(len(group)) as pool:
            futures = [(run, pool.submit(execute, run, directory / run.name, min(run.timeout_s, left), commit))
                       for run in group]
        for run, future in futures:
            record(run, future.result())

    group: list[Run] = []
    for run in runs:
        if group and not (run.side_by_side and group[-1].side_by_side):
            start(group)
            group = []
        if wanted(run):
            group.append(run)
    if group:
        start(group)

    done = [r for r in runs if r.name in rows]
    if study == "loss":
        judge_losses(done, rows)
    write_results(study, done, rows, out, directory, best, commit)
    print((out / "results.md").read_text())
    return 0 if all(rows[r.name]["status"] == "ok" for r in done) else 1


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


def speed_tables(runs: list[Run], rows: dict[str, dict], best: Optional[str]) -> list[str]:
    def step(name: str) -> Optional[float]:
        return rows.get(name, {}).get("step_s")

    compared = [r for r in runs if r.part in ("precisions", "torch", "nemotron") and r.name in rows]
    lines = ["## Precisions (llama3_8b, 8 layers, full vocabulary, mock data, seq 8192, micro-batch 1 x 8 per step)",
             "", "| engine | precision | s/step | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | vs own bf16 "
             "| torch vs megatron | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in compared:
        r = rows[run.name]
        bf16 = step(f"{run.engine}-bf16") if run.part != "nemotron" else None
        lines.append(
            f"| {run.engine}{' (' + run.model + ', 4 layers)' if run.part == 'nemotron' else ''} | {run.precision} | "
            f"{number(r['step_s'], '.3f')} | {number(r['tokens_per_s_per_gpu'], ',.0f')} | "
            f"{number(r['tflops_per_gpu'], '.0f')} | {number(r['mfu'], '.1%')} | {number(r['peak_gib'], '.1f')} | "
            f"{ratio(bf16, r['step_s']) if run.precision != 'bf16' else '-'} | "
            f"{ratio(step(engine_pair(run.name)), r['step_s']) if run.engine == 'torch' else '-'} | "
            f"{r['status']} {r['error']} |")
    lines += ["", "\"torch vs megatron\": engine=megatron's s/step over the torch engine's, same recipe and model "
              "(above 1: the torch engine is faster).", "",
              "## Where the profiled step's GPU time goes (ms of kernels, recipes.profiling)", "",
              "| run | " + " | ".join(CATEGORY_NAMES) + " | all kernels |", "|---|" + "---|" * (len(CATEGORY_NAMES) + 1)]
    for run in compared:
        r = rows[run.name]
        lines.append(f"| {run.name} | " + " | ".join(number(r.get(f"{c}_ms"), '.1f') for c in CATEGORY_NAMES)
                     + f" | {number(r.get('kernels_ms'), '.1f')} |")
    lines += ["", *target_table(compared, rows)]
    ablations = [r for r in runs if r.part == "ablations" and r.name in rows]
    if ablations:
        tuned = step(f"megatron-{best}")
        lines += ["", f"## Tuning switches, one at a time on megatron {best} (tuned: {number(tuned, '.3f')} s/step)",
                  "", "| switch | s/step | change vs tuned | status |", "|---|---|---|---|"]
        for run in ablations:
            r = rows[run.name]
            change = f"{r['step_s'] / tuned - 1:+.1%}" if r["step_s"] and tuned else "-"
            lines.append(f"| {run.switch} | {number(r['step_s'], '.3f')} | {change} | {r['status']} {r['error']} |")
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


def target_table(compared: list[Run], rows: dict[str, dict]) -> list[str]:
    """The torch engine against engine=megatron, met or missed: step time and peak memory in each recipe, and the
    torch engine's fp8_current speedup over its own bf16; missing where a run has no timing."""
    def verdict(met: Optional[bool]) -> str:
        return "-" if met is None else "met" if met else "missed"

    lines = ["## Targets (the torch engine against engine=megatron, this call)", "", "| target | measured | result |",
             "|---|---|---|"]
    for run in (r for r in compared if r.engine == "torch"):
        ours, theirs = rows[run.name], rows.get(engine_pair(run.name), {})
        for what, field, spec in (("s/step", "step_s", ".3f"), ("peak GiB", "peak_gib", ".1f")):
            a, b = ours.get(field), theirs.get(field)
            lines.append(f"| {run.name}: {what} <= megatron's | {number(a, spec)} vs {number(b, spec)} | "
                         f"{verdict(a <= b if a and b else None)} |")
    bf16, current = (rows.get(f"torch-{p}", {}).get("step_s") for p in ("bf16", "fp8_current"))
    speedup = bf16 / current if bf16 and current else None
    lines.append(f"| torch fp8_current over torch bf16 >= {CURRENT_OVER_BF16_TARGET:.2f}x | "
                 f"{number(speedup, '.3f')}x | {verdict(speedup >= CURRENT_OVER_BF16_TARGET if speedup else None)} |")
    return lines


SAME_ENGINE_BF16, TORCH_SAME_RECIPE = "same engine's bf16", "torch engine, same recipe"


def loss_references(run: Run) -> dict[str, str]:
    """What a loss-study run is compared with: its engine's BF16 run and, on engine=megatron, the torch engine's run
    of the same recipe (label: run name)."""
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


def write_results(study: str, runs: list[Run], rows: dict[str, dict], out: Path, directory: Path,
                  best: Optional[str], commit: str) -> None:
    """results.md and results.csv, provenance.json (command, commit, date, versions, device), and runs.tar.gz of the
    runs' small files (a checkpoint is gigabytes)."""
    out.mkdir(parents=True, exist_ok=True)
    tables = speed_tables(runs, rows, best) if study == "speed" else loss_tables(runs, rows)
    info = provenance()
    te = info["versions"].get("transformer_engine") or (
        "(version unknown)" if importlib.util.find_spec("transformer_engine") else None)
    footer = ["", f"commit {os.environ.get('FP8_RECIPES_COMMIT', commit)}; {info['device']}; "
                  f"versions {info['versions']}",
              f"Transformer Engine {te + ' importable by every run' if te else 'not installed'} (the torch engine's "
              "runs import it through megatron-core, as in a NeMo container)", f"command: {' '.join(sys.argv)}"]
    title = f"# scripts/megatron_bench.py: {study} study"
    (out / "results.md").write_text("\n".join([title, "", *tables, *footer]) + "\n")
    record = {"command": "python scripts/megatron_bench.py " + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              **info, "commit": os.environ.get("FP8_RECIPES_COMMIT", commit), "transformer_engine_importable": bool(te)}
    (out / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[runs[0].name]) if runs else ["name"])
        writer.writeheader()
        writer.writerows(rows[r.name] for r in runs)
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for run in runs:
            for name in KEPT_FILES:
                if (directory / run.name / name).is_file():
                    tar.add(directory / run.name / name, arcname=f"runs/{run.name}/{name}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="compose every run's config.yaml (needs Hydra: run it here)")
    prep.add_argument("--dir", type=Path, required=True)
    prep.add_argument("--study", choices=("speed", "loss"), default="speed")
    prep.add_argument("--gpu", default="h200", help="conf/gpu option of the GPU machine (peaks for MFU)")
    prep.add_argument("--steps", type=int, help="steps per run (default: speed 6, loss 500)")
    go = commands.add_parser("run", help="run the prepared configurations on this machine's GPU")
    go.add_argument("--dir", type=Path, required=True, help="the folder `prepare` wrote")
    go.add_argument("--out", type=Path, required=True, help="results.md, results.csv, runs.tar.gz")
    go.add_argument("--parts", default=",".join(SPEED_PARTS), help=f"speed study: some of {','.join(SPEED_PARTS)}")
    go.add_argument("--budget-s", type=float, default=480.0, help="no run starts that would not finish within this")
    go.add_argument("--best", choices=FP8_RECIPES,
                    help="the FP8 recipe of the ablations (default: the fastest one measured in this call)")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        builder = speed_runs if args.study == "speed" else loss_runs
        prepare(args.study, builder(args.gpu, args.steps or (6 if args.study == "speed" else 500)), args.dir)
        print(f"prepared {args.dir}/study.json; on the GPU machine: "
              f"python scripts/megatron_bench.py run --dir {args.dir} --out OUT")
        return 0
    if not (args.dir / "study.json").is_file():
        parser.error(f"{args.dir}/study.json not found: run `prepare --dir {args.dir}` first (on a machine with Hydra)")
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
    return run_study(args.dir, args.out, parts, args.budget_s, args.best)


if __name__ == "__main__":
    sys.exit(main())
