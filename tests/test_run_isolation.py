"""A run's files are its own: no run adopts, prunes or clobbers another's; no write goes through a link; no folder a
run writes lies in the checkout's sources; what a run is called and what it reads are what ran.

Engine runs are tiny_llama on the CPU in-process (tests/test_checkpoint.py's make_config); launches go through
launch/run.py as a user runs it (tests/test_launch.py's helpers: a fresh working directory each).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from recipes.config import CheckpointConfig, load_config, load_option
from recipes.engine import torch_engine
from recipes.folders import UnsafeFile, open_append, save_config, write_file
from recipes.trainer.checkpoints import OWNER, CheckpointError, own_checkpoint_dir

from test_checkpoint import make_config
from test_data import write_indexed
from test_launch import REPO, assert_clean_failure, launch, launches_forked
from test_train import read_metrics

TINY = ("model=tiny_llama", "precision=bf16", "model.seq_length=32", "trainer.log_interval=1", "data=mock")


def with_checkpoints(config_path: Path, folder: Path, **changes) -> Path:
    """The config at `config_path`, saving into `folder` (trainer.checkpoint.dir), with trainer fields changed."""
    cfg = load_config(config_path)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, checkpoint=CheckpointConfig(interval=1, keep_last=1, dir=str(folder)), **changes))
    save_config(cfg, config_path)
    return config_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- a checkpoint folder belongs to one run ----


def test_a_second_run_is_refused_another_runs_checkpoint_folder_and_touches_nothing_of_it(tmp_path, capsys):
    shared = tmp_path / "shared"
    first = with_checkpoints(make_config(tmp_path / "a", max_steps=2), shared)
    assert torch_engine.main([str(first)]) == 0
    before = snapshot(shared)
    second = with_checkpoints(make_config(tmp_path / "b", max_steps=4), shared)
    capsys.readouterr()
    assert torch_engine.main([str(second)]) == 1
    err = capsys.readouterr().err
    assert f"holds the checkpoints of the run in {tmp_path / 'a'}" in err and len(err.strip().splitlines()) == 1
    assert snapshot(shared) == before  # neither continued from nor pruned
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # and no step of the refused run
    # The launcher refuses it before it writes a byte, with or without run.overwrite
    for overwrite in ("false", "true"):
        result = launch(tmp_path / f"launch-{overwrite}", *TINY, "trainer.checkpoint.interval=1",
                        f"trainer.checkpoint.dir={shared}", f"run.overwrite={overwrite}")
        assert_clean_failure(result, "holds the checkpoints of the run in")
    assert snapshot(shared) == before


def test_of_runs_started_together_on_one_checkpoint_folder_exactly_one_claims_it(tmp_path):
    shared, outcomes, start = tmp_path / "shared", {}, threading.Barrier(8)
    configs = {i: load_config(with_checkpoints(make_config(tmp_path / f"run{i}"), shared)) for i in range(8)}

    def claim(i: int) -> None:
        start.wait()
        try:
            own_checkpoint_dir(configs[i], tmp_path / f"run{i}")
            outcomes[i] = "claimed"
        except CheckpointError as error:
            outcomes[i] = str(error)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [i for i, outcome in outcomes.items() if outcome == "claimed"]
    assert len(winners) == 1, outcomes
    assert f'"run_dir": "{tmp_path / f"run{winners[0]}"}"' in (shared / OWNER).read_text()
    assert all("holds the checkpoints of the run in" in o for i, o in outcomes.items() if i != winners[0])


def test_run_overwrite_starts_fresh_and_sets_its_checkpoints_elsewhere_aside(tmp_path):
    run_dir, checkpoints = tmp_path / "work" / "run", tmp_path / "ckpt"
    args = (*TINY, f"run.dir={run_dir}", "trainer.checkpoint.interval=1", f"trainer.checkpoint.dir={checkpoints}")
    assert launch(tmp_path / "work", *args, "trainer.max_steps=2").returncode == 0
    result = launch(tmp_path / "again", *args, "trainer.max_steps=3", "run.overwrite=true")
    assert result.returncode == 0, str(result)
    assert f"its checkpoints in {checkpoints} are now in" in result.stdout
    assert "resuming" not in result.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]  # from step 1: nothing continued
    (aside,) = tmp_path.glob("ckpt.replaced-*")
    assert sorted(p.name for p in aside.iterdir()) == [OWNER, "step_00000001", "step_00000002"]  # kept


# ---- the dataset is compared by what it is, not by its path ----


def test_a_resume_reads_the_dataset_it_trained_on_whatever_path_names_it(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for folder in ("one", "two"):  # two datasets of one name, in two folders
        (tmp_path / folder / "data").mkdir(parents=True)
        write_indexed(tmp_path / folder / "data" / "corpus", [[rng.integers(0, 200, 400)] for _ in range(8)])
    config_path = make_config(tmp_path / "run", max_steps=2, interval=1)
    cfg = load_config(config_path)
    indexed = dataclasses.replace(load_option("data", "text"), path=str(tmp_path / "one" / "data" / "corpus"))
    save_config(dataclasses.replace(cfg, data=indexed), config_path)
    assert torch_engine.main([str(config_path)]) == 0

    moved = tmp_path / "moved"  # the same dataset elsewhere: the run continues
    os.rename(tmp_path / "one", moved)
    cfg = load_config(config_path)
    save_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(moved / "data" / "corpus")),
                                    trainer=dataclasses.replace(cfg.trainer, max_steps=3)), config_path)
    capsys.readouterr()
    assert torch_engine.main([str(config_path)]) == 0
    assert "resuming from step 2" in capsys.readouterr().out

    cfg = load_config(config_path)  # another dataset at a path like the first: refused
    save_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "two" / "data" / "corpus")),
                                    trainer=dataclasses.replace(cfg.trainer, max_steps=4)), config_path)
    assert torch_engine.main([str(config_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "its run trained on the dataset" in err and "data.path" in err
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_relative_paths_are_stored_absolute_from_the_launch_folder(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "here" / "data").mkdir(parents=True)
    write_indexed(tmp_path / "here" / "data" / "corpus", [[rng.integers(0, 200, 400)] for _ in range(8)])
    result = launch(tmp_path / "here", "model=tiny_llama", "precision=bf16", "model.seq_length=32",
                    "data.path=data/corpus", "executor.nemo_run_home=nr", "run.dir=run", "dryrun=true")
    assert result.returncode == 0, str(result)
    cfg = load_config(tmp_path / "here" / "run" / "config.yaml")
    assert cfg.data.path == str(tmp_path / "here" / "data" / "corpus")
    assert cfg.executor.nemo_run_home == str(tmp_path / "here" / "nr")
    assert Path(cfg.run.root).is_absolute() and Path(cfg.data.cache_dir).is_absolute()


# ---- writes never go through a link; dry runs never into a run ----


def test_write_file_and_open_append_refuse_links_fifos_and_folders(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name, kind in (("link", "a symbolic link"), ("fifo", "a FIFO"), ("folder", "a folder")):
        with pytest.raises(UnsafeFile, match=kind):
            write_file(tmp_path / name, "x")
        with pytest.raises(UnsafeFile, match=kind):
            open_append(tmp_path / name)
    assert target.read_text() == "keep"
    write_file(tmp_path / "new", "one")
    write_file(tmp_path / "new", "two")  # a regular file is replaced whole
    assert (tmp_path / "new").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo", "folder", "link", "new", "outside.txt"]  # no temporary file left


def test_planted_links_and_finished_runs_are_never_written_by_a_launch(tmp_path):
    finished = tmp_path / "finished" / "run"
    assert launch(tmp_path / "finished", *TINY, "trainer.max_steps=1", f"run.dir={finished}").returncode == 0
    record = snapshot(finished)
    outside = tmp_path / "outside.yaml"
    outside.write_text("not yours\n")
    conf_before = (REPO / "conf" / "config.yaml").read_bytes()
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "config.yaml").symlink_to(outside)
    (planted / "overrides.yaml").symlink_to(REPO / "conf" / "config.yaml")
    results = launches_forked({
        "dry run into a finished run": (tmp_path / "c1", (*TINY, f"run.dir={finished}", "dryrun=true")),
        "dry run over planted links": (tmp_path / "c2", (*TINY, f"run.dir={planted}", "dryrun=true")),
        "run over planted links": (tmp_path / "c3", (*TINY, f"run.dir={planted}", "trainer.max_steps=1")),
    })
    assert "holds a run" in results["dry run into a finished run"].stderr
    for result in results.values():
        assert result.returncode == 1 and "Traceback" not in result.output, str(result)
        assert len(result.stderr.strip().splitlines()) == 1, str(result)
    assert "holds symbolic links (config.yaml, overrides.yaml)" in results["dry run over planted links"].stderr
    assert snapshot(finished) == record
    assert outside.read_text() == "not yours\n" and (REPO / "conf" / "config.yaml").read_bytes() == conf_before


# ---- folders a run writes: outside the sources; names: what ran ----


def test_folders_in_the_sources_names_that_lie_and_chdir_are_refused_in_one_line(tmp_path):
    sources = REPO / "recipes" / "ckpt-test"
    cases = {
        "checkpoints in recipes/": (("trainer.checkpoint.interval=1", f"trainer.checkpoint.dir={sources}"),
                                    "trainer.checkpoint.dir=" + str(sources) + " is inside this checkout's source "
                                    "folder recipes/"),
        "nemo-run home in conf/": ((f"executor.nemo_run_home={REPO / 'conf' / 'nr'}",),
                                   "executor.nemo_run_home=" + str(REPO / "conf" / "nr") + " is inside"),
        "cache in the run dir": (("data=text", "data.cache_dir=${run.dir}/cache"), "is inside the run directory"),
        "cache in the checkout": (("data=text", f"data.cache_dir={REPO}"), "holds this checkout"),
        "chdir": (("hydra.job.chdir=true",), "hydra.job.chdir: the launch stays in the folder"),
        "recipe under another name": (("precision=fp8_current", "precision.recipe=bf16"),
                                      "the run would be reported as fp8_current; choose the option of that recipe "
                                      "(precision=bf16)"),
        "model name": (("model.name=llama3_70b",), "model.name is the name of the model option chosen"),
        "gpu name": (("gpu.name=h200",), "gpu.name is the name of the gpu option chosen"),
    }
    results = launches_forked({name: (tmp_path / name.replace(" ", "_").replace("/", ""),
                                      (*TINY, "trainer.max_steps=1", *args))
                               for name, (args, _) in cases.items()})
    for name, (_, message) in cases.items():
        assert_clean_failure(results[name], message)
        assert len(results[name].stderr.strip().splitlines()) == 1, str(results[name])
    assert not sources.exists()
