"""Fully sharded data parallelism (PyTorch FSDP2, `fully_shard`) for the torch engine's several processes.

Every process holds 1/N of each parameter, its gradient and its AdamW moments (FP32, as DTensors sharded along
dimension 0 over a one-dimensional DeviceMesh). Each decoder layer is one FSDP group, and the root module (the
embedding, final norm and output layer) another:

    forward     a layer's BF16 parameters are all-gathered just before it runs (MixedPrecisionPolicy param_dtype),
                so every layer, FP8 linears included, sees its whole weight as a plain BF16 tensor, exactly the
                weight one process would cast under autocast; they are freed again after the layer (reshard after
                forward) except in the last layer and the root, whose backward starts at once
    backward    all-gathered again, then the gradients reduce-scattered in FP32 (reduce_dtype) and averaged
    optimizer   AdamW updates the FP32 shards in place

Gradient accumulation (`trainer.grad_reduce`): by default (per_step) the micro-batches before the last one of a
step skip the reduce-scatter (`set_gradient_sync`) and FSDP accumulates their unsharded gradients in FP32 (the
reduce dtype); the last one reduce-scatters the sum, once per optimizer step. per_micro_batch reduce-scatters
after every micro-batch and FSDP adds the result into the sharded gradients (torchtitan's way): N times the
traffic, overlapped with the backward, but no unsharded gradients (32 GB for Llama 3 8B), which is what lets a big
model accumulate at all. Resharding after forward stays on during accumulation: it
costs an all-gather per layer and micro-batch, which overlaps with compute, and saves holding every layer's BF16
weights at once (16 GB for Llama 3 8B).

FP8 all-gather (`trainer.fsdp_fp8_all_gather=true`, per-tensor recipes): each process casts its FP32 shard to
E4M3 with the whole weight's scale and the FP8 bytes are gathered instead of BF16 (recipes.fp8.all_gather); the
gathered FP8 weight goes straight into the GEMMs, so no layer quantizes its weight (and none keeps a weight
cache). Off by default: on two NVLink-connected H200s it was slower than the BF16 all-gather, because the
compiled blocks fell back to eager around the FP8 linears (fixed since; not re-measured: docs/results).

Initialisation: the model is built on the meta device, sharded, and only then materialised (`materialize`):
each process allocates its shards and draws each weight whole from the run's generator, in the order one process
draws them, keeping its slice. So no GPU ever holds the whole FP32 model (280 GB for Llama 3 70B), at most one
whole parameter at a time, and N processes start from exactly the weights one process would.

Buffers are not sharded: RoPE tables, and delayed scaling's amax histories, which
the FP8 object (recipes.fp8.training) keeps identical on every rank by all-reducing (max) the amaxes.
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


def shard_model(model: Transformer, mesh: DeviceMesh) -> None:
    """Apply FSDP2 in place, bottom-up: each decoder layer, then the root. Call after compiling the layers (the
    order torchtitan uses; Dynamo leaves FSDP's hooks out of the compiled graphs), and after
    Fp8Training.prepare_for_sharding."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
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
