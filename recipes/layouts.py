"""NVIDIA's published per-GPU layouts (conf/layouts.yaml): look up the row of a GPU, model and precision.

`layout=published` (conf/layout/published.yaml) sets each parallel size, the batch sizes and the node count to
`${published_layout:FIELD}`, which Hydra resolves here from the composed config's gpu, model and precision. A value
given on the command line replaces the interpolation, so it wins over the row.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml

from recipes.config import CONF_DIR, ConfigError, Recipe

TABLE = CONF_DIR / "layouts.yaml"
# A row's fields; those a row leaves out take these values.
DEFAULTS = {"fsdp": False, "pp_embedding_loss_as_layers": False}
FIELDS = ("gpus", "tp", "pp", "cp", "vp", "mbs", "gbs", *DEFAULTS)


@functools.cache
def table() -> dict[str, dict]:
    """gpu -> model -> dtype key ("bf16", "fp8" or "bf16/fp8") -> row; a GPU given as another GPU's name shares
    that GPU's rows."""
    raw = yaml.safe_load(TABLE.read_text())
    return {gpu: raw[rows] if isinstance(rows, str) else rows for gpu, rows in raw.items()}


def dtype_of(recipe: str) -> str:
    """The table's dtype column of a precision recipe: every FP8 recipe runs the fp8 layout."""
    return "bf16" if recipe == "bf16" else "fp8"


def lookup(gpu: str, model: str, recipe: str) -> dict[str, Any]:
    """The published row for this GPU, model and precision recipe, with every field of FIELDS."""
    by_model = table().get(gpu)
    if by_model is None:
        raise ConfigError(f"layout=published: no published layouts for gpu={gpu}; they exist for "
                          f"{', '.join(table())}. Choose one of those, or layout=none with parallel.* of your own")
    rows = by_model.get(model)
    if rows is None:
        raise ConfigError(f"layout=published: no published layout for model={model} on gpu={gpu}; it exists for "
                          f"{', '.join(by_model)}. Use layout=none with parallel.* of your own")
    dtype = dtype_of(recipe)
    for key, row in rows.items():
        if dtype in key.split("/"):
            return {**DEFAULTS, **row}
    raise ConfigError(f"layout=published: conf/layouts.yaml has no {dtype} row for {model} on {gpu}")


def published_layout(field: str, _root_: Any) -> Any:
    """OmegaConf resolver `${published_layout:FIELD}`: FIELD of the composed config's row, and `nodes`, the
    published GPU count over the GPU type's GPUs per node."""
    gpu = _root_.gpu
    if gpu.name == "auto":
        raise ConfigError("layout=published needs a named GPU (gpu=h100, h200, b200 or gb200), not gpu=auto")
    row = lookup(gpu.name, _root_.model.name, Recipe(_root_.precision.recipe).value)
    if field == "nodes":
        return row["gpus"] // gpu.gpus_per_node
    return row[field]
