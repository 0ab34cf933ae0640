"""What the config leaves to launch time: the GPU of gpu=auto."""

from __future__ import annotations

import dataclasses

import torch

from recipes.config import Config, ConfigError, ExecutorName, load_option

# Substrings of torch.cuda.get_device_name() -> conf/gpu option; "gb200" before "b200" (it contains it).
KNOWN_GPUS = (("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"))


def detect_gpu() -> str:
    """The conf/gpu option of the local device: cpu without CUDA; an unknown GPU is an error, not a guess."""
    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name()
    for token, option in KNOWN_GPUS:
        if token in device_name.lower():
            return option
    raise ConfigError(
        f"gpu=auto found '{device_name}', which has no file in conf/gpu; pass gpu=<one of "
        f"{', '.join(option for _, option in KNOWN_GPUS)}, cpu> or add conf/gpu/<name>.yaml with its peaks"
    )


def resolve(cfg: Config) -> Config:
    """Fill in what is decided at launch: the detected GPU for gpu=auto."""
    if cfg.gpu.name == "auto" and cfg.executor.name == ExecutorName.slurm:
        raise ConfigError("executor=slurm: name the cluster's GPU (gpu=h100, h200, b200, gb200 or cpu); gpu=auto "
                          "would detect this machine's device, not the compute nodes'")
    if cfg.gpu.name == "auto":
        cfg = dataclasses.replace(cfg, gpu=load_option("gpu", detect_gpu()))
    return cfg
