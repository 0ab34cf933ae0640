"""Launcher prefixes: what a launcher writes in front of every line of the processes it runs. They are stripped
before any family sees a line, and kept: they name the host or rank a line came from.

- pdsh, as DeepSpeed launches several nodes with it (deepspeed/launcher/multinode_runner.py `PDSHRunner`): the
  host's name, `sd-1: `;
- Slurm's `srun --label`: the task's number, `0: ` (padded with spaces to the widest);
- torchrun with `--tee` (torch.distributed.elastic's log line prefix `[{role}{rank}]:`; torchtitan's run_train.sh
  passes `--role rank`): `[rank3]:`, `[default0]:`.

`name: ` also begins a configuration line (`fp8: hybrid`, `bf16: true`), so a host's or task's prefix is taken for
a launcher's only where it labels the file: its shape (the name with its digits as `#`: `sd-#`, `#`) begins at least
a quarter of the file's non-blank lines, and at least 10 of them (a configuration key begins a line once per dump),
as pdsh and srun label every line they pass on. A name without a digit (`INFO: `, `model: `) is never a host's.
torchrun's `[rank3]:` has no other meaning and is always stripped.
"""

from __future__ import annotations

import re
from collections import Counter

HOST = re.compile(r"^\s*(?P<name>[A-Za-z0-9][\w.-]*): ")
RANK = re.compile(r"^\[(?P<name>[A-Za-z_]*\d+)\]:")
DIGITS = re.compile(r"\d+")
LABELLING_SHARE, LABELLING_LINES = 0.25, 10


def strip_launcher_prefixes(lines: list[str]) -> tuple[list[str], list[str]]:
    """The lines without their launchers' prefixes, and each line's prefixes as names (`sd-1`, `0`, `rank3`,
    `sd-1 rank3`; "" for none)."""
    shapes = _labelling_shapes(lines)
    stripped, origins = [], []
    for line in lines:
        names = []
        host = HOST.match(line)
        if host and _shape(host["name"]) in shapes:
            names.append(host["name"])
            line = line[host.end():]
        rank = RANK.match(line)
        if rank:
            names.append(rank["name"])
            line = line[rank.end():]
        stripped.append(line)
        origins.append(" ".join(names))
    return stripped, origins


def describe(origins: list[str], where: str) -> list[str]:
    """A note naming the prefixes a file's lines carried (the hosts or ranks they came from), or none."""
    counts = Counter(origin for origin in origins if origin)
    if not counts:
        return []
    named = ", ".join(f"{name} ({count})" for name, count in sorted(counts.items()))
    return [f"{where}: {sum(counts.values())} line(s) carried a launcher's prefix, read without it: {named}"]


def _shape(name: str) -> str:
    return DIGITS.sub("#", name)


def _labelling_shapes(lines: list[str]) -> set[str]:
    counts: Counter = Counter()
    written = 0
    for line in lines:
        if not line.strip():
            continue
        written += 1
        host = HOST.match(line)
        if host and DIGITS.search(host["name"]):
            counts[_shape(host["name"])] += 1
    return {shape for shape, count in counts.items() if count >= max(LABELLING_LINES, LABELLING_SHARE * written)}
