"""engine=megatron's tuning switches (cfg.megatron) on a CPU with the real megatron-core 0.16.1: each one reaches
megatron-core's TransformerConfig, DistributedDataParallelConfig or OptimizerConfig; auto follows the kernels the
machine can load; a switch that cannot run is refused in one line naming the fix; the plan says which.

Kernels this machine lacks are simulated honestly: Apex's extensions by an empty module of their name on sys.path,
which the real import check (translate.available_kernels) then finds; Transformer Engine and CUDA by Kernels(...)
handed to the translation, with TE's fused-RoPE entry point, the one megatron-core's TransformerConfig checks at
construction, set to a stand-in. The GPU tests at the end (`pytest -m gpu`) build the Transformer Engine model for
real.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from recipes.config import ConfigError
from recipes.plan.checks import megatron_tuning, validate

translate = pytest.importorskip("recipes.megatron.translate")
from recipes.megatron.translate import Kernels, NO_KERNELS, available_kernels  # noqa: E402

# a GPU, TE and megatron-core 0.16.1 from pip
WITH_TE = Kernels(transformer_engine=True, wgrad_accumulation=True, apex_softmax=False, graphs_take_fp8_weights=False)
BASE = ("engine=megatron", "gpu=h200", "model=llama3_8b", "model.num_layers=2", "precision=fp8_current", "dryrun=true")


@pytest.fixture
def te_rope(monkeypatch):
    """TransformerConfig(apply_rope_fusion=True) asks megatron-core's rope_utils for TE's fused kernel."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *args, **kwargs: None)


@pytest.fixture
def apex_importable(tmp_path, monkeypatch):
    """Apex's two extensions, importable by name as in the NeMo container (empty stand-ins: nothing calls them)."""
    for name in ("fused_weight_gradient_mlp_cuda", "scaled_upper_triang_masked_softmax_cuda"):
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


def configs(cfg, kernels: Kernels) -> dict:
    return {"tc": translate.transformer_config(cfg, kernels), "ddp": translate.ddp_config(cfg),
            "opt": translate.optimizer_config(cfg)}


# ---- gradient-accumulation fusion: every linear, wherever CUDA builds the model ----


def test_gradient_accumulation_fusion_is_on_wherever_cuda_builds_the_model(hydra_compose):
    cfg = hydra_compose(*BASE)
    assert translate.wgrad_fusion(cfg, WITH_TE) is True
    assert translate.wgrad_fusion(cfg, dataclasses.replace(WITH_TE, transformer_engine=False)) is True  # local spec
    assert translate.wgrad_fusion(cfg, None) is None  # the job's machine decides
    assert not available_kernels().wgrad_accumulation  # this CPU machine: megatron-core's fused backward needs CUDA
    assert translate.wgrad_fusion(cfg, available_kernels()) is False
    # kept under CUDA graphs (megatron-core's graphs keep its one flag); off under Megatron-FSDP, as NeMo; off asked
    assert translate.wgrad_fusion(hydra_compose(*BASE, "megatron.cuda_graphs=true"), WITH_TE) is True
    assert translate.wgrad_fusion(hydra_compose(*BASE, "parallel.fsdp=true"), WITH_TE) is False
    assert translate.wgrad_fusion(hydra_compose(*BASE, "megatron.gradient_accumulation_fusion=false"), WITH_TE) is False


def test_apex_extension_is_found_and_kept(apex_importable, monkeypatch):
    from megatron.core.tensor_parallel import layers
    from recipes.megatron import wgrad

    assert available_kernels().wgrad_accumulation  # the stand-in is found by the real check, on a CPU too
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", "apex's", raising=False)
    wgrad.install()
    assert layers.fused_weight_gradient_mlp_cuda == "apex's"


