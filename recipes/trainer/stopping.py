"""How a training process stops when asked to: Ctrl-C, `kill`, a closing terminal, Slurm's preemption or requeue
(SIGTERM, then SIGKILL after the cluster's grace period), or the death of the launcher that started it.

    before the loop    a signal stops the engine at once: nothing it wrote is worth keeping
    in the loop        the step in progress finishes; every rank agrees to stop after it (an all-reduce of the
                       signal each step, as Megatron-LM's DistributedSignalHandler all-gathers it); the step's
                       checkpoint is written if checkpointing is on; the engine exits 128 + the signal's number
                       with one line saying where the run resumes
    a second Ctrl-C    abandons the step in progress at once. A repeated SIGTERM does not: Slurm sends one to the
                       task and one through srun, and sends SIGKILL when it stops waiting
    during a save      a signal is only noted, a second Ctrl-C included (a line says so): the checkpoint being
                       written is finished and published (a save that fails removes its temporary folder), then
                       the run stops as in the loop. Abandoned midway, the save would leave a half-written folder,
                       and the run would resume from an older step than the one it stopped after

The launcher on this machine (recipes.launcher.run_local) forwards its signals to the engine, which nemo-run starts
in a session of its own (the terminal's Ctrl-C does not reach it). Should the launcher die without forwarding
(SIGKILL, a crash), the engine notices through a pidfd of the launcher's process, named by FP8_RECIPES_LAUNCHER_PID,
and stops as on SIGTERM. A parent-death signal (prctl PR_SET_PDEATHSIG) cannot do this: it fires when the parent
*thread* ends, and nemo-run starts the job from a worker thread that ends right after the launch.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from recipes.config import Config
from recipes.trainer.checkpoints import checkpoint_dir

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCHER_PID = "FP8_RECIPES_LAUNCHER_PID"  # set by recipes.launcher for the engine processes it starts


class Stopped(Exception):
    """The run stopped on a signal. `step`: the last step done (None: before the loop, or the step abandoned);
    `checkpoint`: the checkpoint the run resumes from, written on the way out or earlier (None: it starts over)."""

    def __init__(self, signum: int, step: Optional[int] = None, checkpoint: Optional[Path] = None,
                 abandoned: Optional[int] = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint, self.abandoned = signum, step, checkpoint, abandoned


class StopSignals:
    """The process's stop signals: raise at once outside the loop (`graceful` False), noted inside it."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.graceful = False
        self.step_in_progress: Optional[int] = None
        self.in_save = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers, for the block (an engine may run inside another program: the tests)."""
        self.received = None
        previous = handle_stop_signals(self._handle)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        first = self.received is None
        self.received = self.received or signum
        if self.in_save:
            if not first and signum == signal.SIGINT:
                # os.write to stderr's descriptor, not print: the handler may run in the middle of a print
                os.write(2, b"SIGINT again: the checkpoint being written is finished first, then the run stops\n")
            return
        if not self.graceful or (not first and signum == signal.SIGINT):
            raise Stopped(self.received, abandoned=self.step_in_progress if self.graceful else None)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint is being written in the block: a signal is noted, never raised in the middle of it (the
        loop stops after the save: agreed)."""
        self.in_save = True
        try:
            yield
        finally:
            self.in_save = False

    def agreed(self, device: torch.device) -> Optional[int]:
        """The signal that stops the run after this step on every rank (the largest number any rank holds), or
        None. Every rank calls it after every step, so that all of them stop after the same one."""
        received = self.received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([received], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return received or None


stop_signals = StopSignals()  # the one of this process; engine_main installs its handlers


def handle_stop_signals(handler) -> dict:
    """Install `handler` for the stop signals this process does not ignore (`nohup` ignores SIGHUP, a shell's `&`
    SIGINT, for the launcher and the engine alike); returns the handlers it replaced."""
    return {signum: signal.signal(signum, handler) for signum in SIGNALS
            if signal.getsignal(signum) is not signal.SIG_IGN}


def watch_launcher(on_end: Callable[[], None] = lambda: None) -> None:
    """Stop as on SIGTERM when the launcher named by FP8_RECIPES_LAUNCHER_PID ends (or is already gone), calling
    `on_end` first (the run directory's lock, which the launcher held for this process, is taken over)."""
    pid = os.environ.get(LAUNCHER_PID)
    if not pid:
        return
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        on_end()
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has ended
        on_end()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="launcher-watch", daemon=True).start()


def stopped_line(stopped: Stopped, cfg: Config, run_dir: Path) -> str:
    """The one line a stopped run ends with: where it stopped and where the same command picks it up."""
    name, max_steps = signal.Signals(stopped.signum).name, cfg.trainer.max_steps
    if stopped.step is not None:
        where = f"stopped by {name} after step {stopped.step}/{max_steps}"
    elif stopped.abandoned is not None:
        where = f"stopped by {name} during step {stopped.abandoned}/{max_steps}, abandoned"
    else:
        where = f"stopped by {name} before the first step"
    if stopped.checkpoint:
        resume = f"its checkpoint is {stopped.checkpoint}; the same command (run.dir={run_dir}) resumes from it"
    elif cfg.trainer.checkpoint.interval > 0:
        resume = (f"the same command (run.dir={run_dir}) resumes from the newest checkpoint in "
                  f"{checkpoint_dir(cfg, run_dir)}, if there is one")
    else:
        resume = ("checkpointing is off (trainer.checkpoint.interval=0): the same command starts over; set "
                  "trainer.checkpoint.interval to make the run resumable")
    return f"{where}; {resume}"
