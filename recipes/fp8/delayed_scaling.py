"""Per-tensor delayed scaling, as Transformer Engine 2.x's DelayedScaling computes it with its default, fused
update (common/recipe/delayed_scaling.cu, `kernel_bulk`).

Each operand role of a layer (input, weight, gradient) keeps a history of `amax_history_len` amaxes and a scale.
A quantization casts with the stored scale, never with its own tensor's amax (so a compiler may fuse the cast
into the kernel that produces the tensor), and records its tensor's amax in the history's open slot (slot 0).
"Step" here is one micro-batch: its forward quantizes input and weight once, its backward the gradient once.
`update_delayed_scaling`, called after each micro-batch's backward, closes the open slot of every layer at once,
as TE does after each fp8_autocast region:

    1. one all-reduce (max) of the open slots of all layers over the data-parallel ranks, so that every rank
       holds the same histories and scales (each rank saw only its own slice of the batch);
    2. per layer and role, with `last` the reduced amax:
       last == 0   nothing changes: the history does not move and the scale stays. This is a tensor not
                   quantized in this micro-batch (a cached weight, recipes.fp8.linear) or an all-zero one.
       otherwise   the window moves on: amax = the maximum of the last `amax_history_len` amaxes, `last`
                   included (`max`; NaN ignored), or `last` (`most_recent`), and
                       scale = (fp8_max * 2**-margin) / amax            in FP32,
                   the previous scale where amax is 0, inf or NaN, FP32's max where the quotient overflows.
                   The oldest amax drops out, `last` becomes the newest.

The history row of a role is laid out as TE's: [open slot, oldest, ..., newest]. The gradient's open slot is a
buffer of its own, `grad_amax` (its row's slot 0 stays 0): a compiled backward that wrote into the buffer its
forward wrote would be handed a copy of it to write, and copy it back (AOTAutograd), two more kernels per
gradient. The histories start at zero and the scale at 1, so a tensor is first cast with scale 1. Recording is a
max into the open slot, so a forward recomputed under activation checkpointing casts with the same scale and
records nothing new. The state lives in `DelayedScalingState` buffers of each FP8 linear layer, so checkpoints
carry it (the open slots are 0 between micro-batches, where a checkpoint is written).

inf and NaN: a cast saturates inf to +-fp8_max and keeps NaN (TE's casts do the same), and the recorded amax is
inf or NaN (TE instead drops NaN from its amax). The update marks such a (layer, role) in the `nonfinite` flags,
reduced over the ranks with the amaxes; the training loop reads them once per optimizer step with the loss
(recipes.engine.training) and stops, naming the step, the layer and the role.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import AmaxComputeAlgo
from recipes.fp8.current_scaling import FP32_MAX, cast_to_fp8, fp32_quotient
from recipes.fp8.formats import fp8_max
from recipes.fp8.tensor import Float8Tensor

NUM_ROLES = 3
INPUT, WEIGHT, GRAD = range(NUM_ROLES)  # the operand roles of an FP8 linear (recipes.fp8.linear)
ROLE_NAMES = ("input", "weight", "grad")


class DelayedScalingState(nn.Module):
    def __init__(self, history_len: int):
        super().__init__()
        self.register_buffer("amax_history", torch.zeros(NUM_ROLES, history_len))
        self.register_buffer("scale", torch.ones(NUM_ROLES))
        # The gradient's open slot (see the module's doc); 0 between micro-batches, so not checkpointed.
        self.register_buffer("grad_amax", torch.zeros(1), persistent=False)
        # 1 where an inf or NaN amax was recorded; the run stops on it, so it is not checkpointed.
        self.register_buffer("nonfinite", torch.zeros(NUM_ROLES), persistent=False)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a quantization reads and records into (quantize_delayed's `state`)."""
        return self.amax_history, self.scale, self.grad_amax

    def reset_constants(self) -> None:
        """The initial state: an empty history, scale 1 (after a model built on the meta device is materialised)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.grad_amax.zero_()
        self.nonfinite.zero_()


def open_slot(state: tuple[torch.Tensor, ...], role: int) -> tuple[torch.Tensor, int]:
    """Where a quantization of `role` records its amax: a buffer of `state` (DelayedScalingState.tensors()) and
    the index of the slot in it, flattened."""
    amax_history, _, grad_amax = state
    return (grad_amax, 0) if role == GRAD else (amax_history, role * amax_history.shape[1])


def delayed_scale(amax: torch.Tensor, previous: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """The new scale from the amax of the window (TE delayed_scaling.cu kernel_bulk: scaled_max / amax)."""
    scaled_max = fp8_max(dtype) * 2.0**-margin  # TE: fp8_dtype_max * std::pow(2.f, -margin), exact in FP32
    scale = fp32_quotient(scaled_max, amax)
    scale = torch.where(torch.isfinite(amax) & (amax > 0), scale, previous)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)


@torch.no_grad()
def quantize_delayed(
    x: torch.Tensor, dtype: torch.dtype, state: tuple[torch.Tensor, ...], role: int
) -> Float8Tensor:
    """`state`: a DelayedScalingState's tensors(); this tensor's amax goes into the role's open slot (in place)."""
    scale = state[1][role]
    quantized = Float8Tensor(cast_to_fp8(x, scale, dtype), fp32_quotient(1.0, scale))
    target, index = open_slot(state, role)
    slots = target.view(-1)
    slots[index] = torch.maximum(slots[index], x.abs().amax().float())  # propagates NaN
    return quantized