def test_without_apex_the_output_layer_builds_with_the_fusion(hydra_compose, te_rope, megatron_state, monkeypatch):
    """The failure of issue 15: with megatron-core's flag on and no Apex, its ColumnParallelLinear (the output layer)
    refuses to build. recipes.megatron.wgrad takes Apex's place, and build() installs it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import layers
    from recipes.megatron import wgrad
    from recipes.megatron.build import build_model_chunks

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)  # as imported without Apex
    cfg = hydra_compose(*BASE)
    tc = translate.transformer_config(cfg, WITH_TE, use_cpu_initialization=True)
    assert tc.gradient_accumulation_fusion
    tc = dataclasses.replace(tc, perform_initialization=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")  # TE's spec needs TE; the output layer is the same
    with torch.device("meta"):
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            build_model_chunks(cfg, tc, spec)
        monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)  # restored after
        wgrad.install()
        (model,) = build_model_chunks(cfg, tc, spec)
    assert model.output_layer.gradient_accumulation_fusion
    assert layers.fused_weight_gradient_mlp_cuda is wgrad


@pytest.mark.parametrize("buffer", [torch.float32, torch.bfloat16])
def test_the_fused_output_layer_adds_its_weight_gradient_into_main_grad(megatron_state, monkeypatch, buffer):
    """megatron-core's own fused backward (LinearWithGradAccumulationAndAsyncCommunication) through
    recipes.megatron.wgrad, two micro-batches into one main_grad, against the unfused path: megatron-core's BF16
    wgrad added afterwards, as its DDP hook does. FP32 buffer: the fused sum is the exact products summed in FP32,
    so it is at least as close to the FP64 sum as the unfused one. On a CPU megatron-core's backward allocates its
    placeholder gradient on torch.cuda.current_device(): the stand-in returns the CPU."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
    from recipes.megatron import wgrad

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    wgrad.install()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(48, 64, generator=generator) / 8).bfloat16())
    inputs = [torch.randn(2, 32, 64, generator=generator).bfloat16() for _ in range(2)]
    upstream = [torch.randn(2, 32, 48, generator=generator).bfloat16() for _ in range(2)]

    def main_grad(fused: bool) -> torch.Tensor:
        weight.main_grad = torch.zeros(48, 64, dtype=buffer)
        weight.grad_added_to_main_grad = False
        for x, dy in zip(inputs, upstream):
            weight.grad = None
            out = linear_with_grad_accumulation_and_async_allreduce(
                x, weight, None, gradient_accumulation_fusion=fused, allreduce_dgrad=False, sequence_parallel=False)
            out.backward(dy)
            if not weight.grad_added_to_main_grad:
                weight.main_grad.add_(weight.grad)  # DDP's hook, unfused
            weight.grad_added_to_main_grad = False
        return weight.main_grad.double()

    exact = sum(dy.double().flatten(0, 1).t() @ x.double().flatten(0, 1) for x, dy in zip(inputs, upstream))
    fused, unfused = main_grad(True), main_grad(False)
    assert not torch.equal(fused, torch.zeros_like(fused))
    assert (fused - unfused).norm() <= 1e-2 * exact.norm()
    if buffer == torch.float32:
        assert (fused - exact).abs().max() <= 1e-5 * exact.abs().max()
        assert (fused - exact).norm() <= (unfused - exact).norm()


