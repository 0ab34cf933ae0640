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
from pathlib import Path

import hydra
import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from recipes.config import CONF_DIR, REQUIRED_GROUPS, Config, ConfigError
from recipes.hydra_schema import check_override_keys, register_schema, to_config
from recipes.folders import check_writable, save_config, write_file
from recipes.run_files import CONFIG, LOCK, OVERRIDES
from recipes.trainer.run_lock import check_free, locked


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
    for override in args.overrides:
        if override.startswith("~") and override.lstrip("~").split("=")[0] in REQUIRED_GROUPS:
            group = override.lstrip("~").split("=")[0]
            raise ConfigError(f"{override} deletes the {group} group, which every run needs: choose one of its "
                              f"options instead ({group}=OPTION; --help lists them)")
    for key in ("run.dir", "hydra.run.dir"):
        if args.multirun and key in keys:
            raise ConfigError(f"{key} with -m: each point gets its own folder under hydra.sweep.dir; give "
                              "hydra.sweep.dir=DIR instead")
    if not args.multirun and "hydra.sweep.dir" in keys:
        raise ConfigError("hydra.sweep.dir is the folder of a -m sweep; one run goes to run.dir=DIR (or add -m)")
    if "hydra.job.chdir" in keys:
        raise ConfigError("hydra.job.chdir: the launch stays in the folder it is started from, which relative paths "
                          "(run.root, data.path, executor.nemo_run_home) are taken from; inside the run directory "
                          "they would name the run's own folder. Leave it unset (false)")
    if not (args.cfg or args.help or args.hydra_help or args.info):
        plan_every_point(args.overrides, args.multirun)


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
    check_writable(key, value)


def save_overrides(hydra_cfg, path: Path) -> None:
    """The command line that made the run, as Hydra's own overrides.yaml holds it (a list of `key=value`), with
    the whole command as a comment above: for a point of -m, the overrides are that point's."""
    command = shlex.join(["python", "launch/run.py", *sys.argv[1:]]).replace("\n", "\\n")
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task)
    write_file(path, f"# {command}\n" + yaml.safe_dump(overrides, default_flow_style=False))


def experiment_name(cfg: Config) -> str:
    """What groups the run in nemo-run: its own name, or for -m the sweep folder's name (one for all points)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir).name
    return cfg.run.name


def plan_point(dict_cfg: DictConfig, directory: Path):
    """One run (or -m point) composed, resolved and planned for `directory`, its run directory: every check that
    needs no lock, the run directory's own included (recipes.plan.run_dir). Raises ConfigError."""
    from recipes.plan import make_plan
    from recipes.plan.gpu import resolve
    from recipes.plan.paths import absolute_paths
    from recipes.plan.run_dir import check_run_dir, check_run_dir_given

    check_run_dir_given(dict_cfg.run.dir)
    dict_cfg.run.dir = str(directory)
    cfg: Config = absolute_paths(resolve(to_config(dict_cfg)))
    plan = make_plan(cfg, directory / CONFIG)
    check_free(directory)  # a run in progress is said to be so, whatever its folder holds
    check_run_dir(cfg, directory, plan.resumes)
    return plan


