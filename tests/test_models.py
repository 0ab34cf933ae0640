"""The models (recipes/models/transformer.py) and the FLOP count (recipes/metrics.py), against independent references.

Parameter counts come from REFERENCE.md section 2 (Llama) or from a closed form written out here (Nemotron-4);
norms, RoPE, MLPs and attention are compared with float64 formulas written directly in this file.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from recipes.config import CONF_DIR, Activation, ModelConfig, Normalization, RopeScaling, load_option
from recipes.metrics import count_parameters, flops_per_token
from recipes.models.transformer import (
    MLP,
    Attention,
    LayerNorm1p,
    RMSNorm,
    RotaryEmbedding,
    Transformer,
    rope_inverse_frequencies,
)

# REFERENCE.md section 2, copied by hand: layers, hidden, ffn, heads, kv groups, head dim, vocab, seq.
REFERENCE_ARCHITECTURES = {
    "llama3_8b": (32, 4096, 14336, 32, 8, 128, 128256, 8192),
    "llama3_70b": (80, 8192, 28672, 64, 8, 128, 128256, 8192),
    "llama31_405b": (126, 16384, 53248, 128, 8, 128, 128256, 8192),
    "nemotron4_15b": (32, 6144, 24576, 48, 8, 128, 256000, 4096),
    "nemotron4_340b": (96, 18432, 73728, 96, 8, 192, 256000, 4096),
}

# REFERENCE.md section 2: "Parameter counts: 8B = 8,030,261,248; 70B = 70,553,706,496; 405B = 405,853,388,800."
LLAMA_PARAMETERS = {
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama31_405b": 405_853_388_800,
}


def tiny(**changes) -> ModelConfig:
    """A small model for numerical checks: tiny_llama from conf/ with the given fields changed."""
    return dataclasses.replace(load_option("model", "tiny_llama"), **changes)


# ---- the published architectures ----


@pytest.mark.parametrize("name", REFERENCE_ARCHITECTURES)
def test_conf_model_matches_reference_table(name):
    m = load_option("model", name)
    dims = (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.kv_channels, m.vocab_size, m.seq_length)
    assert dims == REFERENCE_ARCHITECTURES[name]
    if name.startswith("llama"):
        assert (m.normalization, m.activation, m.rope_base, m.norm_eps, m.rotary_percent) == (
            Normalization.rmsnorm, Activation.swiglu, 500000.0, 1e-5, 1.0)
    else:
        assert (m.normalization, m.activation, m.rope_base, m.rotary_percent) == (
            Normalization.layernorm1p, Activation.squared_relu, 10000.0, 0.5)
    expected_scaling = RopeScaling(8.0, 1.0, 4.0, 8192) if name == "llama31_405b" else None
    assert m.rope_scaling == expected_scaling


@pytest.mark.parametrize("name", LLAMA_PARAMETERS)
def test_llama_parameter_counts_equal_reference(name):
    assert count_parameters(load_option("model", name)) == LLAMA_PARAMETERS[name]


def nemotron_closed_form(layers, h, f, heads, groups, head_dim, vocab) -> int:
    """Nemotron-4 parameters, by hand: untied embedding and output layer, no linear biases, not gated."""
    q, kv = heads * head_dim, groups * head_dim
    per_layer = (
        h * (q + 2 * kv)  # fused QKV projection
        + q * h  # attention output projection
        + h * f  # fc1 (squared ReLU: not gated, one matrix)
        + f * h  # fc2
        + 2 * 2 * h  # two LayerNorms, each with weight and bias
    )
    return 2 * vocab * h + layers * per_layer + 2 * h  # + final LayerNorm (weight and bias)


# REFERENCE.md gives no exact parameter count for Nemotron-4 (only "15B" / "340B"), so the count is checked against
# the closed form above, evaluated on the REFERENCE.md dimensions (not on conf/), and against the nominal size.
@pytest.mark.parametrize("name, nominal", [("nemotron4_15b", 15e9), ("nemotron4_340b", 340e9)])
def test_nemotron_parameter_counts_equal_closed_form(name, nominal):
    layers, h, f, heads, groups, head_dim, vocab, _ = REFERENCE_ARCHITECTURES[name]
    expected = nemotron_closed_form(layers, h, f, heads, groups, head_dim, vocab)
    assert count_parameters(load_option("model", name)) == expected
    assert abs(expected - nominal) / nominal < 0.05


def test_nemotron_15b_closed_form_by_hand():
    # The arithmetic of nemotron_closed_form for 15B, spelled out: 2*256000*6144 + 32*(6144*(6144+2*1024)
    # + 6144*6144 + 2*6144*24576 + 4*6144) + 2*6144.
    per_layer = 50_331_648 + 37_748_736 + 2 * 150_994_944 + 24_576
    assert nemotron_closed_form(32, 6144, 24576, 48, 8, 128, 256000) == 3_145_728_000 + 32 * per_layer + 12_288
    assert 3_145_728_000 + 32 * per_layer + 12_288 == 15_628_775_424


def test_tiny_llama_parameter_count():
    # 2*320*256 + 4*(256*(256+2*128) + 256*256 + 256*2*768 + 768*256 + 2*256) + 256 (the count run.py prints)
    assert count_parameters(load_option("model", "tiny_llama")) == 3_311_872


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_parameter_count_is_what_the_model_builds(name):
    """count_parameters (a formula the report uses without building models) against the model code itself."""
    with torch.device("meta"):
        model = Transformer(load_option("model", name))
    assert count_parameters(model.cfg) == sum(p.numel() for p in model.parameters())


def test_convergence_study_model_is_about_100m_parameters():
    # 2*320*896 + 12*(896*(896+2*128) + 896*896 + 896*2*2432 + 2432*896 + 2*896) + 896
    assert count_parameters(load_option("model", "llama3_100m")) == 101_062_528


# ---- RoPE ----


@pytest.mark.parametrize("rotary_dim, base", [(128, 500000.0), (64, 10000.0), (16, 10000.0)])
def test_rope_frequencies_without_scaling(rotary_dim, base):
    expected = torch.tensor([1.0 / base ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)
    actual = rope_inverse_frequencies(rotary_dim, base, None)
    assert actual.shape == (rotary_dim // 2,)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=0)


def meta_apply_scaling(freqs: list[float], scale_factor, low_freq_factor, high_freq_factor, old_context_len) -> list:
    """Meta's reference `apply_scaling` (llama-models, Llama 3.1), as its plain loop over frequencies."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return new_freqs


