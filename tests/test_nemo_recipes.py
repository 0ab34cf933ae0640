"""engine=nemo against the real NeMo 2.7.3 on a CPU: the recipe built for every model x precision, megatron-core
accepting the model config NeMo would train, the metrics callback in a real Lightning trainer, NeMo's own iteration
line read by the report parser, and the entry point refusing a machine without GPUs.

NeMo is not in the project's main environment (about 260 packages, 2.9 GB): there these tests skip, saying so.
.ci/run installs it into .venv-nemo from .ci/nemo-requirements.txt and runs this file with FP8_RECIPES_REQUIRE_NEMO=1,
which turns the skip into a failure. Building the model itself needs Transformer Engine and a GPU: the test marked
`gpu` runs the engine inside the NeMo container.

Expected values are written out by hand: layouts from REFERENCE section 5 (H100 rows; MXFP8 on B200's fp8 rows),
architectures from REFERENCE section 2, precision settings from NeMo's presets as NVIDIA's performance scripts
change them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("nemo") is None:
    reason = ("nemo_toolkit 2.7.3 is not installed in this Python; .ci/run runs these tests in .venv-nemo "
              "(python3.11 -m venv .venv-nemo && .venv-nemo/bin/pip install -r .ci/nemo-requirements.txt)")
    if os.environ.get("FP8_RECIPES_REQUIRE_NEMO") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)

import fiddle as fdl  # noqa: E402
from nemo.collections import llm  # noqa: E402
from nemo.lightning.pytorch.callbacks.progress_printer import ProgressPrinter  # noqa: E402
from nemo.lightning.pytorch.plugins.mixed_precision import update_config_with_dtype_overrides  # noqa: E402

from recipes.config import ConfigError, dump_config  # noqa: E402
from recipes.folders import save_config  # noqa: E402
from recipes.nemo import build  # noqa: E402
from recipes.nemo.callback import RunMetrics  # noqa: E402
from recipes.nemo.mapping import precision_fields  # noqa: E402
from recipes.nemo.preflight import source_version  # noqa: E402
from recipes.plan import make_plan  # noqa: E402
from recipes.report.parse import read_log, read_metrics_jsonl  # noqa: E402
from recipes.trainer.loop import NonFiniteError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# REFERENCE section 2: NeMo config class, layers, hidden, ffn, heads, groups, head dim, seq, norm, gated SiLU or
# squared ReLU, RoPE base and fraction of head dims rotated.
ARCHITECTURES = {
    "llama3_8b": ("Llama3Config8B", 32, 4096, 14336, 32, 8, 128, 8192, "RMSNorm", True, 500000, 1.0),
    "llama3_70b": ("Llama3Config70B", 80, 8192, 28672, 64, 8, 128, 8192, "RMSNorm", True, 500000, 1.0),
    "llama31_405b": ("Llama31Config405B", 126, 16384, 53248, 128, 8, 128, 8192, "RMSNorm", True, 500000, 1.0),
    "nemotron4_15b": ("Nemotron4Config15B", 32, 6144, 24576, 48, 8, 128, 4096, "LayerNorm", False, 10000, 0.5),
    "nemotron4_340b": ("Nemotron4Config340B", 96, 18432, 73728, 96, 8, 192, 4096, "LayerNorm", False, 10000, 0.5),
}
VOCABULARY = {"llama3_8b": 128256, "llama3_70b": 128256, "llama31_405b": 128256, "nemotron4_15b": 256000,
              "nemotron4_340b": 256000}

# REFERENCE section 5: (GPU, model, dtype) -> GPUs, TP, PP, CP, VP, MBS, GBS, Megatron-FSDP
LAYOUTS = {
    ("h100", "llama3_8b", "bf16"): (8, 1, 1, 2, 1, 1, 128, False),
    ("h100", "llama3_8b", "fp8"): (8, 1, 1, 1, 1, 1, 128, True),
    ("h100", "llama3_70b", "bf16"): (64, 4, 4, 2, 5, 1, 128, False),
    ("h100", "llama3_70b", "fp8"): (64, 4, 8, 1, 5, 1, 128, False),
    ("h100", "llama31_405b", "bf16"): (1024, 8, 8, 2, 8, 1, 512, False),
    ("h100", "llama31_405b", "fp8"): (1024, 8, 8, 2, 8, 1, 512, False),
    ("h100", "nemotron4_15b", "bf16"): (64, 2, 1, 1, 1, 2, 256, False),
    ("h100", "nemotron4_15b", "fp8"): (64, 2, 1, 1, 1, 2, 256, False),
    ("h100", "nemotron4_340b", "bf16"): (256, 8, 8, 1, 12, 1, 64, False),
    ("h100", "nemotron4_340b", "fp8"): (256, 8, 8, 1, 12, 1, 64, False),
    ("b200", "llama3_8b", "fp8"): (8, 1, 1, 1, 1, 2, 128, False),
    ("b200", "llama3_70b", "fp8"): (64, 1, 1, 1, 1, 1, 128, True),
    ("b200", "llama31_405b", "fp8"): (128, 4, 8, 2, 8, 1, 64, False),
    ("b200", "nemotron4_15b", "fp8"): (64, 1, 1, 1, 1, 2, 256, False),
    ("b200", "nemotron4_340b", "fp8"): (128, 8, 4, 1, 12, 1, 32, False),
}

# NeMo's preset of each precision with what the performance scripts and conf/precision change in it: BF16
# gradient reduction everywhere, current scaling without BF16 first/last layers, blockwise without FP8 weights and
# in E4M3 both ways (conf/precision/fp8_blockwise.yaml, Transformer Engine's Float8BlockScaling default; NeMo's
# preset says hybrid).
PLUGINS = {
    "bf16": ("bf16_mixed", {"fp8": None}),
    "fp8_delayed": ("bf16_with_fp8_mixed", {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0,
                    "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max", "fp8_param_gather": True,
                    "first_last_layers_bf16": False}),
    "fp8_current": ("bf16_with_fp8_current_scaling_mixed", {"fp8": "hybrid", "fp8_recipe": "tensorwise",
                    "fp8_param_gather": True, "first_last_layers_bf16": False, "num_layers_at_start_in_bf16": 0,
                    "num_layers_at_end_in_bf16": 0}),
    "fp8_blockwise": ("bf16_with_fp8_subchannel_scaling_mixed", {"fp8": "e4m3", "fp8_recipe": "blockwise",
                      "fp8_param_gather": False}),
    "mxfp8": ("bf16_with_mxfp8_mixed", {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True,
              "reuse_grad_buf_for_mxfp8_param_ag": True}),
}
PAIRS = [(model, precision) for model in ARCHITECTURES for precision in PLUGINS]


def published_recipe(hydra_compose, tmp_path: Path, model: str, precision: str):
    gpu = "b200" if precision == "mxfp8" else "h100"
    cfg = hydra_compose("engine=nemo", "executor=slurm", f"gpu={gpu}", f"model={model}", f"precision={precision}",
                        "layout=published")
    make_plan(cfg, tmp_path / "config.yaml")  # the preflight passes
    return cfg, build.build_recipe(cfg, tmp_path, "/data/corpus")


@pytest.mark.parametrize("model, precision", PAIRS)
def test_recipe_of_every_model_and_precision_is_the_published_run(hydra_compose, tmp_path, model, precision):
    cfg, recipe = published_recipe(hydra_compose, tmp_path, model, precision)
    gpu = cfg.gpu.name
    gpus, tp, pp, cp, vp, mbs, gbs, fsdp = LAYOUTS[(gpu, model, "bf16" if precision == "bf16" else "fp8")]
    seq = ARCHITECTURES[model][7]
    assert recipe.__fn_or_cls__ is llm.pretrain
    assert recipe.model.config.__fn_or_cls__.__name__ == ARCHITECTURES[model][0]
    trainer, strategy = recipe.trainer, recipe.trainer.strategy
    assert (trainer.num_nodes, trainer.devices) == (gpus // 8, 8)
    assert (strategy.tensor_model_parallel_size, strategy.pipeline_model_parallel_size, strategy.context_parallel_size,
            strategy.virtual_pipeline_model_parallel_size) == (tp, pp, cp, vp if vp > 1 else None)
    assert strategy.sequence_parallel == (tp > 1)
    assert strategy.pipeline_dtype == (torch.bfloat16 if pp > 1 else None)
    assert strategy.account_for_embedding_in_pipeline_split == strategy.account_for_loss_in_pipeline_split == (
        model == "llama31_405b" and pp > 1)
    assert (getattr(strategy, "fsdp", None) == "megatron") == fsdp
    assert recipe.data.__fn_or_cls__ is llm.PreTrainingDataModule
    assert (recipe.data.micro_batch_size, recipe.data.global_batch_size, recipe.data.seq_length) == (mbs, gbs, seq)
    assert recipe.data.paths == ["/data/corpus"] and recipe.model.config.seq_length == seq
    assert recipe.data.tokenizer.vocab_size + 1 == VOCABULARY[model]  # NullTokenizer adds the end-of-document id
    assert recipe.optim.lr_scheduler.max_steps == trainer.max_steps == 100

    preset, settings = PLUGINS[precision]
    plugin = fdl.build(recipe.trainer.plugins).dtype_config  # NeMo's MegatronMixedPrecision, constructed
    expected = {"params_dtype": torch.bfloat16, "grad_reduce_in_fp32": False, **settings}
    assert {name: getattr(plugin, name) for name in expected} == expected
    # Everything the run does not set is NeMo's preset for the precision.
    nemo_preset = fdl.build(getattr(build.mixed_precision, preset)()).dtype_config
    set_here = {path.rpartition(".")[2] for path in precision_fields(cfg) if path.startswith("trainer.plugins.")}
    kept = [f.name for f in dataclasses.fields(plugin) if f.name not in set_here | {"fp8_param"}]
    assert {name: getattr(plugin, name) for name in kept} == {name: getattr(nemo_preset, name) for name in kept}
    assert [c.__fn_or_cls__ for c in trainer.callbacks].count(RunMetrics) == 1
    assert build.to_yaml(recipe).startswith("_partial_: true\n_target_: nemo.collections.llm.api.pretrain\n")


@pytest.mark.parametrize("model, precision", PAIRS)
def test_megatron_core_accepts_the_model_config_nemo_would_train(hydra_compose, tmp_path, model, precision):
    """NeMo's model config with the strategy's layout and the plugin's precision written in (as MegatronStrategy
    does when it connects the model), built as megatron-core's TransformerConfig: what megatron-core validates.
    Rotary fusion needs Transformer Engine, absent here, so it is off."""
    _, recipe = published_recipe(hydra_compose, tmp_path, model, precision)
    config = copy.deepcopy(recipe.model.config)
    config.apply_rope_fusion = False
    strategy = recipe.trainer.strategy
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "context_parallel_size", "sequence_parallel", "pipeline_dtype",
                 "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        setattr(config, name, getattr(strategy, name))
    update_config_with_dtype_overrides(fdl.build(recipe.trainer.plugins).dtype_config, config)
    built = fdl.build(config)
    _, layers, hidden, ffn, heads, groups, head_dim, seq, norm, gated, rope_base, rotary = ARCHITECTURES[model]
    assert (built.num_layers, built.hidden_size, built.ffn_hidden_size, built.num_attention_heads,
            built.num_query_groups, built.kv_channels, built.seq_length) == (layers, hidden, ffn, heads, groups,
                                                                             head_dim, seq)
    assert (built.normalization, built.gated_linear_unit, built.rotary_base, built.rotary_percent) == (
        norm, gated, rope_base, rotary)
    assert built.layernorm_zero_centered_gamma == (norm == "LayerNorm")  # Nemotron-4's LayerNorm1p
    assert built.fp8 == PLUGINS[precision][1]["fp8"] and built.bf16
    if model == "llama31_405b":  # Llama 3.1 RoPE scaling
        assert (built.scale_factor, built.low_freq_factor, built.high_freq_factor, built.old_context_len) == (
            8.0, 1.0, 4.0, 8192)
    if precision == "fp8_current":  # the check has teeth: megatron-core refuses BF16 end layers with delayed scaling
        bad = copy.deepcopy(config)
        bad.fp8_recipe, bad.first_last_layers_bf16, bad.num_layers_at_start_in_bf16 = "delayed", True, 1
        with pytest.raises(Exception, match="first_last_layers_bf16"):
            fdl.build(bad)


def test_a_field_this_nemo_lacks_is_refused_unless_it_only_saves_memory():
    import nemo_run as run

    def plugin_of_nemo_2_4(precision: str, fp8=None, fp8_recipe: str = "delayed", fp8_param_gather=None):
        """MegatronMixedPrecision's arguments in NeMo 2.4, which has no reuse_grad_buf_for_mxfp8_param_ag."""

    recipe = run.Partial(llm.pretrain, trainer=run.Config(dict, plugins=run.Config(plugin_of_nemo_2_4, "bf16-mixed")))
    skipped = build.apply_fields(recipe, {"trainer.plugins.fp8_recipe": "mxfp8",
                                          "trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag": True})
    assert skipped == ["trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag"]
    assert recipe.trainer.plugins.fp8_recipe == "mxfp8"
    with pytest.raises(ConfigError, match=r"^engine=nemo: NeMo 2\.7\.3's recipe has no trainer\.plugins\.fp8_margin, "):
        build.apply_fields(recipe, {"trainer.plugins.fp8_margin": 0})


