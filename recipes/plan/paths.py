"""The config's paths as the launch resolves them: absolute, so that config.yaml names the same files from any
folder (the engine command the plan prints, a resume started elsewhere).

A relative path is taken from the folder the launch is started in, once, here; what the run directory records is
the result. trainer.checkpoint.dir stays as given: a relative one is the run directory's own (recipes.trainer.
checkpoints.checkpoint_dir), and moves with it. Over SSH the data and the cache are the cluster's: a relative
data.path would name a folder of the job's working directory there, and is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from recipes.config import Config, ConfigError, Tunnel


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with run.root, executor.nemo_run_home, data.path and data.cache_dir absolute (`~` expanded)."""
    over_ssh = cfg.executor.slurm is not None and cfg.executor.slurm.tunnel == Tunnel.ssh
    data = cfg.data
    if data.path is not None and over_ssh and not data.path.startswith("/"):
        raise ConfigError(f"data.path={data.path} is relative: over SSH the job reads it on the cluster, from a folder "
                          "of nemo-run's; give the dataset's absolute path there")
    if not over_ssh:
        data = dataclasses.replace(data, path=_absolute(data.path), cache_dir=_absolute(data.cache_dir))
    return dataclasses.replace(
        cfg, data=data, run=dataclasses.replace(cfg.run, root=_absolute(cfg.run.root)),
        executor=dataclasses.replace(cfg.executor, nemo_run_home=_absolute(cfg.executor.nemo_run_home)))


def _absolute(path: str | None) -> str | None:
    # An empty path stays empty, for the check that names it (recipes.folders.check_writable)
    return str(Path(path).expanduser().absolute()) if path and path.strip() else path
