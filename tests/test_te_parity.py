"""The FP8 recipes against Transformer Engine 2.x's own formulas, eager and under torch.compile, on the CPU.

Each expected value comes from a transliteration of TE's code into Python floats, written here, not from the
implementation under test:
    te_delayed_update     common/recipe/delayed_scaling.cu, kernel_bulk (DelayedScaling's default, fused update)
    te_float_to_e8m0      common/util/ptx_arch_spec.cuh, float_to_e8m0 (its software path; Blackwell's
                          cvt.rp.satfinite.ue8m0x2.f32 rounds the same), applied to amax * max_norm_rcp as
                          cast/mxfp8/quantize_mxfp8.cuh does
    te_scale_from_amax    common/recipe/recipe_common.cuh, compute_scale_from_amax as compute_scale_from_types
                          calls it for blockwise scaling (value_for_inf: the input dtype's largest value)
FP32 arithmetic is emulated exactly: an FP32 product or quotient of FP32 values is the float64 one rounded once to
FP32 (products are exact in float64; for quotients float64 carries more than 2 * 24 + 2 bits, so the double
rounding is innocuous), overflowing to inf.
"""

from __future__ import annotations

import functools
import math
import struct

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from recipes.config import AmaxComputeAlgo
from recipes.fp8.blockwise import quantize_blockwise
from recipes.fp8.delayed_scaling import DelayedScalingState, delayed_scale, quantize_delayed, update_delayed_scaling
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.mxfp8 import mx_scale_exponent, quantize_mx, to_e8m0

from test_fp8_recipes import ref_mx_exponent, ref_round

FLT_MAX = torch.finfo(torch.float32).max
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
INPUT, WEIGHT, GRAD = 0, 1, 2
ALGOS = {"max": AmaxComputeAlgo.max, "most_recent": AmaxComputeAlgo.most_recent}


def f32(value: float) -> float:
    """`value` rounded once to FP32 (round to nearest even, subnormals kept, overflow to inf)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def fmaxf(a: float, b: float) -> float:
    """CUDA's fmaxf: a NaN operand is ignored."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Delayed scaling
# ---------------------------------------------------------------------------------------------------------------


def te_delayed_update(history: list[float], scale: float, last: float, algo: str, fp8_max: float, margin: int):
    """kernel_bulk for one tensor. `history` as TE lays it out ([open slot, oldest, ..., newest]), `last` the
    reduced amax of the open slot. Returns the new (history, scale)."""
    length = len(history)
    amax = 0.0
    if last != 0.0:  # roll (NaN != 0 too)
        a = [history[i + 1] if i < length - 1 else last for i in range(length)]
        for value in a:
            amax = fmaxf(amax, value)
        history = [0.0] + a[1:]
    if algo == "most_recent":
        amax = last
    scaled_max = f32(fp8_max * 2.0**-margin)  # fp8_dtype_max(fp8_dtype) * std::pow(2.f, -margin)
    new = f32(scaled_max / amax) if math.isfinite(amax) and amax > 0 else scale
    return history, FLT_MAX if math.isinf(new) else new


