"""How many processes a run has, and how they split the model and the data."""

from __future__ import annotations

from recipes.config import Config


def world_size(cfg: Config) -> int:
    return cfg.executor.gpus * cfg.executor.nodes


def model_parallel_size(cfg: Config) -> int:
    """GPUs that hold one copy of the model: tensor x pipeline x context parallel (1 for the torch engine)."""
    return cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp


def data_parallel_size(cfg: Config) -> int:
    return world_size(cfg) // model_parallel_size(cfg)
