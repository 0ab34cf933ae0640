"""scripts/compare.py and recipes.report: every input format, broken logs, golden numbers, alarms, outputs.

The fixtures under tests/fixtures/logs are small hand-made files. Expected numbers below are worked out by hand
from how the fixtures were written (comments say how), never by calling the code under test.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from compare_helpers import FIXTURES, REPO, SCRIPT, approx, copy_run, csv_by_run, quiet, read_one, report
from recipes.report import build_report, metadata
from recipes.report.inputs import find_sources, read_source
from recipes.report.parse import read_log, read_metrics_jsonl
from recipes.report.table import compare

NEMO_LABEL = f"{FIXTURES / 'nemo'}:gpu=b200,nodes=1,gpus=8,tp=1,pp=1,cp=1,vp=1,mbs=2,gbs=128,seq=8192"


def load_cli():
    spec = importlib.util.spec_from_file_location("compare_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ---- each input format ----


def test_megatron_lines_and_argument_header():
    read = read_log(FIXTURES / "megatron/log-nemotron4_15b_h100_8nodes_bf16_2001_0.out", "bf16.out")
    assert read.format == "megatron"
    assert [s.step for s in read.steps] == list(range(10, 101, 10))
    assert read.steps[1].time_s == pytest.approx(2.0)  # 2000.0 ms
    assert read.steps[1].tflops_per_gpu == 400.0
    assert read.steps[1].global_batch_size == 256
    assert read.steps[-1].loss == pytest.approx(5.0)
    assert read.steps[0].fresh and not read.steps[1].fresh
    assert read.header == {
        "bf16": True,
        "cp": 1,
        "dp": 32,
        "fp8": "none",
        "fp8_recipe": "delayed",
        "gbs": 256,
        "mbs": 2,
        "pp": 1,
        "seed": 1234,
        "seq": 4096,
        "tp": 2,
        "vp": 1,
        "world_size": 64,
    }
    assert read.notes == []


def test_nemo2_lines_count_iterations_from_zero():
    read = read_log(FIXTURES / "nemo/llama3_8b_bf16.log", "bf16.log")
    assert read.format == "nemo2"
    assert [s.step for s in read.steps] == list(range(1, 11))  # iteration 0..9 -> steps 1..10
    assert read.steps[0].time_s == 20.0 and read.steps[1].time_s == 2.1
    assert read.steps[0].loss == 11.0 and read.steps[0].global_batch_size == 128


def test_metrics_jsonl_requeue_keeps_last_occurrence():
    run, _ = read_one(FIXTURES / "rundirs/llama3_8b-fp8_current")
    assert [s.step for s in run.steps] == list(range(1, 21))  # 11 and 12 were logged twice: counted once
    step11, step12 = run.steps[10], run.steps[11]
    assert step11.time_s == 5.0 and step11.fresh  # the restart's first step (recompiles): warm-up
    assert step12.loss == pytest.approx(10 - 0.3 * 12 + 0.01)  # not the first attempt's 50.0
    assert any("2 step record(s) logged again" in note for note in run.notes)


def test_slurm_requeue_newest_restart_wins():
    sources, _ = find_sources([str(FIXTURES / "megatron")], REPO)
    fp8 = next(s for s in sources if "fp8cs" in s.name)
    assert [p.name for p in fp8.paths] == [
        "log-nemotron4_15b_h100_8nodes_fp8cs_3001_0.out",
        "log-nemotron4_15b_h100_8nodes_fp8cs_3001_1.out",
    ]
    run, _ = read_source(fp8, [], REPO)
    assert [s.step for s in run.steps] == list(range(10, 101, 10))
    step50, step60 = run.steps[4], run.steps[5]
    assert step50.time_s == 8.0 and step50.fresh  # restart 1's first interval, not restart 0's 1.5 s
    assert step60.loss == pytest.approx(10 - 0.05 * 60 + 0.02)  # not restart 0's 7.77
    assert any("2 step record(s) logged again" in note for note in run.notes)


def test_megatron_bridge_log_uses_the_config_that_ran_and_pairs_its_step_time_lines():
    run, _ = read_one(FIXTURES / "bridge/pretrain_llama3_8b_run1.log")
    # the recipe's defaults (512 / 8192 / 1234, CP 2) were printed first; the merged config that ran, 8 / 4096 / 42
    assert (run.meta["gbs"], run.meta["seq"], run.meta["seed"], run.meta["cp"], run.meta["mbs"]) == (8, 4096, 42, 1, 1)
    # `fp8: null` beside `fp8_recipe: delayed` (Transformer Engine's default) is a BF16 run, not fp8_delayed
    assert (run.meta["precision"], run.meta_origin["precision"]) == ("bf16", "header")
    assert [s.step for s in run.steps] == [5, 10, 15, 20, 25, 30]
    # each `Step Time : 2.00s GPU utilization: 400.0MODEL_TFLOP/s/GPU` line joins the iteration line after it
    assert [s.tflops_per_gpu for s in run.steps] == [66.7, 400.0, 398.0, 400.0, 398.0, 400.0]
    fp8, _ = read_one(FIXTURES / "bridge/pretrain_llama3_8b_run2.log")
    # a preset naming FP8 current scaling, and the setup's summary `fp8: 'hybrid'`, `fp8_recipe: 'tensorwise'`
    assert fp8.meta["precision"] == "fp8_current"
    # interval 20's throughput line came after its iteration line: paired all the same
    assert [s.tflops_per_gpu for s in fp8.steps] == [66.7, 533.3, 529.8, 533.3, 529.8, 533.3]
    assert not [note for note in run.notes + fp8.notes if "Step Time" in note]


def test_step_time_line_with_another_step_time_is_not_paired(tmp_path):
    log = tmp_path / "bridge.log"
    line = FIXTURES.joinpath("bridge/pretrain_llama3_8b_run1.log").read_text().splitlines()
    iteration = next(text for text in line if "iteration       10/" in text)  # 2000.0 ms
    log.write_text("Step Time : 3.00s GPU utilization: 266.7MODEL_TFLOP/s/GPU\n" + iteration + "\n")
    read = read_log(log, "bridge.log")
    assert read.steps[0].tflops_per_gpu is None
    assert read.notes == ["bridge.log: 1 'Step Time' line(s) not paired with an iteration line of the same step time: "
                          "their TFLOP/s not used"]


def test_bridge_speedup_names_the_unknown_field_and_the_label_that_supplies_it(tmp_path):
    status, results = report(["bridge"], tmp_path / "a")
    rows = csv_by_run(tmp_path / "a")
    fp8, bf16 = rows["pretrain_llama3_8b_run2"], rows["pretrain_llama3_8b_run1"]
    assert fp8["speedup"] == "" and fp8["baseline"] == "" and bf16["baseline"] == ""  # run names only, or nothing
    target = "tests/fixtures/logs/bridge/pretrain_llama3_8b_run{}.log:gpu=GPU"
    assert fp8["note"] == (
        "speedup missing: gpu unknown here and on BF16 run pretrain_llama3_8b_run1; supply it with "
        f"--label {target.format(2)} --label {target.format(1)}"
    )
    assert fp8["note"] in (tmp_path / "a" / "report.md").read_text()
    status, results = report(["bridge"], tmp_path / "b", labels=[f"{FIXTURES / 'bridge'}:gpu=h100"])
    rows = csv_by_run(tmp_path / "b")
    fp8, bf16 = rows["pretrain_llama3_8b_run2"], rows["pretrain_llama3_8b_run1"]
    # 30 steps, warm-up 3 and the first interval (5); intervals 10..30 at 2000/2010/2000/2010/2000 ms (FP8 1500/1510)
    assert (fp8["steps_measured"], fp8["baseline"], fp8["note"]) == ("25", "pretrain_llama3_8b_run1", "")
    approx(bf16["median_step_time_s"], 2.0)
    approx(fp8["median_step_time_s"], 1.5)
    approx(fp8["speedup"], 2.0 / 1.5)
    approx(bf16["tflops_per_gpu"], 400.0)
    approx(fp8["tflops_per_gpu"], 533.3)
    approx(bf16["final_loss"], 11.0 - 0.1 * 30)  # the last 3 steps: interval 30 alone
    approx(fp8["final_loss"], 11.0 - 0.1 * 30 + 0.02)
    assert status == 0


def test_megatron_deepspeed_lm_loss_and_its_argument_dump():
    run, _ = read_one(FIXTURES / "deepspeed/megatron_deepspeed_llama3_8b.log")
    assert [s.step for s in run.steps] == list(range(10, 101, 10))
    assert run.steps[0].loss == pytest.approx(8.6)  # `lm-loss: 8.600000E+00`
    # --fp8-e4m3 and --fp8-hybrid False with --bf16; Megatron's world size (8), not DeepSpeed's data-parallel one (4)
    assert (run.meta["precision"], run.meta["world_size"], run.meta["tp"]) == ("bf16", 8, 2)
    assert not [note for note in run.notes if "no loss" in note]


def test_megatron_deepspeed_golden_numbers(tmp_path):
    report(["deepspeed"], tmp_path)
    row = csv_by_run(tmp_path)["megatron_deepspeed_llama3_8b"]
    # 100 steps: warm-up 10 and the first interval; intervals 20..100: five at 1000 ms, four at 1024 ms
    assert row["steps_measured"] == "90"
    approx(row["median_step_time_s"], 1.0)
    # its own tokens per GPU per second, of 2000-token sequences: not 256 * 2048 / 8 from the arguments
    approx(row["tokens_per_s_per_gpu"], 256 * 2000 / 8 / 1.0)
    # its own TFLOPs (150000 / ms): no recomputation in its arguments, so model FLOPs by its formula, and said so
    approx(row["tflops_per_gpu"], 150.0)
    approx(row["final_loss"], 9.0 - 0.04 * 100)
    assert "TFLOP/s/GPU are Megatron-DeepSpeed's own" in (tmp_path / "report.md").read_text()


def test_fp8_only_where_the_log_says_it_is_on(tmp_path):
    iteration = " iteration       10/     100 | elapsed time per iteration (ms): 1000.0 | lm loss: 2.0 |\n"
    echoed = tmp_path / "echoed_llama3_8b.log"
    echoed.write_text("+ torchrun pretrain_gpt.py --bf16 --fp8-format hybrid --fp8-recipe tensorwise --seed 7\n" + iteration)
    assert read_one(echoed)[0].meta["precision"] == "fp8_current"
    recipe_only = tmp_path / "recipe_only_llama3_8b.log"
    recipe_only.write_text("fp8_recipe: delayed\nbf16: true\n" + iteration)  # TE's default recipe, FP8 never switched on
    run, _ = read_one(recipe_only)
    assert "precision" not in run.meta
    assert compare([run])[0].note.startswith("no speedup: precision unknown")


def test_a_loss_under_another_name_is_reported_not_guessed(tmp_path):
    log = tmp_path / "custom.log"
    log.write_text(" iteration       10/     100 | elapsed time per iteration (ms): 1000.0 | lm_loss: 2.0 |\n"
                   " iteration       20/     100 | elapsed time per iteration (ms): 1000.0 | lm_loss: 1.9 |\n")
    run, _ = read_one(log)
    assert [s.loss for s in run.steps] == [None, None]
    assert "custom: no loss read from any record(s) (its records name lm_loss, none of which is the training loss)" \
        in run.notes


def test_a_step_time_missing_from_some_records_is_reported(tmp_path):
    log = tmp_path / "untimed.log"
    log.write_text(" iteration       10/     100 | elapsed time per iteration (ms): 1000.0 | lm loss: 2.0 |\n"
                   " iteration       20/     100 | elapsed time per iteration (ms): n/a | lm loss: 1.9 |\n"
                   " iteration       30/     100 | lm loss: 1.8 |\n")
    run, _ = read_one(log)
    # a value that is no number drops its line, saying so; a record without the field is kept, and noted
    assert [(s.step, s.time_s) for s in run.steps] == [(10, 1.0), (30, None)]
    assert any(note.endswith("skipped 1 line (2): unreadable step time") for note in run.notes), run.notes
    assert "untimed: no step time read from 1 of the 2 record(s)" in run.notes


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


# ---- metadata ----


def test_metadata_precedence_label_config_header_file_name():
    layers = [
        ("label", {"gpu": "gb200"}),
        ("config", {"gpu": "h200", "tp": 4}),
        ("header", {"tp": 8, "vp": 5, "gpu": "h100"}),
        ("file name", {"tp": 2, "vp": 3, "model": "llama3_70b", "gpu": "b200"}),
    ]
    meta, origin = metadata.merge(layers)
    assert (meta["gpu"], meta["tp"], meta["vp"], meta["model"]) == ("gb200", 4, 5, "llama3_70b")
    assert (origin["gpu"], origin["tp"], origin["vp"], origin["model"]) == ("label", "config", "header", "file name")
    assert meta["params"] == 70_553_706_496  # REFERENCE.md section 2, from conf/model's dimensions
    assert "precision" not in meta  # nobody said: stays unknown


def test_file_name_tokens():
    meta, notes = metadata.from_file_name("pretrain_llama3_8b_fp8cs_h100_8nodes_tp1_pp1_cp2_vp1_1mbs_128gbs")
    assert meta == {
        "model": "llama3_8b",
        "precision": "fp8_current",
        "gpu": "h100",
        "nodes": 8,
        "tp": 1,
        "pp": 1,
        "cp": 2,
        "vp": 1,
        "mbs": 1,
        "gbs": 128,
    }
    for name, precision in [
        ("x_fp8ds", "fp8_delayed"),
        ("x_fp8ss", "fp8_blockwise"),
        ("x-fp8mx", "mxfp8"),
        ("x.fp8", "fp8"),
        ("llama3_70b-fp8_blockwise", "fp8_blockwise"),
        ("bf16", "bf16"),
    ]:
        assert metadata.from_file_name(name)[0]["precision"] == precision
    meta, notes = metadata.from_file_name("llama3_8b_bf16_vs_fp8cs")
    assert "precision" not in meta and "several precisions" in notes[0]


def test_experiment_folder_config_beside_log_and_label_override(tmp_path):
    status, results = report(["experiment"], tmp_path, labels=[f"{FIXTURES}/experiment/*/fp8_current:gpu=gb200"])
    by_name = {r.run.name: r for r in results}
    bf16 = by_name["log-llama3_70b_h100_tp8_bf16_4001"]
    fp8 = by_name["log-llama3_70b_h100_tp8_fp8_current_4002"]
    # config.yaml beside the log beats the file name (h100, tp8); the header fills what the config lacks (vp, dp)
    assert (bf16.meta["gpu"], bf16.meta["tp"], bf16.meta["pp"], bf16.meta["vp"], bf16.meta["dp"]) == (
        "h200",
        4,
        4,
        5,
        4,
    )
    assert bf16.run.meta_origin["vp"] == "header" and bf16.run.meta_origin["gpu"] == "config"
    assert fp8.meta["gpu"] == "gb200" and fp8.run.meta_origin["gpu"] == "label"
    # now on another GPU than the only BF16 run: no baseline, shown as missing, never guessed
    assert fp8.baseline is None and fp8.speedup is None
    assert csv_by_run(tmp_path)[fp8.run.name]["speedup"] == ""
    assert status == 0


# ---- broken logs: never a crash, skipped lines listed ----


def test_truncated_log_skips_the_cut_line():
    read = read_log(FIXTURES / "broken/truncated.log", "truncated.log")
    assert [s.step for s in read.steps] == [10, 20, 30, 40, 50]
    assert read.notes == ["truncated.log: skipped 1 line (6): cut off (no newline at the end of the file)"]


def test_interleaved_line_is_skipped_not_misread():
    read = read_log(FIXTURES / "broken/interleaved.log", "interleaved.log")
    assert [s.step for s in read.steps] == [10, 20, 40, 50]
    assert "two records on one line" in read.notes[0]


def test_garbled_log():
    read = read_log(FIXTURES / "broken/garbled.log", "garbled.log")
    assert [s.step for s in read.steps] == [10, 40, 50]
    notes = " ".join(read.notes)
    assert "unreadable loss" in notes and "unreadable step time" in notes and "neither a loss nor a step time" in notes


def test_empty_and_bad_metrics_files():
    assert read_log(FIXTURES / "broken/empty.log", "empty.log").notes == ["empty.log: empty file"]
    read = read_metrics_jsonl(FIXTURES / "broken/bad_metrics/metrics.jsonl", "m")
    assert [s.step for s in read.steps] == [1, 2, 3]
    notes = " ".join(read.notes)
    for reason in ("not valid JSON", "no positive integer 'step'", "unreadable loss", "cut off"):
        assert reason in notes


def test_mixed_units_are_seconds():
    read = read_log(FIXTURES / "broken/mixed_units.log", "mixed.log")
    # Megatron lines in ms (1200.0), NeMo lines in s (1.2) and one value with its own unit (1200ms)
    assert [s.step for s in read.steps] == [10, 20, 30, 40, 50, 60, 70]
    assert all(s.time_s == pytest.approx(1.2) for s in read.steps)


def test_broken_inputs_give_a_report_listing_what_was_skipped(tmp_path):
    status, results = report(["broken"], tmp_path)
    assert status == 1  # nan_megatron.log holds a NaN loss
    text = (tmp_path / "report.md").read_text()
    assert ("truncated: no speedup: precision unknown (nothing read says whether FP8 was on); supply it with "
            "--label tests/fixtures/logs/broken/truncated.log:precision=PRECISION") in text
    for reason in ("empty file", "cut off", "two records on one line", "unreadable loss", "not valid JSON"):
        assert reason in text
    assert {r.run.name for r in results} == {
        "garbled",
        "interleaved",
        "nan_megatron",
        "truncated",
        "mixed_units",
        "bad_metrics",
    }
    row = csv_by_run(tmp_path)["truncated"]
    assert row["model"] == "" and row["gpu"] == "" and row["precision"] == ""  # nothing says: the one missing code


# ---- golden table ----


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden")
    status, results = report(
        ["rundirs", "megatron", "nemo"], out, labels=[NEMO_LABEL], gemm_csv=str(FIXTURES / "gemm.csv")
    )
    return status, out, csv_by_run(out)


def test_golden_run_directories(golden):
    status, _, rows = golden
    assert status == 0
    bf16, fp8 = rows["llama3_8b-bf16"], rows["llama3_8b-fp8_current"]
    # 20 steps: warm-up = max(1, 20 // 10) = 2 steps; steps 3..20 alternate 1.00 s (odd) and 1.02 s (even)
    assert (bf16["steps_measured"], bf16["warmup_steps"], bf16["world_size"], bf16["tp"], bf16["dp"]) == (
        "18",
        "2",
        "8",
        "1",
        "8",
    )
    approx(bf16["median_step_time_s"], (1.00 + 1.02) / 2)
    approx(bf16["tokens_per_s_per_gpu"], (128 * 8192 / 8 / 1.00 + 128 * 8192 / 8 / 1.02) / 2)
    approx(bf16["tflops_per_gpu"], (400 + 400 / 1.02) / 2)
    approx(bf16["mfu"], (400 + 400 / 1.02) / 2 / 989)
    approx(bf16["final_loss"], ((10 - 0.3 * 19) + (10 - 0.3 * 20)) / 2)  # mean of the last 2 steps: 4.15
    assert bf16["speedup"] == "" and bf16["params"] == "8030261248"
    # FP8: steps 11-12 redone after a requeue; the restart's step 11 (5.0 s) is warm-up; 8 x 0.80 s + 9 x 0.82 s
    assert fp8["steps_measured"] == "17" and fp8["baseline"] == "llama3_8b-bf16"
    approx(fp8["median_step_time_s"], 0.82)
    approx(fp8["tokens_per_s_per_gpu"], 128 * 8192 / 8 / 0.82)
    approx(fp8["speedup"], 1.01 / 0.82)
    approx(fp8["final_loss"], 4.16)
    approx(fp8["loss_gap_vs_bf16"], (4.16 - 4.15) / 4.15)
    assert fp8["flag"] == ""


def test_golden_megatron_logs_with_requeue(golden):
    _, _, rows = golden
    bf16 = rows["log-nemotron4_15b_h100_8nodes_bf16_2001"]
    fp8 = rows["log-nemotron4_15b_h100_8nodes_fp8cs_3001"]
    assert (bf16["model"], bf16["gpu"], bf16["nodes"], bf16["engine"], bf16["precision"]) == (
        "nemotron4_15b",
        "h100",
        "8",
        "megatron",
        "bf16",
    )
    assert (fp8["precision"], fp8["tp"], fp8["dp"], fp8["mbs"], fp8["gbs"], fp8["seq"]) == (
        "fp8_current",
        "2",
        "32",
        "2",
        "256",
        "4096",
    )
    # BF16: intervals 20..100 (9 of 10 steps each): five at 2000 ms, four at 2010 ms
    assert bf16["steps_measured"] == "90"
    approx(bf16["median_step_time_s"], 2.0)
    approx(bf16["tokens_per_s_per_gpu"], 256 * 4096 / 64 / 2.0)
    approx(bf16["tflops_per_gpu"], 400.0)
    approx(bf16["mfu"], 400.0 / 989)
    # FP8: restart 0 logged 10..60, restart 1 redid 50..100 (its 50 is warm-up): 20,30,40,60..100 -> 80 steps
    assert fp8["steps_measured"] == "80"
    approx(fp8["median_step_time_s"], 1.6)
    approx(fp8["tokens_per_s_per_gpu"], 256 * 4096 / 64 / 1.6)
    approx(fp8["tflops_per_gpu"], 500.0)
    approx(fp8["speedup"], 2.0 / 1.6)
    approx(fp8["final_loss"], 5.02)
    approx(fp8["loss_gap_vs_bf16"], 0.02 / 5.0)
    assert fp8["flag"] == ""  # restart 0's stale 7.77 losses at 50 and 60 were replaced


def test_golden_nemo_logs_with_labels(golden):
    _, _, rows = golden
    bf16, mx = rows["llama3_8b_bf16"], rows["llama3_8b_fp8mx"]
    assert (mx["gpu"], mx["precision"], mx["engine"], mx["world_size"]) == ("b200", "mxfp8", "nemo", "8")
    # 10 steps, warm-up 1; steps 2..10: odd iterations 1.7 s (x5), even 1.6 s (x4); BF16 2.1 / 2.0 s
    approx(bf16["median_step_time_s"], 2.1)
    approx(mx["median_step_time_s"], 1.7)
    approx(mx["speedup"], 2.1 / 1.7)
    approx(mx["tokens_per_s_per_gpu"], 128 * 8192 / 8 / 1.7)
    assert mx["tflops_per_gpu"] == "" and mx["mfu"] == ""  # NeMo lines carry no FLOPs: unknown, not guessed


def test_golden_markdown_table(golden):
    _, out, _ = golden
    text = (out / "report.md").read_text()
    assert (
        "| llama3_8b-fp8_current | llama3_8b | h100 | 1 | 8 | torch | fp8_current | TP1 PP1 CP1 VP1 DP8 | 1/128 | "
        "8192 | resumed at step 11 | 17 | 0.82 | 159,844 | 487.8 | 49.3% | 1.23x | 14,451 (mbridge-25.11, H100 x8 FP8-CS) "
        "| 11.06 | 4.1600 | +0.24% |  |"
    ) in text
    assert "| complete | 18 | 1.01 | 129,787 | 396.1 | 40.0% | baseline | none published | n/a | 4.1500 | baseline |" in text
    assert "max(1, N // 10)" in text  # the warm-up rule is stated


def test_gemm_csv(golden):
    _, out, _ = golden
    text = (out / "report.md").read_text()
    assert f"| sweep 8192x8192 | 1024 | 1.00x (628) | {1003 / 628:.2f}x (1003) |" in text
    assert "skipped 1 row(s)" in text


# ---- divergence alarm and exit status ----


def test_divergence_alarm_and_tolerance(tmp_path):
    status, results = report(["rundirs/llama3_8b-bf16", "diverged"], tmp_path / "a")
    delayed = next(r for r in results if r.meta["precision"] == "fp8_delayed")
    # last window (steps 19-20): (5.2 + 5.0) / 2 = 5.1 against BF16's 4.15
    assert status == 1 and delayed.max_loss_gap == pytest.approx(5.1 / 4.15 - 1)
    assert "diverged" in delayed.flags[0]
    assert "diverged" in csv_by_run(tmp_path / "a")["llama3_8b-fp8_delayed"]["flag"]
    status, _ = report(["rundirs/llama3_8b-bf16", "diverged"], tmp_path / "b", loss_tolerance=0.25)
    assert status == 0


def test_nan_loss_is_flagged(tmp_path):
    status, results = report(["rundirs/llama3_8b-bf16", "nan"], tmp_path)
    blockwise = next(r for r in results if r.meta["precision"] == "fp8_blockwise")
    assert status == 1 and blockwise.flags == ["NaN/inf loss from step 15"]
    assert "NaN/inf loss from step 15" in (tmp_path / "report.md").read_text()


def test_cli_exit_status(tmp_path):
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), "no/such/run", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no/such/run: no such file or directory" in missing.stderr
    flagged = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(FIXTURES / "rundirs/llama3_8b-bf16"),
            str(FIXTURES / "nan"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert flagged.returncode == 1 and "FLAGGED" in flagged.stderr


def test_cli_usage_errors(tmp_path):
    cli = load_cli()
    run_dir = str(FIXTURES / "rundirs/llama3_8b-bf16")
    assert cli.main([run_dir, "--out", str(tmp_path), "--label", "nonsense"]) == 2
    assert cli.main([run_dir, "--out", str(tmp_path), "--label", f"{run_dir}:colour=red"]) == 2
    assert cli.main([run_dir, "--out", str(tmp_path), "--label", "nothing/here:gpu=h100"]) == 2
    assert cli.main([run_dir, "--out", str(tmp_path), "--gemm", "missing.csv"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main([run_dir])  # no --out
    assert exit_info.value.code == 2


@pytest.mark.parametrize("kind", ["empty file", "binary file", "empty folder"])
def test_nothing_usable_exits_2_and_writes_no_report(tmp_path, kind):
    inputs = tmp_path / "in"
    inputs.mkdir()
    given = inputs if kind == "empty folder" else inputs / "x.log"
    if kind == "empty file":
        given.write_text("")
    elif kind == "binary file":
        given.write_bytes(bytes(range(256)) * 64)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(SCRIPT), str(given), "--out", str(out)], capture_output=True,
                            text=True)
    assert result.returncode == 2, result.stderr
    assert "no usable run" in result.stderr and "no report written" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    if kind == "empty file":
        assert "empty file" in result.stderr  # the reason, printed since no report holds it


def test_a_folder_report_reads_only_the_run_directories_inside_it(tmp_path):
    """nemo-run's record of a run whose run.dir lies outside the folder given points at it: not read, noted."""
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    copy_run("llama3_8b-bf16", runs / "a-bf16")
    outside = copy_run("llama3_8b-fp8_current", elsewhere / "b-fp8")
    task = runs / "nemo-run" / "experiments" / "b" / "b_1" / "main"
    (task / "configs").mkdir(parents=True)
    (task / "configs" / "main_config.yaml").write_text(yaml_dump({"args": [str(outside / "config.yaml")]}))
    (task / "log-main.out").write_text("iteration 1/ 20 | lm loss: 2.0 |\n")
    logs: list[str] = []
    status, results = build_report([str(runs)], tmp_path / "out", base=tmp_path, log=logs.append)
    assert [r.run.paths for r in results] == [[runs / "a-bf16"]]
    assert "outside" in (tmp_path / "out" / "report.md").read_text()


