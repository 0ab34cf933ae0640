"""Checkpoint folders as both engines keep them, and whether a run may continue from one.

    <checkpoints>/owner.json              whose folder this is: the run directory that saves here, and its dataset
    <checkpoints>/step_00000050/          a complete checkpoint: the file its engine writes last is there
    <checkpoints>/step_00000150.tmp-<x>/  a save that was killed midway: never read, removed by the next save
    <checkpoints>/step_00000100.damaged/  a checkpoint whose files no longer match its manifest: never read, kept

An engine calls this module twice: `restore` before its first step and `save` at each checkpoint the loop asks for.
What a checkpoint holds is the engine's, handed over as a small object (`CheckpointFormat`: its marker file, a
function that writes its shards into a folder and one that reads them back; recipes.engine.checkpoint,
recipes.megatron.checkpoint); everything else is here.

`save` writes into a temporary folder (start_save) and publishes it as `step_<N>` with one atomic rename
(finish_save), so a folder named `step_<N>` is always complete; `prune` keeps the newest ones. A manifest
(manifest.json: each file's size and SHA-256, written before the rename) lets a resume check the files before it
reads them (verify_files) and fall back to an older checkpoint when one was damaged since. `restore` continues a run
started again in the same run directory from the newest intact checkpoint, if the folder is the run's own
(own_checkpoint_dir) and its config allows (check_resumable; the launcher checks both before it writes anything:
check_owner, check_before_launch), and cuts its metrics back to that step (resume_metrics). A save the machine
refuses (a full disk, a quota, `ulimit -f`) removes its temporary folder and stops the run in one line on every rank
(settle: SaveFailed); the checkpoints before it stay.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import resource
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from recipes.config import Config, ConfigError, to_dict
from recipes.folders import check_regular_or_absent, write_file
from recipes.metrics import FULL, StepMetrics, WriteFailed, write_failure, write_fix
from recipes.run_files import CHECKPOINTS, METRICS

_STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST = "manifest.json"

# Settings a resumed run must share with the run that wrote the checkpoint: the model's shape and maths, the
# precision recipe, which samples each step reads. Anything else (max_steps, intervals, compile, ...) may change.
# The dataset itself is compared by identity, not by path (recipes.data.identity; own_checkpoint_dir).
MUST_MATCH = ("model", "precision", "data.kind", "trainer.seed", "trainer.global_batch_size")
# A checkpoint folder's owner: the run directory whose run saves there, and the dataset that run trains on.
OWNER = "owner.json"


class CheckpointError(ConfigError):
    """A checkpoint this run cannot continue from; the message says why and what to do."""


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    configured = cfg.trainer.checkpoint.dir
    return run_dir / CHECKPOINTS if configured is None else run_dir / Path(configured).expanduser()


# ---- what an engine calls: restore and save ----


class CheckpointFormat(Protocol):
    """What an engine keeps in a checkpoint and how; where, when, and whether it is intact are this module's. Every
    rank calls `write` and `read`."""

    marker: str  # the small file rank 0 writes last (step, config and what `write` returns): a complete checkpoint

    def write(self, folder: Path) -> dict:
        """Write this rank's shards into `folder`, returning once every rank's are there; what it returns is kept in
        the marker beside step and config (rank 0's)."""

    def read(self, folder: Path, state: dict) -> None:
        """Load the shards of `folder` into this rank's model and optimizer; `state` is the marker's."""


@dataclass
class Start:
    """Where a run starts: the step after its checkpoint's (1 without one), and on the logging rank the metrics of
    the steps before it ([] elsewhere)."""

    first_step: int
    history: list[StepMetrics]


def restore(cfg: Config, run_dir: Path, engine: CheckpointFormat, rank: int, world_size: int) -> Start:
    """The run continued from the newest intact checkpoint of its own checkpoint folder (damaged ones moved aside),
    read by `engine`, or started from scratch where there is none; metrics.jsonl cut back to match. CheckpointError
    on every rank when the folder is another run's or this run cannot continue from its checkpoint. A collective
    when world_size > 1."""
    directory = own_checkpoint_dir(cfg, run_dir, rank, world_size)
    found = newest_intact(directory, engine.marker, cfg, rank, world_size)
    if found is None:
        return Start(1, resume_metrics(run_dir, 0) if rank == 0 else [])
    step, folder, state = found
    engine.read(folder, state)
    if rank == 0:
        changed = changed_settings(state["config"], cfg)
        note = f" (changed: {', '.join(changed)})" if changed else ""
        print(f"resuming from step {step} of {folder}{note}", flush=True)
    return Start(step + 1, resume_metrics(run_dir, step, folder) if rank == 0 else [])


def save(cfg: Config, run_dir: Path, step: int, engine: CheckpointFormat, rank: int, world_size: int) -> Optional[Path]:
    """Step `step`'s checkpoint, its shards written by `engine`, published whole, and the oldest pruned; the
    published folder on rank 0 (None elsewhere). SaveFailed on every rank where the machine refuses it (its
    temporary folder removed, the checkpoints before it kept). A collective when world_size > 1."""
    directory = checkpoint_dir(cfg, run_dir)
    temporary = start_everywhere(directory, step, engine.marker, rank, world_size)
    final, failure = None, None
    try:
        state = engine.write(temporary)
        seal(temporary, engine.marker, {"step": step, "config": to_dict(cfg), **state}, rank, world_size)
        if rank == 0:
            final = finish_save(directory, step, temporary)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        failure = error
    settle(failure, directory, step, temporary, engine.marker, rank, world_size)
    if rank == 0:
        prune(directory, cfg.trainer.checkpoint.keep_last, engine.marker)
    return final


# ---- whose checkpoints ----


def own_checkpoint_dir(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1) -> Path:
    """The run's checkpoint folder, checked to be its own: a folder shared by two runs would have one continue the
    other's checkpoints and prune its saves. The first run that saves there claims it (OWNER, created in one step:
    of two runs started together one claims, the other is refused); a run continues only from a folder its own run
    directory claimed, and only on the dataset it trained on. CheckpointError on every rank otherwise (a collective
    when world_size > 1)."""
    directory = checkpoint_dir(cfg, run_dir)
    problem = None
    if rank == 0:
        try:
            _claim(directory, run_dir, cfg)
        except CheckpointError as error:
            problem = str(error)
    if world_size > 1:
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        raise CheckpointError(problem)
    return directory


def _claim(directory: Path, run_dir: Path, cfg: Config) -> None:
    from recipes.data.identity import dataset_identity  # reads the index, and may build the bundled corpus

    if not directory.is_dir() and cfg.trainer.checkpoint.interval == 0:
        return  # no checkpoint to continue from, none to be saved
    record = {"run_dir": str(run_dir.resolve()), "dataset": dataset_identity(cfg.data)}
    directory.mkdir(parents=True, exist_ok=True)
    if _create_new(directory / OWNER, record):
        return
    owner = check_owner(directory, run_dir)
    if owner.get("dataset") != record["dataset"] and _holds_saves(directory):
        raise CheckpointError(
            f"cannot resume from {directory}: its run trained on the dataset {_describe(owner.get('dataset'))}, and "
            f"data (data.path={cfg.data.path}) is now {_describe(record['dataset'])}; give data.path that dataset, "
            f"or use a new run.dir for a run on this one")
    if owner != record:  # the run directory moved with its checkpoints, or no save yet of the earlier dataset
        write_file(directory / OWNER, json.dumps(record, indent=1) + "\n")


def check_owner(directory: Path, run_dir: Path) -> dict:
    """The owner record of `directory` ({} when unclaimed); CheckpointError when another run directory claimed it.
    A folder inside the run directory is that run's, whoever claimed it (the run directory was moved)."""
    path = directory / OWNER
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        check_regular_or_absent(path)
        owner = json.loads(path.read_text())
        claimed = Path(owner["run_dir"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as error:
        raise CheckpointError(f"{path} cannot be read ({str(error) or type(error).__name__}): this folder's owner is "
                              "unknown; give this run its own trainer.checkpoint.dir") from None
    ours = run_dir.resolve()
    if claimed != ours and ours not in directory.resolve().parents:
        raise CheckpointError(
            f"trainer.checkpoint.dir {directory} holds the checkpoints of the run in {claimed} ({path}); a run "
            f"continues and prunes only its own: give this run another trainer.checkpoint.dir (if {claimed} was "
            f"moved to {ours}, delete {path})")
    return owner


def _create_new(path: Path, record: dict) -> bool:
    """`path` created holding `record`, unless it exists (False): written aside, then linked into place, which
    fails where the name is taken, so a reader never sees it half written and two writers never both succeed."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    write_file(temporary, json.dumps(record, indent=1) + "\n")
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink()


def _holds_saves(directory: Path) -> bool:
    return any(_STEP_DIR.fullmatch(entry.name) for entry in directory.iterdir())


def _describe(dataset: Optional[dict]) -> str:
    if not dataset:
        return "mock (random tokens)"
    return (f"of {dataset['bin_bytes']:,} token bytes (index sha256 {dataset['idx_sha256'][:12]}, tokens "
            f"{dataset['bin_pieces_sha256'][:12]})")


def step_folder(directory: Path, step: int) -> Path:
    """Where the complete checkpoint of `step` is kept in `directory`."""
    return directory / f"step_{step:08d}"


def complete_checkpoints(directory: Path, marker: str) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `directory`, oldest first; temporary folders are ignored.
    `marker` is the file an engine writes last into a checkpoint folder."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (entry / marker).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


# ---- saving ----


def start_save(directory: Path, step: int, tag: str) -> Path:
    """An empty temporary folder for step `step`'s checkpoint, never read as a checkpoint (see prune)."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f"{step_folder(directory, step).name}.tmp-{tag}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    return temporary


def finish_save(directory: Path, step: int, temporary: Path) -> Path:
    """Publish a fully written temporary folder as `step_<N>` with one atomic rename."""
    _fsync_dir(temporary)
    final = step_folder(directory, step)
    replaced = None
    if final.exists():  # the same step saved again: moved aside (a name that is never read), then replaced
        replaced = directory / f"{final.name}.tmp-replaced-{os.getpid()}"
        os.rename(final, replaced)
    try:
        os.rename(temporary, final)
    except OSError:
        if replaced:  # the step's earlier checkpoint back in its place: a failed save leaves what was there
            os.rename(replaced, final)
        raise
    _fsync_dir(directory)
    if replaced:
        shutil.rmtree(replaced)
    return final


def seal(temporary: Path, marker: str, state: dict, rank: int, world_size: int) -> None:
    """Close a save once every rank's files are in `temporary`: each rank digests its share of them, then rank 0
    writes the engine's `marker` file (`state`: step, config, ...) and the manifest of every file, fsynced. A
    collective when world_size > 1 (a rank that cannot read its share sends its OSError, raised on every rank);
    finish_save publishes the folder after it."""
    names = sorted(name for name in os.listdir(temporary) if (temporary / name).is_file())
    try:
        digests: list[Any] = [file_digests(temporary, names[rank::world_size])]
    except OSError as error:
        digests = [error]
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, digests[0])
        digests = gathered
    for share in digests:
        if isinstance(share, OSError):
            raise share
    if rank == 0:
        with open(temporary / marker, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        manifest = {name: digest for share in digests for name, digest in share.items()}
        write_manifest(temporary, manifest | file_digests(temporary, [marker]))


def file_digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """Size and SHA-256 of each named file of `folder`, for the manifest (each process digests its own share)."""
    return {name: _digest(folder / name) for name in names}


def _digest(path: Path) -> dict:
    sha256 = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            sha256.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha256.hexdigest()}


def write_manifest(folder: Path, digests: dict[str, dict]) -> None:
    """manifest.json: every file of the checkpoint with its size and checksum (written last, fsynced)."""
    with open(folder / MANIFEST, "w") as file:
        json.dump({"files": dict(sorted(digests.items()))}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


class SaveFailed(CheckpointError):
    """A checkpoint the machine would not take (a full disk, a quota, a file-size limit, its folder gone): its
    temporary folder is removed, the checkpoints before it stay, and the run stops in one line on every rank."""


def start_everywhere(directory: Path, step: int, marker: str, rank: int, world_size: int) -> Path:
    """start_save on rank 0 (named with its process id), its folder shared with every rank; SaveFailed on every
    rank where rank 0 cannot make it. A collective when world_size > 1."""
    started: list[Any] = [None]  # the folder, or why it could not be made
    if rank == 0:
        try:
            started[0] = start_save(directory, step, str(os.getpid()))
        except OSError as error:
            started[0] = _failure_line(error, directory, step, marker)
    if world_size > 1:
        dist.broadcast_object_list(started, src=0)
    if isinstance(started[0], str):
        raise SaveFailed(started[0])
    return started[0]


def settle(error: Optional[BaseException], directory: Path, step: int, temporary: Path, marker: str, rank: int,
           world_size: int) -> None:
    """End a save alike on every rank; `error` is what failed this rank's part of it (None: nothing). A failure
    of the machine on any rank (an OSError, wherever the writers wrapped it) removes the temporary folder and raises
    the same SaveFailed everywhere; any other failure is raised again where it happened (a bug: its traceback), and
    as a CheckpointError on the other ranks. A collective when world_size > 1, which also keeps every rank from
    running ahead of the published checkpoint."""
    outcome = None if error is None else _failure_line(error, directory, step, marker, temporary) or ""
    outcomes = [outcome]
    if world_size > 1:
        outcomes = [None] * world_size
        dist.all_gather_object(outcomes, outcome)
    line = next((found for found in outcomes if found), None)
    if line:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise SaveFailed(line)
    if error is not None:
        raise error
    if "" in outcomes:
        raise CheckpointError(f"the checkpoint of step {step} failed on rank {outcomes.index('')} (its error above)")


def _failure_line(error: BaseException, directory: Path, step: int, marker: str,
                  temporary: Optional[Path] = None) -> Optional[str]:
    """The one line of a save that failed for a reason of the machine, what to do included; None for any other
    failure. Worked out before the temporary folder is removed (_probed_cause looks into it)."""
    cause = _os_error(error)
    if cause is None and temporary is not None and isinstance(error, CheckpointException):
        cause = _probed_cause(temporary)
    if cause is None:
        return None
    if cause.errno == errno.ENOENT and not directory.is_dir():
        return (f"the checkpoint folder {directory} disappeared while the checkpoint of step {step} was written "
                "(removed or moved, perhaps with its run directory): the run stops")
    previous = complete_checkpoints(directory, marker)
    resume = (f"the newest complete checkpoint, {previous[-1][1]}, is intact and the same command resumes from it"
              if previous else "there is no earlier checkpoint: the same command starts the run over")
    fewer = " or keep fewer checkpoints (trainer.checkpoint.keep_last)" if cause.errno in FULL else ""
    return (f"cannot save the checkpoint of step {step} in {directory}: {write_failure(cause)}; what was written of "
            f"it is removed and the run stops; {resume}. To save there, "
            f"{write_fix(cause, 'set trainer.checkpoint.dir to a folder')}{fewer}")


def _os_error(error: BaseException) -> Optional[OSError]:
    """The OSError behind `error`: itself, or one it was raised over (torch.save's zip writer raises a RuntimeError
    over a failed write), or in a CheckpointException's failures (rank: exception, or (exception, traceback))."""
    pending, seen = [error], set()
    while pending:
        found = pending.pop(0)
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno is not None:
            return found
        pending += [found.__cause__, found.__context__]
        for failure in getattr(found, "failures", {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


LOW_SPACE = 64 << 20  # bytes: a filesystem with less left after a failed write was filled by it


def _probed_cause(temporary: Path) -> Optional[OSError]:
    """Why a save's writers failed, from what its folder shows, where their own errors did not come back: an error
    sent from another process loses the OSError it was raised over (megatron-core writes in forked processes; DCP
    gathers every rank's). A file at this process's file-size limit: EFBIG; a filesystem about full: ENOSPC."""
    if not temporary.is_dir():
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    sizes = [entry.stat().st_size for entry in temporary.iterdir() if entry.is_file()]
    if limit != resource.RLIM_INFINITY and any(size >= limit for size in sizes):
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    space = os.statvfs(temporary)
    free = (space.f_bfree if os.geteuid() == 0 else space.f_bavail) * space.f_frsize  # root may use the reserve
    if free < LOW_SPACE:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def read_manifest(folder: Path) -> Optional[dict[str, dict]]:
    """The files a checkpoint's manifest lists; None when it has none (an older engine's checkpoint). A manifest
    that cannot be read is itself damage: CheckpointDamaged."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {str(name): {"bytes": int(entry["bytes"]), "sha256": str(entry["sha256"])} for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointDamaged(f"{path} cannot be read ({type(error).__name__})") from None


def verify_files(folder: Path, files: dict[str, dict], rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with this process's share of the files a manifest lists (sizes first: cheap)."""
    problems = []
    for name in sorted(files)[rank::world_size]:
        path, expected = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{name} is {path.stat().st_size} bytes, {expected['bytes']} when saved")
        elif _digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{name} does not match its checksum")
    return problems


class CheckpointDamaged(Exception):
    """A checkpoint's files are not what was saved: the resume falls back to an older one."""


def move_aside(path: Path) -> Path:
    """A damaged checkpoint renamed out of the way (never read, never pruned), not deleted: nothing is lost."""
    target = path.with_name(f"{path.name}.damaged")
    if target.exists():  # the same step damaged before
        target = path.with_name(f"{path.name}.damaged-{os.getpid()}")
    os.rename(path, target)
    return target


def read_marker(path: Path) -> dict:
    """A checkpoint's small torch.save file (step, config, ...), or CheckpointDamaged when it cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, AttributeError) as error:
        raise CheckpointDamaged(f"{path.name} cannot be read ({type(error).__name__})") from None
    if not isinstance(state, dict) or "config" not in state:
        raise CheckpointDamaged(f"{path.name} holds no checkpoint state")
    return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: Path, keep_last: int, marker: str) -> None:
    """Keep the newest `keep_last` checkpoints (all when 0) and remove the leftovers of killed saves."""
    for entry in directory.glob("step_*.tmp-*"):  # one writer per run: any other is a killed save's
        shutil.rmtree(entry, ignore_errors=True)
    complete = complete_checkpoints(directory, marker)
    if keep_last > 0:
        for _, path in complete[:-keep_last]:
            shutil.rmtree(path)


# ---- resuming ----


def newest_intact(directory: Path, marker: str, cfg: Config, rank: int = 0,
                  world_size: int = 1) -> Optional[tuple[int, Path, dict]]:
    """(step, folder, marker state) of the newest intact checkpoint in `directory`, checked against `cfg`; None
    when there is none. Each one is verified against its manifest first (every rank a share of the files); a
    damaged one is moved aside with a line saying so and the next older one is tried. Raises CheckpointError when
    checkpoints exist but none is intact, or when this run cannot continue from the newest intact one. A
    collective when world_size > 1."""
    damaged: list[Path] = []
    for step, path in reversed(complete_checkpoints(directory, marker)):
        state, problems = _read_verified(path, marker, rank, world_size)
        if problems:
            damaged.append(path)
            if rank == 0:
                print(f"checkpoint {path} is damaged ({'; '.join(problems)}): not used", flush=True)
            continue
        check_resumable(state["config"], step, cfg, path)
        if damaged and rank == 0:
            aside = [str(move_aside(folder)) for folder in damaged]
            print(f"falling back to the newest intact checkpoint, {path}; the damaged one(s) moved aside to "
                  f"{', '.join(aside)}", flush=True)
        if world_size > 1:
            dist.barrier()  # rank 0 has moved the damaged ones before anyone saves next to them
        return step, path, state
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {directory}: {', '.join(p.name for p in damaged)} damaged (above). Move them "
            f"away to start this run over, or use a new run.dir."
        )
    return None


def _read_verified(path: Path, marker: str, rank: int, world_size: int) -> tuple[Optional[dict], list[str]]:
    """The marker's state and what is wrong with the checkpoint's files, the same list on every rank: its
    manifest (each rank checks a share of the files), then the marker itself. An older checkpoint without a
    manifest is read unverified."""
    state = None
    try:
        files = read_manifest(path)
        problems = [] if files is None else verify_files(path, files, rank, world_size)
        if not problems:
            state = read_marker(path / marker)
    except CheckpointDamaged as error:
        problems = [str(error)]
    if world_size > 1:
        shares: list[Any] = [None] * world_size
        dist.all_gather_object(shares, problems)
        problems = [problem for share in shares for problem in share]
    return state, problems


def check_before_launch(cfg: Config, run_dir: Path, marker: str) -> Optional[int]:
    """Refuse, before the launcher writes anything into `run_dir`, a run that could not continue from the newest
    readable checkpoint there (another model, precision, data, ...), as the engine would after overwriting
    config.yaml. Returns the step the run continues from (None: it starts from scratch). Reads only the marker
    files (step and config), never the shards."""
    for step, path in reversed(complete_checkpoints(checkpoint_dir(cfg, run_dir), marker)):
        try:
            saved = read_marker(path / marker)
        except CheckpointDamaged:
            continue  # the engine falls back past it
        check_resumable(saved["config"], step, cfg, path)
        return step
    return None


def check_resumable(saved: dict, step: int, cfg: Config, path: Path) -> None:
    """Raise CheckpointError when this run cannot continue from the checkpoint of `step` at `path`."""
    check_compatible(saved, cfg, path)
    if step > cfg.trainer.max_steps:
        raise CheckpointError(
            f"cannot resume from {path}: it is at step {step}, past trainer.max_steps={cfg.trainer.max_steps}. "
            f"Set trainer.max_steps >= {step}, or use a new run.dir."
        )


def check_compatible(saved: dict, cfg: Config, path: Path) -> None:
    """Raise CheckpointError when the checkpoint was written with a different model, precision or data order."""
    current = to_dict(cfg)
    differences = [
        f"{name}={before!r} in the checkpoint, {after!r} now"
        for key in MUST_MATCH
        for name, before, after in _walk({key: _get(saved, key)}, {key: _get(current, key)}, "")
    ]
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: this run's config differs from the one that wrote it ("
            + "; ".join(differences)
            + f"). Use a new run.dir for a different run, or delete {path.parent} to start this one over."
        )


def changed_settings(saved: dict, cfg: Config) -> list[str]:
    """Settings that differ from the checkpoint's but may (max_steps, intervals, ...), for the resume message."""
    return [f"{name} {before!r} -> {after!r}" for name, before, after in _walk(saved, to_dict(cfg), "")]


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _walk(before: dict, after: dict, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, before, after) of every leaf that differs."""
    changes = []
    for key in sorted(set(before) | set(after)):
        name = f"{prefix}.{key}" if prefix else key
        b, a = before.get(key), after.get(key)
        if isinstance(b, dict) and isinstance(a, dict):
            changes += _walk(b, a, name)
        elif b != a:
            changes.append((name, b, a))
    return changes


def resume_metrics(run_dir: Path, step: int, checkpoint: Optional[Path] = None) -> list[StepMetrics]:
    """Cut `metrics.jsonl` back to the steps <= `step` (a run that crashed after its last checkpoint wrote later
    steps, which the resumed run writes again) and return what is kept. step 0: a run that starts over. Where the
    file lacks some of those steps (removed, cut short) and `checkpoint`, the folder of the checkpoint resumed from,
    holds its copy of them all (recipes.trainer.loop.save), the copy is restored, saying so."""
    path = run_dir / METRICS
    check_regular_or_absent(path)  # a link is neither read nor written through, a FIFO never waited on
    lines = path.read_text().splitlines() if path.exists() else []
    kept = _steps_up_to(lines, step)
    copy = checkpoint / METRICS if checkpoint is not None else None
    if [record["step"] for _, record in kept] != list(range(1, step + 1)) and copy is not None and copy.is_file():
        check_regular_or_absent(copy)
        restored = _steps_up_to(copy.read_text().splitlines(), step)
        if [record["step"] for _, record in restored] == list(range(1, step + 1)):
            print(f"{METRICS}: held {len(kept)} of steps 1..{step}; restored them from {copy}", flush=True)
            kept, lines = restored, []
    if len(kept) != len(lines):
        _write_metrics(path, "".join(line + "\n" for line, _ in kept))
        if lines:
            print(f"{METRICS}: dropped {len(lines) - len(kept)} line(s) after step {step}", flush=True)
    history = [StepMetrics(**record) for _, record in kept]
    if [m.step for m in history] != list(range(1, step + 1)):
        print(f"warning: {path} does not hold exactly steps 1..{step}; summary.json covers those it holds", flush=True)
    return history


def _write_metrics(path: Path, text: str) -> None:
    try:
        write_file(path, text)
    except OSError as error:
        raise WriteFailed(f"cannot write {path} to resume the run: {write_failure(error)}; no step was run. To "
                          f"go on, {write_fix(error, 'move the run directory to a folder')}") from None


def _steps_up_to(lines: list[str], step: int) -> list[tuple[str, dict]]:
    """The lines of metrics.jsonl of steps <= `step`, each with its record; torn lines left out."""
    records = [(line, _record(line)) for line in lines]
    return [(line, record) for line, record in records if record is not None and record["step"] <= step]


def _record(line: str) -> Optional[dict]:
    """A metrics line parsed, its step an int; None for a line torn by a kill in the middle of its write."""
    try:
        record = json.loads(line)
        record["step"] = int(record["step"])
    except (ValueError, KeyError, TypeError):
        return None
    return record
