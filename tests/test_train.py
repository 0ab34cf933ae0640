"""End to end through launch/run.py and nemo-run: real training runs on the CPU, their metrics files, several
processes (FSDP2), NaN stop."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes.config import LINEAR_KINDS, OUTPUT_LAYER, load_config
from recipes.engine.torch_engine import main as engine_main
from recipes.metrics import StepMetrics, warmup_steps

REPO = Path(__file__).resolve().parent.parent
STEP_FIELDS = {f for f in StepMetrics.__dataclass_fields__}
SUMMARY_FIELDS = {
    "model", "parameters", "precision", "recipe", "gpu", "engine", "world_size", "nodes", "num_layers", "seq_length",
    "micro_batch_size", "global_batch_size", "steps", "warmup_steps_excluded", "median_step_time_s",
    "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "peak_memory_gib", "final_loss", "emulated",
    "commit", "versions", "device", "compute_dtype", "attention", "fused_loss", "modules",
}
# precision.modules on the command line: layer 0's linears in BF16, layer 1's in the run's fp8_current
LAYER_0_IN_BF16 = 'precision.modules=[{pattern: "layers.0.*", precision: bf16}]'



@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def launch(tmp_path: Path, cache_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FP8_RECIPES_RUNS": str(tmp_path / "runs"),
        "FP8_RECIPES_CACHE": str(cache_dir),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    return subprocess.run(
        [sys.executable, str(REPO / "launch" / "run.py"), *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision,modules", [("bf16", ()), ("fp8_current", ()), ("fp8_current", (LAYER_0_IN_BF16,))],
                         ids=["bf16", "fp8_current", "fp8_current-layer0_bf16"])
def test_training_run_loss_falls(tmp_path, cache_dir, precision, modules):
    run_dir = tmp_path / "run"
    steps = 20
    result = launch(
        tmp_path, cache_dir, f"precision={precision}", f"trainer.max_steps={steps}", "trainer.log_interval=5",
        f"run.dir={run_dir}", *modules,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step    {steps}/{steps}" in result.stdout  # progress reached the console

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert set(m) == STEP_FIELDS
        assert math.isfinite(m["loss"]) and m["step_time_s"] > 0 and m["tokens_per_s_per_gpu"] > 0
        assert m["mfu"] is None  # no published peak for a CPU
    # Byte-level text starts at ln(320) ~ 5.8; 20 steps of real text must bring it well down.
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-3:]) / 3
    assert first > 5.0 and last < first - 1.5, (first, last)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == SUMMARY_FIELDS
    assert summary["precision"] == precision and summary["steps"] == steps
    # auto: BF16 where PyTorch runs BF16 GEMMs natively (oneDNN), FP32 elsewhere
    native_bf16 = torch.backends.mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert summary["compute_dtype"] == ("bf16" if native_bf16 else "fp32")
    assert (summary["attention"], summary["fused_loss"]) == ("flash", True)  # SDPA's CPU flash kernel; the default
    assert "TFLOP/s" not in result.stdout and "MFU" not in result.stdout  # a CPU: tokens/s, no GPU figures
    assert summary["parameters"] == 3_311_872  # tiny_llama, worked out by hand in tests/test_models.py
    assert summary["warmup_steps_excluded"] == warmup_steps(steps)
    steady = sorted(m["step_time_s"] for m in metrics[warmup_steps(steps):])
    assert summary["median_step_time_s"] == pytest.approx((steady[8] + steady[9]) / 2)
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.precision.name == precision and cfg.gpu.name == "cpu"
    # which linear ran which precision: the plan, the summary, the config (which a resume must match)
    layers = cfg.model.num_layers
    assert summary["modules"] == {
        **{f"layers.{i}.{kind}": "bf16" if precision == "bf16" or (modules and i == 0) else "fp8_current"
           for i in range(layers) for kind in LINEAR_KINDS}, OUTPUT_LAYER: "bf16"}
    assert [(m.pattern, m.precision) for m in cfg.precision.modules] == ([("layers.0.*", "bf16")] if modules else [])
    if precision != "bf16":
        plan_line = next(line for line in result.stdout.splitlines() if line.startswith("modules"))
        first = 1 if modules else 0
        assert f"fp8_current: layers {first}-{layers - 1} attention.qkv, attention.out, mlp.fc1, mlp.fc2" in plan_line

    # TensorBoard (trainer.tensorboard, on by default): every step's metrics, as tensorboard's own reader sees them
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for field in sorted(STEP_FIELDS - {"step", "mfu"}):  # MFU is null on a CPU (no published peak): not logged
        logged = events.Scalars(f"train/{field}")
        assert [e.step for e in logged] == list(range(1, steps + 1)), field
        assert [e.value for e in logged] == pytest.approx([m[field] for m in metrics], rel=1e-6), field  # float32
    assert "train/mfu" not in events.Tags()["scalars"]


def test_two_processes_train_sharded_through_torchrun_and_profile_a_step(tmp_path, cache_dir):
    run_dir = tmp_path / "ddp"
    result = launch(tmp_path, cache_dir, "executor.gpus=2", "trainer.max_steps=3", "precision=bf16",
                    "trainer.profile_step=2", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert len(read_metrics(run_dir)) == 3  # one writer (rank 0), not one per process
    # trainer.profile_step: each process traces step 2 and splits its operator time (CPU: no kernels)
    assert "profile of step 2 (rank 0)" in result.stdout
    for rank in (0, 1):
        split = json.loads((run_dir / "profile" / f"time_rank{rank}.json").read_text())
        assert (split["step"], split["rank"], split["timed"]) == (2, rank, "operators")
        assert split["ms"]["gemm"] > 0 and split["ms"]["communication"] > 0  # matmuls; FSDP2's Gloo collectives
        assert split["total_ms"] == pytest.approx(sum(split["ms"].values()))
        assert json.loads((run_dir / "profile" / f"trace_rank{rank}.json").read_text())["traceEvents"]


def test_the_engine_refuses_a_hand_edited_config_out_of_range(tmp_path, capsys):
    """A config.yaml the plan never saw (edited by hand, written by another tool): the engine's own check."""
    from test_checkpoint import make_config

    config = make_config(tmp_path / "run")
    config.write_text(config.read_text().replace("lr: 0.001\n", "lr: -1.0\n", 1))
    assert load_config(config).trainer.lr == -1.0
    assert engine_main([str(config)]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: trainer.lr=-1.0 is out of range: it must be >= 0; e.g. trainer.lr=0.001 (the default)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_non_finite_loss_stops_the_run_and_is_recorded(tmp_path, cache_dir, capsys):
    # Weights of 1e30 overflow BF16 activations: the loss or the gradient norm is non-finite from the first step.
    result = launch(
        tmp_path, cache_dir, "model.init_std=1e30", "trainer.max_steps=5", f"run.dir={tmp_path / 'nan'}", "dryrun=true"
    )
    assert result.returncode == 0, result.stderr
    assert engine_main([str(tmp_path / "nan" / "config.yaml")]) == 1
    assert "not finite" in capsys.readouterr().err
    metrics = read_metrics(tmp_path / "nan")
    assert len(metrics) == 1
    assert not (math.isfinite(metrics[0]["loss"]) and math.isfinite(metrics[0]["grad_norm"]))
    assert not (tmp_path / "nan" / "summary.json").exists()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_amax_stops_a_delayed_scaling_run_naming_step_layer_and_role(tmp_path, cache_dir, capsys,
                                                                                monkeypatch, bad):
    """An inf or NaN reaches one FP8 layer's input in step 2. Delayed scaling casts with its stored scale (an inf
    saturates and the loss stays finite; a NaN spreads), its amax reaches the history, and the run stops at the
    end of step 2 with one line naming the step, the layer (without the activation-checkpointing wrapper) and
    the role."""
    from recipes.engine import torch_engine
    from recipes.fp8.linear import Fp8Linear
    from recipes.trainer import loop

    run_dir = tmp_path / "run"
    small = ("model.num_layers=2", "model.seq_length=32", "trainer.micro_batch_size=1", "trainer.global_batch_size=1")
    result = launch(tmp_path, cache_dir, "precision=fp8_delayed", "trainer.max_steps=2", *small,  # CPU FP8 is slow
                    "trainer.activation_checkpointing=true", f"run.dir={run_dir}", "dryrun=true")
    assert result.returncode == 0, result.stderr
    now, faulty = {}, {}
    learning_rate, build_model = loop.learning_rate, torch_engine.build_model

    def noting_the_step(step, trainer):
        now["step"] = step
        return learning_rate(step, trainer)

    def with_a_fault(*args, **kwargs):
        model = build_model(*args, **kwargs)
        name, layer = next((n, m) for n, m in model.named_modules() if n.startswith("layers.1.")
                           and isinstance(m, Fp8Linear))
        faulty["name"] = "layers.1." + name.split("_checkpoint_wrapped_module.")[1]

        def inject(module, args):
            if now["step"] == 2:
                x = args[0].clone()
                x.view(-1)[5] = bad
                return (x,)

        layer.register_forward_pre_hook(inject)
        return model

    monkeypatch.setattr(loop, "learning_rate", noting_the_step)
    monkeypatch.setattr(torch_engine, "build_model", with_a_fault)
    assert engine_main([str(run_dir / "config.yaml")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: training stopped: step 2: ") and error.endswith("(precision=fp8_delayed)")
    if bad == float("inf"):
        assert f"the amax of {faulty['name']}'s input is inf or NaN (delayed scaling)" in error, error
        assert "loss" not in error  # saturated in the cast: only the amax tells
    else:
        assert f"the amax of {faulty['name']}'s input (and " in error and "loss nan" in error, error
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


def test_failed_job_makes_launch_fail(tmp_path, cache_dir):
    result = launch(tmp_path, cache_dir, "model.init_std=1e30", "trainer.max_steps=2", f"run.dir={tmp_path / 'f'}")
    assert result.returncode != 0
    assert "did not succeed" in result.stderr



def test_local_sweep_is_one_experiment_that_nemo_runs_cli_reads(tmp_path, cache_dir, nemo_cli):
    result = launch(tmp_path, cache_dir, "-m", "trainer.seed=1,2", "precision=bf16", "data=mock",
                    "model.seq_length=64", "trainer.max_steps=2", "trainer.tensorboard=false")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "runs").glob("*-sweep")
    assert not list(sweep.glob("*/tensorboard")) and len(list(sweep.glob("*/metrics.jsonl"))) == 2
    home = tmp_path / "runs" / "nemo-run"  # one home for every executor, as executor=slurm's
    ids = sorted(p.name for p in (home / "experiments" / sweep.name).iterdir())
    assert len(ids) == 2  # both points under the sweep's experiment title, as a Slurm sweep is
    commands = nemo_cli.printed(result.stdout)
    assert [c.split()[-1] for c in commands["status"]] == ids and f"NEMORUN_HOME={home} " in commands["status"][0]
    assert "Status: SUCCEEDED" in nemo_cli.run(commands["status"][0])
    assert "final loss" in nemo_cli.run(commands["logs"][0])  # the engine's summary, from nemo-run's own log
    listed = nemo_cli.run(commands["list"][-1])
    assert all(experiment_id in listed for experiment_id in ids)


def test_progress_line_shows_the_time_left():
    from recipes.trainer.console import step_line

    times = [30.0, 2.0, 2.2, 2.1, 9.0]  # compilation first, a profiled step last: the median of all five is 2.2
    history = [StepMetrics(step=s, loss=3.0, grad_norm=1.0, lr=1e-3, step_time_s=t, tokens_per_s_per_gpu=100.0,
                           model_tflops_per_gpu=1.0, mfu=None, peak_memory_gib=1.0) for s, t in enumerate(times, 1)]
    assert step_line(history, max_steps=1005).endswith(" | ETA 0:36:40")  # 1000 steps left x 2.2 s = 2200 s
    assert step_line(history, max_steps=5).endswith(" | ETA 0:00:00")
    assert " | 100 tokens/s/GPU | 1.00 TFLOP/s/GPU | " in step_line(history, max_steps=5)


def test_progress_line_on_a_cpu_shows_the_runs_tokens_per_second_and_no_gpu_figures():
    from recipes.trainer.console import step_line

    history = [StepMetrics(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, step_time_s=2.0, tokens_per_s_per_gpu=100.0,
                           model_tflops_per_gpu=0.001, mfu=None, peak_memory_gib=1.0)]
    line = step_line(history, max_steps=5, cpu_processes=2)
    assert " | 2.000 s/step | 200 tokens/s | peak mem " in line  # two processes of 100 tokens/s each
    assert "GPU" not in line and "TFLOP" not in line and "MFU" not in line
