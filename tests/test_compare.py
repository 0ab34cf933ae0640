"""scripts/compare.py and recipes.report: metadata, broken logs, golden numbers, alarms, run states, NVIDIA's published
figures, outputs. Each log format's own tests are in tests/test_logs_<family>.py, beside its fixtures in
tests/fixtures/logs/<family>/.

The fixtures under tests/fixtures/logs are small hand-made files. Expected numbers below are worked out by hand
from how the fixtures were written (comments say how), never by calling the code under test.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from compare_helpers import FIXTURES, REPO, SCRIPT, approx, copy_run, csv_by_run, quiet, report
from recipes.report import build_report, metadata
from recipes.report.parse import read_log, read_metrics_jsonl

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
        ("llama3_8b-fp8_blockwise_1d1d", "fp8_blockwise_1d1d"),
        ("bf16", "bf16"),
    ]:
        assert metadata.from_file_name(name)[0]["precision"] == precision
    # A log naming only megatron-core's fp8_recipe ran the recipe's preset with TE's default blocks.
    assert metadata.RECIPE_TO_PRECISION["blockwise"] == "fp8_blockwise"
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
        "8192 | resumed at step 11 | 17 | 0.82 | 159,844 | 487.8 | 49.3% | 1.23x | "
        "14,451 (mbridge-25.11, H100 x8 FP8-CS) | 11.06 | 4.1600 | +0.24% |  |"
    ) in text
    bf16_cells = ("| complete | 18 | 1.01 | 129,787 | 396.1 | 40.0% | baseline | no published row | n/a | 4.1500 "
                  "| baseline |")
    assert bf16_cells in text
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


def test_a_run_stopped_on_a_nan_gradient_norm_is_flagged_everywhere(tmp_path):
    """The engine writes the step whose gradient norm went NaN and stops (no summary.json): stopped, incomplete, and
    flagged (exit 1) in the table, the CSV and the loss-curve figure's data."""
    status, results = report(["rundirs/llama3_8b-bf16", "failed"], tmp_path)
    delayed = next(r for r in results if r.meta["precision"] == "fp8_delayed")
    assert delayed.state == ["stopped: non-finite gradient norm at step 8", "incomplete: 8 of 20 steps"]
    assert delayed.flags == ["NaN/inf gradient norm at step 8"] and status == 1
    row = csv_by_run(tmp_path)["llama3_8b-fp8_delayed"]
    assert row["run_state"] == "stopped: non-finite gradient norm at step 8; incomplete: 8 of 20 steps"
    assert row["flag"] == "NaN/inf gradient norm at step 8"
    text = (tmp_path / "report.md").read_text()
    assert "| stopped: non-finite gradient norm at step 8; incomplete: 8 of 20 steps |" in text
    assert f"| metrics.jsonl | {row['run_state']} |" in text  # the Sources table
    with (tmp_path / "loss_curves_llama3_8b_h100_llama3_8b-bf16.csv").open() as f:
        states = {row["run"]: row["run_state"] for row in csv.DictReader(f)}
    assert states == {"llama3_8b-bf16": "complete", "llama3_8b-fp8_delayed": row["run_state"]}