def yaml_dump(data) -> str:
    import yaml

    return yaml.safe_dump(data)


def test_a_run_is_paired_only_with_a_bf16_run_of_the_same_planned_length(tmp_path):
    copy_run("llama3_8b-bf16", tmp_path / "bf16-short", max_steps=5, steps=5)
    copy_run("llama3_8b-fp8_current", tmp_path / "fp8-long")
    results = {r.run.name: r for r in build_report([str(tmp_path)], tmp_path / "out", base=tmp_path, log=quiet)[1]}
    assert results["fp8-long"].baseline is None
    assert "steps 20 here, 5 on BF16 run bf16-short" in results["fp8-long"].note
    copy_run("llama3_8b-bf16", tmp_path / "bf16-long")
    results = {r.run.name: r for r in build_report([str(tmp_path)], tmp_path / "out", base=tmp_path, log=quiet)[1]}
    assert results["fp8-long"].baseline.run.name == "bf16-long"


def test_loss_curve_legend_has_no_two_entries_alike(tmp_path):
    from recipes.report import plots

    copy_run("llama3_8b-bf16", tmp_path / "in" / "bf16")
    for n in range(3):
        copy_run("llama3_8b-fp8_current", tmp_path / "in" / f"fp8-{n}")
    results = build_report([str(tmp_path / "in")], tmp_path / "out", base=tmp_path, log=quiet)[1]
    baseline = next(r for r in results if r.is_bf16)
    others = [r for r in results if r.baseline is baseline]
    assert len(others) == 3
    labels = plots._legend_labels(others)
    assert sorted(labels.values()) == [f"fp8_current (fp8-{n})" for n in range(3)]


