"""Compose a recipe, check it, plan it, and launch it through nemo-run.

    python launch/run.py model=llama3_70b precision=fp8_current trainer.max_steps=50
    python launch/run.py model=llama3_8b model.num_layers=4 dryrun=true
    python launch/run.py -m precision=bf16,fp8_current
    python launch/run.py executor=slurm gpu=h100 executor.slurm.account=ACCT dryrun=true   # the sbatch script

Groups (conf/): model, precision, gpu, executor, data. `--cfg job` prints the composed config, `--help` the options.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from recipes.config import CONF_DIR, Config, ConfigError, save_config
from recipes.hydra_schema import check_override_keys, register_schema, to_config
from recipes.launcher import launch
from recipes.plan import make_plan
from recipes.plan.describe import describe
from recipes.plan.gpu import resolve
from recipes.run_files import CONFIG



def run_dir(cfg: DictConfig) -> Path:
    """The run's directory: run.dir for a single run; one folder per job under the sweep dir for -m."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir, hydra_cfg.sweep.subdir).resolve()
    return Path(cfg.run.dir).resolve()


def experiment_name(cfg: Config) -> str:
    """What groups the run in nemo-run: its own name, or for -m the sweep folder's name (one for all points)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir).name
    return cfg.run.name


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    directory = run_dir(dict_cfg)
    dict_cfg.run.dir = str(directory)
    config_path = directory / CONFIG
    try:
        cfg: Config = resolve(to_config(dict_cfg))
        plan = make_plan(cfg, config_path)
    except ConfigError as error:
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # Hydra made it before the job ran; a rejected run leaves nothing behind
        sys.exit(f"error: {error}")
    print(describe(plan), flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, dryrun=False), config_path)  # the config as the engine will run it
    try:
        status = launch(plan, config_path, experiment_name(cfg))
    except ConfigError as error:
        sys.exit(f"error: {error}")
    if status:
        sys.exit(status)


if __name__ == "__main__":
    register_schema()
    try:
        check_override_keys([arg for arg in sys.argv[1:] if not arg.startswith("-") and "=" in arg])
    except ConfigError as error:
        sys.exit(f"error: {error}")
    main()
