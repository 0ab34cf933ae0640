"""scripts/layer_bench.py and its Transformer Engine peer (scripts/te_peer.py): on the CPU, a short study on
tiny_llama and the bookkeeping of the te_megatron columns (FP32 main gradients and master weights around BF16
layers); on a GPU with TE (`pytest -m gpu`), that TE's fused weight-gradient accumulation writes those main
gradients."""

from __future__ import annotations

import copy
import csv
import dataclasses

import pytest
import torch
from torch import nn

from recipes.config import REPO_ROOT, TrainerConfig, load_option
from recipes.engine.training import build_optimizer, optimizer_step


@pytest.fixture
def scripts(monkeypatch):
    """The benchmark scripts, importable as they import each other (scripts/ on sys.path)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    import layer_bench
    import te_peer

    return layer_bench, te_peer


def test_a_short_study_reports_every_column_against_the_fastest_bf16(scripts, tmp_path):
    layer_bench, _ = scripts
    argv = ["--model", "tiny_llama", "--layers", "1", "--seq-length", "32", "--precisions", "bf16,fp8_current",
            "--steps", "1", "--warmup", "0", "--micro-batches", "2", "--no-compile", "--out", str(tmp_path)]
    assert layer_bench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["precision"] for r in rows] == ["bf16", "fp8_current"]
    assert all(r["bf16_baseline"] == "bf16" and float(r["speedup_vs_bf16"]) > 0 for r in rows)
    assert "| tiny_llama | 1 | 32 | fp8_current |" in (tmp_path / "results.md").read_text()


def test_the_strongest_bf16_column_may_be_a_peers(scripts):
    layer_bench, _ = scripts
    results = [{"precision": "bf16", "median_step_s": 1.0}, {"precision": "te_megatron_bf16", "median_step_s": 0.9},
               {"precision": "te_current", "median_step_s": 0.5}, {"precision": "te_bf16", "error": "no TE"}]
    assert layer_bench.strongest_bf16(results)["precision"] == "te_megatron_bf16"


def test_megatron_style_training_keeps_fp32_main_gradients_and_master_weights(scripts):
    """Without TE's fused GEMMs every gradient arrives through autograd (as a norm's does), so the peer's hooks
    must fold each micro-batch's BF16 gradient into the FP32 main gradient, step AdamW on the FP32 masters and
    copy them into the BF16 parameters: the same as summing the gradients in FP32 by hand."""
    _, te_peer = scripts
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    inputs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]
    trainer = TrainerConfig(lr=1e-2, warmup_steps=0, max_steps=2, grad_clip=0.05)
    training = te_peer.MegatronStyleTraining(model)
    optimizer = build_optimizer(training.masters, trainer, torch.device("cpu"))
    reference_optimizer = build_optimizer(reference, trainer, torch.device("cpu"))

    def loss_of(module: nn.Module, micro: int) -> torch.Tensor:
        return module(inputs[micro]).float().square().mean() / len(inputs)

    for _ in range(2):
        sums = None  # the reference: each micro-batch's BF16 gradient, summed in FP32
        for micro in range(len(inputs)):
            bf16 = copy.deepcopy(model)
            grads = torch.autograd.grad(loss_of(bf16, micro), list(bf16.parameters()))
            sums = [g.float() for g in grads] if sums is None else [s.add_(g) for s, g in zip(sums, grads)]
        for param, grad in zip(reference.parameters(), sums):
            param.grad = grad
        nn.utils.clip_grad_norm_(reference.parameters(), trainer.grad_clip, foreach=True)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)

        optimizer_step(lambda micro: loss_of(model, micro), len(inputs), training.masters, training, optimizer,
                       trainer.lr, trainer.grad_clip)
        for master, param, expected in zip(training.masters, model.parameters(), reference.parameters()):
            assert torch.equal(master, expected)
            assert param.dtype == torch.bfloat16 and torch.equal(param, expected.bfloat16())
            assert param.grad is None and master.grad is None


@pytest.mark.gpu
def test_transformer_engine_writes_the_main_gradients_of_the_te_megatron_columns(scripts):
    """TE's weight-gradient GEMMs write main_grad in the first micro-batch and add to it in the others, leaving
    .grad empty; the norms' gradients come through autograd. Against the same layers without the fusion."""
    pytest.importorskip("transformer_engine")
    _, te_peer = scripts
    cfg = dataclasses.replace(load_option("model", "tiny_llama"), num_layers=1, seq_length=128)
    torch.manual_seed(0)
    plain = te_peer.TeDecoderStack(cfg)
    fused = te_peer.TeDecoderStack(cfg, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    training = te_peer.MegatronStyleTraining(fused)
    inputs = [torch.randn(1, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for micro, x in enumerate(inputs):
        training.micro_batch(fused, micro)
        plain(x, is_first_microbatch=micro == 0).float().square().mean().backward()
        fused(x, is_first_microbatch=micro == 0).float().square().mean().backward()
        training.after_backward(fused)
    names = [name for name, _ in fused.named_parameters()]
    matrices = [name for name, p in fused.named_parameters() if p.ndim == 2]
    assert len(matrices) == 4  # QKV, the attention's output, FC1, FC2
    for name, param, expected in zip(names, training.params, plain.parameters()):
        assert param.grad is None, name
        # BF16 gradients summed by autograd against FP32 main gradients: equal to BF16's rounding
        reference = expected.grad.float()
        torch.testing.assert_close(param.main_grad, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item(),
                                   msg=name)


def test_no_timed_step_is_refused_in_one_line(scripts, capsys):
    layer_bench, _ = scripts
    with pytest.raises(SystemExit) as exit_info:
        layer_bench.parse_args(["--model", "tiny_llama", "--steps", "0"])
    assert exit_info.value.code == 2
    assert "--steps 0 --warmup 3: time at least one step" in capsys.readouterr().err


def test_te_recipes_are_checked_in_one_line(scripts, capsys):
    """--te-recipes picks TE's columns (device time: each costs a compile and its steps), and refuses a recipe TE
    does not have, or a list with no TE peer to apply to."""
    layer_bench, _ = scripts
    args = layer_bench.parse_args(["--peer", "te_megatron", "--te-recipes", "bf16,delayed"])
    assert args.te_recipes == ["bf16", "delayed"]
    for argv in (["--peer", "te", "--te-recipes", "bf16,fp8_delayed"], ["--te-recipes", "bf16"]):
        with pytest.raises(SystemExit) as exit_info:
            layer_bench.parse_args(argv)
        assert exit_info.value.code == 2
        assert "give TE recipes of bf16, current, delayed, blockwise, mxfp8, with --peer te" in capsys.readouterr().err
