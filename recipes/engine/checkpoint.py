"""Checkpoints of the PyTorch engine: saved every `trainer.checkpoint.interval` steps, resumed automatically.

A run started again with the same run directory (a Slurm requeue, a resubmission, possibly with a larger
`trainer.max_steps`) continues from the newest checkpoint there, and continues exactly: everything a step depends
on is restored.

    model          parameters and persistent buffers (the FP32 master weights; delayed scaling's amax histories
                   and scales, which FP8 recipes keep as buffers, replicated over data-parallel ranks)
    optimizer      AdamW moments and step counts
    step           the data position: sample i is a pure function of (seed, i) (MicroBatches.get), so the step
                   alone says where the data stream continues
    rng            torch CPU and CUDA, Python `random`, NumPy, for each rank
    config         the config that wrote it, to refuse a checkpoint of a different model (check_compatible)

On disk, under `<run dir>/checkpoints/` (or `trainer.checkpoint.dir`):

    step_00000050/.metadata, __0_0.distcp, __1_0.distcp, ...   model and optimizer (torch.distributed.checkpoint)
    step_00000050/checkpoint.pt                                 step, rng, config
    step_00000050/manifest.json         every file's size and SHA-256, written last: checked before a resume,
                                        which falls back to the newest intact checkpoint (recipes.trainer.checkpoints)
    step_00000150.tmp-<pid>/            a save that was killed midway: never read, removed by the next save

(the folders as both engines keep them: recipes.trainer.checkpoints).

Model and optimizer go through torch.distributed.checkpoint (DCP) with get_state_dict/set_state_dict: under
FSDP every rank writes its own shards in parallel, nothing is gathered to one process (a full state of Llama 3
70B with its Adam moments would be 1.1 TB on rank 0), and a run may resume on another number of processes
(DCP reshards on load); one process writes the same format. Parameter names are those of the plain model,
whatever wraps it (FSDP, activation checkpointing, compile). Rank 0 alone writes checkpoint.pt (each rank's RNG
state is gathered to it) once every rank's shards are on disk; every rank reads it.

A save writes into the temporary folder (DCP fsyncs its files; checkpoint.pt is fsynced), and renames it to
`step_<N>` (a rename is atomic), so a folder named `step_<N>` is always complete. One the machine refuses (a full
disk, `ulimit -f`) removes the temporary folder and stops the run in one line (recipes.trainer.checkpoints.settle);
a stop signal that comes meanwhile, a second Ctrl-C included, waits for the save (recipes.trainer.stopping).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from recipes.config import Config, to_dict
from recipes.trainer import checkpoints
from recipes.trainer.checkpoints import CheckpointError
from recipes.trainer.stopping import stop_signals

FILE = "checkpoint.pt"


@dataclass
class Checkpoint:
    path: Path  # the step_<N> folder
    step: int
    state: dict


# ---- what a checkpoint holds ----


def rng_state(device: torch.device) -> dict[str, Any]:
    numpy_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        # As plain tensors and numbers, so that the file loads with torch.load(weights_only=True).
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )


# ---- saving ----


def save(
    directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, rank: int,
    world_size: int, device: torch.device,
) -> Optional[Path]:
    """Write step `step`'s checkpoint (every rank calls this and writes its shards) and prune old ones. Returns
    the folder on rank 0. SaveFailed on every rank where the machine refuses it (recipes.trainer.checkpoints)."""
    rng = [rng_state(device)]
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, rng[0])
        rng = gathered
    with stop_signals.saving():
        # made by rank 0 and named with its process id, the same on every rank
        temporary = checkpoints.start_everywhere(directory, step, str(os.getpid()), FILE, rank, world_size)
        final, failure = None, None
        try:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary,
                     no_dist=world_size == 1)
            # dcp.save returns once every rank's shards and the metadata are written
            checkpoints.seal(temporary, FILE, {"step": step, "rng": rng, "config": to_dict(cfg)}, rank, world_size)
            if rank == 0:
                final = checkpoints.finish_save(directory, step, temporary)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            failure = error
        checkpoints.settle(failure, directory, step, temporary, FILE, rank, world_size)
    if rank == 0:
        checkpoints.prune(directory, cfg.trainer.checkpoint.keep_last, FILE)
    return final


# ---- resuming ----


def load_latest(directory: Path, cfg: Config) -> Optional[Checkpoint]:
    """The newest intact checkpoint in `directory`, checked against `cfg` (recipes.trainer.checkpoints'
    newest_intact: damaged ones are moved aside); None when there is none."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = checkpoints.newest_intact(directory, FILE, cfg, rank, world_size)
    if found is None:
        return None
    step, path, state = found
    return Checkpoint(path, step, state)


def restore(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer from `checkpoint` into this (possibly sharded) model and its optimizer (RNG
    separately, last: see set_rng_state). Every rank calls it."""
    if not (checkpoint.path / ".metadata").is_file():
        raise CheckpointError(
            f"cannot resume from {checkpoint.path}: it holds no torch.distributed.checkpoint shards (an earlier "
            "version of the engine wrote the whole state into checkpoint.pt). Use a new run.dir."
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint.path,
            no_dist=not dist.is_initialized(),
        )
    except (CheckpointException, RuntimeError) as error:  # missing or misshapen entries
        raise CheckpointError(f"cannot resume from {checkpoint.path}: the model does not match it: {error}") from None
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def rank_rng(checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
    states = checkpoint.state["rng"]
    return states[rank % len(states)]  # a different world size: data and weights are exact, RNG streams reused
