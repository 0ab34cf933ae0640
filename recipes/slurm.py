"""Slurm through nemo-run's SlurmExecutor: render or submit a planned run's sbatch job, and read jobs back.

nemo-run writes the task command into the sbatch script joined with plain spaces, `env_vars` values as
`export KEY=VALUE`, and every srun argument, all unquoted: every value that comes from the user is shell-quoted
here. The task's only argument is the resolved config file; every other setting travels inside that file. Paths
that nemo-run itself writes unquoted (the job folder of the srun log files) are checked to hold no shell
characters instead, and the values of #SBATCH lines to be in Slurm's grammar (recipes.plan.cluster).

Secrets (`secret_env`) travel by name only: sbatch hands the submitting environment to the job (`--export=ALL`),
pyxis is told to pass them into the container (`--container-env`), and the script checks with `printenv NAME`
(which shows no value, even under nemo-run's `set -x`) that each one arrived. With `dependency` set, each point
of a `-m` sweep waits for the previous point's job (sbatch `--dependency=TYPE:JOBID`).

With `tunnel: ssh` this machine needs no Slurm: nemo-run's SSHTunnel (recipes.ssh) copies the job folder to
`ssh.job_dir/experiments` on the login node and runs sbatch there. The job runs the checkout at `ssh.repo` with
`ssh.python`, reading the resolved config uploaded to its run directory under `ssh.job_dir/runs` and writing its
metrics there; the sbatch script names only those cluster paths (a dry run renders it without connecting).

Each submitted run gets a record, `slurm_job.json`, in its run directory and in its nemo-run experiment folder:
`launch/status.py` reads it to report the job's state and gather its logs (and, over SSH, its metrics) here.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from recipes.config import Config, SshTunnelConfig, dump_config
from recipes.folders import write_file
from recipes.run_files import CONFIG, JOB_RECORD, METRICS, SBATCH_SCRIPT, SLURM_LOG, SUMMARY, TRAIN_LOG, slurm_log_name


if TYPE_CHECKING:  # launch/status.py reads jobs back without importing the planner (and torch)
    from recipes.plan import Plan
    from recipes.plan.cluster import Site

TASK = "train"
# The latest job of each experiment submitted by this process: Hydra's basic launcher runs the points of a -m
# sweep one after another in one process, so this is the previous point's job when `dependency` chains them.
_latest_job: dict[str, str] = {}


@dataclass
class JobRecord:
    experiment: str  # the nemo-run experiment title: the run name, or the sweep's name for every point of a sweep
    experiment_id: str
    job_id: str
    job_name: str
    log_dir: str  # where srun writes log-<job name>_<job id>_<restart>.out (on the login node, over SSH)
    run_dir: str
    ssh: Optional[dict] = None  # executor.slurm.ssh of a job submitted over SSH; None: this machine is the login node
    remote_run_dir: Optional[str] = None  # over SSH: where the job writes metrics.jsonl and summary.json

    def save(self, *folders: Path) -> None:
        for folder in folders:
            write_file(Path(folder) / JOB_RECORD, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "JobRecord":
        return cls(**json.loads(Path(path).read_text()))


def slug(name: str) -> str:
    """A job or experiment name that is safe in file names and unquoted shell words."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"


def _setup_lines(site: Site, secrets: list[str]) -> Optional[str]:
    """Script lines before srun: a Python given by path brings its folder (torchrun is there) onto PATH, and the
    job stops, naming the secret, when one did not reach it (printenv prints no value)."""
    path = posixpath.dirname(site.python)
    lines = [f'export PATH={shlex.quote(path)}:"$PATH"'] if path else []
    lines += [f'printenv {name} >/dev/null || {{ echo "error: secret {name} did not reach the job: export it where '
              f'you submit, and keep sbatch --export=ALL" >&2; exit 1; }}' for name in secrets]
    return "\n".join(lines) or None


