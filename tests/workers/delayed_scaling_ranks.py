"""Run by tests/test_fsdp.py under torchrun with 2 processes (Gloo): FP8 linears with delayed scaling, sharded by
FSDP2, each rank feeding its own data. Checks that the layers see the whole (unsharded) BF16 weight, and that
after update_fp8_scaling every rank holds the same amax histories and scales, whose newest amaxes are the maxima
over the ranks; that an amax of 0 on every rank leaves a history as it is (Transformer Engine's fused update),
an amax of 0 on one rank does not; and that an inf on one rank stops both. Exits non-zero (an AssertionError)
otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recipes.config import AmaxComputeAlgo
from recipes.engine.fsdp import data_parallel_mesh, shard_model
from recipes.fp8.delayed_scaling import NUM_ROLES, DelayedScalingState, update_delayed_scaling
from recipes.fp8.formats import E4M3, E5M2
from recipes.fp8.linear import DelayedScaling, Fp8Linear
from recipes.fp8.current_scaling import tensorwise_scale
from recipes.fp8.training import fp8_amaxes_finite, non_finite_amaxes, update_fp8_scaling

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

    # Micro-batch 1: rank 0 feeds zeros, rank 1 does not: the reduced amaxes are rank 1's and every history moves.
    # Micro-batch 3: both feed zeros: inputs and gradients have amax 0 on every rank and (TE's fused update) keep
    # their histories and scales; the weights, quantized again, move on.
    amaxes = []
    for micro in range(4):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 * rank + micro)) * (1 + rank + micro)
        if (micro, rank) in ((1, 0), (3, 0), (3, 1)):
            x = torch.zeros_like(x)
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
    # TE's layout [open slot, oldest, ..., newest]: micro-batches 0, 1, 2, each the max over ranks; not 3.
    every_rank = torch.stack(amaxes)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MAX)
    assert every_rank[3] == 0 and torch.equal(history[INPUT], torch.cat([torch.zeros(1), every_rank[:3]]))
    assert torch.equal(scale[INPUT], tensorwise_scale(every_rank.max(), E4M3))
    assert (history[GRAD, 1:] > 0).all() and history[GRAD, 0] == 0  # three moves, none in micro-batch 3
    weight_amax = full_weight.bfloat16().abs().max().float()
    assert torch.equal(history[WEIGHT], torch.stack([torch.zeros(()), weight_amax, weight_amax, weight_amax]))

    # An inf in rank 1's input only: the cast saturates it, and both ranks stop on the same flag.
    assert bool(fp8_amaxes_finite(model))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7 + rank))
    if rank == 1:
        x[3, 3] = float("inf")
    loss = model(x.bfloat16()).float().square().mean()
    loss.backward()
    update_fp8_scaling(model)
    assert torch.isfinite(loss) and not bool(fp8_amaxes_finite(model))
    assert non_finite_amaxes(model) == "layers.0's input", non_finite_amaxes(model)
    check_update_kernel(rank)
    dist.destroy_process_group()


def check_update_kernel(rank: int) -> None:
    """The GPU's update (recipes.fp8.delayed_update_kernel: one kernel reads the open slots, the all-reduce, one
    closes them; Triton's CPU interpreter here) gives every rank the reference update's bits: open slots that
    differ by rank, a NaN on rank 0 and an inf on rank 1, amax 0 on both ranks for one role."""
    dtypes = (E4M3, E4M3, E5M2)
    results = []
    for kernel in (False, True):
        states = [DelayedScalingState(4) for _ in range(3)]
        for layer, state in enumerate(states):
            state.amax_history[:, 1:] = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 8.0], [1e-3, 2e-3, 0.0]])
            state.amax_history[:2, 0] = torch.tensor([1.0 + rank + layer, 0.0])
            state.grad_amax.fill_(1e-5 * (2 - rank))
        states[1].amax_history[0, 0] = float("nan") if rank == 0 else float("inf")
        update_delayed_scaling(states, dtypes, AmaxComputeAlgo.max, 0, kernel=kernel)
        results.append(torch.cat([torch.cat([s.amax_history.flatten(), s.scale, s.grad_amax, s.nonfinite])
                                  for s in states]))
    reference, kernel = results
    assert torch.equal(kernel.view(torch.int32), reference.view(torch.int32)), (rank, kernel, reference)


if __name__ == "__main__":
    main()
