"""Checkpoint and resume of the PyTorch engine: exact continuation, metrics without gaps or duplicates, pruning,
atomic saves, refusal of a checkpoint of another model, one call each way between the engine and the shared
checkpoint code, and the same through torchrun with two processes.

Runs are tiny_llama with 64-token sequences on random tokens, in FP8 current scaling (one in delayed scaling), on
the CPU (deterministic: compile is off), and a constant learning rate, so that a run may also be extended
(max_steps grown) and still match an uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes.config import CheckpointConfig, Config, TrainerConfig, load_option
from recipes.folders import save_config
from recipes.engine import checkpoint, torch_engine
from recipes.trainer import checkpoints as shared_checkpoints
from recipes.trainer import loop
from recipes.trainer.checkpoints import complete_checkpoints

from test_train import REPO, launch, read_metrics

STEPS = 6


class SimulatedKill(Exception):
    """Stands for SIGKILL, a node failure or a Slurm preemption in the middle of a run."""


def make_config(
    run_dir: Path, max_steps: int = STEPS, interval: int = 3, keep_last: int = 2, gpu: str = "cpu",
    precision: str = "fp8_current", **model,
) -> Path:
    model_cfg = dataclasses.replace(load_option("model", "tiny_llama"), seq_length=64, **model)
    cfg = Config(
        model=model_cfg,
        precision=load_option("precision", precision),
        gpu=load_option("gpu", gpu),
        executor=load_option("executor", "local"),
        data=load_option("data", "mock"),
        trainer=TrainerConfig(
            max_steps=max_steps, lr=1e-3, min_lr=1e-3, warmup_steps=0, log_interval=1,
            checkpoint=CheckpointConfig(interval=interval, keep_last=keep_last),
        ),
    )
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir / "config.yaml"


def run(config_path: Path) -> None:
    assert torch_engine.main([str(config_path)]) == 0


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(run_dir)]


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


ORIGINAL_GET = torch_engine.MicroBatches.get


def patch_batches(monkeypatch, draws: dict, kill_step: int | None = None) -> None:
    """Draw from every global RNG at each micro-batch (as dropout would) and record the draws, so that a resumed
    run shows whether it continued the RNG streams where the checkpoint left them; die in step `kill_step`."""

    def get(self, step, micro):
        if step == kill_step:
            raise SimulatedKill
        draws[step] = (torch.rand(1).item(), random.random(), float(np.random.rand()))
        return ORIGINAL_GET(self, step, micro)

    monkeypatch.setattr(torch_engine.MicroBatches, "get", get)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float, float]]:
    """(step, loss, grad norm) of an uninterrupted run of STEPS steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    run(make_config(run_dir, interval=0))
    assert not (run_dir / "checkpoints").exists()  # interval 0: no checkpoints
    return losses(run_dir)


def test_resume_after_a_kill_is_exact_and_metrics_have_no_gap_or_duplicate(tmp_path, monkeypatch, capsys, reference):
    uninterrupted_dir, uninterrupted, killed, resumed = tmp_path / "uninterrupted", {}, {}, {}
    patch_batches(monkeypatch, uninterrupted)
    seed_everything(0)
    run(make_config(uninterrupted_dir, interval=0))
    assert losses(uninterrupted_dir) == reference  # drawing random numbers does not change training

    run_dir = tmp_path / "run"
    config_path = make_config(run_dir)
    patch_batches(monkeypatch, killed, kill_step=5)
    seed_everything(0)
    with pytest.raises(SimulatedKill):
        torch_engine.main([str(config_path)])
    # Killed in step 5: checkpoint at 3, and step 4 already in metrics.jsonl. A line torn by the kill, too.
    assert [s for s, *_ in losses(run_dir)] == [1, 2, 3, 4]
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({**read_metrics(run_dir)[-1], "step": 5, "loss": 99.0}) + "\n")
        file.write('{"step": 6, "lo')
    assert [p.name for _, p in complete_checkpoints(run_dir / "checkpoints", checkpoint.FILE)] == ["step_00000003"]

    capsys.readouterr()
    patch_batches(monkeypatch, resumed)
    seed_everything(12345)  # a new process starts with other RNG states; the checkpoint's must win
    run(config_path)
    out = capsys.readouterr().out
    assert f"resuming from step 3 of {run_dir / 'checkpoints' / 'step_00000003'}" in out

    assert losses(run_dir) == reference  # bit-identical, every step once, in order
    assert killed[4] == uninterrupted[4] and resumed[4] == uninterrupted[4] and resumed[6] == uninterrupted[6]
    # TensorBoard too: the resumed writer purges the killed run's steps after the checkpoint (step 4), and the
    # steps before it were on disk by the checkpoint
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss, *_ in reference]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_loss"] == reference[-1][1]


