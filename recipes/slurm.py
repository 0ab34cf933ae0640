"""Slurm through nemo-run's SlurmExecutor: render or submit a planned run's sbatch job, and read jobs back.

nemo-run writes the task command into the sbatch script joined with plain spaces, and `env_vars` values as
`export KEY=VALUE`, both unquoted: every value that comes from the user is shell-quoted here. The task's only
argument is the resolved config file; every other setting travels inside that file. Paths that nemo-run itself
writes unquoted (the job folder of the srun log files) are checked to hold no shell characters instead.

Secrets (`secret_env`) travel by name only: sbatch hands the submitting environment to the job (`--export=ALL`),
pyxis is told to pass them into the container (`--container-env`), and the script checks with `printenv NAME`
(which shows no value, even under nemo-run's `set -x`) that each one arrived. With `dependency` set, each point
of a `-m` sweep waits for the previous point's job (sbatch `--dependency=TYPE:JOBID`).

Each submitted run gets a record, `slurm_job.json`, in its run directory and in its nemo-run experiment folder:
`launch/status.py` reads it to report the job's state and gather its logs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from recipes.config import REPO_ROOT, ConfigError, SlurmConfig


if TYPE_CHECKING:  # launch/status.py reads jobs back without importing the planner (and torch)
    from recipes.plan import Plan

JOB_RECORD = "slurm_job.json"
TASK = "train"
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9_-]*$")
DEPENDENCY_TYPES = ("after", "afterany", "afterok", "afternotok")
# The latest job of each experiment submitted by this process: Hydra's basic launcher runs the points of a -m
# sweep one after another in one process, so this is the previous point's job when `dependency` chains them.
_latest_job: dict[str, str] = {}


@dataclass
class JobRecord:
    experiment: str  # the nemo-run experiment title: the run name, or the sweep's name for every point of a sweep
    experiment_id: str
    job_id: str
    job_name: str
    log_dir: str  # where srun writes log-<job name>_<job id>_<restart>.out
    run_dir: str

    def save(self, *folders: Path) -> None:
        for folder in folders:
            (Path(folder) / JOB_RECORD).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "JobRecord":
        return cls(**json.loads(Path(path).read_text()))


def slug(name: str) -> str:
    """A job or experiment name that is safe in file names and unquoted shell words."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"


def check_slurm_settings(slurm: SlurmConfig, nemo_run_home: Path, run_dir: str) -> None:
    if slurm.tunnel not in ("local", "ssh"):
        raise ConfigError(f"executor.slurm.tunnel={slurm.tunnel!r}; valid values: local, ssh")
    if slurm.tunnel == "ssh" and slurm.ssh is None:
        raise ConfigError("executor.slurm.tunnel=ssh needs executor.slurm.ssh={host: ..., user: ..., job_dir: ...}")
    if slurm.tunnel == "ssh":
        raise ConfigError("executor.slurm.tunnel=ssh: submission over SSH is not implemented yet; run launch/run.py "
                          "on the cluster's login node with executor.slurm.tunnel=local")
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
        clash = [path for path in (str(nemo_run_home), run_dir) if "/nemo_run" in path]
        if clash:
            raise ConfigError(f"{clash[0]!r} contains '/nemo_run', which nemo-run rewrites in the sbatch script of "
                              "a job without a container; rename that folder (executor.nemo_run_home, run.root or "
                              "run.dir)")
    if not SAFE_PATH.match(str(nemo_run_home)):
        raise ConfigError(
            f"executor.nemo_run_home={str(nemo_run_home)!r}: nemo-run writes the job folder unquoted into the sbatch "
            "script, so it may hold only letters, digits and _ . / + -; choose another executor.nemo_run_home"
        )


def _secret_checks(names: list[str]) -> Optional[str]:
    """Script lines that stop the job, naming the secret, when one did not reach it (printenv prints no value)."""
    return "\n".join(f'printenv {name} >/dev/null || {{ echo "error: secret {name} did not reach the job: export it '
                     f'where you submit, and keep sbatch --export=ALL" >&2; exit 1; }}' for name in names) or None


