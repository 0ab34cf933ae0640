"""The docs as tests: the README and the pages of docs/ run as written, their links resolve, and every measured
figure in them is what the benchmark records give.

- Every `python launch/run.py ... dryrun=true` line of a ```bash block plans as written (the Slurm examples
  included), launched as a user launches it.
- Every ```console block is run: each `$ command` and the lines after it, the output it must print (`...` alone on
  a line stands for any lines, within a line for any text; an expected `error:` line means a non-zero exit).
- Every relative link of README.md, docs/*.md and docs/results/*.md names a file that exists, and a heading there.
- The tables between `<!-- figures:... -->` markers are what `scripts/render_figures.py` renders from the records
  (its `--check`), and the README holds no measured figure outside them.
- The benchmarks write their records: rows and provenance.json (command, commit, date, versions, device).

Launches are forked from this process, as tests/test_launch.py's error cases are, to stay fast on two cores.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_launch import REPO, TRACEBACK, Launch, launch_environment, launches_forked

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(p for p in DOCS.glob("*.md"))]  # the front door and the topic pages
RESULT_PAGES = sorted((DOCS / "results").glob("*.md"))
RUN_PY = "python launch/run.py"


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^ *```{language}\n(.*?)^ *```", text, re.S | re.M)


def dry_runs(page: Path) -> list[str]:
    """Every `python launch/run.py ... dryrun=true` line of a page's bash blocks (continuation lines joined)."""
    commands = []
    for block in fenced(page.read_text(), "bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(RUN_PY) and "dryrun=true" in shlex.split(line):
                commands.append(line)
    return commands


def console_examples(page: Path) -> list[tuple[str, list[str]]]:
    """(command, the lines it must print) of each `$ ` line of a page's console blocks."""
    examples = []
    for block in fenced(page.read_text(), "console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:].strip(), []))
            elif line.strip():
                examples[-1][1].append(line.rstrip())
    return examples


def matches(expected: list[str], printed: list[str]) -> bool:
    """The printed lines, blank ones dropped, are the expected ones in order; `...` alone skips any lines, `...` within
    a line stands for any text."""
    printed = [line.rstrip() for line in printed if line.strip()]
    def fits(e: int, p: int) -> bool:
        if e == len(expected):
            return p == len(printed)
        if expected[e] == "...":
            return any(fits(e + 1, q) for q in range(p, len(printed) + 1))
        pattern = ".*".join(map(re.escape, expected[e].split("...")))
        return p < len(printed) and re.fullmatch(pattern, printed[p]) is not None and fits(e + 1, p + 1)
    return fits(0, 0)


def run_elsewhere(command: str, cwd: Path) -> Launch:
    """A non-launch command of the docs (scripts/...), from a fresh folder where `scripts` and `tests` are the
    repository's, so its outputs land in that folder."""
    env = launch_environment(cwd)
    for name in ("scripts", "tests"):
        (cwd / name).symlink_to(REPO / name)
    argv = shlex.split(command)
    assert argv[0] == "python", command
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    return Launch(tuple(argv[1:]), cwd, proc.returncode, proc.stdout, "")


# ---- examples ----


def test_the_readme_and_docs_dry_run_examples_plan_as_written(tmp_path):
    commands = {f"{page.name}:{i}": command for page in PAGES for i, command in enumerate(dry_runs(page))}
    assert any(key.startswith("README.md:") for key in commands), "the README shows a dry run"
    assert any("executor=slurm" in c for key, c in commands.items() if key.startswith("slurm.md:"))
    assert any("executor.slurm.tunnel=ssh" in c for c in commands.values())
    results = launches_forked({key: (tmp_path / re.sub(r"\W", "_", key), tuple(shlex.split(command)[2:]))
                               for key, command in commands.items()})
    for key, result in results.items():
        assert result.returncode == 0 and TRACEBACK not in result.output, f"{key}: {commands[key]}\n{result}"


def test_the_console_examples_print_what_the_docs_show(tmp_path):
    examples = {f"{page.name}:{i}": example for page in PAGES for i, example in enumerate(console_examples(page))}
    assert {key.split(":")[0] for key in examples} >= {"configuration.md", "slurm.md", "fp8_recipes.md",
                                                       "checkpoints.md", "reports.md", "benchmarks.md"}
    folder = {key: tmp_path / re.sub(r"\W", "_", key) for key in examples}
    launched = launches_forked({key: (folder[key], tuple(shlex.split(command)[2:]))
                                for key, (command, _) in examples.items() if command.startswith(RUN_PY + " ")})
    for key, (command, _) in examples.items():
        if key not in launched:
            folder[key].mkdir()
            launched[key] = run_elsewhere(command, folder[key])
    for key, (command, expected) in examples.items():
        result = launched[key]
        assert TRACEBACK not in result.output, f"{key}: {command}\n{result}"
        assert (result.returncode != 0) == any("error:" in line for line in expected), f"{key}: {command}\n{result}"
        assert matches(expected, result.output.splitlines()), (
            f"{key}: `{command}` printed\n{result.output}\nwhere the docs show\n" + "\n".join(expected))


def test_the_example_matcher_skips_and_anchors():
    assert matches(["a", "...", "c ... e"], ["a", "b", "", "c d e"])
    assert not matches(["a", "c"], ["a", "b", "c"])
    assert not matches(["a"], ["a", "b"]) and matches(["a", "..."], ["a", "b"])
    assert matches(["... error: x"], ["compare.py: error: x"]) and not matches(["error: x"], ["compare.py: error: x"])


# ---- the front door ----


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert any("python -m pytest -q" in block for block in fenced(readme, "bash")), "the README's test command"
    assert re.search(r"^python -m pytest -q$", (REPO / ".ci" / "run").read_text(), re.M), ".ci/run runs it"
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"the README links docs/{page.name}"


FIGURE = re.compile(r"\d\.\d+x\b|\d+(\.\d+)?%|\d[\d,]* tokens/s|\b\d+(\.\d+)? (ms|s|GiB) per step|\b\d\.\d{3}\b")


def outside_markers(text: str) -> str:
    return re.sub(r"<!-- figures:([\w-]+):begin -->.*?<!-- figures:\1:end -->", "", text, flags=re.S)


def test_no_measured_figure_is_typed_in_the_readme():
    """Speedups, ratios, percentages, throughputs and step times appear only in the rendered blocks."""
    typed = [m.group(0) for m in FIGURE.finditer(outside_markers((REPO / "README.md").read_text()))]
    assert not typed, f"figures typed into README.md outside the rendered tables: {typed}"


def test_the_config_groups_table_names_every_option():
    text = (DOCS / "configuration.md").read_text()
    for group in ("model", "precision", "gpu", "executor", "data", "layout"):
        row = re.search(rf"^\| `{group}` \|(.*)\|$", text, re.M)
        assert row, f"docs/configuration.md has no row for {group}"
        options = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        named = set(re.findall(r"`(\w+)`", row.group(1)))
        assert options <= named, f"{group}: {sorted(options - named)} missing from docs/configuration.md"


# ---- links ----


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_every_link_of_the_docs_resolves():
    broken = []
    for page in [*PAGES, *RESULT_PAGES]:
        text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---- the figures and their records ----


@pytest.fixture
def render(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import render_figures

    return render_figures


def test_the_rendered_figures_are_what_the_records_give(render, capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().err


def layer_bench_record(folder: Path, model: str, layers: int, steps: dict[str, float]) -> Path:
    """A layer_bench record as the script writes it: results.csv (each precision's step in s, its speedup over
    the BF16 column) and provenance.json of commit abcdef0123 on 2027-01-02."""
    folder.mkdir()
    rows = [{"model": model, "layers": layers, "precision": p, "median_step_s": s,
             "speedup_vs_bf16": steps["bf16"] / s} for p, s in steps.items()]
    with (folder / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "provenance.json").write_text(json.dumps({"command": "python scripts/layer_bench.py ...",
                                                        "commit": "abcdef0123", "date": "2027-01-02T03:04:05+00:00"}))
    return folder


def test_a_newer_record_takes_the_cells_it_holds_and_the_table_says_so(render, tmp_path):
    record = layer_bench_record(tmp_path / "layer_bench_new", "llama3_8b", 4, {"bf16": 0.7, "fp8_current": 0.5})
    new = render.record({"path": str(record), "section": "per_tensor_kernels.md"})
    assert (new.commit, new.date) == ("abcdef0", "2027-01-02")
    table = render.fp8_speedup_table([new, *render.load_index()["layer_bench"]], render.RESULTS)
    assert "| llama3_8b (4) | 1.400x | 1.442x | 1.181x |" in table  # fp8_delayed and blockwise: older records
    assert "`abcdef0`, 2027-01-02 for llama3_8b" in table and "`d756c36`, 2026-12-03 for llama3_70b" in table


def test_a_granularity_row_is_against_the_peer_training_the_same_recipe(render, tmp_path):
    steps = {"bf16": 0.7, "fp8_rowwise": 0.5, "torchao_rowwise": 0.625, "fp8_rowwise_gw_hp": 0.56,
             "torchao_rowwise_with_gw_hp": 0.5, "fp8_blockwise_1d1d": 0.6, "te_megatron_blockwise_1d1d": 0.6,
             "fp8_current": 0.4}  # fp8_current: not a granularity row, and not read from this study
    record = layer_bench_record(tmp_path / "lb_granularity", "llama3_70b", 2, steps)
    index = render.load_index()
    index["granularity"] = [render.record({"path": str(record), "section": "granularity.md"})]
    table = render.fp8_recipes_table(index, render.RESULTS).splitlines()
    row = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table if line.startswith("| fp8_")}
    assert row["fp8_rowwise"][0] == "1.400x (1 of 5 proxies)" and row["fp8_rowwise"][-1] == "0.800 (torchao) |"
    assert row["fp8_rowwise_gw_hp"][-1] == "1.120 (torchao) |"
    assert row["fp8_blockwise_1d1d"][0] == "1.167x (1 of 5 proxies)"
    assert row["fp8_blockwise_1d1d"][-1] == "1.000 (TE as Megatron) |"
    assert row["fp8_current"][0] != "1.750x (1 of 5 proxies)"  # the per-tensor rows keep their own records


def study_record(folder: Path, losses: dict[tuple[str, int], object]) -> Path:
    """A recipe study's record as megatron_bench writes it: results.csv with every planned run (label, seed) and its
    mean loss of the last 100 steps ("" where it did not finish; seed 2 of nvfp4 timed out, seed 3 of it was not
    run), and results.md's footer naming commit abcdef0123; BF16 of seed 3 finished in an earlier call."""
    folder.mkdir()
    rows = [{"name": f"torch-llama3_100m-{label}-seed{seed}", "status": {("nvfp4", 2): "timeout", ("nvfp4", 3):
             "not run (budget)"}.get((label, seed), "ok"), "mean_loss_last_100": loss,
             "note": "finished in an earlier call: commit 1234567890ab, X" if (label, seed) == ("bf16", 3) else ""}
            for (label, seed), loss in losses.items()]
    with (folder / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "results.md").write_text("commit abcdef0123; X; versions {'torch': '2'}\ncommand: scripts/megatron_bench.py"
                                       " run\n")
    return folder


def test_a_recipe_rows_loss_is_its_studys_mean_gap_over_the_seeds_that_finished(render, tmp_path):
    """The loss column of the granularity and NVFP4 rows: each run of a recipe study (megatron_bench's results.csv)
    against BF16 of its seed, averaged over the seeds whose runs finished, saying how many of the seeds the record
    lists; a run an earlier call finished is named with that call's commit."""
    losses = {("bf16", 1): 2.0, ("bf16", 2): 2.5, ("bf16", 3): 4.0, ("fp8_rowwise", 1): 2.02, ("fp8_rowwise", 2): 2.5,
              ("fp8_rowwise", 3): 4.04, ("nvfp4", 1): 2.1, ("nvfp4", 2): 9.0, ("nvfp4", 3): ""}
    index = render.load_index()
    index["recipe_studies"] = [render.record({"path": str(study_record(tmp_path / "study", losses)),
                                              "section": "granularity.md", "date": "2027-01-02"})]
    table = render.fp8_recipes_table(index, render.RESULTS)
    row = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()
           if line.startswith("| ")}
    assert row["fp8_rowwise"][2] == "+0.67% (mean of 3 seeds)"  # +1%, 0%, +1%
    assert row["nvfp4"][2] == "+5.00% (1 of 3 seeds so far), emulated"  # seed 2 did not finish
    assert row["fp8_rowwise_gw_hp"][2] == "-" and row["fp8_blockwise_2d2d"][2] == "-"
    assert "loss of fp8_rowwise: `abcdef0`, 2027-01-02 for seeds 1, 2, 3" in table
    assert "`1234567`, 2027-01-02 for seed 3" in table


def test_the_granularity_table_sets_every_granularity_beside_the_others_on_each_proxy(render, tmp_path):
    """Each granularity's speedup per proxy from the newest record holding it (issue 50's records for the new ones,
    the per-tensor and TE-block columns from theirs), and one loss row from the newest granularity study, where all
    of them ran beside the same BF16 runs; 2D2D has no kernel to time."""
    record = layer_bench_record(tmp_path / "lb_405b", "llama31_405b", 1,
                                {"bf16": 0.8, "fp8_rowwise": 0.5, "fp8_rowwise_gw_hp": 0.64, "fp8_blockwise_1d1d": 0.625})
    losses = {("bf16", 1): 2.0, ("bf16", 2): 2.5, ("fp8_current", 1): 2.04, ("fp8_current", 2): 2.55,
              ("fp8_blockwise_2d2d", 1): 2.0, ("fp8_blockwise_2d2d", 2): ""}
    index = render.load_index()
    index["granularity"] = [render.record({"path": str(record), "section": "granularity.md"}), *index["granularity"]]
    index["recipe_studies"] = [render.record({"path": str(study_record(tmp_path / "study", losses)),
                                              "section": "granularity.md", "date": "2027-01-02"})]
    table = render.granularity_table(index, render.RESULTS)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["llama31_405b (1)"][2:] == ["1.600x", "1.250x", "1.280x", "no kernel |"]
    current = render.Sources().pick("", "", index["layer_bench"], render.speedup("llama31_405b", "fp8_current"))[0]
    assert rows["llama31_405b (1)"][0] == render.fmt_x(current) != "-"  # the speedup study's, on its record
    assert rows["loss vs BF16, llama3_100m"] == ["+2.00% (mean of 2 seeds)", "-", "-", "-", "-",
                                                 "+0.00% (1 of 2 seeds so far) |"]
    assert "`abcdef0`, 2027-01-02 for llama31_405b" in table


def test_the_readmes_recipe_table_says_what_each_loss_is_compared_with(render, tmp_path):
    """The README's rows are fp8_recipes_table's without the GEMM; under them, fp8_current's gap in each recipe
    study's newest record, so that a loss is read against its own study's."""
    granularity = study_record(tmp_path / "granularity", {("bf16", 1): 2.0, ("fp8_current", 1): 2.06,
                                                          ("fp8_rowwise", 1): 2.02})
    nvfp4 = study_record(tmp_path / "nvfp4", {("bf16", 1): 2.0, ("fp8_current", 1): 1.98, ("nvfp4", 1): 2.1})
    older = study_record(tmp_path / "older", {("bf16", 1): 2.0, ("fp8_current", 1): 3.0})
    index = render.load_index()
    index["recipe_studies"] = [render.record({"path": str(path), "section": section, "date": "2027-01-02"})
                               for path, section in ((granularity, "granularity.md"), (nvfp4, "nvfp4.md#x"),
                                                     (older, "granularity.md"))]
    table = render.readme_recipes_table(index, REPO)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["fp8_rowwise"][1] == "+1.00% (mean of 1 seeds)" and len(rows["fp8_rowwise"]) == 3
    assert "fp8_current ended +3.00% in the granularity study, -1.00% in the nvfp4 study" in table
    assert "[docs/fp8_recipes.md](docs/fp8_recipes.md#what-each-buys-and-costs)" in table


def test_a_figure_typed_over_is_caught(render, tmp_path, monkeypatch):
    text = render.PAGES["readme"].read_text()
    row = next(line for line in text.splitlines() if line.startswith("| llama3_8b (4) | "))
    page = tmp_path / "README.md"
    page.write_text(text.replace(row, row.replace("| llama3_8b (4) | ", "| llama3_8b (4) | 9", 1)))
    monkeypatch.setitem(render.PAGES, "readme", page)
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0 and row in page.read_text()


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_provenance(folder: Path, script: str) -> None:
    record = json.loads((folder / "provenance.json").read_text())
    assert record["command"].startswith(f"python scripts/{script}.py")
    assert {"commit", "date", "versions", "device"} <= set(record) and record["versions"]["torch"]


def test_the_benchmarks_write_rows_and_provenance(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    gemm_bench = load_script("gemm_bench")
    rows = [{"shape": "sweep M=N=8192", "M": 8192, "N": 8192, "K": k, "variant": v, "ms": 1.0, "tflops": 1.0,
             "speedup": 1.0} for k in (1024, 2048) for v in ("bf16", "tensorwise")]
    gemm_bench.write_records(rows, tmp_path / "gemm", ["--out", "OUT"])
    assert_provenance(tmp_path / "gemm", "gemm_bench")
    assert len(list(csv.DictReader((tmp_path / "gemm" / "gemm.csv").open()))) == 4

    megatron_bench = load_script("megatron_bench")
    megatron_bench.write_results("loss", [], {}, tmp_path / "megatron", tmp_path, None, "abc1234")
    assert_provenance(tmp_path / "megatron", "megatron_bench")

    scaling_bench = load_script("scaling_bench")
    run = scaling_bench.Run("c", "llama3_8b", "bf16", 1, {"global_batch_size": 2}, (("num_layers", 4),))
    run_dir = tmp_path / "runs" / run.name
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"peak_memory_gib": 1.5, "mfu": 0.5, "commit": "abc1234"}))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 2.0, "step_time_s": 0.5, "tokens_per_s_per_gpu": 100.0 + s,
                    "model_tflops_per_gpu": 1.0, "mfu": 0.5}) + "\n" for s in range(1, 7)))
    scaling_bench.write_records([run], {run.name: run_dir}, tmp_path / "scaling", 1, 1.0)
    assert_provenance(tmp_path / "scaling", "scaling_bench")
    [row] = csv.DictReader((tmp_path / "scaling" / "results.csv").open())
    assert row["run"] == run.name and float(row["tokens_per_s_per_gpu"]) == 105.0 and row["status"] == "ok"


