"""From command-line inputs to runs: run directories, nemo-run experiments (any folder tree), raw log files.

- A folder with a metrics.jsonl is a run directory of this project (config.yaml and summary.json beside it);
  log files inside it are not read again.
- Any other folder (a nemo-run experiment, a folder of Slurm logs) is searched for run directories and for log
  files (*.out, *.err, *.log, *.txt).
- A *.jsonl file is a metrics file; any other file is a log.
- Slurm logs `log-<name>_<jobid>_<restart>.out|.err` of one job name in one folder are one run: a requeued or
  resubmitted job writes a new file and redoes the steps since its checkpoint; files are read in (job id,
  restart) order and for a step logged more than once the newest file wins.
- A nemo-run task keeps its command in `<task>/configs/<task>_config.yaml`; when an argument of that command is a
  resolved config.yaml with a metrics.jsonl beside it (this project's engines), that folder is the task's run
  directory, read instead of the task's console logs. Given a folder that holds nemo-run's home (runs/, which holds
  runs/nemo-run), a run directory outside that folder (run.dir=/elsewhere) is not read, nor are its task's logs:
  the folder's report covers what is in it (noted; give it as an input). Given nemo-run's home or a folder inside
  it, its records lead wherever their run directories are.
- stdout.log and stderr.log of one folder (nemo-run's local executor) are one run, named after its folders; where
  the folder also holds combined.log (both streams), only that is read.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from recipes.report import metadata
from recipes.report.formats.base import UnusableFile, file_problem, read_input, system_reason
from recipes.report.parse import FileRead, read_log, read_metrics_jsonl
from recipes.report.records import Run, lines_of, merge_steps
from recipes.run_files import CONFIG, METRICS, SLURM_LOG, SUMMARY, TRAIN_LOG, slurm_log_stem

LOG_SUFFIXES = {".out", ".err", ".log", ".txt"}
LOCAL_LOG = re.compile(r"^(?P<stream>combined|stdout|stderr)\.log$")  # nemo-run local: <task>/<app>/<role>/<n>/
# Both engines' line on a resume (recipes/engine/torch_engine.py, recipes/megatron/engine.py): metrics.jsonl is cut
# back to the checkpoint and goes on, so only the job's log (train.log, gathered from Slurm) shows that it resumed.
RESUMING = re.compile(r"^resuming from step (?P<step>\d+) of ", re.M)
ENGINE_OF_FORMAT = {"megatron": "megatron", "nemo2": "nemo", "nemo1": "nemo", "torchtitan": "torchtitan"}


class InputError(ValueError):
    """An input that does not exist or cannot be read: a usage error."""


@dataclass
class Source:
    kind: str  # "run_dir" (a folder with metrics.jsonl), "jsonl" (a metrics file), "logs"
    paths: list[Path]  # the run folder, the metrics file, or the log files in the order they were written
    name: str  # the run's default name; file-name tokens are read from it
    root: Path  # a log's resolved config is searched for from its folder up to here


def find_sources(inputs: list[str], base: Path) -> tuple[list[Source], list[str]]:
    """Inputs (paths relative to base, or absolute) -> sources, and notes on what was left out. Raises
    InputError."""
    run_dirs: list[tuple[Path, Path]] = []  # (folder, root)
    jsonl_files: list[Path] = []
    log_files: list[tuple[Path, Path]] = []
    tasks_with_run_dirs: set[Path] = set()
    notes: list[str] = []
    for given in inputs:
        path = _given_path(given, base)
        if path.is_dir() and (path / METRICS).is_file():
            run_dirs.append((path, path))
        elif path.is_dir():
            for folder, subfolders, files in os.walk(path):
                subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
                folder_path = Path(folder)
                if METRICS in files:
                    run_dirs.append((folder_path, path))
                    subfolders[:] = []
                    continue
                log_files += [(folder_path / f, path) for f in sorted(files) if Path(f).suffix in LOG_SUFFIXES]
                if folder_path.name == "configs":
                    found = _nemo_run_run_dirs(folder_path, files)
                    inside = [run_dir for run_dir in found
                              if path in run_dir.parents or _inside_nemo_run_home(path, folder_path)]
                    run_dirs += [(run_dir, run_dir) for run_dir in inside]
                    notes += [f"{display_path(folder_path.parent, base)}: its run directory {run_dir} is outside "
                              f"{given}: not read (give it as an input)" for run_dir in found if run_dir not in inside]
                    if found:
                        tasks_with_run_dirs.add(folder_path.parent)
        elif path.suffix == ".jsonl":
            jsonl_files.append(path)
        elif not os.access(path, os.R_OK):
            raise InputError(f"{given}: not readable")
        else:
            log_files.append((path, path.parent))

    sources: list[Source] = []
    seen: set[Path] = set()
    for folder, root in run_dirs:
        if folder not in seen:
            seen.add(folder)
            sources.append(Source("run_dir", [folder], folder.name, root))
    for path in jsonl_files:
        if path.parent not in seen and path not in seen:
            seen.add(path)
            sources.append(Source("jsonl", [path], path.parent.name, path.parent))
    unique_logs = []
    for path, root in log_files:
        if path not in seen and not tasks_with_run_dirs.intersection(path.parents):
            seen.add(path)
            unique_logs.append((path, root))
    return sources + _group_logs(unique_logs), notes


def _given_path(given: str, base: Path) -> Path:
    """An input's absolute path, its links followed; InputError unless it names a folder or a file read_input
    takes (a FIFO, a device, a link loop or a file past the size bound is refused here, before any is read)."""
    try:
        path = (base / given).resolve()
        info = path.stat()
    except RuntimeError:  # what Python before 3.13 raises on a symbolic link loop (3.13: ELOOP from stat)
        raise InputError(f"{given}: a symbolic link loop") from None
    except OSError as error:
        raise InputError(f"{given}: {system_reason(error)}") from None
    problem = None if stat.S_ISDIR(info.st_mode) else file_problem(info)
    if problem:
        raise InputError(f"{given}: {problem}; give a run directory, a folder to search or a log file")
    return path


def _inside_nemo_run_home(given: Path, configs: Path) -> bool:
    """The folder given is nemo-run's own (its home, experiments/, an experiment or a task of this record): its
    records are what was asked for, wherever their run directories are."""
    home = next((folder.parent for folder in configs.parents if folder.name == "experiments"), None)
    return home is not None and (given == home or home in given.parents)


def _nemo_run_run_dirs(configs: Path, files: list[str]) -> list[Path]:
    found = []
    for name in sorted(f for f in files if f.endswith("_config.yaml")):
        try:
            task = yaml.safe_load(read_input(configs / name).decode(errors="replace"))
        except (UnusableFile, yaml.YAMLError):
            continue
        args = task.get("args") if isinstance(task, dict) else None
        for arg in args if isinstance(args, list) else []:
            config = Path(str(arg))
            if config.name == CONFIG and config.is_absolute() and (config.parent / METRICS).is_file():
                found.append(config.parent.resolve())
    return found


def _group_logs(files: list[tuple[Path, Path]]) -> list[Source]:
    groups: dict[tuple[Path, str], list[tuple[tuple, Path, Path]]] = {}
    singles: list[Source] = []
    for path, root in files:
        match = SLURM_LOG.match(path.name)
        if match:
            order = (int(match["job"]), int(match["restart"]), match["stream"] == "err")
            groups.setdefault((path.parent, match["name"]), []).append((order, path, root))
        elif LOCAL_LOG.match(path.name):
            if path.name != "combined.log" and (path.parent / "combined.log").is_file():
                continue  # combined.log holds both streams
            name = "-".join(path.parent.relative_to(root).parts) if root in path.parents else path.parent.name
            order = (0, 0, path.name.startswith("stderr"))
            groups.setdefault((path.parent, name or path.parent.name), []).append((order, path, root))
        else:
            singles.append(Source("logs", [path], path.stem, root))
    for (_, name), members in groups.items():
        members.sort(key=lambda member: member[0])
        paths = [p for _, p, _ in members]
        run_name = slurm_log_stem(name, members[0][0][0]) if SLURM_LOG.match(paths[0].name) else name
        singles.append(Source("logs", paths, run_name, members[0][2]))
    return singles


def display_path(path: Path, base: Path) -> str:
    try:
        return os.path.relpath(path, base)
    except ValueError:
        return str(path)


# ---- reading one source into a Run ----


def read_source(
    source: Source, labels: list[tuple[str, dict[str, Any]]], base: Path
) -> tuple[Optional[Run], list[str]]:
    """A Run with merged metadata, or None (with notes saying why) when the source holds no usable record."""
    config, summary = {}, {}
    if source.kind == "logs":
        reads = [_read(read_log, path, base) for path in source.paths]
        config_dir = _config_dir(source.paths[0].parent, source.root)
    else:
        metrics = source.paths[0] / METRICS if source.kind == "run_dir" else source.paths[0]
        reads = [_read(read_metrics_jsonl, metrics, base)]
        config_dir = metrics.parent
    notes = [note for read in reads for note in read.notes]
    if config_dir is not None:
        config, more = _load(config_dir / CONFIG, base, yaml.safe_load)
        summary, even_more = _load(config_dir / SUMMARY, base, json.loads)
        notes += more + even_more

    steps, repeats = merge_steps([read.steps for read in reads])
    if not steps:
        return None, notes
    formats = [read.format for read in reads if read.format]
    fmt = max(set(formats), key=formats.count)
    claimed = all(read.claimed for read in reads if read.format == fmt)
    if repeats:
        notes.append(f"{source.name}: {repeats} step record(s) logged again after a restart: the last one kept")

    header, header_sources = _first_header(reads)
    field_keys = {attribute: key for read in reads for attribute, key in read.field_keys.items()}
    batched = [s for s in steps if s.global_batch_size]
    file_meta, file_notes = metadata.from_file_name(source.name)
    header_meta, header_meta_sources, header_notes = metadata.from_header(
        header, header_sources, [s.global_batch_size for s in batched],
        lines_of(batched, field_keys.get("global_batch_size", "")))
    config_names = tuple(display_path(config_dir / name, base) if config_dir else name for name in (CONFIG, SUMMARY))
    config_meta, config_sources = metadata.from_config(config, summary, config_names)
    label_meta, label_sources = _label_values(source, labels, base)
    planned, planned_source = _planned(reads)
    # the length its records print (`iteration 10/ 100`): the planned steps, where nothing above says; the engine, of
    # a format this reader claims
    format_meta = {"engine": ENGINE_OF_FORMAT.get(fmt) if claimed else None, "steps": planned}
    layers = [
        ("label", label_meta),
        ("config", config_meta),
        ("header", header_meta),
        ("file name", file_meta),
        ("log format", format_meta),
    ]
    meta, origin = metadata.merge(layers)
    details = {
        "label": label_sources,
        "config": config_sources,
        "header": header_meta_sources,
        "file name": {key: f"file name {source.name}" for key in file_meta},
        "log format": {"engine": f"its {fmt} records ({lines_of(steps[:1])})", "steps": planned_source},
    }
    provenance = {key: summary[key] for key in ("commit", "versions", "device") if key in summary}
    unread = _unread_columns(source.name, steps, {key for read in reads for key in read.other_losses})
    run = Run(
        name=meta.get("name") or source.name,
        format=fmt if claimed else f"{fmt} (assumed)",
        paths=source.paths,
        steps=steps,
        meta=meta,
        meta_origin=origin,
        meta_source=metadata.sources(meta, origin, details),
        field_keys=field_keys,
        provenance=provenance,
        notes=notes + file_notes + [f"{source.name}: {note}" for note in header_notes] + unread,
        label_target=display_path(source.paths[0], base),
        skipped_records=sum(read.skipped_records for read in reads),
        resumed_at=_resumed_at(steps, reads, source),
    )
    return run, []


def _read(reader, path: Path, base: Path) -> FileRead:
    """One file's records; a file that cannot be read (formats.base.read_input) is skipped with a note saying why."""
    where = display_path(path, base)
    try:
        return reader(path, where)
    except UnusableFile as error:
        return FileRead(None, [], notes=[f"{where}: not read: {error}"])