def test_a_run_killed_early_is_incomplete_and_its_speedup_says_so(tmp_path):
    """Killed at step 2 of 6 and paired with a whole BF16 run of 6: marked incomplete, no figure from its one
    measured step, and the pairing says the run is incomplete."""
    copy_run("llama3_8b-bf16", tmp_path / "in" / "bf16", max_steps=6, steps=6)
    killed = copy_run("llama3_8b-fp8_current", tmp_path / "in" / "fp8-killed", max_steps=6, steps=2)
    (killed / "summary.json").unlink()
    status, results = build_report([str(tmp_path / "in")], tmp_path / "out", base=tmp_path, log=quiet)
    fp8 = next(r for r in results if r.run.name == "fp8-killed")
    assert fp8.baseline.run.name == "bf16" and fp8.state == ["incomplete: 2 of 6 steps"]
    assert fp8.step_time_s is None and fp8.thin["step time"] == "1 of 1 records" and fp8.speedup is None
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| incomplete: 2 of 6 steps | 1 | too few records (1 of 1 records) |" in text
    # killed at step 12 of 20 instead: figures from its 10 measured steps, and the speedup cell names the state
    copy_run("llama3_8b-bf16", tmp_path / "in2" / "bf16")
    later = copy_run("llama3_8b-bf16", tmp_path / "in2" / "fp8-killed", steps=12)
    config = (later / "config.yaml").read_text()
    config = config.replace("name: bf16\n  recipe: bf16", "name: fp8_current\n  recipe: tensorwise")
    (later / "config.yaml").write_text(config)
    (later / "summary.json").unlink()
    build_report([str(tmp_path / "in2")], tmp_path / "out2", base=tmp_path, log=quiet)
    row = csv_by_run(tmp_path / "out2")["fp8-killed"]
    assert (row["run_state"], row["baseline"]) == ("incomplete: 12 of 20 steps", "bf16")
    # its warm-up is 1 step (of 12): steps 2..12, 1.5 s, five at 1.00 s, five at 1.02 s; BF16 (1.00 + 1.02) / 2
    approx(row["speedup"], 1.01 / 1.02)
    assert "| 0.99x (this run incomplete) |" in (tmp_path / "out2" / "report.md").read_text()


@pytest.mark.parametrize("meta, expected", [
    # the GPU's own row, the exact recipe, the newest container's of those
    ({"model": "llama3_70b", "gpu": "h100", "world_size": 64, "precision": "fp8_current"},
     (1602, "mbridge-25.11, H100 x64 FP8-CS")),
    # H200: H100's rows, said so
    ({"model": "llama3_8b", "gpu": "h200", "world_size": 8, "precision": "fp8_current"},
     (14451, "mbridge-25.11, H100 x8 FP8-CS; H100 rows for H200")),
    # delayed scaling on B200: only rows that say "FP8" without a recipe, said so
    ({"model": "nemotron4_15b", "gpu": "b200", "world_size": 64, "precision": "fp8_delayed"},
     (14760, "nemo-25.02, B200 x64 FP8; recipe not stated")),
    ({"model": "llama3_8b", "gpu": "gb200", "world_size": 8, "precision": "mxfp8"},
     (29789, "mbridge-25.11, GB200 x8 FP8-MX")),
    # no match: another GPU count, BF16, a GPU NVIDIA publishes nothing for, a precision unknown
    ({"model": "llama3_8b", "gpu": "h100", "world_size": 16, "precision": "fp8_current"}, None),
    ({"model": "llama3_8b", "gpu": "h100", "world_size": 8, "precision": "bf16"}, None),
    ({"model": "llama3_8b", "gpu": "cpu", "world_size": 8, "precision": "fp8_current"}, None),
    ({"model": "llama3_8b", "gpu": "h100", "world_size": 8}, None),
])
def test_the_nvidia_row_a_run_is_held_against(meta, expected):
    from recipes.report.published import published_for

    found = published_for(meta)
    assert (found.tokens, found.label()) == expected if expected else found is None


def test_published_columns_for_matching_and_non_matching_run_directories(tmp_path):
    """An FP8 run on 8 H200s takes H100's row; the same run on 4 GPUs has none; the rows used are listed in full."""
    runs = tmp_path / "in"
    for name, gpus in (("h200-8", 8), ("h200-4", 4)):
        run = copy_run("llama3_8b-fp8_current", runs / name)
        config = (run / "config.yaml").read_text().replace("name: h100", "name: h200")
        (run / "config.yaml").write_text(config.replace("gpus: 8", f"gpus: {gpus}"))
        (run / "summary.json").unlink()
    build_report([str(runs)], tmp_path / "out", base=tmp_path, log=quiet)
    rows = csv_by_run(tmp_path / "out")
    assert rows["h200-8"]["published_row"] == "mbridge-25.11, H100 x8 FP8-CS; H100 rows for H200"
    approx(rows["h200-8"]["ours_over_published"], 128 * 8192 / 8 / 0.82 / 14451)
    assert rows["h200-4"]["world_size"] == "4" and rows["h200-4"]["published_row"] == ""
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| no published row | n/a |" in text
    assert ("- llama3_8b on 8 H100, FP8-CS, TP1 PP1 CP1 VP-, FSDP, MBS/GBS 1/128, seq 8192: 14,451 tokens/s/GPU, 744 "
            "model TFLOP/s/GPU as published (container 25.11); NVIDIA-NeMo/Megatron-Bridge "
            "docs/performance-summary-archive.md") in text


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


