"""Megatron-DeepSpeed logs (recipes/report/formats/deepspeed.py), fixtures in tests/fixtures/logs/deepspeed/."""

from __future__ import annotations

import pytest

from compare_helpers import FIXTURES, approx, csv_by_run, read_one, report


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


def test_megatron_deepspeed_tflops_with_recomputation_are_dropped_and_samples_per_second_give_tokens(tmp_path):
    """An older Megatron-DeepSpeed line (no tgs) of a run with --checkpoint-activations: its TFLOPs count the
    recomputed forward, so they are not model FLOPs; tokens/s/GPU come from samples per second x --seq-length / GPUs."""
    report(["deepspeed/recompute"], tmp_path)
    row = csv_by_run(tmp_path)["megatron_deepspeed_recompute_llama3_8b"]
    assert row["tflops_per_gpu"] == ""
    # samples per second 256000 / ms: 256 (five intervals at 1000 ms), 250 (four at 1024 ms); x 2048 / 8 GPUs
    approx(row["tokens_per_s_per_gpu"], 256 * 2048 / 8)
    text = (tmp_path / "report.md").read_text()
    assert ("Megatron-DeepSpeed's TFLOPs not used: with checkpoint_activations on they count the recomputed "
            "forward") in text
