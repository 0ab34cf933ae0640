"""Failures of the machine under a training run, each ending in one line that names the cause and the fix, with
nothing half-written left behind: a checkpoint save past the file-size limit or on a full disk (both engines), a
full disk at launch, the run directory removed or moved while the run trains, a link planted under a run's file
name, and any other write the disk refuses. (A second Ctrl-C during a save: tests/test_stopping.py.)

The failures are real: a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored the write that crosses it fails with
EFBIG) on an engine or launcher subprocess, and a full disk on a small tmpfs (ENOSPC). Where this process may not
mount a tmpfs, the file-size limit stands in for the full disk, and the test expects EFBIG instead.

Runs are tiny_llama cut to one small layer, in BF16, on the CPU: its checkpoint is one 2.8 MB shard and small files.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

from recipes.config import CheckpointConfig, load_config
from recipes.engine import torch_engine
from recipes.folders import save_config
from recipes.run_files import LOCK
from recipes.trainer import loop
from recipes.trainer.checkpoints import read_manifest, verify_files
from recipes.trainer.entry import engine_main

from test_checkpoint import make_config
from test_train import REPO, read_metrics

SMALL = dict(num_layers=1, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2, num_query_groups=1,
             kv_channels=64)
FILE_LIMIT = 1 << 20  # bytes: above every file of a run but the checkpoint's shard
EFBIG = "file too large for the file-size limit (ulimit -f) or the filesystem (EFBIG)"
ENOSPC = "no space left on the device (ENOSPC)"


def small_run(run_dir: Path, max_steps: int, checkpoint_dir: Optional[Path] = None, **trainer) -> Path:
    """The config of a run checkpointing every 2 steps, keeping 2 (into `checkpoint_dir` if given)."""
    path = make_config(run_dir, max_steps=max_steps, interval=2, precision="bf16", **SMALL)
    cfg = load_config(path)
    saves = CheckpointConfig(interval=2, keep_last=2, dir=None if checkpoint_dir is None else str(checkpoint_dir))
    save_config(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, checkpoint=saves, **trainer)), path)
    return path


def file_limit(limit: int):
    """A child's preexec: writes past `limit` bytes fail with EFBIG (ignored, SIGXFSZ would kill it instead)."""
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limited


def torch_engine_limited(config: Path, limit: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.engine.torch_engine", str(config)], cwd=REPO,
                          preexec_fn=file_limit(limit), capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Optional[Path]]:
    """A 4 MiB tmpfs (one checkpoint fits, two do not), or None where this process may not mount one."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    yield folder if mounted else None
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Write into `folder` until its filesystem has no room left."""
    with open(folder / "filler", "wb") as file:
        try:
            while True:
                file.write(b"\0" * (1 << 16))
                file.flush()
        except OSError:
            pass
        file.truncate(file.tell())  # what did not fit is dropped


def the_error_line(stderr: str) -> str:
    """The run's one `error:` line; no traceback beside it."""
    assert "Traceback" not in stderr, stderr[-4000:]
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


def assert_intact(folder: Path) -> None:
    files = read_manifest(folder)
    assert files and verify_files(folder, files) == [], folder


def saves(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir() if entry.name.startswith("step_"))


def test_a_save_past_the_file_size_limit_removes_its_folder_and_stops_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    assert torch_engine.main([str(small_run(run_dir, max_steps=2))]) == 0  # step 2's checkpoint
    result = torch_engine_limited(small_run(run_dir, max_steps=4), FILE_LIMIT)  # resumed, and saves step 4
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    line = the_error_line(result.stderr)
    assert line.startswith(f"error: cannot save the checkpoint of step 4 in {checkpoints}: {EFBIG}; "), line
    assert f"the newest complete checkpoint, {checkpoints / 'step_00000002'}, is intact" in line
    assert line.endswith("raise the file-size limit (ulimit -f), or set trainer.checkpoint.dir to a folder on a "
                         "filesystem that takes larger files")
    assert saves(checkpoints) == ["step_00000002"]  # step 4's temporary folder removed
    assert_intact(checkpoints / "step_00000002")
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]  # the steps trained stay recorded


