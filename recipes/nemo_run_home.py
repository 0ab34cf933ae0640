"""The one folder where nemo-run keeps its experiments, for every executor (`executor.nemo_run_home`, default
`${run.root}/nemo-run`), and the commands of nemo-run's own CLI that read it.

nemo-run's CLI (`nemo experiment list|status|logs`) looks for experiments under $NEMORUN_HOME, `~/.nemo_run` when
unset: the hint nemo-run prints after a run names no home and fails there, so its goodbye message is switched off
and these commands, with NEMORUN_HOME set, are printed instead.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


def use_nemo_run_home(setting: str) -> Path:
    """Make `setting` nemo-run's home in this process (nemo-run read $NEMORUN_HOME when it was imported) and in
    the processes it starts; return it as an absolute path."""
    from nemo_run.config import set_nemorun_home

    home = Path(setting).expanduser().resolve()
    os.environ["NEMORUN_HOME"] = str(home)
    set_nemorun_home(str(home))
    return home


def cli_commands(home: Path, title: str, experiment_id: str) -> str:
    """Lines for the end of a launch: nemo-run's CLI on this experiment, reading this home."""
    env = f"NEMORUN_HOME={shlex.quote(str(home))}"
    return (f"nemo-run    {env} nemo experiment status {experiment_id}\n"
            f"            {env} nemo experiment logs {experiment_id} 0\n"
            f"            {env} nemo experiment list {title}")
