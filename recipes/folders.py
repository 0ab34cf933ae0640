"""Folders a run writes into, checked before anything is written: each can be made and written by this process
(launch/run.py for the run directory, recipes.plan for the others)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from recipes.config import ConfigError


def check_writable(key: str, value: str) -> None:
    """ConfigError naming `key` unless the folder `value` names exists or can be made, and can be written: the
    nearest existing folder on its path is a folder, and a file can be made there."""
    if not value.strip():
        raise ConfigError(f"{key} is empty: it would be the folder the launch is started from; give a folder "
                          f"({key.split()[0]}=PATH)")
    folder = Path(value).expanduser().absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={value}: {existing} is a file, not a folder; choose another {key}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))  # os.access says yes to root on /sys
    except OSError as error:
        raise ConfigError(f"{key}={value}: cannot write into {existing} ({error.strerror}); choose a folder on a "
                          f"writable filesystem for {key}") from None
