"""engine=nemo without NeMo: the mapping of a run onto NeMo's recipe fields, the preflight, and the entry point where
NeMo is missing. (With NeMo 2.7.3 installed, tests/test_nemo_recipes.py builds the real recipes; the Slurm
script and a submission are in tests/test_slurm.py.)

Expected values are written out by hand from REFERENCE section 5 (layouts), NeMo's precision presets and NVIDIA's
performance scripts (scripts/performance/helpers.py), not read back from the mapping.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from recipes.config import ConfigError, Engine
from recipes.folders import save_config
from recipes.metrics import count_parameters
from recipes.nemo.mapping import data_module, recipe_fields, tokenizer_vocab_size
from recipes.nemo.preflight import check_versions, source_version
from recipes.plan import make_plan
from recipes.plan.describe import describe
from recipes.plan.memory import estimate_memory

REPO = Path(__file__).resolve().parent.parent
NEMO = ("engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_8b")
OVERLAP = "trainer.callbacks[MegatronCommOverlapCallback]"
NEMO_HERE = importlib.util.find_spec("nemo") is not None


def subset(fields: dict, keys) -> dict:
    return {key: fields[key] for key in keys if key in fields}


def test_published_llama3_70b_fp8_delayed_on_h100_maps_onto_the_recipe(hydra_compose, tmp_path):
    cfg = hydra_compose(*NEMO, "model=llama3_70b", "precision=fp8_delayed", "layout=published",
                        "trainer.checkpoint.interval=25", "trainer.checkpoint.keep_last=3")
    fields = recipe_fields(cfg, tmp_path)
    expected = {
        # REFERENCE 5, H100 llama3_70b fp8: 64 GPUs, TP 4, PP 8, CP 1, VP 5, MBS 1, GBS 128
        "trainer.num_nodes": 8, "trainer.devices": 8,
        "trainer.strategy.tensor_model_parallel_size": 4, "trainer.strategy.pipeline_model_parallel_size": 8,
        "trainer.strategy.virtual_pipeline_model_parallel_size": 5, "trainer.strategy.context_parallel_size": 1,
        "trainer.strategy.sequence_parallel": True, "trainer.strategy.pipeline_dtype": torch.bfloat16,
        "trainer.strategy.account_for_embedding_in_pipeline_split": False,
        "optim.config.use_distributed_optimizer": True,
        "model.config.recompute_granularity": None,
        # data parallel 2, PP and VP: the all-gather would overlap the optimizer step, but not with checkpoints
        f"{OVERLAP}.overlap_param_gather_with_optimizer_step": False,
        # NeMo's bf16_with_fp8_mixed preset, and the performance scripts' BF16 gradient reduction
        "trainer.plugins.fp8": "hybrid", "trainer.plugins.fp8_recipe": "delayed", "trainer.plugins.fp8_margin": 0,
        "trainer.plugins.fp8_amax_history_len": 1024, "trainer.plugins.fp8_amax_compute_algo": "max",
        "trainer.plugins.fp8_param_gather": True, "trainer.plugins.first_last_layers_bf16": False,
        "trainer.plugins.grad_reduce_in_fp32": False, "optim.config.use_precision_aware_optimizer": False,
        "model.config.num_layers": 80, "model.config.hidden_size": 8192, "model.config.seq_length": 8192,
        "optim.lr_scheduler.max_steps": 100, "optim.lr_scheduler.warmup_steps": 10,
        "optim.lr_scheduler.constant_steps": 0, "optim.lr_scheduler.min_lr": 1e-4, "optim.config.lr": 1e-3,
        "trainer.max_steps": 100, "trainer.limit_val_batches": 0, "trainer.strategy.progress_interval": 10,
        "log.explicit_log_dir": str(tmp_path / "nemo"), "trainer.enable_checkpointing": True,
        "log.ckpt.dirpath": str(tmp_path / "checkpoints"), "log.ckpt.every_n_train_steps": 25,
        "log.ckpt.save_top_k": 3, "log.ckpt.monitor": "step", "log.ckpt.mode": "max",
        "resume.resume_from_directory": str(tmp_path / "checkpoints"),
    }
    assert subset(fields, expected) == expected
    assert "trainer.strategy.fsdp" not in fields and "trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag" not in fields


def test_without_checkpoints_nothing_is_saved_and_the_gather_overlaps_the_optimizer(hydra_compose, tmp_path):
    cfg = hydra_compose(*NEMO, "model=llama3_70b", "precision=bf16", "layout=published")
    fields = recipe_fields(cfg, tmp_path)
    # H100 llama3_70b bf16: TP 4, PP 4, CP 2, VP 5 on 64 GPUs -> data parallel 2
    expected = {
        "log.ckpt": None, "trainer.enable_checkpointing": False,
        f"{OVERLAP}.overlap_param_gather_with_optimizer_step": True, "trainer.strategy.context_parallel_size": 2,
        "optim.config.use_precision_aware_optimizer": True, "trainer.plugins.grad_reduce_in_fp32": False}
    assert subset(fields, expected) == expected
    assert not [key for key in fields if key.startswith("trainer.plugins.fp8")]  # BF16 sets no FP8 field
    no_vp = recipe_fields(hydra_compose(*NEMO, "executor.nodes=2", "parallel.pp=2", "trainer.global_batch_size=64"),
                          tmp_path)
    assert no_vp[f"{OVERLAP}.overlap_param_gather_with_optimizer_step"] is False
    assert no_vp["trainer.strategy.virtual_pipeline_model_parallel_size"] is None


def test_megatron_fsdp_layout_sets_what_the_performance_scripts_set(hydra_compose, tmp_path):
    cfg = hydra_compose(*NEMO, "precision=fp8_current", "layout=published")  # H100 llama3_8b fp8: FSDP
    fields = recipe_fields(cfg, tmp_path)
    expected = {
        "trainer.strategy.fsdp": "megatron",
        "trainer.strategy.ddp.data_parallel_sharding_strategy": "optim_grads_params",
        "model.config.init_model_with_meta_device": True, "model.config.gradient_accumulation_fusion": False,
        f"{OVERLAP}.defer_embedding_wgrad_compute": False, "trainer.strategy.pipeline_dtype": None,
        "trainer.strategy.sequence_parallel": False, "trainer.plugins.fp8_recipe": "tensorwise"}
    assert subset(fields, expected) == expected


@pytest.mark.parametrize("recompute, expected", [
    ("full", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    ("selective", {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
])
def test_recompute_is_megatron_cores(hydra_compose, tmp_path, recompute, expected):
    fields = recipe_fields(hydra_compose(*NEMO, f"parallel.recompute={recompute}"), tmp_path)
    assert {k.removeprefix("model.config."): v for k, v in fields.items() if "recompute" in k} == expected


def test_mxfp8_reuses_the_gradient_buffer_only_with_fp8_weights(hydra_compose, tmp_path):
    cfg = hydra_compose(*NEMO, "gpu=b200", "precision=mxfp8")
    fields = recipe_fields(cfg, tmp_path)
    assert subset(fields, ["trainer.plugins.fp8", "trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag",
                           f"{OVERLAP}.overlap_param_gather"]) == {
        "trainer.plugins.fp8": "e4m3", "trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag": True,
        f"{OVERLAP}.overlap_param_gather": False}
    off = recipe_fields(hydra_compose(*NEMO, "gpu=b200", "precision=mxfp8", "precision.fp8_param_gather=false"),
                        tmp_path)
    assert off["trainer.plugins.reuse_grad_buf_for_mxfp8_param_ag"] is False
    assert f"{OVERLAP}.overlap_param_gather" not in off


def test_data_modules_and_the_exact_vocabulary(hydra_compose, tmp_path):
    mock = hydra_compose(*NEMO, "data=mock", "trainer.max_steps=30")
    assert data_module(mock, None) == ("MockDataModule", {"seq_length": 8192, "micro_batch_size": 4,
                                                          "global_batch_size": 8, "num_train_samples": 240})
    text = hydra_compose(*NEMO, "model=nemotron4_15b", "data.path=/data/corpus", f"data.cache_dir={tmp_path}")
    assert data_module(text, "/data/corpus") == ("PreTrainingDataModule", {
        "seq_length": 4096, "micro_batch_size": 4, "global_batch_size": 8, "paths": ["/data/corpus"], "seed": 1234,
        "split": "100,0,0", "index_mapping_dir": str(tmp_path / "megatron-index")})
    # NullTokenizer(V) has V + 1 ids, which NeMo pads to a multiple of 128: 128255 -> 128256, 255999 -> 256000
    assert (tokenizer_vocab_size(mock), tokenizer_vocab_size(text)) == (128255, 255999)


@pytest.mark.parametrize("overrides, message", [
    (("model=tiny_llama",), "NeMo has none for model=tiny_llama: choose llama3_8b"),
    (("model.rope_base=10000",), "keeps NeMo's model class for llama3_8b, which fixes model.rope_base"),
    (("trainer.activation_checkpointing=true",),
     "no counterpart in NeMo's recipe on engine=nemo: use parallel.recompute=full"),
    (("trainer.compile=true",), "trainer.compile=true has no counterpart"),
    (("trainer.grad_reduce=per_micro_batch",), "trainer.grad_reduce=per_micro_batch has no counterpart"),
    (("trainer.fsdp_fp8_all_gather=true",), "use precision.fp8_param_gather"),
    (("trainer.fused_loss=false",), "NeMo's recipe sets megatron-core's cross-entropy fusion"),
    (("trainer.profile_step=3",), "profile NeMo with nsys"),
    (("trainer.seed=7",), "NeMo seeds the model's weights with 1234"),
    (("gpu=cpu",), "engine=nemo needs CUDA GPUs"),
    (("precision=mxfp8",), "Blackwell GPUs (b200, gb200); gpu=h100 is hopper. Choose fp8_current or fp8_delayed "
                           "or fp8_blockwise (engine=nemo cannot emulate)"),
    (("precision=fp8_blockwise", "precision.emulate=true"), "engine=nemo runs Transformer Engine's kernels"),
    (("precision=fp8_blockwise_1d1d",), "precision.x/w/grad_block_scaling_dim = [1, 1, 1] has no counterpart"),
    (("precision=fp8_rowwise",), "precision=fp8_rowwise is torchao's row-wise recipe, which Transformer Engine"),
    (("precision=fp8_delayed", "precision.num_layers_at_start_in_bf16=1"), "engine=nemo: delayed scaling cannot keep"),
    (("parallel.tp=3", "executor.gpus=6"), "model.num_attention_heads=32 is not divisible by parallel.tp=3"),
])
def test_preflight_refuses_what_nemo_cannot_run(hydra_compose, tmp_path, overrides, message):
    cfg = hydra_compose(*NEMO, *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan(cfg, tmp_path / "config.yaml")


@pytest.mark.parametrize("precision, nemo, megatron_core, message", [
    ("bf16", "2.2.1", None, "precision=bf16 on engine=nemo needs NeMo >= 2.3 (bf16_mixed); this NeMo is 2.2.1"),
    ("fp8_current", "2.3.0rc0", "0.12.0", None),
    ("fp8_blockwise", "2.3.1", "0.13.0",
     "needs NeMo >= 2.4 (bf16_with_fp8_subchannel_scaling_mixed); this NeMo is 2.3.1"),
    ("fp8_blockwise", "2.4.0", "0.12.2", "needs megatron-core >= 0.13; this megatron-core is 0.12.2"),
    ("fp8_blockwise", "2.4.0", "0.13.0+abc", None),
    ("fp8_blockwise", "2.4.0", None, None),  # megatron-core unknown here: the job checks it
    ("mxfp8", "2.7.3", "0.16.1", None),
    ("fp8_delayed", "3.0.0", "0.16.1", "NeMo 3.0.0 has no LLM recipes"),
])
def test_nemo_versions_each_precision_needs(hydra_compose, precision, nemo, megatron_core, message):
    cfg = hydra_compose(*NEMO, "gpu=b200", f"precision={precision}")
    if message is None:
        check_versions(cfg, nemo, megatron_core)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_versions(cfg, nemo, megatron_core)


def test_versions_are_read_from_package_info():
    assert source_version("megatron.core") == metadata.version("megatron-core")  # its package_info.py, unimported
    assert source_version("no_such_package") is None


def test_plan_names_the_recipe_the_plugin_and_the_image(hydra_compose, tmp_path):
    cfg = hydra_compose(*NEMO, "model=nemotron4_15b", "precision=fp8_blockwise", "layout=published")
    lines = describe(make_plan(cfg, tmp_path / "config.yaml")).splitlines()
    (recipe,) = [line for line in lines if line.startswith("nemo ")]
    assert recipe == ("nemo        nemo.collections.llm.recipes.nemotron4_15b.pretrain_recipe(performance_mode=True), "
                      "built in the job by the NeMo of image nvcr.io/nvidia/nemo:25.04; needs NeMo 2.4 to 2.7 with "
                      "megatron-core >= 0.13 (checked there before anything is built)")
    (plugin,) = [line for line in lines if line.startswith("plugin ")]
    assert plugin.startswith("plugin      bf16_with_fp8_subchannel_scaling_mixed() with grad_reduce_in_fp32=False, "
                             "fp8=e4m3, fp8_recipe=blockwise")
    assert "fp8_param_gather=False" in plugin
    assert any(line.startswith("layout      tp 2 x pp 1 x cp 1 x dp 32") for line in lines)  # H100 nemotron4_15b


def test_memory_estimate_counts_nemos_bf16_gradient_buffer(hydra_compose):
    nemo = hydra_compose(*NEMO, "model=llama3_70b", "layout=published")
    parameters = count_parameters(nemo.model)
    megatron = dataclasses.replace(nemo, engine=Engine.megatron)
    fp32_buffer = estimate_memory(dataclasses.replace(
        megatron, megatron=dataclasses.replace(megatron.megatron, grad_reduce_in_fp32=True)), parameters)
    assert estimate_memory(nemo, parameters).gradients == pytest.approx(fp32_buffer.gradients / 2)  # 2 bytes, not 4
    assert estimate_memory(nemo, parameters).gradients == estimate_memory(megatron, parameters).gradients  # both BF16
    assert estimate_memory(nemo, parameters).optimizer == fp32_buffer.optimizer


def run_without_nemo(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, FP8_RECIPES_RUNS=str(cwd / "runs"), FP8_RECIPES_CACHE=str(cwd / "cache"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(NEMO_HERE, reason="this Python has NeMo; the refusal is of a Python without it")
def test_local_run_without_nemo_says_so_in_one_line(tmp_path):
    result = run_without_nemo([str(REPO / "launch" / "run.py"), "engine=nemo", "model=llama3_8b", "gpu=h100"], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: engine=nemo with executor=local runs NeMo from this Python ({sys.executable}), which has no NeMo: "
        "run inside the NeMo container, or use executor=slurm (it runs in executor.slurm.container_image, NeMo's "
        "container by default)"]


@pytest.mark.skipif(NEMO_HERE, reason="this Python has NeMo; the refusal is of a Python without it")
def test_entry_point_without_nemo_says_so_in_one_line(hydra_compose, tmp_path):
    config = tmp_path / "config.yaml"
    save_config(hydra_compose(*NEMO), config)
    result = run_without_nemo(["-m", "recipes.nemo.engine", str(config)], REPO)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: engine=nemo runs inside the NeMo container, and this Python "
                                     f"({sys.executable}) has no NeMo: submit with executor=slurm and "
                                     "executor.slurm.container_image set to a NeMo 2 image")
