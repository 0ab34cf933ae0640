"""One trainer per run directory: the trainer holds an exclusive lock on RUN_DIR/trainer.lock while it runs.

The lock is flock(2)'s: the kernel drops it when its holder ends, however it ends, so the lock of a dead trainer
(killed, its machine rebooted) is simply taken over; the file itself stays, naming its last holder. In a run of
several processes only the logging rank (global rank 0) holds it: it alone writes metrics.jsonl, summary.json and
the file that completes each checkpoint, and the other ranks of a second run can do nothing without theirs
(every step and every save is collective), so a second run stops at its rank 0. The launcher checks the lock
before it writes the run's config (check_free), so a second launch does not touch a run in progress.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from recipes.config import ConfigError
from recipes.run_files import LOCK


class RunDirBusy(ConfigError):
    """Another trainer holds the run directory."""


def _holder(path: Path) -> Optional[str]:
    """The process the lock file names: its holder, or one that ended without releasing it (empty: released)."""
    text = path.read_text().split() if path.is_file() else []
    return f"PID {text[0]} on {text[1]}" if len(text) >= 2 else None


def _busy(run_dir: Path) -> RunDirBusy:
    holder = _holder(run_dir / LOCK) or "starting up"
    return RunDirBusy(f"run dir {run_dir} is in use by a trainer ({holder}): wait for it to end or stop it, "
                      "or give this run another run.dir")


def _try_lock(fd: int) -> bool:
    """Take the lock without waiting; False when another process holds it. A filesystem without locks (a Lustre
    mounted without `flock`) gets no lock, and a warning."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        print(f"warning: cannot lock {LOCK} ({error.strerror}): nothing stops a second trainer in this run dir",
              file=sys.stderr, flush=True)
    return True


@contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock for the block; RunDirBusy at once if another trainer holds it."""
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            raise _busy(run_dir)
        previous = _holder(path)
        if previous:
            print(f"{LOCK}: taking over the lock of {previous}, which ended without releasing it", flush=True)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released in order (a kill skips this): nobody to take over from
    finally:
        os.close(fd)  # releases the lock


def check_free(run_dir: Path) -> None:
    """RunDirBusy if a trainer holds the run directory now; creates nothing."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        if not _try_lock(fd):
            raise _busy(run_dir)
    finally:
        os.close(fd)
