"""Several processes through FSDP2 on the CPU (Gloo, torchrun): two processes train the same global batch as one,
to a stated tolerance, in BF16 and in FP8 delayed scaling (whose amax histories are reduced over the ranks);
sharded checkpoints resume exactly, and on another number of processes; the planner's view of sharding.

Runs are tiny_llama with 64-token sequences on the bundled text, global batch 8 in micro-batches of 2: one
process accumulates 4 micro-batches per step, each of two processes 2 (so gradient accumulation without
reduce-scatter is exercised too).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.config import CheckpointConfig, Config, ConfigError, GradReduce, TrainerConfig, load_config, load_option
from recipes.folders import save_config
from recipes.engine import torch_engine
from recipes.plan import make_plan
from recipes.plan.describe import describe
from recipes.plan.memory import estimate_memory

from test_train import read_metrics

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
# Relative differences allowed between 1 and 2 processes at every step: (loss, gradient norm). The processes
# compute the same micro-batches from the same weights; what differs is by design:
# - FSDP all-gathers BF16 weights, so norm weights are BF16-rounded (one process: FP32 under autocast), and an
#   FP8 layer quantizes the BF16-rounded weight and produces its weight gradient in BF16 (one process: from and
#   to FP32), as Megatron does with BF16 parameters;
# - the order of FP32 gradient sums;
# - delayed scaling: one process updates its scales after each of its 4 micro-batches, two processes after each
#   of their 2, with the amaxes of both.
# Measured over these 4 steps: BF16 loss and norm <= 2e-4; FP8 losses <= 7e-4, gradient norms <= 2.3e-2.
TOLERANCE = {"bf16": (2e-3, 2e-3), "fp8": (2e-3, 5e-2)}


def make_config(
    run_dir: Path, cache_dir: Path, precision: str, gpus: int, interval: int = 0, activation_checkpointing: bool = False,
    fp8_all_gather: bool = False,
) -> Path:
    cfg = Config(
        model=dataclasses.replace(load_option("model", "tiny_llama"), seq_length=64),
        precision=dataclasses.replace(load_option("precision", precision), fp8_param_gather=False),
        gpu=load_option("gpu", "cpu"),
        executor=dataclasses.replace(load_option("executor", "local"), gpus=gpus),
        data=dataclasses.replace(load_option("data", "text"), cache_dir=str(cache_dir)),
        trainer=TrainerConfig(
            max_steps=STEPS, micro_batch_size=2, global_batch_size=8, warmup_steps=2, log_interval=1,
            checkpoint=CheckpointConfig(interval=interval, keep_last=0),
            activation_checkpointing=activation_checkpointing, fsdp_fp8_all_gather=fp8_all_gather,
        ),
    )
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir / "config.yaml"


def torchrun(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(run_dir)]


def assert_close(two: list, one: list, precision: str) -> None:
    loss_tolerance, norm_tolerance = TOLERANCE[precision]
    assert [s for s, *_ in two] == [s for s, *_ in one]
    for (step, loss, norm), (_, loss_ref, norm_ref) in zip(two, one):
        assert loss == pytest.approx(loss_ref, rel=loss_tolerance), step
        assert norm == pytest.approx(norm_ref, rel=norm_tolerance), step


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_two_processes_match_one_in_bf16(tmp_path, cache_dir):
    assert torch_engine.main([str(make_config(tmp_path / "one", cache_dir, "bf16", 1))]) == 0
    torchrun("-m", "recipes.engine.torch_engine", str(make_config(tmp_path / "two", cache_dir, "bf16", 2)))
    one, two = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert one[-1][1] < one[0][1] - 1.0  # real text: the loss falls, so a wrong batch split would show
    assert [s for s, *_ in two] == list(range(1, STEPS + 1))
    assert_close(two, one, "bf16")


def test_fp8_delayed_under_fsdp_matches_one_process_and_resumes_exactly(tmp_path, cache_dir, capsys):
    assert torch_engine.main([str(make_config(tmp_path / "one", cache_dir, "fp8_delayed", 1))]) == 0
    run_dir = tmp_path / "two"
    config_path = make_config(run_dir, cache_dir, "fp8_delayed", 2, interval=2)
    torchrun("-m", "recipes.engine.torch_engine", str(config_path))
    uninterrupted = curve(run_dir)
    assert [s for s, *_ in uninterrupted] == list(range(1, STEPS + 1))
    assert_close(uninterrupted, curve(tmp_path / "one"), "fp8")
    step_2 = run_dir / "checkpoints" / "step_00000002"
    assert {p.name for p in step_2.iterdir()} >= {"checkpoint.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}

    # As if killed after step 4's metrics but before its checkpoint: the resumed run redoes steps 3 and 4, from
    # each rank's shards of the weights, Adam moments and the amax histories.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    torchrun("-m", "recipes.engine.torch_engine", str(config_path))
    assert curve(run_dir) == uninterrupted  # bit-identical

    # The same sharded checkpoint, resumed by one process: DCP reshards on load.
    one_dir = tmp_path / "resharded"
    shutil.copytree(step_2, one_dir / "checkpoints" / step_2.name)
    capsys.readouterr()
    assert torch_engine.main([str(make_config(one_dir, cache_dir, "fp8_delayed", 1, interval=2))]) == 0
    assert "resuming from step 2 of" in capsys.readouterr().out
    resumed = curve(one_dir)
    assert resumed[:2] == uninterrupted[:2]  # steps 1 and 2 restored from the checkpoint's copy of metrics.jsonl
    assert [s for s, *_ in resumed] == [1, 2, 3, 4]
    assert_close(resumed[2:], uninterrupted[2:], "fp8")


def test_activation_checkpointing_changes_nothing_even_for_delayed_scaling(tmp_path, cache_dir):
    # The recomputed forward quantizes with the scales of the first one and records the same amaxes again, so the
    # run is bit-identical, the amax histories included.
    for checkpointed in (False, True):
        config_path = make_config(tmp_path / str(checkpointed), cache_dir, "fp8_delayed", 1, interval=STEPS,
                                  activation_checkpointing=checkpointed)
        assert torch_engine.main([str(config_path)]) == 0
    assert curve(tmp_path / "True") == curve(tmp_path / "False")
    # Weights, Adam moments and amax histories after the last step, byte for byte (DCP's data file).
    saved = [(tmp_path / str(c) / "checkpoints" / "step_00000004" / "__0_0.distcp").read_bytes() for c in (False, True)]
    assert saved[0] == saved[1]


def test_delayed_scaling_state_is_the_same_on_every_rank():
    torchrun(str(REPO / "tests" / "workers" / "delayed_scaling_ranks.py"))


def planned(tmp_path: Path, precision: str, gpus: int, **trainer) -> Config:
    cfg = load_config(make_config(tmp_path, tmp_path, precision, gpus))
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))


def test_the_plan_says_which_all_gather_runs(tmp_path):
    """trainer.fsdp_fp8_all_gather: FP8 all-gather for the per-tensor recipes, refused for block-scaled ones (their
    weight scales come from the gathered weight). precision.fp8_param_gather (NeMo's fp8_current, fp8_delayed and
    mxfp8 presets) is engine=megatron's: the torch engine's plan says it gathers BF16."""
    def plan_text(precision: str, gpus: int, fsdp_fp8: bool, param_gather: bool = False) -> str:
        cfg = planned(tmp_path, precision, gpus, fsdp_fp8_all_gather=fsdp_fp8)
        emulate = precision in ("fp8_blockwise", "mxfp8")  # no native kernels on a CPU; the others run natively
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, fp8_param_gather=param_gather,
                                                                     emulate=emulate))
        return describe(make_plan(cfg, tmp_path / "config.yaml"))

    fp8, bf16 = "weights all-gathered in FP8", "weights all-gathered in BF16"
    for precision in ("fp8_current", "fp8_delayed"):
        assert fp8 in plan_text(precision, 2, True) and bf16 not in plan_text(precision, 2, True)
        assert bf16 in plan_text(precision, 2, False, param_gather=True)
    for text in (plan_text("fp8_current", 2, False), plan_text("fp8_current", 1, True)):
        assert fp8 not in text and bf16 not in text
    for precision in ("fp8_blockwise", "mxfp8", "bf16"):
        with pytest.raises(ConfigError, match="needs a per-tensor FP8 recipe"):
            plan_text(precision, 2, True)


@pytest.mark.parametrize("precision", ["fp8_current", "fp8_delayed"])
def test_fp8_all_gather_trains_like_one_process_and_resumes_exactly(tmp_path, cache_dir, precision):
    """FSDP2 all-gathers the weights in FP8: the same losses as one process within the tolerance above, and a
    sharded checkpoint resumes bit for bit (master shards, and for current scaling the scales recomputed)."""
    assert torch_engine.main([str(make_config(tmp_path / "one", cache_dir, precision, 1))]) == 0
    run_dir = tmp_path / "two"
    config_path = make_config(run_dir, cache_dir, precision, 2, interval=2, fp8_all_gather=True)
    torchrun("-m", "recipes.engine.torch_engine", str(config_path))
    uninterrupted = curve(run_dir)
    assert_close(uninterrupted, curve(tmp_path / "one"), "fp8")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    torchrun("-m", "recipes.engine.torch_engine", str(config_path))
    assert curve(run_dir) == uninterrupted


def test_fp8_all_gather_ranks():
    """What each rank's layers receive (tests/workers/fp8_all_gather_ranks.py): the FP8 weight one process would
    quantize from the whole FP32 weight, eager and compiled; delayed scaling's weight amax is the whole weight's."""
    torchrun(str(REPO / "tests" / "workers" / "fp8_all_gather_ranks.py"))


def test_fp8_gathered_weight_prints_without_reading_values():
    """torch.compile's AOTAutograd prints the metadata of a compiled block's inputs, FSDP2's gathered weights
    included, while they are fake tensors without values: the repr must not read the scale (it once did, with
    .item(), and every FP8-all-gathered block fell back to eager on GPUs)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from recipes.fp8.all_gather import Fp8GatheredWeight
    from recipes.fp8.formats import E4M3

    with FakeTensorMode():
        weight = Fp8GatheredWeight(torch.empty(96, 64, dtype=E4M3), torch.ones(()), torch.bfloat16)
        text = repr(weight)
    assert text.startswith("Fp8GatheredWeight(shape=(96, 64)") and "bfloat16" in text