def _planned(reads: list[FileRead]) -> tuple[Optional[int], str]:
    """The planned steps the last file's records print, and the line that prints them."""
    planned = [(read.planned_steps, read.planned_source) for read in reads if read.planned_steps]
    return planned[-1] if planned else (None, "")


def _resumed_at(steps: list, reads: list[FileRead], source: Source) -> list[int]:
    """The first step of each process after the first (a restart the records show: a step that does not advance, a
    requeue's next log file), the step a log says training started at when that is past step 1, and for a run
    directory the resumes its train.log names."""
    restarts = [record.step for record in steps[1:] if record.fresh]
    started = [read.start_step for read in reads if read.start_step and read.start_step > 1]
    log = source.paths[0] / TRAIN_LOG if source.kind == "run_dir" else None
    if log is not None and log.is_file():
        try:
            text = read_input(log).decode(errors="replace")
        except UnusableFile:  # its resumes go unmarked; the records' own restarts above still show
            text = ""
        started += [int(m["step"]) + 1 for m in RESUMING.finditer(text)]
    return sorted(set(restarts + started))


def _unread_columns(name: str, steps: list, other_losses: set[str]) -> list[str]:
    """One note per column the run's records leave empty: loss, step time (an unknown precision is noted where it
    keeps the run from a baseline: table.compare)."""
    notes = []
    for attribute, column in (("loss", "loss"), ("time_s", "step time")):
        missing = sum(getattr(record, attribute) is None for record in steps)
        if not missing:
            continue
        why = ""
        if attribute == "loss" and other_losses:
            why = f" (its records name {', '.join(sorted(other_losses))}, none of which is the training loss)"
        amount = "any" if missing == len(steps) else f"{missing} of the {len(steps)}"
        notes.append(f"{name}: no {column} read from {amount} record(s){why}")
    return notes


