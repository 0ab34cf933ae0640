"""The output layer and the cross-entropy loss in one pass over chunks of rows, never holding the whole logits.

    for each chunk of rows:   logits = h @ W^T                          (BF16 GEMM, a chunk of the vocabulary rows)
                              loss += sum(logsumexp(logits) - logits[label])           (FP32 math)
                              dlogits = (softmax(logits) - onehot(label)) * scale      (in BF16, as autograd's)
                              dh[rows] = dlogits @ W ;  dW += dlogits^T @ h            (dW in FP32 inside the GEMM)

The gradients are computed in the forward, where the chunk's logits exist, and handed to autograd in the backward
(Liger-Kernel's fused linear cross-entropy does the same): a step holds one chunk's logits and their gradient in
BF16 (at most `CHUNK_ELEMENTS` each) instead of the whole logits in BF16 and FP32 and their FP32 gradient, 8 GB per
8192-token micro-batch of a 128K vocabulary. The GEMMs are the three of the plain output layer; the chunk's
loss and gradient are one Inductor kernel on a GPU. `scale` is 1 / (valid tokens x micro-batches), so the loss is
the micro-batch's share of a step's mean loss, and its backward must be that loss's own (gradient 1).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn

from recipes.compute import mm_into

# Logits per chunk: 2 GiB in BF16, one chunk for an 8192-token micro-batch of a 128K vocabulary (or 4096 of 256K).
# Each chunk's weight-gradient GEMM reads and writes the whole FP32 main gradient, with the chunk's rows as its K:
# in 2048-row chunks (2**28 logits) llama3_8b's output-layer weight gradient took 117 ms a step, in 1024-row chunks
# nemotron4_15b's 239 ms, against 93 and 138 ms for engine=megatron's one GEMM a micro-batch (one H200, issue 47).
CHUNK_ELEMENTS = 2**30
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                        ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of a chunk's rows, and `scale` times its gradient with respect to the logits, in the logits'
    dtype; FP32 math. Rows labelled `ignore_index` add nothing."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    valid = labels != ignore_index
    target_index = torch.where(valid, labels, 0)
    target = x.gather(1, target_index[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, 0.0).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == target_index[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.float()) * torch.where(valid, scale, 0.0)[:, None]
    return loss, grad.to(logits.dtype)


@functools.cache
def compiled_chunk_cross_entropy():
    return torch.compile(chunk_cross_entropy, dynamic=False)


def chunk_rows(rows: int, vocab: int, chunk_elements: int) -> int:
    """Rows per chunk: the fewest chunks of at most `chunk_elements` logits, equal in size (one compiled shape)."""
    chunks = max(1, math.ceil(rows * vocab / chunk_elements))
    return math.ceil(rows / chunks)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, cached, refresh, main_grad, accumulate, micro_batches, ignore_index,
                chunk_elements, compiled):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            hidden = hidden.to(dtype)  # the GEMMs' dtype, as autocast would give them (the output layer's own call)
            if cached is None:
                w = weight.to(dtype)
            else:
                if refresh:
                    cached.copy_(weight)
                w = cached
            valid = labels != ignore_index
            scale = 1.0 / (valid.sum().float() * micro_batches)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = main_grad if main_grad is not None else torch.empty_like(weight, dtype=torch.float32)
            loss_and_grad = compiled_chunk_cross_entropy() if compiled else chunk_cross_entropy
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            step = chunk_rows(hidden.shape[0], weight.shape[0], chunk_elements)
            for start in range(0, hidden.shape[0], step):
                h = hidden[start:start + step]
                loss, dlogits = loss_and_grad(h @ w.t(), labels[start:start + step], scale, ignore_index)
                total += loss
                torch.mm(dlogits, w, out=grad_hidden[start:start + step])
                mm_into(dlogits.t(), h.t(), grad_weight, accumulate or start > 0)
        ctx.save_for_backward(grad_hidden, None if main_grad is not None else grad_weight)
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # The gradients were scaled in the forward (and a main gradient already summed): no other factor may come.
        torch._assert_async(grad_loss == 1, "linear_cross_entropy: backward() must start at this loss")
        return grad_hidden, grad_weight, *(None,) * 9


def linear_cross_entropy(hidden: torch.Tensor, output: nn.Linear, labels: torch.Tensor, micro_batches: int = 1,
                         ignore_index: int = IGNORE_INDEX, chunk_elements: Optional[int] = None,
                         compiled: Optional[bool] = None) -> torch.Tensor:
    """Mean cross-entropy of `output(hidden)` against `labels` over the rows not labelled `ignore_index`, divided by
    `micro_batches`; hidden (rows, hidden size), labels (rows,). The output layer's weight gradient goes to
    autograd, or into its FP32 main gradient where it has one (recipes.fp8.linear.Bf16Linear's `gemm_state`, which
    also holds the BF16 weight cast once per optimizer step). At most `chunk_elements` logits at a time (default
    CHUNK_ELEMENTS); `compiled`: the chunk's loss and gradient as one Inductor kernel (default: on CUDA)."""
    state = getattr(output, "gemm_state", None)
    cached, refresh, main_grad, accumulate = state() if state else (None, False, None, False)
    compiled = hidden.is_cuda if compiled is None else compiled
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    return _LinearCrossEntropy.apply(hidden, output.weight, labels, cached, refresh, main_grad, accumulate,
                                     micro_batches, ignore_index, chunk_elements, compiled)