def test_a_save_on_a_full_disk_removes_its_folder_and_stops_in_one_line(tmp_path, small_disk, capsys):
    """Checkpoints on a disk with room for one: step 2's fits, step 4's does not (keep_last=2 keeps step 2 until
    step 4's is complete)."""
    run_dir = tmp_path / "run"
    checkpoints = small_disk or run_dir / "checkpoints"
    assert torch_engine.main([str(small_run(run_dir, max_steps=2, checkpoint_dir=small_disk))]) == 0
    config = small_run(run_dir, max_steps=4, checkpoint_dir=small_disk)
    if small_disk:
        capsys.readouterr()
        assert torch_engine.main([str(config)]) == 1
        line, cause = the_error_line(capsys.readouterr().err), ENOSPC
    else:  # no tmpfs here: the file-size limit fills the disk's part
        line, cause = the_error_line(torch_engine_limited(config, FILE_LIMIT).stderr), EFBIG
    assert line.startswith(f"error: cannot save the checkpoint of step 4 in {checkpoints}: {cause}; "), line
    assert f"the newest complete checkpoint, {checkpoints / 'step_00000002'}, is intact" in line
    if small_disk:
        assert line.endswith("free space there, or set trainer.checkpoint.dir to a folder with room or keep fewer "
                             "checkpoints (trainer.checkpoint.keep_last)")
    assert saves(checkpoints) == ["step_00000002"]
    assert_intact(checkpoints / "step_00000002")
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_a_megatron_save_past_the_file_size_limit_removes_its_folder_and_stops_in_one_line(hydra_compose, tmp_path):
    """megatron-core writes its shards in forked processes and gets back only their messages: the cause is read
    from what the failed save left (a shard at the limit), before that is removed."""
    cfg = hydra_compose("engine=megatron", "precision=bf16", "gpu=h200", "data=mock", "trainer.max_steps=2",
                        "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "trainer.checkpoint.interval=2",
                        f"data.cache_dir={tmp_path / 'cache'}", "dryrun=true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(dataclasses.replace(cfg, dryrun=False), run_dir / "config.yaml")
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=1", str(REPO / "tests" / "megatron_on_cpu.py"),
         str(run_dir / "config.yaml")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
             "LOGLEVEL": "WARNING"},
        preexec_fn=file_limit(5 * FILE_LIMIT), capture_output=True, text=True, timeout=300)  # its shards: 23 MB
    assert result.returncode != 0
    # the worker's traceback would be [rank0]'s; torchrun's own report of a failed worker follows the line
    assert "[rank0]: Traceback" not in result.stderr, result.stderr[-4000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    checkpoints = run_dir / "checkpoints"
    assert line.startswith(f"error: cannot save the checkpoint of step 2 in {checkpoints}: {EFBIG}; "), line
    assert "there is no earlier checkpoint: the same command starts the run over" in line
    assert saves(checkpoints) == []
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


def test_a_full_disk_at_launch_is_one_line_and_leaves_no_lock_file(tmp_path, small_disk):
    """The run directory's lock file is created (that takes no room) and cannot name its holder: the launch stops
    in one line, and the lock file and the run directory it created are gone."""
    run_dir = (small_disk or tmp_path) / "run"
    if small_disk:
        fill(small_disk)
    env = dict(os.environ, FP8_RECIPES_RUNS=str(tmp_path / "runs"), FP8_RECIPES_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "run.py"), "data=mock", "model.seq_length=64", "trainer.max_steps=2",
         f"run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=None if small_disk else file_limit(0))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    cause = ENOSPC if small_disk else EFBIG
    assert the_error_line(result.stderr).startswith(f"error: cannot write {run_dir / LOCK}: {cause}; nothing was "
                                                    "started. To run there, ")
    assert not (run_dir / LOCK).exists() and not run_dir.exists()


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_run_dir_removed_or_moved_mid_run_stops_it_in_one_line_and_is_not_made_again(tmp_path, monkeypatch,
                                                                                         capsys, how):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    config = small_run(run_dir, max_steps=6)
    rate = loop.learning_rate

    def meddling(step: int, trainer):  # at the start of step 4, after step 3's line and step 2's checkpoint
        if step == 4:
            shutil.rmtree(run_dir) if how == "removed" else run_dir.rename(moved)
        return rate(step, trainer)

    monkeypatch.setattr(loop, "learning_rate", meddling)
    assert torch_engine.main([str(config)]) == 1
    line = the_error_line(capsys.readouterr().err)
    assert line == (f"error: run dir {run_dir} disappeared during the run (removed or moved): its record "
                    "(config.yaml, metrics.jsonl, checkpoints) is not there any more, so the run stops rather than "
                    "start a half run dir in its place; if it was moved, the same command with run.dir set to its "
                    "new place resumes from its newest checkpoint")
    assert not run_dir.exists()
    if how == "moved":  # the moved run is whole up to where it stopped
        assert [m["step"] for m in read_metrics(moved)] == [1, 2, 3]
        assert saves(moved / "checkpoints") == ["step_00000002"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "profile/time_rank0.json"])
def test_a_link_planted_under_a_runs_file_name_is_refused_in_one_line_and_never_written_through(tmp_path, capsys,
                                                                                                 name):
    run_dir, target = tmp_path / "run", tmp_path / "elsewhere.txt"
    config = small_run(run_dir, max_steps=2, profile_step=1)
    target.write_text("")  # empty: nothing for a run to read, all the more to write
    link = run_dir / name
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target)
    assert torch_engine.main([str(config)]) == 1
    assert the_error_line(capsys.readouterr().err).startswith(f"error: {link} is a symbolic link, not a file this "
                                                              "run wrote")
    assert target.read_text() == "" and link.is_symlink()


def test_any_other_write_the_disk_refuses_is_one_line_too_and_a_bugs_error_keeps_its_traceback(tmp_path, capsys):
    """A write that no module wrapped (TensorBoard's, the profiler's trace, ...) failing for want of room is one line
    in engine_main; an OSError that says nothing of the machine (a missing file) is not hidden."""
    config = small_run(tmp_path / "run", max_steps=2)

    def failing(error: OSError):
        def train(cfg, run_dir):
            raise error
        return train

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run" / "tensorboard" / "events"))
    assert engine_main("engine", failing(full), [str(config)]) == 1
    assert the_error_line(capsys.readouterr().err) == (
        f"error: training stopped: {ENOSPC} ({full.filename}). To go on, free space there, or move the run directory "
        "to a folder with room; the same command resumes from the newest checkpoint")
    with pytest.raises(FileNotFoundError):
        engine_main("engine", failing(FileNotFoundError(errno.ENOENT, "No such file or directory")), [str(config)])
