"""scripts/layer_bench.py and its peers (scripts/te_peer.py, scripts/megatron_layer_peer.py): on the CPU, a short
study on tiny_llama timed in interleaved rounds, the FP32 main gradients of the te_megatron columns, the configs of
the megatron_layer columns and one such column on megatron-core's local spec (tests/megatron_on_cpu.py); on a GPU
with TE (`pytest -m gpu`), that TE's fused weight-gradient accumulation writes those main gradients, that the
te_megatron columns' optimizer updates BF16 and FP8 weights as AdamW would, and that every new column trains."""

from __future__ import annotations

import copy
import csv
import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from recipes.config import REPO_ROOT, TrainerConfig, load_option


@pytest.fixture
def scripts(monkeypatch):
    """The benchmark scripts, importable as they import each other (scripts/ on sys.path)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    import layer_bench
    import te_peer

    return layer_bench, te_peer


def test_a_short_study_times_every_column_in_interleaved_rounds(scripts, tmp_path, capsys):
    """Two rounds, the second in reverse order; each row pools both rounds' steps and reports their spread."""
    layer_bench, _ = scripts
    argv = ["--model", "tiny_llama", "--layers", "1", "--seq-length", "32", "--precisions", "bf16,fp8_current",
            "--steps", "2", "--rounds", "2", "--warmup", "0", "--micro-batches", "2", "--no-compile",
            "--out", str(tmp_path)]
    assert layer_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("commit ")  # the provenance comes first
    order = [(line.split()[0], line.split()[2]) for line in out.splitlines() if " step 1/2:" in line]
    assert order == [("bf16", "1/2"), ("fp8_current", "1/2"), ("fp8_current", "2/2"), ("bf16", "2/2")]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["precision"] for r in rows] == ["bf16", "fp8_current"]
    for row in rows:
        assert row["bf16_baseline"] == "bf16" and float(row["speedup_vs_bf16"]) > 0
        assert (row["rounds"], row["timed_steps"]) == ("2", "4")
        assert float(row["min_step_s"]) <= float(row["median_step_s"]) <= float(row["max_step_s"])
    table = (tmp_path / "results.md").read_text()
    assert "| median step (ms) | min-max (ms) | timed steps (rounds) |" in table
    assert "| tiny_llama | 1 | 32 | fp8_current |" in table and " | 4 (2) | " in table


def test_a_column_that_fails_is_reported_and_left_out_of_later_rounds(scripts, capsys):
    layer_bench, _ = scripts
    args = layer_bench.parse_args(["--steps", "1", "--warmup", "0", "--no-compile"])
    args.dtype = torch.float32
    model_cfg = dataclasses.replace(load_option("model", "tiny_llama"), num_layers=1, seq_length=16)
    builds = []

    def broken(model_cfg, args, device):
        builds.append(1)
        raise RuntimeError("no kernel for this\nsecond line")

    progress = []
    rows = layer_bench.bench_model(model_cfg, [layer_bench.Variant("broken", broken)], args, torch.device("cpu"),
                                   progress.append)
    assert len(builds) == 1 and rows == progress[-1]
    assert rows[0]["error"].startswith("round 1: no kernel for this")
    assert "| tiny_llama | 1 | 16 | broken | failed: round 1: no kernel for this |" in layer_bench.markdown_table(rows)
    assert "broken FAILED: RuntimeError: no kernel for this" in capsys.readouterr().out


def test_the_strongest_bf16_column_may_be_a_peers(scripts):
    layer_bench, _ = scripts
    results = [{"precision": "bf16", "median_step_s": 1.0}, {"precision": "te_megatron_bf16", "median_step_s": 0.9},
               {"precision": "megatron_layer_bf16", "median_step_s": 0.95},
               {"precision": "te_current", "median_step_s": 0.5}, {"precision": "te_bf16", "error": "no TE"}]
    assert layer_bench.strongest_bf16(results)["precision"] == "te_megatron_bf16"


