"""The command line both engines share: `python -m <engine module> RUN_DIR/config.yaml`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from recipes.config import Config, ConfigError, check_values, load_config
from recipes.trainer.loop import NonFiniteError


def engine_main(module: str, train: Callable[[Config, Path], dict], argv: list[str] | None = None) -> int:
    """Run `train` on the config file given; the run directory is the file's folder. Exit status 0 done,
    1 stopped (non-finite loss, a refused checkpoint or setting), 2 usage."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    config_path = Path(args[0])
    try:
        cfg = load_config(config_path)
        check_values(cfg)  # a config.yaml edited by hand, or written by another tool
        train(cfg, run_dir=config_path.parent)
    except NonFiniteError as error:
        print(f"error: training stopped: {error} (precision={cfg.precision.name})", file=sys.stderr)
        return 1
    except ConfigError as error:  # a checkpoint.CheckpointError included
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
