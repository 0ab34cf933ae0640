"""NeMo 2 lines and NeMo 1 (Lightning) progress bars (recipes/report/formats/nemo.py), fixtures in
tests/fixtures/logs/{nemo,nemo1,nemo1_cut,nemo1_cut_loss}/."""

from __future__ import annotations

import pytest

from compare_helpers import FIXTURES, approx, csv_by_run, read_one, report
from recipes.report.parse import read_log


def test_nemo2_lines_count_iterations_from_zero():
    read = read_log(FIXTURES / "nemo/llama3_8b_bf16.log", "bf16.log")
    assert read.format == "nemo2"
    assert [s.step for s in read.steps] == list(range(1, 11))  # iteration 0..9 -> steps 1..10
    assert read.steps[0].time_s == 20.0 and read.steps[1].time_s == 2.1
    assert read.steps[0].loss == 11.0 and read.steps[0].global_batch_size == 128


def test_nemo1_progress_bars(tmp_path):
    read = read_log(FIXTURES / "nemo1/log-nemo-megatron-nemotron4_15b_bf16_7001.out", "bf16.out")
    assert read.format == "nemo1" and read.notes == []
    # 100 redraws (each step drawn with the previous step's fields, then its own) and a validation bar: 50 steps
    assert [s.step for s in read.steps] == list(range(1, 51))  # global_step 0..49
    assert (read.steps[0].time_s, read.steps[1].time_s, read.steps[2].time_s) == (30.0, 3.13, 3.15)
    assert read.steps[-1].loss == pytest.approx(6.1)  # `reduced_train_loss=6.100`
    run, _ = read_one(FIXTURES / "nemo1/log-nemo-megatron-nemotron4_15b_fp8_7002.out")
    # the experiment's YAML: `fp8: true` (a NeMo 1 FP8 run names no scaling recipe), 2 nodes of 8 GPUs
    assert (run.meta["precision"], run.meta_origin["precision"], run.meta["world_size"]) == ("fp8", "header", 16)
    status, _ = report(["nemo1"], tmp_path, labels=[f"{FIXTURES / 'nemo1'}:gpu=h100"])
    rows = csv_by_run(tmp_path)
    bf16, fp8 = rows["log-nemo-megatron-nemotron4_15b_bf16_7001"], rows["log-nemo-megatron-nemotron4_15b_fp8_7002"]
    assert (bf16["precision"], bf16["engine"], fp8["baseline"]) == ("bf16", "nemo", bf16["run"])
    # 50 steps, warm-up 5; steps 6..50 are global steps 5..49: 23 odd ones at 3.13 s, 22 even at 3.15 s
    assert bf16["steps_measured"] == "45"
    approx(bf16["median_step_time_s"], 3.13)
    approx(fp8["median_step_time_s"], 2.51)
    approx(fp8["speedup"], 3.13 / 2.51)
    approx(bf16["tokens_per_s_per_gpu"], 64 * 4096 / 16 / 3.13)
    approx(bf16["final_loss"], (6.5 + 6.4 + 6.3 + 6.2 + 6.1) / 5)
    approx(fp8["final_loss"], (6.6 + 6.5 + 6.4 + 6.3 + 6.2) / 5)
    assert status == 0


def test_nemo1_bars_cut_at_the_terminal_width_are_read_from_their_count():
    """tqdm trims each draw to the terminal's width: no global_step, no closing bracket. The bar's count (finished
    steps) gives the step and the cut last field is dropped, never read as a shorter number."""
    read = read_log(FIXTURES / "nemo1_cut/log-nemo-megatron-llama3_8b_bf16_8001.out", "cut.out")
    assert read.format == "nemo1" and read.notes == [] and read.planned_steps == 20
    assert [s.step for s in read.steps] == list(range(1, 21))
    assert [s.time_s for s in read.steps[:3]] == [30.0, 3.13, 3.13]  # each step's own draw, not the previous one's
    assert [s.loss for s in read.steps[:3]] == [11.0, 10.9, 10.8]


def test_a_cut_bar_drops_its_last_field(tmp_path):
    log = tmp_path / "cut.out"
    # `train_step_timing in s=3.130` cut to `=3.1`: read, it would be 3.1 s
    log.write_text("Epoch 0: :  10%|█  | 2/20 [01:00<02:00, reduced_train_loss=10.90, train_step_timing in s=3.1\n")
    read = read_log(log, "cut.out")
    assert [(s.step, s.loss, s.time_s) for s in read.steps] == [(2, 10.9, None)]


def test_a_bar_cut_inside_the_loss_keeps_its_step(tmp_path):
    """Cut inside its last field, the loss, a bar keeps its step (its count) and drops the field: a run whose bars
    reach step 120 of 200 is incomplete at 120, not at the last bar whose loss survived (9)."""
    read = read_log(FIXTURES / "nemo1_cut_loss/log-nemo-megatron-llama3_8b_bf16_8101.out", "cut.out")
    assert read.format == "nemo1" and read.notes == [] and read.planned_steps == 20 * 10
    assert [s.step for s in read.steps] == list(range(1, 121))
    # one-digit counts are cut after the loss's comma, `10/200` and on inside `reduced_train_loss=11.00`
    assert [s.loss for s in read.steps[:10]] == [11.0] * 9 + [None]
    assert all(s.loss is None and s.time_s is None for s in read.steps[9:])
    run, _ = read_one(FIXTURES / "nemo1_cut_loss")
    assert "log-nemo-megatron-llama3_8b_bf16_8101: no loss read from 111 of the 120 record(s)" in run.notes
    report(["nemo1_cut_loss"], tmp_path)
    row = csv_by_run(tmp_path)["log-nemo-megatron-llama3_8b_bf16_8101"]
    assert row["run_state"] == "incomplete: 120 of 200 steps"
    assert row["run_state_source"] == (
        "last record: tests/fixtures/logs/nemo1_cut_loss/log-nemo-megatron-llama3_8b_bf16_8101.out line 241; planned "
        "steps: tests/fixtures/logs/nemo1_cut_loss/log-nemo-megatron-llama3_8b_bf16_8101.out line 241 (record 120/200)")
