"""Checkpoints of engine=megatron: megatron-core's distributed checkpoints in the torch engine's folder layout.

    <checkpoints>/step_<N>/           dist_checkpointing shards of every rank (model chunks and optimizer), and
                       run.pt         step and config: the mark of a complete checkpoint
                       manifest.json  every file's size and SHA-256, written last: checked before a resume,
                                      which falls back to the newest intact checkpoint

Every rank writes its own shards into one temporary folder, and rank 0 publishes it as step_<N> with one rename
(recipes.trainer.checkpoints' start_save/finish_save), so the newest step_<N> is always whole and is what a restart
in the same run directory resumes, with the same tp, pp, vp and cp (the optimizer's "dp_reshardable" format lets
only the data-parallel size change). There is no RNG state to keep: no dropout, and the data of a step is a
function of the step (recipes.megatron.data).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from recipes.config import Config, to_dict
from recipes.trainer import checkpoints
from megatron.core import dist_checkpointing
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


def save(directory: Path, step: int, model: list, optimizer, cfg: Config) -> Optional[Path]:
    """Write step `step`'s checkpoint (a collective: every rank calls it); the published folder on rank 0."""
    rank = dist.get_rank()
    temporary = directory / f"step_{step:08d}.tmp-megatron"  # one name on every rank
    if rank == 0:
        checkpoints.start_save(directory, step, tag="megatron")
    # With overlapped parameter all-gathers the model's BF16 weights lag the optimizer step until the next
    # forward; gather them now, as Megatron-LM does before saving.
    overlapped = [chunk for chunk in model if chunk.ddp_config.overlap_param_gather]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)
        # megatron-core 0.16.1's forced all-gather skips what its overlapped one does after it: FP8 weights'
        # transposes (what dgrad reads on Hopper) would stay the previous step's, still marked valid, and the step
        # after every checkpoint would train on them (found comparing resumed runs: docs/results).
        post_all_gather_processing([param for param in chunk.parameters() if is_float8tensor(param)])
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(model, optimizer), str(temporary))
    for chunk in overlapped:
        chunk.enable_forward_pre_hook()
    dist.barrier()
    checkpoints.seal(temporary, MARKER, {"step": step, "config": to_dict(cfg)}, rank, dist.get_world_size())
    final = None
    if rank == 0:
        final = checkpoints.finish_save(directory, step, temporary)
        checkpoints.prune(directory, cfg.trainer.checkpoint.keep_last, MARKER)
    dist.barrier()
    return final


@torch.no_grad()  # the optimizer copies loaded states into its FP32 master weights, views of autograd leaves
def load_latest(directory: Path, cfg: Config, model: list, optimizer) -> int:
    """Load the newest intact checkpoint (recipes.trainer.checkpoints' newest_intact: verified against its manifest,
    damaged ones moved aside) into the model chunks and optimizer; its step, 0 when there is none."""
    found = checkpoints.newest_intact(directory, MARKER, cfg, dist.get_rank(), dist.get_world_size())
    if found is None:
        return 0
    step, path, _ = found
    # Without Transformer Engine or Apex, megatron-core reads Adam's step count while it builds the loading state
    # dict, which a fresh optimizer does not have yet: one step on zero gradients allocates the states (and moves
    # the weights by weight decay), and the load below overwrites all of it.
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.step()
    with own_te_extra_state_trusted():
        state = dist_checkpointing.load(sharded_state_dict(model, optimizer, is_loading=True), str(path))
        for key, chunk in zip(model_keys(model), model):
            chunk.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer)
    return step


TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextmanager
def own_te_extra_state_trusted():
    """Transformer Engine (2.20) keeps delayed scaling's amax histories and scales as a pickle in each layer's extra
    state and refuses to unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. load_latest only reads this
    run's own checkpoints (its checkpoint folder, checked by check_resumable), so it trusts them for the load and
    puts the setting back after."""
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
    saves once per parameter group and, into an optimizer that has already stepped (see load_latest), does not
    copy back: without this, bias correction would restart from the allocation step."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param, {})
                if "step" in group and "step" in state:
                    state["step"] = torch.full_like(state["step"], float(group["step"]))
