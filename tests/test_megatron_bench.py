"""scripts/megatron_bench.py on the CPU: the studies it plans, the configs `prepare` composes, and `run` starting
each config as its own engine process (the torch engine on tiny_llama, in two rounds; engine=megatron, which needs
CUDA, fails there and is reported as failed), the round-robin order, the median and spread over rounds, the window
of the timed steps for the GPU's clock and power, the resume check, the loss study's verdict, the budget, and the
tables. No megatron training on the CPU; on a GPU with Transformer Engine (`pytest -m gpu`), the resume check of
every recipe.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from recipes.config import REPO_ROOT, load_config
from recipes.folders import save_config
from recipes.hydra_schema import check_override_keys, register_schema

spec = importlib.util.spec_from_file_location("megatron_bench", REPO_ROOT / "scripts" / "megatron_bench.py")
bench = sys.modules["megatron_bench"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(bench)


def overrides_of(run) -> dict:
    return dict(o.split("=", 1) for o in run.overrides)


def test_speed_study_is_the_issues_list():
    runs = bench.speed_runs("h200", steps=5, rounds=2)
    assert len({r.name for r in runs}) == len(runs)
    by_part = {part: [r for r in runs if r.part == part] for part in bench.SPEED_PARTS}
    assert [(r.engine, r.precision) for r in by_part["precisions"]] == \
        [("megatron", "bf16"), ("megatron", "fp8_current"), ("megatron", "fp8_delayed"), ("megatron", "fp8_blockwise")]
    assert [(r.engine, r.precision) for r in by_part["torch"]] == [("torch", p) for p in ("bf16", *bench.FP8_RECIPES)]
    for run in by_part["precisions"] + by_part["torch"]:
        o = overrides_of(run)
        assert (o["model"], o["model.num_layers"], o["data"], o["trainer.micro_batch_size"],
                o["trainer.global_batch_size"]) == ("llama3_8b", "8", "mock", "1", "8")
        assert "model.vocab_size" not in o and "model.seq_length" not in o  # full vocabulary, seq 8192
    assert [(r.engine, overrides_of(r)["model"], r.side_by_side) for r in by_part["nemotron"]] == \
        [("megatron", "nemotron4_15b", False), ("torch", "nemotron4_15b", False)]
    for run in by_part["precisions"] + by_part["torch"] + by_part["nemotron"] + by_part["fsdp"]:
        # 2 warm-up and 5 timed steps in each of 2 rounds; round 1 profiles one more, round 2 stops before it
        o, later = overrides_of(run), dict(x.split("=", 1) for x in bench.round_overrides(run, 2))
        assert (run.warmup, run.rounds, o["trainer.max_steps"], o["trainer.profile_step"], run.profile_step) == \
            (2, 2, "8", "8", 8)
        assert later["trainer.max_steps"] == "7" and "trainer.profile_step" not in later
        assert set(later.items()) ^ set(o.items()) == {("trainer.max_steps", "8"), ("trainer.max_steps", "7"),
                                                       ("trainer.profile_step", "8")}
    for run in by_part["precisions"] + by_part["torch"] + by_part["nemotron"]:
        assert bench.engine_pair(run.name) in {r.name for r in runs}
    for run in by_part["fsdp"]:  # timed as its DDP twin of `precisions`, with Megatron-FSDP its only difference
        ddp = next(r for r in by_part["precisions"] if r.precision == run.precision)
        assert not run.side_by_side and set(run.overrides) - set(ddp.overrides) == {"parallel.fsdp=true"}
        assert set(ddp.overrides) <= set(run.overrides)
    assert [r.precision for r in by_part["fsdp"]] == ["bf16", "fp8_current"]
    functional = by_part["functional"]
    assert all(r.side_by_side and r.resume and r.rounds == 1 for r in functional)
    assert {(r.precision, overrides_of(r).get("parallel.distributed_optimizer", "true"),
             overrides_of(r).get("parallel.fsdp", "false")) for r in functional} == \
        {(p, optimizer, "false") for p in ("bf16", *bench.FP8_RECIPES) for optimizer in ("true", "false")} | \
        {(p, "true", "true") for p in ("bf16", "fp8_current", "fp8_delayed")}
    for resume in functional:
        o = overrides_of(resume)
        assert (o["trainer.checkpoint.interval"], o["trainer.max_steps"], o["model"]) == ("3", "6", "llama3_100m")
    for recipe in bench.FP8_RECIPES:  # each ablation is its recipe's tuned run with exactly its own switch changed
        timed = set(next(r for r in by_part["precisions"] if r.precision == recipe).overrides)
        tuned, *ablations = [r for r in by_part["ablations"] if r.precision == recipe]
        assert (tuned.name, tuned.switch, tuned.profile_step, tuned.rounds) == \
            (f"megatron-{recipe}--tuned", "", None, 2)
        assert timed - set(tuned.overrides) == {"trainer.max_steps=8", "trainer.profile_step=8"}  # not profiled
        assert set(tuned.overrides) - timed == {"trainer.max_steps=7"}
        fp8_weights = recipe != "fp8_blockwise"  # on in the others' presets
        # megatron-core 0.16's graphs cannot replay FP8 weights: the graphs' column goes without them
        graphs_switch = "cuda_graphs=true,fp8_param_gather=false" if fp8_weights else "cuda_graphs=true"
        assert [r.switch for r in ablations][:3] == ["grad_reduce_in_fp32=true", graphs_switch,
                                                     "gradient_accumulation_fusion=false"]
        for run in ablations:
            changed, dropped = set(run.overrides) - set(tuned.overrides), set(tuned.overrides) - set(run.overrides)
            graphs = run.switch == graphs_switch  # 6 warm-up steps, in which the graphs are captured
            assert (run.warmup, run.rounds) == (6 if graphs else 2, 2)
            expected = {"megatron.cuda_graphs=true", *(("precision.fp8_param_gather=false",) if fp8_weights else ())} \
                if graphs else set(dict(bench.ABLATIONS)[run.switch])
            assert changed - {"trainer.max_steps=11"} == expected, run.name
            assert dropped == ({"trainer.max_steps=7"} if graphs else set()), run.name
        switches = [r.switch for r in ablations]
        assert ("fp8_param_gather=false" in switches) == fp8_weights
        assert {graphs_switch, "gradient_accumulation_fusion=false", "grad_reduce_in_fp32=true"} <= set(switches)
        assert "grad_reduce_in_fp32=false" not in switches  # the default now: BF16, NVIDIA's
    register_schema()
    for run in runs + bench.loss_runs("h200", steps=500):
        check_override_keys(list(run.overrides))


def test_the_timed_columns_go_round_robin_the_engines_of_a_recipe_together():
    """The columns of precisions, torch, nemotron and fsdp are one group: round 1 in the study's order with each
    recipe's two engines one after the other, round 2 reversed; each recipe's ablations are a group of their own."""
    runs = bench.speed_runs("h200", steps=5, rounds=2)
    groups = bench.study_groups(runs)
    assert [{r.part for r in g} for g in groups] == [{"precisions", "torch", "nemotron", "fsdp"}, {"functional"},
                                                    {"ablations"}, {"ablations"}, {"ablations"}]
    first = ["megatron-bf16", "torch-bf16", "megatron-fp8_current", "torch-fp8_current", "megatron-fp8_delayed",
             "torch-fp8_delayed", "megatron-fp8_blockwise", "torch-fp8_blockwise",
             "megatron-nemotron4_15b-fp8_current", "torch-nemotron4_15b-fp8_current", "megatron-fsdp-bf16",
             "megatron-fsdp-fp8_current"]
    order = [(run.name, k) for run, k in bench.round_robin(groups[0])]
    assert order == [(name, 1) for name in first] + [(name, 2) for name in reversed(first)]
    three = [r for r in runs if r.name in ("megatron-bf16", "torch-bf16", "megatron-fp8_current")]
    three[2] = dataclasses.replace(three[2], rounds=3)
    assert [(r.name, k) for r, k in bench.round_robin(three)] == [
        ("megatron-bf16", 1), ("torch-bf16", 1), ("megatron-fp8_current", 1), ("megatron-fp8_current", 2),
        ("torch-bf16", 2), ("megatron-bf16", 2), ("megatron-fp8_current", 3)]
    assert [r.name for r in groups[2]][:2] == ["megatron-fp8_current--tuned",
                                               "megatron-fp8_current--grad_reduce_in_fp32"]
    assert bench.round_dir(Path("d"), runs[0], 1) == Path("d/megatron-bf16")
    assert bench.round_dir(Path("d"), runs[0], 2) == Path("d/megatron-bf16.round2")


def test_loss_study_pairs_every_recipe_on_both_engines():
    runs = bench.loss_runs("h200", steps=500)
    assert {(r.engine, r.precision) for r in runs} == {(e, p) for e in ("megatron", "torch")
                                                       for p in ("bf16", *bench.FP8_RECIPES)}
    for run in runs:
        o = overrides_of(run)
        assert (o["model"], o["data"], o["trainer.max_steps"], run.side_by_side) == ("llama3_100m", "text", "500", True)


NOT_ON_THE_GPU_MACHINE = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "nemo_run"):
            raise ModuleNotFoundError(f"{name}: not installed on the GPU machine")

sys.meta_path.insert(0, NotInstalled())
"""


