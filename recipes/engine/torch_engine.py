"""The PyTorch engine: train a model from a resolved config file.

    python -m recipes.engine.torch_engine RUN_DIR/config.yaml        (or under torchrun for several processes)

Reads only the resolved YAML written by `launch/run.py` (no Hydra, no nemo-run); the run directory is the
folder holding that file, and the metrics are written there. Builds the model from
conf/model, swaps its block linears for FP8 ones as the precision asks (`recipes.fp8.Fp8Training`), trains with
AdamW under BF16 autocast (FP32 on a CPU without native BF16: `trainer.compute_dtype`, recipes.compute) in the
loop both engines share (`recipes.trainer.loop`), and writes `metrics.jsonl` and
`summary.json` into the run directory. Several processes train fully sharded
data-parallel (FSDP2, `recipes.engine.fsdp`; NCCL on GPUs, Gloo on CPUs), each reading its own slice of every
global batch. With `trainer.checkpoint.interval` set it checkpoints as it goes, and a start in a run directory
that holds a checkpoint continues from the newest one: `recipes.trainer.checkpoints`' restore and save, with the
engine's shards (`recipes.engine.checkpoint`).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from recipes.compute import compute_dtype
from recipes.config import Config, GradReduce
from recipes.data.dataset import make_dataset
from recipes.engine.checkpoint import TorchCheckpoint
from recipes.engine.fsdp import data_parallel_mesh, materialize, shard_model
from recipes.engine.training import build_optimizer, checkpoint_blocks, compile_blocks, optimizer_step
from recipes.fp8 import Fp8Training
from recipes.metrics import StepMetrics
from recipes.models.attention import attention_kernel
from recipes.models.transformer import Transformer
from recipes.trainer import checkpoints
from recipes.trainer.console import print_step
from recipes.trainer.entry import engine_main
from recipes.trainer.loop import EngineSteps, train_loop


def setup_distributed() -> tuple[int, int, torch.device]:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


def build_model(cfg: Config, device: torch.device, fp8: Fp8Training, mesh: DeviceMesh | None = None) -> nn.Module:
    """The model of one process, or with `mesh` this process's FSDP2 shards of it (built on the meta device,
    sharded, then materialised: recipes.engine.fsdp.materialize); the same initial weights either way. `fp8`
    converts its blocks' linears."""
    generator = torch.Generator(device).manual_seed(cfg.trainer.seed)
    dtype = compute_dtype(cfg.trainer.compute_dtype, device.type)
    with torch.device("meta" if mesh is not None else device):
        model = Transformer(cfg.model, activation_dtype=dtype, fused_loss=cfg.trainer.fused_loss)
    if mesh is None:
        model.init_weights(generator)
    fp8.convert(model)
    if cfg.trainer.activation_checkpointing:
        checkpoint_blocks(model.layers)
    should_compile = cfg.trainer.compile if cfg.trainer.compile is not None else device.type == "cuda"
    if should_compile:
        compile_blocks(model.layers)
    if mesh is not None:
        fp8.prepare_for_sharding(model)
        shard_model(model, mesh, dtype)
        materialize(model, device, generator)
        fp8.materialized(model)
    return model


class MicroBatches:
    """Reads the micro-batches of this process: rank r takes its slice of every global batch, in order."""

    def __init__(self, cfg: Config, rank: int, world_size: int, device: torch.device):
        self.dataset = make_dataset(cfg.data, cfg.model.seq_length, cfg.model.vocab_size, cfg.trainer.seed)
        self.mbs, self.gbs = cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size
        self.rank, self.world_size, self.device = rank, world_size, device

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (step - 1) * self.gbs + (micro * self.world_size + self.rank) * self.mbs
        rows = torch.stack([torch.from_numpy(self.dataset[first + j]) for j in range(self.mbs)])
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]


def train(cfg: Config, run_dir: Path) -> dict:
    rank, world_size, device = setup_distributed()
    accumulation = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * world_size)
    mesh = data_parallel_mesh(device, world_size) if world_size > 1 else None
    fp8 = Fp8Training.for_run(cfg, world_size, device)
    model = build_model(cfg, device, fp8, mesh)
    optimizer = build_optimizer(model, cfg.trainer, device)
    shards = TorchCheckpoint(model, optimizer, device, rank, world_size)
    start = checkpoints.restore(cfg, run_dir, shards, rank, world_size)
    fp8.weights_changed(model)  # the initial or restored weights
    batches = MicroBatches(cfg, rank, world_size, device)
    dtype = compute_dtype(cfg.trainer.compute_dtype, device.type)
    bf16 = dtype == torch.bfloat16

    def micro_batch_loss(step: int, micro: int) -> torch.Tensor:
        tokens, labels = batches.get(step, micro)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return model(tokens, labels, accumulation)

    def train_step(step: int, lr: float) -> tuple[float, float]:
        loss, grad_norm = optimizer_step(
            partial(micro_batch_loss, step), accumulation, model, fp8, optimizer, lr, cfg.trainer.grad_clip,
            reduce_every_micro_batch=cfg.trainer.grad_reduce == GradReduce.per_micro_batch, step=step,
        )
        if world_size > 1:
            dist.all_reduce(loss)  # a sum: Gloo has no average
            loss /= world_size
        return loss.item(), grad_norm.item()

    def save_checkpoint(step: int) -> Optional[Path]:
        return checkpoints.save(cfg, run_dir, step, shards, rank, world_size)

    def log(interval: list[StepMetrics], history: list[StepMetrics]) -> None:
        print_step(history, cfg.trainer.max_steps, world_size if device.type == "cpu" else 0)

    facts = {"attention": attention_kernel(cfg.model, device, dtype), "fused_loss": cfg.trainer.fused_loss}
    engine = EngineSteps(train_step, save_checkpoint, log, log_first_step=True, facts=facts)
    summary = train_loop(cfg, run_dir, engine, start, rank, world_size, device)
    if world_size > 1:
        dist.barrier()  # every rank waits for rank 0's summary
        dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    return engine_main("recipes.engine.torch_engine", train, argv)


if __name__ == "__main__":
    sys.exit(main())
