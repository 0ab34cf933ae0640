"""The profiled steps' kernel time by kernel name (recipes.profiling's categories as of this commit), re-derived from
the 30 largest kernels each profile kept: the profiles' own "ms" split was made with CPU-range regions that counted
kernels twice on the H200 (see docs/results/README.md), while each top kernel's time is the profiler's own.

    python docs/results/h200_whole_step/split_from_top_kernels.py      (with the project installed: pip install -e .)
"""

import json
from pathlib import Path

from recipes.profiling import CATEGORY_NAMES, kernel_category

HERE = Path(__file__).parent
COLUMNS = [c for c in CATEGORY_NAMES if c not in ("communication", "other")]


def split(path: Path) -> dict:
    profile = json.loads(path.read_text())
    by = {c: 0.0 for c in CATEGORY_NAMES}
    for kernel in profile["top_kernels"]:
        # Names are kept to 120 characters, which can cut "FusedAdam..." off PyTorch's Adam kernel; the profile's
        # own category, taken from the whole name, says "optimizer" where its code had that category (not 6ab39a5).
        name_says = kernel_category(kernel["name"])
        by["optimizer" if kernel["category"] == "optimizer" else name_says] += kernel["ms"]
    top = sum(k["ms"] for k in profile["top_kernels"])
    return {**by, "rest": profile["total_ms"] - top, "total": profile["total_ms"]}


print("| run | " + " | ".join(COLUMNS) + " | other (top 30) | beyond the top 30 | all kernels |")
print("|---|" + "---|" * (len(COLUMNS) + 3))
for path in sorted(HERE.glob("*_call/profiles/*.json")) + [HERE / "nemotron_call" / "time_rank0.json"]:
    s = split(path)
    name = path.stem if path.parent.name == "profiles" else "torch-nemotron4_15b-fp8_current"
    print(f"| {path.parts[-3] if path.parent.name == 'profiles' else 'nemotron_call'}/{name} | "
          + " | ".join(f"{s[c]:.1f}" for c in COLUMNS) + f" | {s['other']:.1f} | {s['rest']:.1f} | {s['total']:.1f} |")
