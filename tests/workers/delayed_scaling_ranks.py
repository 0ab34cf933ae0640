"""Run by tests/test_fsdp.py under torchrun with 2 processes (Gloo): FP8 linears with delayed scaling, sharded by
FSDP2, each rank feeding its own data. Checks that the layers see the whole (unsharded) BF16 weight, and that
after update_fp8_scaling every rank holds the same amax histories and scales, whose newest amaxes are the maxima
over the ranks. Exits non-zero (an AssertionError) otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import AmaxComputeAlgo
from recipes.engine.fsdp import data_parallel_mesh, shard_model
from recipes.fp8.delayed_scaling import NUM_ROLES
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.linear import DelayedScaling, Fp8Linear
from recipes.fp8.current_scaling import tensorwise_scale
from recipes.fp8.training import update_fp8_scaling

INPUT, WEIGHT, GRAD = range(NUM_ROLES)


class Stack(nn.Module):
    """The shape shard_model expects: `layers`, each one FSDP group, and a root."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        recipe = DelayedScaling(E4M3, E5M2, amax_history_len=4, amax_compute_algo=AmaxComputeAlgo.max)
        self.layers = nn.ModuleList(Fp8Linear(nn.Linear(64, 64, bias=False), recipe) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Stack()
    full_weight = model.layers[0].weight.detach().clone()
    shard_model(model, data_parallel_mesh(torch.device("cpu"), world))
    seen = []
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))

    amaxes = []
    for micro in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 * rank + micro)) * (1 + rank + micro)
        x = x.bfloat16().requires_grad_(True)
        model(x).float().square().mean().backward()
        amaxes.append(x.abs().max().float())
        update_fp8_scaling(model)

    assert seen[0].shape == full_weight.shape and seen[0].dtype == torch.bfloat16
    assert torch.equal(seen[0], full_weight.bfloat16())  # the whole weight, as one process would cast it
    layer = model.layers[0]
    history, scale = layer.fp8_state.amax_history, layer.fp8_state.scale
    for name, local in (("amax_history", history), ("scale", scale)):
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name} differs between ranks"
    # Newest first (slot 0 is the open one): slots 1..3 hold micro-batches 2, 1, 0, each the max over ranks.
    every_rank = torch.stack(amaxes)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MAX)
    assert torch.equal(history[INPUT, 1:], every_rank.flip(0)), (history[INPUT], every_rank)
    assert torch.equal(scale[INPUT], tensorwise_scale(every_rank.max(), E4M3))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
