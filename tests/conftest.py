"""Fixtures shared by the test modules: the real single-node Slurm that the cluster tests submit to."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


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