# Amaxes of 9 micro-batches for (layer, role); 0: the tensor was not quantized (a cached weight) or all zero.
SEQUENCES = {
    (0, INPUT): [1, 3.5, 0, 0.25, 100, 0, 0, 7, 1e-3],  # the example
    (0, WEIGHT): [2, 0, 0, 0, 1.5, 0, 0, 0, 1.25],  # a cached weight, 4 micro-batches per optimizer step
    (0, GRAD): [1e-3, 2e-3, 5e-4, 3e-2, 1e-2, 3e-3, 1e-3, 2e-3, 4e-3],
    (1, INPUT): [0, 0, 1e-36, 0, 0, 0, 0, 0, 5],  # tiny: its scale overflows FP32 without a margin
    (1, WEIGHT): [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
    (1, GRAD): [0, 3e-5, 0, 6e4, 0, 0, 1, 0, 2e-7],
}
DTYPES = (E4M3, E4M3, E5M2)  # HYBRID: input, weight, gradient

DELAYED_CASES = [("max", 0, False), ("max", 1, False), ("most_recent", 0, False), ("most_recent", 1, False),
                 ("max", 0, True), ("max", 1, True), ("most_recent", 0, True), ("most_recent", 1, True)]


@pytest.mark.parametrize("algo, margin, compiled", DELAYED_CASES)
def test_delayed_scaling_follows_te_fused_update(algo, margin, compiled):
    """Two layers, history 4, 9 micro-batches: every quantization casts with TE's scale of the moment, and after
    every update the histories and scales equal kernel_bulk's, bit for bit, per (layer, role): a role whose
    amax is 0 keeps its history and scale while the layer's other roles move on."""
    check_delayed_sequence(algo, margin, compiled, torch.device("cpu"))


def check_delayed_sequence(algo: str, margin: int, compiled: bool, device: torch.device) -> None:
    """The test above on `device` (tests/test_gpu.py runs it on a GPU). `compiled`: the path the product takes on
    a GPU, the quantization compiled and the update by recipes.fp8.delayed_update_kernel (here, Triton's CPU
    interpreter); else the eager reference of both."""
    quantize = torch.compile(quantize_delayed) if compiled else quantize_delayed
    update = functools.partial(update_delayed_scaling, kernel=compiled)
    states = [DelayedScalingState(4).to(device), DelayedScalingState(4).to(device)]
    expected = {key: ([0.0] * 4, 1.0) for key in SEQUENCES}
    scales_after = []
    for step in range(9):
        for (layer, role), amaxes in SEQUENCES.items():
            x = torch.tensor([[amaxes[step], -amaxes[step] / 2]], dtype=torch.float32, device=device)
            state = states[layer]
            q = quantize(x, DTYPES[role], state.tensors(), role)
            assert q.scale_inv.item() == f32(1 / expected[layer, role][1]), (step, layer, role)
        update(states, DTYPES, ALGOS[algo], margin)
        for (layer, role), amaxes in SEQUENCES.items():
            history, scale = expected[layer, role]
            expected[layer, role] = te_delayed_update(history, scale, f32(amaxes[step]), algo, FP8_MAX[DTYPES[role]],
                                                      margin)
            assert states[layer].amax_history[role].tolist() == expected[layer, role][0], (step, layer, role)
            assert states[layer].scale[role].item() == expected[layer, role][1], (step, layer, role)
        scales_after.append({key: value[1] for key, value in expected.items()})
    # The issue's numbers, from TE's rule by hand. Layer 0's input after micro-batch 9 (index 8): the window holds
    # 0.25, 100, 7, 1e-3 (max: 448 / 100 = 4.48, not 448 / 7 = 64 as when the zeros rolled in; most_recent:
    # 448 / 1e-3). The cached weight keeps 448 / 2 = 224 through the whole window (max).
    if algo == "max":
        assert scales_after[8][0, INPUT] == f32(f32(448.0 * 2.0**-margin) / 100) != f32(448.0 / 7)
        assert [s[0, WEIGHT] for s in scales_after] == [f32(f32(448.0 * 2.0**-margin) / 2)] * 9
    else:
        assert scales_after[8][0, INPUT] == f32(f32(448.0 * 2.0**-margin) / f32(1e-3))
    # Layer 1's input after amax 1e-36 (micro-batch 3): 448 / 1e-36 overflows FP32 (FP32's max); with margin 1 the
    # scaled maximum 224 is divided instead, 2.24e38 < FP32's max 3.40e38 (not FP32's max, as 448 / 1e-36 / 2).
    tiny = scales_after[2][1, INPUT]
    assert tiny == (FLT_MAX if margin == 0 else f32(224.0 / f32(1e-36))), tiny
    assert margin == 0 or 2.239e38 < tiny < 2.241e38


def random_states(history_len: int, layers: int, seed: int, device: torch.device) -> list[DelayedScalingState]:
    """States with histories and open slots drawn from zeros, NaN, inf, tiny, huge and ordinary amaxes, scales
    from 1 and earlier quotients, some non-finite flags already set."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, 0.0, float("nan"), float("inf"), 1e-36, 1e-3, 0.5, 3.0, 448.0, 6e4, 3e38])
    states = [DelayedScalingState(history_len) for _ in range(layers)]
    for state in states:
        state.amax_history.copy_(values[torch.randint(len(values), state.amax_history.shape, generator=g)])
        state.grad_amax.copy_(values[torch.randint(len(values), (1,), generator=g)])
        state.scale.copy_(torch.tensor([1.0, 0.75, 3.5e3])[torch.randperm(3, generator=g)])
        state.nonfinite.copy_((torch.rand(3, generator=g) < 0.2).float())
    return [state.to(device) for state in states]


@pytest.mark.parametrize("history_len", [1, 5, 16])
@pytest.mark.parametrize("algo, margin", [("max", 0), ("max", 2), ("most_recent", 1)])
def test_delayed_update_kernel_writes_the_reference_bits(history_len, algo, margin):
    """The GPU's update (recipes.fp8.delayed_update_kernel, Triton's interpreter here) against the reference
    update the test above checks against TE: every history, scale and non-finite flag bit for bit, over zeros,
    NaN, inf, tiny and huge amaxes, a history of one, lengths that are not powers of two."""
    check_update_kernel(history_len, algo, margin, torch.device("cpu"))


def check_update_kernel(history_len: int, algo: str, margin: int, device: torch.device) -> None:
    """The test above on `device` (tests/test_gpu.py runs it on a GPU)."""
    for seed in range(4):
        reference, kernel = (random_states(history_len, 7, seed, device) for _ in range(2))
        for states, use_kernel in ((reference, False), (kernel, True)):
            update_delayed_scaling(states, DTYPES, ALGOS[algo], margin, kernel=use_kernel)
        for ours, theirs in zip(kernel, reference):
            for name in ("amax_history", "scale", "grad_amax", "nonfinite"):
                got, want = getattr(ours, name), getattr(theirs, name)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (seed, name, got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_delayed_scale_margin_with_a_tiny_amax(compiled):
    """TE's order of operations: (fp8_max * 2**-margin) / amax, then FP32's max for an overflow. amax 1e-36,
    margin 1: 2.24e38 (dividing first and halving after would overflow to inf and give FP32's max)."""
    scale = torch.compile(delayed_scale) if compiled else delayed_scale
    amax = torch.tensor([1e-36, 1e-36, 0.0, float("inf"), float("nan")], dtype=torch.float32)
    previous = torch.full_like(amax, 3.0)
    got = scale(amax, previous, E4M3, 1).tolist()
    assert got == [f32(224.0 / f32(1e-36)), f32(224.0 / f32(1e-36)), 3.0, 3.0, 3.0]
    assert 2.239e38 < got[0] < 2.241e38
    assert scale(amax, previous, E4M3, 0).tolist() == [FLT_MAX, FLT_MAX, 3.0, 3.0, 3.0]


def test_delayed_cast_reads_the_stored_scale_only():
    """The cast and its scale_inv do not depend on the tensor's own amax (a compiler may then fuse the cast into
    the kernel producing the tensor, and the amax reduction does not have to finish first); the amax is still
    computed, for the history."""
    def quantize(x, history, scale, grad_amax):
        q = quantize_delayed(x, E4M3, (history, scale, grad_amax), INPUT)
        return q.data, q.scale_inv

    graph = make_fx(quantize)(torch.randn(4, 8), torch.zeros(3, 4), torch.ones(3), torch.zeros(1)).graph
    reductions = {n for n in graph.nodes if n.target in (torch.ops.aten.amax.default, torch.ops.aten.max.default)}
    assert reductions
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    for output in outputs:
        seen, stack = set(), [output]
        while stack:
            node = stack.pop()
            assert node not in reductions, f"{output} depends on the amax"
            stack += [n for n in node.all_input_nodes if n not in seen]
            seen.update(node.all_input_nodes)


# ---------------------------------------------------------------------------------------------------------------
# MXFP8: the E8M0 exponent
# ---------------------------------------------------------------------------------------------------------------


def bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def te_float_to_e8m0(val: float) -> int:
    """ptx_arch_spec.cuh float_to_e8m0, software path, for an FP32 value."""
    if math.isnan(val):
        return 0xFF
    if math.isinf(val):
        return 0xFE
    if val == 0.0:
        return 0x00
    exponent, mantissa = bits(val) >> 23, bits(val) & 0x7FFFFF
    if (mantissa > 0 and exponent != 0xFE) and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def te_mx_byte(amax: float, fp8_max: float) -> int:
    """quantize_mxfp8.cuh: float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp), max_norm_rcp being
    1.0 / max_norm (double) stored as a float."""
    return te_float_to_e8m0(f32(amax * f32(1.0 / fp8_max)))


def edge_amax(fp8_max: float) -> float:
    """The float just above fp8_max * 2**-127 (an FP32 normal)."""
    return torch.nextafter(torch.tensor(fp8_max * 2.0**-127), torch.tensor(math.inf)).item()


def mx_amaxes() -> torch.Tensor:
    """FP32 amaxes over every binade, subnormals included: random mantissas, the binade's ends, and fp8_max *
    2**k with its FP32 neighbours for both formats (the rounding boundaries)."""
    g = torch.Generator().manual_seed(13)
    exponent_fields = torch.arange(0, 255, dtype=torch.int32).repeat_interleave(24)
    mantissas = torch.randint(0, 2**23, (exponent_fields.numel(),), generator=g, dtype=torch.int32)
    mantissas[::24], mantissas[1::24] = 0, 2**23 - 1
    random = ((exponent_fields << 23) | mantissas).view(torch.float32)
    powers = torch.tensor([m * 2.0**k for m in FP8_MAX.values() for k in range(-149, 113)], dtype=torch.float32)
    powers = powers[powers > 0]
    up, down = torch.nextafter(powers, torch.tensor(math.inf)), torch.nextafter(powers, torch.tensor(0.0))
    return torch.cat([random, powers, up, down, torch.tensor([0.0])])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mx_exponent_is_te_float_to_e8m0(dtype, compiled):
    check_mx_exponents(dtype, compiled, torch.device("cpu"))


def check_mx_exponents(dtype: torch.dtype, compiled: bool, device: torch.device) -> None:
    """The test above on `device`: subnormal products must not be flushed to zero."""
    fp8_max = FP8_MAX[dtype]
    exponent = torch.compile(mx_scale_exponent) if compiled else mx_scale_exponent
    amax = mx_amaxes()
    got = (exponent(amax.to(device), dtype) + 127).tolist()
    expected = [te_mx_byte(a, fp8_max) for a in amax.tolist()]
    assert got == expected
    # The module's claim: the exact 2**ceil(log2(amax / fp8_max)) clamped to E8M0's range, for every amax but
    # the float just above fp8_max * 2**-127, whose FP32 product rounds down to 2**-127: TE's byte 0, exact 1.
    edge = edge_amax(fp8_max)
    exact = [ref_mx_exponent(a, fp8_max) + 127 for a in amax.tolist()]
    differs = {a for a, te, ex in zip(amax.tolist(), expected, exact) if te != ex}
    assert edge in amax.tolist() and differs == {edge}
    assert te_mx_byte(edge, fp8_max) == 0 and ref_mx_exponent(edge, fp8_max) + 127 == 1
    assert exponent(torch.tensor([edge], device=device), dtype).item() + 127 == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_mx_at_the_e8m0_edge(dtype, compiled):
    """A block whose amax is the edge amax: E8M0 byte 0 (scale_inv 2**-127) as in TE, so its largest element maps
    a hair above fp8_max and saturates to it; every element is cast with 2**127."""
    fp8_max = FP8_MAX[dtype]
    quantize = torch.compile(quantize_mx) if compiled else quantize_mx
    x = torch.zeros(2, 32)
    x[0] = torch.linspace(-1, 1, 32) * fp8_max * 2.0**-128
    x[0, 7] = edge_amax(fp8_max)
    x[1] = torch.linspace(-3, 3, 32)
    q = quantize(x, dtype)
    assert to_e8m0(q.scale_inv).tolist() == [[0], [te_mx_byte(3.0, fp8_max)]]
    assert q.data[0, 7].float().item() == fp8_max  # saturated: edge * 2**127 > fp8_max
    data = ref_round(x[0].double() * 2.0**127, dtype)  # exact products in float64, FP32 representable here
    assert torch.equal(q.data[0].double(), data)


# ---------------------------------------------------------------------------------------------------------------
# Blockwise with FP32 scales
# ---------------------------------------------------------------------------------------------------------------


def te_scale_from_amax(amax: float, fp8_max: float, pow_2: bool, value_for_inf: float) -> float:
    """recipe_common.cuh compute_scale_from_amax with epsilon 0 (TE's recipes' amax_epsilon)."""
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = f32(fp8_max / amax)  # __fdiv_rn
    if math.isinf(scale):
        scale = value_for_inf
    if pow_2:
        scale = struct.unpack("<f", struct.pack("<I", bits(scale) & 0xFF800000))[0]
    return scale


BLOCKWISE_CASES = [(torch.bfloat16, False, False), (torch.bfloat16, True, False), (torch.float32, False, False),
                   (torch.float32, True, False), (torch.bfloat16, False, True)]


@pytest.mark.parametrize("in_dtype, pow2, compiled", BLOCKWISE_CASES)
def test_blockwise_scales_are_te_compute_scale_from_types(in_dtype, pow2, compiled):
    """Block amaxes below fp8_max / FP32's max (1.3e-36 for E4M3) overflow the FP32 quotient: TE's scale is then
    the input dtype's largest value (BF16: 3.3895e38; FP32: 3.4028e38), and scale_inv its FP32 reciprocal."""
    check_blockwise_scales(in_dtype, pow2, compiled, torch.device("cpu"))


def check_blockwise_scales(in_dtype: torch.dtype, pow2: bool, compiled: bool, device: torch.device) -> None:
    """The test above on `device`."""
    quantize = torch.compile(quantize_blockwise) if compiled else quantize_blockwise
    amaxes = [1e-37, 1e-38, 0.0, 1.0, 3e-20, 1000.0, 2e-36]
    x = torch.zeros(len(amaxes), 128, dtype=in_dtype, device=device)
    x[:, 5] = torch.tensor(amaxes).to(in_dtype)
    x[:, 9] = -x[:, 5] / 3
    for dtype in (E4M3, E5M2):
        q = quantize(x, dtype, (1, 128), pow2)
        value_for_inf = torch.finfo(in_dtype).max
        expected = [f32(1.0 / te_scale_from_amax(a, FP8_MAX[dtype], pow2, value_for_inf))
                    for a in x[:, 5].float().tolist()]
        assert q.scale_inv[:, 0].tolist() == expected, dtype
    if in_dtype == torch.bfloat16 and not pow2:
        assert q.scale_inv[0, 0].item() == f32(1.0 / torch.finfo(torch.bfloat16).max) != f32(1.0 / FLT_MAX)
