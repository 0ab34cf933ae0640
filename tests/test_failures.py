"""Every disk or environment failure is one line: a full disk under the report, inputs that are no regular file (a
symbolic link loop, a FIFO, a device, a file past the size bound), a reader of the launcher's output that exits, a
sweep Hydra's basic sweeper cannot expand, a damaged corpus cache, a network whose gradient is gone. Each ends in
one line naming the cause and the fix, with the exit status the README gives, never a traceback, a hang or exit 0.

Real failures, not mocks: a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored, gives EFBIG as a full disk gives
ENOSPC, without root or a small filesystem), real FIFOs, links and /dev/zero, real tiny CPU training.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from compare_helpers import FIXTURES, REPO, SCRIPT, copy_run, quiet
from recipes.config import ConfigError, DataConfig
from recipes.data import corpus
from recipes.data.corpus import build_corpus
from recipes.data.dataset import make_dataset
from recipes.data.tokenizer import VOCAB_SIZE
from recipes.engine.torch_engine import main as engine_main
from recipes.report import UsageError, build_report
from recipes.report.formats.base import MAX_INPUT_BYTES

RUN_PY = REPO / "launch" / "run.py"
TRACEBACK = "Traceback (most recent call last)"


def file_size_limit(limit: int):
    """A child's preexec_fn: no file it writes may pass `limit` bytes; a write past it fails with EFBIG (SIGXFSZ,
    which would kill the process, ignored, as a full disk fails a write with ENOSPC)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@contextmanager