# ---- outputs ----


def test_every_loss_curve_has_its_points_as_csv(golden):
    _, out, _ = golden
    figures = sorted(out.glob("loss_curves_*.png"))
    assert figures and all(figure.with_suffix(".csv").is_file() for figure in figures)
    with (out / "loss_curves_llama3_8b_h100_llama3_8b-bf16.csv").open() as f:
        rows = list(csv.DictReader(f))
    bf16 = [r for r in rows if r["run"] == "llama3_8b-bf16"]
    assert [int(r["step"]) for r in bf16] == list(range(1, 21)) and {r["panel"] for r in bf16} == {"loss"}
    gap = [r for r in rows if r["run"] == "llama3_8b-fp8_current" and r["panel"] == "relative difference to bf16"]
    assert len(gap) == 20
    approx(gap[-1]["value"], ((10 - 0.3 * 20 + 0.01) - (10 - 0.3 * 20)) / (10 - 0.3 * 20))


def test_plots_are_non_empty_pngs(golden):
    _, out, _ = golden
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures == [
        "gemm_speedup_vs_k.png",
        "loss_curves_llama3_8b_b200_llama3_8b_bf16.png",
        "loss_curves_llama3_8b_h100_llama3_8b-bf16.png",
        "loss_curves_nemotron4_15b_h100_log-nemotron4_15b_h100_8nodes_bf16_2001.png",
        "speedup_vs_model_size.png",
    ]
    for name in figures:
        width, height = png_size(out / name)
        assert width >= 600 and height >= 400 and (out / name).stat().st_size > 10_000


