"""torchtitan logs (recipes/report/formats/torchtitan.py), fixtures in
tests/fixtures/logs/{torchtitan,torchtitan_b200}/."""

from __future__ import annotations

import shutil

import pytest

from compare_helpers import FIXTURES, approx, csv_by_run, quiet, read_one, report
from recipes.report import build_report
from recipes.report.parse import read_log

FLOAT8 = FIXTURES / "torchtitan/torchtitan_llama3_8b_float8.log"


def test_step_lines_and_what_ran_from_the_job_config():
    read = read_log(FLOAT8, "float8.log")
    assert read.format == "torchtitan" and read.notes == []
    assert [s.step for s in read.steps] == [1] + list(range(10, 101, 10))  # step 1, then every log_freq (10)
    # coloured `tps: 10,240`: per GPU, thousands separator dropped; its tflops and mfu count the whole attention
    # matrix and are not read
    assert (read.steps[1].loss, read.steps[1].tokens_per_s_per_gpu, read.steps[1].grad_norm) == (11.5, 10240.0, 1.25)
    assert read.steps[1].tflops_per_gpu is None and read.steps[1].time_s is None
    run, _ = read_one(FLOAT8)
    assert (run.meta["model"], run.meta["precision"], run.meta["engine"]) == ("llama3_8b", "fp8_current", "torchtitan")
    assert (run.meta["world_size"], run.meta["gbs"], run.meta["seq"], run.meta["steps"]) == (8, 8, 8192, 100)
    assert read_one(FIXTURES / "torchtitan/torchtitan_llama3_8b_bf16.log")[0].meta["precision"] == "bf16"


def test_the_precision_comes_from_the_log_not_a_file_name_that_says_otherwise(tmp_path):
    misnamed = tmp_path / "llama3_8b_bf16_baseline.log"
    shutil.copy(FLOAT8, misnamed)
    run, _ = read_one(misnamed)
    assert (run.meta["precision"], run.meta_origin["precision"]) == ("fp8_current", "header")


@pytest.mark.parametrize("line, precision", [
    ("Float8 training active with recipe rowwise", "fp8_rowwise"),
    ("Float8 training active with recipe mxfp8_cublas", "mxfp8"),  # the MX converter's line at 07c00d9
    ("Converted Linear layers to MXFP8Linear", "mxfp8"),
    ("Float8 training active", "fp8"),  # 2024: dynamic or delayed scaling, not said
    ("MX training active with recipe mxfp8_cublas", "mxfp8"),  # late 2025's mx converter
    ("Converted modules to use dynamic mxfp8_rceil quantization for grouped_mm and linear ops", "mxfp8"),  # 2026
])
def test_the_converters_own_line_names_the_precision(tmp_path, line, precision):
    log = tmp_path / "llama3_8b.log"
    log.write_text(f"[titan] 2025-08-01 12:00:00,000 - root - INFO - {line}\n"
                   "[titan] 2025-08-01 12:00:00,000 - root - INFO - step: 10  loss:  7.8653  grad_norm:  1.2345  "
                   "memory: 37.57GiB(39.55%)  tps: 6,862  tflops: 397.31  mfu: 40.17%\n")
    assert read_one(log)[0].meta["precision"] == precision


def test_speedup_from_tokens_per_second_and_nvidia_published(tmp_path):
    status, results = report(["torchtitan"], tmp_path, labels=[f"{FIXTURES / 'torchtitan'}:gpu=h100"])
    rows = csv_by_run(tmp_path)
    bf16, fp8 = rows["torchtitan_llama3_8b_bf16"], rows["torchtitan_llama3_8b_float8"]
    # 100 steps, warm-up 10: records 20..100, five at 1.02 s, four at 1.0 s (FP8 0.82 / 0.8): tps 8192 / time
    approx(bf16["tokens_per_s_per_gpu"], 8031)
    approx(fp8["tokens_per_s_per_gpu"], 9990)
    assert fp8["median_step_time_s"] == "" and fp8["speedup_from"] == "tokens/s/GPU"
    approx(fp8["speedup"], 9990 / 8031)
    # Megatron-Bridge 25.11, llama3_8b on 8 H100s, FP8-CS: 14,451 tokens/s/GPU
    approx(fp8["published_tokens_per_s_per_gpu"], 14451)
    approx(fp8["ours_over_published"], 9990 / 14451)
    assert bf16["published_row"] == "" and bf16["ours_over_published"] == ""
    text = (tmp_path / "report.md").read_text()
    assert "| 1.24x (from tokens/s/GPU) | 14,451 (mbridge-25.11, H100 x8 FP8-CS) | 0.69 |" in text
    assert status == 0


def test_a_resumed_torchtitan_run_says_so(tmp_path):
    log = tmp_path / "torchtitan_llama3_8b_float8.log"
    log.write_text(FLOAT8.read_text().replace("Training starts at step 1", "Training starts at step 51"))
    _, results = build_report([str(log)], tmp_path / "out", base=tmp_path, log=quiet)
    assert results[0].state == ["resumed at step 51"]


def test_a_2024_step_line_and_a_validation_line(tmp_path):
    """2024's torchtitan (train.py) writes `wps` for tokens per second per GPU; `validate step:` is not training."""
    log = tmp_path / "llama3_8b.log"
    prefix = "[titan] 2024-09-01 12:00:00,000 - root - INFO - "
    log.write_text(f"{prefix}step: 10  loss:  7.8653  memory: 37.57GiB(39.55%)  wps: 6,862  mfu: 40.17%\n"
                   f"{prefix}validate step: 10  loss:  7.9000  memory: 37.57GiB(39.55%)  tps: 20,000\n")
    read = read_log(log, "llama3_8b.log")
    assert [(s.step, s.loss, s.tokens_per_s_per_gpu) for s in read.steps] == [(10, 7.8653, 6862.0)]


