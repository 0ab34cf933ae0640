"""Render the current-figure tables of docs/results/README.md and README.md from the benchmarks' records.

    python scripts/render_figures.py            # rewrite every table between its marker comments
    python scripts/render_figures.py --check    # change nothing; exit 1 naming each table that differs

A table lives between `<!-- figures:NAME:begin -->` and `<!-- figures:NAME:end -->`. Its numbers come from the records
that docs/results/figures.yaml lists for its study, newest first: each cell takes the newest record that holds it,
and the table names the commit and date of every record it used, column by column, so a column measured at
another commit than the rest says so. A record is a benchmark's output folder (results.csv with provenance.json,
scripts/megatron_bench.py's results.csv with its results.md footer, run directories' summary.json and
metrics.jsonl) or, where a run's files did not come back, its console log; a folder under docs/results/runs/ may be
read from its .tar.xz archive. Nothing is typed here but the tables' layout: every figure is computed from a record
as the study's section computes it.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import re
import statistics
import sys
import tarfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable, Iterable, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "figures.yaml"
PAGES = {"results": RESULTS / "README.md", "readme": REPO / "README.md", "fp8": REPO / "docs" / "fp8_recipes.md"}
MARKER = re.compile(r"(<!-- figures:(?P<name>[\w-]+):begin -->\n)(?P<body>.*?)(<!-- figures:(?P=name):end -->)", re.S)

PROXIES = ("llama3_8b", "llama3_70b", "llama31_405b", "nemotron4_15b", "nemotron4_340b")


# ---- records ----


@dataclass
class Record:
    """One record of a study: where it is, what produced it, and its files."""

    path: str
    commit: str
    date: str
    section: str
    command: Optional[str] = None
    versions: dict = field(default_factory=dict)
    device: Optional[str] = None
    why: Optional[str] = None

    @property
    def label(self) -> str:
        return f"`{self.commit}`, {self.date}"


class Files:
    """Read a record's files from docs/results, or from the runs/*.tar.xz archive that holds its folder."""

    @staticmethod
    def text(relative: str) -> str:
        path = RESULTS / relative
        if path.is_file():
            return path.read_text()
        archive, member = Files._archived(relative)
        return archive[member]

    @staticmethod
    def exists(relative: str) -> bool:
        if (RESULTS / relative).exists():
            return True
        try:
            archive, member = Files._archived(relative)
        except FileNotFoundError:
            return False
        return member in archive or any(name.startswith(member.rstrip("/") + "/") for name in archive)

    @staticmethod
    def listdir(relative: str) -> list[str]:
        path = RESULTS / relative
        if path.is_dir():
            return sorted(p.name for p in path.iterdir())
        archive, member = Files._archived(relative)
        prefix = member.rstrip("/") + "/"
        return sorted({name[len(prefix):].split("/")[0] for name in archive if name.startswith(prefix)})

    @staticmethod
    def _archived(relative: str) -> tuple[dict[str, str], str]:
        parts = Path(relative).parts
        if len(parts) < 2 or parts[0] != "runs":
            raise FileNotFoundError(RESULTS / relative)
        archive = RESULTS / "runs" / f"{parts[1]}.tar.xz"
        if not archive.is_file():
            raise FileNotFoundError(RESULTS / relative)
        return _archive_members(archive), "/".join(parts[1:])


@cache
def _archive_members(archive: Path) -> dict[str, str]:
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def load_index() -> dict[str, list[Record]]:
    index = yaml.safe_load(INDEX.read_text())
    return {study: [record(entry) for entry in entries] for study, entries in index.items()}


def record(entry: dict) -> Record:
    """The index entry with what the record's own files say: provenance.json, or a megatron_bench footer."""
    path = entry["path"]
    said: dict = {}
    if Files.exists(f"{path}/provenance.json"):
        said = json.loads(Files.text(f"{path}/provenance.json"))
    else:
        footer = next((f for f in (f"{path}/results.md", f"{path}/megatron_results.md") if Files.exists(f)), None)
        if footer:
            said = megatron_bench_footer(Files.text(footer))
    if not said and not entry.get("commit"):
        said = {"commit": " / ".join(run_commits(path))}
    commit = str(entry.get("commit") or said.get("commit") or "")
    if not commit:
        raise SystemExit(f"{INDEX}: {path} names no commit and its record does not say one")
    date = entry.get("date") or said.get("date", "")[:10]
    if not date:
        raise SystemExit(f"{INDEX}: {path} names no date and its record does not say one")
    command = entry.get("command") or said.get("command")
    return Record(path=path, commit=" / ".join(short(c) for c in commit.split(" / ")), date=str(date),
                  section=entry["section"],
                  command=" ".join(command) if isinstance(command, list) else command,
                  versions=said.get("versions", {}), device=said.get("device"), why=entry.get("why"))


def run_commits(path: str) -> list[str]:
    """The commits that a folder of run directories' summary.json files name."""
    found = []
    for name in Files.listdir(path) if Files.exists(path) else []:
        if Files.exists(f"{path}/{name}/summary.json"):
            commit = short(summary(f"{path}/{name}/summary.json").get("commit", ""))
            if commit and commit not in found:
                found.append(commit)
    return found


def short(commit: str) -> str:
    head, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    return head[:7] + ("-dirty" if dirty else "")


def megatron_bench_footer(text: str) -> dict:
    """scripts/megatron_bench.py's results.md ends `commit C; DEVICE; versions {...}` and `command: ...`."""
    said = {}
    match = re.search(r"^commit (\S+); (.+?); versions (\{.*\})$", text, re.M)
    if match:
        said = {"commit": match[1], "device": match[2], "versions": ast.literal_eval(match[3])}
    command = re.search(r"^command: (.+)$", text, re.M)
    if command:
        said["command"] = "python " + command[1] if not command[1].startswith("python") else command[1]
    return said


def csv_rows(relative: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(Files.text(relative))))


def markdown_rows(text: str, first_header: str) -> list[dict]:
    """The rows of the first markdown table in `text` whose header starts with `| first_header |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


def metrics(relative: str) -> list[dict]:
    return [json.loads(line) for line in Files.text(relative).splitlines() if line.strip()]


def summary(relative: str) -> dict:
    return json.loads(Files.text(relative))


# ---- picking a cell from the newest record that holds it ----


@dataclass
class Pinned:
    """A cell's value with the commit of the runs it came from, where a record folder holds runs of several."""

    value: object
    commit: str