def test_rope_llama31_scaling_matches_meta_reference():
    cfg = load_option("model", "llama31_405b")
    d, base = cfg.kv_channels, cfg.rope_base
    plain = [1.0 / base ** (2 * i / d) for i in range(d // 2)]
    expected = meta_apply_scaling(plain, 8, 1, 4, 8192)
    actual = rope_inverse_frequencies(d, base, cfg.rope_scaling).double()
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)

    ratio = [a / p for a, p in zip(actual.tolist(), plain)]
    unchanged = [r for r in ratio if abs(r - 1) < 1e-6]
    divided = [r for r in ratio if abs(r - 1 / 8) < 1e-6]
    between = [r for r in ratio if 1 / 8 + 1e-6 < r < 1 - 1e-6]
    # All three regimes occur for Llama 3.1's dimensions, so each branch above is exercised.
    assert unchanged and divided and between and len(unchanged) + len(divided) + len(between) == len(ratio)
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 8)  # high kept, low divided by 8
    # Smooth in between: the ratio falls monotonically from 1 to 1/8 as the frequency falls (up to FP32 rounding).
    assert all(later <= earlier + 1e-6 for earlier, later in zip(ratio, ratio[1:]))


def rotary_at_positions(rotary: RotaryEmbedding, vector: torch.Tensor, seq: int) -> torch.Tensor:
    """rotary(vector at every position 0..seq-1): (seq, head_dim); row m is the vector rotated for position m."""
    x = vector.expand(1, 1, seq, vector.numel()).clone()
    return rotary(x)[0, 0]


def test_partial_rotary_leaves_second_half_and_preserves_norm():
    cfg = tiny(kv_channels=32, rotary_percent=0.5, rope_base=10000.0, seq_length=64)
    rotary = RotaryEmbedding(cfg)
    assert rotary.rotary_dim == 16
    x = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(0))
    y = rotary(x)
    assert y.shape == x.shape
    assert torch.equal(y[..., 16:], x[..., 16:])  # the second half of every head is untouched
    torch.testing.assert_close(y[..., :16].norm(dim=-1), x[..., :16].norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: angle 0
    assert (y[:, :, 1:, :16] - x[:, :, 1:, :16]).abs().max() > 0.1  # later positions are rotated


@pytest.mark.parametrize("scaled", [False, True], ids=["llama3", "llama31-scaling"])
def test_rope_scores_depend_only_on_relative_position(scaled):
    seq = 48
    cfg = tiny(kv_channels=32, rope_base=500000.0 if scaled else 10000.0, seq_length=seq,
               rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=16) if scaled else None)
    rotary = RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(32, generator=g), torch.randn(32, generator=g)
    scores = rotary_at_positions(rotary, q, seq).double() @ rotary_at_positions(rotary, k, seq).double().T
    for m, n, d in [(0, 0, 5), (3, 1, 7), (1, 9, 20), (10, 2, 30), (0, 17, 30)]:
        assert scores[m, n].item() == pytest.approx(scores[m + d, n + d].item(), rel=1e-4, abs=1e-4)
    # ... and does depend on it: otherwise the check above would hold trivially.
    assert abs(scores[5, 0] - scores[0, 0]) > 1e-2