def test_a_killed_run_keeps_every_step_it_logged_in_tensorboard(tmp_path):
    """SIGKILL right after three steps: their TensorBoard scalars are on disk (TensorBoard's writer flushes every
    two minutes unless told), as their lines of metrics.jsonl are."""
    run_dir = tmp_path / "run"
    config_path = make_config(run_dir)
    fields = "grad_norm=1.0, lr=1e-3, step_time_s=1.0, tokens_per_s_per_gpu=1.0, model_tflops_per_gpu=1.0, mfu=None"
    code = (f"import os; from pathlib import Path; from recipes.config import load_config; "
            f"from recipes.metrics import MetricsWriter, StepMetrics; "
            f"writer = MetricsWriter(Path({str(run_dir)!r}), load_config({str(config_path)!r})); "
            f"[writer.write(StepMetrics(step=s, loss=float(s), {fields}, peak_memory_gib=1.0)) for s in (1, 2, 3)]; "
            f"os.kill(os.getpid(), 9)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == -9
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_finished_run_extended_with_more_steps_matches_an_uninterrupted_one(tmp_path, capsys, reference):
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=4, interval=4))
    capsys.readouterr()
    run(make_config(run_dir, max_steps=STEPS, interval=4))  # a resubmission asking for more steps
    out = capsys.readouterr().out
    assert "resuming from step 4 of" in out and "trainer.max_steps 4 -> 6" in out
    assert "saved checkpoint of step 6" in out  # the last step is always saved
    assert losses(run_dir) == reference
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS

    run(make_config(run_dir, max_steps=STEPS, interval=4))  # started again when already done: nothing to train
    assert losses(run_dir) == reference


def test_metrics_removed_or_replaced_during_a_run_are_written_again_whole(tmp_path, monkeypatch, capsys, reference):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    rate = loop.learning_rate

    def meddling(step: int, trainer):  # at the start of a step, after the previous one's line was written
        if step == 3:
            metrics.unlink()
        if step == 4:
            metrics.write_text('{"step": 1, "loss": 0.0}\n')  # written over, shorter
        if step == 5:
            (run_dir / "other.jsonl").write_text('{"step": 1, "loss": 0.0}\n')
            (run_dir / "other.jsonl").replace(metrics)  # another file in its place
        return rate(step, trainer)

    monkeypatch.setattr(loop, "learning_rate", meddling)
    run(make_config(run_dir, interval=0))
    out = capsys.readouterr().out
    assert f"warning: {metrics} was removed during the run; written again from the run's own record (3 steps)" in out
    assert f"warning: {metrics} was cut short during the run; written again from the run's own record (4 steps)" in out
    assert f"warning: {metrics} was replaced during the run; written again from the run's own record (5 steps)" in out
    assert losses(run_dir) == reference
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS


def test_a_resume_restores_the_metrics_lost_since_from_its_checkpoint(tmp_path, capsys, reference):
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=4, interval=4))
    (run_dir / "metrics.jsonl").unlink()
    capsys.readouterr()
    run(make_config(run_dir, max_steps=STEPS, interval=4))
    copy = run_dir / "checkpoints" / "step_00000004" / "metrics.jsonl"
    assert f"metrics.jsonl: held 0 of steps 1..4; restored them from {copy}" in capsys.readouterr().out
    assert losses(run_dir) == reference
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS


def test_delayed_scaling_resumes_exactly_with_its_amax_histories(tmp_path, capsys):
    """fp8_delayed, 2 micro-batches a step: each weight is quantized in the first only, and the second's amax 0
    leaves its history and scale alone (Transformer Engine's fused update). Resumed from step 2's checkpoint, the
    run continues bit for bit: losses, and the weights, Adam moments, amax histories and scales of step 4."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(make_config(whole, max_steps=4, interval=4, precision="fp8_delayed"))
    run(make_config(split, max_steps=2, interval=2, precision="fp8_delayed"))
    capsys.readouterr()
    run(make_config(split, max_steps=4, interval=2, precision="fp8_delayed"))
    assert "resuming from step 2 of" in capsys.readouterr().out
    assert losses(split) == losses(whole)
    saved = [(d / "checkpoints" / "step_00000004" / "__0_0.distcp").read_bytes() for d in (whole, split)]
    assert saved[0] == saved[1]


def test_only_the_last_checkpoints_are_kept(tmp_path):
    run(make_config(tmp_path / "two", max_steps=5, interval=1, keep_last=2))
    names = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert names == ["owner.json", "step_00000004", "step_00000005"]  # owner.json: whose they are
    run(make_config(tmp_path / "all", max_steps=5, interval=2, keep_last=0))
    names = sorted(p.name for p in (tmp_path / "all" / "checkpoints").iterdir())
    assert names == ["owner.json", "step_00000002", "step_00000004", "step_00000005"]  # and always the last step


def test_a_save_killed_midway_leaves_the_previous_checkpoint_to_resume_from(tmp_path, monkeypatch, capsys, reference):
    run_dir = tmp_path / "run"
    config_path = make_config(run_dir, interval=2)
    save = torch.save

    def dying_save(obj, file, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 4:
            file.write(b"half a checkpoint")
            raise SimulatedKill
        return save(obj, file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", dying_save)
        with pytest.raises(SimulatedKill):
            torch_engine.main([str(config_path)])
    checkpoints = run_dir / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir()]
    assert "step_00000002" in leftovers and "step_00000004" not in leftovers
    assert any(name.startswith("step_00000004.tmp-") for name in leftovers)

    capsys.readouterr()
    run(config_path)
    assert "resuming from step 2 of" in capsys.readouterr().out
    assert losses(run_dir) == reference
    assert sorted(p.name for p in checkpoints.iterdir()) == ["owner.json", "step_00000004", "step_00000006"]


def test_a_checkpoint_of_another_model_is_refused_with_a_clear_message(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=2, interval=2))
    capsys.readouterr()
    assert torch_engine.main([str(make_config(run_dir, max_steps=4, interval=2, num_layers=2))]) == 1
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "model.num_layers=4 in the checkpoint, 2 now" in err
    assert "new run.dir" in err
    assert [s for s, *_ in losses(run_dir)] == [1, 2]  # nothing written by the refused run

    assert torch_engine.main([str(make_config(run_dir, max_steps=1, interval=2))]) == 1
    assert "past trainer.max_steps=1" in capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_refused_before_the_launcher_writes_anything(tmp_path):
    run_dir = tmp_path / "run"
    config_path = make_config(run_dir, max_steps=2, interval=2)
    run(config_path)
    saved_config = config_path.read_text()
    result = launch(tmp_path, tmp_path / "cache", "model.seq_length=64", "data=mock", "model.num_layers=2",
                    "trainer.max_steps=4", f"run.dir={run_dir}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot resume from" in result.stderr and "model.num_layers=4 in the checkpoint, 2 now" in result.stderr
    assert config_path.read_text() == saved_config  # the run's config.yaml is still the checkpoint's
    assert not (run_dir / "overrides.yaml").exists() and not (tmp_path / "runs" / "nemo-run").exists()


def test_a_checkpoint_has_a_manifest_of_its_files_sizes_and_checksums(tmp_path):
    run(make_config(tmp_path / "run", max_steps=2, interval=2))
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    files = json.loads((folder / "manifest.json").read_text())["files"]
    # all but the copy of metrics.jsonl, put beside it once it is published (recipes.trainer.loop.save)
    assert sorted(files) == sorted(p.name for p in folder.iterdir() if p.name not in ("manifest.json", "metrics.jsonl"))
    assert {"checkpoint.pt", ".metadata", "__0_0.distcp"} <= set(files)
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _truncate_shard(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])


def _garbage_state(folder: Path) -> None:
    (folder / "checkpoint.pt").write_bytes(b"not a checkpoint at all" * 10)


def _flipped_byte(folder: Path) -> None:
    """Same size, one byte changed: only the checksum tells."""
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, problem", [
    (_truncate_shard, "__0_0.distcp is 1000 bytes"),
    (_garbage_state, "checkpoint.pt is"),
    (_flipped_byte, "__0_0.distcp does not match its checksum"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys, reference, damage,
                                                                       problem):
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=4, interval=2, keep_last=0))
    checkpoints = run_dir / "checkpoints"
    damage(checkpoints / "step_00000004")
    capsys.readouterr()
    run(make_config(run_dir, max_steps=STEPS, interval=2, keep_last=1))
    out, err = capsys.readouterr()
    assert f"checkpoint {checkpoints / 'step_00000004'} is damaged ({problem}" in out, out
    assert f"falling back to the newest intact checkpoint, {checkpoints / 'step_00000002'}" in out
    assert "resuming from step 2 of" in out and "Traceback" not in out + err
    assert losses(run_dir) == reference  # steps 3 and 4 trained again, exactly
    # The damaged one is kept aside, never read or pruned; keep_last counts intact ones only.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["owner.json", "step_00000004.damaged", "step_00000006"]


def test_when_no_checkpoint_is_intact_the_run_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=2, interval=2))
    _garbage_state(run_dir / "checkpoints" / "step_00000002")
    capsys.readouterr()
    assert torch_engine.main([str(make_config(run_dir, max_steps=4, interval=2))]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no intact checkpoint in") and err.count("\n") == 1, err
    assert "UnpicklingError" not in err and "weights_only" not in err
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()  # nothing moved or deleted


def test_delayed_scaling_state_travels_in_the_checkpoint(tmp_path):
    """Delayed scaling's amax histories and scales are buffers of the FP8 linears, so the model's checkpoint carries
    them: a run resumed at step 2 continues exactly as the uninterrupted one (a fresh history, scale 1, would
    quantize differently). A small model, for the CPU's slow FP8 GEMMs."""
    small = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 kv_channels=16)
    run(make_config(tmp_path / "whole", max_steps=4, interval=0, precision="fp8_delayed", **small))
    run(make_config(tmp_path / "run", max_steps=2, interval=2, precision="fp8_delayed", **small))
    run(make_config(tmp_path / "run", max_steps=4, interval=2, precision="fp8_delayed", **small))
    assert losses(tmp_path / "run") == losses(tmp_path / "whole")