def cpu_study(tmp_path):
    """Three configurations the CPU can judge: the torch engine timed in two rounds and resumed, engine=megatron
    (no CUDA)."""
    tiny = ("gpu=cpu", "model=tiny_llama", "model.seq_length=64", "data=mock", "precision=bf16",
            "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "trainer.log_interval=1")
    return [
        bench.Run("resume-torch", "functional", "torch", "bf16", ("engine=torch", *tiny, "trainer.max_steps=2",
                  "trainer.checkpoint.interval=1", "data.cache_dir=cache"), side_by_side=True, resume=True),
        bench.Run("megatron-bf16", "precisions", "megatron", "bf16", ("engine=megatron", *tiny, "trainer.max_steps=3")),
        bench.Run("torch-bf16", "torch", "torch", "bf16", ("engine=torch", *tiny, "trainer.max_steps=5",
                  "trainer.profile_step=5"), warmup=1, rounds=2, profile_step=5),
    ]


def test_prepare_then_run_each_config_in_its_own_process(tmp_path):
    study = tmp_path / "study"
    bench.prepare("speed", cpu_study(tmp_path), study)
    assert [r.name for r in bench.load_study(study)[2]] == [r.name for r in cpu_study(tmp_path)]
    cfg = load_config(study / "torch-bf16" / "config.yaml")
    assert (cfg.engine, cfg.model.seq_length, cfg.trainer.max_steps, cfg.dryrun) == ("torch", 64, 5, False)
    later = load_config(study / "torch-bf16.round2" / "config.yaml")  # round 2: the timed steps, none profiled
    assert (later.trainer.max_steps, later.trainer.profile_step, cfg.trainer.profile_step) == (4, None, 5)
    assert "tuning      " in (study / "megatron-bf16" / "plan.txt").read_text()  # the megatron plan's line
    assert json.loads((study / "study.json").read_text())["order"] == [["megatron-bf16", "torch-bf16",
                                                                         "torch-bf16.round2"]]

    # As on the GPU machine: no Hydra, omegaconf or nemo-run, for `run` and the engines it starts (PYTHONPATH).
    blocker = tmp_path / "gpu_machine"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NOT_ON_THE_GPU_MACHINE)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "megatron_bench.py"), "run", "--dir", "study",
                             "--out", "out", "--parts", "functional,precisions,torch"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(blocker)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr  # engine=megatron cannot run on a CPU
    started = re.findall(r"^\[ *\d+ s\] (\S+ round \d/\d):", result.stdout, re.M)  # the progress lines
    assert started == ["resume-torch round 1/1", "megatron-bf16 round 1/1", "torch-bf16 round 1/2",
                       "torch-bf16 round 2/2"]  # the study's order, the timed pair round-robin
    rows = {r["name"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert rows["megatron-bf16"]["status"] == "failed (1)"
    assert "engine=megatron needs CUDA GPUs" in rows["megatron-bf16"]["error"]
    timed = rows["torch-bf16"]
    assert (timed["status"], timed["rounds"], timed["steps"], timed["timed_steps"]) == ("ok", "2", "9", "6")
    steps = [json.loads(line)["step_time_s"] for run_dir in ("torch-bf16", "torch-bf16.round2")
             for line in (study / run_dir / "metrics.jsonl").read_text().splitlines()[1:4]]  # steps 2-4 of each
    assert float(timed["step_s"]) == pytest.approx(sum(sorted(steps)[2:4]) / 2)  # the median of six
    assert (float(timed["step_min_s"]), float(timed["step_max_s"])) == (min(steps), max(steps))
    assert timed["sm_clock_mhz"] == "" and float(timed["gemm_ms"]) >= 0  # no GPU; round 1's profiled step
    resumed = rows["resume-torch"]
    assert resumed["status"] == "ok" and resumed["step_s"] == "", resumed["note"]  # side by side: no timing
    assert resumed["note"] == "resumed from step 1; steps 2-2 repeated, max rel. diff: loss 0.00e+00, grad norm 0.00e+00"
    table = (out / "results.md").read_text()
    assert "| torch | bf16 | " in table and "| resume-torch | 2 | " in table
    assert "failed (1) error: engine=megatron needs CUDA GPUs" in table
    assert "GPU clock and power not recorded: not a CUDA device" in table
    assert "engine=megatron sums and reduces gradients in a BF16 buffer" in table  # from the config it ran
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"runs/torch-bf16/metrics.jsonl", "runs/torch-bf16.round2/metrics.jsonl", "runs/torch-bf16/profile/"
            "time_rank0.json", "runs/resume-torch/train_resumed.log", "runs/megatron-bf16/plan.txt"} <= names
    assert not any("checkpoints" in name or "cache" in name or "trace" in name for name in names)
    assert not (out / "traces.tar.gz").exists()  # engine=megatron's traces only


def engine_free_run(monkeypatch, tmp_path, runs, wall_s=None, parts=("precisions", "torch", "nemotron"),
                    budget_s=10_000.0, best=None, only=()):
    """run_study over `runs` with each process replaced by what an engine would leave: metrics.jsonl (warm-up steps
    9 s, then 1.0, 1.1, ... s, round 2 from 1.5 s; a profiled step 5 s) and, profiled, the profile; process i
    starts at time 1000 i and writes step s's line at 1000 i + s. Its GPU samples, every 0.25 s, are at 1500 + i
    MHz and 600 W during its timed steps, at 1000 MHz and 100 W otherwise. Returns the processes in the order they
    ran and results.csv's rows."""
    monkeypatch.setattr(bench, "load_study", lambda directory: ("speed", "prepared1", runs))
    monkeypatch.setattr(bench, "provenance", lambda: {"commit": "unknown", "versions": {"torch": "2"}, "device": "X"})
    started, windows = [], []

    def execute(run, run_dir, timeout_s):
        round_ = int(run_dir.name.rsplit(".round", 1)[1]) if ".round" in run_dir.name else 1
        o = dict(x.split("=", 1) for x in bench.round_overrides(run, round_))
        last, profiled, base = int(o["trainer.max_steps"]), o.get("trainer.profile_step"), 1000.0 * len(started)
        started.append((run.name, round_))
        windows.append((base + run.warmup, base + last - bool(profiled), 1500 + len(started) - 1))
        run_dir.mkdir(parents=True, exist_ok=True)
        times = [9.0] * run.warmup + [1.0 + 0.1 * i + 0.5 * (round_ - 1) for i in range(last - run.warmup)]
        if profiled:
            times[-1] = 5.0
            (run_dir / "profile").mkdir(exist_ok=True)
            (run_dir / "profile" / "time_rank0.json").write_text(json.dumps({"ms": {"gemm": 1.0}, "total_ms": 2.0}))
            (run_dir / "profile" / "trace_rank0.json").write_text("{}")
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "loss": 3.0, "grad_norm": 1.0, "step_time_s": t, "tokens_per_s_per_gpu": 8.0 / t,
             "model_tflops_per_gpu": 1.0 / t, "mfu": 0.1 / t, "peak_memory_gib": 10.0 + round_}) + "\n"
            for s, t in enumerate(times, 1)))
        return bench.Outcome("ok", (wall_s or {}).get(run.engine, 1.0), "",
                             {s: base + s for s in range(0, last + 1)})

    @contextlib.contextmanager
    def telemetry(device, interval_ms):
        found = {}
        yield found  # the process runs
        (a, b, clock), base = windows[-1], 1000.0 * (len(started) - 1)
        found["timeline"] = [(t, *((clock, 600.0) if a <= t <= b else (1000.0, 100.0)), 700.0, 60.0, False)
                             for t in (base + j * 0.25 for j in range(4000))]

    monkeypatch.setattr(bench, "execute", execute)
    monkeypatch.setattr(bench, "gpu_telemetry", telemetry)
    bench.run_study(tmp_path, tmp_path / "out", parts, budget_s, best, only)
    return started, {r["name"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}


def test_precisions_torch_and_nemotron_interleave_and_report_each_columns_rounds(monkeypatch, tmp_path):
    """--parts precisions,torch,nemotron: all ten columns round-robin in one call, the two engines of each recipe
    together, round 2 reversed; a column's s/step is the median of the timed steps of both rounds, beside it their
    spread, and its clock and power are the medians of the samples taken during those steps only."""
    runs = bench.speed_runs("h200", steps=5, rounds=2)
    started, rows = engine_free_run(monkeypatch, tmp_path, runs)
    columns = [r.name for r in runs if r.part in ("precisions", "torch", "nemotron")]
    assert started == [(name, 1) for name in columns] + [(name, 2) for name in reversed(columns)]
    bf16 = rows["megatron-bf16"]
    # timed: round 1's steps 3-7 (1.0-1.4 s), round 2's (1.5-1.9 s); neither the warm-up steps nor the profiled one
    assert (bf16["status"], bf16["rounds"], bf16["steps"], bf16["timed_steps"]) == ("ok", "2", "15", "10")
    assert (float(bf16["step_s"]), float(bf16["step_min_s"]), float(bf16["step_max_s"])) == \
        pytest.approx((1.45, 1.0, 1.9))
    assert bf16["round_step_s"] == "1.2000 1.7000" and float(bf16["peak_gib"]) == 12.0
    assert float(bf16["tokens_per_s_per_gpu"]) == pytest.approx(statistics.median(8.0 / (1.0 + 0.1 * i)
                                                                                  for i in range(10)))
    # its processes were the first (1500 MHz) and the last (1519 MHz): as many samples in each window (reversed,
    # round 2 gives every column the same sum)
    assert (float(bf16["sm_clock_mhz"]), float(bf16["power_w"])) == (1509.5, 600.0)
    assert float(rows["torch-nemotron4_15b-fp8_current"]["sm_clock_mhz"]) == 1509.5  # processes 9 and 10
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| megatron | bf16 | 1.450 | 1.000-1.900 | 10 (2) | 1510 | 600 | " in table
    assert "| torch (nemotron4_15b, 4 layers) | fp8_current | 1.450 | 1.000-1.900 | 10 (2) | 1510 | 600 | " in table
    assert "commit unknown; X; versions" in table and "The project's commit is unknown" in table
    assert "prepared at commit prepared1" in table and "GPU clock and power: nvidia-smi every 200 ms" in table
    with tarfile.open(tmp_path / "out" / "traces.tar.gz") as tar:  # engine=megatron's profiled steps' traces
        assert set(tar.getnames()) == {f"runs/{name}/profile/trace_rank0.json" for name in columns
                                       if name.startswith("megatron-")}
    assert json.loads((tmp_path / "out" / "provenance.json").read_text())["prepared_at_commit"] == "prepared1"


def test_the_budget_takes_a_recipes_two_engines_together_and_says_what_it_left_out(monkeypatch, tmp_path):
    runs = [r for r in bench.speed_runs("h200", steps=5, rounds=2) if r.part in ("precisions", "torch")]
    guess = 2 * (bench.FIRST_GUESS_S["megatron"] + bench.FIRST_GUESS_S["torch"])  # a recipe's four processes
    started, rows = engine_free_run(monkeypatch, tmp_path, runs, budget_s=guess + 5)
    assert started == [("megatron-bf16", 1), ("torch-bf16", 1), ("torch-bf16", 2), ("megatron-bf16", 2)]
    for name in ("megatron-fp8_current", "torch-fp8_current", "torch-fp8_blockwise"):
        assert rows[name]["status"].startswith("not run (budget: ~") and rows[name]["timed_steps"] == "0"
    # a process found slower than guessed: the rounds that no longer fit are not run, and the column says so
    started, rows = engine_free_run(monkeypatch, tmp_path, runs, wall_s={"megatron": 300.0}, budget_s=guess + 5)
    assert started == [("megatron-bf16", 1), ("torch-bf16", 1), ("torch-bf16", 2)]
    assert rows["megatron-bf16"]["status"].startswith("not run (budget: ~300 s needed")
    assert rows["megatron-bf16"]["status"].endswith("in round 2 of 2")
    assert (rows["megatron-bf16"]["rounds"], rows["megatron-bf16"]["timed_steps"]) == ("1", "5")
    assert rows["torch-bf16"]["status"] == "ok"


def test_only_picks_columns_and_an_ablation_brings_its_tuned_run(monkeypatch, tmp_path):
    runs = bench.speed_runs("h200", steps=5, rounds=2)
    started, _ = engine_free_run(monkeypatch, tmp_path, runs, parts=("precisions", "torch", "ablations"),
                                 best="fp8_delayed", only=("*-bf16", "*--cuda_graphs"))
    assert started == [("megatron-bf16", 1), ("torch-bf16", 1), ("torch-bf16", 2), ("megatron-bf16", 2),
                       ("megatron-fp8_delayed--tuned", 1), ("megatron-fp8_delayed--cuda_graphs", 1),
                       ("megatron-fp8_delayed--cuda_graphs", 2), ("megatron-fp8_delayed--tuned", 2)]
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| (tuned) | 1.450 | 1.000-1.900 | 10 (2) |" in table
    assert "| cuda_graphs=true,fp8_param_gather=false | 1.450 | 1.000-1.900 | 10 (2) |" in table


def test_the_tables_say_which_gradient_buffer_is_like_for_like_with_the_torch_engine():
    runs = bench.speed_runs("h200", steps=5, rounds=2)
    ablations = [r for r in runs if r.part == "ablations" and r.precision == "fp8_current"][:2]
    timing = {"status": "ok", "error": "", "step_min_s": 1.0, "step_max_s": 1.2, "timed_steps": 10, "rounds": 2}
    rows = {ablations[0].name: {**timing, "step_s": 1.40, "grad_reduce_in_fp32": False},
            ablations[1].name: {**timing, "step_s": 1.47, "grad_reduce_in_fp32": True}}
    table = "\n".join(bench.ablation_table(ablations, rows, "fp8_current"))
    assert "| (tuned) | 1.400 | 1.000-1.200 | 10 (2) | - | - | - | ok  |" in table
    assert "| grad_reduce_in_fp32=true | 1.470 | 1.000-1.200 | 10 (2) | - | - | +5.0% | ok  |" in table
    assert "the torch engine keeps FP32 main gradients, so grad_reduce_in_fp32=true is the like-for-like one" in table
    compared = [r for r in runs if r.name in ("megatron-bf16", "megatron-fp8_current", "torch-fp8_current")]
    settings = {"megatron-bf16": (False, False), "megatron-fp8_current": (False, True),
                "torch-fp8_current": (None, None)}
    note = bench.engine_differences(compared, {name: {"grad_reduce_in_fp32": fp32, "fp8_param_gather": gather,
                                                      "precision": name.split("-")[1]}
                                               for name, (fp32, gather) in settings.items()})[1]
    assert "engine=megatron sums and reduces gradients in a BF16 buffer" in note
    assert "between steps (precision.fp8_param_gather) in fp8_current (" in note


def test_the_timed_window_runs_from_the_step_before_the_first_timed_to_the_last():
    seen = {0: 100.0, 1: 130.0, 2: 131.5, 3: 133.0, 4: 134.5}
    steps = [{"step": s} for s in (1, 2, 3, 4)]
    run = bench.Run("x", "torch", "torch", "bf16", ("model=m",), warmup=2, profile_step=4)
    timed = bench.timed_steps(run, steps)
    assert [r["step"] for r in timed] == [3] and bench.timed_window(timed, seen) == (131.5, 133.0)
    assert bench.timed_window(bench.timed_steps(dataclasses.replace(run, warmup=0, profile_step=None), steps),
                              seen) == (100.0, 134.5)  # no warm-up: from the process's start
    assert bench.timed_window(timed, {0: 100.0, 3: 133.0}) is None  # step 2's line never seen
    timeline = [(t, clock, 500.0, 700.0, 60.0, False) for t, clock in ((131.0, 900.0), (131.6, 1800.0),
                                                                        (132.5, 1900.0), (133.1, 700.0))]
    assert bench.clock_and_power(timeline, [(131.5, 133.0)]) == \
        {"sm_clock_mhz": 1850.0, "power_w": 500.0, "gpu_samples": 2}
    assert bench.clock_and_power(timeline, [(131.5, 131.55), (133.05, 133.2)]) == \
        {"sm_clock_mhz": 700.0, "power_w": 500.0, "gpu_samples": 1}
    assert bench.clock_and_power([], [(131.5, 133.0)])["sm_clock_mhz"] is None  # no nvidia-smi: no samples


def test_watch_steps_notes_when_each_step_ends_and_kills_a_hung_process(tmp_path):
    writer = ("import json, sys, time\nf = open(sys.argv[1], 'w')\nfor s in (1, 2, 3):\n    time.sleep(0.3)\n"
              "    f.write(json.dumps({'step': s}) + '\\n'); f.flush()\n")
    process = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path / "metrics.jsonl")])
    seen, ended = bench.watch_steps(process, tmp_path / "metrics.jsonl", timeout_s=30)
    assert ended == "finished" and sorted(seen) == [0, 1, 2, 3]
    assert seen[0] < seen[1] < seen[2] < seen[3] and seen[3] - seen[1] > 0.4
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    hung = subprocess.Popen([sys.executable, "-c", deaf])
    started = time.monotonic()
    seen, ended = bench.watch_steps(hung, tmp_path / "none.jsonl", timeout_s=1.0, grace_s=0.5)
    assert ended == "killed" and hung.returncode == -signal.SIGKILL and list(seen) == [0]
    assert time.monotonic() - started < 5


