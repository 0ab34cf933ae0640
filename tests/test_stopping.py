"""Stopping a run with real signals to real processes: Ctrl-C and SIGTERM to launch/run.py, the launcher's death,
SIGTERM and a repeated Ctrl-C to the engine itself, and the run directory's lock (recipes.trainer.run_lock). The
same on the real Slurm (scancel --signal=TERM, scontrol requeue) is in tests/test_slurm.py.

Every run is tiny_llama with 64-token sequences on random tokens on the CPU; a run meant to be stopped has far
more steps than it will take, and every wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from recipes.config import load_config
from recipes.engine import torch_engine
from recipes.run_files import LOCK
from recipes.trainer import loop
from recipes.trainer.checkpoints import read_manifest, verify_files
from recipes.trainer.run_lock import LAUNCHER, RunDirBusy, check_free
from recipes.trainer.stopping import Stopped, stop_signals

from test_checkpoint import make_config
from test_train import REPO, read_metrics

WAIT_S = 180
RUN = ("data=mock", "model.seq_length=64", "trainer.log_interval=1", "trainer.max_steps=10000")


def start(args: list[str], tmp_path: Path) -> subprocess.Popen:
    """A process in a session of its own, as a shell starts a command: the terminal's Ctrl-C goes to its group."""
    env = dict(os.environ, FP8_RECIPES_RUNS=str(tmp_path / "runs"), FP8_RECIPES_CACHE=str(tmp_path / "cache"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    return subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def launch(tmp_path: Path, run_dir: Path, *overrides: str) -> subprocess.Popen:
    return start([str(REPO / "launch" / "run.py"), *RUN, f"run.dir={run_dir}", *overrides], tmp_path)


def engine(tmp_path: Path, config: Path) -> subprocess.Popen:
    return start(["-m", "recipes.engine.torch_engine", str(config)], tmp_path)


def wait_for_steps(run_dir: Path, count: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= count:
            return
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"fewer than {count} steps in {run_dir} after {WAIT_S}s")


def wait_for_lock(run_dir: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (run_dir / LOCK).is_file() and (run_dir / LOCK).read_text().split()[:1] == [str(process.pid)]:
            return
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"{process.pid} did not take {run_dir / LOCK} in {WAIT_S}s")


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=WAIT_S)
    return process.returncode, output


def training_processes(run_dir: Path) -> list[psutil.Process]:
    """Processes on this machine whose command line names the run's config: engines, torchrun, its workers."""
    config = str(run_dir / "config.yaml")
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if config in (process.info["cmdline"] or []):
            found.append(process)
    return found


def assert_all_gone(run_dir: Path) -> None:
    deadline = time.monotonic() + 30
    while training_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not training_processes(run_dir), "a training process outlived the run"


def stopped_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "stopped by SIG" in line]


def assert_quiet(output: str) -> None:
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]


def test_one_ctrl_c_stops_the_run_after_a_step_with_its_checkpoint_and_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    launcher = launch(tmp_path, run_dir, "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 2, launcher)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    rc, output = finish(launcher)
    assert rc == 130, output[-4000:]
    assert_quiet(output)
    assert_all_gone(run_dir)
    last = read_metrics(run_dir)[-1]["step"]
    checkpoint = run_dir / "checkpoints" / f"step_{last:08d}"
    assert (checkpoint / "checkpoint.pt").is_file()  # the step it stopped after, saved on the way out
    [line] = stopped_lines(output)
    assert f"stopped by SIGINT after step {last}/10000; its checkpoint is {checkpoint}; the same command" in line
    assert (run_dir / LOCK).read_text() == ""  # released in order

    again = launch(tmp_path, run_dir, "trainer.checkpoint.interval=1000", f"trainer.max_steps={last + 2}")
    rc, output = finish(again)
    assert rc == 0, output[-4000:]
    assert f"resuming from step {last} of {checkpoint}" in output
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, last + 3))