def make_executor(plan: Plan, nemo_run_home: Path, job_name_prefix: str, after: Optional[str] = None):
    """nemo-run's SlurmExecutor for the plan; the job folder is under nemo_run_home/experiments (LocalTunnel).
    `after`: the nemo-run handle of a job this one waits for (slurm.dependency)."""
    import nemo_run as run

    cfg = plan.cfg
    slurm = cfg.executor.slurm
    check_slurm_settings(slurm, nemo_run_home, cfg.run.dir)
    mounts = list(slurm.container_mounts)
    if slurm.container_image:  # the job imports this repo in place and writes into the run root
        mounts += [f"{REPO_ROOT}:{REPO_ROOT}", f"{Path(cfg.run.root).resolve()}:{Path(cfg.run.root).resolve()}"]
    env = {"PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING",
           **slurm.gpu_env.get(cfg.gpu.name, {}), **slurm.env_vars}
    sbatch_args = {**({"export": "ALL"} if slurm.secret_env else {}), **slurm.sbatch_args}
    cpu_bind = [f"--cpu-bind={slurm.cpu_bind}"] if slurm.cpu_bind else []
    return run.SlurmExecutor(
        account=slurm.account,
        partition=slurm.partition,
        job_name_prefix=job_name_prefix,
        time=slurm.time,
        nodes=cfg.executor.nodes,
        ntasks_per_node=cfg.executor.gpus,
        gpus_per_node=cfg.executor.gpus if cfg.gpu.arch != "cpu" else None,
        mem=slurm.mem,
        exclusive=slurm.exclusive or None,
        container_image=slurm.container_image,
        container_mounts=mounts,
        env_vars={key: shlex.quote(str(value)) for key, value in env.items()},
        container_env=list(slurm.secret_env) or None,
        setup_lines=_secret_checks(slurm.secret_env),
        srun_args=[f"--mpi={slurm.mpi}", *cpu_bind, *slurm.srun_args],
        additional_parameters=sbatch_args or None,
        dependencies=[after] if after else [],
        dependency_type=slurm.dependency or "afterok",
        launcher="torchrun" if plan.processes > 1 else None,
        tunnel=run.LocalTunnel(job_dir=str(nemo_run_home / "experiments")),
        packager=run.Packager(),  # no copy: the nodes import this repo where it is (shared storage)
        poll_estimated_start_time=False,
        retries=slurm.retries,
    )


def _task(plan: Plan, config_path: Path):
    import nemo_run as run

    from recipes.plan import ENGINE_MODULE

    python = "python" if plan.cfg.executor.slurm.container_image else sys.executable
    return run.Script(path=ENGINE_MODULE[plan.cfg.engine], m=True, entrypoint=python,
                      args=[shlex.quote(str(config_path))])


