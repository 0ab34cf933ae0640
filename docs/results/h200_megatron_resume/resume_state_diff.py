"""Which state an engine=megatron resume does not bring back: every tensor the training step reads, snapshotted in an
uninterrupted run and in a run resumed from its checkpoint, compared bit for bit.

    python docs/results/h200_megatron_resume/resume_state_diff.py run DIR [DIR ...] --out OUT

Each DIR holds a config.yaml (launch/run.py ... dryrun=true) with trainer.max_steps=5 and checkpoint.interval=3. The
engine runs in this process with three observation points patched in (nothing else changes):
  start       after the checkpoint is loaded (a resume) or the model built (a fresh start)
  save3       right after step 3's checkpoint is written
  pre_step<N> step N's gradients (N = 4, 5), at its optimizer step: main_grad of every parameter, and the FP8
              copies and delayed-scaling state that step's forward and backward used
A snapshot holds a digest (hash, sum, largest magnitude) of each parameter's tensors (a Float8Tensor's data,
transpose, scale_inv and its transpose-valid flag), every TE module's fp8_meta scales and amax histories, and the
optimizer's master weights and moments. The uninterrupted run's save3 is compared with the resumed run's start, and
both runs' pre_step4 and pre_step5; at every optimizer step the FP8 weights with a stale transpose are counted.
--variants (joined with +) tries candidate fixes in the same call:
  no_dummy_step          skip the load's allocation step
  requantize_after_load  copy the master weights into the model after the load
  transposes_after_step  TE's post_all_gather_processing of the FP8 weights after each optimizer step and the load
  deterministic          NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (TE's deterministic attention backward)
The result files in this folder came from successive versions of this script (the stale-transpose count was added
for state_diff_fix/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

def digest(t: torch.Tensor) -> tuple:
    """What a snapshot keeps of a tensor: dtype, shape, a hash of its bytes, and its sum and largest magnitude (for
    floating-point tensors) to say how far two differing ones are apart."""
    t = t.detach()
    bits = t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).contiguous().view(torch.uint8)
    stats = (t.double().sum().item(), t.double().abs().max().item()) if t.is_floating_point() and t.numel() else ()
    return (str(t.dtype), tuple(t.shape), hashlib.sha1(bits.cpu().numpy().tobytes()).hexdigest(), *stats)


def tensors_of(obj, prefix: str, out: dict) -> None:
    """Every tensor attribute of a (possibly quantized) parameter, and its transpose-valid flag."""
    if type(obj) is torch.nn.Parameter or type(obj) is torch.Tensor:
        out[prefix] = digest(obj)
        return
    for name, value in sorted(vars(obj).items()):
        if name in ("main_grad", "grad"):  # gradients are snapshotted as such, at the optimizer step
            continue
        if isinstance(value, torch.Tensor):
            out[f"{prefix}.{name}"] = digest(value)
        elif name == "_transpose_invalid":
            out[f"{prefix}.{name}"] = ("bool", (), str(bool(value)))
    if not any(key.startswith(prefix + ".") for key in out):
        out[prefix] = digest(obj.dequantize() if hasattr(obj, "dequantize") else obj)


def fp8_weights(model: list) -> list:
    return [p for chunk in model for p in chunk.parameters() if getattr(p, "_transpose", None) is not None]


def stale_transposes(model: list) -> int:
    """Float8Tensor weights whose transpose (what dgrad reads on Hopper) is marked valid but is not their data's."""
    return sum(not p._transpose_invalid and not torch.equal(p._transpose, p._data.t()) for p in fp8_weights(model))