def test_sigterm_to_the_launcher_stops_torchrun_workers_quietly(tmp_path):
    run_dir = tmp_path / "run"
    launcher = launch(tmp_path, run_dir, "executor.gpus=2", "precision=bf16", "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 1, launcher)
    launcher.terminate()  # to the launcher alone, as `timeout` and `kill` send it
    rc, output = finish(launcher)
    assert rc == 143, output[-4000:]
    assert_quiet(output)
    assert_all_gone(run_dir)
    last = read_metrics(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{last:08d}" / "checkpoint.pt").is_file()  # both ranks' shards
    [line] = stopped_lines(output)
    assert f"stopped by SIGTERM after step {last}/10000" in line


def test_a_closing_terminal_stops_a_one_process_run_like_sigterm(tmp_path):
    """SIGHUP to the launcher of one engine process (no torchrun): passed on, the step finishes, the engine says it
    was SIGHUP and the launcher returns 128 + SIGHUP."""
    run_dir = tmp_path / "run"
    launcher = launch(tmp_path, run_dir, "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 1, launcher)
    launcher.send_signal(signal.SIGHUP)
    rc, output = finish(launcher)
    assert rc == 128 + signal.SIGHUP, output[-4000:]
    assert_quiet(output)
    assert_all_gone(run_dir)
    last = read_metrics(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{last:08d}" / "checkpoint.pt").is_file()
    [line] = stopped_lines(output)
    assert f"stopped by SIGHUP after step {last}/10000; its checkpoint is" in line


def test_the_engine_stops_when_its_launcher_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    launcher = launch(tmp_path, run_dir, "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 1, launcher)
    [engine_process] = training_processes(run_dir)
    launcher.kill()  # SIGKILL: nothing forwarded
    finish(launcher)
    engine_process.wait(WAIT_S)  # psutil.TimeoutExpired if it runs on
    last = read_metrics(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{last:08d}" / "checkpoint.pt").is_file()
    [log] = (tmp_path / "runs" / "nemo-run").rglob("stdout.log")  # the engine's own, as torchx writes it
    assert f"stopped by SIGTERM after step {last}/10000; its checkpoint is" in log.read_text()


def signals_at(monkeypatch, step: int, *signums: int) -> None:
    """Send this process `signums` while step `step` runs (its learning rate is asked at its start)."""
    rate = loop.learning_rate

    def signalling(at: int, trainer):
        if at == step:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return rate(at, trainer)

    monkeypatch.setattr(loop, "learning_rate", signalling)


def test_sigterm_to_the_engine_checkpoints_the_step_and_a_second_ctrl_c_abandons_one(tmp_path, monkeypatch, capsys):
    config = make_config(tmp_path / "run", max_steps=10, interval=1000)
    run_dir = config.parent
    signals_at(monkeypatch, 3, signal.SIGTERM, signal.SIGTERM)  # Slurm sends two: to the task and through srun
    assert torch_engine.main([str(config)]) == 143
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert stopped_lines(capsys.readouterr().out) == [
        f"stopped by SIGTERM after step 3/10; its checkpoint is {checkpoint}; the same command (run.dir={run_dir}) "
        "resumes from it"]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert (checkpoint / "checkpoint.pt").is_file()

    signals_at(monkeypatch, 5, signal.SIGINT, signal.SIGINT)
    assert torch_engine.main([str(config)]) == 130
    output = capsys.readouterr().out
    assert "resuming from step 3" in output
    assert stopped_lines(output) == [
        f"stopped by SIGINT during step 5/10, abandoned; the same command (run.dir={run_dir}) resumes from the "
        f"newest checkpoint in {run_dir / 'checkpoints'}, if there is one"]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]  # step 5 left no trace
    assert not (run_dir / "checkpoints" / "step_00000004").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the engine's handlers are gone


def test_a_second_ctrl_c_during_a_save_lets_the_checkpoint_finish_and_the_run_stops_after_its_step(
        tmp_path, monkeypatch, capfd):
    """The first Ctrl-C in step 3 asks for its checkpoint on the way out; the second lands while that checkpoint's
    shards are written (DCP writes them with torch.save): the checkpoint is finished and published, no temporary
    folder is left, and the run ends with the line of a graceful stop."""
    config = make_config(tmp_path / "run", max_steps=10, interval=1000, precision="bf16")
    run_dir = config.parent
    signals_at(monkeypatch, 3, signal.SIGINT)
    save, sent = torch.save, []

    def interrupted(*args, **kwargs):  # only a checkpoint calls torch.save: step 3's, on the way out
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted)
    assert torch_engine.main([str(config)]) == 130
    out, err = capfd.readouterr()
    assert sent and "Traceback" not in out + err
    assert "SIGINT again: the checkpoint being written is finished first, then the run stops" in err
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert stopped_lines(out) == [
        f"stopped by SIGINT after step 3/10; its checkpoint is {checkpoint}; the same command (run.dir={run_dir}) "
        "resumes from it"]
    assert verify_files(checkpoint, read_manifest(checkpoint)) == []
    assert sorted(p.name for p in checkpoint.parent.iterdir() if p.name.startswith("step_")) == ["step_00000003"]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]


def test_a_signal_before_the_first_step_stops_at_once():
    with stop_signals.installed():
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler runs in this thread, between bytecodes
    assert (stopped.value.signum, stopped.value.step, stopped.value.abandoned) == (signal.SIGTERM, None, None)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_a_second_trainer_is_refused_with_the_holders_pid_and_a_dead_ones_lock_is_taken_over(tmp_path):
    config = make_config(tmp_path / "run", max_steps=10000, interval=0)
    run_dir = config.parent
    first = engine(tmp_path, config)
    wait_for_steps(run_dir, 1, first)
    second = engine(tmp_path, config)
    rc, output = finish(second)
    assert rc == 1 and output.strip().splitlines()[-1] == (
        f"error: run dir {run_dir} is in use by a trainer (PID {first.pid} on {os.uname().nodename}): wait for it "
        "to end or stop it, or give this run another run.dir")
    # launch/run.py refuses before it writes its config over the running one's
    before = config.read_text()
    launcher = launch(tmp_path, run_dir, "trainer.max_steps=3")
    rc, output = finish(launcher)
    assert rc == 1 and f"is in use by a trainer (PID {first.pid} " in output.splitlines()[-1]
    assert config.read_text() == before

    first.kill()  # SIGKILL: the lock file still names it; the kernel has dropped the lock
    finish(first)
    assert (run_dir / LOCK).read_text().split()[0] == str(first.pid)
    third = engine(tmp_path, config)
    wait_for_lock(run_dir, third)
    third.send_signal(signal.SIGTERM)
    rc, output = finish(third)
    assert rc == 143
    assert f"{LOCK}: taking over the lock of PID {first.pid} on {os.uname().nodename}, which ended" in output


def test_of_two_launches_started_together_on_one_run_dir_one_trains_and_the_other_is_refused(tmp_path):
    """The launcher locks the run directory before it writes anything and hands the lock to its trainer: the
    second launch, whenever it comes, is refused in one line (the first holds the lock, or has left a finished
    run there), and the run directory describes the one run that trained."""
    run_dir = tmp_path / "run"
    rates = ("0.001", "0.003")
    launches = [launch(tmp_path, run_dir, "trainer.max_steps=2", f"trainer.lr={rate}") for rate in rates]
    results = [finish(process) for process in launches]
    assert sorted(rc for rc, _ in results) == [0, 1], results
    [(winner, _)] = [(rate, output) for rate, (rc, output) in zip(rates, results) if rc == 0]
    [refusal] = [output for rc, output in results if rc == 1]
    assert_quiet(refusal)
    [line] = refusal.strip().splitlines()
    assert line.startswith(f"error: run dir {run_dir} is in use by a launch (PID ") or line.startswith(
        f"error: run.dir={run_dir} holds a run (metrics.jsonl"), line
    assert load_config(run_dir / "config.yaml").trainer.lr == float(winner)
    assert f"trainer.lr={winner}" in (run_dir / "overrides.yaml").read_text()
    assert {m["lr"] for m in read_metrics(run_dir)} <= {float(winner) * step / 10 for step in (1, 2)}
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


def test_a_refusal_in_the_instant_before_the_holder_names_itself_still_names_the_launch(tmp_path):
    """flock is taken before the holder writes its name into the lock file: a second launch refused in between
    waits for the name instead of calling the holder an unnamed trainer."""
    fd = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    named = threading.Timer(0.3, os.pwrite, (fd, f"{os.getpid()} {os.uname().nodename} {LAUNCHER}\n".encode(), 0))
    named.start()
    try:
        with pytest.raises(RunDirBusy, match=rf"in use by a launch \(PID {os.getpid()} on "):
            check_free(tmp_path)
    finally:
        named.join()
        os.close(fd)