def submit(plan: Plan, config_path: Path, experiment: str, dryrun: bool) -> int:
    """Render (dryrun) or submit the run's sbatch job, print where everything is, and return without waiting."""
    import nemo_run as run

    cfg = plan.cfg
    nemo_run_home = Path(cfg.executor.nemo_run_home).expanduser().resolve()
    os.environ["NEMORUN_HOME"] = str(nemo_run_home)  # nemo-run's own job list (.slurm_jobs) lives there
    run_dir = config_path.parent
    if not dryrun:
        _require_sbatch()
        require_secrets(cfg.executor.slurm.secret_env)
    after = _latest_job.get(slug(experiment)) if cfg.executor.slurm.dependency else None
    executor = make_executor(plan, nemo_run_home, job_name_prefix=f"{slug(cfg.run.name)}.", after=after)
    with run.Experiment(slug(experiment), executor=executor, base_dir=str(nemo_run_home), log_level="WARN") as exp:
        exp.add(_task(plan, config_path), name=TASK)
        if dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            script = Path(exp._exp_dir, f"{TASK}_sbatch.sh")
            shutil.copy(script, run_dir / "sbatch.sh")
            shutil.rmtree(exp._exp_dir)
            if not any(Path(exp._exp_dir).parent.iterdir()):
                Path(exp._exp_dir).parent.rmdir()
            print(f"{(run_dir / 'sbatch.sh').read_text()}\n"
                  f"dry run: nothing submitted; the sbatch script above is saved as {run_dir / 'sbatch.sh'}")
            return 0
        exp.run(detach=True, tail_logs=False)
        job = exp.jobs[0]
        job_id = _job_id(job.handle)
        _latest_job[slug(experiment)] = job.handle
        record = JobRecord(slug(experiment), exp._id, job_id, f"{slug(cfg.run.name)}.{TASK}",
                           str(Path(job.executor.job_dir)), str(run_dir))
        shutil.copy(Path(exp._exp_dir, f"{TASK}_sbatch.sh"), run_dir / "sbatch.sh")
        record.save(run_dir, Path(exp._exp_dir))
    print(f"submitted   Slurm job {job_id}, experiment {record.experiment_id}\n"
          + (f"after       job {_job_id(after)} ({cfg.executor.slurm.dependency})\n" if after else "")
          + f"logs        {record.log_dir}/log-{record.job_name}_{job_id}_<restart>.out\n"
          f"run dir     {run_dir}\n"
          f"status      python launch/status.py {shlex.quote(str(run_dir))}", flush=True)
    return 0


def _job_id(handle: str) -> str:
    return str(handle).rstrip("/").rpartition("/")[2]


def require_secrets(names: list[str]) -> None:
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise ConfigError(f"executor.slurm.secret_env: {missing} not set here; export them before submitting (the "
                          "job receives them from this environment, by name)")


def _require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError("executor=slurm: sbatch is not on PATH here; submit from a Slurm login node, or use "
                          "dryrun=true to only render the sbatch script (scripts/slurm/start.sh starts a test cluster)")


# ---- reading jobs back ----


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def job_state(job_id: str) -> tuple[str, int]:
    """(state, restarts) of a job: the controller's view (kept MinJobAge after the end), else accounting."""
    fields = dict(item.split("=", 1) for item in _run("scontrol", "show", "job", "-o", job_id).split() if "=" in item)
    if "JobState" in fields:
        return fields["JobState"], int(fields.get("Restarts", 0))
    lines = _run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").split()
    return (lines[0].split()[0] if lines else "UNKNOWN"), 0


# nemo-run's srun logs: log-<job name>_<job id>_<restart>.out|.err (scripts/compare.py reads them too).
SLURM_LOG = re.compile(r"^log-(?P<name>.+)_(?P<job>\d+)_(?P<restart>\d+)\.(?P<stream>out|err)$")


def newest_log(record: JobRecord) -> Optional[Path]:
    """The srun log of the job's latest start: log-<name>_<job id>_<restart>.out with the highest restart."""
    logs = []
    for path in Path(record.log_dir).glob(f"log-*_{record.job_id}_*.out"):
        match = SLURM_LOG.match(path.name)
        if match and match["job"] == record.job_id and match["stream"] == "out":
            logs.append((int(match["restart"]), path))
    return max(logs)[1] if logs else None


def gather(record: JobRecord) -> Optional[Path]:
    """Copy the newest log into the run directory as train.log (metrics.jsonl is written there by the job)."""
    log = newest_log(record)
    if log is not None and Path(record.run_dir).is_dir():
        shutil.copy(log, Path(record.run_dir) / "train.log")
    return log


def find_records(target: str, nemo_run_home: Path) -> list[JobRecord]:
    """Records of a run directory, of every run under a folder (a sweep), or of a nemo-run experiment name."""
    path = Path(target)
    if path.is_dir():
        files = [path / JOB_RECORD] if (path / JOB_RECORD).is_file() else sorted(path.glob(f"*/{JOB_RECORD}"))
    else:
        files = sorted((nemo_run_home / "experiments" / target).glob(f"*/{JOB_RECORD}"))
    return [JobRecord.load(file) for file in files]
