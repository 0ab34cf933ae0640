"""Fixtures shared by the test modules: the real single-node Slurm that the cluster tests submit to, and Hydra
composition of conf/ in this process."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from recipes.config import CONF_DIR, Config


def missing(message: str) -> None:
    """A real component the test needs is not here: skip, saying so, or fail where it is required (.ci/run sets
    FP8_RECIPES_REQUIRE_SLURM=1 after bringing up the Slurm cluster and installing sshd)."""
    if os.environ.get("FP8_RECIPES_REQUIRE_SLURM") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def cluster() -> None:
    if shutil.which("sbatch") is None:
        missing("no Slurm here (sbatch not on PATH): start one with `sudo scripts/slurm/start.sh`")
    nodes = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], capture_output=True, text=True)
    assert nodes.returncode == 0 and nodes.stdout.split(), f"Slurm does not answer ({nodes.stderr}): scripts/slurm/start.sh"


@pytest.fixture(scope="module")
def hydra_compose():
    """Compose conf/ in this process, as launch/run.py does (many combinations: too many subprocesses)."""
    from hydra import compose, initialize_config_dir

    from recipes.hydra_schema import register_schema, to_config
    from recipes.plan.gpu import resolve

    register_schema()

    def composed(*overrides: str) -> Config:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return resolve(to_config(compose("config", overrides=list(overrides))))

    return composed
