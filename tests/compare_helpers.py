"""What the report's test files share: the fixture logs, a quiet report into a folder, its CSV by run, one input read
into a Run, and a fixture run directory copied and cut. Expected numbers in those files are worked out by hand from
how the fixtures were written (tests/fixtures/logs/make_fixtures.py), never by calling the code under test."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from recipes.report import build_report, metadata
from recipes.report.inputs import find_sources, read_source

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "logs"
SCRIPT = REPO / "scripts" / "compare.py"


def quiet(_message: str) -> None:
    pass


def report(inputs, out, **kwargs):
    return build_report([str(FIXTURES / i) for i in inputs], out, base=REPO, log=quiet, **kwargs)


def csv_by_run(out: Path) -> dict[str, dict[str, str]]:
    with (out / "results.csv").open() as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def read_one(path: Path, labels=()):
    sources, _ = find_sources([str(path)], REPO)
    assert len(sources) == 1
    return read_source(sources[0], [metadata.parse_label(label) for label in labels], REPO)


def approx(value: str, expected: float):
    assert float(value) == pytest.approx(expected, rel=1e-9)


def copy_run(source: str, target: Path, max_steps: int | None = None, steps: int | None = None) -> Path:
    """A fixture run directory copied to `target`, its config's trainer.max_steps and its metrics cut to `steps`."""
    shutil.copytree(FIXTURES / "rundirs" / source, target)
    if max_steps is not None:
        config = target / "config.yaml"
        config.write_text(config.read_text().replace("max_steps: 20", f"max_steps: {max_steps}"))
    if steps is not None:
        metrics = target / "metrics.jsonl"
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:steps]))
    return target