def snapshot(model: list, optimizer, grads: bool) -> dict:
    out = {"fp8_weights": ("count", (), str(len(fp8_weights(model))))}
    for c, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            tensors_of(param.data if type(param) is torch.nn.Parameter else param, f"param/{c}/{name}", out)
            if grads and getattr(param, "main_grad", None) is not None:
                out[f"main_grad/{c}/{name}"] = digest(param.main_grad)
        for name, module in chunk.named_modules():
            meta = getattr(module, "fp8_meta", None)
            if not isinstance(meta, dict):
                continue
            for key in ("scaling_fwd", "scaling_bwd"):
                state = meta.get(key)
                for field in ("scale", "amax_history"):
                    value = getattr(state, field, None)
                    if isinstance(value, torch.Tensor):
                        out[f"fp8_meta/{c}/{name}/{key}.{field}"] = digest(value)
    for o, inner in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        torch_optimizer = inner.optimizer
        for g, group in enumerate(torch_optimizer.param_groups):
            if "step" in group:
                out[f"optim/{o}/group{g}.step"] = ("step", (), str(float(group["step"])))
            for i, param in enumerate(group["params"]):
                out[f"optim/{o}/{g}/{i}.master"] = digest(param)
                for key, value in torch_optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim/{o}/{g}/{i}.{key}"] = digest(value)
    return out


def engine(config: str, dump: str) -> int:
    """Run the engine on `config` with the observation points, writing the snapshots to `dump`."""
    if not torch.cuda.is_available():  # a check of this script on a CPU: the test suite's stand-ins for CUDA
        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
        import megatron_on_cpu

        megatron_on_cpu.install()
        from recipes.megatron.engine import _rendezvous

        address = _rendezvous()  # a free local port for the one Gloo process
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=address.rsplit(":", 1)[1])
    import recipes.megatron.engine as megatron_engine
    from recipes.megatron import checkpoint as megatron_checkpoint
    if torch.cuda.is_available():
        from transformer_engine.pytorch.tensor.utils import post_all_gather_processing

    variant = os.environ.get("DIAG_VARIANT", "as_is")
    snapshots, current = {}, {"step": None, "model": None, "optimizer": None, "loading": False}

    make_optimizer = megatron_engine.get_megatron_optimizer

    def get_megatron_optimizer(config_, model):
        optimizer = make_optimizer(config_, model)
        current["model"], current["optimizer"] = model, optimizer
        real_step = optimizer.step

        def step():
            if current["loading"] and "no_dummy_step" in variant:
                return None  # the load's allocation step skipped (TE's FusedAdam allocates without it)
            if current["step"] in (4, 5):
                snapshots[f"pre_step{current['step']}"] = snapshot(model, optimizer, grads=True)
            if current["step"] is not None:
                snapshots.setdefault("stale_at_step", {})[current["step"]] = stale_transposes(model)
            result = real_step()
            if "transposes_after_step" in variant:
                post_all_gather_processing(fp8_weights(model))
            return result

        optimizer.step = step
        return optimizer

    megatron_engine.get_megatron_optimizer = get_megatron_optimizer
    real_load = megatron_checkpoint.load_latest

    def load_latest(directory, cfg, model, optimizer):
        current["loading"] = True
        try:
            step = real_load(directory, cfg, model, optimizer)
        finally:
            current["loading"] = False
        if "transposes_after_step" in variant:
            post_all_gather_processing(fp8_weights(model))
        if step and "requantize_after_load" in variant:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                inner._copy_main_params_to_model_params()
        return step

    megatron_engine.megatron_checkpoint.load_latest = load_latest

    real_train_loop = megatron_engine.train_loop

    def train_loop(cfg, run_dir, steps, first_step, *args, **kwargs):
        snapshots["start"] = snapshot(current["model"], current["optimizer"], grads=False)
        real_step, real_save = steps.step, steps.save_checkpoint

        def step(n, lr):
            current["step"] = n
            return real_step(n, lr)

        def save_checkpoint(n):
            saved = real_save(n)
            if n == 3:
                snapshots[f"save{n}"] = snapshot(current["model"], current["optimizer"], grads=False)
            return saved

        steps.step, steps.save_checkpoint = step, save_checkpoint
        return real_train_loop(cfg, run_dir, steps, first_step, *args, **kwargs)

    megatron_engine.train_loop = train_loop
    status = megatron_engine.main([config])
    torch.save({"variant": variant, "snapshots": snapshots}, dump)
    return status


