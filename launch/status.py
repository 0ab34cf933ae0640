"""State and logs of runs submitted with `launch/run.py executor=slurm`.

    python launch/status.py RUN_DIR                 # one run
    python launch/status.py SWEEP_DIR               # every run of a sweep (-m), or every run under a folder
    python launch/status.py EXPERIMENT              # a nemo-run experiment by name (the run's or sweep's name)

Lists each job with its Slurm state, restarts and the last step in its metrics, and copies each job's newest
log (after a requeue, the latest restart's) into its run directory as train.log, next to the metrics.jsonl and
summary.json that the job writes there: the run directories are then what scripts/compare.py reads. A job
submitted over SSH (executor.slurm.tunnel=ssh) is read on its login node: Slurm's state, the log, and the
metrics.jsonl and summary.json it wrote on the cluster are copied into the run directory here.
Exit status: 0 every job listed, 1 none found or the login node unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recipes.config import ConfigError
from recipes.run_files import METRICS
from recipes.slurm import JobRecord, cluster_of, find_records, gather, job_state


def last_step(run_dir: Path) -> str:
    metrics = run_dir / METRICS
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return str(json.loads(lines[-1]).get("step", "-")) if lines else "-"


def shown(path: object) -> str:
    """A path on one line: one with a newline or another unprintable character is shown escaped, as Python does."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def report(record: JobRecord, cluster) -> str:
    state, restarts = job_state(record.job_id, cluster)
    log = gather(record, cluster)
    return (f"{record.job_id:>8}  {state:<11} {restarts:>8}  {last_step(Path(record.run_dir)):>9}  "
            f"{shown(record.run_dir)}  {shown(log) if log else '(no log yet)'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a run directory, a folder of run directories, or an experiment name")
    runs = os.environ.get("FP8_RECIPES_RUNS", "runs")
    parser.add_argument("--nemo-run-home", default=f"{runs}/nemo-run",
                        help="executor.nemo_run_home of the runs, to find an experiment by name (default: %(default)s)")
    args = parser.parse_args()
    records = find_records(args.target, Path(args.nemo_run_home).expanduser().resolve())
    if not records:
        print(f"error: no Slurm job found for '{args.target}': give a run directory (it holds slurm_job.json), a "
              f"sweep folder, or an experiment name under {args.nemo_run_home}/experiments", file=sys.stderr)
        return 1
    print(f"experiment {', '.join(sorted({r.experiment for r in records}))}")
    print(f"{'job':>8}  {'state':<11} {'restarts':>8}  {'last step':>9}  run dir  log")
    clusters = {}  # one connection per login node for all the jobs submitted there
    try:
        for record in records:
            where = json.dumps(record.ssh, sort_keys=True)
            if where not in clusters:
                clusters[where] = cluster_of(record)
            print(report(record, clusters[where]), flush=True)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
