"""launch/run.py: composition, validation and planning, run as a user runs it (a subprocess), with dryrun=true.

Every launch runs in its own temporary directory as cwd, with FP8_RECIPES_RUNS, FP8_RECIPES_CACHE and HOME pointing
into it, and is checked to have written nothing outside FP8_RECIPES_RUNS: no Hydra `outputs/`, `multirun/` or
`.hydra/` folders, nothing in the repository, nothing in the home directory.

The error cases are independent launches, each forked from the test process with torch and Hydra imported (one
fixture, four at a time) to keep the suite fast on a two-core machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from recipes.config import (
    Config,
    ConfigError,
    DataConfig,
    DataKind,
    ExecutorConfig,
    RunConfig,
    TrainerConfig,
    VALUE_RANGES,
    check_values,
    load_config,
    load_option,
)
from recipes.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "launch" / "run.py"
CONF = REPO / "conf"
TRACEBACK = "Traceback (most recent call last)"
GROUPS = ("model", "precision", "gpu", "executor", "data")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


MODELS = options("model")
LLAMA_PARAMETERS = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama31_405b": 405_853_388_800}


# ---- running launch/run.py ----


@dataclass
class Launch:
    args: tuple[str, ...]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str

    # Not "runs" and "cache": a launch that ignored the variables and used its defaults would be caught.
    @property
    def runs(self) -> Path:
        return self.cwd / "fp8_runs"

    @property
    def cache(self) -> Path:
        return self.cwd / "fp8_cache"

    @property
    def home(self) -> Path:
        return self.cwd / "home"

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def config_files(self) -> list[Path]:
        return sorted(self.cwd.rglob("config.yaml"))

    def lines(self, label: str) -> list[str]:
        """Lines of the printed plan that start with `label` (model, precision, gpu, memory/GPU, command, ...)."""
        return [line for line in self.stdout.splitlines() if line.split(" ", 1)[0] == label]

    def __str__(self) -> str:
        command = f"launch/run.py {' '.join(self.args)} -> {self.returncode}"
        return f"{command}\n--- stdout\n{self.stdout}--- stderr\n{self.stderr}"


def launch_environment(cwd: Path) -> dict[str, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(
        FP8_RECIPES_RUNS=str(cwd / "fp8_runs"),
        FP8_RECIPES_CACHE=str(cwd / "fp8_cache"),
        HOME=str(cwd / "home"),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


def launch(cwd: Path, *args: str) -> Launch:
    env = launch_environment(cwd)
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    return Launch(args, cwd, proc.returncode, proc.stdout, proc.stderr)


def launches_forked(cases: dict[str, tuple[Path, tuple[str, ...]]], at_once: int = 4) -> dict[str, Launch]:
    """launch() of each case, run as launch/run.py's `__main__` in a child forked from this process, which has
    imported torch, Hydra and recipes already: the same code, command line, environment and working directory,
    without the seconds of Python and torch starting up in each (the error cases are many). `at_once` children
    at a time; this process forks them from its one thread."""
    import runpy

    import hydra._internal.utils  # noqa: F401  what launch/run.py imports, imported once here
    import recipes.hydra_schema  # noqa: F401
    import recipes.launcher  # noqa: F401
    import recipes.plan.describe  # noqa: F401
    import recipes.plan.gpu  # noqa: F401
    import recipes.plan.run_dir  # noqa: F401
    from hydra.core.global_hydra import GlobalHydra

    def start(cwd: Path, args: tuple[str, ...]) -> int:
        env, streams = launch_environment(cwd), [cwd.with_name(f"{cwd.name}.{stream}") for stream in ("out", "err")]
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            for fd, path in zip((1, 2), streams):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            sys.stdin = open(os.devnull)  # not pytest's captured stdin: nemo-run's Slurm dry run runs shell commands
            sys.argv = [str(RUN_PY), *args]
            GlobalHydra.instance().clear()  # a test before may have composed in this process
            try:
                runpy.run_path(str(RUN_PY), run_name="__main__")
                code = 0
            except SystemExit as exit_:  # as the interpreter ends: a message goes to stderr, with status 1
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    pending, running, status = list(cases.items()), {}, {}
    while pending or running:
        while pending and len(running) < at_once:
            name, (cwd, args) = pending.pop(0)
            running[start(cwd, args)] = name
        pid, wait_status = os.wait()
        status[running.pop(pid)] = os.waitstatus_to_exitcode(wait_status)
    return {name: Launch(args, cwd, status[name], *(cwd.with_name(f"{cwd.name}.{stream}").read_text()
                                                    for stream in ("out", "err")))
            for name, (cwd, args) in cases.items()}


def assert_confined(result: Launch, allowed: tuple[str, ...] = ()) -> None:
    """Nothing written outside FP8_RECIPES_RUNS (and `allowed` entries of cwd); no Hydra output folders."""
    top = {p.name for p in result.cwd.iterdir()}
    allowed_top = {result.runs.name, result.cache.name, "home", *allowed}
    assert top <= allowed_top, f"unexpected files in cwd: {sorted(top)}\n{result}"
    assert not any(result.home.iterdir()), f"wrote into HOME: {list(result.home.rglob('*'))}"
    for path in result.cwd.rglob("*"):
        assert path.name != ".hydra", f"Hydra wrote {path}"
        if path.name in ("outputs", "multirun"):
            assert result.runs in path.parents, f"Hydra output folder outside FP8_RECIPES_RUNS: {path}"


def assert_nothing_launched(result: Launch) -> None:
    assert not (result.runs / "nemo-run").exists(), "nemo-run was started"
    assert not list(result.cwd.rglob("metrics.jsonl")), "an engine ran"


def assert_clean_failure(result: Launch, *expected: str) -> None:
    assert result.returncode != 0, str(result)
    assert TRACEBACK not in result.output, str(result)
    for text in expected:
        assert text in result.output, f"{text!r} not in the message\n{result}"
    assert not result.config_files(), "a failed launch saved a config"
    assert_nothing_launched(result)
    assert_confined(result)


REPO_PATHS = ("runs", "outputs", "multirun", ".hydra", "launch/outputs", "launch/multirun", "launch/.hydra")


def repo_state() -> dict:
    return {p: sorted(os.listdir(REPO / p)) if (REPO / p).exists() else None for p in REPO_PATHS}


@pytest.fixture(scope="module", autouse=True)
def repo_baseline():
    return repo_state()


@pytest.fixture(autouse=True)
def repo_untouched(repo_baseline):
    yield
    assert repo_state() == repo_baseline, "a launch wrote into the repository"


def engine_command(config_path: Path) -> str:
    """The plan's command line for one process: this interpreter runs the engine module on the saved config."""
    return f"command     {sys.executable} -m recipes.engine.torch_engine {config_path}"


