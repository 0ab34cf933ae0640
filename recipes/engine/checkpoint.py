"""Checkpoints of the PyTorch engine: saved every `trainer.checkpoint.interval` steps, resumed automatically.

A run started again with the same run directory (a Slurm requeue, a resubmission, possibly with a larger
`trainer.max_steps`) continues from the newest checkpoint there, and continues exactly: everything a step depends
on is restored.

    model          parameters and persistent buffers (the FP32 master weights; delayed scaling's amax histories)
    optimizer      AdamW moments and step counts
    fp8            FP8 scaling state outside the model's state_dict, by module name (see fp8_state)
    step           the data position: sample i is a pure function of (seed, i) (MicroBatches.get), so the step
                   alone says where the data stream continues
    rng            torch CPU and CUDA, Python `random`, NumPy, for each rank
    config         the config that wrote it, to refuse a checkpoint of a different model (check_compatible)

On disk, under `<run dir>/checkpoints/` (or `trainer.checkpoint.dir`):

    step_00000050/.metadata, __0_0.distcp, __1_0.distcp, ...   model and optimizer (torch.distributed.checkpoint)
    step_00000050/checkpoint.pt                                 step, fp8, rng, config; written last
    step_00000150.tmp-<pid>/            a save that was killed midway: never read, removed by the next save

Model and optimizer go through torch.distributed.checkpoint (DCP) with get_state_dict/set_state_dict: under
FSDP every rank writes its own shards in parallel, nothing is gathered to one process (a full state of Llama 3
70B with its Adam moments would be 1.1 TB on rank 0), and a run may resume on another number of processes
(DCP reshards on load); one process writes the same format. Parameter names are those of the plain model,
whatever wraps it (FSDP, activation checkpointing, compile). Rank 0 alone writes checkpoint.pt (each rank's RNG
state is gathered to it) once every rank's shards are on disk; every rank reads it.

A save writes into the temporary folder (DCP fsyncs its files; checkpoint.pt is fsynced), and renames it to
`step_<N>` (a rename is atomic), so a folder named `step_<N>` is always complete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
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

from recipes.config import Config, ConfigError, to_dict
from recipes.metrics import StepMetrics
from recipes.run_files import CHECKPOINTS, METRICS

FILE = "checkpoint.pt"
_STEP_DIR = re.compile(r"step_(\d+)")

# Settings a resumed run must share with the run that wrote the checkpoint: the model's shape and maths, the
# precision recipe, which samples each step reads. Anything else (max_steps, intervals, compile, ...) may change.
MUST_MATCH = ("model", "precision", "data.kind", "data.path", "trainer.seed", "trainer.global_batch_size")


class CheckpointError(ConfigError):
    """A checkpoint this run cannot continue from; the message says why and what to do."""


@dataclass
class Checkpoint:
    path: Path  # the step_<N> folder
    step: int
    state: dict


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    configured = cfg.trainer.checkpoint.dir
    return run_dir / CHECKPOINTS if configured is None else run_dir / Path(configured).expanduser()


def is_due(cfg: Config, step: int) -> bool:
    interval = cfg.trainer.checkpoint.interval
    return interval > 0 and (step % interval == 0 or step == cfg.trainer.max_steps)


def complete_checkpoints(directory: Path, marker: str = FILE) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `directory`, oldest first; temporary folders are ignored.
    `marker` is the file an engine writes last into a checkpoint folder."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (entry / marker).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


# ---- what a checkpoint holds ----


def fp8_state(model: nn.Module) -> dict[str, Any]:
    """FP8 scaling state kept outside parameters and buffers, by module name.

    Current scaling has none: every scale is computed from the tensor at hand. Delayed scaling keeps an amax
    history and a scale per operand as persistent buffers of each FP8 linear layer (`DelayedScalingState`), so
    they travel in the model's state_dict and need nothing here. This hook is for a recipe whose state cannot be a
    buffer: its modules define `fp8_state_dict()` and `load_fp8_state_dict(state)`. Either way the state must be
    replicated over data-parallel ranks (delayed scaling reduces its amaxes over them), since one copy is saved.
    """
    return {name: m.fp8_state_dict() for name, m in model.named_modules() if hasattr(m, "fp8_state_dict")}


def load_fp8_state(model: nn.Module, state: dict[str, Any]) -> None:
    modules = {name: m for name, m in model.named_modules() if hasattr(m, "load_fp8_state_dict")}
    if set(modules) != set(state):
        raise CheckpointError(
            f"the checkpoint has FP8 scaling state for {sorted(state) or 'no modules'}, this model for "
            f"{sorted(modules) or 'no modules'}"
        )
    for name, module in modules.items():
        module.load_fp8_state_dict(state[name])


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
    the folder on rank 0."""
    rng = [rng_state(device)]
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, rng[0])
        rng = gathered
    temporary = _temporary_dir(directory, step, rank, world_size)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary, no_dist=world_size == 1)
    final = None
    if rank == 0:  # dcp.save returns once every rank's shards and the metadata are written
        state = {"step": step, "fp8": fp8_state(model), "rng": rng, "config": to_dict(cfg)}
        with open(temporary / FILE, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        final = finish_save(directory, step, temporary)
        prune(directory, cfg.trainer.checkpoint.keep_last)
    if world_size > 1:
        dist.barrier()  # nobody runs ahead (and possibly fails) before the checkpoint is on disk
    return final


def _temporary_dir(directory: Path, step: int, rank: int, world_size: int) -> Path:
    """The folder this save writes into, made by rank 0 and named with its process id, the same on every rank."""
    temporary = [start_save(directory, step, tag=str(os.getpid())) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(temporary, src=0)
    return temporary[0]


def start_save(directory: Path, step: int, tag: str) -> Path:
    """An empty temporary folder for step `step`'s checkpoint, never read as a checkpoint (see prune)."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f"step_{step:08d}.tmp-{tag}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    return temporary


def finish_save(directory: Path, step: int, temporary: Path) -> Path:
    """Publish a fully written temporary folder as `step_<N>` with one atomic rename."""
    _fsync_dir(temporary)
    final = directory / f"step_{step:08d}"
    replaced = None
    if final.exists():  # the same step saved again: moved aside (a name that is never read), then replaced
        replaced = directory / f"{final.name}.tmp-replaced-{os.getpid()}"
        os.rename(final, replaced)
    os.rename(temporary, final)
    _fsync_dir(directory)
    if replaced:
        shutil.rmtree(replaced)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: Path, keep_last: int, marker: str = FILE) -> None:
    """Keep the newest `keep_last` checkpoints (all when 0) and remove the leftovers of killed saves."""
    for entry in directory.glob("step_*.tmp-*"):  # one writer per run: any other is a killed save's
        shutil.rmtree(entry, ignore_errors=True)
    complete = complete_checkpoints(directory, marker)
    if keep_last > 0:
        for _, path in complete[:-keep_last]:
            shutil.rmtree(path)


# ---- resuming ----


def load_latest(directory: Path, cfg: Config, device: torch.device) -> Optional[Checkpoint]:
    """The newest complete checkpoint in `directory`, checked against `cfg`; None when there is none."""
    complete = complete_checkpoints(directory)
    if not complete:
        return None
    step, path = complete[-1]
    state = torch.load(path / FILE, map_location=device, weights_only=True)
    check_resumable(state["config"], step, cfg, path)
    return Checkpoint(path, step, state)


def check_resumable(saved: dict, step: int, cfg: Config, path: Path) -> None:
    """Raise CheckpointError when this run cannot continue from the checkpoint of `step` at `path`."""
    check_compatible(saved, cfg, path)
    if step > cfg.trainer.max_steps:
        raise CheckpointError(
            f"cannot resume from {path}: it is at step {step}, past trainer.max_steps={cfg.trainer.max_steps}. "
            f"Set trainer.max_steps >= {step}, or use a new run.dir."
        )


def check_compatible(saved: dict, cfg: Config, path: Path) -> None:
    """Raise CheckpointError when the checkpoint was written with a different model, precision or data order."""
    current = to_dict(cfg)
    differences = [
        f"{name}={before!r} in the checkpoint, {after!r} now"
        for key in MUST_MATCH
        for name, before, after in _walk({key: _get(saved, key)}, {key: _get(current, key)}, "")
    ]
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: this run's config differs from the one that wrote it ("
            + "; ".join(differences)
            + f"). Use a new run.dir for a different run, or delete {path.parent} to start this one over."
        )


def changed_settings(saved: dict, cfg: Config) -> list[str]:
    """Settings that differ from the checkpoint's but may (max_steps, intervals, ...), for the resume message."""
    return [f"{name} {before!r} -> {after!r}" for name, before, after in _walk(saved, to_dict(cfg), "")]


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _walk(before: dict, after: dict, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, before, after) of every leaf that differs."""
    changes = []
    for key in sorted(set(before) | set(after)):
        name = f"{prefix}.{key}" if prefix else key
        b, a = before.get(key), after.get(key)
        if isinstance(b, dict) and isinstance(a, dict):
            changes += _walk(b, a, name)
        elif b != a:
            changes.append((name, b, a))
    return changes


def restore(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model, FP8 state and optimizer from `checkpoint` into this (possibly sharded) model and its optimizer (RNG
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
    load_fp8_state(model, checkpoint.state["fp8"])


def rank_rng(checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
    states = checkpoint.state["rng"]
    return states[rank % len(states)]  # a different world size: data and weights are exact, RNG streams reused


def resume_metrics(run_dir: Path, step: int) -> list[StepMetrics]:
    """Cut `metrics.jsonl` back to the steps <= `step` (a run that crashed after its last checkpoint wrote later
    steps, which the resumed run writes again) and return what is kept. step 0: a run that starts over."""
    path = run_dir / METRICS
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = [(line, _record(line)) for line in lines]
    kept = [(line, record) for line, record in records if record is not None and record["step"] <= step]
    if len(kept) != len(lines):
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line, _ in kept))
        os.replace(temporary, path)
        print(f"{METRICS}: dropped {len(lines) - len(kept)} line(s) after step {step}", flush=True)
    history = [StepMetrics(**record) for _, record in kept]
    if [m.step for m in history] != list(range(1, step + 1)):
        print(f"warning: {path} does not hold exactly steps 1..{step}; summary.json covers those it holds", flush=True)
    return history


def _record(line: str) -> Optional[dict]:
    """A metrics line parsed, its step an int; None for a line torn by a kill in the middle of its write."""
    try:
        record = json.loads(line)
        record["step"] = int(record["step"])
    except (ValueError, KeyError, TypeError):
        return None
    return record
