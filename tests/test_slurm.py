"""executor=slurm: the sbatch script launch/run.py renders, and real jobs on a real single-node Slurm.

The cluster tests need the Slurm that scripts/slurm/start.sh brings up (.ci/run starts it before pytest): the
`cluster` fixture (tests/conftest.py) skips them without it, or fails them under FP8_RECIPES_REQUIRE_SLURM=1.
Every job is a CPU run of tiny_llama with short sequences and few steps; every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from recipes.config import ConfigError, SlurmConfig
from recipes.plan.cluster import check_slurm_settings, require_secrets
from recipes.slurm import JOB_RECORD, JobRecord, job_state

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "launch" / "run.py"
STATUS_PY = REPO / "launch" / "status.py"
TINY_CPU = ("executor=slurm", "gpu=cpu", "executor.slurm.container_image=null", "model.seq_length=64",
            "data=mock", "trainer.log_interval=1")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
JOB_WAIT_S = 180


def run_py(tmp_path: Path, *overrides: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), FP8_RECIPES_RUNS=str(tmp_path / "runs"),
               FP8_RECIPES_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(RUN_PY), *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def hydra_quoted(value: str) -> str:
    """A Hydra override value in single quotes: escape the quotes, and the backslashes just before a quote or the
    end (Hydra reads every other backslash as itself)."""
    value = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value)
    value = re.sub(r"(\\+)$", lambda m: m[1] * 2, value)
    return f"'{value}'"


# ---- the rendered sbatch script (no cluster needed) ----


def dryrun_script(tmp_path: Path, *overrides: str) -> str:
    run_dir = tmp_path / "run"
    result = run_py(tmp_path, *overrides, f"run.dir={run_dir}", "dryrun=true")
    script = (run_dir / "sbatch.sh").read_text()
    assert script in result.stdout  # printed and saved, the same text
    assert not (tmp_path / "runs" / "nemo-run" / "experiments").exists() or not any(
        (tmp_path / "runs" / "nemo-run" / "experiments").iterdir()), "a dry run left a nemo-run experiment"
    return script


def test_dryrun_renders_the_sbatch_script_from_the_config(tmp_path):
    probe = tmp_path / "probe"
    evil = f"a b $(touch {probe}) `touch {probe}`; touch {probe} \"dq\" 's'\nline2 $HOME"
    script = dryrun_script(tmp_path, "executor=slurm", "gpu=h100", "executor.nodes=2", "trainer.global_batch_size=64",
                           "precision.fp8_param_gather=false", "executor.slurm.account=acct", "executor.slurm.partition=batch",
                           f"+executor.slurm.env_vars.FP8_PROBE={hydra_quoted(evil)}",
                           "+executor.slurm.sbatch_args.qos=high")
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --qos=high", "#SBATCH --time=01:00:00"):
        assert line in script.splitlines()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image nvcr.io/nvidia/nemo:25.04" in srun and "--mpi=none" in srun
    assert "--nnodes 2 --nproc-per-node 8" in srun
    assert "export NCCL_NVLS_ENABLE=0" in script and "NCCL_NET_GDR_LEVEL" not in script  # gb200's only
    assert f"-m recipes.engine.torch_engine {tmp_path}/run/config.yaml" in srun
    # The env var's export line, run by bash, sets the value byte for byte and executes nothing.
    export = script[script.index("export FP8_PROBE="):].split("\nexport ", 1)[0].split("\n\n")[0]
    shown = subprocess.run(["bash", "-c", f'{export}\nprintf %s "$FP8_PROBE"'], capture_output=True, text=True)
    assert shown.stdout == evil and not probe.exists()


def test_multi_node_script_runs_one_torchrun_per_node_with_a_rendezvous_on_the_first(tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("FP8_TEST_SECRET", secret)
    script = dryrun_script(tmp_path, "executor=slurm", "gpu=gb200", "executor.nodes=2", "trainer.global_batch_size=64",
                           "precision.fp8_param_gather=false",
                           "executor.slurm.secret_env=[FP8_TEST_SECRET,HF_TOKEN]", "executor.slurm.cpu_bind=cores")
    lines = script.splitlines()
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --export=ALL"} <= set(lines)
    assert "#SBATCH --gpus-per-node=4" in lines  # from conf/gpu/gb200.yaml
    assert 'head_node=${nodes_array[0]}' in lines  # the first host of the allocation ...
    assert 'head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)' in lines
    (srun,) = [line for line in lines if line.startswith("srun ") and "torchrun" in line]
    torchrun = srun[srun.index("torchrun"):]
    assert torchrun.startswith("torchrun --rdzv-backend c10d --rdzv-endpoint $head_node_ip:29500 ")  # ... hosts it
    assert "--nnodes 2 --nproc-per-node 4 --node-rank $SLURM_NODEID" in torchrun  # 4: gb200's GPUs per node
    assert "--cpu-bind=cores" in srun and "--container-env FP8_TEST_SECRET,HF_TOKEN" in srun
    assert {"export NCCL_NET_GDR_LEVEL=PHB", "export NCCL_NET_GDR_C2C=1", "export NCCL_NVLS_ENABLE=0"} <= set(lines)
    assert "printenv FP8_TEST_SECRET >/dev/null ||" in script and secret not in script


def test_slurm_refuses_what_it_cannot_run(tmp_path):
    auto = run_py(tmp_path, "executor=slurm", "dryrun=true", check=False)
    assert auto.returncode != 0 and "name the cluster's GPU (gpu=h100" in auto.stderr
    clash = run_py(tmp_path, *TINY_CPU, f"run.dir={tmp_path}/nemo_run/x", "dryrun=true", check=False)
    assert clash.returncode != 0 and "rename that folder" in clash.stderr
    assert "Traceback" not in auto.stderr + clash.stderr
    for bad, message in [({"secret_env": ["NOT-A-NAME"]}, "executor.slurm.secret_env: ['NOT-A-NAME']"),
                         ({"secret_env": ["A"], "env_vars": {"A": "1"}}, "not also in executor.slurm.env_vars"),
                         ({"dependency": "afterwards"}, "valid values: null, after, afterany")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_slurm_settings(SlurmConfig(**bad), tmp_path, str(tmp_path / "run"))


# ---- real jobs ----


def submit(tmp_path: Path, *overrides: str, run_dir: Path | None = None, env: dict | None = None) -> JobRecord:
    run_dir = run_dir or tmp_path / "run"
    result = run_py(tmp_path, *TINY_CPU, *overrides, f"run.dir={hydra_quoted(str(run_dir))}", env=env)
    record = JobRecord.load(run_dir / JOB_RECORD)
    assert f"submitted   Slurm job {record.job_id}, experiment {record.experiment_id}" in result.stdout
    return record


def wait_for(job_id: str, states: set[str], timeout_s: float = JOB_WAIT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = job_state(job_id)
        if state in states:
            return state
        assert state not in FINISHED, f"job {job_id} ended {state} while waiting for {states}"
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} not {states} after {timeout_s}s (state {state}); cancelled it")


def wait_for_accounting(job_id: str, state: str, timeout_s: float = 60) -> None:
    """Until Slurm's accounting holds the job's end as `state`: nemo-run's `nemo experiment status` reads the state
    from there (`sacct --parsable2 -j ID`), and slurmctld hands a job's end to slurmdbd asynchronously, after its
    own view (scontrol, what wait_for reads) says the job ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                               text=True).stdout.split()
        if shown and shown[0] == state:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: accounting says {shown} {timeout_s}s after the job ended, not {state}")


