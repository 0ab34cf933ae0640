"""Preflight: resolve what the config leaves open (gpu.py), reject what cannot run (checks.py), estimate the
memory (memory.py) and say what will run (describe.py); `make_plan` does all of it, before anything launches.

Everything here happens before launch, so a bad combination fails with a message naming the fix instead of a
stack trace from inside an engine, and a recipe is never silently replaced by another precision.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from recipes.config import Config, Engine
from recipes.metrics import count_parameters
from recipes.plan.memory import MemoryEstimate, estimate_memory
from recipes.plan.parallel import world_size
from recipes.plan.checks import validate

ENGINE_MODULE = {Engine.torch: "recipes.engine.torch_engine", Engine.megatron: "recipes.megatron.engine"}


@dataclass
class Plan:
    cfg: Config
    parameters: int
    memory: MemoryEstimate
    command: list[str]

    @property
    def processes(self) -> int:
        return world_size(self.cfg)


def engine_command(cfg: Config, config_path: Path) -> list[str]:
    module = ENGINE_MODULE[cfg.engine]
    if world_size(cfg) > 1:
        return ["torchrun", f"--nproc-per-node={cfg.executor.gpus}", f"--nnodes={cfg.executor.nodes}", "-m", module, str(config_path)]
    return [sys.executable, "-m", module, str(config_path)]


def make_plan(cfg: Config, config_path: Path) -> Plan:
    validate(cfg)
    parameters = count_parameters(cfg.model)
    return Plan(cfg, parameters, estimate_memory(cfg, parameters), engine_command(cfg, config_path))
