"""Per-tensor delayed scaling (Transformer Engine's DelayedScaling).

Each operand role of a layer (input, weight, gradient) keeps a history of its last `amax_history_len` amaxes and
the scale derived from it. A quantization uses the scale computed from the history *before* this tensor, then
records this tensor's amax and recomputes the scale for the next one:

    scale_t = fp8_max / reduce(history[..t-1]) / 2**margin,    reduce = max (over the window) or most_recent

"Step" here is one use of the layer: every micro-batch's forward (input, weight) and backward (gradient), as TE
updates inside each fp8_autocast region. Under gradient accumulation the training loop caches the FP8 weight
for the whole optimizer step (recipes.fp8.linear), so the weight's amax is recorded once per step, in the first
micro-batch, as in TE with `is_first_microbatch`. The history starts at zero, so the first use has scale 1. An inf or NaN
in the tensor makes this quantization NaN (not a silent saturation with the old scale) and poisons the history.
The state lives in `DelayedScalingState` buffers of each FP8 linear layer, so checkpoints carry it.
"""

from __future__ import annotations

import torch
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


@torch.no_grad()
def quantize_delayed(
    x: torch.Tensor,
    dtype: torch.dtype,
    state: tuple[torch.Tensor, torch.Tensor],
    role: int,
    algo: AmaxComputeAlgo,
    margin: int,
) -> Float8Tensor:
    """`state` is (amax_history, scale) of a DelayedScalingState; both are updated in place."""
    amax_history, scales = state
    amax = x.abs().amax().float()
    scale = scales[role].clone()  # from the history before this tensor
    poisoned = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    quantized = Float8Tensor(cast_to_fp8(x, poisoned, dtype), poisoned.reciprocal())
    history = amax_history[role]
    history.copy_(torch.roll(history, 1))
    history[0] = amax
    reduced = history.amax() if algo == AmaxComputeAlgo.max else history[0]
    scales[role] = tensorwise_scale(reduced, dtype, margin)
    return quantized
