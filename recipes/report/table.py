"""From runs to the comparison: steady-state medians, the BF16 baseline of each run, speedups, loss gaps and the
divergence alarm. `rules()` states each rule as the report prints it; the functions below implement them."""

from __future__ import annotations

import math
import shlex
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from recipes.metrics import warmup_steps
from recipes.report.metadata import PRECISION_ORDER, describe_layout
from recipes.report.published import Published, published_for
from recipes.report.records import Run, Step, lines_of
from recipes.report.render import Table

MATCH_KEYS = ("model", "gpu", "engine", "nodes", "world_size", "tp", "pp", "cp", "vp", "mbs", "gbs", "seq", "steps")
REQUIRED_KEYS = ("model", "gpu")  # must be known to match at all
DEFAULT_LOSS_TOLERANCE = 0.05
# A figure stands only on enough of the run: at least this many records, and at least this share of the records
# after warm-up that the files hold (those that could not be read count against it).
MIN_RECORDS, MIN_SHARE = 3, 0.5


@dataclass
class Result:
    run: Run
    warmup_steps: int
    steps_measured: int
    step_time_s: Optional[float]
    tokens_per_s_per_gpu: Optional[float]
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    final_loss: Optional[float]
    first_bad_step: Optional[int]  # first NaN/inf loss
    first_bad_grad_step: Optional[int] = None  # first NaN/inf gradient norm
    thin: dict[str, str] = field(default_factory=dict)  # figure -> why it is left blank (too few records behind it)
    state: list[str] = field(default_factory=list)  # how the run ended: stopped, incomplete, resumed
    baseline: Optional["Result"] = None
    # "baseline" (a BF16 run), "found", "missing", "ambiguous: ...", "precision unknown"
    baseline_status: str = "missing"
    speedup: Optional[float] = None
    speedup_from: str = "step time"  # or "tokens/s/GPU", for a log that prints no step time (torchtitan)
    loss_gap: Optional[float] = None  # relative, over the last common window
    max_loss_gap: Optional[float] = None  # largest |relative gap| over the windows, signed
    max_gap_window: Optional[tuple[int, int]] = None
    published: Optional[Published] = None  # NVIDIA's figure for this model, GPU, GPU count and precision
    vs_published: Optional[float] = None  # our tokens/s/GPU / the published one
    flags: list[str] = field(default_factory=list)
    note: str = ""  # why there is no baseline (the field that blocked the match, and the --label that supplies it)
    sources: dict[str, str] = field(default_factory=dict)  # CSV column -> the lines (or derivation) behind its value

    @property
    def meta(self) -> dict[str, Any]:
        return self.run.meta

    @property
    def is_bf16(self) -> bool:
        return self.meta.get("recipe") == "bf16"

    @property
    def incomplete(self) -> bool:
        return any(state.startswith(("incomplete", "stopped")) for state in self.state)


def rules(tolerance: float) -> list[str]:
    return [
        "Warm-up: with N the last step logged, records ending at or before step max(1, N // 10) are warm-up (the "
        "rule of the engines' summary.json), and so is the first record each process wrote (a log's first "
        "interval, the first step after a restart: compilation and allocator warm-up).",
        "Step time, tokens/s/GPU and TFLOP/s/GPU: medians over the remaining records (one per logged step or "
        "interval); 'steps measured' counts the optimizer steps they cover. A step logged twice (requeue) counts "
        "once, the last record winning. Tokens/s/GPU is the figure to hold against other tools and NVIDIA's "
        "published numbers: their FLOP formulas differ.",
        f"Never a figure from a handful: a median (or the final loss) is left blank, the cell saying from how many "
        f"records it would come, unless at least {MIN_RECORDS} records hold it and they are at least "
        f"{MIN_SHARE:.0%} of the records after warm-up (the final loss: of all records), counting the record lines "
        f"that could not be read. 2 readable intervals of 20 give no figure.",
        "Run state, in the table, the CSV and the figures: 'stopped' where a loss or gradient norm went NaN/inf "
        "(the engines stop there), 'incomplete: N of M steps' where the last step is short of the planned length "
        "(trainer.max_steps, --train-iters, the iteration line's total), 'resumed at step N' where the records show "
        "a restart or the run's log says it resumed (a run directory's train.log, torchtitan's start step). A "
        "speedup or loss gap that pairs an incomplete run says so.",
        "MFU: model TFLOP/s/GPU divided by the GPU's dense BF16 peak, for every recipe (so MFU ratios equal "
        "speedups); where the peak is unknown, the run's own logged MFU.",
        "NVIDIA published: the tokens/s/GPU NVIDIA publishes (recipes/report/nvidia_published.yaml, each row with "
        "its source) for the run's model, GPU, GPU count and precision (an H200 run against H100's rows, a per-tensor "
        "FP8 run against a row that says only FP8, each said in the cell; the newest container's row), and ours / "
        "published the run's median tokens/s/GPU over it. Tokens/s/GPU, not TFLOP/s: NVIDIA's own tools count "
        "model FLOPs differently.",
        "Speedup: BF16 median step time / the recipe's (where either log prints no step time, the recipe's "
        "tokens/s/GPU / BF16's, said in the cell), against the BF16 run with the same model, GPU, engine, "
        "nodes, GPUs, TP/PP/CP/VP, micro/global batch, sequence length and planned steps (trainer.max_steps, "
        "Megatron's --train-iters: the learning-rate schedule depends on them) (model and GPU known; another field "
        "unknown matches only unknown); where several do, the one with the same seed (trainer.seed, Megatron's "
        "--seed); 'missing' when there is no such run, or more than one: never guessed.",
        "Final loss: mean over the last max(1, N // 10) steps. Loss gap: relative difference to BF16 over the last "
        "tenth of the steps both runs logged.",
        f"Divergence alarm: flagged when the mean loss differs from BF16's by more than {tolerance:.1%} (relative) "
        "in any tenth of the common steps after warm-up, or when any loss is NaN/inf (or Megatron counted a nan "
        "iteration), BF16 runs included.",
    ]