@torch.no_grad()
def update_delayed_scaling(
    states: list[DelayedScalingState], role_dtypes: tuple[torch.dtype, ...], algo: AmaxComputeAlgo, margin: int,
    kernel: Optional[bool] = None,
) -> None:
    """Close the open history slot of every layer in `states`: reduce over the default process group (when
    there is one), recompute the scales, move the windows on. One collective for the whole model, whatever its
    number of layers. `kernel` (default: on CUDA, outside a compiled region): recipes.fp8.delayed_update_kernel's
    one launch for the whole model (two around the collective) instead of tens of small kernels: it runs after
    every micro-batch, and on a GPU those launches cost more host time than the kernels take."""
    if kernel is None:
        kernel = states[0].scale.is_cuda and not torch.compiler.is_compiling()
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if kernel:
        _update_with_kernel(states, role_dtypes, algo, margin, distributed)
        return
    last, nonfinite = _open_slots(states)
    if distributed:
        reduced = torch.stack([last, nonfinite])  # the flags travel with the amaxes: a MAX need not keep a NaN
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        last, nonfinite = reduced.unbind(0)
    _close_slots(states, last, nonfinite, role_dtypes, algo, margin)


def _update_with_kernel(states: list[DelayedScalingState], role_dtypes: tuple[torch.dtype, ...],
                        algo: AmaxComputeAlgo, margin: int, distributed: bool) -> None:
    from recipes.fp8 import delayed_update_kernel

    buffers = tuple([getattr(s, name) for s in states] for name in ("amax_history", "grad_amax", "scale", "nonfinite"))
    reduced = None
    if distributed:
        reduced = delayed_update_kernel.open_slots(buffers)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    scaled_maxes = tuple(fp8_max(dtype) * 2.0**-margin for dtype in role_dtypes)
    delayed_update_kernel.close_slots(buffers, scaled_maxes, algo == AmaxComputeAlgo.most_recent, reduced)


def _open_slots(states: list[DelayedScalingState]) -> tuple[torch.Tensor, torch.Tensor]:
    """(layers, roles): each open slot's amax, and the non-finite flags with this micro-batch's folded in."""
    last = torch.stack([torch.cat([state.amax_history[:GRAD, 0], state.grad_amax]) for state in states])
    nonfinite = torch.stack([state.nonfinite for state in states]).maximum((~torch.isfinite(last)).float())
    return last, nonfinite


def _close_slots(states: list[DelayedScalingState], last: torch.Tensor, nonfinite: torch.Tensor,
                 role_dtypes: tuple[torch.dtype, ...], algo: AmaxComputeAlgo, margin: int) -> None:
    histories = torch.stack([state.amax_history for state in states])  # (layers, roles, history)
    window = histories.roll(-1, dims=-1)  # [oldest, ..., newest, last]: the last history_len amaxes
    window[:, :, -1] = last
    if algo == AmaxComputeAlgo.max:
        amax = torch.where(torch.isnan(window), 0.0, window).amax(dim=-1)  # TE's fmaxf drops NaN
    else:
        amax = last
    moves = last != 0  # TE skips the roll and keeps the scale where the reduced amax is 0 (NaN moves)
    amax = torch.where(moves, amax, 0.0)
    previous = torch.stack([state.scale for state in states])
    scales = torch.stack(
        [delayed_scale(amax[:, r], previous[:, r], role_dtypes[r], margin) for r in range(NUM_ROLES)], dim=1
    )
    window[:, :, 0] = 0  # the oldest amax drops out; slot 0 is the open one again
    histories = torch.where(moves[:, :, None], window, histories)
    # Compiled, one copy per tensor: Inductor on CUDA (torch 2.11) lost the _foreach_copy_ into the scales that
    # the same graph had read (they stayed 1). Eager, one launch per kind for the whole model.
    copy = _copy_each if torch.compiler.is_compiling() else torch._foreach_copy_
    copy([state.amax_history for state in states], list(histories.unbind(0)))
    copy([state.scale for state in states], list(scales.unbind(0)))
    copy([state.nonfinite for state in states], list(nonfinite.unbind(0)))
    torch._foreach_zero_([state.grad_amax for state in states])


def _copy_each(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for target, value in zip(targets, values):
        target.copy_(value)
