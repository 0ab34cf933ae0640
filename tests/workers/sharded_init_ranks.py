"""Run by tests/test_fsdp.py under torchrun with 2 processes (Gloo on CPUs; `cuda` as argument: NCCL, one GPU each,
tests/test_gpu.py): the torch engine's FSDP2 model, built on the meta device, sharded and materialised, holds
exactly the initial values one process builds: every parameter (gathered from the shards), the RoPE tables and
the FP8 state, for a Llama and a Nemotron (LayerNorm1p, partial rotary), BF16 and FP8 delayed scaling with FP8
all-gather. Exits non-zero (an AssertionError) otherwise."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recipes.config import Config, TrainerConfig, load_option
from recipes.engine.fsdp import data_parallel_mesh
from recipes.engine.torch_engine import build_model
from recipes.fp8 import Fp8Training


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    whole = {}
    for name, tensor in named.items():
        if "weight_cache" in name:
            continue  # filled by the first micro-batch, never read before
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local = getattr(tensor, "_tensor", tensor)  # an FP8-all-gathered master weight: its FP32 values
        whole[name.replace("_checkpoint_wrapped_module.", "")] = local.detach().float().clone()
    return whole


def main() -> None:
    on_gpu = sys.argv[1:] == ["cuda"]
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", dist.get_rank()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    mesh = data_parallel_mesh(device, dist.get_world_size())
    for model_name, precision, fp8_all_gather in (("tiny_llama", "bf16", False), ("tiny_nemotron", "fp8_delayed", True)):
        cfg = Config(
            model=load_option("model", model_name),
            precision=dataclasses.replace(load_option("precision", precision), fp8_param_gather=False),
            gpu=load_option("gpu", "cpu"), executor=load_option("executor", "local"), data=load_option("data", "mock"),
            trainer=TrainerConfig(micro_batch_size=1, global_batch_size=4, fsdp_fp8_all_gather=fp8_all_gather),
        )
        one = values(build_model(cfg, device, Fp8Training.for_run(cfg, 1)))
        sharded = values(build_model(cfg, device, Fp8Training.for_run(cfg, dist.get_world_size()), mesh))
        assert one.keys() == sharded.keys(), one.keys() ^ sharded.keys()
        for name in one:
            assert torch.equal(one[name], sharded[name]), f"{model_name}: {name} differs"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