def test_an_out_that_cannot_be_written_is_a_usage_error_not_a_divergence(tmp_path, capsys):
    """Exit 2 (with one line saying why, before anything is read), never 1, which says a run diverged."""
    a_file = tmp_path / "report.md"
    a_file.write_text("not a folder")
    run_dir = str(FIXTURES / "rundirs/llama3_8b-bf16")
    cli = load_cli()
    for out in (a_file, a_file / "below"):
        assert cli.main([run_dir, "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"compare.py: error: --out {out}: {a_file} is a file, not a folder\n"
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if not os.access(read_only, os.W_OK):  # root writes anywhere: nothing to test there
        assert cli.main([run_dir, "--out", str(read_only / "out")]) == 2


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
    # each names its run, and its state: the fixture's FP8 run was requeued and resumed
    assert sorted(labels.values()) == [f"fp8_current (fp8-{n}) [resumed at step 11]" for n in range(3)]


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
                    "| -2.00% | +4.00% | 1.25 | yes | complete |"]
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


# ---- where each value came from ----


def test_every_value_of_a_row_says_where_it_was_read(golden):
    """results.csv: beside each value, a `<column>_source` naming the line and the key it was read from, the config
    key, the --label, the file name, or how it was derived; the markdown table stays as it was."""
    _, out, rows = golden
    bf16 = rows["log-nemotron4_15b_h100_8nodes_bf16_2001"]
    log = "tests/fixtures/logs/megatron/log-nemotron4_15b_h100_8nodes_bf16_2001_0.out"
    assert bf16["tp_source"] == f"{log} line 13 (tensor_model_parallel_size)"
    assert bf16["precision_source"] == f"{log} line 6 (fp8); {log} line 3 (bf16)"  # `fp8 None` and `bf16 True`
    assert bf16["gpu_source"] == "file name log-nemotron4_15b_h100_8nodes_bf16_2001"
    assert bf16["params_source"] == "derived from conf/model/nemotron4_15b.yaml (the model's dimensions)"
    assert bf16["median_step_time_s_source"] == f"{log} lines 20-28 (elapsed time per iteration (ms))"
    assert bf16["tokens_per_s_per_gpu_source"].startswith("derived from global batch x seq / world size / step time")
    assert bf16["final_loss_source"] == f"{log} line 28 (lm loss)"
    assert bf16["run_state_source"] == f"last record: {log} line 28; planned steps: {log} line 28 (record 100/100)"
    mx = rows["llama3_8b_fp8mx"]
    assert mx["gpu_source"] == f"--label {FIXTURES / 'nemo'}:gpu=b200"
    assert mx["tflops_per_gpu"] == mx["tflops_per_gpu_source"] == ""  # no figure, no source
    fp8 = rows["llama3_8b-fp8_current"]
    assert fp8["seq_source"] == "tests/fixtures/logs/rundirs/llama3_8b-fp8_current/config.yaml (model.seq_length)"
    assert fp8["median_step_time_s_source"] == (
        "tests/fixtures/logs/rundirs/llama3_8b-fp8_current/metrics.jsonl lines 3-22 (step_time_s)")
    assert "_source" not in (out / "report.md").read_text()


def test_a_configuration_key_is_no_launcher_prefix():
    from recipes.report.formats.prefixes import strip_launcher_prefixes

    config = ["fp8: hybrid", "bf16: true", " iteration 10/ 100 | lm loss: 2.0 |"] * 3
    assert strip_launcher_prefixes(config) == (config, [""] * 9)
    labelled = [f"node{n % 2 + 1:02d}: line {n}" for n in range(12)] + ["fp8: hybrid"]
    lines, origins = strip_launcher_prefixes(labelled)
    assert lines == [f"line {n}" for n in range(12)] + ["fp8: hybrid"]
    assert origins == [f"node{n % 2 + 1:02d}" for n in range(12)] + [""]