class Sources:
    """Which record (and commit) each column's cells came from, to say under the table."""

    def __init__(self) -> None:
        self.used: dict[str, dict[tuple[str, str], list[str]]] = {}
        self.rows: dict[str, int] = {}  # each row's place in the table, to name rows in the table's order

    def pick(self, column: str, row: str, records: Iterable[Record], value: Callable[[Record], object]):
        self.rows.setdefault(row, len(self.rows))
        for rec in records:
            got = value(rec)
            if got is not None:
                commit = got.commit if isinstance(got, Pinned) else rec.commit
                self.used.setdefault(column, {}).setdefault((rec.path, commit), []).append(row)
                return (got.value if isinstance(got, Pinned) else got), rec
        return None, None

    def note(self, records: list[Record], base: Path) -> str:
        """`columns: commit, date (section; records)`, naming the rows where a column mixes commits."""
        by_path = {r.path: r for r in records}
        columns: dict[str, dict[tuple, dict]] = {}
        for column, uses in self.used.items():
            for (path, commit), rows in uses.items():
                rec = by_path[path]
                source = columns.setdefault(column, {}).setdefault((commit, rec.date, rec.section),
                                                                   {"paths": [], "rows": []})
                source["paths"].append(path)
                source["rows"] = sorted(dict.fromkeys(source["rows"] + rows),
                                        key=lambda r: self.rows.get(r, len(self.rows)))
        groups: dict[tuple, list[str]] = {}
        for column, sources in columns.items():
            key = tuple((s, tuple(v["paths"]), tuple(v["rows"]) if len(sources) > 1 else ())
                        for s, v in sources.items())
            groups.setdefault(key, []).append(column)
        parts = []
        for key, names in groups.items():
            said = []
            for (commit, date, section), paths, rows in key:
                where = f" for {', '.join(rows)}" if rows else ""
                records_ = ", ".join(f"[{Path(p).name}]({link(base, p)})" for p in paths)
                said.append(f"`{commit}`, {date}{where} ([section]({link(base, section)}); {records_})")
            parts.append(f"{', '.join(names)}: {'; '.join(said)}")
        return "Measured at: " + ". ".join(parts) + "."


def link(base: Path, relative: str) -> str:
    """A link to docs/results/`relative` from the page in folder `base`."""
    target, _, anchor = relative.partition("#")
    path = RESULTS / target
    if not path.exists() and target.startswith("runs/"):
        path = RESULTS / "runs" / f"{Path(target).parts[1]}.tar.xz"
    rel = Path(_relpath(path, base)).as_posix()
    if path.is_dir():
        rel += "/"
    return rel + (f"#{anchor}" if anchor else "")


def _relpath(path: Path, base: Path) -> str:
    import os

    return os.path.relpath(path, base)


def versions_line(records: Iterable[Record]) -> str:
    """The software the records say they ran with, one value per package (several where they differ)."""
    names = {"torch": "torch", "transformer_engine": "Transformer Engine", "megatron-core": "megatron-core",
             "triton": "Triton", "cuda": "CUDA"}
    seen: dict[str, list[str]] = {}
    devices = []
    for rec in records:
        for key in names:
            value = rec.versions.get(key)
            if value and value not in seen.setdefault(key, []):
                seen[key].append(value)
        if rec.device and rec.device not in devices:
            devices.append(rec.device)
    software = ", ".join(f"{names[k]} {' / '.join(v)}" for k, v in seen.items() if v)
    return f"{' / '.join(devices) or 'device not recorded'}; {software or 'versions not recorded'}"


# ---- layer benchmark ----


@cache
def layer_bench(path: str) -> dict[str, dict[str, dict]]:
    """model -> precision -> {median_ms, speedup, layers}: a results.csv, or layer_bench's table in a console log."""
    if path.endswith(".log"):
        rows = markdown_rows(Files.text(path), "model")
        table = [{"model": r["model"], "layers": r["layers"], "precision": r["precision"],
                  "median_ms": float(r["median step (ms)"]),
                  "speedup": float(r["speedup vs fastest bf16"].rstrip("x")) if r["speedup vs fastest bf16"] != "n/a"
                  else None} for r in rows if not r["median step (ms)"].startswith("failed")]
    else:
        table = [{"model": r["model"], "layers": r["layers"], "precision": r["precision"],
                  "median_ms": float(r["median_step_s"]) * 1e3,
                  "speedup": float(r["speedup_vs_bf16"]) if r.get("speedup_vs_bf16") else None}
                 for r in csv_rows(f"{path}/results.csv") if r.get("median_step_s")]
    out: dict[str, dict[str, dict]] = {}
    for row in table:
        out.setdefault(row["model"], {})[row["precision"]] = row
    for model, columns in out.items():  # every speedup is over the run's fastest BF16 column, as layer_bench's
        bf16 = [c["median_ms"] for name, c in columns.items() if name.split(":")[0].endswith("bf16")]
        for c in columns.values():
            computed = min(bf16) / c["median_ms"] if bf16 else None
            if c["speedup"] is not None and abs(c["speedup"] - computed) > 1e-3 * computed:
                raise SystemExit(f"{path}: {model} {c['precision']}: speedup {c['speedup']} is not the fastest "
                                 f"BF16 column's {computed}")
            c["speedup"] = computed
    return out


def speedup(model: str, precision: str) -> Callable[[Record], Optional[float]]:
    def value(rec: Record) -> Optional[float]:
        column = layer_bench(rec.path).get(model, {}).get(precision)
        return column["speedup"] if column else None
    return value


def ratio(model: str, ours: str, peer: str) -> Callable[[Record], Optional[float]]:
    """Our median step over the peer's, both columns of the same record (one process)."""
    def value(rec: Record) -> Optional[float]:
        columns = layer_bench(rec.path).get(model, {})
        if ours in columns and peer in columns:
            return columns[ours]["median_ms"] / columns[peer]["median_ms"]
        return None
    return value


def proxy_label(records: list[Record], model: str) -> str:
    for rec in records:
        column = next(iter(layer_bench(rec.path).get(model, {}).values()), None)
        if column:
            return f"{model} ({column['layers']})"
    return model


RECIPES = {"fp8_current": "current", "fp8_delayed": "delayed", "fp8_blockwise": "blockwise"}


