"""Inputs -> runs -> comparison -> report.md, report.html, results.csv and the figures in one folder."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from recipes.folders import UnsafeFile, check_regular_or_absent, write_file
from recipes.metrics import write_failure, write_fix
from recipes.report import gemm, plots, render, table
from recipes.report.inputs import InputError, Source, display_path, find_sources, label_matches, read_source
from recipes.report.metadata import LabelError, parse_label
from recipes.report.records import Run

# 0: report written, nothing flagged. 1: report written, a run diverged from BF16 or went NaN/inf (its loss or
# gradient norm). 2: bad arguments, an --out that cannot be written (before or while writing), or no usable run (no
# report written).
EXIT_OK, EXIT_FLAGGED, EXIT_USAGE = 0, 1, 2
# Figures this tool writes; an earlier report's are removed as the new one moves in, so that none is left stale.
FIGURE_PATTERNS = ["speedup_vs_model_size.png", "loss_curves_*.png", "loss_curves_*.csv", "gemm_speedup_vs_k.png"]


class UsageError(ValueError):
    """Bad arguments or inputs, or an --out that cannot be written: the CLI exits with status 2."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def build_report(
    inputs: Sequence[str],
    out: Path,
    labels: Sequence[str] = (),
    gemm_csv: Optional[str] = None,
    loss_tolerance: float = table.DEFAULT_LOSS_TOLERANCE,
    base: Optional[Path] = None,
    command: str = "scripts/compare.py",
    log: Callable[[str], None] = _stderr,
) -> tuple[int, list[table.Result]]:
    """Write the report into `out`; returns (exit status, results). Raises UsageError for bad arguments."""
    base = (base or Path.cwd()).resolve()
    try:
        parsed_labels = [parse_label(text) for text in labels]
        sources, source_notes = find_sources(list(inputs), base)
    except (LabelError, InputError) as error:
        raise UsageError(str(error)) from None
    for pattern, _ in parsed_labels:
        if not any(label_matches(pattern, source, base) for source in sources):
            raise UsageError(f"--label {pattern}: matches no input")
    gemm_path = (base / gemm_csv) if gemm_csv else None
    if gemm_path is not None and not gemm_path.is_file():
        raise UsageError(f"--gemm {gemm_csv}: no such file")
    if not loss_tolerance > 0:
        raise UsageError(f"--loss-tol {loss_tolerance}: must be > 0")
    _check_out(out)

    runs, notes = _read_runs(sources, parsed_labels, base, log)
    notes = source_notes + notes
    if not runs:  # nothing to report: no report (an empty one would pass for a result)
        for note in notes:
            log(note)
        log(f"no usable run in the inputs ({len(sources)} file(s) or folder(s) found): no report written")
        return EXIT_USAGE, []
    results = table.compare(runs, loss_tolerance)
    try:
        with _staged(out) as folder:
            figures, flags = _write_report(results, folder, notes, gemm_path, loss_tolerance, base, command)
    except OSError as error:  # ENOSPC, EFBIG, EROFS, EACCES: the previous report, if any, is left as it was
        raise UsageError(f"--out {out}: the report could not be written, {write_failure(error)}, and nothing there "
                         f"was changed; {write_fix(error, 'give an --out')}") from None
    except UnsafeFile as error:
        raise UsageError(f"--out {out}: {error}") from None
    log(f"wrote {out}/: report.md, report.html, results.csv and {len(figures)} figure(s) (with their data as CSV)")
    for flag in flags:
        log(f"FLAGGED {flag}")
    return (EXIT_FLAGGED if flags else EXIT_OK), results


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A new folder inside `out` to write the report into; once every file is written they are renamed into `out`
    (_move_in). A write that fails (a full disk, a file-size limit, a read-only filesystem) leaves no part of the
    new report and the previous one as it was; an `out` made here is removed again."""
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # innermost first
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".compare-", dir=out))  # same filesystem: a rename moves it in
        try:
            yield staging
            _move_in(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        for folder in made:
            with suppress(OSError):  # not empty: something else wrote there meanwhile, and it stays
                folder.rmdir()
        raise


def _move_in(staging: Path, out: Path) -> None:
    """The staged files renamed into `out` (a rename needs no space), an earlier report's figures removed first.
    UnsafeFile, before anything is moved, where a report file's name in `out` is a link, a FIFO or a folder."""
    names = sorted(path.name for path in staging.iterdir())
    for name in names:
        check_regular_or_absent(out / name)
    for pattern in FIGURE_PATTERNS:
        for stale in out.glob(pattern):
            stale.unlink()
    for name in names:
        os.replace(staging / name, out / name)


