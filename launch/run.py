"""Compose a recipe, check it, plan it, and launch it through nemo-run.

    python launch/run.py model=llama3_70b precision=fp8_current trainer.max_steps=50
    python launch/run.py model=llama3_8b model.num_layers=4 dryrun=true
    python launch/run.py -m precision=bf16,fp8_current
    python launch/run.py executor=slurm gpu=h100 executor.slurm.account=ACCT dryrun=true   # the sbatch script

Groups (conf/): model, precision, gpu, executor, data. `--cfg job` prints the composed config, `--help` the options.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

import hydra
import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from recipes.config import CONF_DIR, Config, ConfigError, save_config
from recipes.hydra_schema import check_override_keys, register_schema, to_config
from recipes.run_files import CONFIG, OVERRIDES
from recipes.trainer.run_lock import check_free


def run_dir(cfg: DictConfig) -> Path:
    """The run's directory: the folder Hydra made for this job, hydra.run.dir (run.dir unless given) for one run,
    hydra.sweep.dir/hydra.sweep.subdir for each point of -m. A run.dir that would be ignored is refused."""
    hydra_cfg = HydraConfig.get()
    directory = Path(hydra_cfg.runtime.output_dir).resolve()
    if hydra_cfg.mode == RunMode.RUN and "run.dir" in overridden_keys(hydra_cfg.overrides.task):
        if directory != Path(cfg.run.dir).resolve():
            raise ConfigError(f"run.dir={cfg.run.dir} and hydra.run.dir={hydra_cfg.run.dir} name two folders; "
                              "give one of them (run.dir)")
    return directory


def overridden_keys(overrides) -> set[str]:
    return {override.split("=", 1)[0].lstrip("+~") for override in overrides}


def check_command_line(argv: list[str]) -> None:
    """Before Hydra composes anything: every override key is in the schema, and run.dir is not given to -m.
    Hydra's own parser tells its flags from the overrides; with -sc (shell completion) the words after it are
    Hydra's completion command (install=bash, query=bash), not overrides."""
    args = get_args_parser().parse_args(argv)
    if args.shell_completion:
        return
    check_override_keys(args.overrides)
    keys = overridden_keys(args.overrides)
    for key in ("run.dir", "hydra.run.dir"):
        if args.multirun and key in keys:
            raise ConfigError(f"{key} with -m: each point gets its own folder under hydra.sweep.dir; give "
                              "hydra.sweep.dir=DIR instead")
    if not args.multirun and "hydra.sweep.dir" in keys:
        raise ConfigError("hydra.sweep.dir is the folder of a -m sweep; one run goes to run.dir=DIR (or add -m)")
    if not (args.cfg or args.help or args.hydra_help or args.info):
        check_output_folder(args.overrides, args.multirun)


def check_output_folder(overrides: list[str], multirun: bool) -> None:
    """The folder a run's files will go to can be made and written: Hydra makes it before anything of ours runs,
    and an existing file or a read-only filesystem there would end in its traceback. The folder is the first given
    of (hydra.sweep.dir with -m | hydra.run.dir, run.dir), run.root, $FP8_RECIPES_RUNS, ./runs; a value with an
    interpolation is left to Hydra."""
    given = dict(override.split("=", 1) for override in overrides if "=" in override and override[0] not in "+~")
    keys = ("hydra.sweep.dir",) if multirun else ("hydra.run.dir", "run.dir")
    key, value = next(((k, given[k]) for k in (*keys, "run.root") if k in given),
                      ("FP8_RECIPES_RUNS", os.environ.get("FP8_RECIPES_RUNS", "runs")))
    if "${" in value:
        return
    folder = Path(value).expanduser().absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={value}: {existing} is a file, not a folder; choose another {key}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))  # os.access says yes to root on /sys
    except OSError as error:
        raise ConfigError(f"{key}={value}: cannot write into {existing} ({error.strerror}); choose a folder on a "
                          "writable filesystem") from None


def save_overrides(hydra_cfg, path: Path) -> None:
    """The command line that made the run, as Hydra's own overrides.yaml holds it (a list of `key=value`), with
    the whole command as a comment above: for a point of -m, the overrides are that point's."""
    command = shlex.join(["python", "launch/run.py", *sys.argv[1:]]).replace("\n", "\\n")
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task)
    path.write_text(f"# {command}\n" + yaml.safe_dump(overrides, default_flow_style=False))


def experiment_name(cfg: Config) -> str:
    """What groups the run in nemo-run: its own name, or for -m the sweep folder's name (one for all points)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir).name
    return cfg.run.name


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    # The plan and the launcher import torch, which takes seconds: --help, --cfg and a command line that Hydra
    # or the schema refuses are answered before that.
    from recipes.launcher import launch
    from recipes.plan import make_plan
    from recipes.plan.describe import describe
    from recipes.plan.gpu import resolve

    directory = Path(HydraConfig.get().runtime.output_dir).resolve()
    config_path = directory / CONFIG
    try:
        dict_cfg.run.dir = str(run_dir(dict_cfg))
        cfg: Config = resolve(to_config(dict_cfg))
        plan = make_plan(cfg, config_path)
        check_free(directory)  # before this run's config replaces that of a run in progress
    except ConfigError as error:
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # Hydra made it before the job ran; a rejected run leaves nothing behind
        sys.exit(f"error: {error}")
    print(describe(plan), flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, dryrun=False), config_path)  # the config as the engine will run it
    save_overrides(HydraConfig.get(), directory / OVERRIDES)
    try:
        status = launch(plan, config_path, experiment_name(cfg))
    except ConfigError as error:
        sys.exit(f"error: {error}")
    if status:
        sys.exit(status)


if __name__ == "__main__":
    register_schema()
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as error:
        sys.exit(f"error: {error}")
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before the launch (after it, recipes.launcher forwards it to the job)
        print("interrupted: nothing was launched", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