def files_of_at_most(limit: int):
    """This process's files limited as file_size_limit does, for the block's length."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def environment(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "FP8_RECIPES_RUNS": str(tmp_path / "runs"),
            "FP8_RECIPES_CACHE": str(tmp_path / "cache"),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def compare(tmp_path: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    # A timeout: a read that blocks (a FIFO) or never ends (/dev/zero) fails the test instead of hanging it.
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=environment(tmp_path),
                          capture_output=True, text=True, timeout=120, **kwargs)


def last_line_alone(stderr: str) -> str:
    """The error, the last line of stderr, with no traceback before it."""
    assert TRACEBACK not in stderr, stderr
    return stderr.strip().splitlines()[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


# ---- 1. scripts/compare.py on a full disk ----


def test_compare_on_a_full_disk_exits_2_and_leaves_the_previous_report(tmp_path):
    """A run is flagged (NaN), so a report that half-wrote and exited 1 would pass for a divergence. The file-size
    limit lets the figures be written and stops report.html (over 100 kB with them embedded)."""
    inputs = [str(FIXTURES / "rundirs"), str(FIXTURES / "nan")]
    out = tmp_path / "out"
    status, _ = build_report(inputs, out, base=REPO, log=quiet)
    assert status == 1
    previous = snapshot(out)
    assert (out / "report.html").stat().st_size > 100_000 and (out / "speedup_vs_model_size.png").exists()

    for target in (out, tmp_path / "new" / "out"):
        result = compare(tmp_path, *inputs, "--out", str(target), preexec_fn=file_size_limit(60_000))
        assert result.returncode == 2, result.stderr
        assert last_line_alone(result.stderr) == (
            f"compare.py: error: --out {target}: the report could not be written, file too large for the file-size "
            "limit (ulimit -f) or the filesystem (EFBIG), and nothing there was changed; raise the file-size limit "
            "(ulimit -f), or give an --out on a filesystem that takes larger files")
    assert snapshot(out) == previous  # no partial file, no staging folder, the earlier figures kept
    assert not (tmp_path / "new").exists()  # the folders it made for the report are gone again


def test_compare_never_writes_through_a_link_planted_in_out(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.md"
    out.mkdir()
    elsewhere.write_text("mine\n")
    (out / "report.md").symlink_to(elsewhere)
    with pytest.raises(UsageError, match=f"--out {out}: {out / 'report.md'} is a symbolic link, not a file"):
        build_report([str(FIXTURES / "rundirs")], out, base=REPO, log=quiet)
    assert elsewhere.read_text() == "mine\n" and [path.name for path in out.iterdir()] == ["report.md"]


# ---- 2. inputs that are no regular file, or too large ----


def sparse_file(path: Path, size: int) -> Path:
    with open(path, "wb") as file:
        file.truncate(size)  # no block is written: costs no disk
    return path


def link_loop(folder: Path, first: str, second: str) -> Path:
    (folder / first).symlink_to(second)
    (folder / second).symlink_to(first)
    return folder / first


@pytest.mark.parametrize("case, what", [
    ("symlink_loop", "a symbolic link loop"),
    ("fifo", "a FIFO, not a regular file"),
    ("dev_zero", "a device file, not a regular file"),
    ("too_large", f"{MAX_INPUT_BYTES + 1:,} bytes, more than the 2 GiB an input file may be"),
])
def test_compare_refuses_an_input_that_is_no_regular_file_or_too_large(tmp_path, case, what):
    if case == "symlink_loop":
        given = link_loop(tmp_path, "a", "b")
    elif case == "fifo":
        given = tmp_path / "train.log"
        os.mkfifo(given)  # open() for reading would wait for a writer for ever
    elif case == "dev_zero":
        given = Path("/dev/zero")  # would be read until the memory ran out
    else:
        given = sparse_file(tmp_path / "train.log", MAX_INPUT_BYTES + 1)
    result = compare(tmp_path, str(given), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert last_line_alone(result.stderr).startswith(f"compare.py: error: {given}: {what}")
    assert not (tmp_path / "out").exists()


def test_compare_skips_unusable_files_met_inside_a_folder_and_notes_each(tmp_path):
    folder = tmp_path / "runs"
    copy_run("llama3_8b-bf16", folder / "llama3_8b-bf16")
    link_loop(folder, "a.log", "b.log")
    os.mkfifo(folder / "stdout.log")
    sparse_file(folder / "big.out", MAX_INPUT_BYTES + 1)
    fifo_run = folder / "fifo_run"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "metrics.jsonl")  # a run directory whose metrics file blocks
    result = compare(tmp_path, str(folder), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert TRACEBACK not in result.stderr
    notes = (tmp_path / "out" / "report.md").read_text()
    for note in ("runs/a.log: not read: a symbolic link loop", "runs/b.log: not read: a symbolic link loop",
                 "runs/stdout.log: not read: a FIFO, not a regular file",
                 "runs/fifo_run/metrics.jsonl: not read: a FIFO, not a regular file",
                 f"runs/big.out: not read: {MAX_INPUT_BYTES + 1:,} bytes, more than the 2 GiB"):
        assert note in notes, notes


# ---- 3. launch/run.py's output read by a reader that exits ----


def test_launch_piped_into_a_reader_that_exits_ends_quietly_with_status_141(tmp_path):
    """`launch/run.py dryrun=true | head -3`: its reader gone, the launcher stops without a word, as a command that
    SIGPIPE ends does (128 + 13). The reader here is gone before the first line, so the test never races it."""
    process = subprocess.Popen([sys.executable, str(RUN_PY), "dryrun=true", f"run.dir={tmp_path / 'run'}"],
                               cwd=tmp_path, env=environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGPIPE
    assert stderr == ""


# ---- 4. sweeps the basic sweeper cannot expand ----


@pytest.mark.parametrize("override, why", [
    ("trainer.seed=glob(*)", "glob() picks among a config group's options (model=glob(tiny_*)), and trainer.seed is "
                             "no group or none of its options match"),
    ("trainer.max_steps=interval(1,5)", "interval() is a continuous range, which only a search sweeper (Optuna, Ax) "
                                        "samples"),
    ("trainer.seed=range(1,1)", "the range or list is empty"),
])
def test_a_sweep_the_basic_sweeper_cannot_expand_is_refused_in_one_line(tmp_path, override, why):
    result = subprocess.run([sys.executable, str(RUN_PY), "-m", override, "dryrun=true"], cwd=tmp_path,
                            env=environment(tmp_path), capture_output=True, text=True, timeout=120)
    key = override.split("=")[0]
    assert result.returncode == 1
    assert result.stderr == (f"error: {override}: -m has no value of {key} to run: {why}; list the values: "
                             f"-m {key}=a,b,c, {key}=range(start,stop,step) or {key}=choice(a,b,c)\n")
    assert not (tmp_path / "runs").exists()


def test_a_glob_of_a_config_group_sweeps_its_options(tmp_path):
    result = subprocess.run([sys.executable, str(RUN_PY), "-m", "model=glob(tiny_*)", "dryrun=true"], cwd=tmp_path,
                            env=environment(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    configs = sorted((tmp_path / "runs").glob("*-sweep/*/config.yaml"))
    assert [path.parent.name.split("-")[1] for path in configs] == ["tiny_llama", "tiny_nemotron"]


# ---- 5. a damaged corpus cache ----


def _truncated_bin(folder: Path) -> None:
    os.truncate(folder / "corpus.bin", (folder / "corpus.bin").stat().st_size // 2)


def _garbage_idx(folder: Path) -> None:
    (folder / "corpus.idx").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _flipped_token(folder: Path) -> None:
    """Same size, one token changed: no index check can see it, only the digest."""
    with open(folder / "corpus.bin", "r+b") as file:
        file.seek(1000)
        file.write(b"\xff\x00")


def _no_digest(folder: Path) -> None:
    """An entry from before the cache kept a digest, or one whose digest was lost."""
    (folder / corpus.DIGEST).unlink()


@pytest.mark.parametrize("damage", [_truncated_bin, _garbage_idx, _flipped_token, _no_digest])
def test_a_damaged_corpus_cache_is_built_again_saying_so(tmp_path, capsys, damage):
    prefix = build_corpus(str(tmp_path))
    folder = Path(prefix).parent
    intact = {name: (folder / name).read_bytes() for name in (*corpus.FILES, corpus.DIGEST)}
    capsys.readouterr()
    damage(folder)
    dataset = make_dataset(DataConfig(name="stdlib", cache_dir=str(tmp_path)), seq_length=64, vocab_size=VOCAB_SIZE,
                           seed=0)
    assert len(dataset[0]) == 65
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"[data] the cached corpus in {folder} is damaged (")
    assert out.splitlines()[0].endswith("): building it again")
    assert {name: (folder / name).read_bytes() for name in intact} == intact
    assert [path.name for path in tmp_path.iterdir()] == [folder.name]  # nothing set aside is left


def test_a_corpus_cache_on_a_full_disk_is_one_line(tmp_path):
    """A ConfigError, which the engines print as one line (`error: ...`, exit status 1)."""
    with files_of_at_most(1_000_000), pytest.raises(ConfigError) as error:
        build_corpus(str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"cannot build the bundled corpus in {corpus._corpus_dir(str(tmp_path))}: file too")
    assert message.endswith("(EFBIG); raise the file-size limit (ulimit -f), or point data.cache_dir "
                            "(FP8_RECIPES_CACHE) at a folder on a filesystem that takes larger files (it needs 30 MB)")
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []  # no half-built entry


# ---- 6. a dead network ----


def test_a_dead_network_stops_the_run_naming_the_step_and_the_causes(tmp_path, capsys):
    """Weights of 1e10 saturate the tiny model: the gradient norm is exactly 0 from step 1 and the loss ln(320)."""
    run_dir = tmp_path / "dead"
    small = ("precision=bf16", "data=mock", "model.num_layers=2", "model.seq_length=32", "trainer.micro_batch_size=1",
             "trainer.global_batch_size=1", "trainer.tensorboard=false")
    result = subprocess.run([sys.executable, str(RUN_PY), *small, "model.init_std=1e10", "trainer.max_steps=10",
                             f"run.dir={run_dir}", "dryrun=true"], cwd=tmp_path, env=environment(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert engine_main([str(run_dir / "config.yaml")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: training stopped: step 3: the gradient norm has been exactly 0 for 3 steps running (loss 5.7683, "
        "ln(model.vocab_size): a uniform guess): the network is dead and will not learn again; look for a "
        "trainer.weight_decay, model.init_std or trainer.lr far too large (precision=bf16)")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["grad_norm"]) for r in records] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert not (run_dir / "summary.json").exists()