def _first_header(reads: list[FileRead]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each configuration key as the first file that prints it says, and its source."""
    header: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for read in reads:
        for key, value in read.header.items():
            if key not in header:
                header[key], sources[key] = value, read.header_sources.get(key, "")
    return header, sources


def _config_dir(folder: Path, root: Path) -> Optional[Path]:
    """The nearest folder from a log's folder up to the input's root that holds a config.yaml."""
    while True:
        if (folder / CONFIG).is_file():
            return folder
        if folder == root or folder.parent == folder or root not in folder.parents:
            return None
        folder = folder.parent


def _load(path: Path, base: Path, loader) -> tuple[dict, list[str]]:
    if not path.is_file():
        return {}, []
    try:
        data = loader(read_input(path).decode(errors="replace"))
    except UnusableFile as error:
        return {}, [f"{display_path(path, base)}: not read ({error}); its metadata is unknown"]
    except (ValueError, yaml.YAMLError) as error:
        return {}, [f"{display_path(path, base)}: not read ({type(error).__name__}); its metadata is unknown"]
    if not isinstance(data, dict):
        return {}, [f"{display_path(path, base)}: not a mapping; its metadata is unknown"]
    return data, []


def _label_values(source: Source, labels: list[tuple[str, dict[str, Any]]], base: Path
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """Values of every --label whose FILE matches this source (a later --label overrides an earlier one), and the
    --label each came from."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for pattern, label in labels:
        if label_matches(pattern, source, base):
            values.update(label)
            sources.update({key: f"--label {pattern}:{key}={value}" for key, value in label.items()})
    return values, sources


def label_matches(pattern: str, source: Source, base: Path) -> bool:
    """FILE names a source's file or folder, or a folder above it: by path (relative to base or absolute), by
    name, or as a glob pattern over either."""
    # os.path.realpath, not Path.resolve: a link loop stays a path that matches nothing, not a RuntimeError
    target = Path(os.path.realpath(base / pattern))
    names = [source.name]
    for path in source.paths:
        if path == target or target in path.parents:
            return True
        names.append(path.name)
        names += [name for folder in (path, *path.parents) for name in (str(folder), display_path(folder, base))]
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)
