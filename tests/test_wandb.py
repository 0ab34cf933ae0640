"""logger.wandb.project: every step's metrics reach a real W&B run (offline: no server), and a resumed run continues
the run of its run directory.

wandb is not a dependency of the project (`pip install wandb`, or `.[wandb]`), so in the project's main environment
these tests skip, saying so; there tests/test_launch.py checks the one-line refusal instead. NeMo's environment has
it: .ci/run runs this file in .venv-nemo with FP8_RECIPES_REQUIRE_NEMO=1, which turns the skip into a failure.

W&B writes an offline run into `<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`: 32 KiB blocks of records
(LevelDB's log format: checksum, length, type, then the bytes; a record may span blocks) after a 7-byte header,
each record one protobuf `Record` of wandb's own schema. `history_rows` reads the `history` records back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest

from recipes.config import Config, load_config
from recipes.metrics import MetricsWriter, StepMetrics

if importlib.util.find_spec("wandb") is None:
    reason = "wandb is not installed in this Python; .ci/run runs these tests in .venv-nemo, which has it"
    if os.environ.get("FP8_RECIPES_REQUIRE_NEMO") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)

import wandb  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

from test_checkpoint import make_config  # noqa: E402

BLOCK = 32768
HEADER = b":W&B"
FULL, LAST = 1, 4  # a record in one piece; the last piece of one that spans blocks


def history_rows(run_file: Path) -> list[dict]:
    """The `history` records of an offline W&B run file, as {key: value} rows in order."""
    data = run_file.read_bytes()
    assert data[: len(HEADER)] == HEADER, data[:8]
    rows, pos, pieces = [], 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a record header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def step(number: int) -> StepMetrics:
    return StepMetrics(step=number, loss=10.0 - number, grad_norm=1.0 / number, lr=1e-3, step_time_s=0.5,
                       tokens_per_s_per_gpu=1000.0 * number, model_tflops_per_gpu=1.0, mfu=None, peak_memory_gib=2.0)


def with_wandb(config_path: Path) -> Config:
    cfg = load_config(config_path)
    cfg.logger.wandb.project = "fp8-recipes-test"
    return cfg


def test_every_step_reaches_wandb_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = with_wandb(make_config(run_dir))
    writer = MetricsWriter(run_dir, cfg)
    for number in (1, 2, 3):
        writer.write(step(number))
    writer.close()
    resumed = MetricsWriter(run_dir, cfg, first_step=3)  # a restart from step 2's checkpoint logs step 3 again
    for number in (3, 4):
        resumed.write(step(number))
    resumed.close()
    # A training process's exit shuts W&B's service down, which writes out what its writer still holds (a run's
    # finish() may return before that); the test reads the files in the same process, so it shuts it down first.
    wandb.teardown()

    first, second = sorted((run_dir / "wandb").glob("offline-run-*"))
    run_id = first.name.split("-")[3]  # offline-run-<date>_<time>-<id>, and "-1" after it when in the same second
    assert second.name.split("-")[3] == run_id  # one W&B run per run directory
    for folder, numbers in ((first, (1, 2, 3)), (second, (3, 4))):
        rows = history_rows(folder / f"run-{run_id}.wandb")
        assert [row["_step"] for row in rows] == list(numbers)
        for row, number in zip(rows, numbers):
            expected = step(number)
            assert row["train/loss"] == expected.loss and row["train/grad_norm"] == pytest.approx(expected.grad_norm)
            assert row["train/tokens_per_s_per_gpu"] == expected.tokens_per_s_per_gpu
            assert "train/mfu" not in row  # None (no peak on a CPU): not logged, as in TensorBoard
