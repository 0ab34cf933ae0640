"""Compare runs: throughput and loss of each FP8 recipe against BF16, from run directories or raw training logs.

inputs.py    find runs in the inputs (run directories, nemo-run experiments, Slurm logs with requeues)
parse.py     the one interface to the readers of formats/, one module per format family (Megatron-LM/Bridge/Primus,
             Megatron-DeepSpeed, NeMo 2/1, torchtitan, run directories): files -> per-step records, each value with
             the line or key it was read from (launchers' line prefixes stripped first: formats/prefixes.py)
metadata.py  what each run was (model, precision, GPU, layout, batch), source by source
table.py     warm-up, steady-state medians (never from a handful), run states, BF16 baselines, speedups, loss gaps,
             the divergence alarm, seeds
published.py NVIDIA's published throughput (nvidia_published.yaml) for each run
plots.py     the study's figures;  gemm.py  the GEMM benchmark's CSV
render.py    report.md, report.html, results.csv;  report.py  all of it, as `scripts/compare.py` runs it
"""

from recipes.report.report import EXIT_FLAGGED, EXIT_OK, EXIT_USAGE, UsageError, build_report

__all__ = ["build_report", "UsageError", "EXIT_OK", "EXIT_FLAGGED", "EXIT_USAGE"]
