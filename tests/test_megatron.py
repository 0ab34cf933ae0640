"""engine=megatron on a CPU with the real megatron-core: published layouts, preflight, translation, model build.

Every GPU x model x precision composes with layout=published as a user would, is checked against REFERENCE.md
(section 5's layouts, section 2's architectures, section 4's FP8 presets, restated below as the test's own data),
and its TransformerConfig, DDP and optimizer configs are built, which runs megatron-core's own validation.
GPTModel is built on the meta device for the parameter counts. Training needs CUDA (see recipes.megatron.engine).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from recipes.config import REPO_ROOT, ConfigError, load_option
from recipes.layouts import lookup, table
from recipes.metrics import count_parameters
from recipes.plan import make_plan
from recipes.plan.checks import validate
from recipes.plan.memory import estimate_memory
from recipes.plan.parallel import data_parallel_size

translate = pytest.importorskip("recipes.megatron.translate")
from megatron.core.activations import squared_relu  # noqa: E402

# REFERENCE.md section 5, as published: GPU, model, dtype, GPUs, seq, TP, PP, CP, VP, MBS, GBS, FSDP.
PUBLISHED = """
h100 llama3_8b bf16 8 8192 1 1 2 1 1 128 -
h100 llama3_8b fp8 8 8192 1 1 1 1 1 128 fsdp
h100 llama3_70b bf16 64 8192 4 4 2 5 1 128 -
h100 llama3_70b fp8 64 8192 4 8 1 5 1 128 -
h100 llama31_405b bf16/fp8 1024 8192 8 8 2 8 1 512 -
h100 nemotron4_15b bf16/fp8 64 4096 2 1 1 1 2 256 -
h100 nemotron4_340b bf16/fp8 256 4096 8 8 1 12 1 64 -
b200 llama3_8b bf16/fp8 8 8192 1 1 1 1 2 128 -
b200 llama3_70b bf16 64 8192 2 4 2 5 1 128 -
b200 llama3_70b fp8 64 8192 1 1 1 1 1 128 fsdp
b200 llama31_405b bf16/fp8 128 8192 4 8 2 8 1 64 -
b200 nemotron4_15b bf16/fp8 64 4096 1 1 1 1 2 256 -
b200 nemotron4_340b bf16/fp8 128 4096 8 4 1 12 1 32 -
gb200 llama3_8b bf16 8 8192 1 1 1 1 2 128 -
gb200 llama3_8b fp8 8 8192 1 1 1 1 4 128 -
gb200 llama3_70b bf16/fp8 64 8192 1 1 1 1 1 128 fsdp
gb200 llama31_405b bf16 128 8192 4 8 2 8 1 64 -
gb200 llama31_405b fp8 128 8192 2 1 1 1 1 256 fsdp
gb200 nemotron4_15b bf16/fp8 64 4096 1 1 1 1 2 256 -
gb200 nemotron4_340b bf16 128 4096 4 8 1 12 1 32 -
gb200 nemotron4_340b fp8 128 4096 8 4 1 12 1 32 -
"""
# REFERENCE.md section 2: layers, hidden, ffn, heads, kv groups, head dim, vocab.
ARCHITECTURE = {
    "llama3_8b": (32, 4096, 14336, 32, 8, 128, 128256),
    "llama3_70b": (80, 8192, 28672, 64, 8, 128, 128256),
    "llama31_405b": (126, 16384, 53248, 128, 8, 128, 128256),
    "nemotron4_15b": (32, 6144, 24576, 48, 8, 128, 256000),
    "nemotron4_340b": (96, 18432, 73728, 96, 8, 192, 256000),
}
# REFERENCE.md section 4 (NeMo presets) as TransformerConfig / DDP fields. fp8_current keeps no layer in BF16, as
# NeMo's performance scripts run it; fp8_blockwise is E4M3 here (conf/precision/fp8_blockwise.yaml says why).
FP8_PRESETS = {
    "bf16": dict(fp8=None, fp8_recipe="delayed", fp8_param_gather=False),  # "delayed": megatron's unused default
    "fp8_delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max",
                        fp8_margin=0, fp8_param_gather=True, first_last_layers_bf16=False),
    "fp8_current": dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True, first_last_layers_bf16=False),
    "fp8_blockwise": dict(fp8="e4m3", fp8_recipe="blockwise", fp8_param_gather=False),
    "mxfp8": dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True),
}
PRECISIONS = list(FP8_PRESETS)
GPUS = ["h100", "h200", "b200", "gb200"]


def published_rows() -> dict[tuple[str, str, str], dict]:
    rows = {}
    for line in PUBLISHED.strip().splitlines():
        gpu, model, dtypes, gpus, seq, tp, pp, cp, vp, mbs, gbs, fsdp = line.split()
        for dtype in dtypes.split("/"):
            rows[gpu, model, dtype] = dict(gpus=int(gpus), seq=int(seq), tp=int(tp), pp=int(pp), cp=int(cp),
                                           vp=int(vp), mbs=int(mbs), gbs=int(gbs), fsdp=fsdp == "fsdp")
    return rows


def runs_natively(precision: str, gpu: str) -> bool:
    arch = load_option("gpu", gpu).arch
    return precision != "mxfp8" or arch == "blackwell"


@pytest.fixture(autouse=True)
def runs_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8_RECIPES_RUNS", str(tmp_path / "runs"))


# ---- the published layouts ----


def test_layout_table_is_reference_section_5_and_h200_takes_h100s():
    expected = published_rows()
    for (gpu, model, dtype), row in expected.items():
        found = lookup(gpu, model, "bf16" if dtype == "bf16" else "tensorwise")
        assert {k: found[k] for k in ("gpus", "tp", "pp", "cp", "vp", "mbs", "gbs", "fsdp")} == \
            {k: v for k, v in row.items() if k != "seq"}, (gpu, model, dtype)
        assert load_option("model", model).seq_length == row["seq"]
        if gpu == "h100":
            assert lookup("h200", model, "bf16" if dtype == "bf16" else "mxfp8") == found
    assert {gpu for gpu, _, _ in expected} | {"h200"} == set(table())


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model", list(ARCHITECTURE))
def test_every_published_layout_translates_and_validates_in_megatron_core(hydra_compose, tmp_path, gpu, model):
    """All five precisions of one GPU and model: the layout row, the architecture, the FP8 preset, and megatron-core
    building and validating TransformerConfig, DistributedDataParallelConfig and OptimizerConfig."""
    arch = ARCHITECTURE[model]
    for precision in PRECISIONS:
        cfg = hydra_compose("engine=megatron", "layout=published", "executor=slurm", f"gpu={gpu}", f"model={model}",
                            f"precision={precision}", "dryrun=true")
        if not runs_natively(precision, gpu):
            with pytest.raises(ConfigError, match="Blackwell"):
                validate(cfg)
            continue
        plan = make_plan(cfg, tmp_path / "config.yaml")
        row = published_rows()[gpu.replace("h200", "h100"), model, "bf16" if precision == "bf16" else "fp8"]
        p = cfg.parallel
        assert (p.tp, p.pp, p.cp, p.vp, p.fsdp) == (row["tp"], row["pp"], row["cp"], row["vp"], row["fsdp"])
        assert (cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size) == (row["mbs"], row["gbs"])
        assert plan.processes == row["gpus"] and cfg.executor.gpus == cfg.gpu.gpus_per_node

        tc = translate.transformer_config(cfg)
        assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads, tc.num_query_groups,
                tc.kv_channels) == arch[:6]
        assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size) == \
            (row["tp"], row["pp"], row["cp"])
        assert tc.virtual_pipeline_model_parallel_size == (row["vp"] if row["vp"] > 1 else None)
        assert tc.sequence_parallel == (row["tp"] > 1)
        assert tc.bf16 and tc.params_dtype == torch.bfloat16 and not tc.add_bias_linear
        kwargs = translate.gpt_model_kwargs(cfg)
        assert kwargs["vocab_size"] == arch[6] and not kwargs["share_embeddings_and_output_weights"]
        if model.startswith("llama"):
            assert tc.normalization == "RMSNorm" and not tc.layernorm_zero_centered_gamma
            assert tc.gated_linear_unit and tc.activation_func is F.silu
            assert (kwargs["rotary_base"], kwargs["rotary_percent"]) == (500000, 1.0)
            assert kwargs["rope_scaling"] == (model == "llama31_405b") and kwargs["rope_scaling_factor"] == 8.0
        else:
            assert tc.normalization == "LayerNorm" and tc.layernorm_zero_centered_gamma
            assert not tc.gated_linear_unit and tc.activation_func is squared_relu
            assert (kwargs["rotary_base"], kwargs["rotary_percent"]) == (10000, 0.5)
        assert tc.layernorm_epsilon == 1e-5

        ddp = translate.ddp_config(cfg)
        for name, value in FP8_PRESETS[precision].items():
            actual = getattr(ddp, name) if hasattr(ddp, name) and not hasattr(tc, name) else getattr(tc, name)
            assert actual == value, (precision, name)
        assert tc.fp8_param == FP8_PRESETS[precision]["fp8_param_gather"]
        assert not ddp.grad_reduce_in_fp32 and ddp.use_distributed_optimizer  # BF16, as NVIDIA's performance recipes
        assert ddp.use_megatron_fsdp == row["fsdp"]
        optimizer = translate.optimizer_config(cfg)
        assert optimizer.use_distributed_optimizer and optimizer.bf16
        assert optimizer.fp8_recipe == (None if precision == "bf16" else FP8_PRESETS[precision]["fp8_recipe"])


def test_command_line_wins_over_the_published_row(hydra_compose):
    cfg = hydra_compose("engine=megatron", "layout=published", "executor=slurm", "gpu=h100", "model=llama3_70b",
                        "precision=fp8_current", "parallel.pp=4", "parallel.vp=1", "executor.nodes=16",
                        "trainer.global_batch_size=256", "model.num_layers=8")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vp, cfg.parallel.cp) == (4, 4, 1, 1)
    assert (cfg.executor.nodes, cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size) == (16, 256, 1)
    assert data_parallel_size(cfg) == 16 * 8 // 16
    validate(cfg)
    assert translate.transformer_config(cfg).num_layers == 8


def test_without_a_layout_the_run_is_data_parallel_and_overrides_make_the_gpu_proxy(hydra_compose):
    """The lead's 2-GPU proxy runs: llama3_8b with 4 layers, TP=2 and PP=2, bf16, on the local spec."""
    base = ("engine=megatron", "gpu=h200", "model=llama3_8b", "model.num_layers=4", "precision=bf16",
            "executor.gpus=2", "trainer.micro_batch_size=1", "trainer.global_batch_size=8", "dryrun=true")
    default = hydra_compose(*base[:5])
    assert (default.parallel.tp, default.parallel.pp, default.parallel.cp, default.parallel.vp) == (1, 1, 1, 1)
    tp2 = hydra_compose(*base, "parallel.tp=2", "parallel.sp=false")
    pp2 = hydra_compose(*base, "parallel.pp=2")
    for cfg, (tp, pp) in ((tp2, (2, 1)), (pp2, (1, 2))):
        validate(cfg)
        tc = translate.transformer_config(cfg)
        assert (tc.num_layers, tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (4, tp, pp)
        assert not tc.sequence_parallel and data_parallel_size(cfg) == 1


# ---- preflight: each impossible layout names its fix ----

INVALID = {
    "heads": (("model=llama3_8b", "parallel.tp=3", "executor.gpus=3"), "num_attention_heads=32 is not divisible"),
    "vocabulary": (("model.vocab_size=330", "parallel.tp=4", "executor.gpus=4"), "model.vocab_size=330 is not divisible"),
    "query groups": (("model.num_attention_heads=12", "model.num_query_groups=3", "parallel.tp=2", "executor.gpus=2"),
                     "model.num_query_groups=3 must be a multiple or a divisor of parallel.tp=2"),
    "layers": (("model=llama3_8b", "parallel.pp=3", "executor.gpus=3"), "not divisible by parallel.pp x parallel.vp"),
    "virtual stages": (("model=llama3_8b", "parallel.pp=2", "parallel.vp=3", "executor.gpus=2"),
                       "parallel.pp x parallel.vp = 2 x 3 = 6"),
    "vp without pp": (("parallel.vp=2",), "needs parallel.pp > 1"),
    "global batch": (("parallel.tp=2", "executor.gpus=8", "trainer.micro_batch_size=2", "trainer.global_batch_size=12"),
                     "micro_batch_size x data-parallel size = 2 x 4 = 8"),
    "context": (("model.seq_length=250", "parallel.cp=2", "executor.gpus=2"), "divisible by 2 x parallel.cp = 4"),
    "world": (("parallel.tp=4", "executor.gpus=6"), "is not a multiple of parallel.tp x pp x cp"),
    "sp without tp": (("parallel.sp=true",), "parallel.sp=true needs tensor parallelism"),
    "delayed bf16 layers": (("precision=fp8_delayed", "precision.num_layers_at_start_in_bf16=1"),
                            "delayed scaling cannot keep first/last layers in BF16"),
    "bf16 layers per stage": (("precision=fp8_current", "precision.num_layers_at_end_in_bf16=3", "parallel.pp=2",
                               "executor.gpus=2"), "more than the 2 layers of one pipeline stage"),
    "mxfp8 on hopper": (("precision=mxfp8", "gpu=h100"), "engine=megatron cannot emulate"),
    "emulation": (("precision=mxfp8", "gpu=h100", "precision.emulate=true"), "precision.emulate=true is the torch"),
    "405b split": (("layout=published", "gpu=h100", "model=llama31_405b", "parallel.pp_embedding_loss_as_layers=false"),
                   "model.num_layers = 126 is not divisible"),
    "torch engine": (("engine=torch", "parallel.tp=2", "executor.gpus=2"), "engine=torch runs data-parallel only"),
    "no row": (("layout=published", "gpu=h100"), "no published layout for model=tiny_llama"),
    "auto gpu": (("layout=published", "gpu=auto", "model=llama3_8b"), "needs a named GPU"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_impossible_layout_is_a_config_error_naming_the_fix(hydra_compose, case):
    overrides, message = INVALID[case]
    base = ["engine=megatron", "executor=slurm", "gpu=h100", "dryrun=true"]
    with pytest.raises(ConfigError) as error:
        validate(hydra_compose(*base, *overrides))
    assert message in str(error.value)


# ---- memory estimate ----


def test_memory_estimate_shards_optimizer_states_and_recompute_shrinks_activations(hydra_compose):
    args = ("engine=megatron", "executor=slurm", "gpu=h100", "model=llama3_70b", "precision=bf16", "parallel.tp=8",
            "executor.nodes=4", "trainer.micro_batch_size=1", "trainer.global_batch_size=32", "dryrun=true")
    parameters = count_parameters(load_option("model", "llama3_70b"))
    base = hydra_compose(*args)
    memory = estimate_memory(base, parameters)
    per_gpu = parameters / 8  # TP 8, PP 1: all layers, an eighth of each
    assert memory.weights == pytest.approx(2 * per_gpu, rel=1e-3)  # BF16
    assert memory.gradients == pytest.approx(2 * per_gpu, rel=1e-3)  # BF16 main_grad, NVIDIA's performance setting
    fp32_buffer = estimate_memory(hydra_compose(*args, "megatron.grad_reduce_in_fp32=true"), parameters)
    assert fp32_buffer.gradients == pytest.approx(4 * per_gpu, rel=1e-3)
    assert memory.optimizer == pytest.approx(12 * per_gpu / 4, rel=1e-3)  # master + 2 moments over DP = 4
    replicated = estimate_memory(hydra_compose(*args, "parallel.distributed_optimizer=false"), parameters)
    assert replicated.optimizer == pytest.approx(12 * per_gpu, rel=1e-3)
    fsdp = estimate_memory(hydra_compose(*args, "parallel.fsdp=true"), parameters)
    assert fsdp.weights == pytest.approx(memory.weights / 4) and fsdp.gradients == pytest.approx(memory.gradients / 4)
    full = estimate_memory(hydra_compose(*args, "parallel.recompute=full"), parameters)
    selective = estimate_memory(hydra_compose(*args, "parallel.recompute=selective"), parameters)
    assert full.activations == memory.activations_full_recompute < selective.activations < memory.activations
    no_sp = estimate_memory(hydra_compose(*args, "parallel.sp=false"), parameters)
    assert no_sp.activations > memory.activations  # norms and residual replicated over the 8 TP ranks
    pipelined = estimate_memory(hydra_compose(*args, "parallel.tp=4", "parallel.pp=2"), parameters)
    assert pipelined.weights < memory.weights * 1.1  # half the layers on twice the weight share


def test_dryrun_shows_the_layout_and_the_estimate(tmp_path):
    env = {**os.environ, "FP8_RECIPES_RUNS": str(tmp_path / "runs"), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "launch" / "run.py"), "engine=megatron", "layout=published", "executor=slurm",
         "gpu=b200", "model=nemotron4_340b", "precision=mxfp8", "dryrun=true"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layout      tp 8 x pp 4 (vp 12) x cp 1 x dp 4, sequence parallel, distributed optimizer" in result.stdout
    assert "batch       micro 1 x 4 data-parallel x 8 accumulation = global 32" in result.stdout
    assert "with full recompute)" in result.stdout and " of 180 GB" in result.stdout
    assert "-m recipes.megatron.engine" in result.stdout and "--nnodes=16" in result.stdout


# ---- megatron-core's model: parameter counts ----


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_nemotron", "llama3_8b", "nemotron4_15b"])
def test_megatron_gpt_model_has_the_torch_engines_parameter_count(hydra_compose, megatron_state, model):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from recipes.megatron.build import build_model_chunks

    cfg = hydra_compose("engine=megatron", f"model={model}", "precision=bf16", "gpu=cpu")
    tc = translate.transformer_config(cfg, use_cpu_initialization=True)
    # The local spec's torch LayerNorm cannot hold Nemotron's zero-centred gamma (build.layer_spec refuses it
    # without Apex); centring changes how gamma is stored, not how many parameters there are.
    tc = dataclasses.replace(tc, perform_initialization=False, layernorm_zero_centered_gamma=False)
    with torch.device("meta"):
        (gpt,) = build_model_chunks(cfg, tc, get_gpt_layer_local_spec(normalization=tc.normalization))
    assert sum(p.numel() for p in gpt.parameters()) == count_parameters(cfg.model)


def test_local_spec_refuses_what_it_cannot_run(hydra_compose):
    from recipes.megatron.build import layer_spec

    fp8 = hydra_compose("engine=megatron", "precision=fp8_current", "gpu=cpu")
    with pytest.raises(ConfigError, match="needs Transformer Engine"):
        layer_spec(fp8, use_te=False)
    nemotron = hydra_compose("engine=megatron", "model=tiny_nemotron", "precision=bf16", "gpu=cpu")
    with pytest.raises(ConfigError, match="layernorm1p"):
        layer_spec(nemotron, use_te=False)
    sp = hydra_compose("engine=megatron", "precision=bf16", "gpu=cpu", "parallel.tp=2", "executor.gpus=2")
    with pytest.raises(ConfigError, match="parallel.sp=false"):
        layer_spec(sp, use_te=False)


# ---- the engine's CPU-testable parts: data, the iteration line, refusing a CPU ----


def test_megatron_datasets_give_each_data_parallel_rank_its_slice(hydra_compose, tmp_path):
    from recipes.data import tokenizer
    from recipes.megatron.data import MicroBatches, build_train_dataset

    for data in ("text", "mock"):
        cfg = hydra_compose("engine=megatron", "precision=bf16", "gpu=cpu", f"data={data}",
                            f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=3",
                            "trainer.micro_batch_size=2", "trainer.global_batch_size=8")
        dataset = build_train_dataset(cfg, rank=0)
        dp = 2
        step = [MicroBatches(dataset, cfg, r, dp).get(2, m) for m in range(2) for r in range(dp)]
        rows = torch.cat([b["tokens"] for b in step])
        assert rows.shape == (8, cfg.model.seq_length)
        expected = torch.stack([dataset[8 + i]["tokens"] for i in range(8)])  # step 2's samples, in order
        assert torch.equal(rows, expected)
        assert torch.equal(step[0]["labels"][:, :-1], step[0]["tokens"][:, 1:])
        assert int(rows.max()) <= tokenizer.EOD


def test_iteration_line_is_megatrons_and_the_report_reads_it(tmp_path):
    from recipes.trainer.console import megatron_iteration_line
    from recipes.metrics import StepMetrics
    from recipes.report.parse import read_log

    history = [StepMetrics(step=s, loss=2.0 + s, grad_norm=0.5, lr=1e-4,
                           step_time_s=30.0 if s == 1 else 1.0 + s / 10, tokens_per_s_per_gpu=1000.0,
                           model_tflops_per_gpu=400.0 + s, mfu=0.4, peak_memory_gib=10.0) for s in range(1, 11)]
    line = megatron_iteration_line(history[-2:], max_steps=100, global_batch_size=128, history=history)
    assert "] iteration       10/     100 | consumed samples:         1280 | elapsed time per iteration (ms): 1950.0 |" in line
    assert "| lm loss: 1.150000E+01 | loss scale: 1.0 | grad norm: 0.500 |" in line
    # the median of the run's ten step times (30 s for the first, compiled one; 1.2 .. 2.0 s after it) is 1.65 s,
    # not the interval's 1.95 s: 1.65 s x 90 steps left = 148.5 s
    assert line.endswith(" ETA: 0:02:28 |")
    single = megatron_iteration_line(history[:1], max_steps=100, global_batch_size=128, history=history[:1])
    assert single.endswith(" ETA: 0:49:30 |")  # only the first step is known: 30 s x 99
    log = tmp_path / "train.log"
    log.write_text(line + "\n")
    (record,) = read_log(log, "train.log").steps
    assert (record.step, record.loss, record.time_s, record.tflops_per_gpu) == (10, 11.5, 1.95, 409.5)
    assert record.global_batch_size == 128 and record.nan_iterations == 0


def test_engine_and_plan_refuse_a_cpu_with_the_fix(hydra_compose, tmp_path):
    from recipes.folders import save_config
    from recipes.megatron.engine import main

    cfg = hydra_compose("engine=megatron", "precision=bf16", "gpu=cpu")
    with pytest.raises(ConfigError, match="engine=megatron needs CUDA GPUs.*engine=torch"):
        validate(cfg)
    if not torch.cuda.is_available():
        save_config(cfg, tmp_path / "config.yaml")
        assert main([str(tmp_path / "config.yaml")]) == 1


# ---- the engine itself, on CPUs through tests/megatron_on_cpu.py (megatron-core's CUDA calls pointed at the CPU) ----


def run_engine_on_cpu(config_path, processes: int) -> subprocess.CompletedProcess:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run(  # --standalone: torchrun's rendezvous binds a free port itself (no probe-then-bind race)
        [torchrun, "--standalone", f"--nproc-per-node={processes}",
         str(REPO_ROOT / "tests" / "megatron_on_cpu.py"), str(config_path)],
        # PYTHONFAULTHANDLER: a rank that dies of a signal prints every thread's stack (once, under the full suite, a
        # rank died of SIGBUS in torch's Gloo thread, pt_gloo_runloop, and left no trace).
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
             "LOGLEVEL": "WARNING", "PYTHONFAULTHANDLER": "1"},
        capture_output=True, text=True, timeout=300,
    )


def train_tiny_llama_on_two_cpus(hydra_compose, tmp_path, *overrides: str):
    """engine=megatron in BF16, 4 steps of 2 x 2 samples on two processes, into tmp_path/run: (cfg, run dir, the
    finished torchrun)."""
    from recipes.folders import save_config

    cfg = hydra_compose("engine=megatron", "precision=bf16", "gpu=h200", "executor.gpus=2", "trainer.max_steps=4",
                        "trainer.micro_batch_size=2", "trainer.global_batch_size=4",
                        f"data.cache_dir={tmp_path / 'cache'}", "dryrun=true", *overrides)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(dataclasses.replace(cfg, dryrun=False), run_dir / "config.yaml")
    result = run_engine_on_cpu(run_dir / "config.yaml", processes=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return cfg, run_dir, result


def test_engine_trains_two_pipeline_stages_writes_metrics_and_resumes_exactly(hydra_compose, tmp_path):
    import json
    import math
    from importlib.util import find_spec

    from recipes.metrics import StepMetrics
    from recipes.report.parse import read_log

    checkpoints = find_spec("psutil") is not None  # dist_checkpointing needs it (a dependency in pyproject)
    cfg, run_dir, result = train_tiny_llama_on_two_cpus(
        hydra_compose, tmp_path, "parallel.pp=2", "trainer.log_interval=2",
        f"trainer.checkpoint.interval={2 if checkpoints else 0}", "trainer.profile_step=3")

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(set(m) == {f.name for f in dataclasses.fields(StepMetrics)} for m in metrics)
    assert abs(metrics[0]["loss"] - math.log(cfg.model.vocab_size)) < 0.5  # a fresh model: about uniform
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["engine"], summary["world_size"], summary["steps"]) == ("megatron", 2, 4)
    # BF16 where the CPU has it natively, else FP32 (megatron-core's bf16=False), as the torch engine
    native_bf16 = torch.backends.mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert summary["compute_dtype"] == ("bf16" if native_bf16 else "fp32")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # the logging rank's TensorBoard scalars, as for the torch engine
    for field in sorted({f.name for f in dataclasses.fields(StepMetrics)} - {"step"}):  # MFU against gpu=h200's peak
        assert [(e.step, e.value) for e in events.Scalars(f"train/{field}")] == [
            (m["step"], pytest.approx(m[field], rel=1e-6)) for m in metrics], field
    log = tmp_path / "stdout.log"
    log.write_text(result.stdout)
    logged = read_log(log, "stdout").steps
    assert [s.step for s in logged] == [2, 4]
    assert logged[-1].loss == pytest.approx((metrics[2]["loss"] + metrics[3]["loss"]) / 2, rel=1e-6)
    assert "profile of step 3 (rank 0)" in result.stdout  # trainer.profile_step: each rank traces step 3
    for rank in (0, 1):
        split = json.loads((run_dir / "profile" / f"time_rank{rank}.json").read_text())
        assert (split["step"], split["timed"]) == (3, "operators") and split["ms"]["gemm"] > 0
        assert (run_dir / "profile" / f"trace_rank{rank}.json").stat().st_size > 0

    if checkpoints:  # step 4's checkpoint damaged: resume from step 2 and repeat steps 3 and 4 bit for bit
        newest = run_dir / "checkpoints" / "step_00000004"
        manifest = json.loads((newest / "manifest.json").read_text())["files"]
        assert {"run.pt", ".metadata"} <= set(manifest) and any(name.endswith(".distcp") for name in manifest)
        shard = next(path for path in sorted(newest.iterdir()) if path.suffix == ".distcp")
        shard.write_bytes(shard.read_bytes()[:100])
        result = run_engine_on_cpu(run_dir / "config.yaml", processes=2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"checkpoint {newest} is damaged ({shard.name} is 100 bytes" in result.stdout
        assert "falling back to the newest intact checkpoint" in result.stdout
        assert "resuming from step 2" in result.stdout
        assert (run_dir / "checkpoints" / "step_00000004.damaged").is_dir()
        resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # Measurements aside: time, and on a CPU the peak memory (the process's maximum RSS, which loading the
        # checkpoint raises in the resumed run).
        assert resumed == [{**m, "step_time_s": r["step_time_s"], "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                            "model_tflops_per_gpu": r["model_tflops_per_gpu"], "mfu": r["mfu"],
                            "peak_memory_gib": r["peak_memory_gib"]}
                           for m, r in zip(metrics, resumed)]


def test_megatron_fsdp_checkpoints_on_two_ranks_and_resumes_exactly(hydra_compose, tmp_path):
    """Megatron-FSDP saves its DTensor shards through torch.distributed.checkpoint ("fsdp_dtensor"): with ranks
    whose shards of some parameters are empty (Adam keeps no state for those), the save completes, and a run
    resumed from step 2 repeats steps 3 and 4 bit for bit."""
    import json

    _, run_dir, _ = train_tiny_llama_on_two_cpus(hydra_compose, tmp_path, "parallel.fsdp=true",
                                                 "trainer.checkpoint.interval=2")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    newest = run_dir / "checkpoints" / "step_00000004"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"} <= {path.name for path in newest.iterdir()}

    os.rename(newest, run_dir / "checkpoints" / "step_00000004.removed")
    result = run_engine_on_cpu(run_dir / "config.yaml", processes=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from step 2" in result.stdout
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed] == \
        [(m["step"], m["loss"], m["grad_norm"]) for m in metrics]


def test_one_process_without_torchrun_gets_a_local_store_bound_as_it_is_made(monkeypatch):
    """The plan runs engine=megatron on one GPU as `python -m recipes.megatron.engine` (no torchrun, no
    MASTER_ADDR); megatron-core still needs a process group. The store binds a port the OS picks as it is made, so
    runs started side by side cannot be handed the same one (a port probed free and bound later could be: eleven
    resume checks started at once on an H200 failed one run with 'The server socket has failed to listen')."""
    from recipes.megatron.engine import _single_process_store

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    stores = [_single_process_store() for _ in range(8)]
    assert len({store.port for store in stores}) == 8 and all(store.port > 0 for store in stores)
    stores[0].set("rank0", "up")  # a working store, not only a number
    assert stores[0].get("rank0") == b"up"
    monkeypatch.setenv("MASTER_ADDR", "node001")
    assert _single_process_store() is None  # torchrun's env:// variables


def test_fsdp2_gradient_reduction_option_is_refused_on_megatron(hydra_compose):
    from recipes.plan.checks import validate

    cfg = hydra_compose("engine=megatron", "gpu=h200", "precision=bf16", "trainer.grad_reduce=per_micro_batch", "dryrun=true")
    with pytest.raises(ConfigError, match="trainer.grad_reduce is the torch engine's"):
        validate(cfg)


@pytest.mark.parametrize("override, message", [
    ("trainer.fsdp_fp8_all_gather=true", "trainer.fsdp_fp8_all_gather is the torch engine's"),
    ("trainer.fused_loss=false", "on engine=megatron use megatron.cross_entropy_loss_fusion=false"),
])
def test_torch_engine_options_are_refused_on_megatron(hydra_compose, override, message):
    from recipes.plan.checks import validate

    cfg = hydra_compose("engine=megatron", "gpu=h200", "precision=fp8_current", override, "dryrun=true")
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_megatron_fsdp_load_sets_the_fp8_scales_before_the_weights_hook_casts_with_them():
    """Megatron-FSDP's load hook casts the loaded main weights into the FP8 compute weights with each layer's scale,
    which delayed scaling keeps in TE's extra state; restored after the weights, the cast used the fresh model's
    scales (on an H200 the FSDP fp8_delayed resume came out 3.8e-02 apart). A layer here keeps its scale as extra
    state, and the chunk's load hook records the scale it finds, as the cast would use it."""
    import struct

    from recipes.megatron.checkpoint import restore_chunk

    class ScaledLayer(torch.nn.Module):  # TE's layer: a weight, and a scale kept as extra state (bytes)
        def __init__(self):
            super().__init__()
            self.weight, self.scale = torch.nn.Parameter(torch.zeros(4)), 1.0

        def get_extra_state(self):
            return torch.frombuffer(bytearray(struct.pack("f", self.scale)), dtype=torch.uint8)

        def set_extra_state(self, state):
            self.scale = struct.unpack("f", bytes(state.numpy()))[0]

    class Chunk(torch.nn.Module):  # megatron-core's FSDP adapter: extra state left out, the rest loaded
        def __init__(self):
            super().__init__()
            self.layer, self.scales_cast_with = ScaledLayer(), []
            self.register_load_state_dict_post_hook(lambda module, keys: self.scales_cast_with.append(self.layer.scale))

        def load_state_dict(self, state_dict, strict=True):
            return super().load_state_dict(state_dict, strict=False)

    trained = Chunk()
    trained.layer.scale = 448.0 / 3.0
    with torch.no_grad():
        trained.layer.weight.fill_(0.5)
    weights = {k: v for k, v in trained.state_dict().items() if not k.endswith("_extra_state")}
    extra = {"layer": bytes(trained.layer.get_extra_state().numpy())}

    resumed = Chunk()
    restore_chunk(resumed, weights, extra)
    assert resumed.scales_cast_with == [pytest.approx(448.0 / 3.0)]
    assert torch.equal(resumed.layer.weight, trained.layer.weight)


@pytest.mark.parametrize("before", [None, "0"])
def test_resume_trusts_transformer_engines_pickled_extra_state_only_while_loading(monkeypatch, before):
    """TE 2.20 refuses to unpickle delayed scaling's extra state without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1;
    MegatronCheckpoint.read sets it while it loads the run's own checkpoint and leaves the user's setting as it was."""
    from recipes.megatron.checkpoint import TE_UNSAFE_PICKLE, own_te_extra_state_trusted

    if before is None:
        monkeypatch.delenv(TE_UNSAFE_PICKLE, raising=False)
    else:
        monkeypatch.setenv(TE_UNSAFE_PICKLE, before)
    with own_te_extra_state_trusted():
        assert os.environ[TE_UNSAFE_PICKLE] == "1"
    assert os.environ.get(TE_UNSAFE_PICKLE) == before
    with pytest.raises(ValueError), own_te_extra_state_trusted():
        raise ValueError("a failed load")
    assert os.environ.get(TE_UNSAFE_PICKLE) == before
