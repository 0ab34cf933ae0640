"""Checkpoints of engine=megatron: megatron-core's distributed checkpoints in the torch engine's folder layout.

    <checkpoints>/step_<N>/           dist_checkpointing shards of every rank (model chunks and optimizer), and
                       run.pt         step and config: the mark of a complete checkpoint
                       manifest.json  every file's size and SHA-256, written last: checked before a resume,
                                      which falls back to the newest intact checkpoint

The engine hands MegatronCheckpoint to recipes.trainer.checkpoints' save and restore, which keep the folders as
for the torch engine: every rank writes its own shards into one temporary folder, which rank 0 publishes as
step_<N> with one rename, so the newest step_<N> is always whole and is what a restart in the same run directory
resumes, with the same tp, pp, vp and cp (the optimizer's "dp_reshardable" format lets only the data-parallel size
change). There is no RNG state to keep: no dropout, and the data of a step is a function of the step
(recipes.megatron.data).

Megatron-FSDP's parameters and optimizer states are DTensor shards, which megatron-core 0.16.1 saves only in its
"fsdp_dtensor" form, through torch.distributed.checkpoint (as Megatron-LM's --ckpt-format fsdp_dtensor). Megatron-LM
drops Transformer Engine's extra state there (delayed scaling's amax histories and scales); this engine keeps it,
one copy per pipeline and tensor-parallel rank, so an FP8 run resumes where it stopped.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.fp8_utils import is_float8tensor, post_all_gather_processing

MARKER = "run.pt"


def model_keys(model: list) -> list[str]:
    """Megatron-LM's names: "model", or "model0", "model1", ... with virtual pipeline stages."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


# Megatron-LM's default format for the distributed optimizer's states: each rank saves and loads its own shard
# of the flat buffers, without gathering (resharding only over data parallel).
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def sharded_state_dict(model: list, optimizer, is_loading: bool = False) -> dict:
    state = {key: chunk.module.sharded_state_dict(metadata=METADATA) for key, chunk in zip(model_keys(model), model)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=METADATA)
    return state


FSDP_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}
EXTRA_STATE = "_extra_state"


def is_fsdp(model: list) -> bool:
    return model[0].ddp_config.use_megatron_fsdp


def _extra_states(chunk) -> dict:
    """The state the chunk's modules keep outside their parameters (Transformer Engine's FP8 scaling: a byte
    tensor), as bytes by module name; megatron-core's own layers return None."""
    states = {name: module.get_extra_state() for name, module in chunk.named_modules()
              if type(module).get_extra_state is not torch.nn.Module.get_extra_state}
    return {name: bytes(state.cpu().numpy()) for name, state in states.items() if state is not None}


def _extra_state_key(key: str) -> str:
    """Where a chunk's extra state is kept: under its pipeline and tensor-parallel rank (the same on every
    data-parallel rank)."""
    return (f"{key}{EXTRA_STATE}.pp{parallel_state.get_pipeline_model_parallel_rank()}"
            f".tp{parallel_state.get_tensor_model_parallel_rank()}")


def fsdp_state_dict(model: list, optimizer, is_loading: bool = False) -> dict:
    """Megatron-FSDP's checkpoint: the DTensor shards of weights and optimizer states, and each chunk's extra state
    as bytes (_extra_state_key)."""
    state = {}
    for key, chunk in zip(model_keys(model), model):
        state[key] = {name: value for name, value in chunk.state_dict_for_save_checkpoint().items()
                      if not name.endswith(EXTRA_STATE)}
        state[_extra_state_key(key)] = _extra_states(chunk)
    if is_loading:  # the optimizer allocates its states (a step on zero gradients), which the load overwrites
        optimizer.sharded_state_dict(state, is_loading=True, metadata=FSDP_METADATA)
    _state_for_every_shard(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=FSDP_METADATA)
    return preprocess_state_dict_for_uneven_dtensor(state)


