"""The fused output layer + cross-entropy (recipes.models.loss) against the plain one: the same loss and gradients
within rounding, in FP32 and BF16, over several uneven chunks, an odd vocabulary, ignored labels and micro-batch
shares; the weight gradient into an FP32 main gradient; never a tensor the size of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.config import load_option
from recipes.fp8.linear import CACHE_REFRESH, CACHE_REUSE, Bf16Linear, WeightCache
from recipes.models import loss as loss_module
from recipes.models.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy
from recipes.models.transformer import Transformer

ROWS, HIDDEN, VOCAB = 45, 24, 1037  # odd sizes: the chunks below are uneven, the vocabulary no power of two


def inputs(dtype: torch.dtype, seed: int = 0, ignored: int = 5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).to(dtype).requires_grad_()
    output = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[torch.randperm(ROWS, generator=g)[:ignored]] = IGNORE_INDEX
    return hidden, output, labels


def plain_loss(hidden, output, labels, micro_batches):
    logits = F.linear(hidden, output.weight.to(hidden.dtype))
    return F.cross_entropy(logits.float(), labels) / micro_batches


def gradients(loss_fn, dtype, **kwargs):
    hidden, output, labels = inputs(dtype)
    loss = loss_fn(hidden, output, labels, 3, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, output.weight.grad


def test_chunks_are_equal_and_hold_at_most_the_budget():
    assert chunk_rows(8192, 128256, 2**28) == 2048
    assert chunk_rows(4096, 256000, 2**28) == 1024
    # The default: one chunk (one weight-gradient GEMM) per micro-batch of the Llama 3 and Nemotron-4 proxies.
    assert chunk_rows(8192, 128256, loss_module.CHUNK_ELEMENTS) == 8192
    assert chunk_rows(4096, 256000, loss_module.CHUNK_ELEMENTS) == 4096
    assert chunk_rows(16384, 128256, loss_module.CHUNK_ELEMENTS) == 8192
    assert chunk_rows(45, 1037, 16 * 1037) == 15  # three chunks of 15 rather than 16 + 16 + 13
    assert chunk_rows(3, 10, 10**9) == 3


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_elements", [10**9, 16 * VOCAB, 7 * VOCAB])
def test_loss_and_gradients_match_the_plain_output_layer(dtype, tolerance, chunk_elements):
    reference = gradients(plain_loss, dtype)
    fused = gradients(linear_cross_entropy, dtype, chunk_elements=chunk_elements)
    for name, ours, theirs in zip(("loss", "grad hidden", "grad weight"), fused, reference):
        assert ours.dtype == theirs.dtype, name
        error = (ours.double() - theirs.double()).norm() / theirs.double().norm()
        assert error < tolerance, (name, error.item())
    assert fused[1].dtype == dtype and fused[2].dtype == torch.float32  # the FP32 weight's gradient


def test_ignored_rows_get_no_gradient_and_no_loss():
    hidden, output, labels = inputs(torch.float32, ignored=10)
    linear_cross_entropy(hidden, output, labels, chunk_elements=8 * VOCAB).backward()
    ignored = labels == IGNORE_INDEX
    assert hidden.grad[ignored].abs().max() == 0 and hidden.grad[~ignored].abs().min() > 0


def test_a_backward_that_does_not_start_at_the_loss_is_refused():
    hidden, output, labels = inputs(torch.float32)
    with pytest.raises(RuntimeError, match="must start at this loss"):
        (2 * linear_cross_entropy(hidden, output, labels)).backward()


def test_weight_gradient_goes_into_the_main_gradient_and_the_weight_is_cast_once_per_step():
    """An output layer with a BF16 weight cache and an FP32 main gradient (Fp8Training's fused linears): the first
    micro-batch refreshes the cache and writes the gradient, the second reuses the cache and adds to it; the sum is
    the plain path's two gradients' sum."""
    output = inputs(torch.bfloat16)[1]
    hiddens = [(hidden.detach(), labels) for hidden, _, labels in (inputs(torch.bfloat16, seed) for seed in (1, 2))]
    for hidden, labels in hiddens:
        plain_loss(hidden.requires_grad_(), output, labels, 2).backward()
    expected, output.weight.grad = output.weight.grad, None
    layer = Bf16Linear(output)
    layer.weight_cache = WeightCache({"weight": torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16)}, torch.device("cpu"))
    layer.main_grad = torch.full((VOCAB, HIDDEN), float("nan"))  # written, not added to, by the first micro-batch
    for mode, (hidden, labels) in zip((CACHE_REFRESH, CACHE_REUSE), hiddens):
        layer.weight_cache.mode = mode
        linear_cross_entropy(hidden.requires_grad_(), layer, labels, 2, chunk_elements=16 * VOCAB).backward()
    assert layer.weight.grad is None  # the gradient went into main_grad instead
    assert torch.equal(layer.weight_cache.weight, output.weight.to(torch.bfloat16))
    assert ((layer.main_grad - expected).norm() / expected.norm()) < 2e-2


class MostLogitRows(TorchDispatchMode):
    """The most rows of any new tensor (views, such as the weight's transpose, excluded) with the vocabulary as its
    last dimension that an operator returns."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in () if func.is_view else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("fused", [True, False])
def test_the_fused_loss_never_holds_the_whole_logits(fused, monkeypatch):
    cfg = load_option("model", "tiny_llama")
    rows = 2 * cfg.seq_length
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", rows * cfg.vocab_size // 4)
    model = Transformer(cfg, activation_dtype=torch.float32, fused_loss=fused)
    model.init_weights(torch.Generator().manual_seed(0))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    with MostLogitRows(cfg.vocab_size) as seen:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert seen.rows == (rows // 4 if fused else rows), seen.rows  # fused: a quarter of the rows at a time


def test_the_model_s_fused_loss_is_its_plain_loss():
    cfg = load_option("model", "tiny_nemotron")
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        model = Transformer(cfg, activation_dtype=torch.float32, fused_loss=fused)
        model.init_weights(torch.Generator().manual_seed(0))
        loss = model(tokens[:, :-1], tokens[:, 1:], 2)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (plain, plain_grads), (fused, fused_grads) = results
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    for ours, theirs in zip(fused_grads, plain_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)