def test_a_process_out_of_time_is_asked_to_stop_and_ends_its_step_first(tmp_path):
    """At the end of its time a run gets SIGTERM `grace_s` before the kill, as the engine's stop signals expect
    (recipes.trainer.stopping: the step in progress finishes, its checkpoint is written, exit 128 + 15): here a
    process that, told to stop, writes the step it is in and a stand-in for that checkpoint, then exits so."""
    engine = ("import json, signal, sys, time\nasked = []\nsignal.signal(signal.SIGTERM, lambda *_: asked.append(1))\n"
              "f = open(sys.argv[1], 'w')\nstep = 0\nwhile not asked:\n    step += 1; time.sleep(0.1)\n"
              "    f.write(json.dumps({'step': step}) + '\\n'); f.flush()\n"
              "open(sys.argv[2], 'w').write(str(step))\nsys.exit(128 + signal.SIGTERM)\n")
    metrics_file, checkpoint = tmp_path / "metrics.jsonl", tmp_path / "checkpoint"
    process = subprocess.Popen([sys.executable, "-c", engine, str(metrics_file), str(checkpoint)])
    seen, ended = bench.watch_steps(process, metrics_file, timeout_s=6, grace_s=4)  # asked at 3 s, killed at 6
    assert ended == "stopped" and process.returncode == 128 + signal.SIGTERM  # before the kill
    assert int(checkpoint.read_text()) == max(seen) == bench.steps_written(metrics_file)[-1] >= 3