def test_main_gradients_are_the_fp32_sums_and_clip_as_torch_does(scripts):
    """Without TE's fused GEMMs every gradient arrives through autograd (as a norm's does): the te_megatron columns
    fold each micro-batch's BF16 gradient into the FP32 main gradient (the same as summing them in FP32 by hand),
    leave no .grad behind, and clip the main gradients as torch's clip_grad_norm_ clips ours."""
    _, te_peer = scripts
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(torch.bfloat16)
    inputs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]
    gradients = te_peer.MainGradients(list(model.parameters()))

    def loss_of(module: nn.Module, micro: int) -> torch.Tensor:
        return module(inputs[micro]).float().square().mean() / len(inputs)

    sums = None  # each micro-batch's BF16 gradient, summed in FP32
    for micro in range(len(inputs)):
        twin = copy.deepcopy(model)
        grads = torch.autograd.grad(loss_of(twin, micro), list(twin.parameters()))
        sums = [g.float() for g in grads] if sums is None else [s.add_(g) for s, g in zip(sums, grads)]
    for _ in range(2):  # the second step's first micro-batch overwrites the first step's sums
        total = gradients.backward(lambda micro: loss_of(model, micro), len(inputs))
        assert total.dtype == torch.float32 and total > 0
        for param, expected in zip(model.parameters(), sums):
            assert param.grad is None and param.main_grad.dtype == torch.float32
            assert torch.equal(param.main_grad, expected)

    reference = [nn.Parameter(torch.zeros_like(s)) for s in sums]
    for param, grad in zip(reference, sums):
        param.grad = grad.clone()
    expected_norm = nn.utils.clip_grad_norm_(reference, 0.05, foreach=True)
    assert torch.equal(gradients.clip_(0.05), expected_norm)
    for grad, expected in zip(gradients.grads, reference):
        assert torch.equal(grad, expected.grad)


def test_fp8_weights_where_megatrons_preset_gathers_them(scripts):
    _, te_peer = scripts
    assert [name for name in te_peer.TE_RECIPES if te_peer.fp8_primary_weights(name)] == ["current", "delayed", "mxfp8"]


def test_the_megatron_layer_columns_are_configured_as_engine_megatron(scripts):
    """Each column's run config: the bench's model and optimizer, the preset of its TE recipe, translated by
    recipes.megatron.translate as engine=megatron translates it (FP8 primary weights, the distributed optimizer)."""
    import megatron_layer_peer
    from recipes.megatron.translate import ddp_config, optimizer_config, transformer_config

    layer_bench, _ = scripts
    model_cfg = dataclasses.replace(load_option("model", "llama3_8b"), num_layers=4)
    expected = {"bf16": (None, False), "current": ("tensorwise", True), "delayed": ("delayed", True),
                "blockwise": ("blockwise", False)}
    for recipe, (fp8_recipe, fp8_param) in expected.items():
        cfg = megatron_layer_peer.megatron_config(model_cfg, recipe, layer_bench.TRAINER, 8)
        config = transformer_config(cfg)
        assert (config.num_layers, config.hidden_size, cfg.model.seq_length) == (4, 4096, 8192)
        assert (config.fp8_recipe if config.fp8 else None, config.fp8_param) == (fp8_recipe, fp8_param), recipe
        assert ddp_config(cfg).use_distributed_optimizer and ddp_config(cfg).fp8_param_gather == fp8_param
        optimizer = optimizer_config(cfg)
        assert (optimizer.lr, optimizer.weight_decay, optimizer.clip_grad) == (1e-5, 0.1, 1.0)
        assert (cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size) == (1, 8)


