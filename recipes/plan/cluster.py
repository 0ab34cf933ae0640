"""executor=slurm, before anything launches: where the job will find the repository, its Python, its job folder and
its run directory (the Site: this machine's paths, or the login node's with executor.slurm.tunnel=ssh), and every
setting that would make a bad sbatch script or a submission that fails. recipes.slurm submits what passed; only
what needs the login node itself (its checkout and Python, over SSH) is checked there, when it connects.
"""

from __future__ import annotations

import getpass
import os
import posixpath
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from recipes.config import REPO_ROOT, Config, ConfigError, SlurmConfig, SshTunnelConfig, Tunnel

SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9_-]*$")
DEPENDENCY_TYPES = ("after", "afterany", "afterok", "afternotok")


def check_cluster(cfg: Config, run_dir: Path) -> Site:
    """Every check of executor=slurm that needs no connection; the Site the job will run in. The sbatch command and
    the secrets are checked for a submission only (a dry run renders the script anywhere)."""
    nemo_run_home = Path(cfg.executor.nemo_run_home).expanduser().resolve()
    site = job_site(cfg, run_dir, nemo_run_home)
    check_slurm_settings(cfg.executor.slurm, site.job_root, site.run_dir)
    if not cfg.dryrun and site.ssh is None:  # over SSH, sbatch and the secrets are the login node's
        require_sbatch()
        require_secrets(cfg.executor.slurm.secret_env)
    return site


@dataclass
class Site:
    """Where the job finds what it needs on the cluster: this machine (tunnel=local) or the login node's storage."""

    repo: str  # this repository's checkout, imported by the job
    storage: str  # the folder holding the job folders and the run directory (mounted into a container)
    job_root: str  # nemo-run's job folders: <experiment>/<experiment id>/<task>
    run_dir: str
    python: str
    ssh: Optional[SshTunnelConfig] = None  # the login node, when submitting over SSH


def job_site(cfg: Config, run_dir: Path, nemo_run_home: Path) -> Site:
    slurm = cfg.executor.slurm
    ssh = ssh_settings(slurm)
    if ssh is None:
        return Site(str(REPO_ROOT), str(Path(cfg.run.root).resolve()), str(nemo_run_home / "experiments"),
                    str(run_dir), "python" if slurm.container_image else sys.executable)
    check_ssh_settings(ssh)
    return Site(ssh.repo, ssh.job_dir, posixpath.join(ssh.job_dir, "experiments"),
                remote_run_dir(ssh, run_dir, Path(cfg.run.root).resolve()), ssh.python or "python", ssh)


def ssh_settings(slurm: SlurmConfig) -> Optional[SshTunnelConfig]:
    """executor.slurm.ssh when the tunnel is ssh, None for the local tunnel."""
    if slurm.tunnel == Tunnel.local:
        return None
    missing = [f"executor.slurm.ssh.{name}" for name in ("host", "job_dir", "repo") if not getattr(slurm.ssh, name)]
    if missing:
        raise ConfigError(f"executor.slurm.tunnel=ssh needs {', '.join(missing)}: the login node, the job folder "
                          "on the cluster's shared storage and this repository's checkout there (absolute paths)")
    return replace(slurm.ssh, user=slurm.ssh.user or getpass.getuser())


def check_slurm_settings(slurm: SlurmConfig, job_root: Path | str, run_dir: str) -> None:
    """`job_root` and `run_dir` as the sbatch script names them: on the login node when the tunnel is ssh."""
    root_setting = "executor.slurm.ssh.job_dir" if ssh_settings(slurm) else "executor.nemo_run_home"
    bad = [key for key in slurm.env_vars if not ENV_NAME.match(key)]
    if bad:
        raise ConfigError(f"executor.slurm.env_vars: {bad} are not environment variable names ([A-Za-z_][A-Za-z0-9_]*)")
    bad = [name for name in slurm.secret_env if not ENV_NAME.match(name) or name in slurm.env_vars]
    if bad:
        raise ConfigError(f"executor.slurm.secret_env: {bad} must be environment variable names that are not also in "
                          "executor.slurm.env_vars (a secret passes by name; its value stays in your environment)")
    if slurm.dependency is not None and slurm.dependency not in DEPENDENCY_TYPES:
        raise ConfigError(f"executor.slurm.dependency={slurm.dependency!r}; valid values: null, "
                          f"{', '.join(DEPENDENCY_TYPES)}")
    bad = [key for key in slurm.sbatch_args if not SBATCH_OPTION.match(key)]
    if bad:
        raise ConfigError(f"executor.slurm.sbatch_args: {bad} are not sbatch option names (e.g. qos, mail-type)")
    if slurm.container_image is None:  # nemo-run then rewrites every "/nemo_run" in the script to the job folder
        clash = [path for path in (str(job_root), run_dir) if "/nemo_run" in path]
        if clash:
            raise ConfigError(f"{clash[0]!r} contains '/nemo_run', which nemo-run rewrites in the sbatch script of "
                              f"a job without a container; rename that folder ({root_setting}, run.root or run.dir)")
    if not SAFE_PATH.match(str(job_root)):
        raise ConfigError(
            f"{root_setting}: {str(job_root)!r}: nemo-run writes the job folder unquoted into the sbatch script, so "
            f"it may hold only letters, digits and _ . / + -; choose another {root_setting}"
        )


def check_ssh_settings(ssh: SshTunnelConfig) -> None:
    """Before connecting: the remote paths must be absolute (sbatch and sftp do not expand ~ or a relative path)."""
    for name in ("job_dir", "repo"):
        value = getattr(ssh, name)
        if not value.startswith("/"):
            raise ConfigError(f"executor.slurm.ssh.{name}={value!r} must be an absolute path on the cluster")


def remote_run_dir(ssh: SshTunnelConfig, run_dir: Path, run_root: Path) -> str:
    """Where the job keeps the run on the cluster: under ssh.job_dir/runs, as run_dir is under run.root here (its
    name alone when it is elsewhere). The same local run directory maps to the same remote one, so a resubmission
    resumes from the checkpoints there."""
    relative = run_dir.relative_to(run_root) if run_dir.is_relative_to(run_root) else Path(run_dir.name)
    return posixpath.join(ssh.job_dir, "runs", relative.as_posix())


def require_secrets(names: list[str]) -> None:
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise ConfigError(f"executor.slurm.secret_env: {missing} not set here; export them before submitting (the "
                          "job receives them from this environment, by name)")


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError("executor=slurm: sbatch is not on PATH here; submit from a Slurm login node, or use "
                          "dryrun=true to only render the sbatch script (scripts/slurm/start.sh starts a test cluster)")
