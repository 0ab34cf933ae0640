"""The fused-linear path's pieces on the CPU (tests/test_gpu.py runs them on cuBLAS and Triton): Bf16Linear computes
what autocast's nn.Linear computes; weight gradients written into FP32 main gradients sum over micro-batches as
autograd sums them, eager and compiled; the Triton kernels (under Triton's CPU interpreter, where installed) write
the reference path's FP8 bytes and scales."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from recipes.engine.training import build_optimizer, optimizer_step
from recipes.config import TrainerConfig, load_option
from recipes.fp8 import Fp8Training
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.current_scaling import cast_to_fp8
from recipes.fp8.activation_ops import OPS
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.mlp import Bf16Mlp, Fp8Mlp
from recipes.fp8.linear import (
    CACHE_OFF, CACHE_REFRESH, CACHE_REUSE, Bf16Linear, BlockwiseScaling, DelayedScaling, Fp8Linear, TensorwiseScaling,
    written_once,
)
from recipes.fp8.tensor import Float8Tensor
from recipes.fp8.training import attach_main_grads, attach_weight_caches, expose_main_grads, set_weight_cache_mode
from recipes.models.transformer import MLP, Transformer

from fused_quantize_checks import check_1x128, check_op, check_scale_edge_cases, op_inputs
from hopper_compile import run_compiled

MICRO_BATCHES = 3


def micro_batches(layer: nn.Module, inputs: list, grads: list, run=None) -> tuple[list, list]:
    """Forward and backward of each micro-batch as optimizer_step runs them (cache refreshed, then reused; the main
    gradients become the weights' .grad at the end): the outputs and the inputs' gradients. `run`: the layer
    compiled, where it is."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    ys = []
    for micro, (x, dy) in enumerate(zip(xs, grads)):
        set_weight_cache_mode(layer, CACHE_REFRESH if micro == 0 else CACHE_REUSE)
        y = (layer if run is None else run)(x)  # not `run or layer`: a compiled module has no truth value
        y.backward(dy)
        ys.append(y.detach())
    set_weight_cache_mode(layer, CACHE_OFF)
    expose_main_grads(layer)
    return ys, [x.grad for x in xs]


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def operands(k: int = 256, n: int = 384, rows: int = 128, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(rows, k, generator=generator).to(torch.bfloat16) for _ in range(MICRO_BATCHES)]
    grads = [(torch.randn(rows, n, generator=generator) * 1e-3).to(torch.bfloat16) for _ in range(MICRO_BATCHES)]
    weight = torch.randn(n, k, generator=generator) * 0.02
    return inputs, grads, weight


def linear_with(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_bf16_linear_computes_what_autocast_computes():
    inputs, grads, weight = operands()
    plain, converted = linear_with(weight), linear_with(weight)
    layer = Bf16Linear(converted)
    attach_weight_caches(layer)  # the BF16 weight cast once, in the first micro-batch
    outputs = {}
    for name, module in (("plain", plain), ("bf16", layer)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs[name] = micro_batches(module, inputs, grads)
    for a, b in zip(*(outputs[name][0] + outputs[name][1] for name in ("plain", "bf16"))):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    assert torch.equal(plain.weight.grad, converted.weight.grad)  # BF16 GEMM, cast to FP32, summed by autograd


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_main_grad_sums_micro_batches_in_fp32(compiled):
    inputs, grads, weight = operands()
    layer = Bf16Linear(linear_with(weight))
    attach_weight_caches(layer)
    attach_main_grads(layer)
    micro_batches(torch.compile(layer) if compiled else layer, inputs, grads)
    expected = sum(dy.double().t() @ x.double() for x, dy in zip(inputs, grads))  # BF16 products, exact in FP64
    assert layer.weight.grad is layer.main_grad and layer.main_grad.dtype == torch.float32
    # FP32 sums err ~1e-7 of the norm; partial gradients rounded to BF16 (autocast's path) ~1e-3.
    assert relative_error(layer.main_grad, expected) < 1e-5
    bf16_partials = sum((dy.t() @ x).double() for x, dy in zip(inputs, grads))
    assert relative_error(bf16_partials, expected) > 1e-4


@pytest.mark.parametrize("recipe, compiled", [
    (TensorwiseScaling(E4M3, E5M2), False), (TensorwiseScaling(E4M3, E5M2), True),
    (DelayedScaling(E4M3, E5M2, amax_history_len=4), False), (TensorwiseScaling(E4M3, E5M2, fp8_wgrad=False), False),
], ids=["current", "current-compiled", "delayed", "bf16-wgrad"])
def test_fp8_main_grad_equals_autograds_sum(recipe, compiled):
    """The same FP8 GEMMs either way; main_grad receives the first micro-batch's weight gradient and adds the
    others, which is what autograd's accumulation does (bit for bit on the CPU, whose path adds after the GEMM)."""
    inputs, grads, weight = operands()
    reference, fused = Fp8Linear(linear_with(weight), recipe), Fp8Linear(linear_with(weight), recipe)
    for layer in (reference, fused):
        attach_weight_caches(layer)
    attach_main_grads(fused)
    micro_batches(reference, inputs, grads)
    micro_batches(torch.compile(fused) if compiled else fused, inputs, grads)
    assert fused.weight.grad is fused.main_grad
    if recipe.fp8_wgrad:
        assert torch.equal(fused.main_grad, reference.weight.grad)
    else:  # BF16 wgrad: FP32 sums of BF16 products instead of BF16-rounded partial gradients
        expected = sum(dy.double().t() @ x.double() for x, dy in zip(inputs, grads))
        assert relative_error(fused.main_grad, expected) < 1e-5 < relative_error(reference.weight.grad, expected)


def test_optimizer_step_with_fused_linears_trains_like_autograd():
    """A tiny model, fp8_current, three micro-batches: with main gradients (and BF16 blocks as Bf16Linear) one
    optimizer step lands on the same weights as with autograd's gradients."""
    cfg = load_option("model", "tiny_llama")
    precision = load_option("precision", "fp8_current")
    trainer = TrainerConfig(lr=1e-3, warmup_steps=0, max_steps=1)
    tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCHES, 1, 65), generator=torch.Generator().manual_seed(3))
    weights = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(torch.Generator().manual_seed(0))
        fp8 = Fp8Training(precision, MICRO_BATCHES, fused_linears=fused)
        fp8.convert(model)
        with_main_grads = [m for m in model.modules() if getattr(m, "main_grad", None) is not None]
        assert len(with_main_grads) == (4 * cfg.num_layers + 1 if fused else 0)  # and the output layer
        optimizer = build_optimizer(model, trainer, torch.device("cpu"))

        def loss(micro: int) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(tokens[micro, :, :-1], tokens[micro, :, 1:], MICRO_BATCHES)

        optimizer_step(loss, MICRO_BATCHES, model, fp8, optimizer, trainer.lr, trainer.grad_clip)
        weights.append([p.detach().clone() for p in model.parameters()])
    for before, after in zip(*weights):
        assert torch.equal(before, after)


def test_bf16_linears_replace_only_bf16_blocks():
    cfg = load_option("model", "tiny_llama")
    precision = load_option("precision", "fp8_current")
    model = Transformer(cfg)
    edges = dataclasses.replace(precision, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    assert convert_to_fp8(model.layers, edges, bf16_linears=True) == 4 * (cfg.num_layers - 2)
    kinds = [{type(m) for m in layer.modules() if isinstance(m, nn.Linear)} for layer in model.layers]
    assert kinds == [{Bf16Linear}] + [{Fp8Linear}] * (cfg.num_layers - 2) + [{Bf16Linear}]
    plain = Transformer(cfg)
    assert convert_to_fp8(plain.layers, load_option("precision", "bf16")) == 0
    assert {type(m) for m in plain.layers.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


# ---- Triton kernels under the CPU interpreter ----

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture
def kernels(monkeypatch):
    """recipes.fp8.kernels under Triton's CPU interpreter (tests/conftest.py chose it), standing in for a GPU: the
    FP8 linears use them on CPU tensors too."""
    from recipes.fp8 import kernels as module

    assert module.INTERPRETED
    monkeypatch.setattr("recipes.fp8.linear._kernels_for", lambda t: module)
    return module


def awkward_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over 60 binades (FP8 subnormals and saturation), an all-zero tile, NaN, infinities, and a block whose
    amax is FP32-subnormal (its scale overflows FP32)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-30, 30, cols)
    x[:128, :128] = 0
    x[5, 200], x[130, 7], x[200, 300] = float("nan"), float("inf"), -float("inf")
    x[140:142, 130:260] = 1e-39
    return x.to(torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("form", [{"KEEP": 1, "SPLIT": 0}, {"KEEP": 0, "SPLIT": 0}, {"KEEP": 0, "SPLIT": 1}],
                         ids=["kept", "recomputed", "split"])
def test_blockwise_kernel_writes_the_reference_bytes(fused_quantize, monkeypatch, op, form):
    """Each op's output and its transpose in 1x128 blocks, from one kernel, are the unfused blockwise quantization's
    bytes and scales: on values over 40 binades with zero blocks, NaN and infinities, and (a materialized tensor) on
    60 binades with a block whose amax is FP32-subnormal (its scale overflows)."""
    cases = [op_inputs(op, rows=256, cols=384, device="cpu", seed=4, awkward=awkward) for awkward in (False, True)]
    if op == "identity":
        cases.append((awkward_input(256, 384, seed=1), None))
    for key, value in form.items():  # the values kept, or computed again by a program per tile or per strip
        monkeypatch.setitem(fused_quantize._INTERPRETED_1X128_TILE, key, value)
    for a, b in cases:
        for dtype in (E4M3, E5M2):
            check_1x128(fused_quantize, op, a, b, dtype)


@needs_triton
@pytest.mark.parametrize("shape", [(200, 300), (64, 64), (1, 129)])
def test_transpose_fp8_moves_every_byte(kernels, shape):
    q = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 100).to(E4M3)
    assert torch.equal(kernels.transpose_fp8(q).view(torch.uint8), q.t().contiguous().view(torch.uint8))


@needs_triton
def test_a_compiled_cast_read_by_the_gemm_and_the_transpose_kernel_is_written_once(kernels):
    """Inductor would write one copy of the FP8 bytes for each extern kernel reading them; written_once keeps one."""
    def operands_of_two_gemms(x, scale, w, fix):
        quantized = Float8Tensor(cast_to_fp8(x * 2, scale, E4M3), scale)
        data = (written_once(quantized) if fix else quantized).data
        return kernels.transpose_fp8(data), torch._scaled_mm(data, w.t(), scale, scale, out_dtype=torch.bfloat16)

    x, w, scale = torch.randn(64, 128).to(torch.bfloat16), torch.randn(32, 128).to(E4M3), torch.tensor(0.5)
    fp8_buffers = {}
    for fix in (False, True):
        torch._dynamo.reset()
        outputs, (code, *_) = run_and_get_code(torch.compile(operands_of_two_gemms), x, scale, w, fix)
        fp8_buffers[fix] = code.count("empty_strided_cpu((64, 128), (128, 1), torch.float8_e4m3fn)")
        for got, expected in zip(outputs, operands_of_two_gemms(x, scale, w, fix)):
            assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                               expected.view(torch.uint8) if expected.dtype == E4M3 else expected)
    assert fp8_buffers == {False: 2, True: 1}


@needs_triton
@pytest.mark.parametrize("recipe", [TensorwiseScaling(E4M3, E5M2), DelayedScaling(E4M3, E5M2, amax_history_len=4),
                                    BlockwiseScaling(E4M3, E4M3, emulate=True)], ids=["current", "delayed", "blockwise"])
def test_fp8_linear_with_fused_kernels_equals_reference(kernels, fused_quantize, recipe):
    """The same layer with and without the kernels: identical outputs and gradients, bit for bit."""
    inputs, grads, weight = operands(k=128, n=256, rows=128)  # the interpreter runs ~0.5 s per 128 x 128 tile
    results = []
    for fused in (False, True):
        layer = Fp8Linear(linear_with(weight), dataclasses.replace(recipe, fused_kernels=fused))
        attach_weight_caches(layer)
        outputs, input_grads = micro_batches(layer, inputs, grads)
        results.append(outputs + input_grads + [layer.weight.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.fixture
def fused_quantize(monkeypatch):
    """recipes.fp8.fused_quantize under Triton's CPU interpreter, used by the per-tensor and blockwise recipes on CPU
    tensors."""
    from recipes.fp8 import fused_quantize as module

    monkeypatch.setattr("recipes.fp8.linear.fused_quantize_for", lambda t: module)
    return module


@needs_triton
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("awkward", [False, True], ids=["plain", "awkward"])
def test_fused_quantize_writes_the_reference_bytes(fused_quantize, op, awkward):
    """Each op's amax, FP8 bytes (row-major and transposed), recorded history slot and BF16 values are the unfused
    reference's (PyTorch's activation, then current scaling's cast), on an odd shape (masked tiles) and one the
    tiles divide (unmasked)."""
    for rows, cols in ((70, 100), (128, 64)):
        a, b = op_inputs(op, rows=rows, cols=cols, device="cpu", seed=3, awkward=awkward)
        for dtype in (E4M3, E5M2):
            check_op(fused_quantize, op, a, b, dtype)


@needs_triton
def test_current_scaling_kernel_computes_the_reference_scale(fused_quantize):
    """The casting kernel computes current scaling's scale from the amax, and writes scale_inv, as
    recipes.fp8.current_scaling does: for an amax of zero, a tiny one (the quotient overflows), a huge one,
    inf and NaN."""
    check_scale_edge_cases(fused_quantize, "cpu")


@needs_triton
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_nemotron"])
@pytest.mark.parametrize("precision", ["bf16", "fp8_current", "fp8_delayed", "fp8_blockwise"])
def test_fused_mlp_equals_the_unfused_one(kernels, fused_quantize, model, precision):
    """fc1, activation and fc2 as one function with the kernels (recipes.fp8.mlp; BF16: the Bf16Linears of the fused
    linears) against the modules without them and autograd's activation: identical outputs, input and weight
    gradients and amax histories over micro-batches, bit for bit."""
    cfg = dataclasses.replace(load_option("model", model), hidden_size=128, ffn_hidden_size=128)
    torch.manual_seed(0)
    base = MLP(cfg)
    generator = torch.Generator().manual_seed(1)
    rows = 128 if precision == "fp8_blockwise" else 64  # blockwise wgrad: 1x128 blocks along the tokens
    inputs = [torch.randn(rows, 128, generator=generator).to(torch.bfloat16) for _ in range(MICRO_BATCHES)]
    grads = [(torch.randn(rows, 128, generator=generator) * 1e-3).to(torch.bfloat16) for _ in range(MICRO_BATCHES)]
    fused_type, linear_type = (Bf16Mlp, Bf16Linear) if precision == "bf16" else (Fp8Mlp, Fp8Linear)
    results = []
    for fused in (False, True):
        settings = dataclasses.replace(load_option("precision", precision), fused_kernels=fused, amax_history_len=4,
                                       emulate=precision == "fp8_blockwise")  # no block-scaled GEMM on a CPU
        blocks = nn.ModuleList([nn.Sequential(copy.deepcopy(base))])
        convert_to_fp8(blocks, settings, bf16_linears=precision == "bf16")
        mlp = blocks[0][0]
        assert isinstance(mlp, fused_type) == fused and type(mlp.fc1) is linear_type
        attach_weight_caches(mlp)
        attach_main_grads(mlp)
        outputs, input_grads = micro_batches(mlp, inputs, grads)
        states = [m.fp8_state.amax_history for m in (mlp.fc1, mlp.fc2) if getattr(m, "fp8_state", None) is not None]
        results.append(outputs + input_grads + [mlp.fc1.weight.grad, mlp.fc2.weight.grad] + states)
    for a, b in zip(*results):
        assert torch.equal(a, b)

HOPPER_SPILL_CHECK = r"""
import sys
from pathlib import Path
import triton
from hopper_compile import compile_for_hopper
from recipes.fp8 import fused_quantize as fq

pointers = {"a": "*bf16", "b": "*bf16"}
sizes = {"rows": "i32", "cols": "i32", "a_cols": "i32", "b_cols": "i32"}
# Each kernel with the ops and modes the product runs it in: the FP8 kernel casts an op's output in delayed scaling
# (CAST_AND_RECORD), and a materialized tensor (identity) in every mode; the BF16 kernel takes every op.
fp8_runs = [(op, {"MODE": fq.CAST_AND_RECORD.value}) for op in (fq.SWIGLU.value, fq.SWIGLU_BACKWARD.value)]
fp8_runs += [(fq.IDENTITY.value, {"MODE": mode.value}) for mode in (fq.AMAX_ONLY, fq.CAST_BY_AMAX, fq.CAST_AND_RECORD)]
bf16_runs = [(op, {"RECORD_AMAX": record}) for op in (fq.SWIGLU.value, fq.SWIGLU_BACKWARD.value)
             for record in (False, True)]  # the ops with the most live tiles
kernels = [(fq._fp8_producer_kernel, {**pointers, "out": "*fp8e4nv", "out_t": "*fp8e4nv", "scale_ptr": "*fp32",
                                      "scale_inv": "*fp32", "amax_bits": "*i32", **sizes},
            dict(FP8_MAX=448.0, MANTISSA=3, BIAS=7, OUT=triton.language.float8e4nv, SOFTWARE=False), fp8_runs),
           (fq._bf16_producer_kernel, {**pointers, "out": "*bf16", "amax_bits": "*i32", **sizes},
            dict(SOFTWARE=False), bf16_runs)]
tiles = {fq._fp8_producer_kernel: fq._TILES, fq._bf16_producer_kernel: fq._TILES}
# The blockwise kernel with every op (128 x 128 tiles, no masks), specialized as its launches are: every size a
# multiple of 128 and every pointer 16-byte aligned, so Triton compiles it for arguments divisible by 16.
kernels.append((fq._fp8_1x128_producer_kernel, {**pointers, "out": "*fp8e4nv", "scale_inv": "*fp32",
                                                "out_t": "*i32", "scale_inv_t": "*fp32", "scratch": "*i16", **sizes},
                dict(FP8_MAX=448.0, MANTISSA=3, BIAS=7, OUT=triton.language.float8e4nv, SOFTWARE=False, B=fq.BLOCK),
                [(op, {}) for op in range(len(fq.OPS))]))
tiles[fq._fp8_1x128_producer_kernel] = fq._1X128_TILES
for kernel, signature, constants, runs in kernels:
    for (op, mode), tile in ((run, tile) for run in runs for tile in tiles[kernel]):
        if kernel is fq._fp8_1x128_producer_kernel and not fq._1x128_forms([tile], {}, OP=op):
            continue  # a form the autotuner never runs for this op
        masks = {} if kernel is fq._fp8_1x128_producer_kernel else {"EVEN": False}  # masks: more registers
        const = {**constants, "OP": op, **mode, **tile.kwargs, **masks}
        divisible = tuple(range(len(signature))) if kernel is fq._fp8_1x128_producer_kernel else ()
        _, spilled, _ = compile_for_hopper(kernel, signature, const, Path(sys.argv[1]), tile.num_warps,
                                           divisible=divisible)
        print(kernel.__name__, op, mode, tile.kwargs, tile.num_warps, "spill", spilled, flush=True)
        assert spilled == 0, f"{kernel.__name__} op {op} mode {mode} {tile} spills {spilled} bytes"
"""


@needs_triton
def test_fused_quantize_tiles_compile_for_hopper_without_register_spills(tmp_path):
    """Every autotuned tile of recipes.fp8.fused_quantize's kernels, compiled for sm_90a by Triton's own ptxas (no
    GPU needed), keeps its tiles in registers: a spill turns a bandwidth-bound kernel into a local-memory-bound one
    (the first tile sizes spilled up to 3 KB per thread and ran at half the bandwidth on an H200)."""
    run_compiled(HOPPER_SPILL_CHECK, tmp_path)


@needs_triton
def test_fused_quantize_bench_times_each_op_and_mode_of_a_model(fused_quantize, tmp_path):
    """scripts/fused_quantize_bench.py runs the product's kernels (here in the interpreter) for each op and mode of
    the model's MLP and counts the bytes each call moves."""
    spec = importlib.util.spec_from_file_location("fused_quantize_bench",
                                                  Path(__file__).parents[1] / "scripts" / "fused_quantize_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokens = 128  # blockwise: 1x128 blocks along the tokens too
    assert bench.main(["--model", "tiny_nemotron", "--seq-length", str(tokens), "--warmup", "0", "--iterations", "1",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["op"], r["mode"]) for r in rows] == [
        ("squared_relu", m) for m in ("current", "delayed", "blockwise")] + [
        ("squared_relu_backward", m) for m in ("current", "delayed", "blockwise", "bf16")] + [
        ("identity", m) for m in ("current", "delayed", "blockwise")]
    ffn = load_option("model", "tiny_nemotron").ffn_hidden_size
    cast, blockwise = rows[1], rows[2]  # squared ReLU: reads BF16 (tokens, ffn), writes FP8 (tokens, ffn) both ways
    assert cast["bytes"] == tokens * ffn * 2 + 2 * tokens * ffn and cast["ms"] > 0
    assert blockwise["bytes"] == cast["bytes"] + 2 * 4 * tokens * ffn // 128  # and a scale per block, both ways
    assert (tmp_path / "results.md").read_text().count("| tiny_nemotron |") == len(rows)
