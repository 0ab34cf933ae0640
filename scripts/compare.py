#!/usr/bin/env python
"""Compare runs: throughput and loss of each FP8 recipe against BF16, as tables and plots.

    python scripts/compare.py INPUT... --out DIR [--label FILE:key=value,...] [--gemm CSV] [--loss-tol 0.05]
    python scripts/compare.py --manifest docs/results/runs.txt [--out DIR]
    python scripts/compare.py --regenerate        # the same, for the project's docs/results/runs.txt

An INPUT is a run directory (metrics.jsonl, config.yaml, summary.json), a folder to search (a nemo-run
experiment, a folder of Slurm logs), a metrics.jsonl, or a raw Megatron-LM / Megatron-Bridge / AMD Primus /
Megatron-DeepSpeed / NeMo 2 / NeMo 1 (Lightning progress bar) / torchtitan log, its lines also behind pdsh's,
srun --label's or torchrun's prefixes (another tool's lines of Megatron's shape are read as an assumed format, for
what they state unambiguously, and said so). Each run is marked with its state (stopped on NaN/inf, incomplete,
resumed), a figure from too few records is left blank, and NVIDIA's published tokens/s/GPU for the same model, GPU,
GPU count and precision stands beside it. DIR receives report.md, report.html (self-contained), results.csv (empty
cells: unknown; beside each value a <column>_source column: the line and key, config key or derivation it came
from) and the PNG figures, each loss-curve figure with a CSV of its points.

A manifest holds the arguments of one report, one or more per line, `#` comments allowed; paths in it are
relative to the manifest's folder, and the report goes there unless it says `--out`.

Exit status: 0 report written, nothing flagged; 1 report written, a run diverged from BF16 beyond the loss
tolerance or logged a NaN/inf loss or gradient norm; 2 nothing written: a usage error (bad argument, missing input,
an input that is no regular file or folder or is larger than 2 GiB, an --out that is a file or cannot be written, a
write that failed: the previous report stays as it was) or no usable run in the inputs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from recipes.report import EXIT_USAGE, UsageError, build_report
from recipes.report.table import DEFAULT_LOSS_TOLERANCE

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = REPO_ROOT / "docs" / "results" / "runs.txt"


def report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="run directories, folders to search, log files")
    parser.add_argument("--out", help="output folder (created if missing)")
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="FILE:key=value,...",
        help="metadata for inputs matching FILE (a path, a name or a glob): model, precision, gpu, "
        "engine, nodes, gpus, world_size, tp, pp, cp, vp, dp, mbs, gbs, seq, seed, steps, params, name; "
        "wins over every other source",
    )
    parser.add_argument("--gemm", metavar="CSV", help="the GEMM benchmark's CSV, for the GEMM figure")
    parser.add_argument(
        "--loss-tol",
        type=float,
        default=None,
        metavar="REL",
        help=f"divergence alarm: relative loss difference to BF16 (default {DEFAULT_LOSS_TOLERANCE})",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    report_arguments(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--manifest", metavar="FILE", help="read the report's arguments from FILE")
    where.add_argument(
        "--regenerate", action="store_true", help=f"--manifest {DEFAULT_MANIFEST.relative_to(REPO_ROOT)}"
    )
    return parser


def read_manifest(path: Path) -> argparse.Namespace:
    manifest_parser = argparse.ArgumentParser(prog=str(path), add_help=False, exit_on_error=False)
    report_arguments(manifest_parser)
    tokens = shlex.split(path.read_text(), comments=True)
    try:
        args, unknown = manifest_parser.parse_known_args(tokens)
    except argparse.ArgumentError as error:
        raise UsageError(f"{path}: {error}") from None
    if unknown:
        raise UsageError(f"{path}: unknown arguments {unknown}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.manifest or args.regenerate:
            manifest = Path(args.manifest) if args.manifest else DEFAULT_MANIFEST
            if args.inputs or args.label or args.gemm:
                parser.error("with --manifest/--regenerate, inputs, --label and --gemm belong in the manifest")
            if not manifest.is_file():
                raise UsageError(f"{manifest}: no such manifest")
            spec = read_manifest(manifest)
            base = manifest.resolve().parent
            out = Path(args.out).resolve() if args.out else base / (spec.out or ".")
            inputs, labels, gemm = spec.inputs, spec.label, spec.gemm
            tolerance = args.loss_tol if args.loss_tol is not None else spec.loss_tol
            command = "python scripts/compare.py " + (
                "--regenerate" if args.regenerate else f"--manifest {args.manifest}"
            )
        else:
            if not args.inputs:
                parser.error("give at least one INPUT (or --manifest FILE / --regenerate)")
            if not args.out:
                parser.error("--out DIR is required")
            base, out = Path.cwd(), Path(args.out).resolve()
            inputs, labels, gemm, tolerance = args.inputs, args.label, args.gemm, args.loss_tol
            command = "python scripts/compare.py " + shlex.join(argv)
        if not inputs:
            raise UsageError("no inputs")
        status, _ = build_report(
            inputs,
            out,
            labels,
            gemm,
            loss_tolerance=DEFAULT_LOSS_TOLERANCE if tolerance is None else tolerance,
            base=base,
            command=command,
        )
    except UsageError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return status


if __name__ == "__main__":
    sys.exit(main())
