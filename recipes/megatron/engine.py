"""The megatron-core engine: train from a resolved config file with tensor, pipeline, context and data parallelism.

    torchrun --nproc-per-node=N -m recipes.megatron.engine RUN_DIR/config.yaml

Reads only the resolved YAML written by `launch/run.py`. The pieces are megatron-core's, put together as
Megatron-LM's pretrain_gpt.py does:

    parallel state        tensor x context x data x pipeline groups (cfg.parallel)      recipes.megatron.build
    model                 GPTModel chunks, Transformer Engine spec (local without TE)   recipes.megatron.build
    data                  GPTDataset / MockGPTDataset via BlendedMegatronDatasetBuilder recipes.megatron.data
    schedule              get_forward_backward_func: no pipelining, 1F1B, interleaved 1F1B
    gradients, optimizer  DistributedDataParallel (or Megatron-FSDP) + the distributed optimizer
    checkpoints           dist_checkpointing, resharded on load                         recipes.megatron.checkpoint
                          in the checkpoint folders both engines share                  recipes.trainer.checkpoints

Its steps run in the loop both engines share (recipes.trainer.loop), so it writes what the torch engine writes:
metrics.jsonl and summary.json (recipes.metrics), plus Megatron's iteration line every log interval, so reports
read both engines alike. Needs CUDA GPUs: megatron-core's rotary
embedding and RNG tracker call torch.cuda unconditionally.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml
from torch.profiler import record_function

from recipes.compute import run_compute_dtype
from recipes.config import Config, ConfigError
from recipes.folders import write_file
from recipes.megatron import parallel_state
from recipes.megatron.build import build, initialize_parallel_state
from recipes.megatron.checkpoint import MegatronCheckpoint
from recipes.megatron.data import MicroBatches, build_train_dataset
from recipes.megatron.translate import ddp_config, optimizer_config, te_precision_config
from recipes.metrics import StepMetrics
from recipes.profiling import OPTIMIZER
from recipes.trainer import checkpoints
from recipes.trainer.console import megatron_iteration_line
from recipes.trainer.entry import engine_main
from recipes.trainer.loop import EngineSteps, train_loop
from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.utils import get_batch_on_this_cp_rank


NONDETERMINISTIC_TE = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"


def _single_process_store() -> dist.Store | None:
    """None under torchrun (the env:// variables it set); for one process started without it (the plan's command on
    one GPU) a local TCP store on a port the OS picks as it binds: megatron-core needs a process group even for one
    process, and a port probed free and bound later can be taken meanwhile by a run started beside this one."""
    if "MASTER_ADDR" in os.environ:
        return None
    return dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    if not torch.cuda.is_available():
        raise ConfigError("engine=megatron needs CUDA GPUs (megatron-core's rotary embedding and RNG tracker call "
                          "torch.cuda); on a CPU use engine=torch")
    if cfg.megatron.deterministic:  # read when TE's attention is built; megatron-core's deterministic_mode checks it
        os.environ[NONDETERMINISTIC_TE] = "0"
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=_single_process_store(), rank=rank, world_size=world_size, device_id=device)
    initialize_parallel_state(cfg)
    # Same weights on data-parallel ranks, own on TP ranks; CUDA graphs need Transformer Engine's graph-safe tracker.
    model_parallel_cuda_manual_seed(cfg.trainer.seed, te_rng_tracker=cfg.megatron.cuda_graphs)
    return rank, world_size, device


def wrap(cfg: Config, config, chunks: list) -> list:
    """Each chunk in DDP (or Megatron-FSDP) with gradient buffers; the schedule's hooks as Megatron-LM sets them:
    gradient reduction deferred to the last micro-batch and overlapped with the backward, parameter all-gather
    overlapped with the next forward."""
    wrapper = FullyShardedDataParallel if cfg.parallel.fsdp else DistributedDataParallel
    ddp = ddp_config(cfg)
    # Only the first chunk buckets its gradients: interleaved chunks reduce whole as they finish (Megatron-LM).
    model = [wrapper(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    # Identical starting weights on every data-parallel rank. Megatron-FSDP's parameters are DTensor shards, which
    # its own broadcast_params hands to c10d's broadcast (megatron-core 0.16.1: "c10d.broadcast_.default does not
    # have a sharding strategy"); the ranks' shared seed (setup_distributed) already makes them equal, which is
    # what Megatron-LM relies on (it broadcasts only under --data-parallel-random-init).
    if not cfg.parallel.fsdp:
        for chunk in model:
            chunk.broadcast_params()
    one = len(model) == 1
    if ddp.overlap_grad_reduce:  # without it finalize_model_grads reduces synchronously, once (Megatron-LM)
        config.no_sync_func = model[0].no_sync if one else [m.no_sync for m in model]
        config.grad_sync_func = model[0].start_grad_sync if one else [m.start_grad_sync for m in model]
    if ddp.align_param_gather:  # the schedule then starts every stage's all-gathers (megatron.align_param_gather)
        config.param_sync_func = model[0].start_param_sync if one else [m.start_param_sync for m in model]
    config.finalize_model_grads_func = finalize_model_grads
    return model


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean cross-entropy over this micro-batch's unmasked tokens; megatron-core's schedule divides by the number
    of micro-batches and multiplies by the context-parallel size."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    # A copy: the schedule divides the returned loss in place, which would scale a view of it too.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(device: torch.device, data_iterator, model):
    batch = {key: value.to(device, non_blocking=True) for key, value in next(data_iterator).items()}
    batch = get_batch_on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def step_loss(losses_reduced: list[dict]) -> torch.Tensor:
    """The step's loss on every rank: mean of the micro-batches' losses on the last pipeline stage, averaged over
    data (and context) parallel ranks, then sent from the last stage down the pipeline."""
    loss = torch.zeros((), device=torch.cuda.current_device())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        loss = torch.stack([x["lm loss"] for x in losses_reduced]).mean()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))  # a sum
        loss /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    dist.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return loss


# precision.modules as megatron-core's per-module precision file, written into the run directory as the record of
# what each linear ran (the model is built from the same dict: recipes.megatron.translate.quant_recipe).
TE_PRECISION_CONFIG = "te_precision_config.yaml"


def train(cfg: Config, run_dir: Path) -> dict:
    rank, world_size, device = setup_distributed(cfg)
    modules = te_precision_config(cfg)
    if modules is not None and rank == 0:
        write_file(run_dir / TE_PRECISION_CONFIG, yaml.safe_dump(modules, sort_keys=False))
    compute = run_compute_dtype(cfg)  # BF16 on GPUs; FP32 on a CPU without native BF16 (tests/megatron_on_cpu.py)
    config, chunks = build(cfg, device, compute)
    model = wrap(cfg, config, chunks)
    optimizer = get_megatron_optimizer(optimizer_config(cfg, compute), model)
    shards = MegatronCheckpoint(model, optimizer)
    start = checkpoints.restore(cfg, run_dir, shards, rank, world_size)

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = MicroBatches(build_train_dataset(cfg, rank), cfg, dp_rank, dp_size)
    num_micro_batches = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * dp_size)
    forward_backward = get_forward_backward_func()

    def train_step(step: int, lr: float) -> tuple[float, float]:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # One iterator per model chunk, each over this step's micro-batches (the interleaved schedule pulls
        # micro-batch m from chunk k's iterator when chunk k runs it).
        iterators = [batches.of_step(step, num_micro_batches) for _ in model]
        losses_reduced = forward_backward(
            forward_step_func=partial(forward_step, device),
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=num_micro_batches,
            seq_length=cfg.model.seq_length // cfg.parallel.cp,
            micro_batch_size=cfg.trainer.micro_batch_size,
            decoder_seq_length=cfg.model.seq_length // cfg.parallel.cp,
            forward_only=False,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        with record_function(OPTIMIZER):  # named in a profile's trace
            _, grad_norm, _ = optimizer.step()  # a non-finite step is applied: the loop stops before checkpointing it
        return step_loss(losses_reduced).item(), float(grad_norm)

    def save_checkpoint(step: int) -> Optional[Path]:
        return checkpoints.save(cfg, run_dir, step, shards, rank, world_size)

    def log(interval: list[StepMetrics], history: list[StepMetrics]) -> None:
        print(megatron_iteration_line(interval, cfg.trainer.max_steps, cfg.trainer.global_batch_size, history),
              flush=True)

    summary = train_loop(cfg, run_dir, EngineSteps(train_step, save_checkpoint, log), start, rank, world_size, device)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    return engine_main("recipes.megatron.engine", train, argv)


if __name__ == "__main__":
    sys.exit(main())
