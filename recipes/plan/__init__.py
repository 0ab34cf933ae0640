"""Preflight: resolve what the config leaves open (gpu.py), reject what cannot run (checks.py; for executor=slurm
cluster.py too), estimate the memory (memory.py) and say what will run (describe.py). launch/run.py resolves, then
`make_plan` does the rest, before anything launches.

Everything here happens before launch, so a bad combination fails with a message naming the fix instead of a
stack trace from inside an engine, and a recipe is never silently replaced by another precision.
"""

from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from recipes.config import Config, Engine, ExecutorName
from recipes.metrics import count_parameters
from recipes.plan.checks import check_host_memory, validate
from recipes.plan.cluster import Site, check_cluster
from recipes.plan.memory import MemoryEstimate, estimate_memory
from recipes.plan.parallel import world_size
from recipes.run_files import CONFIG
from recipes.trainer.checkpoints import check_before_launch, check_owner, checkpoint_dir

ENGINE_MODULE = {Engine.torch: "recipes.engine.torch_engine", Engine.megatron: "recipes.megatron.engine",
                 Engine.nemo: "recipes.nemo.engine"}


@dataclass
class Plan:
    cfg: Config
    parameters: int
    memory: MemoryEstimate
    command: list[str]  # launch_command
    site: Optional[Site] = None  # executor=slurm: where the job runs (recipes.plan.cluster)
    resumes: bool = False  # the run directory holds a checkpoint the run continues from

    @property
    def processes(self) -> int:
        return world_size(self.cfg)


def engine_command(cfg: Config, where: Path | Site) -> list[str]:
    """`python -m <engine module> CONFIG`, what every process of the run executes: nemo-run's task, on this machine
    (recipes.launcher) and in the sbatch script (recipes.slurm), and what the plan prints (launch_command). `where`
    is the config file for this machine's Python, or the Site of an executor=slurm job: its Python and its run
    directory's config, which over SSH or in a container are not this machine's."""
    if isinstance(where, Site):
        return [where.python, "-m", ENGINE_MODULE[cfg.engine], posixpath.join(where.run_dir, CONFIG)]
    return [sys.executable, "-m", ENGINE_MODULE[cfg.engine], str(where)]


def launch_command(cfg: Config, config_path: Path, site: Optional[Site] = None) -> list[str]:
    """engine_command as a shell would start the run: under torchrun for several processes, as nemo-run does."""
    python, *module_and_config = engine_command(cfg, site or config_path)
    if world_size(cfg) == 1:
        return [python, *module_and_config]
    return ["torchrun", f"--nproc-per-node={cfg.executor.gpus}", f"--nnodes={cfg.executor.nodes}", *module_and_config]


def _checkpoint_marker(engine: Engine) -> Optional[str]:
    """The file that holds an engine's checkpoint config (None: engine=nemo keeps NeMo's own checkpoints)."""
    if engine == Engine.torch:
        from recipes.engine.checkpoint import FILE

        return FILE
    if engine == Engine.megatron:
        from recipes.megatron.checkpoint import MARKER

        return MARKER
    return None


def make_plan(cfg: Config, config_path: Path) -> Plan:
    """Every check, Slurm's and SSH's included, then what will run: raises ConfigError before anything launches."""
    validate(cfg)
    check_owner(checkpoint_dir(cfg, config_path.parent), config_path.parent)  # another run's: refused, overwrite or not
    resumes = not cfg.run.overwrite and _resumes(cfg, config_path.parent)
    site = check_cluster(cfg, config_path.parent) if cfg.executor.name == ExecutorName.slurm else None
    parameters = count_parameters(cfg.model)
    memory = estimate_memory(cfg, parameters)
    check_host_memory(cfg, memory.total, world_size(cfg))
    return Plan(cfg, parameters, memory, launch_command(cfg, config_path, site), site, resumes)


def _resumes(cfg: Config, run_dir: Path) -> bool:
    """The run continues from a checkpoint in `run_dir`; CheckpointError, before the launcher overwrites the run
    directory's config.yaml, for one it could not continue from. engine=nemo's NeMo resumes from any it finds."""
    marker = _checkpoint_marker(cfg.engine)
    if marker is None:
        folder = checkpoint_dir(cfg, run_dir)
        return folder.is_dir() and any(folder.iterdir())
    return check_before_launch(cfg, run_dir, marker) is not None