def _state_for_every_shard(optimizer) -> None:
    """Adam keeps no state for a parameter whose shard on this rank is empty (it never gets a gradient), and keeps
    the others in the order they first stepped, so the ranks' state dicts would name different DTensors in different
    orders, and saving them, a collective per DTensor, would hang or mix them up: every parameter gets a state (an
    empty shard, empty moments and the step count of the others), in the parameters' order."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        params = [param for group in inner.param_groups for param in group["params"]]
        mine = next((inner.state[param] for param in params if inner.state.get(param)), None)
        # Each entry's kind: a moment (a tensor shaped as the parameter) by its dtype, a count (torch's Adam keeps
        # its step count as a CPU scalar tensor) by its value.
        layouts: list = [None] * dist.get_world_size()
        dist.all_gather_object(layouts, None if mine is None else {
            key: ("moment", value.dtype) if isinstance(value, torch.Tensor) and value.dim() > 0
            else ("count", value.cpu() if isinstance(value, torch.Tensor) else value) for key, value in mine.items()})
        layout = next((found for found in layouts if found is not None), None)
        if layout is None:  # no rank has stepped: nothing to line up
            continue
        states = {}
        for param in params:  # in parameter order on every rank: the save's gathers pair DTensors by position
            states[param] = inner.state.get(param) or {
                key: _empty_like(param, value) if kind == "moment" else _copy(value)
                for key, (kind, value) in layout.items()}
        inner.state.clear()
        inner.state.update(states)


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _byte_tensor(saved: bytes) -> torch.Tensor:
    """Saved extra state as the byte tensor it came from (empty: TE's "no FP8 state", which frombuffer refuses)."""
    return torch.frombuffer(bytearray(saved), dtype=torch.uint8) if saved else torch.empty(0, dtype=torch.uint8)


def _empty_like(param: DTensor, dtype: torch.dtype) -> DTensor:
    """Zeros shaped and sharded as the parameter, its local shard included (zeros_like would re-split it evenly)."""
    return DTensor.from_local(torch.zeros_like(param.to_local(), dtype=dtype), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


@dataclass
class MegatronCheckpoint:
    """engine=megatron's checkpoint format (recipes.trainer.checkpoints.CheckpointFormat): every rank's shards of the
    model chunks and the optimizer, through dist_checkpointing (torch.distributed.checkpoint under Megatron-FSDP)."""

    model: list
    optimizer: Any
    marker: ClassVar[str] = MARKER

    def write(self, folder: Path) -> dict:
        """Every rank's shards into `folder`; the marker keeps nothing more (no RNG state: see above)."""
        # With overlapped parameter all-gathers the model's BF16 weights lag the optimizer step until the next
        # forward; gather them now, as Megatron-LM does before saving (Megatron-FSDP saves its main weights' shards).
        fsdp = is_fsdp(self.model)
        overlapped = [chunk for chunk in self.model if chunk.ddp_config.overlap_param_gather and not fsdp]
        for chunk in overlapped:
            chunk.disable_forward_pre_hook(param_sync=True)
            # megatron-core 0.16.1's forced all-gather skips what its overlapped one does after it: FP8 weights'
            # transposes (what dgrad reads on Hopper) would stay the previous step's, still marked valid, and the
            # step after every checkpoint would train on them (found comparing resumed runs: docs/results).
            post_all_gather_processing([param for param in chunk.parameters() if is_float8tensor(param)])
        dist.barrier()
        # a failure of the writers is raised on every rank (DCP's and megatron-core's CheckpointException)
        if fsdp:
            dcp.save(fsdp_state_dict(self.model, self.optimizer), checkpoint_id=str(folder))
        else:
            dist_checkpointing.save(sharded_state_dict(self.model, self.optimizer), str(folder))
        for chunk in overlapped:
            chunk.enable_forward_pre_hook()
        dist.barrier()  # every rank's shards are in before rank 0 lists the folder's files for the manifest
        return {}

    @torch.no_grad()  # the optimizer copies loaded states into its FP32 master weights, views of autograd leaves
    def read(self, folder: Path, state: dict) -> None:
        """The shards of `folder` into the model chunks and the optimizer."""
        model, optimizer = self.model, self.optimizer
        if is_fsdp(model):
            _load_fsdp(folder, model, optimizer)
            return
        # Without Transformer Engine or Apex, megatron-core reads Adam's step count while it builds the loading
        # state dict, which a fresh optimizer does not have yet: one step on zero gradients allocates the states
        # (and moves the weights by weight decay), and the load below overwrites all of it.
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.step()
        with own_te_extra_state_trusted():
            loaded = dist_checkpointing.load(sharded_state_dict(model, optimizer, is_loading=True), str(folder))
            for key, chunk in zip(model_keys(model), model):
                chunk.load_state_dict(loaded[key])
        optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)


def _load_fsdp(path: Path, model: list, optimizer) -> None:
    """Megatron-FSDP's shards read in place into the model's and the optimizer's own (the optimizer allocates its
    states first with a step on zero gradients)."""
    state = fsdp_state_dict(model, optimizer, is_loading=True)
    dcp.load(state, checkpoint_id=str(path))
    with own_te_extra_state_trusted():
        for key, chunk in zip(model_keys(model), model):
            restore_chunk(chunk, state[key], state[_extra_state_key(key)])
    optimizer.load_state_dict(state["optimizer"])


def restore_chunk(chunk, weights: dict, extra_states: dict[str, bytes]) -> None:
    """Each module's extra state set from its bytes, then the weights: Megatron-FSDP's load hook
    (install_optimized_model_weights) casts the main weights into FP8 ones with each quantizer's scale, which in
    delayed scaling is the extra state's (TE's own _load_from_state_dict sets it first for the same reason)."""
    for name, saved in extra_states.items():
        chunk.get_submodule(name).set_extra_state(_byte_tensor(saved))
    chunk.load_state_dict(weights, strict=True)


TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextmanager
def own_te_extra_state_trusted():
    """Transformer Engine (2.20) keeps delayed scaling's amax histories and scales as a pickle in each layer's extra
    state and refuses to unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. A resume only reads this run's
    own checkpoints (its checkpoint folder, checked by recipes.trainer.checkpoints.restore), so it trusts them for
    the load and puts the setting back after."""
    before = os.environ.get(TE_UNSAFE_PICKLE)
    os.environ[TE_UNSAFE_PICKLE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[TE_UNSAFE_PICKLE]
        else:
            os.environ[TE_UNSAFE_PICKLE] = before


def _restore_adam_steps(optimizer) -> None:
    """torch's Adam (megatron-core's optimizer without TE/Apex) keeps a step count per parameter, which megatron-core
    saves once per parameter group and, into an optimizer that has already stepped (see MegatronCheckpoint.read),
    does not copy back: without this, bias correction would restart from the allocation step."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param, {})
                if "step" in group and "step" in state:
                    state["step"] = torch.full_like(state["step"], float(group["step"]))
