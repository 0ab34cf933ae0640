"""Decoder-only transformers: Llama 3 / 3.1 and Nemotron-4, as megatron-core lays them out.

    tokens -> embedding -> N x [x + attention(norm(x)); x + mlp(norm(x))] -> norm -> output layer -> logits

Llama 3: RMSNorm, grouped-query attention with RoPE (base 500000, optional 3.1 frequency scaling), SwiGLU MLP.
Nemotron-4: LayerNorm with zero-centred gamma ("layernorm1p"), RoPE on half of each head (base 10000),
squared-ReLU MLP. Neither has biases in its linear layers; embeddings and output layer are untied.

As in megatron-core, Q, K and V come from one fused linear layer (`qkv`) and the gated MLP's gate and up
projections from one (`fc1`): fewer, larger GEMMs, and in FP8 one quantization of each input instead of several.

Parameters are kept in FP32 (they are the optimizer's master weights); the residual stream and every GEMM run in
`activation_dtype` (BF16). Each nn.Linear inside the blocks is a GEMM that `recipes.fp8.Fp8Training.convert` may swap.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel
from torch.profiler import record_function

from recipes.config import Activation, ModelConfig, Normalization, RopeScaling
from recipes.models.attention import attention_order
from recipes.models.loss import linear_cross_entropy
from recipes.profiling import OUTPUT_AND_LOSS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_constants(self) -> None:
        """The initial values that do not depend on the seed (see init_weights)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class LayerNorm1p(nn.Module):
    """LayerNorm whose stored gamma is centred on zero: the scale applied is (1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def reset_constants(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNorm1pFunction.apply(x, self.weight, self.bias, self.eps)


class _LayerNorm1pFunction(torch.autograd.Function):
    """F.layer_norm(x.float(), weight=1 + weight, bias).to(x.dtype), its mean and variance in two passes over the row
    (Inductor compiles aten's variance into a per-element Welford update, a division per element: the slower
    kernel, docs/results issue 24); the backward is aten's own."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        centred = x32 - mean
        rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps)
        gamma = weight + 1
        ctx.save_for_backward(x, gamma, bias, mean, rstd)
        return (centred * rstd * gamma + bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, gamma, bias, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbias = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), x.shape[-1:], mean, rstd, gamma, bias, [True, True, True])
        return dx.to(x.dtype), dgamma, dbias, None


def make_norm(cfg: ModelConfig) -> nn.Module:
    norm = {Normalization.rmsnorm: RMSNorm, Normalization.layernorm1p: LayerNorm1p}[cfg.normalization]
    return norm(cfg.hidden_size, cfg.norm_eps)


def rope_inverse_frequencies(rotary_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if scaling is None:
        return inv_freq.float()
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` dimensions of each head (rotate-half layout, as Megatron and HF do)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rotary_dim = int(cfg.kv_channels * cfg.rotary_percent)
        cos, sin = self._tables(torch.get_default_device())
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Made on the CPU, cosine and sine by NumPy in one thread: PyTorch's multithreaded cosine on a CPU (FP32 and
        # FP64) gave one of two results from one process to the next (a quarter of the starts of tiny_llama's
        # table), which made CPU runs, and their resumes, irreproducible. The same tables on every device.
        with torch.device("cpu"):
            inv_freq = rope_inverse_frequencies(self.rotary_dim, self.cfg.rope_base, self.cfg.rope_scaling)
            angles = torch.outer(torch.arange(self.cfg.seq_length, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1).double().numpy()  # (seq, rotary_dim)
            cos, sin = (torch.from_numpy(table).float() for table in (np.cos(angles), np.sin(angles)))
        return cos.to(device), sin.to(device)

    def reset_constants(self) -> None:
        """Recompute the tables in place (after a model built on the meta device is materialised)."""
        for buffer, table in zip((self.cos, self.sin), self._tables(self.cos.device)):
            buffer.copy_(table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim)."""
        seq = x.shape[-2]
        rot, passthrough = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        rot = rot * self.cos[:seq] + rotated * self.sin[:seq]
        return torch.cat([rot.to(x.dtype), passthrough], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        self.qkv = nn.Linear(cfg.hidden_size, (self.heads + 2 * self.groups) * self.head_dim, bias=False)
        self.out = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, self.heads + 2 * self.groups, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.groups, self.groups], dim=1)
        q, k = self.rotary(q), self.rotary(k)
        with sdpa_kernel(attention_order(q.is_cuda), set_priority=True):  # the same kernel with TE imported or not
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.out(y.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class MLP(nn.Module):
    """fc1 -> activation -> fc2; recipes.fp8.convert may fuse the three (it reads `activation`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.gated = cfg.activation == Activation.swiglu
        fc1_out = 2 * cfg.ffn_hidden_size if self.gated else cfg.ffn_hidden_size
        self.fc1 = nn.Linear(cfg.hidden_size, fc1_out, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.relu(h)
            h = h * h  # squared ReLU; not square(), which CUDA autocast computes (and returns) in FP32
        return self.fc2(h)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg, rotary)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """model(tokens) gives the logits; model(tokens, labels, micro_batches) the micro-batch's share of a step's
    loss (its mean cross-entropy over `micro_batches`), with `fused_loss` from the output layer's GEMMs chunk by
    chunk, never holding the whole logits (recipes.models.loss), else from the logits in FP32. The loss is computed
    in forward so that FSDP2's hooks on this module cover the output layer."""

    def __init__(self, cfg: ModelConfig, activation_dtype: torch.dtype = torch.bfloat16, fused_loss: bool = True):
        super().__init__()
        self.cfg = cfg
        self.activation_dtype = activation_dtype
        self.fused_loss = fused_loss
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg, rotary) for _ in range(cfg.num_layers))
        self.final_norm = make_norm(cfg)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                micro_batches: int = 1) -> torch.Tensor:
        x = self.embedding(tokens).to(self.activation_dtype)
        for layer in self.layers:
            x = layer(x)
        hidden = self.final_norm(x)
        if labels is None:
            return self.output(hidden)
        with record_function(OUTPUT_AND_LOSS):  # named in a profile's trace
            if self.fused_loss:
                return linear_cross_entropy(hidden.flatten(0, 1), self.output, labels.flatten(), micro_batches)
            logits = self.output(hidden)
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / micro_batches

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        init_weights(self, self.cfg, generator)


def initial_std(name: str, cfg: ModelConfig) -> float | None:
    """Megatron's init: N(0, std) everywhere, output projections of each block scaled by 1/sqrt(2 * layers); None
    for norms, which keep their identity initialisation (reset_constants)."""
    if name.endswith(("norm.weight", "norm.bias")):
        return None
    if name.endswith(("attention.out.weight", "mlp.fc2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, generator: torch.Generator | None = None) -> None:
    for name, param in module.named_parameters():
        std = initial_std(name, cfg)
        if std is not None:
            param.normal_(0.0, std, generator=generator)