def test_a_megatron_layer_column_trains_on_megatron_cores_local_spec(tmp_path):
    """Without TE, megatron-core's local spec in BF16, through its DDP, schedule and distributed optimizer on a
    Gloo group of one process (tests/megatron_on_cpu.py points megatron-core's CUDA calls at the CPU): two rounds,
    each building the column anew, beside our BF16 column; with NVIDIA's BF16 gradient buffer and with an FP32 one."""
    if importlib.util.find_spec("transformer_engine"):
        pytest.skip("Transformer Engine is installed: the column would build TE's spec")
    code = ("import sys; sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]; import megatron_on_cpu; "
            "megatron_on_cpu.install(); import layer_bench; sys.exit(layer_bench.main(sys.argv[1:]))")
    argv = ["--model", "tiny_llama", "--layers", "2", "--seq-length", "32", "--precisions", "bf16",
            "--peer", "megatron_layer", "--peer", "megatron_layer_fp32_grads", "--te-recipes", "bf16", "--steps", "2",
            "--rounds", "2", "--warmup", "1",
            "--micro-batches", "2", "--no-compile", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", code, str(REPO_ROOT / "tests"), str(REPO_ROOT / "scripts"), *argv],
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["precision"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert set(rows) == {"bf16", "megatron_layer_bf16", "megatron_layer_fp32_grads_bf16"}
    for name, buffer in (("megatron_layer_bf16", "BF16"), ("megatron_layer_fp32_grads_bf16", "FP32")):
        megatron = rows[name]
        assert not megatron.get("error")
        assert (megatron["rounds"], megatron["timed_steps"]) == ("2", "4")
        assert math.isfinite(float(megatron["last_loss"]))
        # the column's kernels and gradient buffer, named as it is built
        assert re.search(rf"{name} megatron-core's local spec; unfused:[^\n]*; grads reduced in {buffer}",
                         done.stdout), done.stdout[-3000:]


def test_no_timed_step_is_refused_in_one_line(scripts, capsys):
    layer_bench, _ = scripts
    for argv, message in ((["--steps", "0"], "--steps 0 --warmup 3 --rounds 2: time at least one step"),
                          (["--rounds", "0"], "--steps 5 --warmup 3 --rounds 0: time at least one step")):
        with pytest.raises(SystemExit) as exit_info:
            layer_bench.parse_args(["--model", "tiny_llama", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_te_recipes_are_checked_in_one_line(scripts, capsys):
    """--te-recipes picks the columns of TE's recipes (device time: each costs a build and its steps in every
    round), and refuses a recipe TE does not have, or a list with no peer to apply to."""
    layer_bench, _ = scripts
    args = layer_bench.parse_args(["--peer", "te_megatron", "--peer", "megatron_layer", "--te-recipes", "bf16,delayed"])
    assert args.te_recipes == ["bf16", "delayed"]
    assert (args.steps, args.rounds) == (5, 2)  # 10 timed steps per column by default
    columns = [v.name for peer in ("megatron_layer", "megatron_layer_fp32_grads")
               for v in layer_bench.peer_columns(peer, args.te_recipes)]
    assert columns == ["megatron_layer_bf16", "megatron_layer_delayed", "megatron_layer_fp32_grads_bf16",
                       "megatron_layer_fp32_grads_delayed"]
    # Block scaling's other layouts only when asked for; each column with its preset's blocks.
    assert "blockwise_1d1d" in layer_bench.TE_RECIPES and "blockwise_1d1d" not in layer_bench.DEFAULT_TE_RECIPES
    from te_peer import block_dims
    assert (block_dims("blockwise"), block_dims("blockwise_1d1d")) == ((1, 2, 1), (1, 1, 1))
    assert_refused(layer_bench, capsys, "give TE recipes of bf16, current, delayed, blockwise, mxfp8, blockwise_1d1d, "
                   "with --peer te", ["--peer", "te", "--te-recipes", "bf16,fp8_delayed"], ["--te-recipes", "bf16"],
                   ["--peer", "torchao", "--te-recipes", "bf16"])


def assert_refused(layer_bench, capsys, message: str, *argvs: list[str]) -> None:
    """Each command line exits with status 2 (argparse's error) and `message` on stderr."""
    for argv in argvs:
        with pytest.raises(SystemExit) as exit_info:
            layer_bench.parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_torchao_columns_are_its_recipes(scripts, capsys):
    """--peer torchao: a column per torchao recipe (tensorwise for the per-tensor recipes, rowwise and
    rowwise_with_gw_hp for precision=fp8_rowwise and _gw_hp), each converting the blocks with that recipe's own
    config; --torchao-recipes picks them and refuses a recipe torchao does not name."""
    layer_bench, _ = scripts
    args = layer_bench.parse_args(["--peer", "torchao"])
    assert args.torchao_recipes == ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
    assert layer_bench.parse_args(["--peer", "torchao", "--torchao-recipes", "rowwise"]).torchao_recipes == ["rowwise"]
    assert_refused(layer_bench, capsys, "give torchao recipes of tensorwise, rowwise, rowwise_with_gw_hp, with --peer "
                   "torchao", ["--peer", "torchao", "--torchao-recipes", "rowwise,fp8_rowwise"],
                   ["--torchao-recipes", "rowwise"], ["--peer", "te", "--torchao-recipes", "rowwise"])
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import ScalingGranularity

    for recipe in layer_bench.TORCHAO_RECIPES:  # names torchao itself knows, with the granularity the column says
        config = Float8LinearConfig.from_recipe_name(recipe)
        rowwise = config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
        assert rowwise == recipe.startswith("rowwise")
        assert layer_bench.torchao_variant(recipe).name == f"torchao_{recipe}"


# ---- on a GPU with Transformer Engine (`pytest -m gpu`) ----


def tiny_te_config():
    return dataclasses.replace(load_option("model", "tiny_llama"), num_layers=1, seq_length=128)


@pytest.fixture
def process_group_left_behind():
    """The peers make a process group of this one process (and the megatron_layer columns megatron-core's
    parallel state) and keep it: undone after the test, for the tests that make their own."""
    yield
    from recipes.megatron import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
def test_transformer_engine_writes_the_main_gradients_of_the_te_megatron_columns(scripts):
    """TE's weight-gradient GEMMs write main_grad in the first micro-batch and add to it in the others, leaving
    .grad empty; the norms' gradients come through autograd. Against the same layers without the fusion."""
    pytest.importorskip("transformer_engine")
    _, te_peer = scripts
    cfg = tiny_te_config()
    torch.manual_seed(0)
    plain = te_peer.TeDecoderStack(cfg)
    fused = te_peer.TeDecoderStack(cfg, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    gradients = te_peer.MainGradients(list(fused.parameters()))
    inputs = [torch.randn(1, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for micro, x in enumerate(inputs):
        plain(x, is_first_microbatch=micro == 0).float().square().mean().backward()
    gradients.backward(lambda micro: fused(inputs[micro], is_first_microbatch=micro == 0).float().square().mean(),
                       len(inputs))
    names = [name for name, _ in fused.named_parameters()]
    matrices = [name for name, p in fused.named_parameters() if p.ndim == 2]
    assert len(matrices) == 4  # QKV, the attention's output, FC1, FC2
    for name, param, expected in zip(names, fused.parameters(), plain.parameters()):
        assert param.grad is None, name
        # BF16 gradients summed by autograd against FP32 main gradients: equal to BF16's rounding
        reference = expected.grad.float()
        torch.testing.assert_close(param.main_grad, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item(),
                                   msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["bf16", "blockwise", "current", "delayed"])
def test_the_te_megatron_optimizer_updates_the_weights_as_adamw_would(scripts, recipe_name, process_group_left_behind):
    """One step of the te_megatron columns' training against torch's AdamW on FP32 copies of the weights given the
    same clipped main gradients (FusedAdam leaves them as it read them): BF16 weights (FusedAdam's own masters,
    written in its kernel) are AdamW's result rounded to BF16; FP8 weights (current, delayed) hold FP32 masters,
    from the BF16 values TE cast them from, equal to AdamW's result, cast to FP8 with the weight's scale, and their
    transposes are made again. A large learning rate, so that the FP8 weights change."""
    te = pytest.importorskip("transformer_engine.pytorch")
    _, te_peer = scripts
    recipe = te_peer.te_recipe(recipe_name, recipe_name)
    fp8_weights = te_peer.fp8_primary_weights(recipe_name)
    cfg = tiny_te_config()
    torch.manual_seed(0)
    stack = te_peer.TeDecoderStack(cfg, fuse_wgrad_accumulation=True,
                                   fp8_weights_recipe=recipe if fp8_weights else None)
    params = list(stack.parameters())
    assert any(isinstance(p, te.QuantizedTensor) for p in params) == fp8_weights
    # The masters start from the BF16 values the FP8 weights were cast from, as Megatron's do
    initial = [(p.get_high_precision_init_val() if isinstance(p, te.QuantizedTensor) else p.detach()).cuda().float()
               for p in params]
    before = [p.dequantize(dtype=torch.float32) if isinstance(p, te.QuantizedTensor) else p.detach().float()
              for p in params]
    trainer = TrainerConfig(lr=1e-2, warmup_steps=0)
    training = te_peer.MegatronStyleTraining(stack, trainer, te_peer.one_process_group(torch.device("cuda")))
    inputs = [torch.randn(1, cfg.seq_length, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def loss_of(micro: int) -> torch.Tensor:
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return stack(inputs[micro], is_first_microbatch=micro == 0).float().square().mean() / len(inputs)

    training.step(loss_of, len(inputs))
    reference = [nn.Parameter(value.clone()) for value in initial]
    for param, grad in zip(reference, training.gradients.grads):
        param.grad = grad.clone()
    torch.optim.AdamW(te_peer.weight_decay_groups(reference, trainer.weight_decay), lr=trainer.lr,
                      betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps).step()
    masters = dict(zip(map(id, training.fp8_weights + training.copied_weights), training.masters))
    assert len(masters) == (len(params) if fp8_weights else 0)
    for param, expected, start in zip(params, reference, before):
        expected = expected.detach()
        if not isinstance(param, te.QuantizedTensor):
            torch.testing.assert_close(param.detach().float(), expected, rtol=2**-7, atol=1e-6)
            continue
        master = masters[id(param)]
        torch.testing.assert_close(master.detach(), expected, rtol=1e-5, atol=1e-6)
        after = param.dequantize(dtype=torch.float32)
        assert not torch.equal(after, start)
        # E4M3 of the master (through BF16, as TE casts it) at the weight's scale: within half an FP8 step (3
        # mantissa bits) or a subnormal step; where the scale puts it past 448 (delayed scaling's stale amax), 448
        scale_inv = param._scale_inv.float()
        saturated = master.abs() / scale_inv > 448
        tolerance = master.abs() * (2**-4 + 2**-8) + scale_inv * 2**-9
        assert ((after - master).abs() <= tolerance)[~saturated].all()
        assert torch.equal(after[saturated].abs(), (448 * scale_inv).expand_as(after)[saturated])
        if getattr(param, "_transpose", None) is not None and not param._transpose_invalid:
            assert torch.equal(param._transpose, param._data.t().contiguous())


@pytest.mark.gpu
def test_every_new_peer_column_trains_on_a_tiny_model(scripts, tmp_path, process_group_left_behind):
    """The te_megatron and megatron_layer columns (BF16 and FP32 gradient buffers) in TE's Hopper recipes: two
    rounds of two steps each on a tiny model, beside our BF16; none fails, each loss is finite."""
    pytest.importorskip("transformer_engine")
    layer_bench, _ = scripts
    peers = ("te_megatron", "megatron_layer", "megatron_layer_fp32_grads")
    argv = ["--model", "tiny_llama", "--layers", "2", "--seq-length", "256", "--precisions", "bf16",
            *(arg for peer in peers for arg in ("--peer", peer)), "--te-recipes", "bf16,current,delayed,blockwise",
            "--steps", "2", "--rounds", "2", "--warmup", "1", "--micro-batches", "2", "--out", str(tmp_path)]
    assert layer_bench.main(argv) == 0
    rows = {r["precision"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    expected = {"bf16"} | {f"{peer}_{recipe}" for peer in peers
                           for recipe in ("bf16", "current", "delayed", "blockwise")}
    assert set(rows) == expected
    for name, row in rows.items():
        assert not row.get("error"), f"{name}: {row.get('error')}"
        assert row["timed_steps"] == "4" and math.isfinite(float(row["last_loss"])), name
