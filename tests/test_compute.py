"""trainer.compute_dtype (recipes.compute): FP32 in place of BF16 on CPUs without native BF16, either path forced
on any machine, FP8 GEMMs unchanged, and the plan and summary.json saying which path ran."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from recipes import compute
from recipes.config import ComputeDtype, ConfigError, Recipe, load_option
from recipes.engine.torch_engine import main as engine_main
from recipes.fp8.linear import Fp8Linear, recipe_from_config
from recipes.plan.describe import describe
from recipes.plan import make_plan


def test_auto_is_bf16_where_the_cpu_has_native_bf16_and_fp32_elsewhere(monkeypatch):
    monkeypatch.setattr(compute, "cpu_has_native_bf16", lambda: False)
    assert compute.compute_dtype(ComputeDtype.auto, "cpu") == torch.float32
    assert compute.compute_dtype(ComputeDtype.auto, "cuda") == torch.bfloat16
    assert compute.compute_dtype(ComputeDtype.bf16, "cpu") == torch.bfloat16  # forced
    monkeypatch.setattr(compute, "cpu_has_native_bf16", lambda: True)
    assert compute.compute_dtype(ComputeDtype.auto, "cpu") == torch.bfloat16
    assert compute.compute_dtype(ComputeDtype.fp32, "cpu") == torch.float32  # forced
    with pytest.raises(ConfigError, match="set trainer.compute_dtype=auto"):
        compute.compute_dtype(ComputeDtype.fp32, "cuda")


def test_native_bf16_is_what_pytorch_uses_for_bf16_gemms(monkeypatch):
    if torch.backends.mkldnn.enabled:  # as PyTorch starts (a user may have switched it off)
        assert compute.cpu_has_native_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # oneDNN switched off, PyTorch's BF16 GEMMs take its generic path, as on a CPU without native BF16.
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not compute.cpu_has_native_bf16()


def _layer(precision_name: str) -> nn.Module:
    precision = load_option("precision", precision_name)
    if precision.recipe in (Recipe.blockwise, Recipe.mxfp8):
        precision = dataclasses.replace(precision, emulate=True)  # no native block-scaled GEMM on a CPU
    torch.manual_seed(0)
    return Fp8Linear(nn.Linear(256, 384, bias=False), recipe_from_config(precision))


@pytest.mark.parametrize("precision", ["fp8_current", "fp8_delayed", "fp8_blockwise", "mxfp8"])
def test_fp8_gemms_compute_the_same_in_fp32_as_in_bf16(precision):
    """An input that BF16 represents quantizes to the same FP8 bytes and scales whether it arrives in BF16 or FP32,
    and the FP8 GEMMs multiply those in FP32 either way: the FP32 path's outputs, rounded to BF16, are the BF16
    path's, bit for bit, and the weight gradients (FP32 in both) are equal."""
    torch.manual_seed(1)
    x = torch.randn(128, 256).bfloat16()
    dy = torch.randn(128, 384).bfloat16()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = _layer(precision)
        xi = x.to(dtype).requires_grad_()
        y = layer(xi)
        y.backward(dy.to(dtype))
        assert y.dtype == dtype and xi.grad.dtype == dtype
        results[dtype] = y.detach(), xi.grad, layer.weight.grad
    (y32, dx32, dw32), (y16, dx16, dw16) = results[torch.float32], results[torch.bfloat16]
    assert torch.equal(y32.bfloat16(), y16)
    assert torch.equal(dx32.bfloat16(), dx16)
    assert torch.equal(dw32, dw16)


def _dry_run(hydra_compose, tmp_path, *overrides):
    cfg = hydra_compose("model.num_layers=1", "model.seq_length=32", "trainer.micro_batch_size=1",
                        "trainer.global_batch_size=1", "trainer.max_steps=2", "trainer.tensorboard=false",
                        "data=mock", f"run.dir={tmp_path}", *overrides)
    return cfg


def test_plan_says_which_dtype_computes_and_refuses_fp32_on_a_gpu(hydra_compose, tmp_path, monkeypatch):
    monkeypatch.setattr(compute, "cpu_has_native_bf16", lambda: False)
    plan = describe(make_plan(_dry_run(hydra_compose, tmp_path, "gpu=cpu"), tmp_path / "config.yaml"))
    assert "compute     fp32 in place of BF16 (this CPU has no native BF16" in plan
    plan = describe(make_plan(_dry_run(hydra_compose, tmp_path, "gpu=cpu", "trainer.compute_dtype=bf16"),
                              tmp_path / "config.yaml"))
    assert "compute     bf16 (trainer.compute_dtype=bf16)" in plan
    with pytest.raises(ConfigError, match="trainer.compute_dtype=fp32 is for CPUs without native BF16"):
        make_plan(_dry_run(hydra_compose, tmp_path, "gpu=h100", "trainer.compute_dtype=fp32", "dryrun=true"),
                  tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="engine=nemo computes in BF16"):
        compute.check_compute_dtype(_dry_run(hydra_compose, tmp_path, "gpu=h100", "engine=nemo",
                                             "trainer.compute_dtype=bf16"))


@pytest.mark.parametrize("forced", ["bf16", "fp32"])
def test_either_path_trains_on_any_cpu_and_summary_says_which_ran(hydra_compose, tmp_path, forced):
    """Two tiny FP8 steps in each path (the BF16 one is slow on a CPU without native BF16: kept small), the
    residual stream in the forced dtype, a first loss of ln(vocabulary) as an untrained model has."""
    from recipes.folders import save_config
    from recipes.engine import torch_engine

    seen = []
    build_model = torch_engine.build_model

    def watching(*args, **kwargs):
        model = build_model(*args, **kwargs)
        model.layers[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        return model

    cfg = _dry_run(hydra_compose, tmp_path, "gpu=cpu", f"trainer.compute_dtype={forced}")
    save_config(cfg, tmp_path / "config.yaml")
    torch_engine.build_model = watching
    try:
        assert engine_main([str(tmp_path / "config.yaml")]) == 0
    finally:
        torch_engine.build_model = build_model
    assert set(seen) == {torch.bfloat16 if forced == "bf16" else torch.float32}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compute_dtype"] == forced
    first_loss = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss == pytest.approx(5.77, abs=0.05)  # ln(320): random tokens, initial weights (data=mock)