def _finite(values: list[Optional[float]]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _median(values: list[Optional[float]]) -> Optional[float]:
    finite = _finite(values)
    return statistics.median(finite) if finite else None


def measure(run: Run) -> Result:
    steps = run.steps
    last = steps[-1].step
    warmup = warmup_steps(last)
    measured, covered, previous = [], 0, 0
    for record in steps:
        if record.step > warmup and not record.fresh:
            measured.append(record)
            covered += record.step - previous
        previous = record.step

    meta = run.meta
    expected = len(measured) + run.skipped_records  # records after warm-up the files hold, read or not
    thin: dict[str, str] = {}

    def median_of(figure: str, values: list[Optional[float]]) -> Optional[float]:
        held = _finite(values)
        if held and not _enough(len(held), expected):
            thin[figure] = f"{len(held)} of {expected} records"
            return None
        return statistics.median(held) if held else None

    tflops = median_of("TFLOP/s/GPU", [r.tflops_per_gpu for r in measured])
    peak = meta.get("peak_tflops_bf16")
    bad = [r.step for r in steps if r.bad_loss]
    bad_grad = [r.step for r in steps if r.bad_grad_norm]
    final_loss = _mean_loss(steps, last - warmup, last)
    with_loss = sum(r.loss is not None for r in steps)
    if final_loss is not None and not _enough(with_loss, len(steps) + run.skipped_records):
        thin["final loss"] = f"{with_loss} of {len(steps) + run.skipped_records} records"
        final_loss = None
    result = Result(
        run=run,
        warmup_steps=warmup,
        steps_measured=covered,
        step_time_s=median_of("step time", [r.time_s for r in measured]),
        tokens_per_s_per_gpu=median_of("tokens/s/GPU", [_tokens_per_s(r, meta) for r in measured]),
        tflops_per_gpu=tflops,
        mfu=tflops / peak if tflops is not None and peak else median_of("MFU", [r.mfu for r in measured]),
        final_loss=final_loss,
        first_bad_step=bad[0] if bad else None,
        first_bad_grad_step=bad_grad[0] if bad_grad else None,
        thin=thin,
    )
    result.state = _state(result, last)
    result.sources = _figure_sources(result, measured, [r for r in steps if last - warmup < r.step <= last])
    result.published = published_for(meta)
    if result.published and result.tokens_per_s_per_gpu is not None:
        result.vs_published = result.tokens_per_s_per_gpu / result.published.tokens
    return result


def _enough(held: int, expected: int) -> bool:
    return held >= MIN_RECORDS and held >= MIN_SHARE * expected


def _state(result: Result, last: int) -> list[str]:
    state = []
    last_record = result.run.steps[-1]
    # The run's last record non-finite: the engine stopped there (Megatron skips a NaN iteration and goes on: flagged,
    # not stopped)
    stopped = [what for what, record in (("loss", last_record.bad_loss), ("gradient norm", last_record.bad_grad_norm))
               if record]
    if stopped:
        state.append(f"stopped: non-finite {' and '.join(stopped)} at step {last}")
    planned = result.meta.get("steps")
    if planned and last < planned:
        state.append(f"incomplete: {last} of {planned} steps")
    if result.run.resumed_at:
        state.append(f"resumed at step {', '.join(str(step) for step in result.run.resumed_at)}")
    return state


def _figure_sources(result: Result, measured: list[Step], last_window: list[Step]) -> dict[str, str]:
    """Where each figure of the run comes from: the lines of the records behind it and the name they print it
    under, or how it was derived; blank where there is no figure."""
    run, keys = result.run, result.run.field_keys

    def held(attribute: str, records: list[Step] = measured) -> str:
        holding = [r for r in records if _finite([getattr(r, attribute)])]
        return lines_of(holding, keys.get(attribute, attribute))

    tokens = held("tokens_per_s_per_gpu")
    if not tokens and held("samples_per_s"):
        tokens = f"derived from samples per second x seq / world size: {held('samples_per_s')}"
    elif not tokens:
        tokens = f"derived from global batch x seq / world size / step time: {held('time_s')}"
    peak = run.meta_source.get("peak_tflops_bf16")
    state = [f"last record: {lines_of(run.steps[-1:])}"]
    if result.meta.get("steps"):
        state.append(f"planned steps: {run.meta_source.get('steps', '')}")
    restarts = [r for r in run.steps[1:] if r.fresh]
    if restarts:
        state.append(f"restarts: {lines_of(restarts)}")
    return {
        "run_state": "; ".join(state),
        "median_step_time_s": held("time_s") if result.step_time_s is not None else "",
        "tokens_per_s_per_gpu": tokens if result.tokens_per_s_per_gpu is not None else "",
        "tflops_per_gpu": held("tflops_per_gpu") if result.tflops_per_gpu is not None else "",
        "mfu": (f"derived from TFLOP/s/GPU / peak_tflops_bf16 ({peak})" if result.tflops_per_gpu is not None and peak
                else held("mfu")) if result.mfu is not None else "",
        "final_loss": held("loss", last_window) if result.final_loss is not None else "",
    }


def _tokens_per_s(record: Step, meta: dict[str, Any]) -> Optional[float]:
    if record.tokens_per_s_per_gpu is not None:
        return record.tokens_per_s_per_gpu
    seq, world, time_s = meta.get("seq"), meta.get("world_size"), record.time_s
    if record.samples_per_s is not None and seq and world:  # Megatron-DeepSpeed's samples per second, all GPUs
        return record.samples_per_s * seq / world
    gbs = record.global_batch_size or meta.get("gbs")
    if gbs and seq and world and time_s and math.isfinite(time_s) and time_s > 0:
        return gbs * seq / world / time_s
    return None


def _mean_loss(steps: list[Step], after: int, upto: int) -> Optional[float]:
    """Mean loss of the records in steps (after, upto]; NaN if any of them is NaN/inf; None if none has a loss."""
    losses = [r.loss for r in steps if after < r.step <= upto and r.loss is not None]
    return sum(losses) / len(losses) if losses else None


def _last_loss_step(result: Result) -> int:
    return max((r.step for r in result.run.steps if r.loss is not None), default=0)


# ---- baselines and comparisons ----


def compare(runs: list[Run], loss_tolerance: float = DEFAULT_LOSS_TOLERANCE) -> list[Result]:
    results = [measure(run) for run in runs]
    baselines = [r for r in results if r.is_bf16]
    for result in results:
        if result.first_bad_step is not None:
            result.flags.append(f"NaN/inf loss from step {result.first_bad_step}")
        if result.first_bad_grad_step is not None:
            result.flags.append(f"NaN/inf gradient norm at step {result.first_bad_grad_step}")
        if result.is_bf16:
            result.baseline_status = "baseline"
            continue
        if not result.meta.get("recipe"):
            result.baseline_status = "precision unknown"
            result.note = f"no speedup: {_unknown_precision(result)}"
            continue
        matches = [b for b in baselines if _same_setup(result.meta, b.meta)]
        seed = result.meta.get("seed")
        same_seed = [b for b in matches if seed is not None and b.meta.get("seed") == seed]
        if len(matches) > 1 and same_seed:
            matches = same_seed
        if len(matches) > 1:
            result.baseline_status = (
                f"ambiguous: {len(matches)} BF16 runs match ({', '.join(b.run.name for b in matches)})"
            )
            result.note = f"speedup missing: {result.baseline_status}; give each its seed with --label FILE:seed=N"
        elif matches:
            result.baseline, result.baseline_status = matches[0], "found"
            _compare_to(result, matches[0], loss_tolerance)
        else:
            result.note = f"speedup missing: {_why_no_match(result, baselines)}"
    return sorted(results, key=_order)


def _label(result: Result, key: str) -> str:
    return "--label " + shlex.quote(f"{result.run.label_target}:{key}={key.upper()}")


def _unknown_precision(result: Result) -> str:
    precision = result.meta.get("precision")
    if precision:
        return f"precision {precision} is none of this project's recipes"
    return f"precision unknown (nothing read says whether FP8 was on); supply it with {_label(result, 'precision')}"


def _why_no_match(result: Result, baselines: list[Result]) -> str:
    """The fields that keep a run from its BF16 baseline, against the closest BF16 run, and the --label that
    supplies each unknown one (model and GPU must be known on both sides; another field matches only its equal)."""
    if not baselines:
        return "no BF16 run among the inputs"

    def blocking(baseline: Result) -> list[str]:
        return [key for key in MATCH_KEYS if result.meta.get(key) != baseline.meta.get(key)
                or (key in REQUIRED_KEYS and result.meta.get(key) is None)]

    closest = min(baselines, key=lambda b: (len(blocking(b)), b.run.name))
    reasons = []
    for key in blocking(closest):
        ours, theirs = result.meta.get(key), closest.meta.get(key)
        if ours is None and theirs is None:
            reasons.append(f"{key} unknown here and on BF16 run {closest.run.name}; supply it with "
                           f"{_label(result, key)} {_label(closest, key)}")
        elif ours is None:
            reasons.append(f"{key} unknown here ({theirs} on BF16 run {closest.run.name}); supply it with "
                           f"{_label(result, key)}")
        elif theirs is None:
            reasons.append(f"{key} unknown on BF16 run {closest.run.name}; supply it with {_label(closest, key)}")
        else:
            reasons.append(f"{key} {ours} here, {theirs} on BF16 run {closest.run.name}")
    return "; ".join(reasons)


def _same_setup(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if not all(a.get(key) for key in REQUIRED_KEYS):
        return False
    return all(a.get(key) == b.get(key) for key in MATCH_KEYS)


def _compare_to(result: Result, baseline: Result, tolerance: float) -> None:
    if result.step_time_s and baseline.step_time_s:
        result.speedup = baseline.step_time_s / result.step_time_s
    elif "step time" not in result.thin and "step time" not in baseline.thin \
            and result.tokens_per_s_per_gpu and baseline.tokens_per_s_per_gpu:
        result.speedup = result.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu
        result.speedup_from = "tokens/s/GPU"
    common = min(_last_loss_step(result), _last_loss_step(baseline))
    if common < 1:
        return
    w = warmup_steps(common)
    worst: Optional[tuple[float, tuple[int, int]]] = None
    end = common
    while end > w:
        start = max(end - w, w)
        ours, theirs = _mean_loss(result.run.steps, start, end), _mean_loss(baseline.run.steps, start, end)
        if ours is not None and theirs and math.isfinite(ours) and math.isfinite(theirs):
            gap = (ours - theirs) / theirs
            if end == common:
                result.loss_gap = gap
            if worst is None or abs(gap) > abs(worst[0]):
                worst = (gap, (start + 1, end))
        end = start
    if worst is not None:
        result.max_loss_gap, result.max_gap_window = worst
        if abs(worst[0]) > tolerance:
            first, last = worst[1]
            result.flags.append(
                f"diverged: loss {worst[0]:+.1%} vs BF16 over steps {first}-{last} (tolerance {tolerance:.1%})"
            )


def _order(result: Result) -> tuple:
    meta = result.meta
    precision = meta.get("precision") or "~"
    rank = PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)
    setup = tuple(str(meta.get(key, "~")) for key in MATCH_KEYS[1:])
    seed = meta.get("seed")
    return (
        meta.get("params") or math.inf, meta.get("model") or "~", setup,
        seed is None, seed or 0, rank, precision, result.run.name,
    )


def flagged(results: list[Result]) -> list[Result]:
    return [r for r in results if r.flags]


# ---- the table, as text cells (report) and as raw values (CSV) ----

UNKNOWN = "unknown"


def _num(value: Optional[float], spec: str) -> str:
    if value is None:
        return UNKNOWN
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return format(value, spec)


def _comparison(result: Result, value: Optional[float], spec: str) -> str:
    if result.baseline_status == "baseline":
        return "baseline"
    if result.baseline is None:
        return "missing"
    return _num(value, spec) + _pairing_note(result)


def _pairing_note(result: Result, speedup: bool = False) -> str:
    """Where the pair's figures come from runs that did not finish (or a speedup from tokens/s/GPU), the cell says
    so."""
    incomplete = [who for who, r in (("this run", result), ("BF16", result.baseline)) if r.incomplete]
    notes = [f"from {result.speedup_from}"] if speedup and result.speedup_from != "step time" else []
    notes += [f"{' and '.join(incomplete)} incomplete"] if incomplete else []
    return f" ({'; '.join(notes)})" if notes else ""


def _speedup_cell(result: Result) -> str:
    if result.baseline is None or result.speedup is None:
        return _comparison(result, None, "")
    return f"{result.speedup:.2f}x{_pairing_note(result, speedup=True)}"


def _published_cells(result: Result) -> tuple[str, str]:
    if result.published is None:
        return "no published row", "n/a"
    published = f"{result.published.tokens:,.0f} ({result.published.label()})"
    if result.vs_published is None:
        return published, _figure(result, "tokens/s/GPU", None, "")
    return published, f"{result.vs_published:.2f}" + (" (this run incomplete)" if result.incomplete else "")


def _figure(result: Result, figure: str, value: Optional[float], spec: str) -> str:
    """A figure's cell: the number, or why it is blank (too few records behind it)."""
    if figure in result.thin:
        return f"too few records ({result.thin[figure]})"
    return _num(value, spec)


def run_state(result: Result) -> str:
    return "; ".join(result.state) or "complete"


def precision_label(meta: dict[str, Any]) -> str:
    label = meta.get("precision", UNKNOWN)
    return f"{label} (emulated)" if meta.get("emulated") and meta.get("recipe") != "bf16" else label


def _batch(meta: dict[str, Any]) -> str:
    return f"{meta.get('mbs', '?')}/{meta.get('gbs', '?')}" if ("mbs" in meta or "gbs" in meta) else UNKNOWN


def display_rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    headers = [
        *("run", "model", "GPU", "nodes", "GPUs", "engine", "precision", "layout", "MBS/GBS", "seq", "run state"),
        *("steps measured", "step time (s)", "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "speedup vs BF16"),
        *("NVIDIA published (tokens/s/GPU)", "ours / published", "final loss", "loss gap vs BF16", "flag"),
    ]
    rows = []
    for r in results:
        m = r.meta
        rows.append(
            [
                r.run.name,
                m.get("model", UNKNOWN),
                m.get("gpu", UNKNOWN),
                str(m.get("nodes", UNKNOWN)),
                str(m.get("world_size", UNKNOWN)),
                m.get("engine", UNKNOWN),
                precision_label(m),
                describe_layout(m),
                _batch(m),
                str(m.get("seq", UNKNOWN)),
                run_state(r),
                str(r.steps_measured),
                _figure(r, "step time", r.step_time_s, ".4g"),
                _figure(r, "tokens/s/GPU", r.tokens_per_s_per_gpu,
                        ",.0f" if (r.tokens_per_s_per_gpu or 0) >= 100 else ".3g"),
                _figure(r, "TFLOP/s/GPU", r.tflops_per_gpu, ".1f" if (r.tflops_per_gpu or 0) >= 10 else ".3g"),
                _figure(r, "MFU", r.mfu, ".1%"),
                _speedup_cell(r),
                *_published_cells(r),
                _figure(r, "final loss", r.final_loss, ".4f"),
                _comparison(r, r.loss_gap, "+.2%"),
                "; ".join(r.flags),
            ]
        )
    return headers, rows


CSV_HEADERS = """
    run model params gpu nodes world_size engine precision recipe emulated tp pp cp vp dp mbs gbs seq seed
    run_state steps_logged last_step warmup_steps steps_measured median_step_time_s tokens_per_s_per_gpu
    tflops_per_gpu mfu too_few_records baseline speedup speedup_from published_tokens_per_s_per_gpu published_row
    ours_over_published final_loss loss_gap_vs_bf16 max_loss_gap_vs_bf16 flag note format sources
""".split()
META_COLUMNS = CSV_HEADERS[1 : CSV_HEADERS.index("seed") + 1]  # model .. seed, straight from the run's metadata
FIGURE_COLUMNS = ["run_state", "median_step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "final_loss"]
# Where each value of a row came from (`run.log line 12 (tensor_model_parallel_size)`, `config.yaml (trainer.seed)`,
# `run.log lines 20-100 (elapsed time per iteration (ms))`): a `<column>_source` column for each, after the rest
CSV_HEADERS += [f"{column}_source" for column in META_COLUMNS + FIGURE_COLUMNS]


def csv_rows(results: list[Result], display_path) -> list[list[str]]:
    """Raw values; an empty cell is the one missing-value code (unknown, or not applicable: a BF16 run has no
    baseline). `baseline` holds a run name or nothing; why there is none is in `note`."""

    def raw(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return format(value, ".10g")
        return str(value)

    rows = []
    for r in results:
        m = r.meta
        values = [
            r.run.name,
            *(m.get(key) for key in META_COLUMNS),
            "; ".join(r.state) or "complete",
            *(len(r.run.steps), r.run.steps[-1].step, r.warmup_steps, r.steps_measured),
            *(r.step_time_s, r.tokens_per_s_per_gpu, r.tflops_per_gpu, r.mfu),
            "; ".join(f"{figure}: {why}" for figure, why in r.thin.items()),
            r.baseline.run.name if r.baseline else None,
            r.speedup, r.speedup_from if r.speedup is not None else None,
            r.published.tokens if r.published else None, r.published.label() if r.published else None,
            r.vs_published,
            *(r.final_loss, r.loss_gap, r.max_loss_gap, "; ".join(r.flags), r.note),
            r.run.format,
            " ".join(display_path(p) for p in r.run.paths),
            *(r.run.meta_source.get(key) if m.get(key) is not None else None for key in META_COLUMNS),
            *(r.sources.get(column) for column in FIGURE_COLUMNS),
        ]
        rows.append([raw(v) for v in values])
    return rows


# ---- several seeds of one setup ----

SEEDS_RULE = (
    "One row per recipe and setup trained with several seeds, each run paired with the BF16 run of its own seed "
    "(same setup and seed): the loss gap (last tenth of the common steps) averaged over the seeds, its sample "
    "standard deviation and range, and the median speedup. A single seed's gap mixes the recipe's effect with "
    "run-to-run noise; the mean over seeds is what to hold against a tolerance."
)


def _with_baselines(results: list[Result]) -> list[Result]:
    return list({id(r): r for result in results for r in (result, result.baseline)}.values())


def across_seeds(results: list[Result], tolerance: float) -> tuple[Optional[Table], list[str]]:
    """The seeds table (None when no recipe has two paired seeds) and notes on groups it could not summarise."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        seed = r.meta.get("seed")
        if r.baseline is None or r.loss_gap is None or seed is None or r.baseline.meta.get("seed") != seed:
            continue
        setup = tuple(r.meta.get(key) for key in MATCH_KEYS)
        groups.setdefault((setup, precision_label(r.meta)), []).append(r)
    headers = [
        *("model", "GPU", "precision", "layout", "MBS/GBS", "seq", "seeds"),
        *("mean loss gap vs BF16", "std of the gap", "min gap", "max gap", "median speedup"),
        f"mean within ±{tolerance:.1%}", "run states",
    ]
    rows, notes = [], []
    for (_, label), members in groups.items():
        seeds = [r.meta["seed"] for r in members]
        if len(set(seeds)) < len(seeds):
            repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
            names = ", ".join(r.run.name for r in members if r.meta["seed"] in repeated)
            which = ", ".join(str(seed) for seed in repeated)
            notes.append(f"across seeds: {label} not summarised: seed {which} has several runs ({names})")
            continue
        if len(members) < 2:
            continue
        gaps = [r.loss_gap for r in members]
        mean = statistics.mean(gaps)
        m = members[0].meta
        rows.append(
            [
                m.get("model", UNKNOWN), m.get("gpu", UNKNOWN), label, describe_layout(m),
                _batch(m), str(m.get("seq", UNKNOWN)),
                ", ".join(str(seed) for seed in sorted(seeds)),
                _num(mean, "+.2%"), _num(statistics.stdev(gaps), ".2%"),
                _num(min(gaps), "+.2%"), _num(max(gaps), "+.2%"),
                _num(_median([r.speedup for r in members]), ".2f"),
                "yes" if abs(mean) <= tolerance else "no",
                "; ".join(f"{r.run.name}: {run_state(r)}" for r in _with_baselines(members) if r.state) or "complete",
            ]
        )
    return ((headers, rows) if rows else None), notes