def test_a_run_that_would_overrun_the_budget_is_not_started(tmp_path):
    runs = cpu_study(tmp_path)[1:]
    bench.prepare("speed", runs, tmp_path / "study")
    assert bench.run_study(tmp_path / "study", tmp_path / "out", ("precisions", "torch"), budget_s=30, best=None) == 1
    rows = {r["name"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    for run in runs:  # first guesses: 55 s for engine=megatron, 65 s for the torch engine
        assert rows[run.name]["status"].startswith("not run (budget: ~")
        assert not (tmp_path / "study" / run.name / "train.log").exists()
    done = [(runs[0], bench.Outcome("ok", wall_s=42.0)), (runs[0], bench.Outcome("ok", wall_s=47.0))]
    assert bench.estimate_s(runs[0], done) == 47.0 and bench.estimate_s(runs[1], done) == 65.0


def test_ablations_follow_the_fastest_fp8_recipe_and_name_their_switch():
    runs = bench.speed_runs("h200", steps=6)
    rows = {f"megatron-{p}": {"step_s": s} for p, s in
            (("bf16", 2.0), ("fp8_current", 1.5), ("fp8_delayed", 1.4), ("fp8_blockwise", 1.6))}
    assert bench.fastest_fp8(runs, rows) == "fp8_delayed"
    rows["megatron-fp8_delayed"]["step_s"] = None  # failed: not a candidate
    assert bench.fastest_fp8(runs, rows) == "fp8_current"


def test_run_refuses_ablations_without_a_recipe_to_vary(tmp_path):
    bench.prepare("speed", cpu_study(tmp_path)[1:2], tmp_path / "study")
    with pytest.raises(SystemExit):
        bench.main(["run", "--dir", str(tmp_path / "study"), "--out", str(tmp_path / "out"), "--parts", "ablations"])
    with pytest.raises(SystemExit):
        bench.main(["run", "--dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])


def test_targets_say_missed_when_the_torch_engine_is_slower_or_larger():
    runs = [r for r in bench.speed_runs("h200", steps=6) if r.name in ("megatron-bf16", "torch-bf16",
                                                                        "megatron-fp8_current", "torch-fp8_current")]
    rows = {"megatron-bf16": {"step_s": 1.75, "peak_gib": 58.0}, "torch-bf16": {"step_s": 1.70, "peak_gib": 60.0},
            "megatron-fp8_current": {"step_s": 1.45, "peak_gib": 58.0},
            "torch-fp8_current": {"step_s": 1.50, "peak_gib": 50.0}}
    table = "\n".join(bench.target_table(runs, rows))
    assert "| torch-bf16: s/step <= megatron's | 1.700 vs 1.750 | met |" in table
    assert "| torch-bf16: peak GiB <= megatron's | 60.0 vs 58.0 | missed |" in table
    assert "| torch-fp8_current: s/step <= megatron's | 1.500 vs 1.450 | missed |" in table
    assert "| torch fp8_current over torch bf16 >= 1.30x | 1.133x | missed |" in table
    rows["torch-fp8_current"]["step_s"] = None  # not timed: neither met nor missed
    assert "| torch-fp8_current: s/step <= megatron's | - vs 1.450 | - |" in "\n".join(bench.target_table(runs, rows))


def test_fsdp_table_puts_each_recipe_beside_its_ddp_run():
    runs = [run for run in bench.speed_runs("h200", steps=6) if run.part == "fsdp"]
    rows = {"megatron-bf16": {"step_s": 1.75, "peak_gib": 58.0},
            "megatron-fsdp-bf16": {"step_s": 1.89, "peak_gib": 52.5, "status": "ok", "error": ""},
            "megatron-fsdp-fp8_current": {"step_s": None, "peak_gib": None, "status": "failed", "error": "(rc 1)"}}
    table = "\n".join(bench.speed_tables(runs, rows, best=None))
    assert "| bf16 | 1.890 | 1.750 | 1.080x | 52.5 | 58.0 | ok  |" in table
    assert "| fp8_current | - | - | - | - | - | failed (rc 1) |" in table


def test_a_resume_that_does_not_repeat_its_steps_is_failed(tmp_path):
    """The resume check is equality of each repeated step's loss and gradient norm with the uninterrupted run's:
    a repeated step whose loss is equal and gradient norm is not (as docs/results' fp8_delayed resume) is failed,
    and so are a repeated step that is missing and a second start that did not resume."""
    run = bench.Run("resume-x", "functional", "megatron", "fp8_delayed", ("model=llama3_100m",), side_by_side=True,
                    resume=True)
    uninterrupted = [{"step": s, "loss": 3.0 - s / 10, "grad_norm": 40.0 + s, "peak_memory_gib": 1.0}
                     for s in range(1, 7)]

    def resumed_run(records: list[dict], log: str = "resuming from step 3 of checkpoints/step_3\n") -> dict:
        (tmp_path / "train_resumed.log").write_text(f"plan ...\n{log}")
        for name, rows in (("metrics_uninterrupted.jsonl", uninterrupted), ("metrics.jsonl", records)):
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return bench.row(run, [(tmp_path, bench.Outcome("ok", 1.0))])

    exact = resumed_run(uninterrupted)
    assert exact["status"] == "ok"
    assert exact["note"] == "resumed from step 3; steps 4-6 repeated, max rel. diff: loss 0.00e+00, grad norm 0.00e+00"
    diverged = [dict(r, grad_norm=78.339) if r["step"] == 4 else r for r in uninterrupted]
    result = resumed_run(diverged)
    assert result["status"] == "failed (resume not exact)" and "grad norm 7.80e-01" in result["note"]
    assert resumed_run(uninterrupted[:5])["note"] == "resumed from step 3; steps missing from the resumed run: [6]"
    assert resumed_run(uninterrupted[:5])["status"] == "failed (resume not exact)"
    assert resumed_run(uninterrupted, log="starting at step 1\n")["status"] == "failed (resume not exact)"


def test_a_loss_more_than_two_percent_from_its_references_is_failed():
    """The loss study's condition: each FP8 run's mean loss within 2% of its engine's BF16 run and, on
    engine=megatron, of the torch engine's run of the same recipe; a run without a reference to compare is failed."""
    runs = bench.loss_runs("h200", steps=500)
    losses = {"torch-llama3_100m-bf16": 3.00, "torch-llama3_100m-fp8_current": 3.05,  # +1.7%
              "torch-llama3_100m-fp8_delayed": 3.07,  # +2.3%
              "megatron-llama3_100m-bf16": 3.02, "megatron-llama3_100m-fp8_current": 3.04,
              "megatron-llama3_100m-fp8_delayed": 3.03,  # within 2% of its bf16 and of torch's delayed
              "megatron-llama3_100m-fp8_blockwise": 3.02}  # torch's blockwise run has no loss
    rows = {r.name: {"status": "ok", "mean_loss_last_100": losses.get(r.name)} for r in runs}
    bench.judge_losses(runs, rows)
    status = {name: row["status"] for name, row in rows.items()}
    assert status["torch-llama3_100m-fp8_current"] == status["megatron-llama3_100m-fp8_current"] == "ok"
    assert status["megatron-llama3_100m-fp8_delayed"] == "ok"
    assert status["torch-llama3_100m-fp8_delayed"].startswith("failed (loss gap over 2%")
    assert status["megatron-llama3_100m-fp8_blockwise"].startswith("failed")
    table = "\n".join(bench.loss_tables(runs, {name: {**row, "steps": 500, "error": ""} for name, row in rows.items()}))
    assert "| torch | fp8_delayed | 500 | 3.0700 | +2.33% | - | failed" in table
    assert "| megatron | fp8_blockwise | 500 | 3.0200 | +0.00% | no loss | failed" in table


def test_recipe_studies_run_each_configuration_with_each_seed_and_continue_from_checkpoints(tmp_path):
    """Issues 51 and 50's studies: every configuration with every seed, the convergence study's settings, 2000 steps,
    all at once, checkpointed every 500 steps so a later call continues them; each composes and passes the plan
    (prepare, one seed)."""
    nvfp4 = bench.recipe_study_runs("nvfp4", "h200", 2000)
    assert len(nvfp4) == 6 * 3 and len({run.name for run in nvfp4}) == 18
    assert {run.precision for run in nvfp4} == {"bf16", "fp8_current", "nvfp4", "nvfp4-no_rht",
                                                "nvfp4-no_stochastic_rounding", "nvfp4-no_bf16_last_layers"}
    for run in nvfp4:
        o = overrides_of(run)
        assert (o["model"], o["data"], o["trainer.max_steps"], o["trainer.seed"]) == (
            "llama3_100m", "text", "2000", str(run.seed))
        assert (o["trainer.checkpoint.interval"], run.side_by_side, run.part) == ("500", True, "loss")
        assert o.get("precision.emulate") == ("true" if run.precision.startswith("nvfp4") else None)
    granularity = bench.recipe_study_runs("granularity", "h200", 2000, seeds=(7,))
    assert [run.precision for run in granularity] == list(bench.RECIPE_STUDIES["granularity"])
    runs = bench.recipe_study_runs("nvfp4", "h200", 2000, seeds=(7,)) + granularity[2:]
    bench.prepare("nvfp4", runs, tmp_path)
    for run in runs:
        cfg = load_config(tmp_path / run.name / "config.yaml")
        assert cfg.trainer.seed == 7 and cfg.trainer.max_steps == 2000
    assert load_config(tmp_path / "torch-llama3_100m-nvfp4-no_rht-seed7" / "config.yaml").precision.disable_rht
    loaded = bench.load_study(tmp_path)[2]
    assert [dataclasses.replace(run, memory_gib=None) for run in loaded] == runs
    for run in loaded:  # the plan's estimate, as its plan.txt prints it
        planned = re.search(r"memory/GPU\s+~([\d.]+) GiB", (tmp_path / run.name / "plan.txt").read_text())
        assert run.memory_gib == pytest.approx(float(planned[1]), abs=0.05)


def test_side_by_side_runs_share_the_gpu_as_its_free_memory_holds_them():
    """A recipe study's 21 runs on an 80 GB H100: 11 at a time (13 fit by the estimates: two even rounds), within the
    share of the free memory; on an H200 all at once; one at a time where one fits; all at once where the GPU or an
    estimate is unknown."""
    runs = [dataclasses.replace(run, memory_gib=4.4)
            for run in bench.recipe_study_runs("granularity", "h100", 2000)]
    assert len(runs) == 21
    per_run = 4.4 + bench.PROCESS_OVERHEAD_GIB
    assert bench.side_by_side_slots(runs, free_gib=79.0) == 11
    assert 11 * per_run <= 79.0 * bench.GPU_MEMORY_SHARE
    assert bench.side_by_side_slots(runs[:13], free_gib=79.0) == 13
    assert bench.side_by_side_slots(runs[:16], free_gib=79.0) == 8
    assert bench.side_by_side_slots(runs, free_gib=139.0) == 21
    assert bench.side_by_side_slots(runs, free_gib=per_run / bench.GPU_MEMORY_SHARE) == 1
    assert bench.side_by_side_slots(runs, free_gib=1.0) == 1  # never none
    assert bench.side_by_side_slots(runs, free_gib=None) == 21
    unknown = [*runs[:20], dataclasses.replace(runs[20], memory_gib=None)]
    assert bench.side_by_side_slots(unknown, free_gib=79.0) == 21
    assert bench.side_by_side_slots([], free_gib=79.0) == 1  # every run finished earlier: a pool of one, unused


def test_run_study_starts_a_run_as_soon_as_a_slot_frees(monkeypatch, tmp_path):
    """On a GPU with room for two of four side-by-side runs, run_study runs two at a time, in the study's order, and
    starts the third when the first to end has ended, while the other still runs (not when both have: no slot waits
    for the slowest run of a batch)."""
    runs = [dataclasses.replace(run, memory_gib=4.0)
            for run in bench.recipe_study_runs("granularity", "h100", 20, seeds=(1, 2))[:4]]
    monkeypatch.setattr(bench, "load_study", lambda directory: ("granularity", "prepared1", runs))
    monkeypatch.setattr(bench, "provenance", lambda: {"commit": "unknown", "versions": {"torch": "2"}, "device": "X"})
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    per_run = 4.0 + bench.PROCESS_OVERHEAD_GIB
    monkeypatch.setattr(bench.torch.cuda, "mem_get_info", lambda: (int(2.5 * per_run / bench.GPU_MEMORY_SHARE
                                                                        * 2**30), 80 * 2**30))
    events, running, lock = [], set(), threading.Lock()
    duration = {runs[0].name: 1.0, runs[1].name: 0.2, runs[2].name: 0.2, runs[3].name: 0.2}

    def execute(run, run_dir, timeout_s):
        with lock:
            running.add(run.name)
            events.append((run.name, frozenset(running)))
        time.sleep(duration[run.name])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "loss": 3.0, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s_per_gpu": 1.0,
             "model_tflops_per_gpu": 1.0, "mfu": 0.1, "peak_memory_gib": 4.0}) + "\n" for s in range(1, 21)))
        with lock:
            running.discard(run.name)
        return bench.Outcome("ok", 1.0, "", {})

    monkeypatch.setattr(bench, "execute", execute)
    bench.run_study(tmp_path, tmp_path / "out", ("loss",), 10_000.0, None)
    assert [name for name, _ in events] == [run.name for run in runs]  # started in the study's order
    assert all(len(together) <= 2 for _, together in events)
    seen = dict(events)
    assert runs[0].name in seen[runs[2].name]  # the third started while the slow first still ran
    assert runs[0].name in seen[runs[3].name]