def test_html_is_self_contained(golden):
    _, out, _ = golden
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(list(out.glob("*.png")))
    assert 'src="http' not in page and "<link" not in page and "<script" not in page
    assert "llama3_8b-fp8_current" in page and "max(1, N // 10)" in page


def test_manifest_regenerates_the_same_report(tmp_path):
    copy = tmp_path / "logs"
    shutil.copytree(FIXTURES, copy)
    cli = load_cli()
    manifest = copy / "manifest" / "runs.txt"
    assert cli.main(["--manifest", str(manifest)]) == 0
    out = copy / "manifest" / "report"  # the manifest says --out report, relative to itself
    first = {name: (out / name).read_text() for name in ("report.md", "results.csv")}
    assert "| llama3_8b_fp8mx | llama3_8b | b200 |" in first["report.md"]  # its --label applied
    assert "../nemo/llama3_8b_bf16.log" in first["results.csv"]  # paths shown relative to the manifest
    (out / "loss_curves_stale.png").write_bytes(b"old")
    assert cli.main(["--manifest", str(manifest)]) == 0
    assert {name: (out / name).read_text() for name in first} == first
    assert not (out / "loss_curves_stale.png").exists()


def test_nemo_run_local_layout_logs_of_one_replica_are_one_run(tmp_path):
    replica = tmp_path / "experiments" / "pretrain_llama3_8b_fp8cs" / "app-123" / "trainer" / "0"
    replica.mkdir(parents=True)
    shutil.copy(FIXTURES / "megatron/log-nemotron4_15b_h100_8nodes_bf16_2001_0.out", replica / "stdout.log")
    (replica / "stderr.log").write_text("UserWarning: something\n")
    status, results = build_report([str(tmp_path / "experiments")], tmp_path / "out", base=tmp_path, log=quiet)
    assert [r.run.name for r in results] == ["pretrain_llama3_8b_fp8cs-app-123-trainer-0"]
    run = results[0].run
    assert [p.name for p in run.paths] == ["stdout.log", "stderr.log"]
    # the log's own header (fp8 None, bf16 True) beats the "fp8cs" in the folder name; the model comes from the name
    assert (run.meta["model"], run.meta["precision"], run.meta["tp"]) == ("llama3_8b", "bf16", 2)
    assert (run.meta_origin["model"], run.meta_origin["precision"]) == ("file name", "header")
    assert status == 0
    # with combined.log (both streams) beside them, only that one is read
    shutil.copy(replica / "stdout.log", replica / "combined.log")
    _, results = build_report([str(tmp_path / "experiments")], tmp_path / "out", base=tmp_path, log=quiet)
    assert [p.name for p in results[0].run.paths] == ["combined.log"]