def test_memory_estimate_shards_over_processes(tmp_path):
    parameters = 3_311_872
    one = estimate_memory(planned(tmp_path, "bf16", 1), parameters)
    two = estimate_memory(planned(tmp_path, "bf16", 2, global_batch_size=4), parameters)  # no accumulation
    assert two.optimizer == one.optimizer / 2 and two.gradients == one.gradients / 2
    assert one.weights / 2 < two.weights < one.weights  # shards plus the BF16 layers gathered at a time
    accumulating = estimate_memory(planned(tmp_path, "bf16", 2), parameters)
    assert accumulating.gradients == one.gradients  # FP32 gradients accumulate unsharded until the last micro-batch
    recomputed = estimate_memory(planned(tmp_path, "bf16", 2, activation_checkpointing=True), parameters)
    assert recomputed.activations < accumulating.activations


def test_reduce_scatter_every_micro_batch_trains_the_same(tmp_path, cache_dir):
    """trainer.grad_reduce=per_micro_batch: each of the 2 micro-batches per process is reduce-scattered and FSDP
    adds it into the sharded gradients; the same sums as one reduce-scatter per step, in another order."""
    one = tmp_path / "one"
    assert torch_engine.main([str(make_config(one, cache_dir, "fp8_delayed", 1))]) == 0
    config_path = make_config(tmp_path / "two", cache_dir, "fp8_delayed", 2)
    cfg = load_config(config_path)
    cfg.trainer.grad_reduce = GradReduce.per_micro_batch
    save_config(cfg, config_path)
    torchrun("-m", "recipes.engine.torch_engine", str(config_path))
    assert_close(curve(tmp_path / "two"), curve(one), "fp8")


