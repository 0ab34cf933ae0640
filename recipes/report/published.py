"""NVIDIA's published throughput beside each run: the row of nvidia_published.yaml for the run's model, GPU, GPU
count and precision, and our tokens/s/GPU over it.

- GPU: the row of the run's GPU; an H200 run takes H100's rows (NVIDIA publishes none for H200; the project's
  layouts do the same, REFERENCE.md section 5), and the cell says so.
- Precision: a row of the run's own precision first; else, for a per-tensor FP8 run (delayed or current scaling,
  or a bare "fp8"), a row whose source says only "FP8" (the cell says the recipe is not stated). BF16 has no rows.
- Of several such rows, the newest container's.
Tokens/s/GPU is the comparable figure (each tool counts model FLOPs its own way).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

DATA = Path(__file__).with_name("nvidia_published.yaml")
GPU_ROWS = {"h200": "h100"}  # a GPU NVIDIA publishes no rows for -> the GPU whose rows it takes
PER_TENSOR_FP8 = {"fp8_delayed", "fp8_current", "fp8"}


@dataclass(frozen=True)
class Published:
    row: dict[str, Any]
    document: str
    stand_in: Optional[str] = None  # "H100 rows for H200"
    recipe_not_stated: bool = False

    @property
    def tokens(self) -> float:
        return float(self.row["tokens_per_s_per_gpu"])

    def label(self) -> str:
        """Which row, in the few words a table cell holds."""
        row = self.row
        words = [f"{row['source']}, {row['gpu'].upper()} x{row['gpus']} {row['as_published']}"]
        words += [self.stand_in] if self.stand_in else []
        words += ["recipe not stated"] if self.recipe_not_stated else []
        return "; ".join(words)

    def describe(self) -> str:
        """The row in full, for the report's list of published figures used."""
        r = self.row
        layout = " ".join(f"{key.upper()}{'-' if r[key] is None else r[key]}" for key in ("tp", "pp", "cp", "vp"))
        fsdp = {True: ", FSDP", False: ", DDP", None: ""}[r["fsdp"]]
        return (f"{r['model']} on {r['gpus']} {r['gpu'].upper()}, {r['as_published']}, {layout}{fsdp}, MBS/GBS "
                f"{r['mbs']}/{r['gbs']}, seq {r['seq']}: {r['tokens_per_s_per_gpu']:,} tokens/s/GPU, "
                f"{r['tflops_per_gpu']:,} model TFLOP/s/GPU as published (container {r['container']}); "
                f"{self.document}")


@functools.lru_cache(maxsize=None)
def _table() -> tuple[tuple[dict, ...], dict]:
    data = yaml.safe_load(DATA.read_text())
    return tuple(data["rows"]), data["sources"]


def _container(row: dict) -> tuple[int, ...]:
    return tuple(int(part) for part in str(row["container"]).split("."))


def published_for(meta: dict[str, Any]) -> Optional[Published]:
    """The published row for a run's metadata, or None when none matches (or the run's model, GPU, GPU count or
    precision is unknown)."""
    model, gpu, gpus, precision = (meta.get(key) for key in ("model", "gpu", "world_size", "precision"))
    if not (model and gpu and gpus and precision):
        return None
    rows, sources = _table()
    row_gpu = GPU_ROWS.get(gpu, gpu)
    same = [row for row in rows if (row["model"], row["gpu"], row["gpus"]) == (model, row_gpu, gpus)]
    exact = [row for row in same if row["precision"] == precision]
    unstated = [row for row in same if row["precision"] == "fp8" and precision in PER_TENSOR_FP8]
    candidates = exact or unstated
    if not candidates:
        return None
    row = max(candidates, key=_container)
    stand_in = f"{row_gpu.upper()} rows for {gpu.upper()}" if row_gpu != gpu else None
    return Published(row, sources[row["source"]]["document"], stand_in,
                     recipe_not_stated=not exact and precision != "fp8")