# ---- norms ----


# scale 1e-3: mean(x^2) is comparable to eps, so where eps enters the formula matters.
@pytest.mark.parametrize("scale", [3.0, 1e-3])
def test_rmsnorm_matches_float64_formula(scale):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 64, generator=g) + 0.3) * scale
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x64, w64 = x.double(), norm.weight.detach().double()
    expected = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-5) * w64
    actual = norm(x)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def layernorm_formula(x64, weight64, bias64, eps):
    mean = x64.mean(-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdim=True)  # biased variance, as LayerNorm uses
    return (x64 - mean) / torch.sqrt(var + eps) * weight64 + bias64


@pytest.mark.parametrize("scale", [2.0, 1e-3])
def test_layernorm1p_matches_float64_formula_with_one_plus_weight(scale):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 7, 64, generator=g) - 0.25) * scale
    norm = LayerNorm1p(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.1)
        norm.bias.copy_(torch.randn(64, generator=g) * 0.1)
    w, b = norm.weight.detach().double(), norm.bias.detach().double()
    expected = layernorm_formula(x.double(), 1 + w, b, 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_layernorm1p_gradients_are_aten_layer_norms(compiled):
    """The two-pass forward with aten's backward: the values and gradients F.layer_norm gives, compiled or not."""
    g = torch.Generator().manual_seed(5)
    x = ((torch.randn(6, 64, generator=g) + 0.5) * 3).to(torch.bfloat16)
    dy = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    norm = LayerNorm1p(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.1)
        norm.bias.copy_(torch.randn(64, generator=g) * 0.1)
    weight, bias = (p.detach().clone().requires_grad_() for p in (norm.weight, norm.bias))
    x_ours, x_aten = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = (torch.compile(norm) if compiled else norm)(x_ours)
    aten = F.layer_norm(x_aten.float(), (64,), weight + 1, bias, 1e-5).to(torch.bfloat16)
    ours.backward(dy)
    aten.backward(dy)
    assert ours.dtype == x_ours.grad.dtype == torch.bfloat16
    pairs = ((ours, aten), (x_ours.grad, x_aten.grad), (norm.weight.grad, weight.grad), (norm.bias.grad, bias.grad))
    for a, b in pairs:
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)


def test_layernorm1p_with_zero_weight_is_plain_layernorm():
    x = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(4)) * 5 + 2
    norm = LayerNorm1p(64, eps=1e-5)
    assert torch.equal(norm.weight.detach(), torch.zeros(64))  # stored gamma is zero-centred
    ones, zeros = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    torch.testing.assert_close(norm(x).double(), layernorm_formula(x.double(), ones, zeros, 1e-5), rtol=1e-5, atol=1e-6)


# ---- MLPs ----


def test_swiglu_mlp_matches_formula():
    cfg = tiny(hidden_size=16, ffn_hidden_size=24, activation=Activation.swiglu)
    torch.manual_seed(5)
    mlp = MLP(cfg).double()
    assert mlp.fc1.weight.shape == (48, 16)  # gate and up projections fused, gate first (as megatron-core)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    w1, w2 = mlp.fc1.weight.detach(), mlp.fc2.weight.detach()
    gate, up = x @ w1[:24].T, x @ w1[24:].T
    expected = (gate / (1 + torch.exp(-gate)) * up) @ w2.T  # silu(gate) * up, then fc2
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-12)


def test_squared_relu_mlp_matches_formula():
    cfg = tiny(hidden_size=16, ffn_hidden_size=24, activation=Activation.squared_relu)
    torch.manual_seed(6)
    mlp = MLP(cfg).double()
    assert mlp.fc1.weight.shape == (24, 16)  # not gated: one up projection
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    w1, w2 = mlp.fc1.weight.detach(), mlp.fc2.weight.detach()
    expected = (torch.clamp(x @ w1.T, min=0) ** 2) @ w2.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-12)


