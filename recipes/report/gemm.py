"""The GEMM benchmark's CSV -> FP8 speedup over BF16 per GEMM shape and K (the study's GEMM figure).

Read by column name, case and punctuation ignored, one row per (shape, variant):
- K (required), M and N (optional), a shape or model name (optional: `shape`, `model`, `case`, `sweep`);
- the variant (required): `variant`, `recipe`, `scaling`, `granularity`, `kind`, `method` or `dtype`;
  the row whose variant is `bf16` (or `bfloat16`) is the baseline of its shape and K;
- TFLOP/s (`tflops`, `tflop/s`, ...) and/or `speedup`; a speedup column wins, else TFLOP/s / BF16's.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Optional

VARIANT_COLUMNS = ["variant", "recipe", "scaling", "granularity", "kind", "method", "dtype"]
GROUP_COLUMNS = ["shape", "model", "case", "sweep"]
BF16 = {"bf16", "bfloat16"}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _float(text: Optional[str]) -> Optional[float]:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_gemm_csv(path: Path, where: str) -> tuple[list[dict], list[str]]:
    try:
        with path.open(newline="", errors="replace") as f:
            table = list(csv.DictReader(f))
    except (OSError, csv.Error) as error:
        return [], [f"{where}: not read ({error}); no GEMM figure"]
    columns = {_key(c): c for c in (table[0].keys() if table else []) if c}
    k_col = columns.get("k")
    variant_col = next((columns[c] for c in VARIANT_COLUMNS if c in columns), None)
    tflops_col = next((columns[c] for c in columns if c.startswith("tflop")), None)
    speedup_col = next((columns[c] for c in columns if c.startswith("speedup")), None)
    if not (k_col and variant_col and (tflops_col or speedup_col)):
        return [], [f"{where}: needs columns K, a variant (e.g. 'variant') and 'tflops' or 'speedup'; no GEMM figure"]
    group_col = next((columns[c] for c in GROUP_COLUMNS if c in columns), None)

    rows, skipped = [], []
    for line_no, row in enumerate(table, 2):
        k = _float(row.get(k_col))
        variant = (row.get(variant_col) or "").strip().lower()
        tflops = _float(row.get(tflops_col)) if tflops_col else None
        speedup = _float(row.get(speedup_col)) if speedup_col else None
        if k is None or not variant or (tflops is None and speedup is None):
            skipped.append(line_no)
            continue
        group = tuple(row.get(columns[c], "") if c in columns else "" for c in ("m", "n"))
        label = (row.get(group_col) or "").strip() if group_col else ""
        rows.append(
            {
                "variant": variant,
                "k": int(k),
                "m": group[0],
                "n": group[1],
                "group": (label, *group),
                "tflops": tflops,
                "speedup": speedup,
            }
        )
    baseline = {(r["group"], r["k"]): r["tflops"] for r in rows if r["variant"] in BF16}
    for r in rows:
        if r["variant"] in BF16:
            r["variant"], r["speedup"] = "bf16", 1.0
        elif r["speedup"] is None and r["tflops"] is not None and baseline.get((r["group"], r["k"])):
            r["speedup"] = r["tflops"] / baseline[(r["group"], r["k"])]
    notes = (
        [f"{where}: skipped {len(skipped)} row(s) without a numeric K, a variant or a TFLOP/s ({skipped[:5]})"]
        if skipped
        else []
    )
    return rows, notes


def group_name(group: tuple) -> str:
    label, m, n = group
    return " ".join(p for p in (label, f"{m}x{n}" if m or n else "") if p) or "-"


def gemm_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per (shape, K): each variant's speedup over BF16 (and its TFLOP/s where known)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cells: dict[tuple, dict[str, str]] = {}
    for r in rows:
        text = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        if r["tflops"] is not None:
            text = f"{text} ({r['tflops']:.0f})".strip()
        cells.setdefault((r["group"], r["k"]), {})[r["variant"]] = text or "unknown"
    headers = ["shape", "K"] + [f"{v} speedup (TFLOP/s)" for v in variants]
    out = []
    for (group, k), by_variant in cells.items():
        out.append([group_name(group), str(k)] + [by_variant.get(v, "") for v in variants])
    return headers, out
