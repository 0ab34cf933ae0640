"""Megatron-LM, Megatron-Bridge and AMD's Primus logs (recipes/report/formats/megatron.py), and a format of the same
shape this reader does not claim (GPT-NeoX), fixtures in tests/fixtures/logs/{megatron,bridge,primus,primus_v26,
gpt_neox}/."""

from __future__ import annotations

import pytest

from compare_helpers import FIXTURES, REPO, approx, csv_by_run, quiet, read_one, report
from recipes.report import build_report
from recipes.report.inputs import find_sources, read_source
from recipes.report.parse import read_log
from recipes.report.table import compare


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


PRIMUS = FIXTURES / "primus/primus_llama3_8b_fp8.log"


def test_primus_reads_each_iterations_own_time_not_its_running_average(tmp_path):
    run, _ = read_one(PRIMUS)
    # `fp8 : e4m3 (str)`, `fp8_recipe : delayed (str)` behind the logger's prefix: FP8 delayed scaling, from the log
    assert (run.meta["precision"], run.meta_origin["precision"]) == ("fp8_delayed", "header")
    assert (run.meta["world_size"], run.meta["gbs"], run.meta["seq"], run.meta["steps"]) == (8, 8, 4096, 20)
    assert [s.step for s in run.steps] == list(range(1, 21))
    # `elapsed time per iteration (ms): 512.0/16360.4`: the iteration's own 512 ms, not the average since step 1
    assert (run.steps[0].time_s, run.steps[1].time_s, run.steps[2].time_s) == (32.2087, 0.512, 0.51)
    assert run.steps[1].tflops_per_gpu == 390.6 and run.steps[1].tokens_per_s_per_gpu == 8000.0
    report(["primus"], tmp_path)
    row = csv_by_run(tmp_path)["primus_llama3_8b_fp8"]
    # 20 steps, warm-up 2: steps 3..20, nine at 510 ms and nine at 512 ms
    assert (row["steps_measured"], row["run_state"], row["too_few_records"]) == ("18", "complete", "")
    approx(row["median_step_time_s"], 0.511)
    approx(row["tflops_per_gpu"], (392.2 + 390.6) / 2)
    approx(row["final_loss"], (8.2 + 8.0) / 2)


def test_two_readable_iterations_of_twenty_give_no_figure(tmp_path):
    """The issue's case: most iterations' step time in a shape not read. The 2 readable ones must give no median,
    no final loss and no TFLOP/s, and the table's cells say why."""
    lines = PRIMUS.read_text().splitlines(keepends=True)
    broken = [line.replace("elapsed time per iteration (ms): ", "elapsed time per iteration (ms): ~")
              if "iteration        1/" not in line and "iteration        2/" not in line else line for line in lines]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "primus_llama3_8b_fp8.log").write_text("".join(broken))
    status, results = build_report([str(tmp_path / "in")], tmp_path / "out", base=tmp_path, log=quiet)
    result = results[0]
    assert [s.step for s in result.run.steps] == [1, 2] and result.run.skipped_records == 18
    assert result.step_time_s is None and result.final_loss is None and result.tflops_per_gpu is None
    assert result.thin["step time"] == "1 of 19 records" and result.thin["final loss"] == "2 of 20 records"
    row = csv_by_run(tmp_path / "out")["primus_llama3_8b_fp8"]
    assert row["median_step_time_s"] == "" and "step time: 1 of 19 records" in row["too_few_records"]
    assert "| too few records (1 of 19 records) |" in (tmp_path / "out" / "report.md").read_text()


def test_the_short_instant_average_time_field_reads_the_instant(tmp_path):
    log = tmp_path / "amd.log"
    log.write_text(" iteration       10/     100 | elapsed time (ms): 32208.7/32208.7 | lm loss: 2.0 |\n"
                   " iteration       20/     100 | elapsed time (ms): 510.0/16359.4 | compute per GPU (TFLOP/s/GPU): "
                   "391.0 (avg 300.5) | lm loss: 1.9 |\n")
    read = read_log(log, "amd.log")
    assert [(s.time_s, s.tflops_per_gpu) for s in read.steps] == [(32.2087, None), (0.51, 391.0)]