def status(target: str | Path, tmp_path: Path) -> list[list[str]]:
    env = dict(os.environ, FP8_RECIPES_RUNS=str(tmp_path / "runs"))
    result = subprocess.run([sys.executable, str(STATUS_PY), str(target)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split(None, 4) for line in result.stdout.splitlines()[2:]]


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_process_job_trains_and_reports_back(cluster, tmp_path):
    record = submit(tmp_path, "executor.gpus=2", "trainer.max_steps=4", "executor.slurm.cpu_bind=none",
                    "precision.fp8_param_gather=false")
    assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    [(job, state, restarts, last_step, rest)] = status(tmp_path / "run", tmp_path)
    assert (job, state, restarts, last_step) == (record.job_id, "COMPLETED", "0", "4")
    options = re.findall(r"--[a-z-]+[= ][^ ]+", (tmp_path / "run" / "sbatch.sh").read_text())
    assert {"--nproc-per-node 2", "--cpu-bind=none"} <= set(options)
    assert "[default0]:step     4/4" in (tmp_path / "run" / "train.log").read_text()  # torchrun's log came back
    assert steps(tmp_path / "run") == [1, 2, 3, 4]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def step_names(job_id: str, timeout_s: float = 60) -> list[str]:
    """The names of the job's srun steps, from accounting (which records a step asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName"], capture_output=True,
                               text=True).stdout.splitlines()
        names = [line.split("|", 1)[1] for line in shown if re.match(rf"{job_id}\.[0-9]+\|", line)]
        if len(names) >= 2 or time.monotonic() > deadline:  # the head node's `hostname` and the training step
            return names
        time.sleep(0.5)


def test_injection_in_a_value_reaches_the_job_intact_and_never_runs(cluster, tmp_path):
    probe = tmp_path / f"pwned-{uuid.uuid4().hex}"
    evil = f"a b $(touch {probe}) `touch {probe}`; touch {probe} \"dq\" 's' \\ é # c"
    evil_dir = tmp_path / f"{evil} \nline2 $HOME"
    # Two processes: the config path reaches the job through nemo-run's torchrun launcher, which quotes it itself;
    # the step's name through srun's own argument; the comment through an #SBATCH line, as sbatch reads it.
    record = submit(tmp_path, "executor.gpus=2", "precision.fp8_param_gather=false", "trainer.max_steps=2",
                    f"executor.slurm.srun_args=[{hydra_quoted(f'--job-name={evil}')}]",
                    f"+executor.slurm.sbatch_args.comment={hydra_quoted(evil)}", run_dir=evil_dir)
    comment = subprocess.run(["squeue", "-h", "-t", "all", "-j", record.job_id, "-o", "%k"], capture_output=True,
                             text=True, check=True).stdout
    assert comment == f"{evil}\n"
    assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    assert evil in step_names(record.job_id)
    assert not probe.exists()
    ran = yaml.safe_load((evil_dir / "config.yaml").read_text())
    assert ran["run"]["dir"] == str(evil_dir)  # the job read the config at exactly this path
    assert steps(evil_dir) == [1, 2]  # and wrote its metrics there
    assert json.loads((evil_dir / "summary.json").read_text())["world_size"] == 2
    [(job, state, *_)] = status(evil_dir, tmp_path)
    assert (job, state) == (record.job_id, "COMPLETED")


def test_sweep_submits_one_job_per_point_as_one_experiment(cluster, tmp_path, nemo_cli):
    result = run_py(tmp_path, "-m", "precision=bf16,fp8_current", *TINY_CPU, "trainer.max_steps=3")
    (sweep,) = (tmp_path / "runs").glob("*-sweep")
    records = [JobRecord.load(path) for path in sorted(sweep.glob(f"*/{JOB_RECORD}"))]
    assert [Path(r.run_dir).name for r in records] == ["0-tiny_llama-bf16", "1-tiny_llama-fp8_current"]
    assert {r.experiment for r in records} == {sweep.name} and len({r.job_id for r in records}) == 2
    assert result.stdout.count("submitted   Slurm job") == 2
    for record in records:
        assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    by_name = status(sweep.name, tmp_path)  # the experiment by name, as nemo-run groups it
    assert [(row[0], row[1], row[3]) for row in by_name] == [(r.job_id, "COMPLETED", "3") for r in records]
    # nemo-run's own CLI, as the launch printed it (NEMORUN_HOME set to executor.nemo_run_home)
    commands = nemo_cli.printed(result.stdout)
    assert [c.split()[-1] for c in commands["status"]] == [r.experiment_id for r in records]
    wait_for_accounting(records[0].job_id, "COMPLETED")
    assert "Status: SUCCEEDED" in nemo_cli.run(commands["status"][0])
    assert "step     3/3" in nemo_cli.run(commands["logs"][0])  # the job's srun log
    listed = nemo_cli.run(commands["list"][-1])
    assert all(r.experiment_id in listed for r in records)
    report = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), str(sweep), "--out",
                             str(tmp_path / "report")], capture_output=True, text=True)
    assert report.returncode in (0, 1), report.stderr  # 1: a 3-step FP8 loss may differ from BF16 beyond tolerance
    assert "fp8_current" in (tmp_path / "report" / "report.md").read_text()


def test_cancelled_job_is_reported_cancelled(cluster, tmp_path):
    record = submit(tmp_path, "trainer.max_steps=100000")
    wait_for(record.job_id, {"RUNNING"})
    subprocess.run(["scancel", record.job_id], check=True)
    wait_for(record.job_id, {"CANCELLED"}, timeout_s=60)
    [(job, state, *_)] = status(tmp_path / "run", tmp_path)
    assert (job, state) == (record.job_id, "CANCELLED")


def wait_for_steps(run_dir: Path, count: int, timeout_s: float = JOB_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and len(steps(run_dir)) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} steps in {run_dir / 'metrics.jsonl'} after {timeout_s}s")


def first_start_log(record: JobRecord) -> str:
    return (Path(record.log_dir) / f"log-{record.job_name}_{record.job_id}_0.out").read_text()


def stopped_at(log: str, max_steps: int) -> tuple[int, str]:
    """(step, checkpoint) of the engine's stop line in a job's log (recipes.trainer.stopping)."""
    stopped = re.search(rf"stopped by SIGTERM after step (\d+)/{max_steps}; its checkpoint is (\S+);", log)
    assert stopped, log[-3000:]
    return int(stopped[1]), stopped[2]


def test_requeued_job_checkpoints_on_sigterm_and_resumes_with_every_step_once(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # No checkpoint falls due before the last step: the one the requeued job resumes from is the SIGTERM's.
    record = submit(tmp_path, "trainer.max_steps=10", "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 3)
    subprocess.run(["scontrol", "requeue", record.job_id], check=True)  # SIGTERM, KillWait, SIGKILL, pending
    wait_for(record.job_id, {"PENDING"}, timeout_s=60)
    step, checkpoint = stopped_at(first_start_log(record), 10)
    assert step >= 3 and Path(checkpoint) == run_dir / "checkpoints" / f"step_{step:08d}"
    # Slurm holds a requeued job back for a couple of minutes (its BeginTime); let it start now.
    subprocess.run(["scontrol", "update", f"JobId={record.job_id}", "StartTime=now"], check=True)
    assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    [(job, state, restarts, last_step, _)] = status(run_dir, tmp_path)
    assert (job, state, restarts, last_step) == (record.job_id, "COMPLETED", "1", "10")
    assert steps(run_dir) == list(range(1, 11))  # gap-free: nothing lost, nothing done twice
    logs = sorted(p.name for p in Path(record.log_dir).glob(f"log-*_{record.job_id}_*.out"))
    assert logs == [f"log-{record.job_name}_{record.job_id}_{n}.out" for n in (0, 1)]
    assert f"resuming from step {step} of {checkpoint}" in (run_dir / "train.log").read_text()  # the newest start


def test_sigterm_to_a_job_saves_its_step_and_the_same_command_continues(cluster, tmp_path):
    run_dir = tmp_path / "run"
    record = submit(tmp_path, "trainer.max_steps=10000", "trainer.checkpoint.interval=1000")
    wait_for_steps(run_dir, 2)
    subprocess.run(["scancel", "--signal=TERM", record.job_id], check=True)  # what a preemption notice sends
    assert wait_for(record.job_id, FINISHED) == "FAILED"  # the engine exits 143: the run did not complete
    step, checkpoint = stopped_at(first_start_log(record), 10000)
    assert steps(run_dir) == list(range(1, step + 1))
    again = submit(tmp_path, f"trainer.max_steps={step + 2}", "trainer.checkpoint.interval=1000")
    assert wait_for(again.job_id, FINISHED) == "COMPLETED"
    status(run_dir, tmp_path)  # gathers the log
    assert f"resuming from step {step} of {checkpoint}" in (run_dir / "train.log").read_text()
    assert steps(run_dir) == list(range(1, step + 3))


def job_fields(job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)


def test_chained_sweep_runs_each_point_after_the_previous_one(cluster, tmp_path):
    # Point 0 trains longer: unchained, point 1 (which fits beside it on the node) would finish first.
    result = run_py(tmp_path, "-m", "trainer.max_steps=12,2", *TINY_CPU, "executor.slurm.dependency=afterany")
    (sweep,) = (tmp_path / "runs").glob("*-sweep")
    first, second = [JobRecord.load(path) for path in sorted(sweep.glob(f"*/{JOB_RECORD}"))]
    waiting = job_fields(second.job_id)  # asked at once: the first job is still starting up or training
    assert waiting["Dependency"] == f"afterany:{first.job_id}(unfulfilled)" and waiting["Reason"] == "Dependency"
    assert f"after       job {first.job_id} (afterany)" in result.stdout
    assert f"#SBATCH --dependency=afterany:{first.job_id}" in (Path(second.run_dir) / "sbatch.sh").read_text()
    assert "--dependency" not in (Path(first.run_dir) / "sbatch.sh").read_text()
    for record in (first, second):
        assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    assert job_fields(second.job_id)["StartTime"] >= job_fields(first.job_id)["EndTime"]  # ISO times sort


def files_holding(root: Path, text: str) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and text.encode() in path.read_bytes()]


def running_engine_environment(config_path: Path) -> dict[str, str]:
    """The environment of the job's training process on this machine (found by its config file argument)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if str(config_path).encode() in argv and b"recipes.engine.torch_engine" in argv:
                pairs = (proc / "environ").read_bytes().decode().split("\0")
                return dict(pair.split("=", 1) for pair in pairs if "=" in pair)
        except OSError:  # a process that ended while we looked
            continue
    raise AssertionError(f"no training process for {config_path} is running here")


def test_secret_reaches_the_job_by_name_and_is_written_nowhere(cluster, tmp_path):
    secret = f"s3cret-{uuid.uuid4().hex}"
    record = submit(tmp_path, "trainer.max_steps=100000", "executor.slurm.secret_env=[FP8_TEST_SECRET]",
                    env={"FP8_TEST_SECRET": secret})
    wait_for_steps(tmp_path / "run", 1)
    assert running_engine_environment(tmp_path / "run" / "config.yaml").get("FP8_TEST_SECRET") == secret
    subprocess.run(["scancel", record.job_id], check=True)
    wait_for(record.job_id, {"CANCELLED"}, timeout_s=60)
    sbatch_log = next(Path(record.log_dir).glob("sbatch_*.out")).read_text()
    assert "+ printenv FP8_TEST_SECRET" in sbatch_log  # the job checked it (set -x shows the name only)
    # Nothing we or nemo-run wrote holds the value: script, configs, nemo-run's records, logs, metrics.
    assert files_holding(tmp_path, secret) == []


def test_an_unset_secret_stops_the_submission(monkeypatch):
    monkeypatch.delenv("FP8_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=re.escape("['FP8_TEST_UNSET'] not set here; export them")):
        require_secrets(["FP8_TEST_UNSET"])


# ---- engine=nemo ----


def test_nemo_engine_script_runs_the_entry_point_in_the_nemo_container(tmp_path):
    script = dryrun_script(tmp_path, "engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_70b",
                           "precision=fp8_current", "layout=published", "executor.slurm.account=acct")
    lines = script.splitlines()
    assert {"#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"} <= set(lines)
    assert f"export PYTHONPATH={REPO}" in lines
    (srun,) = [line for line in lines if line.startswith("srun ") and "torchrun" in line]
    assert "--container-image nvcr.io/nvidia/nemo:25.04" in srun  # NeMo's container: its NeMo builds the recipe
    mounts = srun.split("--container-mounts ", 1)[1].split()[0].split(",")
    # this repo, run.root, and the run directory, which is outside run.root here: the container sees the config
    run_dir = tmp_path / "run"
    assert {f"{REPO}:{REPO}", f"{tmp_path / 'runs'}:{tmp_path / 'runs'}", f"{run_dir}:{run_dir}"} <= set(mounts)
    assert srun.endswith("--nnodes 8 --nproc-per-node 8 --node-rank $SLURM_NODEID --tee 3 "
                         f"-m recipes.nemo.engine {tmp_path}/run/config.yaml")


def test_nemo_job_reaches_the_queue_with_a_stand_in_entry_point(cluster, hydra_compose, tmp_path, monkeypatch):
    """engine=nemo's submission on the real test Slurm. The nodes here run neither NeMo nor GPUs, so the plan is
    made for an H100 and submitted as a CPU job (no --gpus-per-node), and tests/workers/nemo_stand_in.py takes the
    entry point's place: it reads the config the job was given and prints NeMo's iteration lines."""
    from recipes.config import Engine, load_option
    from recipes.folders import save_config
    from recipes.plan import ENGINE_MODULE, make_plan
    from recipes.report.parse import read_log
    from recipes.slurm import submit as submit_plan

    monkeypatch.setenv("FP8_RECIPES_RUNS", str(tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "nemo-job"
    cfg = hydra_compose("engine=nemo", "executor=slurm", "gpu=h100", "model=llama3_8b", "executor.gpus=1",
                        "executor.slurm.container_image=null", "data=mock", "trainer.max_steps=3", f"run.dir={run_dir}")
    plan = make_plan(cfg, run_dir / "config.yaml")
    plan = dataclasses.replace(plan, cfg=dataclasses.replace(cfg, gpu=load_option("gpu", "cpu")))
    run_dir.mkdir(parents=True)
    save_config(plan.cfg, run_dir / "config.yaml")
    monkeypatch.setitem(ENGINE_MODULE, Engine.nemo, "tests.workers.nemo_stand_in")
    with open(os.devnull) as no_input:  # nemo-run runs sbatch through invoke, which reads stdin (pytest closes it)
        monkeypatch.setattr(sys, "stdin", no_input)
        assert submit_plan(plan, run_dir / "config.yaml", "nemo-job", dryrun=False) == 0
    record = JobRecord.load(run_dir / JOB_RECORD)
    assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    [(job, state, *_)] = status(run_dir, tmp_path)
    assert (job, state) == (record.job_id, "COMPLETED")
    read = read_log(run_dir / "train.log", "train.log")  # the job's log, gathered by launch/status.py
    assert read.format == "nemo2" and [(s.step, s.loss) for s in read.steps] == [(1, 10), (2, 9), (3, 8)]
