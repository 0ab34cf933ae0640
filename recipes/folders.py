"""Folders a run writes into, and how it writes there.

Checked before anything is written: each folder can be made and written by this process (launch/run.py for the
run directory, recipes.plan for the others). Written without trusting what is there: a file is created new or
replaces a regular file of the same name in one rename (write_file), or is appended to only when it is a regular
file (open_append); a symbolic link, a FIFO or a folder planted under a run's file name is refused in one line
(UnsafeFile), never written through: a link in a run directory cannot make a run overwrite a file elsewhere.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

from recipes.config import Config, ConfigError, dump_config


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


class UnsafeFile(ConfigError):
    """A run's file name taken by something that is not a regular file (a link, a FIFO, a folder)."""


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device file")


def check_regular_or_absent(path: Path) -> None:
    """UnsafeFile unless `path` is absent or a regular file (not followed: a link is refused, whatever it names)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise UnsafeFile(f"{path} is {_kind(mode)}, not a file this run wrote: a run writes only regular files of "
                         "its own and never through a link; remove it, or give the run another folder")


def write_file(path: Path, data: str | bytes) -> None:
    """`path` holds `data`, whole: written into a new temporary file beside it (created, never opened through a
    link), flushed to disk, then renamed over `path` in one step, so a reader sees the old file or the new one and
    a full disk leaves the old one (the temporary file is removed). UnsafeFile where `path` is not a regular file."""
    path = Path(path)
    check_regular_or_absent(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it 0600; the run's files are as readable as any it writes
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def open_append(path: Path) -> IO[str]:
    """`path` opened to append text, created when absent; UnsafeFile where it is a link or not a regular file
    (O_NOFOLLOW: a link planted after the check is not followed either)."""
    path = Path(path)
    check_regular_or_absent(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENXIO):  # not a link or FIFO planted since the check
            raise
        raise UnsafeFile(f"{path} cannot be opened to append ({error.strerror}): a run writes only regular files of "
                         "its own and never through a link") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFile(f"{path} is {_kind(mode)}, not a file this run wrote: a run writes only regular files of "
                         "its own; remove it, or give the run another folder")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a")


def save_config(cfg: Config, path: Path) -> None:
    """The resolved config as the engine reads it (recipes.config.load_config), written as write_file writes."""
    write_file(path, dump_config(cfg))