def test_a_prefixed_typed_dump_with_fp8_off_is_bf16(tmp_path):
    log = tmp_path / "primus_bf16.log"
    log.write_text("[20251101 10:00:00][rank-0/8][INFO]       bf16       : True (bool)\n"
                   "[20251101 10:00:00][rank-0/8][INFO]       fp8        : None (NoneType)\n"
                   "[20251101 10:00:00][rank-0/8][INFO]       fp8_recipe : delayed (str)\n"
                   " iteration       10/     100 | elapsed time per iteration (ms): 510.0/510.0 | lm loss: 2.0 |\n")
    assert read_one(log)[0].meta["precision"] == "bf16"


def test_a_nan_iteration_megatron_skipped_is_flagged_but_not_a_stop(tmp_path):
    log = tmp_path / "skipped_nan_llama3_8b.log"
    log.write_text("".join(
        f" iteration {it:8d}/{30:8d} | elapsed time per iteration (ms): 1000.0 | lm loss: {3.0 - it / 100:.6E} | "
        f"grad norm: 1.000 | number of nan iterations: {int(it == 20):3d} |\n" for it in range(1, 31)))
    _, results = build_report([str(log)], tmp_path / "out", base=tmp_path, log=quiet)
    assert results[0].flags == ["NaN/inf loss from step 20"] and results[0].state == []
    # a run whose last line is the NaN: the engine stopped there
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:20]))
    _, results = build_report([str(log)], tmp_path / "out", base=tmp_path, log=quiet)
    assert results[0].state == ["stopped: non-finite loss at step 20", "incomplete: 20 of 30 steps"]


PRIMUS_V26 = FIXTURES / "primus_v26"


def test_primus_prints_each_iteration_twice_and_it_is_one_record(tmp_path):
    """Primus 2026 forwards the last rank's line to rank 0 and the last rank prints its own: every iteration twice,
    the same values. One record each: no restart, figures from every iteration, and a run killed after iteration 19
    of 20 is incomplete, not resumed."""
    read = read_log(PRIMUS_V26 / "primus_llama3_8b_fp8.log", "fp8.log")
    assert [s.step for s in read.steps] == list(range(1, 20))
    assert [s.fresh for s in read.steps] == [True] + [False] * 18
    assert "fp8.log: 19 record(s) printed again with the same step and values (two loggers): read once" in read.notes
    status, results = report(["primus_v26"], tmp_path, labels=[f"{PRIMUS_V26}:gpu=mi300x"])
    rows = csv_by_run(tmp_path)
    bf16, fp8 = rows["primus_llama3_8b_bf16"], rows["primus_llama3_8b_fp8"]
    assert (bf16["run_state"], fp8["run_state"]) == ("complete", "incomplete: 19 of 20 steps")
    # BF16: 20 steps, warm-up 2: steps 3..20, nine at 2000 ms (even), nine at 2010 ms; FP8: 19 steps, warm-up 1:
    # steps 2..19, nine at 1500 ms, nine at 1510 ms
    assert (bf16["steps_measured"], fp8["steps_measured"]) == ("18", "18")
    approx(bf16["median_step_time_s"], 2.005)
    approx(fp8["median_step_time_s"], 1.505)
    approx(bf16["tflops_per_gpu"], (200.0 + 199.0) / 2)  # 400000 / ms, as printed with one decimal
    approx(fp8["tflops_per_gpu"], (266.7 + 264.9) / 2)
    assert fp8["baseline"] == "primus_llama3_8b_bf16"
    approx(fp8["speedup"], 2.005 / 1.505)
    approx(fp8["loss_gap_vs_bf16"], 0.02 / 8.2)  # step 19: 8.22 against 8.2
    assert status == 0


