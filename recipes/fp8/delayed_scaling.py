"""Per-tensor delayed scaling (Transformer Engine's DelayedScaling).

Each operand role of a layer (input, weight, gradient) keeps a history of its last `amax_history_len` amaxes and
the scale derived from it. A quantization uses the scale computed from the history *before* this tensor:

    scale_t = fp8_max / reduce(history[..t-1]) / 2**margin,    reduce = max (over the window) or most_recent

"Step" here is one micro-batch: its forward quantizes input and weight once, its backward the gradient once.
A quantization records its tensor's amax in the newest history slot (slot 0) and leaves the scale alone;
`update_delayed_scaling`, called after each micro-batch's backward, then closes the slot of every layer at once,
as Transformer Engine does after each fp8_autocast region:

    1. one all-reduce (max) of the newest amaxes of all layers over the data-parallel ranks, so that every rank
       holds the same histories and scales (each rank saw only its own slice of the batch);
    2. the new scales from the reduced histories;
    3. the window moves on by one (the oldest amax drops out, slot 0 is emptied).

Recording is a max into the slot, so a forward recomputed under activation checkpointing quantizes with the same
scale and records nothing new. Under gradient accumulation the training loop quantizes each weight once per optimizer
step (recipes.fp8.linear's weight cache), so the weight's slot is filled in the first micro-batch only and stays
empty in the others; a closed slot whose reduced amax is 0 keeps the previous scale, as Transformer Engine's
scale update does, so an empty slot never resets a scale (and `most_recent` stays meaningful). The history starts at zero, so the first use has scale 1. An inf or NaN in the
tensor makes this quantization NaN (not a silent saturation with the old scale) and poisons the history. The
state lives in `DelayedScalingState` buffers of each FP8 linear layer, so checkpoints carry it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import AmaxComputeAlgo
from recipes.fp8.current_scaling import cast_to_fp8, tensorwise_scale
from recipes.fp8.tensor import Float8Tensor

NUM_ROLES = 3  # input, weight, gradient


class DelayedScalingState(nn.Module):
    def __init__(self, history_len: int):
        super().__init__()
        self.register_buffer("amax_history", torch.zeros(NUM_ROLES, history_len))
        self.register_buffer("scale", torch.ones(NUM_ROLES))

    def reset_constants(self) -> None:
        """The initial state: an empty history, scale 1 (after a model built on the meta device is materialised)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)


@torch.no_grad()
def quantize_delayed(
    x: torch.Tensor, dtype: torch.dtype, state: tuple[torch.Tensor, torch.Tensor], role: int
) -> Float8Tensor:
    """`state` is (amax_history, scale) of a DelayedScalingState; this tensor's amax goes into the history's
    newest slot (in place)."""
    amax_history, scales = state
    amax = x.abs().amax().float()
    poisoned = torch.where(torch.isfinite(amax), scales[role], torch.full_like(amax, float("nan")))
    quantized = Float8Tensor(cast_to_fp8(x, poisoned, dtype), poisoned.reciprocal())
    amax_history[role, 0] = torch.maximum(amax_history[role, 0], amax)  # maximum propagates NaN
    return quantized


@torch.no_grad()
def update_delayed_scaling(
    states: list[DelayedScalingState], role_dtypes: tuple[torch.dtype, ...], algo: AmaxComputeAlgo, margin: int
) -> None:
    """Close the newest history slot of every layer in `states`: reduce over the default process group (when
    there is one), recompute the scales, move the window on. A handful of kernels and one collective for the
    whole model, whatever its number of layers."""
    histories = torch.stack([state.amax_history for state in states])  # (layers, roles, history)
    if dist.is_initialized() and dist.get_world_size() > 1:
        newest = histories[:, :, 0].contiguous()
        dist.all_reduce(newest, op=dist.ReduceOp.MAX)
        histories[:, :, 0] = newest
    reduced = histories.amax(dim=-1) if algo == AmaxComputeAlgo.max else histories[:, :, 0]
    scales = torch.stack([tensorwise_scale(reduced[:, r], role_dtypes[r], margin) for r in range(NUM_ROLES)], dim=1)
    scales = torch.where(reduced == 0, torch.stack([state.scale for state in states]), scales)
    histories = histories.roll(1, dims=-1)
    histories[:, :, 0] = 0
    torch._foreach_copy_([state.amax_history for state in states], list(histories.unbind(0)))
    torch._foreach_copy_([state.scale for state in states], list(scales.unbind(0)))
