"""The command line both engines share: `python -m <engine module> RUN_DIR/config.yaml`."""

from __future__ import annotations

import errno
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from recipes.config import Config, ConfigError, check_values, load_config
from recipes.metrics import FULL, write_failure, write_fix
from recipes.trainer.run_lock import locked
from recipes.trainer.loop import NonFiniteError
from recipes.trainer.stopping import LAUNCHER_PID, Stopped, stop_signals, stopped_line, watch_launcher


# Errors of a write that say what state the machine is in, never what a bug did: for these the traceback would
# point into whichever library wrote (TensorBoard, the profiler, ...), and the fix is the same wherever it was.
ENVIRONMENT = (*FULL, errno.EFBIG, errno.EROFS, errno.EIO)


def _environment_failure(error: OSError) -> str:
    where = f" ({error.filename})" if error.filename else ""
    return (f"{write_failure(error)}{where}. To go on, {write_fix(error, 'move the run directory to a folder')}; the "
            "same command resumes from the newest checkpoint")


def engine_main(module: str, train: Callable[[Config, Path], dict], argv: list[str] | None = None,
                stops_on_signals: bool = True) -> int:
    """Run `train` on the config file given; the run directory is the file's folder, locked by the logging rank
    while it trains (recipes.trainer.run_lock). Exit status 0 done, 1 stopped (non-finite loss, a refused
    checkpoint or setting, a run directory in use), 2 usage, 128 + N stopped by signal N
    (recipes.trainer.stopping; 0 under torchrun). An engine whose steps run in another trainer than
    recipes.trainer.loop (NeMo's) leaves the signals to it: `stops_on_signals` False. A run's file the machine
    will not take (a full disk, a quota, `ulimit -f`) or a run directory gone is one `error:` line and status 1,
    as a refusal: said where it happens (recipes.metrics, recipes.trainer.checkpoints), or here for any other
    write (ENVIRONMENT)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    config_path = Path(args[0])
    run_dir = config_path.parent
    logging_rank = int(os.environ.get("RANK", 0)) == 0
    try:
        cfg = load_config(config_path)
        check_values(cfg)  # a config.yaml edited by hand, or written by another tool
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    stopping = stop_signals.installed() if stops_on_signals else nullcontext()
    # Started by launch/run.py on this machine: trained under the lock that launcher holds (recipes.trainer.run_lock)
    launcher = os.environ.get(LAUNCHER_PID)
    try:
        with stopping, locked(run_dir, handed_by=launcher) if logging_rank else nullcontext() as lock:
            if stops_on_signals:
                watch_launcher(lock.take_over if lock else lambda: None)
            train(cfg, run_dir=run_dir)
    except Stopped as stopped:
        if logging_rank:
            print(stopped_line(stopped, cfg, run_dir), flush=True)
        # torchrun reports a worker's non-zero exit as a failure, with a traceback; its own exit says it was stopped
        return 0 if "TORCHELASTIC_RUN_ID" in os.environ else 128 + stopped.signum
    except NonFiniteError as error:
        print(f"error: training stopped: {error} (precision={cfg.precision.name})", file=sys.stderr)
        return 1
    except ConfigError as error:  # CheckpointError, SaveFailed, WriteFailed, RunDirGone, UnsafeFile included
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        if error.errno not in ENVIRONMENT:
            raise
        print(f"error: training stopped: {_environment_failure(error)}", file=sys.stderr)
        return 1
    return 0
