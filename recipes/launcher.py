"""Hand a planned run to nemo-run: the local machine (LocalExecutor; torchrun for several processes), or a Slurm
cluster (SlurmExecutor, see recipes.slurm: one sbatch job per run, submitted without waiting).

The task is the engine module with one argument, the resolved config file; every other setting travels inside
that file, so no user value is ever spliced into a command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from recipes.config import REPO_ROOT, ExecutorName
from recipes.nemo_run_home import cli_commands, use_nemo_run_home
from recipes.plan import Plan, engine_command
from recipes.slurm import TASK, slug


def launch(plan: Plan, config_path: Path, experiment: str) -> int:
    """Launch (or, for a dry run, only show) the run; return the exit status. `experiment` names the nemo-run
    experiment that groups it: the run's name, or the sweep's for every point of a sweep."""
    cfg = plan.cfg
    # torchrun must come from this interpreter's environment, whatever PATH the user's shell had; on Slurm,
    # sbatch hands the submitting PATH to the job.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if cfg.executor.name == ExecutorName.slurm:
        from recipes.slurm import submit

        return submit(plan, config_path, experiment, dryrun=cfg.dryrun)
    if cfg.dryrun:
        print(f"dry run: nothing launched; the resolved config is {config_path}, and the command above runs it")
        return 0
    return run_local(plan, config_path, experiment)


def run_local(plan: Plan, config_path: Path, experiment: str) -> int:
    """Run the job on this machine through nemo-run, stream its output, and return 0 when it succeeded. Every point
    of a -m sweep goes into the sweep's experiment, as on Slurm."""
    import nemo_run as run  # imported here: planning and dry runs do not need it

    cfg = plan.cfg
    home = use_nemo_run_home(cfg.executor.nemo_run_home)
    executor = run.LocalExecutor(
        ntasks_per_node=cfg.executor.gpus,
        launcher="torchrun" if plan.processes > 1 else None,
        env_vars={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                  "LOGLEVEL": "WARNING", "PYTHONUNBUFFERED": "1"},
    )
    python, _, module, config = engine_command(cfg, config_path)
    task = run.Script(path=module, m=True, entrypoint=python, args=[config])
    title = slug(experiment)
    with run.Experiment(title, executor=executor, base_dir=str(home), log_level="WARN",
                        enable_goodbye_message=False) as exp:
        exp.add(task, name=TASK)
        exp.run(sequential=True, tail_logs=True, detach=False)
    print(cli_commands(home, title, exp._id), flush=True)
    status = exp.status(return_dict=True) or {}
    states = {name: str(job.get("status")) for name, job in status.items()}
    failed = {name: state for name, state in states.items() if state != "SUCCEEDED"}
    if failed:
        print(f"error: job(s) did not succeed: {failed}; logs under {exp._exp_dir}", file=sys.stderr)
        return 1
    return 0