def test_memory_estimate_of_gradient_reduction_and_weight_caches(tmp_path):
    parameters = 3_311_872
    per_step = estimate_memory(planned(tmp_path, "bf16", 2), parameters)  # 2 micro-batches per process
    per_micro_batch = estimate_memory(planned(tmp_path, "bf16", 2, grad_reduce=GradReduce.per_micro_batch), parameters)
    assert per_micro_batch.gradients == per_step.gradients / 2
    fp8 = estimate_memory(planned(tmp_path, "fp8_current", 2), parameters)
    cfg = planned(tmp_path, "bf16", 2)
    linear_weights = parameters - 2 * cfg.model.vocab_size * cfg.model.hidden_size
    assert fp8.weights == per_step.weights + 2 * linear_weights  # an FP8 weight and its transpose per linear
    text = describe(make_plan(planned(tmp_path, "bf16", 2, grad_reduce=GradReduce.per_micro_batch), tmp_path / "c.yaml"))
    assert "gradients reduce-scattered every micro-batch" in text
    gathered = estimate_memory(planned(tmp_path, "fp8_current", 2, fsdp_fp8_all_gather=True), parameters)
    assert gathered.weights < per_step.weights  # FP8-gathered layers, and no weight caches


def test_sharded_initialisation_equals_one_process():
    """The model is built on the meta device and materialised shard by shard (tests/workers/sharded_init_ranks.py):
    every parameter and buffer starts exactly as one process's."""
    torchrun(str(REPO / "tests" / "workers" / "sharded_init_ranks.py"))
