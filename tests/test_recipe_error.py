"""scripts/recipe_error.py: every precision's error against a float64 copy of the model, on the CPU.

The bands come from the formats, not from earlier runs: E4M3 keeps 3 mantissa bits, so rounding one element to it
has a relative error of at most 2**-4 (RMS about 2**-4 / sqrt(3) = 3.6%), and a GEMM's output inherits an error of
that size; BF16 (8 bits) is 16x finer. An FP8 recipe that silently ran in BF16 would show BF16's errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_recipe_errs_like_its_format_and_no_recipe_is_bf16(tmp_path):
    command = [sys.executable, str(REPO / "scripts/recipe_error.py"), "--model", "tiny_llama", "--seq-length", "128",
               "--batch", "2", "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "results.json").read_text())
    rows = {row["precision"]: row for row in record["rows"]}
    assert list(rows) == ["bf16", "fp8_current", "fp8_delayed", "fp8_blockwise (emulated)", "mxfp8 (emulated)"]
    bf16 = rows.pop("bf16")
    assert bf16["gemm_error_mean"] is None and bf16["grad_error_mean"] < 0.02
    for name, row in rows.items():
        assert 0.02 < row["gemm_error_mean"] <= row["gemm_error_max"] < 0.08, name
        assert 5 * bf16["grad_error_mean"] < row["grad_error_mean"] < 0.3, name
    # Both block recipes use power-of-two scales and E4M3 everywhere: each element rounds to the same value
    # unless its block is in E4M3's subnormal range, so their losses agree far closer than their errors.
    block, mx = rows["fp8_blockwise (emulated)"], rows["mxfp8 (emulated)"]
    assert abs(block["loss"] - mx["loss"]) < 1e-3 < abs(block["loss"] - rows["fp8_current"]["loss"])
    assert (tmp_path / "results.md").read_text().startswith("float64 loss")
    assert record["command"].startswith("python scripts/recipe_error.py --model tiny_llama")