def make_executor(plan: Plan, site: Site, job_name_prefix: str, after: Optional[str] = None):
    """nemo-run's SlurmExecutor for the plan; its job folder is under site.job_root, reached through a LocalTunnel
    or over SSH. `after`: the nemo-run handle of a job this one waits for (slurm.dependency)."""
    import nemo_run as run

    cfg = plan.cfg
    slurm = cfg.executor.slurm
    if site.ssh is None:
        tunnel = run.LocalTunnel(job_dir=site.job_root)
    else:
        from recipes.ssh import tunnel as ssh_tunnel

        tunnel = ssh_tunnel(site.ssh, job_dir=site.job_root)
    mounts = list(slurm.container_mounts)
    if slurm.container_image:  # the job imports this repo in place and writes into the run's storage
        folders = [site.repo, site.storage] + ([] if _inside(site.run_dir, site.storage) else [site.run_dir])
        mounts += [f"{folder}:{folder}" for folder in folders]
    env = {"PYTHONPATH": site.repo, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING",
           **slurm.gpu_env.get(cfg.gpu.name, {}), **slurm.env_vars}
    sbatch_args = {**({"export": "ALL"} if slurm.secret_env else {}), **slurm.sbatch_args}
    cpu_bind = [f"--cpu-bind={slurm.cpu_bind}"] if slurm.cpu_bind else []
    # nemo-run 0.11.1 means to shell-quote each srun argument but leaves every one as it is (its `noquote` marker is
    # `str` itself), so each is quoted here: the image, each mount on its own (nemo-run joins them with "," into one
    # shell word) and each srun argument. A nemo-run that quotes them would quote twice (tests/test_shell_values.py).
    srun_args = [f"--mpi={slurm.mpi}", *cpu_bind, *slurm.srun_args]
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
        container_image=shlex.quote(slurm.container_image) if slurm.container_image else None,
        container_mounts=[shlex.quote(mount) for mount in mounts],
        env_vars={key: shlex.quote(str(value)) for key, value in env.items()},
        container_env=list(slurm.secret_env) or None,
        setup_lines=_setup_lines(site, slurm.secret_env),
        srun_args=[shlex.quote(arg) for arg in srun_args],
        additional_parameters={key: _sbatch_value(value) for key, value in sbatch_args.items()} or None,
        dependencies=[after] if after else [],
        dependency_type=slurm.dependency or "afterok",
        launcher="torchrun" if _under_torchrun(plan) else None,
        tunnel=tunnel,
        packager=run.Packager(),  # no copy: the nodes import this repo where it is (shared storage)
        poll_estimated_start_time=False,
        retries=slurm.retries,
    )


def _sbatch_value(value: str) -> str:
    """An sbatch option's value as nemo-run should hand it to its #SBATCH line (which it shell-quotes): sbatch
    reads a backslash there as an escape, inside quotes too, so each is doubled to arrive as itself."""
    return str(value).replace("\\", "\\\\")


def _inside(path: str, folder: str) -> bool:
    return posixpath.commonpath([path, folder]) == folder


def _under_torchrun(plan: Plan) -> bool:
    """Several processes start under nemo-run's torchrun launcher; one runs the engine's command itself."""
    return plan.processes > 1


def _task(plan: Plan, site: Site):
    import nemo_run as run

    from recipes.plan import engine_command

    python, _, module, config = engine_command(plan.cfg, site)
    # nemo-run's torchrun component shell-quotes each of its arguments itself (and starts torchrun, not `python`);
    # without a launcher nemo-run joins the entry point and the arguments with plain spaces.
    argument = config if _under_torchrun(plan) else shlex.quote(config)
    return run.Script(path=module, m=True, entrypoint=shlex.quote(python), args=[argument])


def _prepare_login_node(cfg: Config, site: Site) -> None:
    """Over SSH, before nemo-run submits: the checkout and Python are there, and the run's config is uploaded
    (its run.dir the cluster's). Every failure is a ConfigError naming the setting to fix."""
    from recipes.ssh import check_remote_checkout, tunnel, upload

    session = tunnel(site.ssh, job_dir=site.job_root)
    session.connect()
    try:
        check_remote_checkout(session, site.ssh, None if cfg.executor.slurm.container_image else site.python)
        remote_cfg = replace(cfg, run=replace(cfg.run, dir=site.run_dir), dryrun=False)
        upload(session, dump_config(remote_cfg), posixpath.join(site.run_dir, CONFIG))
    finally:
        session.cleanup()