def only_run_dir(result: Launch) -> Path:
    configs = result.config_files()
    assert len(configs) == 1, f"{configs}\n{result}"
    return configs[0].parent


# ---- a default launch ----


@pytest.mark.parametrize("precision, blocks", [
    ("fp8_blockwise", "blocks input 1x128, weight 128x128, grad 1x128)"),
    ("fp8_blockwise_1d1d", "blocks input 1x128, weight 1x128, grad 1x128)"),
    ("fp8_blockwise_2d2d", "blocks input 128x128, weight 128x128, grad 128x128, emulated)"),
])
def test_the_plan_names_each_operands_blocks(tmp_path, precision, blocks):
    result = launch(tmp_path, f"precision={precision}", "gpu=h100", "dryrun=true")
    assert result.returncode == 0, str(result)
    (line,) = result.lines("precision")
    assert line == f"precision   {precision} (recipe blockwise, format e4m3, {blocks}", line


def test_default_compose_plans_tiny_llama_fp8_current(tmp_path):
    result = launch(tmp_path, "dryrun=true")
    assert result.returncode == 0, str(result)
    assert TRACEBACK not in result.output
    run_dir = only_run_dir(result)
    assert run_dir.parent == result.runs
    assert re.fullmatch(r"\d{8}-\d{6}-tiny_llama-fp8_current", run_dir.name)

    (model,) = result.lines("model")
    assert model.startswith("model       tiny_llama: 3,311,872 parameters, 4 layers")
    (precision,) = result.lines("precision")
    assert precision.startswith("precision   fp8_current (recipe tensorwise")
    (memory,) = result.lines("memory")  # on this CPU: per process, no GPU wording
    numbers = re.fullmatch(
        r"memory      ~([\d.,]+) GiB per process \(weights ([\d.,]+), grads ([\d.,]+), optimizer ([\d.,]+), "
        r"activations ([\d.,]+); [\d.,]+ with full recompute\)",
        memory,
    )
    assert numbers, memory
    total, *parts = (float(n.replace(",", "")) for n in numbers.groups())
    assert total == pytest.approx(sum(parts), abs=0.15)
    assert total >= 16 * 3_180_800 / 2**30  # FP32 weights, grads and two Adam moments at least
    assert result.lines("command") == [engine_command(run_dir / "config.yaml")]
    assert "dry run: nothing launched" in result.stdout
    assert_nothing_launched(result)
    assert_confined(result)

    cfg = load_config(run_dir / "config.yaml")
    assert cfg.model == load_option("model", "tiny_llama")
    assert cfg.precision == load_option("precision", "fp8_current")
    assert cfg.gpu.name != "auto"  # gpu=auto is resolved before the config is saved
    if not torch.cuda.is_available():
        assert cfg.gpu == load_option("gpu", "cpu")
        assert result.lines("gpu")[0].startswith("gpu         cpu (cpu), 1 process(es)")