def plan_every_point(overrides: list[str], multirun: bool) -> None:
    """Before Hydra runs anything: the run, or with -m every point, composed and planned, its run directory's
    checks included, so that a value Hydra or OmegaConf cannot compose or resolve is refused in one line, and a
    point that cannot run before any other trains. Each point's folder is the one Hydra will give it
    (hydra.run.dir; with -m hydra.sweep.dir/hydra.sweep.subdir; a ${now:...} in it may resolve a second apart).
    Every point is composed before the first is planned: a refusal at composition needs no torch. A sweep that
    Hydra's basic sweeper expands to no value (interval(), which only a search sweeper samples; glob() of a key
    that is no config group; an empty range) is refused naming what does expand."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def refused(number: int, point: list[str], error: Exception) -> ConfigError:
        where = f"-m point {number} ({' '.join(point)}): " if multirun else ""
        what = "cannot resolve the config: " if isinstance(error, OmegaConfBaseException) else ""
        return ConfigError(where + what + one_line(error) + ("; no point was run" if multirun else ""))

    def no_values(override) -> ConfigError:
        key = override.get_key_element()
        why = {
            "INTERVAL_SWEEP": "interval() is a continuous range, which only a search sweeper (Optuna, Ax) samples",
            "GLOB_CHOICE_SWEEP": f"glob() picks among a config group's options (model=glob(tiny_*)), and {key} is no "
                                 "group or none of its options match",
        }.get(override.value_type.name, "the range or list is empty")
        return ConfigError(f"{override.input_line}: -m has no value of {key} to run: {why}; list the values: "
                           f"-m {key}=a,b,c, {key}=range(start,stop,step) or {key}=choice(a,b,c)")

    composed = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # Hydra's config loader lets glob() list a group's options (model=glob(tiny_*)), as in Hydra's own sweep.
        parsed = OverridesParser.create(GlobalHydra.instance().config_loader()).parse_overrides(overrides)
        for override in parsed:
            if override.is_sweep_override() and not (override.is_discrete_sweep()
                                                     and any(True for _ in override.sweep_string_iterator())):
                raise no_values(override)
        (points,) = BasicSweeper.split_arguments(parsed, None)
        for number, point in enumerate(points):
            try:
                cfg = compose("config", overrides=[*point, f"hydra.job.num={number}"], return_hydra_config=True)
                sweep = Path(cfg.hydra.sweep.dir).absolute() if multirun else None
                folder = Path(sweep, cfg.hydra.sweep.subdir) if multirun else Path(cfg.hydra.run.dir).absolute()
            except (HydraException, OmegaConfBaseException) as error:
                raise refused(number, point, error) from None
            with open_dict(cfg):
                del cfg["hydra"]
            composed.append((cfg, sweep, folder))
    check_output_folder(overrides, multirun)
    from recipes.plan.run_dir import check_outside_source  # imports the plan, and torch: after composition

    for number, (point, (cfg, sweep, folder)) in enumerate(zip(points, composed)):
        try:
            if sweep:  # where Hydra writes the sweep's multirun.yaml
                check_outside_source(sweep, "hydra.sweep.dir")
            plan_point(cfg, folder)
        except (OmegaConfBaseException, ConfigError) as error:
            raise refused(number, point, error) from None


def one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's messages in one line, the errors behind them included (Hydra's "Error merging
    override" says what is wrong only in its cause), without OmegaConf's lines about its own types."""
    lines = []
    while error is not None:
        lines += [line.strip() for line in str(error).split("Config search path:")[0].splitlines()]
        error = error.__cause__
    return "; ".join(line for line in lines if line and not line.startswith(("object_type=", "reference_type=")))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    # The plan and the launcher import torch, which takes seconds: --help, --cfg and a command line that Hydra
    # or the schema refuses are answered before that.
    directory = Path(HydraConfig.get().runtime.output_dir).resolve()
    made = not directory.is_dir() or not any(directory.iterdir())  # by Hydra, before the job ran (or empty)
    try:
        plan = plan_point(dict_cfg, run_dir(dict_cfg))
        status = launch_under_lock(plan, directory)
    except ConfigError as error:
        if made and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # a rejected run leaves nothing behind
        sys.exit(f"error: {error}")
    if status:
        sys.exit(status)


def launch_under_lock(plan, directory: Path) -> int:
    """Holding the run directory's lock, which the trainer this launch starts trains under
    (recipes.trainer.run_lock): the run directory checked again, now that no other launch can change it, an old
    run set aside (run.overwrite), the plan shown, the config and command line written, the run launched."""
    from recipes.launcher import launch
    from recipes.plan.describe import describe
    from recipes.plan.run_dir import check_run_dir, holds_run, set_aside
    from recipes.trainer.checkpoints import checkpoint_dir

    cfg, config_path, lock_was_there = plan.cfg, directory / CONFIG, (directory / LOCK).exists()
    with locked(directory, launcher=True):
        try:
            check_run_dir(cfg, directory, plan.resumes)
        except ConfigError:
            if not lock_was_there:
                (directory / LOCK).unlink()
            raise
        if cfg.run.overwrite and holds_run(directory):
            print(f"run.overwrite=true: the run that was in {directory} is now in {set_aside(directory)}")
        checkpoints = checkpoint_dir(cfg, directory)
        if cfg.run.overwrite and directory not in checkpoints.parents and holds_run(checkpoints):
            # elsewhere (trainer.checkpoint.dir), the old run's checkpoints would be continued from
            print(f"run.overwrite=true: its checkpoints in {checkpoints} are now in {set_aside(checkpoints)}")
        print(describe(plan), flush=True)
        save_config(dataclasses.replace(cfg, dryrun=False), config_path)  # the config as the engine will run it
        save_overrides(HydraConfig.get(), directory / OVERRIDES)
        return launch(plan, config_path, experiment_name(cfg))


if __name__ == "__main__":

    class ReaderGone(BaseException):
        """stdout's reader has exited (`| head -3`). Not an Exception: Hydra reports any Exception of the job as a
        failure, with its traceback; this one passes through Hydra to the quiet exit below."""

    class Stdout:
        """sys.stdout, a BrokenPipeError on it raised as ReaderGone once the stream points at /dev/null (Python's
        recipe, "Note on SIGPIPE"), so that the flush at exit has nowhere to fail."""

        def __init__(self, stream):
            self.stream = stream

        def __getattr__(self, name):
            return getattr(self.stream, name)

        def write(self, text: str) -> int:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self.gone()

        def flush(self) -> None:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.gone()

        def gone(self):
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            raise ReaderGone from None

    # Line-buffered: each line fails where it is printed, if its reader is gone, never in the flush at exit.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stdout = Stdout(sys.stdout)
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
    except ReaderGone:  # 128 + SIGPIPE, as a shell reports a command that SIGPIPE ended; 1 would say the run failed
        sys.exit(128 + signal.SIGPIPE)