def test_nemo_run_task_leads_to_its_run_directory(tmp_path):
    run_dir = tmp_path / "somewhere" / "llama3_8b-bf16"
    shutil.copytree(FIXTURES / "rundirs/llama3_8b-bf16", run_dir)
    task = tmp_path / "experiments" / "sweep" / "sweep_1764410000" / "train"
    (task / "configs").mkdir(parents=True)
    (task / "configs" / "train_config.yaml").write_text(
        f"_target_: nemo_run.config.Script\nargs:\n- {run_dir / 'config.yaml'}\npath: recipes.engine.torch_engine\n"
    )
    console = task / "nemo_run" / "train-abc" / "train" / "0"
    console.mkdir(parents=True)
    (console / "combined.log").write_text("step 1/20 | loss 5.8 | 3.6 s/step\n")
    status, results = build_report([str(tmp_path / "experiments")], tmp_path / "out", base=tmp_path, log=quiet)
    assert [r.run.paths for r in results] == [[run_dir.resolve()]]
    assert "combined.log" not in (tmp_path / "out" / "report.md").read_text()  # the console log is not read
    assert status == 0


def test_two_matching_bf16_runs_give_no_baseline(tmp_path):
    twin = tmp_path / "llama3_8b-bf16-repeat"
    shutil.copytree(FIXTURES / "rundirs/llama3_8b-bf16", twin)
    status, results = build_report([str(FIXTURES / "rundirs"), str(twin)], tmp_path / "out", base=REPO, log=quiet)
    fp8 = next(r for r in results if r.meta["precision"] == "fp8_current")
    assert fp8.baseline is None and fp8.baseline_status.startswith("ambiguous: 2 BF16 runs match")
    row = csv_by_run(tmp_path / "out")["llama3_8b-fp8_current"]
    assert row["speedup"] == "" and row["baseline"] == ""
    assert row["note"].startswith("speedup missing: ambiguous: 2 BF16 runs match")


