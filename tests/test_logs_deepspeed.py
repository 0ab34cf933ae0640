"""Megatron-DeepSpeed logs (recipes/report/formats/deepspeed.py) and launchers' line prefixes
(recipes/report/formats/prefixes.py), fixtures in tests/fixtures/logs/{deepspeed,deepspeed_pdsh}/."""

from __future__ import annotations

import re

import pytest

from compare_helpers import FIXTURES, approx, csv_by_run, read_one, report
from recipes.report.parse import read_log


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


PDSH = FIXTURES / "deepspeed_pdsh/megatron_deepspeed_llama3_8b_2nodes.log"


@pytest.mark.parametrize("first, last", [
    ("sd-1: ", "sd-2: "),  # pdsh, as DeepSpeed's PDSHRunner launches it: the host's name
    ("0: ", "15: "),  # srun --label: the task's number
    (" 0: ", "15: "),  # srun pads the number to the widest
    ("[rank0]:", "[rank15]:"),  # torchrun --tee with --role rank
])
def test_launcher_prefixes_are_stripped_and_named(tmp_path, first, last):
    """Every line behind its host's (task's, rank's) prefix: the argument dump is read (precision, TP, PP, sequence,
    world size), DeepSpeed's own world_size (its data-parallel size, 8) is not the run's 16, and the TFLOPs that count
    full recomputation are dropped, as they are without the prefix."""
    log = tmp_path / PDSH.name
    log.write_text(re.sub("^sd-2: ", last, re.sub("^sd-1: ", first, PDSH.read_text(), flags=re.M), flags=re.M))
    read = read_log(log, "2nodes.log")
    # the records (on the last rank's host) and the arguments (rank 0's)
    assert [s.step for s in read.steps] == list(range(10, 101, 10)) and read.steps[0].line == 35
    assert (read.header["tp"], read.header["pp"], read.header["seq"], read.header["world_size"]) == (2, 1, 2048, 16)
    name, other = first.strip(" :[]"), last.strip(" :[]")
    assert read.header_sources["world_size"] == f"2nodes.log line 21 [{name}] (world_size)"
    assert f"2nodes.log: 42 line(s) carried a launcher's prefix, read without it: {name} (31), {other} (11)" \
        in read.notes
    assert all(s.tflops_per_gpu is None for s in read.steps)
    assert any("TFLOPs not used: with recompute_granularity on" in note for note in read.notes)
    run, _ = read_one(log)
    assert (run.meta["precision"], run.meta["world_size"], run.meta["tp"]) == ("bf16", 16, 2)


def test_pdsh_golden_numbers(tmp_path):
    report(["deepspeed_pdsh"], tmp_path)
    row = csv_by_run(tmp_path)["megatron_deepspeed_llama3_8b_2nodes"]
    # 100 steps: warm-up 10 and the first interval; 20..100: five at 1000 ms, four at 1024 ms
    assert (row["steps_measured"], row["world_size"], row["tflops_per_gpu"]) == ("90", "16", "")
    approx(row["median_step_time_s"], 1.0)
    approx(row["tokens_per_s_per_gpu"], 256 * 2048 / 16 / 1.0)  # its tgs
    assert row["world_size_source"] == ("tests/fixtures/logs/deepspeed_pdsh/megatron_deepspeed_llama3_8b_2nodes.log "
                                        "line 21 [sd-1] (world_size)")
