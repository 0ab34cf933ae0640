"""Hand a planned run to nemo-run: the local machine (LocalExecutor; torchrun for several processes), or a Slurm
cluster (SlurmExecutor, see recipes.slurm: one sbatch job per run, submitted without waiting).

The task is the engine module with one argument, the resolved config file; every other setting travels inside
that file, so no user value is ever spliced into a command line.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from recipes.config import REPO_ROOT, ExecutorName
from recipes.nemo_run_home import cli_commands, use_nemo_run_home
from recipes.plan import Plan, engine_command
from recipes.slurm import TASK, slug
from recipes.trainer.stopping import LAUNCHER_PID, handle_stop_signals


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
    torchrun = plan.processes > 1
    executor = run.LocalExecutor(
        ntasks_per_node=cfg.executor.gpus,
        launcher="torchrun" if torchrun else None,
        env_vars={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                  "LOGLEVEL": "WARNING", "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid())},
    )
    python, _, module, config = engine_command(cfg, config_path)
    task = run.Script(path=module, m=True, entrypoint=python, args=[config])
    title = slug(experiment)
    experiment_run = run.Experiment(title, executor=executor, base_dir=str(home), log_level="WARN",
                                    enable_goodbye_message=False)
    # The handlers outlive the experiment's block, whose end waits for the job.
    with forwarded_signals(torchrun) as received, experiment_run as exp:
        exp.add(task, name=TASK)
        exp.run(sequential=True, tail_logs=True, detach=False)
        if received:  # came while the job was starting
            forward(received[0], torchrun)
    if received:  # the engine said where it stopped and how to resume
        return 128 + received[0]
    print(cli_commands(home, title, exp._id), flush=True)
    status = exp.status(return_dict=True) or {}
    states = {name: str(job.get("status")) for name, job in status.items()}
    failed = {name: state for name, state in states.items() if state != "SUCCEEDED"}
    if failed:
        print(f"error: job(s) did not succeed: {failed}; logs under {exp._exp_dir}", file=sys.stderr)
        return 1
    return 0


@contextmanager
def forwarded_signals(torchrun: bool) -> Iterator[list[int]]:
    """While the job runs, a stop signal to this process (Ctrl-C, kill, a closing terminal) goes on to the engine,
    which nemo-run starts in a session of its own, out of the terminal's reach: the first stops it gracefully after
    the step in progress, a second Ctrl-C abandons the step. This process waits for the job to end. Yields the
    signals received, in order."""
    received: list[int] = []

    def handle(signum: int, frame) -> None:
        received.append(signum)
        forward(signum, torchrun)

    previous = handle_stop_signals(handle)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def forward(signum: int, torchrun: bool) -> None:
    """Send `signum` to the engine processes: this process's child, or with torchrun its workers (a signal to
    torchrun itself ends in its traceback, and so does a worker's non-zero exit: recipes.trainer.entry)."""
    import psutil

    for child in psutil.Process().children():
        try:
            # torchrun itself until it has started its workers: a stop with a traceback beats none
            for process in (child.children() if torchrun else []) or [child]:
                os.kill(process.pid, signum if _catches_stop_signals(process.pid) else signal.SIGTERM)
        except (ProcessLookupError, psutil.NoSuchProcess):  # ended meanwhile
            pass


def _catches_stop_signals(pid: int) -> bool:
    """The engine has installed its stop handlers (recipes.trainer.stopping), which catch SIGTERM, and says which
    signal stopped it. Before that (its imports) a signal is passed on as SIGTERM, which ends it quietly where
    SIGINT would end it in a KeyboardInterrupt traceback. Read from the caught-signal mask in /proc."""
    try:
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
