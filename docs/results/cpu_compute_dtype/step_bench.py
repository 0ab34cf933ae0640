"""CPU seconds per optimizer step of a run's config (the README's default job: `python launch/run.py dryrun=true
run.dir=DIR`), built and stepped as the torch engine does it, with trainer.compute_dtype forced; CPU time
(time.process_time), because the machine measured on was shared. Run with OMP_NUM_THREADS=1.

    python docs/results/cpu_compute_dtype/step_bench.py DIR/config.yaml fp32|bf16 [steps]

CPU_SPEED_SLOW=1 switches oneDNN off: PyTorch's BF16 GEMMs then take the generic path of a CPU without native BF16."""
import os, sys, time, torch
if os.environ.get("CPU_SPEED_SLOW") == "1":
    torch.backends.mkldnn.enabled = False
from functools import partial
import torch.nn.functional as F
from recipes.config import load_config
from recipes.compute import compute_dtype
from recipes.engine.torch_engine import build_model, MicroBatches
from recipes.engine.training import build_optimizer, optimizer_step
from recipes.fp8 import Fp8Training
import dataclasses
config_path, dtype_setting = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
cfg = load_config(config_path)
precision = cfg.precision.name
from recipes.config import ComputeDtype
cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compute_dtype=ComputeDtype(dtype_setting)))
device = torch.device("cpu")
dtype = compute_dtype(cfg.trainer.compute_dtype, "cpu")
fp8 = Fp8Training.for_run(cfg, 1, device)
model = build_model(cfg, device, fp8)
opt = build_optimizer(model, cfg.trainer, device)
fp8.weights_changed(model)
batches = MicroBatches(cfg, 0, 1, device)
def loss_fn(step, micro):
    tokens, labels = batches.get(step, micro)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / 2  # optimizer_step's share
times = []
for step in range(1, steps + 1):
    t = time.process_time()
    loss, _ = optimizer_step(partial(loss_fn, step), 2, model, fp8, opt, 1e-3, 1.0)
    times.append(time.process_time() - t)
steady = sorted(times[1:])[len(times[1:]) // 2]
print(f"{precision} compute={dtype_setting} slow={os.environ.get('CPU_SPEED_SLOW','0')} threads={torch.get_num_threads()} "
      f"step1={times[0]:.2f}s median CPU s/step={steady:.3f} loss={loss.item():.4f}")
