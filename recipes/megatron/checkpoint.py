"""Checkpoints of engine=megatron: megatron-core's distributed checkpoints in the torch engine's folder layout.

    <checkpoints>/step_<N>/           dist_checkpointing shards of every rank (model chunks and optimizer), and
                       run.pt         step and config, written last: the mark of a complete checkpoint

Every rank writes its own shards into one temporary folder, and rank 0 publishes it as step_<N> with one rename
(recipes.engine.checkpoint's start_save/finish_save), so the newest step_<N> is always whole and is what a restart
in the same run directory resumes. dist_checkpointing reshards on load: a run may resume with another tp/pp/dp
(not another vp: the chunks are saved by index). There is no RNG state to keep: no dropout, and the data of a
step is a function of the step (recipes.megatron.data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from recipes.config import Config, to_dict
from recipes.engine import checkpoint
from megatron.core import dist_checkpointing

MARKER = "run.pt"


def model_keys(model: list) -> list[str]:
    """Megatron-LM's names: "model", or "model0", "model1", ... with virtual pipeline stages."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def sharded_state_dict(model: list, optimizer, is_loading: bool = False) -> dict:
    state = {key: chunk.module.sharded_state_dict() for key, chunk in zip(model_keys(model), model)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def save(directory: Path, step: int, model: list, optimizer, cfg: Config) -> Optional[Path]:
    """Write step `step`'s checkpoint (a collective: every rank calls it); the published folder on rank 0."""
    rank = dist.get_rank()
    temporary = directory / f"step_{step:08d}.tmp-megatron"  # one name on every rank
    if rank == 0:
        checkpoint.start_save(directory, step, tag="megatron")
    # With overlapped parameter all-gathers the model's BF16 weights lag the optimizer step until the next
    # forward; gather them now, as Megatron-LM does before saving.
    overlapped = [chunk for chunk in model if chunk.ddp_config.overlap_param_gather]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(model, optimizer), str(temporary))
    for chunk in overlapped:
        chunk.enable_forward_pre_hook()
    dist.barrier()
    final = None
    if rank == 0:
        torch.save({"step": step, "config": to_dict(cfg)}, temporary / MARKER)
        final = checkpoint.finish_save(directory, step, temporary)
        checkpoint.prune(directory, cfg.trainer.checkpoint.keep_last, MARKER)
    dist.barrier()
    return final


def load_latest(directory: Path, cfg: Config, model: list, optimizer) -> int:
    """Load the newest complete checkpoint into the model chunks and optimizer; its step, 0 when there is none."""
    complete = checkpoint.complete_checkpoints(directory, MARKER)
    if not complete:
        return 0
    step, path = complete[-1]
    saved = torch.load(path / MARKER, weights_only=True)
    checkpoint.check_resumable(saved["config"], step, cfg, path)
    state = dist_checkpointing.load(sharded_state_dict(model, optimizer, is_loading=True), str(path))
    for key, chunk in zip(model_keys(model), model):
        chunk.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    return step
