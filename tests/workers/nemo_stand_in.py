"""Stands in for recipes.nemo.engine in tests/test_slurm.py, whose test cluster cannot run NeMo (no container, no
GPU). Takes the engine's argument, reads the resolved config as the engine does, and prints the iteration line
NeMo prints for each step of the run, so that launch/status.py and the report parser read the job as they read an
engine=nemo job."""

from __future__ import annotations

import sys

from recipes.config import load_config


def main() -> None:
    (config_path,) = sys.argv[1:]
    cfg = load_config(config_path)
    assert cfg.engine == "nemo", cfg.engine
    t = cfg.trainer
    for it in range(t.max_steps):
        print(f"Training epoch 0, iteration {it}/{t.max_steps - 1} | lr: {t.lr} | global_batch_size: "
              f"{t.global_batch_size} | global_step: {it} | reduced_train_loss: {10 - it} | train_step_timing in s: "
              f"1.5 | consumed_samples: {(it + 1) * t.global_batch_size}", flush=True)


if __name__ == "__main__":
    main()