def _write_report(results: list[table.Result], out: Path, notes: list[str], gemm_path: Optional[Path],
                  loss_tolerance: float, base: Path, command: str) -> tuple[list[render.Figure], list[str]]:
    """report.md, report.html, results.csv and the figures, written into `out`; returns the figures and the flags."""
    figures = _figures(results, out, loss_tolerance)
    gemm_table = None
    if gemm_path is not None:
        rows, gemm_notes = gemm.read_gemm_csv(gemm_path, display_path(gemm_path, base))
        notes = notes + gemm_notes
        figure = plots.gemm_speedup_vs_k(rows, out / "gemm_speedup_vs_k.png")
        if figure:
            figures.append(render.Figure("GEMM speedup vs K", figure, f"From {display_path(gemm_path, base)}."))
        gemm_table = gemm.gemm_table(rows) if rows else None

    flags = [f"{r.run.name}: {flag}" for r in table.flagged(results) for flag in r.flags]
    seeds, seed_notes = table.across_seeds(results, loss_tolerance)
    report = render.Report(
        command=command,
        rules=table.rules(loss_tolerance),
        results=table.display_rows(results),
        flags=flags,
        seeds=seeds,
        seeds_rule=table.SEEDS_RULE,
        figures=figures,
        gemm=gemm_table,
        provenance=_provenance(results, base),
        published=sorted({r.published.describe() for r in results if r.published}),
        notes=notes + seed_notes + [note for r in results for note in r.run.notes]
        + [f"{r.run.name}: {r.note}" for r in results if r.note],
    )
    write_file(out / "report.md", render.markdown(report))
    write_file(out / "report.html", render.html_page(report))
    render.write_csv(out / "results.csv", table.CSV_HEADERS, table.csv_rows(results, lambda p: display_path(p, base)))
    return figures, flags


def _check_out(out: Path) -> None:
    """--out is a folder this process can write, or can be made one (checked before anything is read, so that a
    bad --out is a usage error, never a traceback after the work)."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise UsageError(f"--out {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {existing} is not writable")


def _read_runs(sources: list[Source], labels, base: Path, log) -> tuple[list[Run], list[str]]:
    runs: list[Run] = []
    notes: list[str] = []
    names: dict[str, int] = {}
    for source in sources:
        where = display_path(source.paths[0], base) + (
            f" (+{len(source.paths) - 1} more)" if len(source.paths) > 1 else ""
        )
        run, skipped = read_source(source, labels, base)
        notes += skipped
        if run is None:
            log(f"skipped {where}: no training records")
            continue
        names[run.name] = names.get(run.name, 0) + 1
        if names[run.name] > 1:
            run.name = f"{run.name}#{names[run.name]}"
        m = run.meta
        log(
            f"read {where}: {run.format}, {len(run.steps)} records to step {run.steps[-1].step}, "
            f"{m.get('model', 'model?')} {m.get('precision', 'precision?')} on {m.get('gpu', 'gpu?')}"
        )
        runs.append(run)
    return runs, notes


def _figures(results: list[table.Result], out: Path, tolerance: float) -> list[render.Figure]:
    figures = []
    path = plots.speedup_vs_model_size(results, out / "speedup_vs_model_size.png")
    if path:
        figures.append(
            render.Figure(
                "Speedup over BF16 vs model size",
                path,
                "Median step time of BF16 over that of each recipe, same model, GPU, layout and batch.",
            )
        )
    used: set[str] = set()
    for baseline in results:
        others = [r for r in results if r.baseline is baseline]
        if not baseline.is_bf16 or not others:
            continue
        m = baseline.meta
        name = plots.safe_name("loss_curves", m.get("model"), m.get("gpu"), baseline.run.name)
        while name in used:
            name += "_"
        used.add(name)
        curves = plots.loss_curve_data(baseline, others)
        path = plots.loss_curves(curves, out / f"{name}.png", tolerance)
        data = plots.write_curve_csv(curves, out / f"{name}.csv")
        figures.append(
            render.Figure(
                f"Loss vs BF16: {m.get('model')} on {m.get('gpu')} ({baseline.run.name})",
                path,
                f"Bottom: relative difference to BF16; dashed: the divergence tolerance ±{tolerance:.1%}. "
                f"Every point of every line: {data.name}.",
            )
        )
    return figures


def _provenance(results: list[table.Result], base: Path) -> render.Table:
    headers = ["run", "read from", "format", "run state", "metadata from", "commit", "versions"]
    rows = []
    for r in results:
        by_origin: dict[str, list[str]] = {}
        for key, origin in r.run.meta_origin.items():
            by_origin.setdefault(origin, []).append(key)
        origins = "; ".join(f"{origin}: {', '.join(keys)}" for origin, keys in by_origin.items()) or "nothing"
        versions = r.run.provenance.get("versions") or {}
        version_text = (
            ", ".join(f"{k} {v}" for k, v in versions.items()) if isinstance(versions, dict) else str(versions)
        )
        if r.run.provenance.get("device"):
            version_text = f"{r.run.provenance['device']}; {version_text}".strip("; ")
        paths = ", ".join(display_path(p, base) for p in r.run.paths)
        rows.append(
            [
                r.run.name,
                paths,
                r.run.format,
                table.run_state(r),
                origins,
                str(r.run.provenance.get("commit", "unknown")),
                version_text or "unknown",
            ]
        )
    return headers, rows
