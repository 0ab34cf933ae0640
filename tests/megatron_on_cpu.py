"""Test-only: run recipes.megatron.engine on CPUs (Gloo) by pointing megatron-core's CUDA calls at the CPU.

    torchrun --nproc-per-node=N tests/megatron_on_cpu.py RUN_DIR/config.yaml

megatron-core 0.16 cannot run without CUDA: its rotary embedding moves frequencies to torch.cuda.current_device(),
its optimizer allocates on device="cuda" and checks parameters' type() strings for "torch.cuda.", and its layers
use the CUDA RNG tracker, and its pipeline communication synchronizes CUDA. This module stubs exactly those, and replaces the engine's NCCL setup with Gloo, so that
the engine's own code (schedules, DDP + distributed optimizer, data, checkpoint save/resume, metrics) runs
unchanged on a CPU in the test suite. It is not a way to train: nothing here is imported by the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda") or isinstance(device, int):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Tensors asked for on CUDA are made on the CPU; a CPU tensor's type() reads as its CUDA twin's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu(args[1]), *args[2:])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class NoRngTracker:
    """The CUDA RNG tracker forks states for dropout and initialization; the tests use neither on the device."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


class NoStream:
    """CUDA streams and events (Megatron-FSDP's overlapped gathers and reductions): on the CPU every op is ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: NoStream()  # record_event's event, which is waited on; query() is truthy


def install() -> None:
    torch.cuda.Stream = torch.cuda.Event = NoStream
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *args, **kwargs: NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0  # an index: CudaToCpu maps it to the CPU
    torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None  # after pipeline sends and receives
    CudaToCpu().__enter__()
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core.tensor_parallel import random

    random.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: NoRngTracker()
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    premultiplied = param_and_grad_buffer.gradient_reduce_preprocessing

    def scaled_then_summed(grad_data, scaling_factor, ddp_config):
        """Gloo has no PREMUL_SUM: Megatron-FSDP's own path without the fused division."""
        return premultiplied(grad_data, scaling_factor, dataclasses.replace(ddp_config, gradient_reduce_div_fusion=False))

    param_and_grad_buffer.gradient_reduce_preprocessing = scaled_then_summed

    import recipes.megatron.engine as engine

    fsdp_init = engine.FullyShardedDataParallel.__init__

    def fsdp_on_cpu(self, *args, **kwargs):
        """Megatron-FSDP's buffers on its own device (it allocates some in backward hooks, outside CudaToCpu)."""
        fsdp_init(self, *args, **kwargs, device=torch.device("cpu"))

    engine.FullyShardedDataParallel.__init__ = fsdp_on_cpu

    def setup_distributed(cfg):
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        engine.initialize_parallel_state(cfg)
        torch.manual_seed(cfg.trainer.seed)
        return rank, world_size, torch.device("cpu")

    engine.setup_distributed = setup_distributed


if __name__ == "__main__":
    install()
    from recipes.megatron.engine import main

    sys.exit(main(sys.argv[1:]))
