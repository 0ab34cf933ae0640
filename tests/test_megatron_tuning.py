"""engine=megatron's tuning switches (cfg.megatron) on a CPU with the real megatron-core 0.16.1: each one reaches
megatron-core's TransformerConfig, DistributedDataParallelConfig or OptimizerConfig; auto follows the kernels the
machine can load; a switch that cannot run is refused in one line naming the fix; the plan says which.

Kernels this machine lacks are simulated honestly: Apex's extensions by an empty module of their name on sys.path,
which the real import check (translate.available_kernels) then finds; Transformer Engine by Kernels(...) handed to
the translation, with TE's fused-RoPE entry point, the one megatron-core's TransformerConfig checks at construction,
set to a stand-in. The GPU test at the end (`pytest -m gpu`) builds the Transformer Engine model for real.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recipes.config import ConfigError
from recipes.plan.checks import megatron_tuning, validate

translate = pytest.importorskip("recipes.megatron.translate")
from recipes.megatron.translate import Kernels, NO_KERNELS, WgradFusion, available_kernels  # noqa: E402

WITH_TE = Kernels(transformer_engine=True, apex_wgrad=False, apex_softmax=False)  # TE installed with pip
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


# ---- gradient-accumulation fusion: only where its kernels exist ----


def test_gradient_accumulation_fusion_follows_apex_and_transformer_engine(hydra_compose, apex_importable, te_rope):
    cfg = hydra_compose(*BASE)
    assert available_kernels().apex_wgrad  # the stand-in is found by the real check
    # Apex importable (the NeMo container): megatron-core's one flag, every linear layer fused.
    for kernels in (available_kernels(), dataclasses.replace(available_kernels(), transformer_engine=True)):
        assert translate.wgrad_fusion(cfg, kernels) == WgradFusion.all
        assert translate.transformer_config(cfg, kernels).gradient_accumulation_fusion
    explicit = hydra_compose(*BASE, "megatron.gradient_accumulation_fusion=true")
    assert translate.transformer_config(explicit, available_kernels()).gradient_accumulation_fusion


def test_without_apex_only_transformer_engines_layers_fuse_and_the_output_layer_builds(hydra_compose, te_rope,
                                                                                        megatron_state):
    """The failure of issue 15: with megatron-core's flag on and no Apex, its ColumnParallelLinear (the output layer)
    refuses to build. Without Apex the flag stays off and build() turns on TE's own fusion in TE's layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from recipes.megatron.build import build_model_chunks

    assert not available_kernels().apex_wgrad and not available_kernels().transformer_engine  # this CPU machine
    cfg = hydra_compose(*BASE)
    assert translate.wgrad_fusion(cfg, WITH_TE) == WgradFusion.te_layers
    assert translate.wgrad_fusion(cfg, available_kernels()) == WgradFusion.off
    tc = translate.transformer_config(cfg, WITH_TE, use_cpu_initialization=True)
    assert not tc.gradient_accumulation_fusion
    tc = dataclasses.replace(tc, perform_initialization=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")  # TE's spec needs TE; the output layer is the same
    with torch.device("meta"):
        (model,) = build_model_chunks(cfg, tc, spec)
        assert not model.output_layer.gradient_accumulation_fusion
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            build_model_chunks(cfg, dataclasses.replace(tc, gradient_accumulation_fusion=True), spec)


def test_gradient_accumulation_fusion_off_under_fsdp_and_cuda_graphs_and_when_asked(hydra_compose):
    assert translate.wgrad_fusion(hydra_compose(*BASE, "parallel.fsdp=true"), WITH_TE) == WgradFusion.off  # NeMo
    graphs = hydra_compose(*BASE, "megatron.cuda_graphs=true")
    assert translate.wgrad_fusion(graphs, WITH_TE) == WgradFusion.off
    assert translate.wgrad_fusion(hydra_compose(*BASE, "megatron.gradient_accumulation_fusion=false"),
                                  WITH_TE) == WgradFusion.off
    assert translate.wgrad_fusion(hydra_compose(*BASE), None) is None  # the job's machine decides


def test_explicit_fusion_without_its_kernel_is_refused_in_one_line_before_launch_and_at_build(hydra_compose):
    """A local run on this machine (not a dry run) is planned with this Python's kernels: no Apex, no TE here."""
    here = ("engine=megatron", "gpu=h200", "precision=bf16")
    cases = {
        "megatron.gradient_accumulation_fusion=true": "need Apex's fused_weight_gradient_mlp_cuda",
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
    assert elsewhere.startswith("decided where it runs (on with Transformer Engine; softmax: Apex): wgrad accumulation")
    here = megatron_tuning(hydra_compose("engine=megatron", "gpu=h200", "precision=bf16"))  # no TE, Apex stand-in
    assert here.startswith("fused: wgrad accumulation (every linear), softmax; "
                           "unfused: cross-entropy, RoPE, SwiGLU, residual add; grads reduced in FP32, overlapped")
    assert translate.describe_tuning(hydra_compose(*BASE), WITH_TE).startswith(
        "fused: wgrad accumulation (TE's layers; the output layer's needs Apex), cross-entropy, RoPE, SwiGLU, "
        "residual add; unfused: softmax; grads reduced in FP32, overlapped; param all-gather overlapped; "
        "CUDA graphs off; TP comm overlap off")
    assert megatron_tuning(hydra_compose(*BASE, "megatron.deterministic=true")).endswith("; deterministic")


# ---- every switch reaches megatron-core's config objects ----

SWITCHES = {
    # override: expected fields of the TransformerConfig (tc), DDP config (ddp) and optimizer config (opt), with TE
    "defaults": ((), {"tc": dict(gradient_accumulation_fusion=False, cross_entropy_loss_fusion=True,
                                 cross_entropy_fusion_impl="te", apply_rope_fusion=True, bias_activation_fusion=True,
                                 bias_dropout_fusion=True, masked_softmax_fusion=False, tp_comm_overlap=False,
                                 cuda_graph_impl="none", use_te_rng_tracker=False, fp8_param=True),
                      "ddp": dict(grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True,
                                  align_param_gather=False, use_distributed_optimizer=True, fp8_param_gather=True),
                      "opt": dict(overlap_param_gather=True, use_distributed_optimizer=True)}),
    "cross-entropy": (("megatron.cross_entropy_loss_fusion=false",), {"tc": dict(cross_entropy_loss_fusion=False)}),
    "rope": (("megatron.apply_rope_fusion=false",), {"tc": dict(apply_rope_fusion=False)}),
    "swiglu": (("megatron.bias_activation_fusion=false",), {"tc": dict(bias_activation_fusion=False)}),
    "residual": (("megatron.bias_dropout_fusion=false",), {"tc": dict(bias_dropout_fusion=False)}),
    "softmax": (("megatron.masked_softmax_fusion=true",), {"tc": dict(masked_softmax_fusion=True)}),
    "grads in bf16": (("megatron.grad_reduce_in_fp32=false",), {"ddp": dict(grad_reduce_in_fp32=False)}),
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
    "cuda graphs": (("megatron.cuda_graphs=true",), {"tc": dict(cuda_graph_impl="local", use_te_rng_tracker=True,
                                                                gradient_accumulation_fusion=False)}),
    "tp comm overlap": (("parallel.tp=2", "executor.gpus=2", "megatron.tp_comm_overlap=true"),
                        {"tc": dict(tp_comm_overlap=True, sequence_parallel=True)}),
    "wgrad fusion with apex": (("megatron.gradient_accumulation_fusion=true",), "apex"),
    "deterministic": (("megatron.deterministic=true",), {"tc": dict(deterministic_mode=True)}),
}


@pytest.mark.parametrize("case", list(SWITCHES))
def test_each_switch_reaches_megatron_core(hydra_compose, te_rope, tmp_path, monkeypatch, case):
    overrides, expected = SWITCHES[case]
    kernels = WITH_TE
    if expected == "apex":
        (tmp_path / "fused_weight_gradient_mlp_cuda.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        kernels = dataclasses.replace(available_kernels(), transformer_engine=True)
        expected = {"tc": dict(gradient_accumulation_fusion=True)}
    cfg = hydra_compose(*BASE, *overrides)
    validate(cfg)
    built = configs(cfg, kernels)
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


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_switch_that_cannot_run_is_refused_in_one_line(hydra_compose, case):
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(hydra_compose(*BASE, *overrides))
    assert "\n" not in str(error.value)


# ---- on a GPU with Transformer Engine (`pytest -m gpu`) ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_te_layers_accumulate_weight_gradients_in_place_as_the_unfused_path_does(tmp_path):
    """Without Apex: TE's layers fuse (fuse_wgrad_accumulation on), megatron-core's output layer does not, and two
    micro-batches' main_grad equal those of the same model with the fusion off, to BF16 rounding of the wgrads.
    Configs from conf/ options without Hydra, which the GPU machine lacks."""
    pytest.importorskip("transformer_engine")
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from recipes.config import Config, MegatronConfig, TrainerConfig, load_option
    from recipes.megatron import engine
    from recipes.megatron import parallel_state
    from recipes.megatron.build import build
    from recipes.megatron.data import MicroBatches, build_train_dataset

    if available_kernels().apex_wgrad:
        pytest.skip("Apex's extension is installed: megatron-core's own flag fuses every layer")
    grads = {}
    for fused in (True, False):
        cfg = Config(model=load_option("model", "tiny_llama"), precision=load_option("precision", "bf16"),
                     gpu=load_option("gpu", "h200"), executor=load_option("executor", "local"),
                     data=dataclasses.replace(load_option("data", "mock"), cache_dir=str(tmp_path)),
                     trainer=TrainerConfig(micro_batch_size=2, global_batch_size=4), engine="megatron",
                     megatron=MegatronConfig(gradient_accumulation_fusion=None if fused else False))
        if not torch.distributed.is_initialized():
            engine.setup_distributed(cfg)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)  # the same weights for both
        config, chunks = build(cfg, torch.device("cuda"))
        te_layers = [m for m in chunks[0].modules() if hasattr(m, "fuse_wgrad_accumulation")]
        assert te_layers and all(m.fuse_wgrad_accumulation == fused for m in te_layers)
        assert not chunks[0].output_layer.gradient_accumulation_fusion
        (model,) = engine.wrap(cfg, config, chunks)
        model.zero_grad_buffer()
        batches = MicroBatches(build_train_dataset(cfg, 0), cfg, 0, 1)
        get_forward_backward_func()(forward_step_func=partial(engine.forward_step, torch.device("cuda")),
                                    data_iterator=batches.of_step(1, 2), model=model, num_microbatches=2,
                                    seq_length=cfg.model.seq_length, micro_batch_size=2, forward_only=False)
        grads[fused] = {name: p.main_grad.float().clone() for name, p in model.module.named_parameters()}
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    for name, unfused in grads[False].items():
        assert (grads[True][name] - unfused).norm() <= 1e-2 * unfused.norm() + 1e-6, name
