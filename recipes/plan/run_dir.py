"""A run directory is its run's alone: what a launch may write there, checked before anything is written.

    a new or empty folder, or one a dry run left (recipes.run_files.PLANNED)   the run starts there
    a folder holding a run (recipes.run_files.RAN)                            continued from its checkpoint; without
                                                                              one refused, or with run.overwrite=true
                                                                              moved aside first (set_aside), never
                                                                              deleted; a dry run there is refused
    a folder holding anything else or a link, the checkout or a folder of     refused
    its source, an empty run.dir

The plan checks it (check_run_dir); the launcher checks again once it holds the run directory's lock, when no other
launch can change the folder, and only then sets an old run aside and writes its own files.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from recipes.config import REPO_ROOT, Config, ConfigError, DataKind, ExecutorName
from recipes.run_files import LOCK, PLANNED, RAN

# The checkout's folders that hold the project itself: a run's files there would become part of it (a config.yaml
# in conf/ is the launcher's own entry config).
SOURCE_FOLDERS = (".ci", ".git", "conf", "docs", "launch", "recipes", "scripts", "tests")
NEW_FOLDER = "give a new folder (run.dir=runs/NAME)"
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
RUN_NAME_EXAMPLE = re.compile(r"[^A-Za-z0-9._-]+", re.ASCII)  # what a suggested name leaves out


def check_run_dir(cfg: Config, run_dir: Path, resumable: bool) -> None:
    """ConfigError unless this launch may write into `run_dir`; `resumable`: it holds a checkpoint this run
    continues from (recipes.trainer.checkpoints.check_before_launch)."""
    if not RUN_NAME.fullmatch(cfg.run.name):
        raise ConfigError(f"run.name={cfg.run.name!r}: a run's name names its folder, its nemo-run experiment and its "
                          "Slurm job, and may hold only ASCII letters, digits, '.', '_' and '-' (a letter or digit "
                          f"first); e.g. run.name={RUN_NAME_EXAMPLE.sub('_', cfg.run.name).strip('._-') or 'my_run'}")
    check_outside_source(run_dir, "run.dir")
    if run_dir.is_dir():
        _check_entries(cfg, run_dir, resumable)
    shared = [("executor.nemo_run_home", cfg.executor.nemo_run_home)]
    if cfg.executor.name == ExecutorName.local and cfg.data.kind == DataKind.indexed and cfg.data.path is None:
        shared.append(("data.cache_dir", cfg.data.cache_dir))
    for key, folder in shared:  # shared by every run: in a run directory they would be entries no run writes
        path = Path(folder).expanduser().absolute()
        if path == run_dir.absolute() or run_dir.absolute() in path.parents:
            raise ConfigError(f"{key}={folder} is inside the run directory {run_dir}, which holds only the run's own "
                              f"files; give {key} a folder outside it (it is shared by every run)")


def _check_entries(cfg: Config, run_dir: Path, resumable: bool) -> None:
    entries = sorted(entry.name for entry in run_dir.iterdir())
    foreign = [name for name in entries if not _is_run_file(name, cfg)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ConfigError(f"run.dir={run_dir} holds files that are not a run's ({shown}): a launch writes only into a "
                          f"folder of its own; {NEW_FOLDER}")
    links = [name for name in entries if (run_dir / name).is_symlink()]
    if links:
        raise ConfigError(f"run.dir={run_dir} holds symbolic links ({', '.join(links)}): a run writes only its own "
                          "regular files, never through a link (a folder elsewhere is trainer.checkpoint.dir's); "
                          f"remove them, or {NEW_FOLDER}")
    ran = [name for name in entries if name not in PLANNED]
    if ran and cfg.dryrun:
        raise ConfigError(f"dryrun=true: run.dir={run_dir} holds a run ({', '.join(ran)}), whose config.yaml and "
                          "overrides.yaml record how it was made and would be replaced; give the dry run a new folder "
                          "(run.dir=runs/NAME) to see the plan")
    if ran and not resumable and not cfg.run.overwrite:
        raise ConfigError(f"run.dir={run_dir} holds a run ({', '.join(ran)}) with no checkpoint this run can "
                          f"continue from; {NEW_FOLDER}, or set run.overwrite=true to move that run aside (into "
                          f"{run_dir.name}.replaced-<time>) and start this one there")


def check_run_dir_given(value: str) -> None:
    """run.dir as given, before it is made absolute: an empty one would be the folder the launch started in."""
    if not value.strip():
        raise ConfigError(f"run.dir is empty: it would be the folder the launch is started from; {NEW_FOLDER}")


def check_outside_source(folder: Path, key: str) -> None:
    """Not the checkout itself or a folder above it, and nothing inside its source folders: for every folder a run
    writes (`key` names its setting): the run directory, a -m sweep's folder (Hydra's multirun.yaml), checkpoints,
    nemo-run's home, the corpus cache."""
    folder = Path(folder).expanduser().absolute()
    fix = NEW_FOLDER if key == "run.dir" else f"give {key} a folder outside it"
    if folder == REPO_ROOT or folder in REPO_ROOT.parents:
        raise ConfigError(f"{key}={folder} holds this checkout ({REPO_ROOT}): {fix}")
    if REPO_ROOT in folder.parents and folder.relative_to(REPO_ROOT).parts[0] in SOURCE_FOLDERS:
        raise ConfigError(f"{key}={folder} is inside this checkout's source folder "
                          f"{folder.relative_to(REPO_ROOT).parts[0]}/: {fix}")


def _is_run_file(name: str, cfg: Config) -> bool:
    """A name a run directory holds, a file being replaced beside it (metrics.jsonl.tmp) included; the first part
    of a relative trainer.checkpoint.dir too."""
    checkpoint_dir = cfg.trainer.checkpoint.dir
    names = (*PLANNED, *RAN, *([Path(checkpoint_dir).parts[0]] if checkpoint_dir and
                                 not Path(checkpoint_dir).expanduser().is_absolute() else []))
    return any(name == known or name.startswith(f"{known}.") for known in names)


def holds_run(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(entry.name not in PLANNED for entry in run_dir.iterdir())


def set_aside(run_dir: Path) -> Path:
    """run.overwrite=true: the run in `run_dir` moved into a folder beside it (its lock file stays: the launcher
    holds it), so that nothing of it is lost and nothing of it mixes with the new run. Returns that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    suffix = 1
    while aside.exists():
        aside, suffix = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{suffix}"), suffix + 1
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK:
            os.rename(entry, aside / entry.name)
    return aside