# ---- attention ----


def reference_rope(x64: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of (batch, heads, seq, head_dim), in float64."""
    seq, half = x64.shape[-2], rotary_dim // 2
    inv_freq = torch.tensor([1.0 / base ** (2 * i / rotary_dim) for i in range(half)], dtype=torch.float64)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (seq, half)
    cos, sin = torch.cos(angle), torch.sin(angle)
    a, b, rest = x64[..., :half], x64[..., half:rotary_dim], x64[..., rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("heads, groups", [(4, 2), (6, 1), (4, 4)])
def test_gqa_attention_matches_float64_reference(heads, groups, rotary_percent):
    head_dim, hidden, seq, batch = 8, 24, 7, 2
    cfg = tiny(hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
               rope_base=10000.0, rotary_percent=rotary_percent, seq_length=16)
    torch.manual_seed(7)
    attention = Attention(cfg, RotaryEmbedding(cfg)).double()
    x = torch.randn(batch, seq, hidden, dtype=torch.float64)

    w_qkv, w_out = attention.qkv.weight.detach(), attention.out.weight.detach()
    q_rows, kv_rows = heads * head_dim, groups * head_dim
    # Fused QKV weight layout: all query heads, then all key heads, then all value heads.
    def heads_of(w, n):
        return (x @ w.T).view(batch, seq, n, head_dim).transpose(1, 2)  # (batch, n, seq, head_dim)

    q = heads_of(w_qkv[:q_rows], heads)
    k = heads_of(w_qkv[q_rows : q_rows + kv_rows], groups)
    v = heads_of(w_qkv[q_rows + kv_rows :], groups)
    rotary_dim = int(head_dim * rotary_percent)
    q, k = reference_rope(q, rotary_dim, 10000.0), reference_rope(k, rotary_dim, 10000.0)
    # GQA: query head i reads key/value group i // (heads / groups), repeated explicitly.
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    expected = (weights @ v).transpose(1, 2).reshape(batch, seq, heads * head_dim) @ w_out.T

    # RoPE's cos/sin tables are computed in FP32, hence the tolerance.
    torch.testing.assert_close(attention(x), expected, rtol=1e-5, atol=1e-6)


# ---- the whole transformer ----


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_nemotron"])
def test_transformer_is_causal(name):
    cfg = dataclasses.replace(load_option("model", name), num_layers=2)
    model = Transformer(cfg, activation_dtype=torch.float32)
    model.init_weights(torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    t = 13
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        logits, changed_logits = model(tokens), model(changed)
    assert logits.shape == (2, 24, cfg.vocab_size)
    torch.testing.assert_close(changed_logits[:, :t], logits[:, :t], rtol=0, atol=1e-6)
    # The change does reach position t and later ones (so the check above could fail).
    assert (changed_logits[:, t:] - logits[:, t:]).abs().amax(dim=-1).min() > 1e-4


# ---- FLOPs ----


def test_flops_per_token_llama3_8b_by_hand():
    # REFERENCE.md section 2: h=4096, f=14336, 32 heads and 8 groups of dim 128 (q=4096, kv=1024), V=128256,
    # s=8192, 32 layers.
    qkv = 4096 * (4096 + 2 * 1024)  # 25,165,824
    out = 4096 * 4096  # 16,777,216
    mlp = 3 * 4096 * 14336  # 176,160,768 (SwiGLU: gate, up, down)
    attention = 6 * 4096 * 8192  # 201,326,592
    per_layer = 6 * (qkv + out + mlp) + attention
    assert per_layer == 1_509_949_440
    logits = 6 * 4096 * 128256
    assert logits == 3_152_019_456
    cfg = load_option("model", "llama3_8b")
    assert flops_per_token(cfg) == 32 * per_layer + logits == 51_470_401_536
    assert flops_per_token(cfg, include_output_layer=False) == 32 * per_layer


def test_flops_per_token_nemotron4_15b_by_hand():
    # Squared ReLU: two MLP matrices. h=6144, f=24576, q=48*128=6144, kv=8*128=1024, V=256000, s=4096, 32 layers.
    per_layer = 6 * (6144 * (6144 + 2 * 1024) + 6144 * 6144 + 2 * 6144 * 24576) + 6 * 6144 * 4096
    assert flops_per_token(load_option("model", "nemotron4_15b")) == 32 * per_layer + 6 * 6144 * 256000