def test_saved_config_is_what_was_asked(tmp_path):
    run_dir = tmp_path / "x"
    result = launch(tmp_path, "model=llama3_70b", "precision=bf16", "trainer.max_steps=7", f"run.dir={run_dir}",
                    "dryrun=true")
    assert result.returncode == 0, str(result)
    assert result.config_files() == [run_dir / "config.yaml"]
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text  # interpolations resolved: the engine needs no Hydra
    gpu = load_option("gpu", "cpu") if not torch.cuda.is_available() else load_config(run_dir / "config.yaml").gpu
    expected = Config(
        model=load_option("model", "llama3_70b"),
        precision=load_option("precision", "bf16"),
        gpu=gpu,
        executor=ExecutorConfig(name="local", gpus=1, nodes=1, nemo_run_home=str(result.runs / "nemo-run")),
        data=DataConfig(name="text", kind=DataKind.indexed, path=None, cache_dir=str(result.cache)),
        trainer=TrainerConfig(max_steps=7),
        run=RunConfig(root=str(result.runs), name="llama3_70b-bf16", dir=str(run_dir)),
        engine="torch",
        dryrun=False,  # saved as the engine will run it
    )
    assert load_config(run_dir / "config.yaml") == expected
    assert result.lines("model") == [
        "model       llama3_70b: 70,553,706,496 parameters, 80 layers, hidden 8192, seq 8192"
    ]
    assert result.lines("command") == [engine_command(run_dir / "config.yaml")]
    assert_nothing_launched(result)
    assert_confined(result, allowed=("x",))


def test_hydra_keeps_cwd_and_writes_no_hydra_folder(tmp_path):
    # A relative run.dir resolves against the launch directory: had Hydra changed into the run dir, the config
    # would land in rel/x/rel/x or the paths would be relative.
    result = launch(tmp_path, "run.dir=rel/x", "dryrun=true")
    assert result.returncode == 0, str(result)
    run_dir = tmp_path / "rel" / "x"
    assert result.config_files() == [run_dir / "config.yaml"]
    assert result.lines("run") == [f"run dir     {run_dir}"]
    assert result.lines("command") == [engine_command(run_dir / "config.yaml")]
    assert load_config(run_dir / "config.yaml").run.dir == str(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "overrides.yaml", "trainer.lock"]
    assert_confined(result, allowed=("rel",))


def test_hydra_run_dir_is_the_run_dir_and_the_command_is_kept_beside_the_config(tmp_path):
    result = launch(tmp_path, "hydra.run.dir=fp8_runs/h", "trainer.max_steps=3", "dryrun=true")
    assert result.returncode == 0, str(result)
    run_dir = result.runs / "h"
    assert result.config_files() == [run_dir / "config.yaml"]  # not an empty h and a run under runs/<time>-...
    assert load_config(run_dir / "config.yaml").run.dir == str(run_dir)
    # Hydra's overrides.yaml: the task's overrides as a list, and the whole command line above them
    text = (run_dir / "overrides.yaml").read_text()
    assert text.splitlines()[0] == "# python launch/run.py hydra.run.dir=fp8_runs/h trainer.max_steps=3 dryrun=true"
    assert yaml.safe_load(text) == ["trainer.max_steps=3", "dryrun=true"]
    assert_confined(result)