def test_the_2024_job_config_names_delayed_scaling(tmp_path):
    config = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"steps": 100, "seq_len": 8192},
              "float8": {"enable_float8_linear": True, "scaling_type_input": "delayed"}}
    log = tmp_path / "llama3_8b.log"
    log.write_text(f"[titan] 2024-09-01 12:00:00,000 - root - INFO - Running with args: {config}\n"
                   "[titan] 2024-09-01 12:00:00,000 - root - INFO - Float8 training active\n"
                   "[titan] 2024-09-01 12:00:00,000 - root - INFO - step: 10  loss:  7.8653  wps: 6,862\n")
    assert read_one(log)[0].meta["precision"] == "fp8_delayed"  # the config, before the bare converter line


B200 = FIXTURES / "torchtitan_b200"


def test_b200_runs_named_by_launch_line_converter_lines_and_device_line(tmp_path):
    """One job script on 8 B200s, `--training.dtype=bfloat16` on every launch line, no printed job config: the BF16
    run is BF16 from its launch line, the others what their converter's line says (over the launch line's dtype); the
    GPU from `CUDA capacity: NVIDIA B200 ...`; every line behind torchrun's `[rank0]:`. So the FP8 runs have their
    BF16 baseline, speedup and loss gap."""
    runs = {name: read_one(B200 / f"torchtitan_llama3_8b_b200_{name}.log")[0] for name in ("bf16", "rowwise", "mxfp8")}
    assert {name: run.meta["precision"] for name, run in runs.items()} == {
        "bf16": "bf16", "rowwise": "fp8_rowwise", "mxfp8": "mxfp8"}
    assert runs["bf16"].meta_source["precision"] == (
        "tests/fixtures/logs/torchtitan_b200/torchtitan_llama3_8b_b200_bf16.log line 4 (--training.dtype)")
    assert runs["mxfp8"].meta_source["precision"] == (
        "tests/fixtures/logs/torchtitan_b200/torchtitan_llama3_8b_b200_mxfp8.log line 9 [rank0] (mx converter)")
    for run in runs.values():
        assert (run.meta["gpu"], run.meta["world_size"], run.meta["model"]) == ("b200", 8, "llama3_8b")
        assert run.meta_source["gpu"].endswith("line 7 [rank0] (CUDA capacity)")
    status, results = report(["torchtitan_b200"], tmp_path)
    rows = csv_by_run(tmp_path)
    bf16, rowwise, mxfp8 = (rows[f"torchtitan_llama3_8b_b200_{name}"] for name in ("bf16", "rowwise", "mxfp8"))
    # 100 steps, warm-up 10: records 20..100, five at 1.02 s, four at 1.0 s (0.82 / 0.8, 0.72 / 0.7): tps 8192 / time
    approx(bf16["tokens_per_s_per_gpu"], 8031)
    approx(rowwise["tokens_per_s_per_gpu"], 9990)
    approx(mxfp8["tokens_per_s_per_gpu"], 11378)
    assert rowwise["baseline"] == mxfp8["baseline"] == "torchtitan_llama3_8b_b200_bf16"
    approx(rowwise["speedup"], 9990 / 8031)
    approx(mxfp8["speedup"], 11378 / 8031)
    approx(rowwise["loss_gap_vs_bf16"], 0.01 / 7.0)  # step 100: 7.01000 against 7.00000
    approx(mxfp8["loss_gap_vs_bf16"], 0.02 / 7.0)
    assert status == 0


@pytest.mark.parametrize("lines, precision", [
    # the TOML file echoed before the launch (2025's configs)
    (["[model]", 'name = "llama3"', 'flavor = "8B"', "", "[training]", "local_batch_size = 1",
      'dtype = "bfloat16"  # full bf16'], "bf16"),
    (["[model]", 'converters = ["float8"]', "[float8]", 'recipe_name = "rowwise"', "[training]", 'dtype = "bfloat16"'],
     "fp8_rowwise"),
    # the launch line over the TOML file it names
    (["[float8]", 'recipe_name = "tensorwise"', "+ torchrun -m torchtitan.train --model.converters=float8 "
      "--float8.recipe_name rowwise"], "fp8_rowwise"),
    # late 2025's quantize converters, on the launch line
    (['+ torchrun -m torchtitan.train --model.converters="quantize.linear.float8" '
      "--quantize.linear.float8.recipe_name rowwise --training.dtype=bfloat16"], "fp8_rowwise"),
    (['+ torchrun -m torchtitan.train --model.converters="quantize.linear.mx" --training.compile'], "mxfp8"),
    # a converter without its recipe (in a TOML file the log does not show): FP8, the recipe unknown
    (["+ torchrun -m torchtitan.train --model.converters float8 --training.dtype bfloat16"], "fp8"),
    # a TOML key outside torchtitan's sections, or after the echo ended, is not read
    (["[other]", 'dtype = "bfloat16"'], None),
    (["[training]", "seq_len = 8192", "not toml", 'dtype = "bfloat16"'], None),
])
def test_precision_from_an_echoed_toml_file_and_the_launch_line(tmp_path, lines, precision):
    log = tmp_path / "llama3_8b.log"
    log.write_text("\n".join(lines) + "\n[titan] 2025-08-01 12:00:00,000 - root - INFO - step: 10  loss:  7.8653  "
                   "grad_norm:  1.2345  memory: 37.57GiB(39.55%)  tps: 6,862  tflops: 397.31  mfu: 40.17%\n")
    assert read_one(log)[0].meta.get("precision") == precision