@pytest.mark.parametrize("prefix, shape", [
    ("[20260601 10:00:00][rank-0/8][INFO]     [-----------module_utils.py:227] : ", "{key} : {value} ({kind})"),
    # December 2025: the module location without its trailing space, no type after the value
    ("[20251202 10:00:00][rank-0/8][INFO]     [-----module_utils.py:197]: ", "{key} : {value}"),
    ("[20251202 10:00:00][rank-0/8][INFO]     [-----module_utils.py:197] : ", "{key} : {value}"),
])
@pytest.mark.parametrize("fp8, recipe, precision", [
    ("e4m3", "delayed", "fp8_delayed"), ("hybrid", "tensorwise", "fp8_current"), ("None", "delayed", "bf16"),
])
def test_primus_argument_dumps_behind_its_module_prefix(tmp_path, prefix, shape, fp8, recipe, precision):
    """log_dict_aligned's lines (primus/core/utils/module_utils.py) behind the logger's location of the line, with a
    space before its colon since 2026: BF16 and each FP8 recipe read, not `unknown`."""
    values = [("bf16", "True", "bool"), ("fp8", fp8, "NoneType" if fp8 == "None" else "str"),
              ("fp8_recipe", recipe, "str"), ("world_size", "8", "int")]
    lines = [prefix + "Final backend args (after patches): (4 parameters)"]
    lines += [prefix + "  " + shape.format(key=f"{key:<10}", value=value, kind=kind) for key, value, kind in values]
    lines += [prefix + "-" * 80, " iteration       10/     100 | elapsed time per iteration (ms): 510.0 | lm loss: 2 |"]
    log = tmp_path / "primus_llama3_8b.log"
    log.write_text("\n".join(lines) + "\n")
    run, _ = read_one(log)
    assert (run.meta["precision"], run.meta["world_size"]) == (precision, 8)
    assert "primus_llama3_8b.log line 3 (fp8)" in run.meta_source["precision"]  # where the CSV says it was read


def test_a_record_repeated_exactly_is_one_record_and_with_other_values_a_restart(tmp_path):
    def line(it, ms, loss):
        return f" iteration {it:8d}/{30:8d} | elapsed time per iteration (ms): {ms:.1f} | lm loss: {loss:.6E} |\n"

    log = tmp_path / "twice.log"
    # step 10 printed twice alike, and again alike after step 20: one record, no restart
    log.write_text(line(10, 1000.0, 2.0) + line(10, 1000.0, 2.0) + line(20, 1000.0, 1.9) + line(10, 1000.0, 2.0)
                   + line(30, 1000.0, 1.8))
    read = read_log(log, "twice.log")
    assert [(s.step, s.fresh) for s in read.steps] == [(10, True), (20, False), (30, False)]
    run, _ = read_one(log)
    assert run.resumed_at == []
    # after step 30, step 20 again with another time: the process restarted there (from its checkpoint at step 10),
    # and its step 30, alike the first process's, is its own record
    log.write_text(line(10, 1000.0, 2.0) + line(20, 1000.0, 1.9) + line(30, 1000.0, 1.8) + line(20, 1200.0, 1.9)
                   + line(30, 1000.0, 1.8) + line(40, 1000.0, 1.7))
    read = read_log(log, "twice.log")
    assert [(s.step, s.fresh) for s in read.steps] == [(10, True), (20, False), (30, False), (20, True), (30, False),
                                                       (40, False)]
    run, _ = read_one(log)
    assert run.resumed_at == [20] and run.steps[1].time_s == 1.2  # the restart's record of step 20 kept


def test_gpt_neox_is_a_format_not_claimed_and_gives_only_what_it_states(tmp_path):
    """GPT-NeoX prints Megatron's iteration shape (megatron/logging.py) with its loss named lm_loss, and DeepSpeed's
    engine configuration says world_size 4 (its data-parallel size) for 8 GPUs. Read as Megatron's lines, said so:
    steps and step times, no world size, engine, precision or TFLOP/s the log does not state for them."""
    read = read_log(FIXTURES / "gpt_neox/neox_llama3_8b.log", "neox.log")
    assert (read.format, read.claimed, read.header) == ("megatron", False, {})
    assert [s.step for s in read.steps] == list(range(10, 101, 10))
    assert read.steps[1].time_s == 1.0 and all(s.tflops_per_gpu is None and s.loss is None for s in read.steps)
    assert any(note.startswith("neox.log: a format this reader does not claim") and "lm_loss" in note
               for note in read.notes)
    report(["gpt_neox"], tmp_path)
    row = csv_by_run(tmp_path)["neox_llama3_8b"]
    assert row["format"] == "megatron (assumed)"
    assert (row["world_size"], row["engine"], row["precision"], row["tflops_per_gpu"]) == ("", "", "", "")
    approx(row["median_step_time_s"], 1.0)  # 20..100: five at 1000 ms, four at 1010 ms
    assert row["median_step_time_s_source"] == ("tests/fixtures/logs/gpt_neox/neox_llama3_8b.log lines 16-24 "
                                                "(elapsed time per iteration (ms))")
    assert (row["steps_measured"], row["run_state"]) == ("90", "complete")  # its `iteration 100/ 100`
