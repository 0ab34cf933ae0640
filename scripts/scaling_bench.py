"""Several GPUs of one node with the torch engine (FSDP2): loss parity, the full Llama 3 8B, 1 -> N GPU scaling.

    python scripts/scaling_bench.py --out DIR --parts ac      # on a node with 2 GPUs: about 3 minutes
    python scripts/scaling_bench.py --out DIR2 --parts b      # about 5 minutes (4 compiled runs of the full 8B)
    python scripts/scaling_bench.py --out DIR --gpus 4        # everything, on 4 GPUs
    python scripts/scaling_bench.py --out DIR3 --parts b --accumulate 4   # b with 4 micro-batches per GPU per step

Parts (each run is the engine started as launch/run.py starts it, from a config composed of conf/ options):
  a  loss parity: tiny_llama on the bundled text, global batch 32, 50 steps, 1 GPU vs --gpus GPUs (same global
     batch: 8 micro-batches accumulated on one GPU, 8/N on each of N), bf16 and fp8_delayed (whose amax
     histories FSDP must keep identical on every GPU); eager (compile off): compilation does not change what is
     compared. Reports the largest relative loss difference over the 50 steps.
  c  weak scaling on the llama3_8b 4-layer proxy (seq 8192, micro-batch 1, 2 micro-batches per GPU per step,
     bf16, mock data): tokens/s/GPU on 1 GPU and on --gpus GPUs; efficiency = the ratio.
  b  the full llama3_8b (32 layers, seq 8192, micro-batch 1, one micro-batch per GPU per step: no FP32
     gradient accumulation buffer, which would not fit beside the activations on 2 GPUs) on --gpus GPUs, mock
     data, bf16 / fp8_current / fp8_delayed / fp8_blockwise: tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory.
     fp8_param_gather is off: the torch engine all-gathers BF16 weights. With --accumulate N, N micro-batches
     per GPU per step, each reduce-scattered (trainer.grad_reduce=per_micro_batch: sharded gradients only), so
     the optimizer step and the FP8 weight quantization are paid once per N micro-batches, as in NVIDIA's
     published runs (global batch 128).

Throughput is the median over the steps after the first WARMUP (compilation, allocator warm-up). Every run's
directory keeps its config.yaml, metrics.jsonl, summary.json (commit, versions, device) and train.log; the table is
printed and written to DIR/results.md, one row per run to DIR/results.csv, and the command, commit, date, versions
and device to DIR/provenance.json. Runs stop at the first failure. The text data of part a needs megatron-core
(docs/install.md, dependencies); otherwise only torch and PyYAML: no Hydra, no nemo-run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from recipes.config import Config, GradReduce, TrainerConfig, load_config, load_option
from recipes.folders import save_config
from recipes.plan import launch_command
from recipes.plan.checks import validate
from recipes.provenance import provenance
from recipes.run_files import CONFIG, METRICS, SUMMARY, TRAIN_LOG

WARMUP = 3
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Run:
    part: str
    model: str
    precision: str
    gpus: int
    trainer: dict
    model_overrides: tuple = ()  # (field, value) pairs
    data: str = "mock"
    accumulate: int = 1  # micro-batches per GPU per step (part b)

    @property
    def name(self) -> str:
        layers = dict(self.model_overrides).get("num_layers")
        model = f"{self.model}-{layers}L" if layers else self.model
        accumulation = f"-{self.accumulate}mb" if self.accumulate > 1 else ""
        return f"{self.part}-{model}-{self.precision}-{self.gpus}gpu{accumulation}"


def plan_runs(parts: str, gpus: int, steps_a: int, steps_bc: int, accumulate: int = 1) -> list[Run]:
    """Cheapest first: a (eager, tiny), c (the first compiled multi-GPU runs, 4 layers; they also fill the
    compile cache for b's identical blocks), b (the full model)."""
    runs = []
    if "a" in parts:
        parity = dict(max_steps=steps_a, micro_batch_size=4, global_batch_size=32, warmup_steps=10, compile=False)
        for precision in ("bf16", "fp8_delayed"):  # fp8_delayed: the recipe whose state FSDP must keep in step
            runs += [Run("a", "tiny_llama", precision, n, parity, data="text") for n in (1, gpus)]
    if "c" in parts:
        for n in (1, gpus):
            weak = dict(max_steps=steps_bc, micro_batch_size=1, global_batch_size=2 * n, lr=1e-4, log_interval=1)
            runs.append(Run("c", "llama3_8b", "bf16", n, weak, model_overrides=(("num_layers", 4),)))
    if "b" in parts:
        full = dict(max_steps=steps_bc, micro_batch_size=1, global_batch_size=gpus * accumulate, lr=1e-4, log_interval=1,
                    grad_reduce=GradReduce.per_micro_batch if accumulate > 1 else GradReduce.per_step)
        runs += [Run("b", "llama3_8b", p, gpus, full, accumulate=accumulate)
                 for p in ("bf16", "fp8_current", "fp8_delayed", "fp8_blockwise")]
    return runs


def make_config(run: Run, run_dir: Path, gpu: str) -> Path:
    data = load_option("data", run.data)
    cfg = Config(
        model=dataclasses.replace(load_option("model", run.model), **dict(run.model_overrides)),
        precision=dataclasses.replace(load_option("precision", run.precision), fp8_param_gather=False),
        gpu=load_option("gpu", gpu),
        executor=dataclasses.replace(load_option("executor", "local"), gpus=run.gpus),
        data=data,
        trainer=TrainerConfig(**run.trainer),
    )
    cfg.run.dir = str(run_dir)
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / CONFIG)
    return run_dir / CONFIG