def test_a_finished_study_run_is_reported_not_started_again_here_and_after_adopt(monkeypatch, tmp_path):
    """A recipe study over several calls: a run that finished is reported from its files by the next call, not
    started (on the machine that ran it, and on a later session's, which has its files by `adopt` from the earlier
    call's runs.tar.gz); a run cut short is started again, and adopt takes no run whose archived config differs
    from the one prepared here or whose steps are not all there."""
    runs = bench.recipe_study_runs("granularity", "h100", 3, seeds=(1,))[:3]
    study = tmp_path / "study"
    bench.prepare("granularity", runs, study)
    monkeypatch.setattr(bench, "provenance", lambda: {"commit": "c2", "versions": {"torch": "2"}, "device": "X"})
    started = []

    def execute(run, run_dir, timeout_s):  # the second run is cut short after step 2 in the first call
        started.append(run.name)
        steps = 2 if run.name == runs[1].name and len(started) <= 3 else 3
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "loss": 3.0, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s_per_gpu": 1.0,
             "model_tflops_per_gpu": 1.0, "mfu": 0.1, "peak_memory_gib": 4.0}) + "\n" for s in range(1, steps + 1)))
        if steps == 3:
            (run_dir / "summary.json").write_text(json.dumps({"commit": "c1" * 20, "device": "NVIDIA H100"}))
        return bench.Outcome("ok" if steps == 3 else "timeout", 1.0)

    monkeypatch.setattr(bench, "execute", execute)

    def call(out: str) -> dict:
        bench.run_study(study, tmp_path / out, ("loss",), 10_000.0, None)
        return {r["name"]: r for r in csv.DictReader(open(tmp_path / out / "results.csv"))}

    call("first")
    assert started == [run.name for run in runs]
    rows = call("second")  # the same machine: only the run cut short starts again
    assert started[3:] == [runs[1].name]
    assert rows[runs[0].name]["status"] == "ok" and rows[runs[0].name]["steps"] == "3"
    assert rows[runs[0].name]["note"] == "finished in an earlier call: commit c1c1c1c1c1c1, NVIDIA H100"
    assert rows[runs[1].name]["note"] == ""
    table = (tmp_path / "second" / "results.md").read_text()
    assert "| ok (finished in an earlier call: commit c1c1c1c1c1c1, NVIDIA H100) |" in table

    # a later session's machine: the prepared files only, then the first call's archive adopted
    for run in runs:
        for name in ("metrics.jsonl", "summary.json"):
            (study / run.name / name).unlink()
    prepared = (study / runs[2].name / "config.yaml").read_text()
    (study / runs[2].name / "config.yaml").write_text(prepared.replace("seed: 1", "seed: 5"))  # another config
    assert bench.adopt(study, tmp_path / "first" / "runs.tar.gz") == [runs[0].name]  # runs[1] had 2 steps of 3
    assert (study / runs[0].name / "summary.json").is_file() and not (study / runs[1].name / "summary.json").exists()
    rows = call("third")
    assert started[4:] == [runs[1].name, runs[2].name]
    assert rows[runs[0].name]["note"].startswith("finished in an earlier call")
    assert not (study / runs[1].name / "summary.json").is_symlink()