def fp8_speedup_table(records: list[Record], base: Path) -> str:
    """Step speedup of each FP8 recipe over the run's fastest BF16 column, per proxy."""
    sources = Sources()
    lines = ["| model (layers) | fp8_current | fp8_delayed | fp8_blockwise |", "|---|---|---|---|"]
    for model in PROXIES:
        cells = [fmt_x(sources.pick(f"{precision} over BF16", model, records, speedup(model, precision))[0])
                 for precision in RECIPES]
        lines.append(f"| {proxy_label(records, model)} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def peer_column(peer: str, precision: str) -> str:
    """The peer's column in the TE recipe of our `precision` (layer_bench's names)."""
    return f"{peer}_{'bf16' if precision == 'bf16' else RECIPES[precision]}"


# layer_bench's peers of NVIDIA's stack (issue 47 on), as the tables name them
PEER_NAMES = {"te_megatron": "TE as Megatron", "megatron_layer": "megatron-core's layers"}


def against_peer_table(records: list[Record], base: Path, peer: str) -> str:
    """Our median step over a peer's (`te_megatron`, `megatron_layer`) in the same process, per proxy and recipe."""
    sources = Sources()
    names = ("bf16", *RECIPES)
    lines = [f"| proxy | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for model in PROXIES:
        cells = [fmt_ratio(sources.pick(name, model, records, ratio(model, name, peer_column(peer, name)))[0])
                 for name in names]
        lines.append(f"| {proxy_label(records, model)} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def readme_fp8_table(records: list[Record], base: Path) -> str:
    """The README's table: what FP8 bought per proxy, and our step time over each of NVIDIA's stacks'."""
    sources = Sources()
    header = ["proxy (layers)", *RECIPES,
              *(f"ours / {name}: bf16 / current / delayed / blockwise" for name in PEER_NAMES.values())]
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for model in PROXIES:
        cells = [fmt_x(sources.pick(f"{p} over BF16", model, records, speedup(model, p))[0]) for p in RECIPES]
        for peer, peer_name in PEER_NAMES.items():
            cells.append(" / ".join(
                fmt_ratio(sources.pick(f"{name} over {peer_name}", model, records,
                                       ratio(model, name, peer_column(peer, name)))[0])
                for name in ("bf16", *RECIPES)))
        lines.append(f"| {proxy_label(records, model)} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def used(sources: Sources, records: list[Record]) -> list[Record]:
    paths = {path for uses in sources.used.values() for path, _ in uses}
    return [r for r in records if r.path in paths]


def fmt_x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}x"


def fmt_ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def pct(value: float, digits: int = 2) -> str:
    return f"{value * 100:+.{digits}f}%"


# ---- scripts/megatron_bench.py ----


@cache
def megatron_runs(path: str) -> dict[str, dict]:
    """name -> {engine, model, precision, step_s, peak_gib, mean_loss_last_100, status}."""
    if Files.exists(f"{path}/results.csv"):
        return {r["name"]: r for r in csv_rows(f"{path}/results.csv")}
    runs = {}  # the nemotron call: the bench's table (its megatron run) and the torch engine's run directory
    for r in markdown_rows(Files.text(f"{path}/megatron_results.md"), "engine"):
        engine, model = r["engine"].split(" ")[0], re.search(r"\((\w+)", r["engine"])
        model = model[1] if model else "llama3_8b"
        name = f"{engine}-{model}-{r['precision']}" if model != "llama3_8b" else f"{engine}-{r['precision']}"
        runs[name] = {"engine": engine, "model": model, "precision": r["precision"], "status": r["status"],
                      "step_s": r["s/step"] if r["status"] == "ok" else ""}
    if Files.exists(f"{path}/summary.json"):
        run = summary(f"{path}/summary.json")
        steps = metrics(f"{path}/metrics.jsonl")
        # as megatron_bench times a run: steps 1-2 warm-up, the last one profiled, the median of the rest
        runs[f"torch-{run['model']}-{run['precision']}"] = {
            "engine": "torch", "model": run["model"], "precision": run["precision"], "status": "ok",
            "step_s": str(statistics.median(s["step_time_s"] for s in steps[2:-1])),
            "peak_gib": str(run["peak_memory_gib"])}
    return runs


def step_s(path: str, name: str) -> Optional[float]:
    run = megatron_runs(path).get(name)
    return float(run["step_s"]) if run and run.get("status") == "ok" and run.get("step_s") else None


def whole_step_table(records: list[Record], base: Path) -> str:
    """engine=megatron's s/step over the torch engine's, same recipe, model and call."""
    sources = Sources()
    def over(model_prefix: str, precision: str, a: str, b: str):
        def value(rec: Record) -> Optional[float]:
            x = step_s(rec.path, f"{a}-{model_prefix}{precision}")
            y = step_s(rec.path, f"{b}-{model_prefix}{precision}")
            return x / y if x and y else None
        return value
    cells = [fmt_x(sources.pick(p, "llama3_8b", records, over("", p, "megatron", "torch"))[0])
             for p in ("bf16", *RECIPES)]
    cells.append(fmt_x(sources.pick("nemotron4_15b fp8_current", "nemotron4_15b", records,
                                    over("nemotron4_15b-", "fp8_current", "megatron", "torch"))[0]))
    def own(rec: Record) -> Optional[float]:
        x, y = step_s(rec.path, "torch-bf16"), step_s(rec.path, "torch-fp8_current")
        return x / y if x and y else None
    cells.append(fmt_x(sources.pick("torch fp8_current over its bf16", "llama3_8b", records, own)[0]))
    lines = ["| bf16 | fp8_current | fp8_delayed | fp8_blockwise | nemotron4_15b fp8_current | torch fp8_current over "
             "its bf16 |", "|---|---|---|---|---|---|", f"| {' | '.join(cells)} |"]
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def megatron_speed_table(records: list[Record], base: Path) -> str:
    """engine=megatron's step speedup over its own BF16, same call."""
    sources = Sources()
    def value(precision: str):
        def get(rec: Record) -> Optional[float]:
            x, y = step_s(rec.path, "megatron-bf16"), step_s(rec.path, f"megatron-{precision}")
            return x / y if x and y else None
        return get
    cells = [fmt_x(sources.pick(p, "llama3_8b", records, value(p))[0]) for p in RECIPES]
    lines = ["| fp8_current | fp8_delayed | fp8_blockwise |", "|---|---|---|", f"| {' | '.join(cells)} |"]
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def megatron_fsdp_table(records: list[Record], base: Path) -> str:
    """Megatron-FSDP's step time over DDP's (distributed optimizer) in the same call, one GPU."""
    sources = Sources()
    lines = ["| precision | FSDP s/step | DDP s/step | FSDP / DDP time |", "|---|---|---|---|"]
    for precision in ("bf16", "fp8_current"):
        def pair(rec: Record, precision=precision):
            fsdp, ddp = step_s(rec.path, f"megatron-fsdp-{precision}"), step_s(rec.path, f"megatron-{precision}")
            return (fsdp, ddp) if fsdp and ddp else None
        got, _ = sources.pick("Megatron-FSDP", precision, records, pair)
        lines.append(f"| {precision} | {got[0]:.3f} | {got[1]:.3f} | {got[0] / got[1]:.3f}x |" if got
                     else f"| {precision} | - | - | - |")
    return "\n".join([*lines, "", sources.note(records, base)])


def mean_last(values: list[float], n: int = 100) -> float:
    return sum(values[-n:]) / len(values[-n:])


def loss_study_table(records: list[Record], seeds: list[Record], base: Path) -> str:
    """Mean loss of the last 100 steps against the same engine's BF16 (and seed), llama3_100m, 500 steps."""
    sources = Sources()
    def gap(engine: str, precision: str):
        def get(rec: Record) -> Optional[float]:
            runs = megatron_runs(rec.path)
            fp8, bf16 = runs.get(f"{engine}-llama3_100m-{precision}"), runs.get(f"{engine}-llama3_100m-bf16")
            if fp8 and bf16 and fp8.get("mean_loss_last_100") and bf16.get("mean_loss_last_100"):
                return float(fp8["mean_loss_last_100"]) / float(bf16["mean_loss_last_100"]) - 1
            return None
        return get
    lines = ["| engine | fp8_current | fp8_delayed | fp8_blockwise |", "|---|---|---|---|"]
    for engine in ("megatron", "torch"):
        cells = [(lambda v: "-" if v is None else pct(v))(sources.pick(f"{engine} seed 1234", engine, records,
                                                                        gap(engine, p))[0]) for p in RECIPES]
        lines.append(f"| {engine} | {' | '.join(cells)} |")
    def seed_gaps(rec: Record):
        names, gaps, runs = Files.listdir(rec.path), [], []
        for name in names:
            match = re.fullmatch(r"torch-llama3_100m-fp8_delayed-seed(\d+)", name)
            baseline = f"torch-llama3_100m-bf16-seed{match[1]}" if match else ""
            if match and baseline in names:
                fp8 = mean_last([m["loss"] for m in metrics(f"{rec.path}/{name}/metrics.jsonl")])
                bf16 = mean_last([m["loss"] for m in metrics(f"{rec.path}/{baseline}/metrics.jsonl")])
                gaps.append((int(match[1]), fp8 / bf16 - 1))
                runs += [summary(f"{rec.path}/{n}/summary.json") for n in (name, baseline)
                         if Files.exists(f"{rec.path}/{n}/summary.json")]
        return pinned(sorted(gaps), *runs) if gaps and runs else sorted(gaps) or None
    gaps, _ = sources.pick("torch fp8_delayed, other seeds", "torch", seeds, seed_gaps)
    if gaps:
        values = [g for _, g in gaps]
        lines.append(f"| torch, seeds {', '.join(str(s) for s, _ in gaps)} | - | {pct(statistics.mean(values))} "
                     f"(std {statistics.stdev(values) * 100:.2f}%) | - |")
    return "\n".join([*lines, "", sources.note([*records, *seeds], base)])


def resume_table(records: list[Record], base: Path) -> str:
    """tests/test_megatron_bench.py's resume checks: the steps after a resume against the uninterrupted run."""
    sources = Sources()
    def checks(rec: Record):
        found = re.findall(r"^resume-llama3_100m-(\S+): resumed from step (\d+); steps (\d+-\d+) repeated, max rel\. "
                           r"diff: loss (\S+), grad norm (\S+)$", Files.text(rec.path), re.M)
        return found or None
    found, _ = sources.pick("resume checks", "all", records, checks)
    lines = ["| layout | bf16 | fp8_current | fp8_delayed | fp8_blockwise |", "|---|---|---|---|---|"]
    layouts = {"": "distributed optimizer", "-no_distopt": "without the distributed optimizer",
               "-fsdp": "Megatron-FSDP"}
    by_name = {name: (step, steps, loss, grad) for name, step, steps, loss, grad in found or []}
    for suffix, layout in layouts.items():
        cells = []
        for precision in ("bf16", *RECIPES):
            got = by_name.get(precision + suffix)
            if not got:
                cells.append("not checked")
            else:
                loss, grad = float(got[2]), float(got[3])
                cells.append("equal" if loss == grad == 0 else f"{loss:.1e} / {grad:.1e} apart")
        lines.append(f"| {layout} | {' | '.join(cells)} |")
    steps = {f"steps {g[1]} after a resume from step {g[0]}" for g in by_name.values()}
    return "\n".join([f"Loss and gradient norm of {', '.join(sorted(steps))} against the uninterrupted run "
                      "(`megatron.deterministic=true`; `equal`: bit for bit):", "", *lines, "",
                      sources.note(records, base)])


# ---- run directories: convergence, FSDP2 ----


def seed_gaps(records: list[Record], precision: str, sources: Sources) -> dict[int, float]:
    """seed -> mean loss of the last 100 steps over BF16's of the same seed, the newest record holding each seed."""
    def seed_of(name: str) -> int:
        match = re.search(r"-seed(\d+)$", name)
        return int(match[1]) if match else 1234  # the runs without a suffix are the study's seed, 1234
    gaps: dict[int, float] = {}
    for rec in records:
        names = Files.listdir(rec.path)
        found: list[str] = []
        seeds: list[int] = []
        for name in names:
            if not re.fullmatch(rf"llama3_100m-{precision}(-seed\d+)?", name):
                continue
            seed = seed_of(name)
            bf16 = next((n for n in names if re.fullmatch(r"llama3_100m-bf16(-seed\d+)?", n) and seed_of(n) == seed),
                        None)
            if bf16 and seed not in gaps:
                fp8_loss = mean_last([m["loss"] for m in metrics(f"{rec.path}/{name}/metrics.jsonl")])
                bf16_loss = mean_last([m["loss"] for m in metrics(f"{rec.path}/{bf16}/metrics.jsonl")])
                gaps[seed] = fp8_loss / bf16_loss - 1
                seeds.append(seed)
                found += [summary(f"{rec.path}/{n}/summary.json").get("commit", "") for n in (name, bf16)
                          if Files.exists(f"{rec.path}/{n}/summary.json")]
        for commit in (dict.fromkeys(short(c) for c in found if c) or [rec.commit]) if seeds else ():
            sources.used.setdefault(precision, {}).setdefault((rec.path, commit), []).append(
                f"seed{'s' if len(seeds) > 1 else ''} {', '.join(str(s) for s in sorted(seeds))}")
    return gaps


def study_gaps(records: list[Record], label: str, sources: Sources) -> tuple[dict[int, float], set[int]]:
    """seed -> a recipe study's run of `label` (scripts/megatron_bench.py's results.csv, which lists every run of the
    study, run or not) against the BF16 run of its seed: the ratio of their mean losses over the last 100 steps,
    minus 1; only runs that finished, each seed from the newest record holding it. A run an earlier call finished (its
    note says so) is of that call's commit. And the seeds the studies planned for `label`."""
    gaps: dict[int, float] = {}
    planned: set[int] = set()
    for rec in records:
        rows = csv_rows(f"{rec.path}/results.csv")
        seed_of = {row["name"]: int(match[1]) for row in rows
                   if (match := re.fullmatch(rf"torch-llama3_100m-{re.escape(label)}-seed(\d+)", row["name"]))}
        planned |= set(seed_of.values())
        finished = {row["name"]: row for row in rows if row["status"] == "ok" and row["mean_loss_last_100"]}
        seeds_of: dict[str, list[int]] = {}  # commit -> the seeds whose runs it made
        for name, row in finished.items():
            seed = seed_of.get(name)
            bf16 = finished.get(f"torch-llama3_100m-bf16-seed{seed}") if seed is not None else None
            if bf16 is None or seed in gaps:
                continue
            gaps[seed] = float(row["mean_loss_last_100"]) / float(bf16["mean_loss_last_100"]) - 1
            for run in (row, bf16):
                earlier = re.search(r"earlier call: commit (\w+)", run["note"])
                seeds_of.setdefault(short(earlier[1]) if earlier else rec.commit, []).append(seed)
        for commit, seeds in seeds_of.items():
            seeds = sorted(set(seeds))
            sources.used.setdefault(f"loss of {label}", {}).setdefault((rec.path, commit), []).append(
                f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
    return gaps, planned


def study_loss(records: list[Record], label: str, sources: Sources) -> str:
    """The loss cell of a recipe studied by a recipe study: the mean gap over its seeds, saying how many finished."""
    gaps, planned = study_gaps(records, label, sources)
    if not gaps:
        return "-"
    count = (f"mean of {len(gaps)} seeds" if len(gaps) == len(planned)
             else f"{len(gaps)} of {len(planned)} seeds so far")
    return f"{pct(statistics.mean(gaps.values()))} ({count})"


def rerun_gap(rec: Record):
    """fp8_delayed and fp8_current over BF16 in the rerun: mean loss of steps 1100-2000, every 100th step (all that
    fp8_delayed's console log holds)."""
    def every_100th(name: str) -> Optional[list[float]]:
        if Files.exists(f"{rec.path}/{name}/metrics.jsonl"):
            return [m["loss"] for m in metrics(f"{rec.path}/{name}/metrics.jsonl") if m["step"] % 100 == 0
                    and m["step"] > 1000]
        if Files.exists(f"{rec.path}/{name}/train.log"):
            return [float(loss) for step, loss in re.findall(r"^step +(\d+)/\d+ \| loss ([\d.]+)",
                    Files.text(f"{rec.path}/{name}/train.log"), re.M) if int(step) % 100 == 0 and int(step) > 1000]
        return None
    losses = {p: every_100th(f"llama3_100m-{p}") for p in ("bf16", "fp8_current", "fp8_delayed")}
    if not all(losses.values()):
        return None
    mean = {p: sum(v) / len(v) for p, v in losses.items()}
    return mean["fp8_delayed"] / mean["bf16"] - 1, mean["fp8_current"] / mean["bf16"] - 1


def convergence_table(records: list[Record], rerun: list[Record], base: Path) -> str:
    """Mean loss of the last 100 steps against BF16 of the same seed, over every seed the records hold."""
    sources = Sources()
    rows = []
    for precision in ("fp8_current", "fp8_blockwise"):
        gaps = seed_gaps(records, precision, sources)
        values = list(gaps.values())
        rows.append(f"| {precision} | {pct(statistics.mean(values))} (std {statistics.stdev(values) * 100:.2f}%) | "
                    f"{len(values)} seeds ({', '.join(str(s) for s in sorted(gaps))}) |")
    got, _ = sources.pick("fp8_delayed", "fp8_delayed", rerun, rerun_gap)
    if got:
        rows.append(f"| fp8_delayed | {pct(got[0], 1)} (fp8_current {pct(got[1], 1)} in the same rerun) | one seed, "
                    "steps 1100-2000 (every 100th) |")
    lines = ["| recipe | gap to BF16 | over |", "|---|---|---|", *rows]
    return "\n".join([*lines, "", sources.note([*records, *rerun], base)])


def pinned(value: object, *runs: dict) -> Pinned:
    """`value` with the commit(s) the run directories' summaries name."""
    return Pinned(value, " / ".join(dict.fromkeys(short(r["commit"]) for r in runs if r.get("commit"))))


# The granularities issue 50 made trainable, each against the one peer that trains the same recipe (its column
# in layer_bench) and with the GEMM variant of its forward pass (gemm_bench's)
GRANULARITY_PEERS = {"fp8_rowwise": ("torchao", "torchao_rowwise"),
                     "fp8_rowwise_gw_hp": ("torchao", "torchao_rowwise_with_gw_hp"),
                     "fp8_blockwise_1d1d": ("TE as Megatron", "te_megatron_blockwise_1d1d")}
GEMM_VARIANTS = {"fp8_current": "tensorwise", "fp8_delayed": "tensorwise", "fp8_blockwise": "1x128_x_128x128",
                 "fp8_rowwise": "rowwise", "fp8_rowwise_gw_hp": "rowwise", "fp8_blockwise_1d1d": "1x128_x_1x128"}


@dataclass
class RecipeRow:
    """One recipe's cells in the recipe tables."""

    recipe: str
    steps: str  # step speedup over BF16, the proxies' range
    gemm: str  # GEMM speedup of its forward pass's variant, llama3_8b fc1
    loss: str  # against BF16 of the same seed, llama3_100m
    against: str  # our step time over the peer's layers training the same recipe


def recipe_rows(index: dict[str, list[Record]], sources: Sources) -> list[RecipeRow]:
    """Each recipe's cells, each from the newest record that holds it: step speedups from the layer benchmarks (the
    granularities from their own, beside the peer training the same recipe), losses from the six-seed convergence
    study (fp8_current, fp8_blockwise), its rerun (fp8_delayed) or the recipe studies (the rest)."""
    lb, peers, granularity = index["layer_bench"], index["layer_bench_peers"], index["granularity"]
    studies = index["recipe_studies"]
    def span(values: list[float], fmt: Callable[[float], str]) -> str:
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        return fmt(min(values)) if len(values) == 1 else f"{fmt(min(values))} to {fmt(max(values))}"
    def proxies(values: list[Optional[float]]) -> str:
        """The span of a recipe's speedups, saying how many proxies it covers where not all."""
        measured = sum(v is not None for v in values)
        note = f" ({measured} of {len(PROXIES)} proxies)" if 0 < measured < len(PROXIES) else ""
        return span(values, fmt_x) + note
    def gemm(variant: str):
        def value(rec: Record) -> Optional[float]:
            row = next((r for r in csv_rows(f"{rec.path}/gemm.csv")
                        if r["shape"] == "llama3_8b/fc1" and r["variant"] == variant), None)
            return float(row["speedup"]) if row else None
        return value
    def gemm_cell(precision: str) -> str:
        variant = GEMM_VARIANTS[precision]
        value = sources.pick("GEMM", precision, index["gemm"], gemm(variant))[0]
        return f"{'-' if value is None else f'{value:.2f}x'} ({variant.replace('_x_', ' x ')})"
    seeds = {p: seed_gaps(index["convergence"], p, sources) for p in ("fp8_current", "fp8_blockwise")}
    rerun, _ = sources.pick("loss", "fp8_delayed", index["convergence_rerun"], rerun_gap)
    rows = []
    for precision in RECIPES:
        steps = [sources.pick("step speedup", precision, lb, speedup(model, precision))[0] for model in PROXIES]
        against = [sources.pick(f"ours / {PEER_NAMES[peer]}", precision, peers,
                                ratio(model, precision, peer_column(peer, precision)))[0]
                   for peer in PEER_NAMES for model in PROXIES]
        if precision in seeds:
            values = list(seeds[precision].values())
            loss = f"{pct(statistics.mean(values))} (mean of {len(values)} seeds)"
        else:
            loss = f"{pct(rerun[0], 1)} (one seed; fp8_current {pct(rerun[1], 1)} in the same run)" if rerun else "-"
        rows.append(RecipeRow(precision, proxies(steps), gemm_cell(precision), loss,
                              f"{span(against, fmt_ratio)} ({', '.join(PEER_NAMES.values())})"))
    for precision, (peer_name, peer) in GRANULARITY_PEERS.items():
        steps = [sources.pick("step speedup", precision, granularity, speedup(model, precision))[0]
                 for model in PROXIES]
        against = [sources.pick(f"ours / {peer_name}", precision, granularity, ratio(model, precision, peer))[0]
                   for model in PROXIES]
        rows.append(RecipeRow(precision, proxies(steps), gemm_cell(precision),
                              study_loss(studies, precision, sources), f"{span(against, fmt_ratio)} ({peer_name})"))
    def emulated_loss(label: str) -> str:
        cell = study_loss(studies, label, sources)
        return cell if cell == "-" else f"{cell}, emulated"
    rows.append(RecipeRow("fp8_blockwise_2d2d", "no kernel takes two 128x128 operands (engine=torch emulates it)",
                          "-", emulated_loss("fp8_blockwise_2d2d"), "-"))
    rows.append(RecipeRow("mxfp8", "no native kernel on Hopper; not measured on Blackwell", "-", "-", "-"))
    rows.append(RecipeRow("nvfp4", "no native kernel on Hopper (engine=torch emulates it); not measured on Blackwell",
                          "-", emulated_loss("nvfp4"), "-"))
    return rows


def recipe_sources(index: dict[str, list[Record]]) -> list[Record]:
    return [*index["layer_bench"], *index["layer_bench_peers"], *index["granularity"], *index["gemm"],
            *index["convergence"], *index["convergence_rerun"], *index["recipe_studies"]]


def fp8_recipes_table(index: dict[str, list[Record]], base: Path) -> str:
    """Each recipe in one row: step speedup over BF16 (the proxies' range), GEMM speedup, loss against BF16, and our
    step time over the peers' that train the same recipe (NVIDIA's layers: TE as Megatron, megatron-core's; torchao
    for rowwise), each from the newest record that holds it."""
    sources = Sources()
    lines = ["| recipe | step speedup over BF16, the proxies | GEMM speedup, llama3_8b fc1 | "
             "loss vs BF16, llama3_100m | ours / the peer's layers training the same recipe |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.recipe} | {r.steps} | {r.gemm} | {r.loss} | {r.against} |" for r in recipe_rows(index, sources)]
    return "\n".join([*lines, "", sources.note(recipe_sources(index), base)])


def readme_recipes_table(index: dict[str, list[Record]], base: Path) -> str:
    """The README's recipe table: fp8_recipes_table's rows without the GEMM column, what a loss is to be compared
    with (its own study's BF16 runs and fp8_current), and the commits; each cell's record is on docs/fp8_recipes.md."""
    sources = Sources()
    rows = recipe_rows(index, sources)
    lines = ["| recipe | step speedup over BF16, the proxies | loss vs BF16, ~100M Llama, 2000 steps | "
             "ours / the peer's layers training the same recipe |", "|---|---|---|---|"]
    lines += [f"| {r.recipe} | {r.steps} | {r.loss} | {r.against} |" for r in rows]
    scatter = max(statistics.stdev(seed_gaps(index["convergence"], p, Sources()).values())
                  for p in ("fp8_current", "fp8_blockwise"))
    newest: dict[str, Record] = {}
    for rec in index["recipe_studies"]:
        newest.setdefault(study_name(rec), rec)
    said = ", ".join(f"{pct(statistics.mean(gaps.values()))} in the {study} study" for study, rec in newest.items()
                     if (gaps := study_gaps([rec], "fp8_current", Sources())[0]))
    commits = ", ".join(dict.fromkeys(f"`{c}`" for uses in sources.used.values() for _, c in uses))
    return "\n".join([*lines, "", f"Each loss is against BF16 runs of the same seeds in its own study: one seed alone "
                      f"scatters by up to {scatter:.2%} (standard deviation over six seeds), and fp8_current ended "
                      f"{said}, so compare a recipe with its own study's fp8_current. Commits {commits}; each cell's "
                      f"commit, date, GPU and record: [docs/fp8_recipes.md]({recipes_section_link(base)}).", "",
                      versions_line(used(sources, recipe_sources(index)))])


def study_name(rec: Record) -> str:
    """A recipe study's record's study: the results page its section is on (granularity.md, nvfp4.md)."""
    return rec.section.split(".md")[0]


def recipes_section_link(base: Path) -> str:
    """A link to docs/fp8_recipes.md's recipe table, with the sources of its cells, from the page in folder `base`."""
    return Path(_relpath(PAGES["fp8"], base)).as_posix() + "#what-each-buys-and-costs"


GRANULARITIES = {"fp8_current": "per tensor", "fp8_blockwise": "1D2D", "fp8_rowwise": "rowwise",
                 "fp8_rowwise_gw_hp": "rowwise, BF16 wgrad", "fp8_blockwise_1d1d": "1D1D", "fp8_blockwise_2d2d": "2D2D"}


def granularity_table(index: dict[str, list[Record]], base: Path) -> str:
    """Every scaling granularity side by side: its step speedup over the fastest BF16 column of its own layer
    benchmark on each proxy (issue 50's records first, then the peers' and the speedup study's), and its loss
    against BF16 of the same seed in the newest granularity study, where every granularity ran beside the same BF16
    runs."""
    sources = Sources()
    records = [*index["granularity"], *index["layer_bench_peers"], *index["layer_bench"]]
    header = ["proxy (layers)", *(f"{p} ({label})" for p, label in GRANULARITIES.items())]
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for model in PROXIES:
        cells = [fmt_x(sources.pick(f"{p} over BF16", model, records, speedup(model, p))[0])
                 for p in GRANULARITIES if p != "fp8_blockwise_2d2d"]
        lines.append(f"| {proxy_label(records, model)} | {' | '.join(cells)} | no kernel |")
    study = [r for r in index["recipe_studies"] if study_name(r) == "granularity"][:1]
    losses = [study_loss(study, p, sources) for p in GRANULARITIES]
    lines.append(f"| loss vs BF16, llama3_100m | {' | '.join(losses)} |")
    return "\n".join([*lines, "", sources.note([*records, *study], base), "",
                      versions_line(used(sources, [*records, *study]))])


def fsdp_table(records: list[Record], base: Path) -> str:
    """As scripts/scaling_bench.py reports: throughput the median of the steps after the first 3, loss the final."""
    sources = Sources()
    def run(rec: Record, name: str) -> Optional[dict]:
        path = f"{rec.path}/{name}/summary.json"
        if not Files.exists(path):
            return None
        steps = metrics(f"{rec.path}/{name}/metrics.jsonl")[3:]
        return {**summary(path), "tokens_per_s_per_gpu": statistics.median(s["tokens_per_s_per_gpu"] for s in steps)}
    def full_8b(rec: Record):
        fp8, bf16 = run(rec, "b-llama3_8b-fp8_current-2gpu-4mb"), run(rec, "b-llama3_8b-bf16-2gpu-4mb")
        if fp8 and bf16:
            return pinned((fp8["tokens_per_s_per_gpu"], fp8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"]),
                          fp8, bf16)
        return None
    def scaling(rec: Record):
        one, two = run(rec, "c-llama3_8b-4L-bf16-1gpu"), run(rec, "c-llama3_8b-4L-bf16-2gpu")
        return pinned(two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"], one, two) if one and two else None
    def parity(rec: Record):
        gaps, runs = [], []
        for precision in ("bf16", "fp8_delayed"):
            one, two = run(rec, f"a-tiny_llama-{precision}-1gpu"), run(rec, f"a-tiny_llama-{precision}-2gpu")
            if not (one and two):
                return None
            gaps.append(abs(two["final_loss"] / one["final_loss"] - 1))
            runs += [one, two]
        return pinned(gaps, *runs)
    def gather(rec: Record):
        fp8, bf16 = run(rec, "fp8_current-gather_true"), run(rec, "fp8_current-gather_false")
        return pinned((fp8["tokens_per_s_per_gpu"], bf16["tokens_per_s_per_gpu"]), fp8, bf16) if fp8 and bf16 else None
    rows = []
    got, _ = sources.pick("the full 8B", "8B", records, full_8b)
    rows.append(f"| llama3_8b fp8_current, tokens/s/GPU (speedup over BF16) | {got[0]:,.0f} ({got[1]:.3f}x) |")
    got, _ = sources.pick("scaling", "scaling", records, scaling)
    rows.append(f"| scaling 1 -> 2 GPUs (BF16) | {got:.1%} |")
    got, _ = sources.pick("parity", "parity", records, parity)
    rows.append(f"| final loss, 2 GPUs vs 1 (bf16 / fp8_delayed) | within {got[0]:.2%} / {got[1]:.2%} |")
    got, _ = sources.pick("FP8 all-gather", "gather", records, gather)
    rows.append(f"| FP8 all-gather, fp8_current tokens/s/GPU (BF16 all-gather) | {got[0]:,.0f} ({got[1]:,.0f}) |")
    lines = ["| figure | value |", "|---|---|", *rows]
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


# ---- GEMMs, whole runs, CPU ----


def gemm_table(records: list[Record], base: Path) -> str:
    sources = Sources()
    variants = ("tensorwise", "rowwise", "1x128_x_128x128", "1x128_x_1x128")
    def get(variant: str):
        def value(rec: Record) -> Optional[float]:
            row = next((r for r in csv_rows(f"{rec.path}/gemm.csv")
                        if r["shape"] == "llama3_8b/fc1" and r["variant"] == variant), None)
            return float(row["speedup"]) if row else None
        return value
    cells = [f"{sources.pick(v, 'fc1', records, get(v))[0]:.2f}x" for v in variants]
    lines = [f"| {' | '.join(v.replace('_x_', ' x ') for v in variants)} |", "|---|---|---|---|",
             f"| {' | '.join(cells)} |"]
    return "\n".join([*lines, "", sources.note(records, base), "", versions_line(used(sources, records))])


def training_runs_table(records: list[Record], base: Path) -> str:
    sources = Sources()
    lines = ["| precision | tokens/s/GPU | model TFLOP/s | speedup |", "|---|---|---|---|"]
    for precision in ("bf16", "fp8_current"):
        def value(rec: Record, precision=precision):
            return next((r for r in csv_rows(f"{rec.path}/results.csv")
                         if r["run"] == f"llama3_8b_4layers-{precision}"), None)
        row, _ = sources.pick("llama3_8b 4-layer proxy", precision, records, value)
        speed = float(row["speedup"]) if row["speedup"] else 1.0
        lines.append(f"| {precision} | {float(row['tokens_per_s_per_gpu']):,.0f} | "
                     f"{float(row['tflops_per_gpu']):.1f} | "
                     f"{speed:.3f}x |")
    return "\n".join([*lines, "", sources.note(records, base)])


def cpu_rows(records: list[Record]) -> tuple[list[dict], Record]:
    rec = records[0]
    return csv_rows(f"{rec.path}/results.csv"), rec


def cpu_table(records: list[Record], base: Path) -> str:
    rows, rec = cpu_rows(records)
    walls = [r for r in rows if r["measurement"] == "wall time"]
    lines = ["| figure | value | commit, date |", "|---|---|---|"]
    for r in walls:
        lines.append(f"| {r['what']} | {float(r['value']):.0f} {r['unit']} | `{r['commit']}`, {r['date']} |")
    steps = [r for r in rows if r["measurement"] == "CPU time per step"]
    lines += ["", "| precision | compute | " + " | ".join(dict.fromkeys(r["machine"] for r in steps)) + " |",
              "|---|---|" + "---|" * len(dict.fromkeys(r["machine"] for r in steps))]
    for key in dict.fromkeys((r["precision"], r["compute"]) for r in steps):
        cells = [f"{float(r['value']):.2f}" for r in steps if (r["precision"], r["compute"]) == key]
        lines.append(f"| {key[0]} | {key[1]} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", f"CPU s/step, one thread ([record]({link(base, rec.path)}), "
                      f"[section]({link(base, rec.section)})); {rec.why or ''}".rstrip("; ") + "."])


def readme_cpu_line(records: list[Record], base: Path) -> str:
    rows, rec = cpu_rows(records)
    job = next(r for r in rows if r["measurement"] == "wall time" and r["what"].startswith("default job"))
    steps = {(r["precision"], r["compute"], r["machine"]): float(r["value"]) for r in rows
             if r["measurement"] == "CPU time per step"}
    native = next(m for (_, _, m) in steps if m.startswith("native"))
    avx2 = next(m for (_, _, m) in steps if m.startswith("AVX2"))
    return (f"Measured ([CPU results]({link(base, rec.section)})): the default job's step takes "
            f"{steps[('fp8_current', 'bf16', native)]:.2f} s of CPU time in BF16 and "
            f"{steps[('fp8_current', 'fp32', native)]:.2f} s in FP32 on a Xeon with AMX; with oneDNN off, as on an "
            f"AVX2 CPU, {steps[('fp8_current', 'bf16', avx2)]:.2f} s in BF16 and "
            f"{steps[('fp8_current', 'fp32', avx2)]:.2f} s in FP32. The whole job on two cores capped at AVX2 "
            f"(FP32 chosen): {float(job['value']):.0f} {job['unit']} (`{job['commit']}`, {job['date']}).")


# ---- the tables, by marker name ----


def tables() -> dict[str, tuple[str, Callable[[Path], str]]]:
    """marker name -> (page, render(base folder of the page))."""
    index = load_index()
    lb, peers = index["layer_bench"], index["layer_bench_peers"]
    return {
        "fp8-speedup": ("results", lambda base: fp8_speedup_table(lb, base)),
        "te-megatron": ("results", lambda base: against_peer_table(peers, base, "te_megatron")),
        "megatron-layer": ("results", lambda base: against_peer_table(peers, base, "megatron_layer")),
        "megatron-speed": ("results", lambda base: megatron_speed_table(index["megatron_speed"], base)),
        "megatron-fsdp": ("results", lambda base: megatron_fsdp_table(index["megatron_fsdp"], base)),
        "megatron-loss": ("results", lambda base: loss_study_table(index["megatron_loss"],
                                                                   index["megatron_loss_seeds"], base)),
        "megatron-resume": ("results", lambda base: resume_table(index["megatron_resume"], base)),
        "whole-step": ("results", lambda base: whole_step_table(index["megatron_speed"], base)),
        "convergence": ("results", lambda base: convergence_table(index["convergence"], index["convergence_rerun"],
                                                                  base)),
        "fsdp": ("results", lambda base: fsdp_table(index["fsdp"], base)),
        "gemm": ("results", lambda base: gemm_table(index["gemm"], base)),
        "training-runs": ("results", lambda base: training_runs_table(index["training_runs"], base)),
        "cpu": ("results", lambda base: cpu_table(index["cpu"], base)),
        "granularity": ("results", lambda base: granularity_table(index, base)),
        "readme-fp8": ("readme", lambda base: readme_fp8_table(peers, base)),
        "readme-cpu": ("readme", lambda base: readme_cpu_line(index["cpu"], base)),
        "readme-recipes": ("readme", lambda base: readme_recipes_table(index, base)),
        "fp8-recipes": ("fp8", lambda base: fp8_recipes_table(index, base)),
    }


def render(text: str, page: str, base: Path, known: dict) -> tuple[str, list[str]]:
    """`text` with every marked table of `page` rendered, and the names of the tables that changed."""
    changed, seen = [], set()
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in known or known[name][0] != page:
            raise SystemExit(f"{shown(PAGES[page])}: no table named {name!r} for this page "
                             f"(known: {', '.join(n for n, (p, _) in known.items() if p == page)})")
        seen.add(name)
        body = known[name][1](base).rstrip("\n") + "\n"
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]
    rendered = MARKER.sub(fill, text)
    missing = [n for n, (p, _) in known.items() if p == page and n not in seen]
    if missing:
        raise SystemExit(f"{shown(PAGES[page])}: no markers for {', '.join(missing)}")
    return rendered, changed


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a committed table differs")
    args = parser.parse_args(argv)
    known = tables()
    stale = []
    for page, path in PAGES.items():
        text = path.read_text()
        rendered, changed = render(text, page, path.parent, known)
        stale += [f"{shown(path)}: {name}" for name in changed]
        if changed and not args.check:
            path.write_text(rendered)
    if args.check and stale:
        print("tables that differ from their records (run python scripts/render_figures.py):\n  "
              + "\n  ".join(stale), file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'rendered'} {len(known)} tables" +
          (f"; rewritten: {', '.join(stale)}" if stale and not args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