def test_explicit_fusion_without_its_kernel_is_refused_in_one_line_before_launch_and_at_build(hydra_compose):
    """A local run on this machine (not a dry run) is planned with this Python's kernels: no Apex, no TE here."""
    here = ("engine=megatron", "gpu=h200", "precision=bf16")
    cases = {
        "megatron.gradient_accumulation_fusion=true": "runs on CUDA GPUs",
        "megatron.cross_entropy_loss_fusion=true": "needs Transformer Engine",
        "megatron.apply_rope_fusion=true": "needs Transformer Engine",
        "megatron.cuda_graphs=true": "graph-safe RNG tracker",
        "megatron.masked_softmax_fusion=true": "Apex's fused softmax",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as error:
            validate(hydra_compose(*here, override))
        assert "\n" not in str(error.value)
        with pytest.raises(ConfigError, match=message):  # the engine's build, on a machine the plan did not see
            translate.transformer_config(hydra_compose(*here, override, "dryrun=true"), available_kernels())
        validate(hydra_compose(*here, override, "dryrun=true"))  # planned for another machine: its kernels decide


def test_the_plan_says_which_kernels_run(hydra_compose, apex_importable):
    elsewhere = megatron_tuning(hydra_compose(*BASE))
    assert elsewhere.startswith("decided where it runs (on with Transformer Engine; wgrad accumulation: on CUDA; "
                                "softmax: Apex): wgrad accumulation, cross-entropy")
    here = megatron_tuning(hydra_compose("engine=megatron", "gpu=h200", "precision=bf16"))  # no TE, Apex stand-in
    assert here.startswith("fused: wgrad accumulation, softmax; "
                           "unfused: cross-entropy, RoPE, SwiGLU, residual add; grads reduced in BF16, overlapped")
    assert translate.describe_tuning(hydra_compose(*BASE, "megatron.grad_reduce_in_fp32=true"), WITH_TE) == (
        "fused: wgrad accumulation, cross-entropy, RoPE, SwiGLU, residual add; unfused: softmax; grads reduced in "
        "FP32, overlapped; param all-gather overlapped; CUDA graphs off; TP comm overlap off")
    assert megatron_tuning(hydra_compose(*BASE, "megatron.deterministic=true")).endswith("; deterministic")


# ---- every switch reaches megatron-core's config objects ----

SWITCHES = {
    # override: expected fields of the TransformerConfig (tc), DDP config (ddp) and optimizer config (opt), with TE
    "defaults": ((), {"tc": dict(gradient_accumulation_fusion=True, cross_entropy_loss_fusion=True,
                                 cross_entropy_fusion_impl="te", apply_rope_fusion=True, bias_activation_fusion=True,
                                 bias_dropout_fusion=True, masked_softmax_fusion=False, tp_comm_overlap=False,
                                 cuda_graph_impl="none", use_te_rng_tracker=False, fp8_param=True),
                      "ddp": dict(grad_reduce_in_fp32=False, overlap_grad_reduce=True, overlap_param_gather=True,
                                  align_param_gather=False, use_distributed_optimizer=True, fp8_param_gather=True),
                      "opt": dict(overlap_param_gather=True, use_distributed_optimizer=True)}),
    "cross-entropy": (("megatron.cross_entropy_loss_fusion=false",), {"tc": dict(cross_entropy_loss_fusion=False)}),
    "rope": (("megatron.apply_rope_fusion=false",), {"tc": dict(apply_rope_fusion=False)}),
    "swiglu": (("megatron.bias_activation_fusion=false",), {"tc": dict(bias_activation_fusion=False)}),
    "residual": (("megatron.bias_dropout_fusion=false",), {"tc": dict(bias_dropout_fusion=False)}),
    "softmax": (("megatron.masked_softmax_fusion=true",), {"tc": dict(masked_softmax_fusion=True)}),
    "grads in fp32": (("megatron.grad_reduce_in_fp32=true",), {"ddp": dict(grad_reduce_in_fp32=True)}),
    "no grad overlap": (("megatron.overlap_grad_reduce=false",), {"ddp": dict(overlap_grad_reduce=False)}),
    "no gather overlap": (("megatron.overlap_param_gather=false",), {"ddp": dict(overlap_param_gather=False),
                                                                      "opt": dict(overlap_param_gather=False)}),
    "aligned gathers": (("parallel.pp=2", "parallel.vp=2", "executor.gpus=4", "model.num_layers=4"),
                        {"ddp": dict(align_param_gather=True)}),
    "unaligned": (("parallel.pp=2", "parallel.vp=2", "executor.gpus=4", "model.num_layers=4",
                   "megatron.align_param_gather=false"), {"ddp": dict(align_param_gather=False)}),
    "no distributed optimizer": (("parallel.distributed_optimizer=false", "precision.fp8_param_gather=false"),
                                 {"ddp": dict(use_distributed_optimizer=False, overlap_param_gather=False),
                                  "opt": dict(use_distributed_optimizer=False, overlap_param_gather=False)}),
    "no fp8 gather": (("precision.fp8_param_gather=false",), {"tc": dict(fp8_param=False),
                                                            "ddp": dict(fp8_param_gather=False)}),
    "cuda graphs": (("megatron.cuda_graphs=true", "precision.fp8_param_gather=false"), {"tc": dict(cuda_graph_impl="local", use_te_rng_tracker=True,
                                                                gradient_accumulation_fusion=True)}),
    "tp comm overlap": (("parallel.tp=2", "executor.gpus=2", "megatron.tp_comm_overlap=true"),
                        {"tc": dict(tp_comm_overlap=True, sequence_parallel=True)}),
    "no wgrad fusion": (("megatron.gradient_accumulation_fusion=false",),
                        {"tc": dict(gradient_accumulation_fusion=False)}),
    "deterministic": (("megatron.deterministic=true",), {"tc": dict(deterministic_mode=True)}),
}


@pytest.mark.parametrize("case", list(SWITCHES))
def test_each_switch_reaches_megatron_core(hydra_compose, te_rope, case):
    overrides, expected = SWITCHES[case]
    cfg = hydra_compose(*BASE, *overrides)
    validate(cfg)
    built = configs(cfg, WITH_TE)
    for name, fields in expected.items():
        assert {field: getattr(built[name], field) for field in fields} == fields, name


def test_without_transformer_engine_every_fusion_stays_off(hydra_compose):
    """The local spec's path (BF16 without TE, the CPU tests) is what it was before the switches existed."""
    tc = translate.transformer_config(hydra_compose(*BASE[:4], "precision=bf16", "dryrun=true"), NO_KERNELS)
    assert not any([tc.gradient_accumulation_fusion, tc.cross_entropy_loss_fusion, tc.apply_rope_fusion,
                    tc.bias_activation_fusion, tc.bias_dropout_fusion, tc.masked_softmax_fusion])


def test_nemotron_keeps_its_squared_relu_unfused(hydra_compose, te_rope):
    cfg = hydra_compose(*BASE, "model=nemotron4_15b")
    tc = translate.transformer_config(cfg, WITH_TE)  # megatron-core would raise with the fusion on
    assert not tc.bias_activation_fusion and tc.apply_rope_fusion and tc.layernorm_zero_centered_gamma
    with pytest.raises(ValueError, match="bias_activation_fusion"):
        dataclasses.replace(tc, bias_activation_fusion=True)


REFUSED = {
    "squared relu": (("model=nemotron4_15b", "megatron.bias_activation_fusion=true"), "fuses (Swi)GLU and GeLU"),
    "tp overlap without tp": (("megatron.tp_comm_overlap=true",), "needs parallel.tp > 1 with sequence parallelism"),
    "tp overlap without sp": (("megatron.tp_comm_overlap=true", "parallel.tp=2", "executor.gpus=2",
                               "parallel.sp=false"), "needs parallel.tp > 1 with sequence parallelism"),
    "graphs with fsdp": (("megatron.cuda_graphs=true", "parallel.fsdp=true"), "not supported with Megatron-FSDP"),
    "graphs with full recompute": (("megatron.cuda_graphs=true", "parallel.recompute=full"), "full recomputation"),
    "fp8 gather without sharding": (("parallel.distributed_optimizer=false",),
                                    "set parallel.distributed_optimizer=true, or precision.fp8_param_gather=false"),
    "torch engine": (("engine=torch", "megatron.cuda_graphs=true"), "megatron.* switches are engine=megatron's"),
}


def test_graphs_with_fp8_weights_are_refused_where_megatron_core_cannot_replay_them(hydra_compose, te_rope):
    """megatron-core 0.16.1 (this machine's) copies each captured weight onto itself at a graph replay, which TE's FP8
    weights fail; planned for another machine the check waits for that machine's megatron-core."""
    graphs = (*BASE, "megatron.cuda_graphs=true")
    assert not available_kernels().graphs_take_fp8_weights
    for kernels in (WITH_TE, dataclasses.replace(available_kernels(), transformer_engine=True)):
        with pytest.raises(ConfigError, match=r"megatron-core 0\.16\.1 copies each weight onto itself.*set "
                                              r"precision\.fp8_param_gather=false or megatron\.cuda_graphs=false"):
            translate.transformer_config(hydra_compose(*graphs), kernels)
    validate(hydra_compose(*graphs))  # dry run: the job's machine decides
    later = dataclasses.replace(WITH_TE, graphs_take_fp8_weights=True)
    assert translate.transformer_config(hydra_compose(*graphs), later).cuda_graph_impl == "local"
    for without_fp8_weights in ("precision.fp8_param_gather=false", "precision=bf16", "precision=fp8_blockwise"):
        assert translate.transformer_config(hydra_compose(*graphs, without_fp8_weights), WITH_TE).cuda_graph_impl \
            == "local"


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_switch_that_cannot_run_is_refused_in_one_line(hydra_compose, case):
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(hydra_compose(*BASE, *overrides))
    assert "\n" not in str(error.value)


# ---- on a GPU with Transformer Engine (`pytest -m gpu`) ----


def megatron_config(tmp_path, precision: str = "bf16", **megatron):
    """tiny_llama on engine=megatron from conf/ options (the GPU machine lacks Hydra)."""
    from recipes.config import Config, MegatronConfig, TrainerConfig, load_option

    return Config(model=load_option("model", "tiny_llama"), precision=load_option("precision", precision),
                  gpu=load_option("gpu", "h200"), executor=load_option("executor", "local"),
                  data=dataclasses.replace(load_option("data", "mock"), cache_dir=str(tmp_path / "cache")),
                  trainer=TrainerConfig(micro_batch_size=2, global_batch_size=4, max_steps=2, log_interval=1),
                  engine="megatron", megatron=MegatronConfig(**megatron))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("buffer", ["fp32", "bf16"])
def test_every_linear_accumulates_weight_gradients_in_place_as_the_unfused_path_does(tmp_path, buffer):
    """TE's layers and megatron-core's output layer fuse (recipes.megatron.wgrad in place of Apex), and two
    micro-batches' main_grad equal those of the same model with the fusion off, to BF16 rounding of the wgrads."""
    pytest.importorskip("transformer_engine")
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from recipes.megatron import engine
    from recipes.megatron import parallel_state
    from recipes.megatron.build import build
    from recipes.megatron.data import MicroBatches, build_train_dataset

    grads = {}
    for fused in (True, False):
        cfg = megatron_config(tmp_path, gradient_accumulation_fusion=None if fused else False,
                              grad_reduce_in_fp32=buffer == "fp32")
        if not torch.distributed.is_initialized():
            engine.setup_distributed(cfg)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)  # the same weights for both
        config, chunks = build(cfg, torch.device("cuda"))
        te_layers = [m for m in chunks[0].modules() if hasattr(m, "fuse_wgrad_accumulation")]
        assert te_layers and all(m.fuse_wgrad_accumulation == fused for m in te_layers)
        assert chunks[0].output_layer.gradient_accumulation_fusion == fused
        (model,) = engine.wrap(cfg, config, chunks)
        model.zero_grad_buffer()
        batches = MicroBatches(build_train_dataset(cfg, 0), cfg, 0, 1)
        get_forward_backward_func()(forward_step_func=partial(engine.forward_step, torch.device("cuda")),
                                    data_iterator=batches.of_step(1, 2), model=model, num_microbatches=2,
                                    seq_length=cfg.model.seq_length, micro_batch_size=2, forward_only=False)
        grads[fused] = {name: p.main_grad.float().clone() for name, p in model.module.named_parameters()}
        assert all(g.dtype == (torch.float32 if buffer == "fp32" else torch.bfloat16)
                   for g in (p.main_grad for p in model.module.parameters()))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    assert any("output_layer" in name for name in grads[True])
    for name, unfused in grads[False].items():
        assert (grads[True][name] - unfused).norm() <= 1e-2 * unfused.norm() + 1e-6, name


