"""Fully sharded data parallelism (PyTorch FSDP2, `fully_shard`) for the torch engine's several processes.

Every process holds 1/N of each parameter, its gradient and its AdamW moments (FP32 DTensors sharded along
dimension 0 over a one-dimensional DeviceMesh). Each decoder layer is one FSDP group, the root (embedding, final
norm, output layer) another:

    forward     a layer's parameters are all-gathered in BF16 just before it runs (MixedPrecisionPolicy), so every
                layer, FP8 linears included, sees the whole weight one process would cast under autocast; freed
                after the layer (reshard after forward) but in the last layer and the root, whose backward is next
    backward    all-gathered again, then the gradients reduce-scattered in FP32 and averaged
    optimizer   AdamW updates the FP32 shards in place

Gradient accumulation (`trainer.grad_reduce`): per_step (the default) skips the reduce-scatter before the step's
last micro-batch (`set_gradient_sync`) and accumulates unsharded FP32 gradients until then; per_micro_batch
reduce-scatters after every micro-batch into the sharded gradients (torchtitan's way): more traffic, overlapped
with the backward, and no unsharded gradients. Resharding after forward stays on during accumulation: an
all-gather per layer and micro-batch, overlapped with compute, instead of every layer's BF16 weights at once.

FP8 all-gather (`trainer.fsdp_fp8_all_gather=true`, per-tensor recipes; off by default, its speed:
docs/results): the FP8 object makes the FP8 linears' weights shards that FSDP2 gathers in E4M3
(Fp8Training.prepare_for_sharding, before `shard_model`; recipes.fp8.all_gather), which go straight into the GEMMs.

Initialisation (`materialize`): the model is built on the meta device, sharded, and only then materialised: each
process allocates its shards and draws each weight whole from the run's generator, in the order one process
draws them, keeping its slice, so N processes start from exactly one process's weights and no GPU holds more
than one whole parameter at a time.

Buffers are not sharded: RoPE tables, and delayed scaling's amax histories, which the FP8 object keeps identical
on every rank by all-reducing (max) the amaxes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from recipes.models.transformer import Transformer, initial_std


def data_parallel_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def shard_model(model: Transformer, mesh: DeviceMesh, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Apply FSDP2 in place, bottom-up: each decoder layer, then the root. Call after compiling the layers (the
    order torchtitan uses; Dynamo leaves FSDP's hooks out of the compiled graphs), and after
    Fp8Training.prepare_for_sharding. Weights are all-gathered in `compute_dtype` (recipes.compute)."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for index, layer in enumerate(model.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=index < last)
    fully_shard(model, mesh=mesh, mp_policy=policy)


@torch.no_grad()
def materialize(model: Transformer, device: torch.device, generator: torch.Generator) -> None:
    """A model built on the meta device and sharded: allocate its shards and buffers on `device`, and give them
    the values Transformer.init_weights gives one process's model with the same generator: seed-independent
    values (norms, RoPE tables, FP8 state) from each module's reset_constants, random weights drawn whole in the
    same order and sliced as FSDP2 shards them."""
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_constants"):
            module.reset_constants()
    for name, param in model.named_parameters():
        std = initial_std(name, model.cfg)
        if std is None:
            continue
        whole = torch.empty(param.shape, dtype=param.dtype, device=device).normal_(0.0, std, generator=generator)
        if isinstance(param, DTensor):  # this process's slice, cut locally (no communication)
            whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param = param.to_local()
        param.copy_(whole)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP) or only accumulates them; one process: no-op."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor that may be a DTensor (e.g. a gradient norm computed over shards)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
