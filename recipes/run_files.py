"""The names of what a run directory holds: written by launch/run.py, the engines and the Slurm submission, read
back by launch/status.py and the report. Each name is spelled here only.

    config.yaml       the resolved config the engine runs (plain YAML)                    launch/run.py
    overrides.yaml    the command line that made the run (Hydra's overrides)              launch/run.py
    metrics.jsonl     one line per optimizer step                                         recipes.metrics
    summary.json      steady-state medians, the parameter count, provenance               recipes.metrics
    checkpoints/      the default trainer.checkpoint.dir                                  the engines
    trainer.lock      locked while a trainer runs; names its PID and host                 recipes.trainer.run_lock
    profile/          trainer.profile_step's trace and time split                         recipes.profiling
    tensorboard/      every step's metrics as TensorBoard scalars (trainer.tensorboard)   recipes.metrics
    sbatch.sh         the job's sbatch script (executor=slurm)                            recipes.slurm
    slurm_job.json    the submitted job's record                                          recipes.slurm
    train.log         the job's newest Slurm log, gathered by launch/status.py            recipes.slurm
    nemo_recipe.yaml  engine=nemo: NeMo's recipe as the job built it                      recipes.nemo.engine
    nemo/             engine=nemo: NeMo's own logs (its log.explicit_log_dir)             recipes.nemo.mapping
    wandb/            logger.wandb.project: wandb's own files                             recipes.metrics

A folder holding anything else is not a run directory, and no launch writes into it (recipes.plan.run_dir).
"""

from __future__ import annotations

import re

CONFIG = "config.yaml"
OVERRIDES = "overrides.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
LOCK = "trainer.lock"
PROFILE = "profile"
TENSORBOARD = "tensorboard"
SBATCH_SCRIPT = "sbatch.sh"
JOB_RECORD = "slurm_job.json"
TRAIN_LOG = "train.log"
NEMO_RECIPE = "nemo_recipe.yaml"
NEMO_LOGS = "nemo"
WANDB = "wandb"

# What a launch writes before anything runs, all that a dry run leaves: the next launch replaces them.
PLANNED = (CONFIG, OVERRIDES, SBATCH_SCRIPT, LOCK)
# What a run leaves once it has been started: continued from a checkpoint, or moved aside (run.overwrite).
RAN = (METRICS, SUMMARY, CHECKPOINTS, PROFILE, TENSORBOARD, JOB_RECORD, TRAIN_LOG, NEMO_RECIPE, NEMO_LOGS, WANDB)

# nemo-run's srun logs: log-<job name>_<job id>_<restart>.out|.err, one file per start of the job (a requeue
# starts it again); launch/status.py gathers the newest, the report reads them all.
SLURM_LOG = re.compile(r"^log-(?P<name>.+)_(?P<job>\d+)_(?P<restart>\d+)\.(?P<stream>out|err)$")


def slurm_log_stem(job_name: str, job_id: object) -> str:
    """What every log of one job's starts begins with: the name of the run they make up together."""
    return f"log-{job_name}_{job_id}"


def slurm_log_name(job_name: str, job_id: object, restart: object) -> str:
    """The stdout log of one start, as SLURM_LOG reads it (`restart` may be a placeholder such as <restart>)."""
    return f"{slurm_log_stem(job_name, job_id)}_{restart}.out"