def submit(plan: Plan, config_path: Path, experiment: str, dryrun: bool) -> int:
    """Render (dryrun) or submit the run's sbatch job, print where everything is, and return without waiting."""
    import nemo_run as run

    from recipes.nemo_run_home import cli_commands, use_nemo_run_home

    cfg = plan.cfg
    nemo_run_home = use_nemo_run_home(cfg.executor.nemo_run_home)  # nemo-run's own job list (.slurm_jobs) too
    run_dir = config_path.parent
    site = plan.site  # checked by the plan (recipes.plan.cluster)
    ssh = site.ssh
    after = _latest_job.get(slug(experiment)) if cfg.executor.slurm.dependency else None
    executor = make_executor(plan, site, job_name_prefix=f"{slug(cfg.run.name)}.", after=after)
    if not dryrun and ssh is not None:  # sbatch runs on the login node, with its environment's secrets
        _prepare_login_node(cfg, site)
    with run.Experiment(slug(experiment), executor=executor, base_dir=str(nemo_run_home), log_level="WARN",
                        enable_goodbye_message=False) as exp:
        exp.add(_task(plan, site), name=TASK)
        if dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            write_file(run_dir / SBATCH_SCRIPT, Path(exp._exp_dir, f"{TASK}_sbatch.sh").read_bytes())
            shutil.rmtree(exp._exp_dir)
            if not any(Path(exp._exp_dir).parent.iterdir()):
                Path(exp._exp_dir).parent.rmdir()
            print(f"{(run_dir / SBATCH_SCRIPT).read_text()}\n"
                  f"dry run: nothing submitted; the sbatch script above is saved as {run_dir / SBATCH_SCRIPT}")
            return 0
        exp.run(detach=True, tail_logs=False)
        job = exp.jobs[0]
        job_id = _job_id(job.handle)
        _latest_job[slug(experiment)] = job.handle
        log_dir = posixpath.join(job.executor.tunnel.job_dir, Path(job.executor.job_dir).name)
        record = JobRecord(slug(experiment), exp._id, job_id, f"{slug(cfg.run.name)}.{TASK}", log_dir, str(run_dir),
                           asdict(ssh) if ssh else None, site.run_dir if ssh else None)
        write_file(run_dir / SBATCH_SCRIPT, Path(exp._exp_dir, f"{TASK}_sbatch.sh").read_bytes())
        record.save(run_dir, Path(exp._exp_dir))
    print(f"submitted   Slurm job {job_id}, experiment {record.experiment_id}\n"
          + (f"after       job {_job_id(after)} ({cfg.executor.slurm.dependency})\n" if after else "")
          + f"logs        {record.log_dir}/{slurm_log_name(record.job_name, job_id, '<restart>')}"
          + (f" on {ssh.host}\nremote run  {site.run_dir} on {ssh.host} (status gathers it here)" if ssh else "")
          + f"\nrun dir     {run_dir}\n"
          f"status      python launch/status.py {shlex.quote(str(run_dir))}\n"
          + cli_commands(nemo_run_home, record.experiment, record.experiment_id), flush=True)
    return 0


def _job_id(handle: str) -> str:
    return str(handle).rstrip("/").rpartition("/")[2]


# ---- reading jobs back ----


class LocalCluster:
    """Slurm's commands and the jobs' files on this machine (the local tunnel: a login node, shared storage)."""

    def run(self, *command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    def listdir(self, folder: str) -> list[str]:
        return os.listdir(folder) if os.path.isdir(folder) else []

    def fetch(self, path: str, local: Path) -> None:
        write_file(local, Path(path).read_bytes())


LOCAL = LocalCluster()


def cluster_of(record: JobRecord):
    """Where the record's job is read back: this machine, or the login node it was submitted to over SSH."""
    if record.ssh is None:
        return LOCAL
    from recipes.ssh import SshCluster

    return SshCluster(SshTunnelConfig(**record.ssh))


def job_state(job_id: str, cluster=LOCAL) -> tuple[str, int]:
    """(state, restarts) of a job: the controller's view (kept MinJobAge after the end), else accounting."""
    shown = cluster.run("scontrol", "show", "job", "-o", job_id)
    fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
    if "JobState" in fields:
        return fields["JobState"], int(fields.get("Restarts", 0))
    lines = cluster.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").split()
    return (lines[0].split()[0] if lines else "UNKNOWN"), 0


def newest_log(record: JobRecord, names: list[str]) -> Optional[str]:
    """Of the file names in the job's log folder, the srun log of its latest start:
    log-<name>_<job id>_<restart>.out with the highest restart."""
    logs = []
    for name in names:
        match = SLURM_LOG.match(name)
        if match and match["job"] == record.job_id and match["stream"] == "out":
            logs.append((int(match["restart"]), name))
    return max(logs)[1] if logs else None


RUN_OUTPUTS = (METRICS, SUMMARY)  # what the job writes into its run directory


def gather(record: JobRecord, cluster=LOCAL) -> Optional[str]:
    """Copy the newest log into the run directory as train.log and, for a job that ran over SSH, the metrics and
    summary it wrote on the cluster; return the log's path (on the cluster)."""
    run_dir = Path(record.run_dir)
    name = newest_log(record, cluster.listdir(record.log_dir))
    log = posixpath.join(record.log_dir, name) if name else None
    if not run_dir.is_dir():
        return log
    if log is not None:
        cluster.fetch(log, run_dir / TRAIN_LOG)
    if record.remote_run_dir:
        present = set(cluster.listdir(record.remote_run_dir))
        for output in RUN_OUTPUTS:
            if output in present:
                cluster.fetch(posixpath.join(record.remote_run_dir, output), run_dir / output)
    return log


def find_records(target: str, nemo_run_home: Path) -> list[JobRecord]:
    """Records of a run directory, of every run under a folder (a sweep), or of a nemo-run experiment name."""
    path = Path(target)
    if path.is_dir():
        files = [path / JOB_RECORD] if (path / JOB_RECORD).is_file() else sorted(path.glob(f"*/{JOB_RECORD}"))
    else:
        files = sorted((nemo_run_home / "experiments" / target).glob(f"*/{JOB_RECORD}"))
    return [JobRecord.load(file) for file in files]
