"""This project's run directories (recipes/report/formats/rundir.py), fixtures in tests/fixtures/logs/rundirs/."""

from __future__ import annotations

import pytest

from compare_helpers import FIXTURES, copy_run, read_one


def test_metrics_jsonl_requeue_keeps_last_occurrence():
    run, _ = read_one(FIXTURES / "rundirs/llama3_8b-fp8_current")
    assert [s.step for s in run.steps] == list(range(1, 21))  # 11 and 12 were logged twice: counted once
    step11, step12 = run.steps[10], run.steps[11]
    assert step11.time_s == 5.0 and step11.fresh  # the restart's first step (recompiles): warm-up
    assert step12.loss == pytest.approx(10 - 0.3 * 12 + 0.01)  # not the first attempt's 50.0
    assert any("2 step record(s) logged again" in note for note in run.notes)


def test_a_resume_the_job_log_names_is_the_run_state(tmp_path):
    """The engines cut metrics.jsonl back to the checkpoint on a resume: only train.log (the job's log, gathered
    from Slurm) says the run resumed, in the engines' own words."""
    run_dir = copy_run("llama3_8b-bf16", tmp_path / "run")
    (run_dir / "train.log").write_text("step    10/20 | loss 7.0\nresuming from step 10 of checkpoints/step_00000010\n")
    run, _ = read_one(run_dir)
    assert run.resumed_at == [11]
