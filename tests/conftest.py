"""Fixtures shared by the test modules: the real single-node Slurm that the cluster tests submit to, Hydra
composition of conf/ in this process, and nemo-run's CLI as a launch tells the user to run it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The CPU tests compare runs bit for bit (a resume against an uninterrupted run). MKL, torch's CPU BLAS, may by
# default run a GEMM on fewer threads while the machine is busy, which sums in another order: once, with the CPUs
# shared, two identical runs' step-1 losses differed in the 7th digit. Set before torch loads MKL.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import torch  # noqa: E402

from recipes.config import CONF_DIR, Config  # noqa: E402

# Without a GPU, recipes.fp8.kernels' Triton kernels run under Triton's CPU interpreter (tests/test_fused_linears.py),
# which must be chosen before anything (torch.compile among others) imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="module")
def megatron_state():
    """A one-process Gloo group and megatron-core's parallel state over it (no GPU)."""
    import torch

    from recipes.megatron import parallel_state

    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)  # binds a free port itself
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


class NemoCli:
    """The nemo-run CLI commands a launch printed (`NEMORUN_HOME=... nemo experiment VERB ARGS`), run as a user's
    shell runs them: NEMORUN_HOME only from the command itself, `nemo` from this interpreter's environment."""

    @staticmethod
    def printed(output: str) -> dict[str, list[str]]:
        commands: dict[str, list[str]] = {}
        for match in re.finditer(r"(NEMORUN_HOME=\S+ nemo experiment (\w+) .+)", output):
            commands.setdefault(match[2], []).append(match[1])
        return commands

    @staticmethod
    def run(command: str) -> str:
        env = {key: value for key, value in os.environ.items() if key != "NEMORUN_HOME"}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in output, f"{command}\n{output}"
        return output


@pytest.fixture(scope="session")
def nemo_cli() -> NemoCli:
    return NemoCli()
