"""Run by tests/test_fsdp.py under torchrun with 2 processes (Gloo): FP8 linears sharded by FSDP2 with FP8
all-gather (recipes.fp8.all_gather), each rank feeding its own data, eager and with each block compiled.

Checks, for current scaling, that the layer receives exactly the FP8 weight (bytes and scale) one process would
quantize from the whole FP32 weight, after each optimizer step too; for delayed scaling, that the weight's amax
recorded by update_all_gather_scales (once per optimizer step) is the whole weight's, and that it sets the next
scale; and that compiled blocks compute what eager ones do. Exits non-zero (an AssertionError) otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recipes.engine.fsdp import data_parallel_mesh, shard_model
from recipes.fp8.all_gather import Fp8GatheredWeight
from recipes.fp8.current_scaling import quantize_tensorwise, tensorwise_scale
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.linear import WEIGHT, TensorwiseScaling, DelayedScaling, Fp8Linear
from recipes.fp8.training import enable_fp8_all_gather, update_all_gather_scales, update_fp8_scaling


class Stack(nn.Module):
    """Two FSDP groups (norm + FP8 linear, as a decoder layer mixes BF16 and FP8 parameters) and a root."""

    def __init__(self, recipe):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), Fp8Linear(nn.Linear(64, 96, bias=False), recipe),
                          nn.Linear(96, 64, bias=False)) for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def full_weight(param: torch.Tensor) -> torch.Tensor:
    """The whole FP32 weight from the ranks' master shards."""
    local = param.to_local()._tensor
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)[: param.shape[0]]


def train(recipe, compiled: bool) -> list[float]:
    rank = dist.get_rank()
    model = Stack(recipe)
    if compiled:
        for layer in model.layers:
            layer.compile()
    enable_fp8_all_gather(model)
    shard_model(model, data_parallel_mesh(torch.device("cpu"), dist.get_world_size()))
    update_all_gather_scales(model)
    linear = model.layers[0][1]
    received = []
    linear.register_forward_pre_hook(
        lambda module, args: received.append((module.weight, [t.clone() for t in module.weight.as_float8()[:2]]))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        expected = full_weight(linear.weight)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        update_fp8_scaling(model)
        if isinstance(recipe, DelayedScaling):
            history = linear.fp8_state.amax_history
            # The newest amax (TE's layout: [open slot, oldest, ..., newest]), put there by update_all_gather_scales.
            assert torch.equal(history[WEIGHT, -1], expected.abs().max()), (history[WEIGHT], expected.abs().max())
            assert torch.equal(linear.fp8_state.scale[WEIGHT], tensorwise_scale(history[WEIGHT].max(), E4M3))
        weight, (data, scale_inv) = received[-1]
        assert isinstance(weight, Fp8GatheredWeight) and weight.shape == expected.shape
        if isinstance(recipe, TensorwiseScaling):
            reference = quantize_tensorwise(expected, E4M3)
            assert torch.equal(data.view(torch.uint8), reference.data.view(torch.uint8)), f"step {step}: FP8 bytes"
            assert torch.equal(scale_inv, reference.scale_inv), f"step {step}: scale"
        optimizer.step()
        optimizer.zero_grad()
        update_all_gather_scales(model)
        losses.append(loss.item())
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    for recipe in (TensorwiseScaling(E4M3, E5M2), DelayedScaling(E4M3, E5M2, amax_history_len=4)):
        eager, compiled = train(recipe, False), train(recipe, True)
        assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(eager, compiled)), (recipe, eager, compiled)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