def compare(a: dict, b: dict, limit: int = 12) -> dict:
    """Keys in both whose tensors differ bit for bit, counted by kind, with the first few named (sum and largest
    magnitude of each side)."""
    differing = [(key, a[key][3:], b[key][3:]) if a[key][:2] == b[key][:2] else (key, a[key][:2], b[key][:2])
                 for key in sorted(set(a) & set(b)) if a[key] != b[key]]
    kinds = {}
    for key, *_ in differing:
        leaf = key.rsplit("/", 1)[-1]
        kind = key.split("/")[0] + ("." + leaf.rsplit(".", 1)[-1] if "." in leaf else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"compared": len(set(a) & set(b)), "differ": len(differing), "kinds": kinds,
            "first": differing[:limit], "only_in_one": sorted(set(a) ^ set(b))[:limit]}


def run_pair(run_dir: Path, variant: str) -> dict:
    run_dir = run_dir.resolve()  # the engine runs in it (its relative data cache)
    deterministic = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"} if "deterministic" in variant else {}
    env = {**os.environ, **deterministic, "DIAG_VARIANT": variant, "PYTHONUNBUFFERED": "1",
           "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "")}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for name in ("metrics.jsonl", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    result = {"run": run_dir.name, "variant": variant}
    for label in ("uninterrupted", "resumed"):
        if label == "resumed":
            newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
            shutil.rmtree(newest)
            shutil.copy(run_dir / "metrics.jsonl", run_dir / "metrics_uninterrupted.jsonl")
        with open(run_dir / f"{label}.log", "w") as log:
            status = subprocess.run([sys.executable, __file__, "engine", str(run_dir / "config.yaml"),
                                     str(run_dir / f"{label}.pt")], cwd=run_dir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=400).returncode
        result[f"{label}_status"] = status
        if status != 0:
            result["error"] = (run_dir / f"{label}.log").read_text(errors="replace")[-1500:]
            return result
    a = torch.load(run_dir / "uninterrupted.pt", weights_only=False)["snapshots"]
    b = torch.load(run_dir / "resumed.pt", weights_only=False)["snapshots"]
    result["stale_transposes_at_step"] = {"uninterrupted": a.pop("stale_at_step", {}),
                                          "resumed": b.pop("stale_at_step", {})}
    result["fp8_weights"] = a["pre_step4"]["fp8_weights"][2]
    result["save3_vs_start"] = compare(a["save3"], b["start"])
    for n in (4, 5):
        result[f"pre_step{n}"] = compare(a[f"pre_step{n}"], b[f"pre_step{n}"])
    steps_a = [json.loads(line) for line in (run_dir / "metrics_uninterrupted.jsonl").read_text().splitlines()]
    steps_b = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result["steps"] = [(x["step"], x["loss"], x["grad_norm"], y["loss"], y["grad_norm"])
                       for x, y in zip(steps_a, steps_b) if x["step"] > 3]
    for path in (run_dir / "uninterrupted.pt", run_dir / "resumed.pt"):
        path.unlink()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("dirs", nargs="+", type=Path)
    run.add_argument("--variants", default="as_is")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--parallel", type=int, default=6)
    one = sub.add_parser("engine")
    one.add_argument("config")
    one.add_argument("dump")
    args = parser.parse_args()
    if args.command == "engine":
        return engine(args.config, args.dump)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for run_dir in args.dirs:
        for variant in args.variants.split(","):
            target = run_dir.parent / f"{run_dir.name}--{variant}"
            if target != run_dir:
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(run_dir, target)
            jobs.append((target, variant))
    with ThreadPoolExecutor(args.parallel) as pool, open(args.out / "resume_state_diff.jsonl", "w") as out:
        for result in pool.map(lambda job: run_pair(*job), jobs):
            print(json.dumps(result), flush=True)
            out.write(json.dumps(result) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