def test_recipe_study_table_compares_each_run_with_bf16_of_its_seed_and_averages_the_seeds():
    runs = bench.recipe_study_runs("nvfp4", "h200", 2000, seeds=(1, 2))
    losses = {"bf16": (3.00, 2.90), "fp8_current": (3.03, 2.90), "nvfp4": (3.06, 2.99)}  # +0.5% / +2.5% on average
    rows = {run.name: {"status": "ok", "error": "", "steps": 2000, "median_step_s": 0.1,
                       "mean_loss_last_100": losses.get(run.precision, (None, None))[run.seed - 1]} for run in runs}
    table = "\n".join(bench.recipe_study_tables(runs, rows))
    assert "| fp8_current | 1 | 2000 | 3.0300 | +1.00% | 0.100 | ok  |" in table
    assert "| nvfp4 | 2 | 2000 | 2.9900 | +3.10% |" in table
    assert "| nvfp4-no_rht | 1 | 2000 | - | no loss |" in table
    assert "| fp8_current | 2 | +0.50% | +0.00% | +1.00% | yes |" in table
    assert "| nvfp4 | 2 | +2.55% | +2.00% | +3.10% | no |" in table
    assert "| nvfp4-no_rht | 0 | - | - | - | - |" in table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_megatron_resume_repeats_the_uninterrupted_steps_in_every_recipe_on_gpu(hydra_compose, tmp_path):
    """engine=megatron with Transformer Engine, the benchmark's own resume runs (llama3_100m, megatron.deterministic):
    run to step 6 with checkpoints at 3 and 6, cut back to step 3, run again. In BF16 and every Hopper recipe, with
    the distributed optimizer (and the FP8 weights it keeps where the recipe's preset has them) and without, and under
    Megatron-FSDP in bf16, fp8_current and fp8_delayed, steps 4-6 repeat with the same loss and gradient norm, bit
    for bit. Hydra from the wheels carried to the GPU machine."""
    pytest.importorskip("transformer_engine")
    runs = [run for run in bench.speed_runs("h200", steps=6) if run.resume]
    for run in runs:
        cfg = hydra_compose(*run.overrides, "dryrun=true")
        (tmp_path / run.name).mkdir()
        save_config(dataclasses.replace(cfg, dryrun=False), tmp_path / run.name / "config.yaml")
    with ThreadPoolExecutor(len(runs)) as pool:
        outcomes = list(pool.map(lambda run: bench.execute(run, tmp_path / run.name, run.timeout_s), runs))
    not_ok = {run.name: f"{outcome.status} {outcome.error}" for run, outcome in zip(runs, outcomes)
              if outcome.status != "ok"}
    assert not not_ok, "\n".join(f"{name}: {why}" for name, why in not_ok.items())
    checks = {run.name: bench.resume_check(tmp_path / run.name) for run in runs}
    report = "\n".join(f"{name}: {note}" for name, (note, _) in checks.items())
    print(report)  # the GPU log's record of each repeated step's difference (pytest -s)
    assert all(exact for _, exact in checks.values()), report
