"""scripts/megatron_bench.py on the CPU: the studies it plans, the configs `prepare` composes, and `run` starting
each config as its own engine process (the torch engine on tiny_llama; engine=megatron, which needs CUDA, fails
there and is reported as failed), the resume check, the loss study's verdict, the budget, and the tables. No
megatron training on the CPU; on a GPU with Transformer Engine (`pytest -m gpu`), the resume check of every recipe.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor

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
    runs = bench.speed_runs("h200", steps=6)
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
    for run in by_part["precisions"] + by_part["torch"] + by_part["nemotron"]:  # 6 timed steps, then one profiled
        o = overrides_of(run)
        assert (o["trainer.max_steps"], o["trainer.profile_step"], run.profile_step) == ("7", "7", 7)
        assert bench.engine_pair(run.name) in {r.name for r in runs}
    for run in by_part["fsdp"]:  # timed as its DDP twin of `precisions`, with Megatron-FSDP its only difference
        ddp = next(r for r in by_part["precisions"] if r.precision == run.precision)
        assert not run.side_by_side and set(run.overrides) - set(ddp.overrides) == {"parallel.fsdp=true"}
        assert set(ddp.overrides) <= set(run.overrides)
    assert [r.precision for r in by_part["fsdp"]] == ["bf16", "fp8_current"]
    functional = by_part["functional"]
    assert all(r.side_by_side and r.resume for r in functional)
    assert {(r.precision, overrides_of(r).get("parallel.distributed_optimizer", "true"),
             overrides_of(r).get("parallel.fsdp", "false")) for r in functional} == \
        {(p, optimizer, "false") for p in ("bf16", *bench.FP8_RECIPES) for optimizer in ("true", "false")} | \
        {(p, "true", "true") for p in ("bf16", "fp8_current", "fp8_delayed")}
    for resume in functional:
        o = overrides_of(resume)
        assert (o["trainer.checkpoint.interval"], o["trainer.max_steps"], o["model"]) == ("3", "6", "llama3_100m")
    for recipe in bench.FP8_RECIPES:  # each ablation is its tuned run with exactly its own switch changed
        tuned = set(next(r for r in by_part["precisions"] if r.precision == recipe).overrides)
        ablations = [r for r in by_part["ablations"] if r.precision == recipe]
        assert [r.switch for r in ablations][:2] == ["gradient_accumulation_fusion=false",
                                                     "cross_entropy_loss_fusion=false"]
        for run in ablations:
            changed, dropped = set(run.overrides) - tuned, tuned - set(run.overrides)
            steps = {"trainer.max_steps=10" if run.warmup > 2 else "trainer.max_steps=6"}  # graphs: 4 more
            assert changed - steps == set(dict(bench.ABLATIONS)[run.switch]), run.name
            assert dropped == {"trainer.max_steps=7", "trainer.profile_step=7"}, run.name  # not profiled
        assert ("fp8_param_gather=false" in [r.switch for r in ablations]) == (recipe != "fp8_blockwise")
    register_schema()
    for run in runs + bench.loss_runs("h200", steps=500):
        check_override_keys(list(run.overrides))


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
    """Three configurations the CPU can judge: the torch engine timed and resumed, engine=megatron (no CUDA)."""
    tiny = ("gpu=cpu", "model=tiny_llama", "model.seq_length=64", "data=mock", "precision=bf16",
            "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "trainer.log_interval=1")
    return [
        bench.Run("resume-torch", "functional", "torch", "bf16", ("engine=torch", *tiny, "trainer.max_steps=2",
                  "trainer.checkpoint.interval=1", "data.cache_dir=cache"), side_by_side=True, resume=True),
        bench.Run("megatron-bf16", "precisions", "megatron", "bf16", ("engine=megatron", *tiny, "trainer.max_steps=3")),
        bench.Run("torch-bf16", "torch", "torch", "bf16", ("engine=torch", *tiny, "trainer.max_steps=4"), warmup=1),
    ]


def test_prepare_then_run_each_config_in_its_own_process(tmp_path):
    study = tmp_path / "study"
    bench.prepare("speed", cpu_study(tmp_path), study)
    assert [r.name for r in bench.load_study(study)[2]] == [r.name for r in cpu_study(tmp_path)]
    cfg = load_config(study / "torch-bf16" / "config.yaml")
    assert (cfg.engine, cfg.model.seq_length, cfg.trainer.max_steps, cfg.dryrun) == ("torch", 64, 4, False)
    assert "tuning      " in (study / "megatron-bf16" / "plan.txt").read_text()  # the megatron plan's line

    # As on the GPU machine: no Hydra, omegaconf or nemo-run, for `run` and the engines it starts (PYTHONPATH).
    blocker = tmp_path / "gpu_machine"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NOT_ON_THE_GPU_MACHINE)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "megatron_bench.py"), "run", "--dir", "study",
                             "--out", "out", "--parts", "functional,precisions,torch"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(blocker)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr  # engine=megatron cannot run on a CPU
    rows = {r["name"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert rows["megatron-bf16"]["status"] == "failed (1)"
    assert "engine=megatron needs CUDA GPUs" in rows["megatron-bf16"]["error"]
    timed = rows["torch-bf16"]
    assert (timed["status"], timed["steps"], timed["timed_steps"]) == ("ok", "4", "3")
    steps = [json.loads(line) for line in (study / "torch-bf16" / "metrics.jsonl").read_text().splitlines()]
    assert float(timed["step_s"]) == sorted(m["step_time_s"] for m in steps[1:])[1]  # the median of three
    resumed = rows["resume-torch"]
    assert resumed["status"] == "ok" and resumed["step_s"] == "", resumed["note"]  # side by side: no timing
    assert resumed["note"] == "resumed from step 1; steps 2-2 repeated, max rel. diff: loss 0.00e+00, grad norm 0.00e+00"
    table = (out / "results.md").read_text()
    assert "| torch | bf16 | " in table and "| resume-torch | 2 | " in table
    assert "failed (1) error: engine=megatron needs CUDA GPUs" in table
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"runs/torch-bf16/metrics.jsonl", "runs/resume-torch/train_resumed.log",
            "runs/megatron-bf16/plan.txt"} <= names
    assert not any("checkpoints" in name or "cache" in name for name in names)


def test_a_run_that_would_overrun_the_budget_is_not_started(tmp_path):
    runs = cpu_study(tmp_path)[1:]
    bench.prepare("speed", runs, tmp_path / "study")
    assert bench.run_study(tmp_path / "study", tmp_path / "out", ("precisions", "torch"), budget_s=30, best=None) == 1
    rows = {r["name"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    for run in runs:  # first guesses: 90 s for engine=megatron, 150 s for the torch engine
        assert rows[run.name]["status"].startswith("not run (budget: ~")
        assert not (tmp_path / "study" / run.name / "train.log").exists()
    done = {"megatron-bf16": bench.Outcome("ok", wall_s=42.0)}
    assert bench.estimate_s(runs[0], runs, done) == 42.0 and bench.estimate_s(runs[1], runs, done) == 150.0


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
        return bench.row(run, tmp_path, bench.Outcome("ok", 1.0))

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
        outcomes = list(pool.map(lambda run: bench.execute(run, tmp_path / run.name, run.timeout_s, "test"), runs))
    not_ok = {run.name: f"{outcome.status} {outcome.error}" for run, outcome in zip(runs, outcomes)
              if outcome.status != "ok"}
    assert not not_ok, "\n".join(f"{name}: {why}" for name, why in not_ok.items())
    checks = {run.name: bench.resume_check(tmp_path / run.name) for run in runs}
    report = "\n".join(f"{name}: {note}" for name, (note, _) in checks.items())
    print(report)  # the GPU log's record of each repeated step's difference (pytest -s)
    assert all(exact for _, exact in checks.values()), report