def test_shell_completion_passes_through(tmp_path):
    result = launch(tmp_path, "-sc", "install=bash")
    assert result.returncode == 0 and "complete -o nospace -o default -F hydra_bash_completion" in result.stdout, \
        str(result)
    env = {"COMP_LINE": "python launch/run.py trainer.max"}
    query = subprocess.run([sys.executable, str(RUN_PY), "-sc", "query=bash"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env={**os.environ, **env})
    assert query.returncode == 0 and query.stdout.split() == ["trainer.max_steps="], query.stdout + query.stderr


# ---- every model x precision ----


def test_every_model_plans_in_bf16_and_fp8_current_on_h100(tmp_path):
    result = launch(tmp_path, "-m", f"model={','.join(MODELS)}", "precision=bf16,fp8_current", "gpu=h100",
                    "dryrun=true")
    assert result.returncode == 0, str(result)
    assert TRACEBACK not in result.output
    configs = result.config_files()
    assert len(configs) == 2 * len(MODELS), str(result)
    planned = set()
    for path in configs:
        cfg = load_config(path)
        assert cfg.gpu == load_option("gpu", "h100")
        assert cfg.model == load_option("model", cfg.model.name)
        assert cfg.precision == load_option("precision", cfg.precision.name)
        assert cfg.run.dir == str(path.parent)
        planned.add((cfg.model.name, cfg.precision.name))
    assert planned == {(m, p) for m in MODELS for p in ("bf16", "fp8_current")}

    printed = {}
    for line in result.lines("model"):
        name, count = re.match(r"model +(\w+): ([\d,]+) parameters", line).groups()
        printed.setdefault(name, set()).add(int(count.replace(",", "")))
    assert set(printed) == set(MODELS)
    for name, count in LLAMA_PARAMETERS.items():
        assert printed[name] == {count}
    memory = result.lines("memory/GPU")
    assert len(memory) == 2 * len(MODELS) and all(" of 80 GB" in line for line in memory)
    # A billion-parameter model (weights, grads, Adam: 16 bytes a parameter) on one 80 GB GPU cannot fit for
    # training and the plan says so; the tiny and ~100M models fit.
    does_not_fit = [line for line in memory if "does not fit" in line]
    assert len(does_not_fit) == 2 * sum(min(printed[m]) > 10**9 for m in MODELS)
    assert_nothing_launched(result)
    assert_confined(result)


NATIVE = [("fp8_delayed", "h100"), ("fp8_blockwise", "h100"), ("mxfp8", "b200")]
NOT_NATIVE = {
    ("mxfp8", "h100"): ("Blackwell", "gpu=h100", "precision.emulate=true"),
    ("fp8_blockwise", "b200"): ("Hopper", "gpu=b200", "precision.emulate=true"),
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("precision, gpu", NATIVE + list(NOT_NATIVE))
def test_every_model_plans_each_recipe_where_it_runs_natively(hydra_compose, tmp_path, monkeypatch, model,
                                                              precision, gpu):
    from recipes.plan import make_plan

    monkeypatch.setenv("FP8_RECIPES_RUNS", str(tmp_path / "runs"))
    cfg = hydra_compose(f"model={model}", f"precision={precision}", f"gpu={gpu}", "dryrun=true")
    assert (cfg.model.name, cfg.precision.name, cfg.gpu.name) == (model, precision, gpu)
    if (precision, gpu) in NOT_NATIVE:
        with pytest.raises(ConfigError) as error:
            make_plan(cfg, tmp_path / "config.yaml")
        assert all(part in str(error.value) for part in NOT_NATIVE[precision, gpu]), str(error.value)
    else:
        plan = make_plan(cfg, tmp_path / "config.yaml")
        assert plan.cfg.precision.name == precision and plan.parameters > 0
    assert not list(tmp_path.iterdir())


# ---- errors, each in its own launch ----


def _gpu_count_case() -> tuple[str, ...]:
    # More processes than this machine has GPUs (0 on the CPU test machine), so it can never really launch.
    return "gpu=h100", f"executor.gpus={max(2, torch.cuda.device_count() + 1)}"


# name: (arguments, texts the output must contain)
ERROR_CASES = {
    # compose time
    "unknown_group_option": (("model=llama3_8bb",), ("model/llama3_8bb", *MODELS)),
    "typo_key": (("trainer.max_stpes=5",), ("Did you mean 'trainer.max_steps'",
                                            *(f.name for f in dataclasses.fields(TrainerConfig)))),
    "unknown_top_level_key": (("foo=1", "dryrun=true"), ("'foo'", *(f.name for f in dataclasses.fields(Config)))),
    "added_unknown_key": (("+trainer.max_stpes=5", "dryrun=true"), ("max_stpes",)),
    "wrong_type": (("trainer.max_steps=abc",), ("trainer.max_steps", "'abc'")),
    "invalid_enum": (("precision.recipe=foo", "dryrun=true"),
                     ("precision.recipe", "'foo'", "bf16", "delayed", "tensorwise", "blockwise", "mxfp8")),
    # plan time
    "global_batch": (("trainer.global_batch_size=6", "trainer.micro_batch_size=4", "dryrun=true"),
                     ("trainer.global_batch_size=6", "e.g. trainer.global_batch_size=")),
    "heads_groups": (("model.num_query_groups=3", "dryrun=true"),
                     ("model.num_attention_heads=4", "model.num_query_groups=3")),
    "bf16_layers": (("precision.num_layers_at_start_in_bf16=3", "precision.num_layers_at_end_in_bf16=3",
                     "dryrun=true"), ("precision.num_layers_at_end_in_bf16 = 6", "model.num_layers=4")),
    "local_nodes": (("executor.nodes=2", "dryrun=true"), ("executor=local", "executor.nodes=1")),
    "profile_step": (("trainer.max_steps=10", "trainer.profile_step=11", "dryrun=true"),
                     ("trainer.profile_step=11", "trainer.max_steps=10")),
    "unknown_engine": (("engine=jax", "dryrun=true"), ("engine=jax", "Invalid value 'jax'", "torch, megatron")),
    "unknown_executor": (("executor.name=ray", "dryrun=true"), ("executor.name", "'ray'", "local, slurm")),
    "unknown_tunnel": (("executor=slurm", "gpu=h100", "executor.slurm.tunnel=vpn", "dryrun=true"),
                       ("executor.slurm.tunnel", "'vpn'", "local, ssh")),
    # Slurm's and SSH's settings, checked by the plan like the rest (nothing saved or rendered first)
    "slurm_secret_name": (("executor=slurm", "gpu=cpu", "executor.slurm.secret_env=[NOT-A-NAME]", "dryrun=true"),
                          ("executor.slurm.secret_env", "NOT-A-NAME")),
    "ssh_without_host": (("executor=slurm", "gpu=cpu", "executor.slurm.tunnel=ssh", "dryrun=true"),
                         ("executor.slurm.ssh.host", "executor.slurm.ssh.job_dir", "executor.slurm.ssh.repo")),
    # wandb is no dependency: asking for it without it installed is refused before anything runs
    **({} if importlib.util.find_spec("wandb") else {"wandb_missing": (
        ("logger.wandb.project=fp8", "dryrun=true"),
        ("logger.wandb.project=fp8 needs wandb", "pip install wandb", "leave logger.wandb.project unset"))}),
    "two_run_dirs": (("hydra.run.dir=fp8_runs/y", "run.dir=fp8_runs/z", "dryrun=true"),
                     ("run.dir=fp8_runs/z and hydra.run.dir=fp8_runs/y name two folders; give one of them (run.dir)",)),
    "run_dir_with_multirun": (("-m", "run.dir=fp8_runs/w", "precision=bf16,fp8_current", "dryrun=true"),
                              ("run.dir with -m", "hydra.sweep.dir=DIR")),
    "hydra_run_dir_with_multirun": (("-m", "hydra.run.dir=fp8_runs/w", "precision=bf16,fp8_current", "dryrun=true"),
                                    ("hydra.run.dir with -m", "hydra.sweep.dir=DIR")),
    "sweep_dir_without_multirun": (("hydra.sweep.dir=fp8_runs/s", "dryrun=true"),
                                   ("hydra.sweep.dir is the folder of a -m sweep", "run.dir=DIR")),
    # hidden 200 keeps heads % groups and the even rotary dimension valid; only the FP8 check rejects it
    "fp8_dims": (("model.hidden_size=200", "dryrun=true"), ("divisible by 16", "hidden_size = 200")),
    "gpu_count": (_gpu_count_case(), (f"executor.gpus={max(2, torch.cuda.device_count() + 1)}",
                                      f"has {torch.cuda.device_count()} GPU(s)", "set executor.gpus to at most")
                  if torch.cuda.device_count() else ("gpu=h100 but this machine has no GPU", "choose gpu=cpu")),
    # precision x GPU
    "blockwise_cpu": (("precision=fp8_blockwise", "dryrun=true"),
                      ("precision=fp8_blockwise", "Hopper", "gpu=cpu", "precision.emulate=true")),
    "blockwise_dims": (("precision=fp8_blockwise", "precision.emulate=true", "model.kv_channels=32", "dryrun=true"),
                       ("divisible by 128", "num_query_groups * kv_channels = 64")),
    "block_dim_range": (("precision=fp8_blockwise", "gpu=h100", "precision.w_block_scaling_dim=3", "dryrun=true"),
                        ("precision.w_block_scaling_dim=3 is out of range", "1 (1 x 128 blocks) or 2")),
    "block_dims_two_2d": (("precision=fp8_blockwise", "gpu=h100", "precision.x_block_scaling_dim=2", "dryrun=true"),
                          ("fprop (input x weight) would multiply two 128x128-block operands",
                           "precision.emulate=true")),
    "block_dims_per_tensor": (("precision=fp8_current", "precision.w_block_scaling_dim=1", "dryrun=true"),
                              ("[1, 1, 1] are blockwise scaling's", "precision=fp8_current has no such blocks")),
    "rowwise_cpu": (("precision=fp8_rowwise", "gpu=cpu", "dryrun=true"),
                    ("precision=fp8_rowwise runs natively on Hopper and Blackwell", "precision.emulate=true")),
    "rowwise_hybrid": (("precision=fp8_rowwise", "precision.fp8_format=hybrid", "gpu=h100", "dryrun=true"),
                       ("torchao's row-wise recipe casts every operand", "precision.fp8_format=e4m3")),
    "mxfp8_hopper": (("model=llama3_70b", "precision=mxfp8", "gpu=h100", "dryrun=true"),
                     ("precision=mxfp8", "Blackwell", "gpu=h100", "fp8_current", "precision.emulate=true")),
    # values out of range, refused at plan time naming the field (issue 19's "Bad input" table)
    "negative_lr": (("trainer.lr=-1",), ("trainer.lr=-1.0 is out of range", ">= 0", "trainer.lr=0.001")),
    "beta_out_of_range": (("trainer.adam_beta2=1.0",), ("trainer.adam_beta2=1.0", "in [0, 1)")),
    "zero_micro_batch": (("trainer.micro_batch_size=0",), ("trainer.micro_batch_size=0", "at least 1")),
    "zero_log_interval": (("trainer.log_interval=0",), ("trainer.log_interval=0", "at least 1")),
    "missing_data": (("data.path=/nonexistent/prefix",), ("data.path = '/nonexistent/prefix'",
                                                         "/nonexistent/prefix.bin", "bundled corpus")),
    "run_dir_is_a_file": (("run.dir=/proc/version",), ("run.dir=/proc/version", "is a file, not a folder")),
    "run_dir_read_only": (("run.dir=/sys/fp8-run",), ("run.dir=/sys/fp8-run: cannot write into /sys",
                                                      "writable filesystem")),
    "mxfp8_cpu": (("precision=mxfp8", "gpu=cpu"), ("precision=mxfp8", "fp8_current or fp8_delayed",
                                                   "precision.emulate=true")),
    # no dry run: the estimate (about 1.1 TB for weights, gradients and Adam alone) is over any CI machine's memory
    "memory_cpu": (("model=llama3_70b", "gpu=cpu"), ("model=llama3_70b on this CPU needs about",
                                                     "more than this machine's", "dryrun=true")),
    # Transformer Engine's Float8CurrentScaling has no margin: refused, not ignored
    "margin_current": (("precision=fp8_current", "precision.margin=1", "dryrun=true"),
                       ("precision.margin=1", "precision=fp8_current", "precision=fp8_delayed")),
    # issue 27: a run directory is the run's alone (DIRS: folders made before the launches)
    "run_dir_in_conf": ((f"run.dir={CONF}", "dryrun=true"), (f"run.dir={CONF} is inside this checkout's source "
                                                            "folder conf/", "run.dir=runs/NAME")),
    "run_dir_in_conf_new": ((f"run.dir={CONF}/new", "dryrun=true"), ("inside this checkout's source folder conf/",)),
    "run_dir_checkout": ((f"run.dir={REPO}", "dryrun=true"), (f"holds this checkout ({REPO})", "run.dir=runs/NAME")),
    "run_dir_empty": (("run.dir=", "dryrun=true"), ("run.dir is empty", "run.dir=PATH")),
    "run_root_empty": (("run.root=", "dryrun=true"), ("run.root is empty",)),
    "nemo_run_home_empty": (("executor.nemo_run_home=", "dryrun=true"), ("executor.nemo_run_home is empty",)),
    "checkpoint_dir_empty": (("trainer.checkpoint.dir=", "dryrun=true"), ("trainer.checkpoint.dir is empty",
                                                                          "leave it unset")),
    "sweep_dir_checkout": (("-m", f"hydra.sweep.dir={REPO}", "precision=bf16,fp8_current", "dryrun=true"),
                           (f"hydra.sweep.dir={REPO} holds this checkout", "no point was run")),
    "run_dir_dot": (("run.dir=.", "dryrun=true"), ("holds files that are not a run's (", "run.dir=runs/NAME")),
    "run_dir_foreign": (("run.dir=@FOREIGN@", "dryrun=true"), ("holds files that are not a run's (notes.txt)",)),
    "run_dir_holds_run": (("run.dir=@RAN@", "model=tiny_nemotron", "data=mock", "model.seq_length=64"),
                          ("holds a run (metrics.jsonl, summary.json, tensorboard) with no checkpoint",
                           "run.overwrite=true to move that run aside")),
    "run_dir_checkpoint_dir_is_a_file": (("trainer.checkpoint.interval=1", "trainer.checkpoint.dir=/proc/version"),
                                         ("trainer.checkpoint.dir=/proc/version", "is a file, not a folder")),
    "checkpoint_dir_read_only": (("trainer.checkpoint.interval=1", "trainer.checkpoint.dir=/sys/fp8-ckpt"),
                                 ("trainer.checkpoint.dir=/sys/fp8-ckpt: cannot write into /sys",)),
    "run_root_read_only": (("run.root=/sys/fp8-runs",), ("run.root=/sys/fp8-runs: cannot write into /sys",)),
    "nemo_run_home_read_only": (("executor.nemo_run_home=/sys/fp8-nemo",),
                                ("executor.nemo_run_home=/sys/fp8-nemo: cannot write into /sys",)),
    "cache_read_only": (("data.cache_dir=/sys/fp8-cache",), ("data.cache_dir (FP8_RECIPES_CACHE)=/sys/fp8-cache",
                                                             "cannot write into /sys")),
    # values the plan refused only after launch, or never
    "lr_inf": (("trainer.lr=inf",), ("trainer.lr=inf is out of range",)),
    "seed_negative": (("trainer.seed=-1",), ("trainer.seed=-1 is out of range", "in [0, 2**32)")),
    "emulate_native": (("precision.emulate=true", "dryrun=true"),
                       ("precision.emulate=true, but precision=fp8_current runs natively",
                        "leave precision.emulate unset")),
    "emulate_bf16": (("precision=bf16", "precision.emulate=true", "dryrun=true"), ("precision=bf16 runs natively",)),
    "dataset_too_short": (("data.path=@SHORT@", "model.seq_length=512"),
                          ("has 300 tokens, fewer than one sample of seq_length + 1 = 513", "model.seq_length")),
    # what reached a shell, Hydra or OmegaConf
    "run_name_metacharacter": (("run.name='a;b $(x)'", "dryrun=true"),
                               ("run.name='a;b $(x)'", "only ASCII letters, digits", "e.g. run.name=a_b_x")),
    "run_name_non_ascii": (("run.name='héllo'", "dryrun=true"), ("run.name='héllo'", "e.g. run.name=h_llo")),
    "run_name_unbalanced_quote": (("run.name=it's", "dryrun=true"), ("cannot read the command line",
                                                                      "run.name=it's", "quote a value")),
    "deleted_group": (("~model", "dryrun=true"), ("~model deletes the model group", "model=OPTION")),
    "unresolved_interpolation": (("run.name=${nowhere}", "dryrun=true"), ("cannot resolve the config",
                                                                          "'nowhere' not found")),
    "unresolved_env": (("trainer.lr=${oc.env:FP8_NO_SUCH_VARIABLE}", "dryrun=true"),
                       ("cannot resolve the config", "FP8_NO_SUCH_VARIABLE")),
    # every point of a sweep is planned before the first runs: bf16 never trains
    "sweep_point": (("-m", "precision=bf16,mxfp8,fp8_current", "data=mock", "model.seq_length=64"),
                    ("-m point 1 (precision=mxfp8 data=mock model.seq_length=64)", "Blackwell", "no point was run")),
}


def prepare_folders(root: Path) -> dict[str, str]:
    """What some ERROR_CASES point at (@NAME@ in their arguments): a folder of something else, one holding a run
    without checkpoints, an indexed dataset of 300 tokens."""
    from recipes.data.megatron_indexed import IndexedDatasetBuilder

    foreign, ran = root / "foreign", root / "ran"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    (ran / "tensorboard").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (ran / name).write_text(f"the earlier run's {name}\n")
    builder = IndexedDatasetBuilder(str(root / "short.bin"), dtype=np.int32)
    builder.add_document(np.arange(300, dtype=np.int32) % 250, lengths=[300])
    builder.finalize(str(root / "short.idx"))
    return {"@FOREIGN@": str(foreign), "@RAN@": str(ran), "@SHORT@": str(root / "short")}


def folder_state(root: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() if path.is_file() else b"/" for path in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("prepared")
    return root, prepare_folders(root)


@pytest.fixture(scope="module")
def error_launches(tmp_path_factory, prepared) -> dict[str, Launch]:
    root, names = prepared
    before = folder_state(root), folder_state(CONF)
    results = launches_forked({name: (tmp_path_factory.mktemp(name), tuple(
        functools.reduce(lambda arg, item: arg.replace(*item), names.items(), arg) for arg in args))
        for name, (args, _) in ERROR_CASES.items()})
    assert (folder_state(root), folder_state(CONF)) == before, "a refused launch changed a folder it was pointed at"
    return results


@pytest.mark.parametrize("case", ERROR_CASES)
def test_error_is_clear_and_launches_nothing(error_launches, case):
    result = error_launches[case]
    assert_clean_failure(result, *ERROR_CASES[case][1])
    assert result.output.strip().count("\n") == 0, f"more than one line:\n{result}"


def test_run_overwrite_moves_the_old_run_aside_and_the_plan_quotes_its_command(tmp_path, prepared):
    run_dir = tmp_path / "old run"  # a space: the printed command must be quoted for a shell
    shutil.copytree(prepared[0] / "ran", run_dir)
    before = folder_state(run_dir)
    dry = launch(tmp_path / "dry", f"run.dir={run_dir}", "run.overwrite=true", "dryrun=true")
    assert dry.returncode == 1 and "dryrun=true: run.dir=" in dry.stderr and "holds a run" in dry.stderr, str(dry)
    assert folder_state(run_dir) == before  # a dry run moves nothing aside
    result = launch(tmp_path / "launch", f"run.dir={run_dir}", "run.overwrite=true", "model=tiny_llama",
                    "precision=bf16", "data=mock", "model.seq_length=32", "trainer.max_steps=1")
    assert result.returncode == 0, str(result)
    [aside] = tmp_path.glob("old run.replaced-*")
    assert f"run.overwrite=true: the run that was in {run_dir} is now in {aside}" in result.stdout
    assert folder_state(aside) == {path.replace(str(run_dir), str(aside)): data for path, data in before.items()}
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    (command,) = result.lines("command")
    assert shlex.split(command.split(None, 1)[1]) == [sys.executable, "-m", "recipes.engine.torch_engine",
                                                      str(run_dir / "config.yaml")]


@pytest.mark.parametrize("content, message", [
    (None, "(No such file or directory)"),
    (b"\xff\xfe garbage", "(not YAML: "),
    (b"[1, 2", "(not YAML: "),
    (b"- a list", "holds no mapping"),
    (b"{}", "lacks the required key(s) ['model', 'precision', 'gpu', 'executor', 'data']"),
])
def test_the_engine_refuses_a_missing_or_garbage_config_in_one_line(tmp_path, capsys, content, message):
    from recipes.engine import torch_engine

    config = tmp_path / "config.yaml"
    if content is not None:
        config.write_bytes(content)
    assert torch_engine.main([str(config)]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["config.yaml"])


def test_mxfp8_on_a_cpu_suggests_only_what_runs_there(error_launches, hydra_compose, tmp_path):
    assert "fp8_blockwise" not in error_launches["mxfp8_cpu"].output  # refused on a CPU as well
    for suggested in ("fp8_current", "fp8_delayed"):
        make_plan(hydra_compose(f"precision={suggested}", "gpu=cpu"), tmp_path / "config.yaml")


def test_every_value_range_refuses_its_bad_value(hydra_compose):
    """Each numeric setting of VALUE_RANGES refused just outside its range, in one line naming it; min_lr > lr."""
    outside = {"at least 1": 0, ">= 0": -1, "> 0": 0, "in [0, 1)": 1, "in (0, 1]": 0, "in [0, 2**32)": 2**32,
               "1 (1 x 128 blocks) or 2 (128 x 128 blocks)": 3}
    cfg = hydra_compose()
    for name, (_, rule) in VALUE_RANGES.items():
        group, field = name.rsplit(".", 1)
        bad = dataclasses.replace(functools.reduce(getattr, group.split("."), cfg), **{field: outside[rule]})
        with pytest.raises(ConfigError) as error:
            check_values(_with(cfg, group, bad))
        assert str(error.value).startswith(f"{name}={outside[rule]} is out of range: it must be {rule}")
    with pytest.raises(ConfigError, match="trainer.min_lr=0.01 is above trainer.lr=0.001"):
        check_values(hydra_compose("trainer.min_lr=0.01", "trainer.lr=0.001"))
    for value in ("inf", "-inf", "nan"):  # inf passes ">= 0", NaN no test: both refused as out of range
        with pytest.raises(ConfigError, match=f"trainer.weight_decay={value} is out of range"):
            check_values(hydra_compose(f"trainer.weight_decay={value}"))
    check_values(cfg)  # the defaults pass


def _with(cfg, dotted: str, value):
    head, *rest = dotted.split(".")
    return dataclasses.replace(cfg, **{head: _with(getattr(cfg, head), ".".join(rest), value) if rest else value})


def test_a_damaged_dataset_is_refused_before_launch(tmp_path):
    from recipes.data.megatron_indexed import IndexedDatasetBuilder

    prefix = tmp_path / "tokens"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for length in (300, 200):
        builder.add_document(np.arange(length, dtype=np.int32) % 250, lengths=[length])
    builder.finalize(f"{prefix}.idx")
    idx = bytearray(Path(f"{prefix}.idx").read_bytes())
    idx[34:42] = np.array([-50, -50], dtype=np.int32).tobytes()  # the two sequence lengths, after the header
    Path(f"{prefix}.idx").write_bytes(bytes(idx))
    result = launch(tmp_path / "launch", f"data.path={prefix}")
    assert_clean_failure(result, f"{prefix}.idx has 2 negative sequence length(s)", "rebuild the dataset")
    assert result.stderr.count("\n") == 1, result.stderr


# The dry-run examples of the README and docs/*.md are planned as written in tests/test_docs.py.


def test_global_batch_suggestion_is_valid(error_launches):
    result = error_launches["global_batch"]
    suggested = int(re.search(r"e\.g\. trainer\.global_batch_size=(\d+)", result.output).group(1))
    assert suggested > 0 and suggested % 4 == 0  # a multiple of micro batch 4 x 1 process


# ---- --cfg job, --help, multirun ----


def test_cfg_job_prints_composed_yaml_and_launches_nothing(tmp_path):
    result = launch(tmp_path, "--cfg", "job", "trainer.max_steps=3")
    assert result.returncode == 0, str(result)
    assert "name: tiny_llama" in result.stdout
    composed = yaml.safe_load(result.stdout)
    assert composed["model"]["name"] == "tiny_llama" and composed["precision"]["name"] == "fp8_current"
    assert composed["trainer"]["max_steps"] == 3
    assert set(composed) == {f.name for f in dataclasses.fields(Config)}
    assert "command" not in result.stdout and not result.config_files()
    assert not result.runs.exists()
    assert_confined(result)


def test_help_lists_groups_and_options(tmp_path):
    result = launch(tmp_path, "--help")
    assert result.returncode == 0, str(result)
    section = result.stdout.split("== Configuration groups ==", 1)[1].split("==", 1)[0]
    listed = {}
    for line in section.splitlines():
        match = re.fullmatch(r"(\w+): (.+)", line.strip())
        if match:
            listed[match.group(1)] = sorted(match.group(2).split(", "))
    assert set(GROUPS) <= set(listed)
    for group, names in listed.items():
        assert names == options(group), group
    assert not result.runs.exists()
    assert_confined(result)


def test_multirun_honours_hydra_sweep_dir(tmp_path):
    result = launch(tmp_path, "-m", "hydra.sweep.dir=fp8_runs/s", "precision=bf16,fp8_current", "dryrun=true")
    assert result.returncode == 0, str(result)
    configs = result.config_files()
    assert sorted(path.parent.name for path in configs) == ["0-tiny_llama-bf16", "1-tiny_llama-fp8_current"]
    assert {path.parent.parent for path in configs} == {result.runs / "s"}
    assert yaml.safe_load((configs[0].parent / "overrides.yaml").read_text()) == ["precision=bf16", "dryrun=True"]  # as Hydra's sweeper writes them
    assert_confined(result)


def test_multirun_makes_one_run_dir_per_job_in_one_sweep(tmp_path):
    result = launch(tmp_path, "-m", "precision=bf16,fp8_current", "dryrun=true")
    assert result.returncode == 0, str(result)
    sweeps = [p for p in result.runs.iterdir()]
    assert len(sweeps) == 1 and sweeps[0].is_dir() and sweeps[0].name.endswith("-sweep"), sweeps
    configs = result.config_files()
    assert len(configs) == 2
    run_dirs = {path.parent for path in configs}
    assert len(run_dirs) == 2 and all(d.parent == sweeps[0] for d in run_dirs)
    precisions = {}
    for path in configs:
        cfg = load_config(path)
        assert cfg.precision == load_option("precision", cfg.precision.name)
        assert cfg.run.dir == str(path.parent)
        assert path.parent.name.endswith(f"-tiny_llama-{cfg.precision.name}")
        precisions[cfg.precision.name] = path
    assert set(precisions) == {"bf16", "fp8_current"}
    assert sorted(result.lines("command")) == sorted(engine_command(path) for path in configs)
    assert_nothing_launched(result)
    assert_confined(result)