def test_gemm_bench_times_the_shapes_and_variants_named_and_refuses_others_before_the_gpu(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    gemm_bench = load_script("gemm_bench")
    fc = gemm_bench.model_gemm_shapes("llama3_8b")
    assert gemm_bench.shape_set("llama3_8b") == fc
    assert gemm_bench.shape_set("llama3_70b/fc1") == gemm_bench.model_gemm_shapes("llama3_70b")[2:3]
    # the weight gradient of a linear y (tokens, out) = x (tokens, in) @ w^T: dw (out, in) = dy^T @ x, K the tokens
    assert gemm_bench.shape_set("llama3_8b/wgrad") == [(f"{label}/wgrad", n, k, m) for label, m, n, k in fc]
    assert gemm_bench.shape_set("llama3_8b/out/wgrad") == [("llama3_8b/out/wgrad", 4096, 4096, 8192)]
    assert gemm_bench.shape_set("sweep") == [("sweep M=N=8192", 8192, 8192, k) for k in gemm_bench.K_SWEEP]
    assert gemm_bench.shape_set("sweep:4096") == [("sweep M=N=8192", 8192, 8192, 4096)]
    timed = []
    monkeypatch.setattr(gemm_bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gemm_bench, "bench_shape", lambda *shape: timed.append(shape) or [])
    monkeypatch.setattr(gemm_bench, "write_records", lambda rows, out, argv: None)
    assert gemm_bench.main(["--out", str(tmp_path), "--shapes", "sweep:8192,llama3_8b/qkv",
                            "--variants", "1x128_x_128x128,cutlass_tma_scales_1x128_x_128x128"]) == 0
    names = ("bf16", "1x128_x_128x128", "cutlass_tma_scales_1x128_x_128x128")  # BF16 first: every row's baseline
    assert timed == [("sweep M=N=8192", 8192, 8192, 8192, 5, 30, names), (*fc[0], 5, 30, names)]
    for bad, says in ((["--shapes", "llama3_8b/fc3"], "LINEAR one of qkv"), (["--shapes", "sweep:k"], "sweep:K"),
                      (["--shapes", "llama4"], "MODEL one of"), (["--variants", "bf16,fp4"], "unknown fp4")):
        with pytest.raises(SystemExit) as refused:
            gemm_bench.main(["--out", str(tmp_path), *bad])
        assert refused.value.code == 2 and says in capsys.readouterr().err
    assert timed == [("sweep M=N=8192", 8192, 8192, 8192, 5, 30, names), (*fc[0], 5, 30, names)]


def test_layer_bench_writes_its_provenance(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import argparse

    layer_bench = load_script("layer_bench")
    row = {"model": "tiny_llama", "layers": 1, "seq_length": 32, "precision": "bf16", "graph_breaks": 0,
           "median_step_s": 0.1, "model_tflops": 1.0, "model_tflops_full_attention": 1.0, "peak_memory_gib": 0.1,
           "speedup_vs_bf16": 1.0, "profile": None}
    layer_bench.write_results([row], argparse.Namespace(out=tmp_path), ["--out", str(tmp_path)])
    assert_provenance(tmp_path, "layer_bench")
    assert os.path.getsize(tmp_path / "results.csv") > 0