def calls_into(modules: list, action) -> dict[str, list[str]]:
    """The functions of each module that `action` calls from outside that module, in order: where the run's control
    enters it (sys.setprofile sees every Python call; a function's calls within its own module are not entries)."""
    names = {module.__file__: module.__name__ for module in modules}
    entered: dict[str, list[str]] = {name: [] for name in names.values()}

    def profile(frame, event, arg):
        file = frame.f_code.co_filename
        if event == "call" and file in names and frame.f_back.f_code.co_filename != file:
            entered[names[file]].append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return entered


def test_a_resumed_run_enters_each_checkpoint_module_once_to_restore_and_once_to_save(tmp_path):
    """The engine restores and saves through one call each into the shared checkpoint code, which calls the
    engine's checkpoint format once each way: nothing else of the loop or the engine reaches either module."""
    run_dir = tmp_path / "run"
    run(make_config(run_dir, max_steps=2, interval=2))
    resumed = make_config(run_dir, max_steps=4, interval=2)  # from step 2's checkpoint, saving step 4's
    assert calls_into([shared_checkpoints, checkpoint], lambda: run(resumed)) == {
        "recipes.trainer.checkpoints": ["restore", "save"], "recipes.engine.checkpoint": ["read", "write"]}


def test_two_processes_checkpoint_and_resume_exactly_through_torchrun(tmp_path):
    run_dir = tmp_path / "ddp"
    args = [
        "executor.gpus=2", "precision.fp8_param_gather=false", "model.seq_length=64", "data=mock", "trainer.max_steps=4",
        "trainer.checkpoint.interval=2",
        "trainer.checkpoint.keep_last=0", "trainer.min_lr=0.001", "trainer.warmup_steps=0", f"run.dir={run_dir}",
    ]
    cache = tmp_path / "cache"
    first = launch(tmp_path, cache, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    uninterrupted = losses(run_dir)
    assert [s for s, *_ in uninterrupted] == [1, 2, 3, 4]
    rng = torch.load(run_dir / "checkpoints" / "step_00000002" / "checkpoint.pt", weights_only=True)["rng"]
    assert len(rng) == 2  # each rank's RNG state, gathered to the one writer

    # As if killed after step 4's metrics but before its checkpoint: the resumed run redoes steps 3 and 4.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    second = launch(tmp_path, cache, *args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from step 2 of" in second.stdout
    assert losses(run_dir) == uninterrupted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_on_gpu_continues_the_compiled_run(tmp_path, monkeypatch, capsys):
    """On a GPU the blocks are compiled, AdamW is fused, the checkpoint is read straight onto the GPU and the CUDA
    RNG is restored too."""
    run(make_config(tmp_path / "uninterrupted", interval=0, gpu="h200"))
    uninterrupted = losses(tmp_path / "uninterrupted")
    run_dir = tmp_path / "run"
    config_path = make_config(run_dir, gpu="h200")
    with monkeypatch.context() as patch:
        patch_batches(patch, {}, kill_step=5)
        with pytest.raises(SimulatedKill):
            torch_engine.main([str(config_path)])
    capsys.readouterr()
    run(config_path)
    assert "resuming from step 3 of" in capsys.readouterr().out
    resumed = losses(run_dir)
    assert [s for s, *_ in resumed] == list(range(1, STEPS + 1))
    assert resumed[:3] == uninterrupted[:3]
    for (_, loss, grad_norm), (_, loss_ref, grad_norm_ref) in zip(resumed[3:], uninterrupted[3:]):
        assert loss == pytest.approx(loss_ref, rel=1e-6) and grad_norm == pytest.approx(grad_norm_ref, rel=1e-5)

    saved = run_dir / "checkpoints" / "step_00000006" / "checkpoint.pt"
    state = torch.load(saved, map_location="cuda", weights_only=True)
    torch.cuda.manual_seed(7)
    checkpoint.set_rng_state(state["rng"][0], torch.device("cuda"))
    first = torch.rand(4, device="cuda")
    checkpoint.set_rng_state(state["rng"][0], torch.device("cuda"))
    assert torch.equal(torch.rand(4, device="cuda"), first)