# ---- several seeds ----


def seeded_run(root: Path, precision: str, recipe: str, seed: int, loss_factor: float, time_factor: float) -> Path:
    """The BF16 fixture run as another precision and seed: every loss times loss_factor, every step time times
    time_factor (so its loss gap to a BF16 run of the same losses is loss_factor - 1 in every window)."""
    run = root / f"llama3_8b-{precision}-seed{seed}"
    shutil.copytree(FIXTURES / "rundirs/llama3_8b-bf16", run)
    config = (run / "config.yaml").read_text()
    config = config.replace("name: bf16\n  recipe: bf16", f"name: {precision}\n  recipe: {recipe}")
    (run / "config.yaml").write_text(config.replace("trainer:\n", f"trainer:\n  seed: {seed}\n"))
    (run / "summary.json").unlink()
    lines = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        record["loss"] *= loss_factor
        record["step_time_s"] *= time_factor
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_runs_pair_with_the_bf16_run_of_their_seed_and_the_gap_is_summarised_across_seeds(tmp_path):
    runs = tmp_path / "runs"
    gaps = {1: 0.01, 2: -0.02, 3: 0.04}  # mean +1%, sample std sqrt((0 + 3^2 + 3^2) / 2) = 3%
    for seed, gap in gaps.items():
        seeded_run(runs, "bf16", "bf16", seed, 1.0 + 0.1 * seed, 1.0)  # each seed its own BF16 losses
        seeded_run(runs, "fp8_current", "tensorwise", seed, (1.0 + 0.1 * seed) * (1 + gap), 0.8)
    seeded_run(runs, "fp8_blockwise", "blockwise", 1, 1.5, 1.0)  # one seed only: not in the seeds table
    seeded_run(runs, "fp8_current", "tensorwise", 9, 1.0, 1.0)  # no BF16 run of seed 9 among three: ambiguous
    status, results = build_report([str(runs)], tmp_path / "out", base=tmp_path, log=quiet, loss_tolerance=0.015)
    by_name = {r.run.name: r for r in results}
    for seed, gap in gaps.items():
        fp8 = by_name[f"llama3_8b-fp8_current-seed{seed}"]
        assert fp8.baseline.run.name == f"llama3_8b-bf16-seed{seed}"
        assert fp8.loss_gap == pytest.approx(gap) and fp8.speedup == pytest.approx(1 / 0.8)
    assert by_name["llama3_8b-fp8_current-seed9"].baseline_status.startswith("ambiguous: 3 BF16 runs match")
    assert csv_by_run(tmp_path / "out")["llama3_8b-fp8_current-seed2"]["seed"] == "2"
    text = (tmp_path / "out" / "report.md").read_text()
    section = text.split("## Across seeds")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| llama3_8b")]
    assert rows == ["| llama3_8b | h100 | fp8_current | TP1 PP1 CP1 VP1 DP8 | 1/128 | 8192 | 1, 2, 3 | +1.00% | 3.00% "
                    "| -2.00% | +4.00% | 1.25 | yes |"]
    assert "<h2>Across seeds</h2>" in (tmp_path / "out" / "report.html").read_text()
    assert status == 1  # the per-seed gaps beyond 1.5% still raise the divergence alarm, run by run


def test_a_seed_run_twice_is_not_summarised(tmp_path):
    runs = tmp_path / "runs"
    for seed in (1, 2):
        seeded_run(runs, "bf16", "bf16", seed, 1.0, 1.0)
        seeded_run(runs, "fp8_current", "tensorwise", seed, 1.0, 1.0)
    shutil.copytree(runs / "llama3_8b-fp8_current-seed2", runs / "llama3_8b-fp8_current-seed2-again")
    build_report([str(runs)], tmp_path / "out", base=tmp_path, log=quiet)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Across seeds" not in text
    assert "across seeds: fp8_current not summarised: seed 2 has several runs" in text