def test_nemos_iteration_line_is_read_by_the_report_parser(tmp_path):
    """ProgressPrinter's own formatting of the metrics NeMo logs (log_interval 2: iterations 1, 3, 5 are 0-based)."""
    printer = ProgressPrinter(log_interval=2)
    lines = [printer.format_string(f"Training epoch 0, iteration {it}/9", {
        "lr": 1e-4, "global_batch_size": 128.0, "global_step": float(it), "reduced_train_loss": 10.0 - it / 3,
        "train_step_timing in s": 1.25, "consumed_samples": 128.0 * (it + 1)}) for it in (1, 3, 5)]
    (tmp_path / "train.log").write_text("\n".join(lines) + "\n")
    read = read_log(tmp_path / "train.log", "train.log")
    assert read.format == "nemo2" and read.notes == []
    assert [(s.step, s.loss, s.time_s, s.global_batch_size) for s in read.steps] == [
        (2, 9.667, 1.25, 128), (4, 9.0, 1.25, 128), (6, 8.333, 1.25, 128)]  # the loss as NeMo prints it: 4 digits


def lightning_run(cfg, run_dir: Path, losses: list[float]):
    """A real Lightning trainer on the CPU whose module logs what NeMo's strategy and optimizer module log each
    step (reduced_train_loss, grad_norm, lr), with RunMetrics as in the recipe."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def training_step(self, batch, batch_idx):
            self.log("lr", self.optimizers().param_groups[0]["lr"], batch_size=1)
            loss = self.weight * 0 + losses[self.global_step]
            self.log("reduced_train_loss", loss, batch_size=1)
            self.log("grad_norm", 0.5, batch_size=1)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step"}}

    trainer = pl.Trainer(max_steps=len(losses), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RunMetrics(config_yaml=dump_config(cfg), run_dir=str(run_dir))])
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.zeros(16, 1)))


def test_metrics_callback_writes_the_other_engines_files(hydra_compose, tmp_path):
    cfg = hydra_compose("engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_8b", "model.num_layers=2")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")  # a previous start's
    lightning_run(cfg, tmp_path, [4.0, 3.0, 2.5, 2.0])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == [(1, 4.0, 0.5), (2, 3.0, 0.5), (3, 2.5, 0.5),
                                                                          (4, 2.0, 0.5)]
    assert [r["lr"] for r in records] == pytest.approx([0.1, 0.05, 0.025, 0.0125])  # each step's own (logged in FP32)
    tokens = 8 * 8192  # global batch x sequence on one process
    assert all(math.isclose(r["tokens_per_s_per_gpu"] * r["step_time_s"], tokens) for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["engine"], summary["precision"], summary["steps"], summary["final_loss"]) == (
        "nemo", "fp8_current", 4, 2.0)
    read = read_metrics_jsonl(tmp_path / "metrics.jsonl", "metrics.jsonl")  # as scripts/compare.py reads it
    assert [(s.step, s.loss) for s in read.steps] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)] and read.notes == []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # the same TensorBoard scalars as the other engines write
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]


def test_metrics_callback_records_a_non_finite_loss_and_stops(hydra_compose, tmp_path):
    cfg = hydra_compose("engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_8b", "model.num_layers=2")
    with pytest.raises(NonFiniteError, match="loss nan"):
        lightning_run(cfg, tmp_path, [4.0, 3.0, float("nan"), 2.0])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and math.isnan(records[-1]["loss"])
    assert not (tmp_path / "summary.json").exists()


def test_plan_reads_the_nemo_and_megatron_core_the_job_will_import():
    assert source_version("nemo") == "2.7.3" and source_version("megatron.core") == "0.16.1"
    assert build.versions() == ("2.7.3", "0.16.1")  # what the job reads from the imported packages


def test_entry_point_with_nemo_but_no_gpu_refuses_in_one_line(hydra_compose, tmp_path, capsys):
    from recipes.nemo.engine import main

    config = tmp_path / "config.yaml"
    save_config(hydra_compose("engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_8b"), config)
    assert main([str(config)]) == 1  # NeMo 2.7.3 can run fp8_current: the versions pass, the missing GPU does not
    assert capsys.readouterr().err == ("error: engine=nemo needs CUDA GPUs: NeMo's recipes train with Transformer "
                                       "Engine on GPUs\n")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_current"])
def test_engine_trains_a_llama3_8b_proxy_in_the_nemo_container(tmp_path, precision):
    """Inside the NeMo container on one GPU: two layers of Llama 3 8B, mock data, 20 steps through launch/run.py;
    NeMo's iteration lines and our metrics agree."""
    pytest.importorskip("transformer_engine", reason="the NeMo container's Transformer Engine")
    run_dir = tmp_path / "run"
    env = dict(os.environ, FP8_RECIPES_RUNS=str(tmp_path / "runs"))
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "run.py"), "engine=nemo", "model=llama3_8b", "model.num_layers=2",
         "model.seq_length=2048", f"precision={precision}", "data=mock", "trainer.max_steps=20",
         "trainer.micro_batch_size=1", "trainer.global_batch_size=4", "trainer.log_interval=1", f"run.dir={run_dir}"],
        env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (run_dir / "train.log").write_text(result.stdout)
    logged = read_log(run_dir / "train.log", "train.log")
    assert logged.format == "nemo2" and [s.step for s in logged.steps] == list(range(1, 21))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all(math.isclose(s.loss, r["loss"], rel_tol=1e-3) for s, r in zip(logged.steps, records))
    assert records[-1]["loss"] < records[0]["loss"]
    assert (run_dir / "nemo_recipe.yaml").is_file() and (run_dir / "summary.json").is_file()
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
