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

This module is what the engine hands recipes.trainer.checkpoints (TorchCheckpoint: the shards, the RNG states),
whose `save` and `restore` do the rest: the temporary folder published with one rename (DCP fsyncs its files;
checkpoint.pt is fsynced), the manifest, the checks before a resume, pruning, a save the machine refuses (a full
disk, `ulimit -f`) stopping the run in one line. A stop signal that comes during a save, a second Ctrl-C included,
waits for it (recipes.trainer.loop.save, recipes.trainer.stopping).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from recipes.trainer.checkpoints import CheckpointError

FILE = "checkpoint.pt"


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


# ---- what the engine hands recipes.trainer.checkpoints ----


@dataclass
class TorchCheckpoint:
    """The torch engine's checkpoint format (recipes.trainer.checkpoints.CheckpointFormat): the model's and the
    optimizer's shards through DCP, every rank's RNG state in checkpoint.pt."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    rank: int
    world_size: int
    marker: ClassVar[str] = FILE

    def write(self, folder: Path) -> dict:
        """Every rank's shards into `folder` (dcp.save returns once they and the metadata are all written); each
        rank's RNG state, gathered, for checkpoint.pt."""
        rng = [rng_state(self.device)]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder,
                 no_dist=self.world_size == 1)
        return {"rng": rng}

    def read(self, folder: Path, state: dict) -> None:
        """Model and optimizer from `folder` into this (possibly sharded) model and its optimizer, then this rank's
        RNG state."""
        if not (folder / ".metadata").is_file():
            raise CheckpointError(
                f"cannot resume from {folder}: it holds no torch.distributed.checkpoint shards (an earlier "
                "version of the engine wrote the whole state into checkpoint.pt). Use a new run.dir."
            )
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        try:
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder,
                     no_dist=not dist.is_initialized())
        except (CheckpointException, RuntimeError) as error:  # missing or misshapen entries
            raise CheckpointError(f"cannot resume from {folder}: the model does not match it: {error}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        states = state["rng"]
        # a different world size: data and weights are exact, RNG streams reused
        set_rng_state(states[self.rank % len(states)], self.device)