def run_megatron_engine(cfg, tmp_path):
    """Train `cfg` as the plan's command does (python -m recipes.megatron.engine config.yaml, in its run directory,
    with this checkout importable); fails with the run's output unless it exits 0. Returns the run directory."""
    import os
    import subprocess
    import sys

    from recipes.config import REPO_ROOT
    from recipes.folders import save_config

    run_dir = tmp_path / "run"
    cfg.run.dir = str(run_dir)
    run_dir.mkdir()
    save_config(cfg, run_dir / "config.yaml")
    done = subprocess.run([sys.executable, "-m", "recipes.megatron.engine", str(run_dir / "config.yaml")],
                          cwd=run_dir, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def cuda_kernel_names(run) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


FALLBACK_CAST = "cast_transpose_general_kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_the_master_shard_cast_writes_tes_bytes_without_the_fallback_kernel(recipe):
    """TE's cast_master_weights_to_fp8, as megatron-core's distributed optimizer calls it (a flat FP32 shard, its
    offset, manual post-all-gather processing), on FP8 primary weights: TE's own path launches the general
    cast-transpose kernel; inside rowwise_master_casts it does not, and writes the same FP8 bytes, scale and
    scale_inv, and leaves the weights' quantizers as they were."""
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common import recipe as te_recipes
    from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8

    from recipes.megatron.master_cast import rowwise_master_casts

    if not torch.distributed.is_initialized():
        store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        torch.distributed.init_process_group("nccl", store=store, rank=0, world_size=1)
    fp8 = te_recipes.Float8CurrentScaling() if recipe == "current" else te_recipes.DelayedScaling()
    generator = torch.Generator(device="cuda").manual_seed(0)
    masters = [torch.randn(n, generator=generator, device="cuda") / 16 for n in (768 * 256, 256 * 768)]

    def cast(rowwise: bool):
        with te.quantized_model_init(enabled=True, recipe=fp8):
            weights = [te.Linear(256, 768, bias=False, params_dtype=torch.bfloat16).weight,
                       te.Linear(768, 256, bias=False, params_dtype=torch.bfloat16).weight]
        usages = [(w._quantizer.rowwise_usage, w._quantizer.columnwise_usage) for w in weights]
        shard = [masters[0], masters[1][1000:]]  # the second: a shard starting inside its weight

        def run():
            with rowwise_master_casts(weights) if rowwise else contextlib.nullcontext():
                cast_master_weights_to_fp8(weights, shard, [0, 1000], torch.distributed.group.WORLD,
                                           manual_post_all_gather_processing=True)

        kernels = cuda_kernel_names(run)
        assert [(w._quantizer.rowwise_usage, w._quantizer.columnwise_usage) for w in weights] == usages
        return kernels, [(w._data.clone(), w._scale_inv.clone()) for w in weights]

    te_kernels, te_result = cast(rowwise=False)
    our_kernels, our_result = cast(rowwise=True)
    assert any(FALLBACK_CAST in name for name in te_kernels)  # what the check looks for does run in TE's path
    assert not any(FALLBACK_CAST in name for name in our_kernels), our_kernels
    for offset, (data, scale_inv), (te_data, te_scale_inv) in zip((0, 1000), our_result, te_result):
        assert torch.equal(data.view(-1)[offset:], te_data.view(-1)[offset:])  # the shard's bytes (the rest: init)
        assert torch.equal(scale_inv, te_scale_inv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp8_current", "fp8_delayed"])
def test_a_megatron_fp8_step_runs_no_fallback_cast(tmp_path, precision):
    """engine=megatron with FP8 primary weights (the preset's fp8_param_gather), as the plan runs it: the profiled
    second step's trace has FP8 kernels and no cast_transpose_general_kernel."""
    pytest.importorskip("transformer_engine")
    import json

    cfg = megatron_config(tmp_path, precision)
    assert cfg.precision.fp8_param_gather
    cfg.trainer.profile_step = 2
    run_dir = run_megatron_engine(cfg, tmp_path)
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    kernels = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    assert any("fp8" in name.lower() or "quantize" in name.lower() for name in kernels)
    assert not [name for name in kernels if FALLBACK_CAST in name]


# ---- blockwise scaling's block dimensions (recipes.megatron.te_recipe) ----


@dataclasses.dataclass
class BlockScalingStandIn:
    """What recipes.megatron.te_recipe reads of Transformer Engine's Float8BlockScaling (not importable without a
    GPU): a dataclass with TE's three fields and defaults, which says it is block scaling as TE's recipes do."""

    fp8_format: str = "e4m3"
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    @classmethod
    def float8_block_scaling(cls):
        return True


@dataclasses.dataclass
class CurrentScalingStandIn:
    fp8_format: str = "e4m3"

    @classmethod
    def float8_block_scaling(cls):
        return False


def test_megatron_core_builds_the_block_scaling_recipe_with_the_runs_block_dims(monkeypatch):
    """get_fp8_recipe, as megatron-core's FP8 contexts look it up, returns the run's blocks; other recipes and None
    (no TE) pass through; TE's defaults put megatron-core's own function back."""
    from megatron.core import fp8_utils

    from recipes.megatron import te_recipe

    made = {"blockwise": BlockScalingStandIn(), "tensorwise": CurrentScalingStandIn(), None: None}
    megatron_core = lambda config: made[config]  # noqa: E731
    monkeypatch.setattr(fp8_utils, "get_fp8_recipe", megatron_core)
    te_recipe.install_block_dims((1, 1, 2))
    recipe = fp8_utils.get_fp8_recipe("blockwise")
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) == (1, 1, 2)
    assert recipe.fp8_format == "e4m3" and made["blockwise"].w_block_scaling_dim == 2  # a new recipe, same format
    assert fp8_utils.get_fp8_recipe("tensorwise") is made["tensorwise"]
    assert fp8_utils.get_fp8_recipe(None) is None
    te_recipe.install_block_dims((2, 1, 1))  # a second model in the process: its own dims, not wrapped twice
    assert fp8_utils.get_fp8_recipe("blockwise").x_block_scaling_dim == 2
    assert fp8_utils.get_fp8_recipe.megatron_core is megatron_core
    te_recipe.install_block_dims((1, 2, 1))
    assert fp8_utils.get_fp8_recipe is megatron_core


@pytest.mark.parametrize("precision, message", [
    ("fp8_blockwise_2d2d", r"fprop \(input x weight\) would multiply two 128x128-block operands"),
    ("fp8_rowwise", "is torchao's row-wise recipe, which Transformer Engine does not have"),
])
def test_what_transformer_engine_cannot_run_is_refused_on_megatron_in_one_line(hydra_compose, precision, message):
    cfg = hydra_compose(*BASE[:-2], f"precision={precision}", "dryrun=true")
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_megatron_step_trains_with_every_operand_in_1x128_blocks(tmp_path):
    """precision=fp8_blockwise_1d1d on engine=megatron: TE's own Float8BlockScaling, as megatron-core builds it in
    the step, has 1x128 weight blocks, and the step runs."""
    pytest.importorskip("transformer_engine")
    from megatron.core import fp8_utils
    from transformer_engine.common import recipe as te_recipes

    from recipes.config import DEFAULT_BLOCK_DIMS
    from recipes.megatron import te_recipe, translate

    cfg = megatron_config(tmp_path, "fp8_blockwise_1d1d")
    te_recipe.install_block_dims(cfg.precision.block_dims)
    try:
        recipe = fp8_utils.get_fp8_recipe(translate.transformer_config(cfg, WITH_TE))
        assert isinstance(recipe, te_recipes.Float8BlockScaling) and recipe.w_block_scaling_dim == 1
    finally:
        te_recipe.install_block_dims(DEFAULT_BLOCK_DIMS)
    run_megatron_engine(cfg, tmp_path)