def start(cfg_path: Path, devices: str) -> subprocess.Popen:
    """The engine command launch/run.py would run (torchrun for several GPUs), on the GPUs `devices`."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    command = launch_command(load_config(cfg_path), cfg_path)
    log = open(cfg_path.parent / TRAIN_LOG, "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait(process: subprocess.Popen, run: Run) -> bool:
    try:
        status = process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        status = "timeout"
    if status != 0:
        print(f"  {run.name}: failed ({status}); see its train.log", flush=True)
    return status == 0


def execute(runs: list[Run], out: Path, gpu: str, gpus: int) -> dict[str, Path]:
    """Run in order until one fails (the rest would likely fail the same way, and GPU time is scarce); the 1-GPU
    runs of part a go two at a time on different GPUs (they are short and eager)."""
    done = {}
    pending = list(runs)
    while pending:
        run = pending.pop(0)
        started = time.perf_counter()
        batch = [run]
        if run.part == "a" and run.gpus == 1 and gpus > 1:
            partner = next((r for r in pending if r.part == "a" and r.gpus == 1), None)
            if partner:
                pending.remove(partner)
                batch.append(partner)
        processes = []
        for index, member in enumerate(batch):
            run_dir = out / member.name
            devices = str(index) if member.gpus == 1 else ",".join(str(i) for i in range(member.gpus))
            processes.append((member, run_dir, start(make_config(member, run_dir, gpu), devices)))
        failed = False
        for member, run_dir, process in processes:
            if wait(process, member):
                done[member.name] = run_dir
            else:
                failed = True
        print(f"  {' + '.join(m.name for m in batch)}: {time.perf_counter() - started:.0f} s", flush=True)
        if failed:
            print(f"  stopped: {len(pending)} run(s) not started", flush=True)
            break
    return done


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def steady(run_dir: Path, field: str) -> float:
    return statistics.median(m[field] for m in metrics(run_dir)[WARMUP:])


def throughput_row(run: Run, run_dir: Path) -> dict:
    summary = json.loads((run_dir / SUMMARY).read_text())
    return {
        "part": run.part, "run": run.name, "GPUs": run.gpus, "global batch": run.trainer["global_batch_size"],
        "s/step": f"{steady(run_dir, 'step_time_s'):.3f}",
        "tokens/s/GPU": f"{steady(run_dir, 'tokens_per_s_per_gpu'):,.0f}",
        "TFLOP/s/GPU": f"{steady(run_dir, 'model_tflops_per_gpu'):.0f}",
        "MFU": f"{steady(run_dir, 'mfu'):.1%}" if summary["mfu"] is not None else "n/a",
        "peak GiB": f"{summary['peak_memory_gib']:.1f}",
    }


def report(runs: list[Run], done: dict[str, Path], gpus: int) -> list[str]:
    lines = []
    parity = [r for r in runs if r.part == "a" and r.gpus == gpus]
    if parity:
        lines += ["a) loss, 1 GPU vs {} GPUs, same global batch".format(gpus), "",
                  "| precision | steps | final loss 1 GPU | final loss N GPUs | max rel. loss diff |",
                  "|---|---|---|---|---|"]
        for run in parity:
            one = next(r for r in runs if r.part == "a" and r.precision == run.precision and r.gpus == 1)
            if run.name in done and one.name in done:
                a, b = metrics(done[one.name]), metrics(done[run.name])
                diff = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
                lines.append(f"| {run.precision} | {len(b)} | {a[-1]['loss']:.4f} | {b[-1]['loss']:.4f} | {diff:.2e} |")
        lines.append("")
    rows = [throughput_row(r, done[r.name]) for r in runs if r.part in "bc" and r.name in done]
    if rows:
        lines += ["b, c) throughput (median after {} warm-up steps)".format(WARMUP), "",
                  "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
        lines.append("")
    pair = [r for r in runs if r.part == "c" and r.name in done]
    if len(pair) == 2:
        one, many = sorted(pair, key=lambda r: r.gpus)
        efficiency = steady(done[many.name], "tokens_per_s_per_gpu") / steady(done[one.name], "tokens_per_s_per_gpu")
        lines.append(f"c) scaling 1 -> {many.gpus} GPUs, bf16: {efficiency:.1%} of the 1-GPU tokens/s/GPU")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--gpu", default="h200", help="conf/gpu option (peaks for MFU)")
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--steps-a", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10, help="steps of parts b and c")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per GPU per step in part b")
    args = parser.parse_args()
    if "a" in args.parts and importlib.util.find_spec("megatron") is None:
        parser.error("part a reads the bundled text through megatron-core, which is not installed; "
                     "install its wheel or leave part a out (--parts bc)")
    runs = plan_runs(args.parts, args.gpus, args.steps_a, args.steps, args.accumulate)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done = execute(runs, args.out, args.gpu, args.gpus)
    write_records(runs, done, args.out, args.gpus, time.perf_counter() - started)
    return 0 if len(done) == len(runs) else 1


def result_row(run: Run, run_dir: Optional[Path]) -> dict:
    """One line of results.csv: the run, and its figures where it finished (throughput as results.md reports it)."""
    row = {"run": run.name, "part": run.part, "model": run.model, "precision": run.precision, "gpus": run.gpus,
           "global_batch_size": run.trainer["global_batch_size"], "accumulate": run.accumulate,
           "status": "ok" if run_dir else "failed or not run"}
    if run_dir:
        summary = json.loads((run_dir / SUMMARY).read_text())
        steps = metrics(run_dir)
        row.update({field: steady(run_dir, field) if len(steps) > WARMUP else None
                    for field in ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu")})
        row.update(steps=len(steps), final_loss=steps[-1]["loss"], peak_memory_gib=summary["peak_memory_gib"],
                   run_commit=summary.get("commit"))
    return row


def write_records(runs: list[Run], done: dict[str, Path], out: Path, gpus: int, seconds: float) -> None:
    """results.md (printed too), results.csv (one row per planned run) and provenance.json: the command, commit,
    date (UTC), versions and device."""
    out.mkdir(parents=True, exist_ok=True)
    lines = report(runs, done, gpus)
    info = provenance()
    command = "python scripts/scaling_bench.py " + " ".join(sys.argv[1:])
    lines += ["", f"commit {info.get('commit')}; {info.get('device')}; versions {info.get('versions')}",
              f"command: {command}; {seconds:.0f} s in all"]
    text = "\n".join(lines)
    print(text)
    (out / "results.md").write_text(text + "\n")
    rows = [result_row(run, done.get(run.name)) for run in runs]
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    record = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **info}
    (out / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
