"""The conservative BF16 correction of docs/results/README.md: the BF16 step minus every pure cast kernel
(FP32 master weight -> BF16, BF16 weight gradient -> FP32) in its profile, and fp8_current's speedup over that.

    python docs/results/bf16_casts.py docs/results/h200_layer_bench_all/*/
"""

import csv
import json
import re
import sys
from pathlib import Path

PURE_CAST = re.compile(r"^triton_poi_fused__to_copy(_t)?_\d+$")  # Inductor's name for a cast and nothing else

if len(sys.argv) < 2:
    sys.exit("usage: python docs/results/bf16_casts.py LAYER_BENCH_DIR... (each with profiles.json and results.csv)")
print("| model | bf16 step (ms) | pure casts (ms) | fp8_current (ms) | speedup | speedup vs bf16 without casts |")
print("|---|---|---|---|---|---|")
for folder in map(Path, sys.argv[1:]):
    profiles = json.loads((folder / "profiles.json").read_text())
    steps = {(r["model"], r["precision"]): float(r["median_step_s"]) * 1e3 for r in csv.DictReader((folder / "results.csv").open())
             if r.get("median_step_s")}
    for key, profile in profiles.items():
        model, precision = key.split("/")
        if precision != "bf16" or (model, "fp8_current") not in steps:
            continue
        casts = sum(k["ms"] for k in profile["top_kernels"] if PURE_CAST.match(k["name"]))
        bf16, fp8 = steps[(model, "bf16")], steps[(model, "fp8_current")]
        print(f"| {model} | {bf16:.1f} | {casts:.1f} | {fp8:.1f} | {bf16 / fp8:.3f}x | {(bf16 - casts) / fp8:.3f}x |")
