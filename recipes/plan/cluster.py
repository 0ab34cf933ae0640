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

# Every pattern is used with fullmatch: `$` would also match before a final newline.
SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SBATCH_OPTION = re.compile(r"[a-z][a-z0-9_-]*")
DEPENDENCY_TYPES = ("after", "afterany", "afterok", "afternotok")

# What Slurm accepts for the #SBATCH values it names, ASCII only: sbatch reads a directive up to the end of its
# line, so a value outside these grammars is refused rather than quoted (a quoted newline still ends the line, and
# the script's shell then runs the rest). A name never starts with "-".
NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
SBATCH_GRAMMAR = {
    "account": (re.compile(NAME), "an account name of letters, digits and _ . - (e.g. my_acct-01)"),
    "partition": (re.compile(rf"{NAME}(,{NAME})*"),
                  "partition names of letters, digits and _ . -, comma-separated (e.g. gpu,gpu-long)"),
    "qos": (re.compile(NAME), "a QOS name of letters, digits and _ . - (e.g. high)"),
    "time": (re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|(?i:unlimited|infinite)"),
             "a time limit as MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED (e.g. 04:00:00)"),
    "mem": (re.compile(r"[0-9]+[KMGTkmgt]?"), "megabytes, or a size with a K, M, G or T suffix (e.g. 200G; 0: all)"),
}
# Any other sbatch option's value is free-form: nemo-run shell-quotes it and sbatch reads those quotes back (its
# backslashes are doubled by recipes.slurm), but no quoting keeps a line break or another control character inside
# one #SBATCH line.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What ssh and rsync take before the host and as the host: nemo-run's rsync builds one shell string of user@host,
# and ssh reads a destination that starts with "-" as an option (-oProxyCommand=... runs a command here).
SSH_GRAMMAR = {
    "user": (re.compile(NAME), "a user name of letters, digits and _ . -"),
    "host": (re.compile(rf"{NAME}|[0-9A-Fa-f]*:[0-9A-Fa-f.:]*:[0-9A-Fa-f.:]*"),
             "a host name or address of letters, digits and _ . -, or an IPv6 address"),
}


def check_cluster(cfg: Config, run_dir: Path) -> Site:
    """Every check of executor=slurm that needs no connection; the Site the job will run in. The sbatch command and
    the secrets are checked for a submission only (a dry run renders the script anywhere)."""
    nemo_run_home = Path(cfg.executor.nemo_run_home).expanduser().resolve()
    site = job_site(cfg, run_dir, nemo_run_home)
    check_slurm_settings(cfg.executor.slurm, site.job_root, site.run_dir)
    if cfg.executor.slurm.container_image:
        check_mounted_folders(site)
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
    check_ssh_settings(ssh, nemo_run_home)
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
    bad = [key for key in slurm.env_vars if not ENV_NAME.fullmatch(key)]
    if bad:
        raise ConfigError(f"executor.slurm.env_vars: {bad} are not environment variable names ([A-Za-z_][A-Za-z0-9_]*)")
    bad = [name for name in slurm.secret_env if not ENV_NAME.fullmatch(name) or name in slurm.env_vars]
    if bad:
        raise ConfigError(f"executor.slurm.secret_env: {bad} must be environment variable names that are not also in "
                          "executor.slurm.env_vars (a secret passes by name; its value stays in your environment)")
    if slurm.dependency is not None and slurm.dependency not in DEPENDENCY_TYPES:
        raise ConfigError(f"executor.slurm.dependency={slurm.dependency!r}; valid values: null, "
                          f"{', '.join(DEPENDENCY_TYPES)}")
    bad = [key for key in slurm.sbatch_args if not SBATCH_OPTION.fullmatch(key)]
    if bad:
        raise ConfigError(f"executor.slurm.sbatch_args: {bad} are not sbatch option names (e.g. qos, mail-type)")
    check_sbatch_values(slurm)
    if slurm.container_image is None:  # nemo-run then rewrites every "/nemo_run" in the script to the job folder
        clash = [path for path in (str(job_root), run_dir) if "/nemo_run" in path]
        if clash:
            raise ConfigError(f"{clash[0]!r} contains '/nemo_run', which nemo-run rewrites in the sbatch script of "
                              f"a job without a container; rename that folder ({root_setting}, run.root or run.dir)")
    if not SAFE_PATH.fullmatch(str(job_root)):
        raise ConfigError(
            f"{root_setting}: {str(job_root)!r}: nemo-run writes the job folder unquoted into the sbatch script, so "
            f"it may hold only letters, digits and _ . / + -; choose another {root_setting}"
        )


def check_sbatch_values(slurm: SlurmConfig) -> None:
    """Each value that becomes an #SBATCH line: in Slurm's grammar for its option, or free of control characters."""
    named = {"account": slurm.account, "partition": slurm.partition, "time": slurm.time, "mem": slurm.mem}
    values = [(f"executor.slurm.{option}", option, value) for option, value in named.items() if value is not None]
    values += [(f"executor.slurm.sbatch_args.{key}", key.replace("_", "-"), value)
               for key, value in slurm.sbatch_args.items()]
    for setting, option, value in values:
        value = str(value)
        if option in SBATCH_GRAMMAR:
            grammar, what = SBATCH_GRAMMAR[option]
            if not grammar.fullmatch(value):
                raise ConfigError(f"{setting}={value!r}: Slurm takes {what}")
        elif CONTROL.search(value):
            raise ConfigError(f"{setting}={value!r} holds a line break or another control character: sbatch would "
                              "end its #SBATCH line there and the job's shell would run the rest; remove it")


def check_mounted_folders(site: Site) -> None:
    """The folders the project mounts into the job's container as SRC:DST (recipes.slurm.make_executor): pyxis splits
    --container-mounts at "," and ":", so a folder holding either would be mounted as other folders."""
    for setting, folder in (("the checkout (executor.slurm.ssh.repo)", site.repo), ("run.root", site.storage),
                            ("run.dir", site.run_dir)):
        if "," in folder or ":" in folder:
            raise ConfigError(f"{setting}: {folder!r} holds ',' or ':', at which pyxis splits --container-mounts; "
                              "move it to a folder without them, or run without a container "
                              "(executor.slurm.container_image=null)")


def check_ssh_settings(ssh: SshTunnelConfig, nemo_run_home: Path) -> None:
    """Before connecting: the remote paths must be absolute (sbatch and sftp do not expand ~ or a relative path),
    and what nemo-run's upload writes unquoted into its rsync and mkdir commands (user, host, key file, this
    machine's experiment folder; the job folder is checked with the sbatch script's paths) are single words."""
    for name in ("job_dir", "repo"):
        value = getattr(ssh, name)
        if not value.startswith("/"):
            raise ConfigError(f"executor.slurm.ssh.{name}={value!r} must be an absolute path on the cluster")
    for name, (grammar, what) in SSH_GRAMMAR.items():
        value = getattr(ssh, name)
        if not grammar.fullmatch(value):
            raise ConfigError(f"executor.slurm.ssh.{name}={value!r}: ssh and rsync take {what}, not starting with -")
    paths = {"executor.nemo_run_home": str(nemo_run_home)}
    if ssh.identity:
        paths["executor.slurm.ssh.identity"] = str(Path(ssh.identity).expanduser())
    for setting, path in paths.items():
        if not SAFE_PATH.fullmatch(path):
            raise ConfigError(f"{setting}: {path!r}: over SSH nemo-run's upload writes it unquoted into an rsync "
                              f"command, so it may hold only letters, digits and _ . / + -; choose another {setting}")


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
