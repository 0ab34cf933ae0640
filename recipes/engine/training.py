"""The pieces of an optimizer step that the engine and the benchmarks share."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.profiler import record_function

from recipes.config import TrainerConfig
from recipes.engine.fsdp import replicated, set_gradient_sync
from recipes.fp8 import Fp8Training
from recipes.profiling import OPTIMIZER
from recipes.trainer.loop import NonFiniteError


def checkpoint_blocks(layers: nn.ModuleList) -> None:
    """Activation checkpointing per transformer block: keep only each block's input and recompute the block in
    the backward (about a third more compute for most of the activation memory). Parameter names in checkpoints
    stay those of the plain model (torch.distributed.checkpoint drops the wrapper's prefix)."""
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer)


def compile_blocks(layers: nn.ModuleList) -> None:
    """Compile each transformer block in place: identical blocks share one compiled graph, and parameter names
    (hence checkpoints) stay those of the eager model."""
    for layer in layers:
        layer.compile()


def build_optimizer(model: nn.Module, trainer: TrainerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW on the FP32 master weights; no weight decay on norms (1-D parameters), as Megatron does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": trainer.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=trainer.lr, betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps, fused=fused
    )


def optimizer_step(
    micro_batch_loss: Callable[[int], torch.Tensor],
    num_micro_batches: int,
    model: nn.Module,
    fp8: Fp8Training,
    optimizer: torch.optim.Optimizer,
    lr: float,
    grad_clip: float,
    reduce_every_micro_batch: bool = False,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of each micro-batch (gradients accumulate), clip, one optimizer step.
    `micro_batch_loss(i)` is micro-batch i's share of the step's loss (its mean loss / num_micro_batches), whose
    backward starts there.

    Returns the mean loss and the gradient norm before clipping. Raises NonFiniteError, before the weights are
    touched, when either is inf or NaN or delayed scaling recorded an inf or NaN amax (one host sync per step
    for the three). Under FSDP gradients are reduce-scattered in
    the last micro-batch's backward only, or in every one with `reduce_every_micro_batch` (FSDP then adds them
    into the sharded gradients). `fp8` is called before each micro-batch, after each backward, after the last
    one and once the weights have changed (recipes.fp8.training); `step` numbers its stochastic rounding's draws.
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    for micro in range(num_micro_batches):
        set_gradient_sync(model, reduce_every_micro_batch or micro == num_micro_batches - 1)
        fp8.micro_batch(model, micro, step)
        loss = micro_batch_loss(micro)
        loss.backward()
        fp8.after_backward(model)
        total += loss.detach()
    fp8.after_micro_batches(model)
    with record_function(OPTIMIZER):  # named in a profile's trace: clipping and the update
        grad_norm = replicated(nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True))
        if not bool(torch.isfinite(total) & torch.isfinite(grad_norm) & fp8.amaxes_finite(model)):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(total.item(), grad_norm.item(), fp8.non_finite_amaxes(model))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    fp8.weights_changed(model)
    return total, grad_norm
