"""One run per run directory: an exclusive lock on RUN_DIR/trainer.lock, held while a launch writes the directory
and while a trainer runs in it.

The lock is flock(2)'s: the kernel drops it when its holder ends, however it ends, so the lock of a dead trainer
(killed, its machine rebooted) is simply taken over; the file itself stays, naming its last holder. launch/run.py
takes it before it writes anything into the run directory, so of two launches on one run.dir, however close
together, the second is refused before it writes a byte. On this machine the launcher keeps holding it for the
trainer it starts, which finds its launcher named as the holder and trains under that lock (handed over; should
the launcher die, the trainer takes the lock on its way out: recipes.trainer.stopping.watch_launcher). A Slurm job
starts after its launcher has ended: the job takes the lock itself, waiting a little for a submitting launcher
still writing the job's record. In a run of several processes only the logging rank (global rank 0) holds it: it
alone writes metrics.jsonl, summary.json and the file that completes each checkpoint, and the other ranks of a
second run can do nothing without theirs (every step and every save is collective), so a second run stops at its
rank 0. A lock file that cannot name its holder (a full disk) stops the launch or trainer in one line, and is
removed where this one created it: a launch refused on a full disk leaves nothing behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from recipes.config import ConfigError
from recipes.metrics import WriteFailed, write_failure, write_fix
from recipes.run_files import LOCK


class RunDirBusy(ConfigError):
    """Another trainer or launch holds the run directory."""


LAUNCHER = "launcher"  # the lock file's third word while launch/run.py holds it
SUBMISSION_WAIT_S = 60  # a Slurm job waits this long for the launcher that submitted it to let go


def _holder(path: Path) -> Optional[str]:
    """The process the lock file names: its holder, or one that ended without releasing it (empty: released)."""
    text = path.read_text().split() if path.is_file() else []
    return f"PID {text[0]} on {text[1]}" if len(text) >= 2 else None


def _held_by_launcher(path: Path, pid: Optional[str] = None) -> bool:
    """The lock file names a launcher (`pid`: that one, on this machine) as its holder."""
    text = path.read_text().split() if path.is_file() else []
    if len(text) < 3 or text[2] != LAUNCHER:
        return False
    return pid is None or text[:2] == [pid, socket.gethostname()]


HOLDER_WRITE_WAIT_S = 2.0  # a holder names itself just after it takes the lock: how long a refusal waits to read it


def _busy(run_dir: Path) -> RunDirBusy:
    path = run_dir / LOCK
    deadline = time.monotonic() + HOLDER_WRITE_WAIT_S
    while (holder := _holder(path)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    who = "launch" if _held_by_launcher(path) else "trainer"
    if holder is None:
        who, holder = "process", "one that has not named itself"
    return RunDirBusy(f"run dir {run_dir} is in use by a {who} ({holder}): wait for it to end or stop it, or give "
                      "this run another run.dir")


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


class Lock:
    """The run directory's lock as its holder has it: `handed` when the launcher that started this trainer holds it."""

    def __init__(self, fd: int, handed: bool):
        self.fd, self.handed = fd, handed

    def take_over(self) -> None:
        """The handing launcher has ended, and with it its lock: hold it from here to the trainer's end."""
        if self.handed and _try_lock(self.fd):
            self.handed = False
            try:
                _write_holder(self.fd, "")
            except OSError as error:  # held all the same; only the name a refusal shows is missing
                print(f"warning: {LOCK} cannot name this trainer as its holder ({write_failure(error)})",
                      file=sys.stderr, flush=True)


def _write_holder(fd: int, role: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {role}".strip().encode() + b"\n", 0)


def _name_holder(fd: int, path: Path, created: bool, role: str) -> None:
    """The lock file names this process; WriteFailed where it cannot (a full disk: opening it needed no room,
    writing does), the file removed where this process created it."""
    try:
        _write_holder(fd, role)
    except OSError as error:
        if created:
            path.unlink(missing_ok=True)
        raise WriteFailed(f"cannot write {path}: {write_failure(error)}; nothing was started. To run there, "
                          f"{write_fix(error, 'give this run another run.dir')}") from None


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file opened, created where absent, and whether this call created it (only then is it this
    process's to remove)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False


@contextmanager
def locked(run_dir: Path, launcher: bool = False, handed_by: Optional[str] = None) -> Iterator[Lock]:
    """Hold the run directory's lock for the block; RunDirBusy at once if another process holds it. `launcher`:
    taken by launch/run.py (the file says so). `handed_by`: the PID of the launcher that started this trainer,
    whose lock it trains under."""
    path = run_dir / LOCK
    fd, created = _open_lock(path)
    try:
        handed = False
        if not _try_lock(fd):
            handed = handed_by is not None and _held_by_launcher(path, handed_by)
            if not (handed or _waited_for_submission(fd, path)):
                raise _busy(run_dir)
        if not handed:
            previous = _holder(path)
            if previous:
                print(f"{LOCK}: taking over the lock of {previous}, which ended without releasing it", flush=True)
            _name_holder(fd, path, created, LAUNCHER if launcher else "")
        lock = Lock(fd, handed)
        try:
            yield lock
        finally:
            if not lock.handed:
                os.ftruncate(fd, 0)  # released in order (a kill skips this): nobody to take over from
    finally:
        os.close(fd)  # releases the lock


def _waited_for_submission(fd: int, path: Path) -> bool:
    """A Slurm job can start while the launcher that submitted it still writes the job's record: the job waits for
    that launcher (SUBMISSION_WAIT_S at most), and takes the lock once it is free."""
    if "SLURM_JOB_ID" not in os.environ:
        return False
    deadline = time.monotonic() + SUBMISSION_WAIT_S
    while _held_by_launcher(path) and time.monotonic() < deadline:
        time.sleep(0.5)
        if _try_lock(fd):
            return True
    return False


def check_free(run_dir: Path) -> None:
    """RunDirBusy if a trainer or a launch holds the run directory now; creates nothing."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        if not _try_lock(fd):
            raise _busy(run_dir)
    finally:
        os.close(fd)
