"""metrics.jsonl and summary.json for engine=nemo, written from inside NeMo's trainer by a Lightning callback.

On global rank 0, after every optimizer step: what NeMo logged for it (`reduced_train_loss`, which NeMo sends
from the last pipeline stage to the first; `grad_norm`, None where NeMo logs none; `lr`), and the wall time since
the previous step ended. Reading the loss waits for the GPU, so each step's time covers its own work. The records
are the other engines' (recipes.metrics.MetricsWriter: with TensorBoard scalars and W&B as the config asks), so
reports read all engines alike.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
import yaml
from lightning.pytorch.callbacks import Callback

from recipes.config import Config, from_dict
from recipes.metrics import MetricsWriter, StepMetrics, step_metrics
from recipes.trainer.checkpoints import resume_metrics
from recipes.trainer.console import finish_run
from recipes.trainer.loop import NonFiniteError


class RunMetrics(Callback):
    """`config_yaml`: the run's resolved config (plain values, so that nemo-run can serialize the recipe)."""

    def __init__(self, config_yaml: str, run_dir: str):
        self.cfg: Config = from_dict(Config, yaml.safe_load(config_yaml))
        self.run_dir = Path(run_dir)
        self.history: list[StepMetrics] = []
        self.writer: Optional[MetricsWriter] = None
        self.step_end = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            # A resumed run: metrics.jsonl cut back to the checkpoint's step, as the other engines do.
            self.history = resume_metrics(self.run_dir, trainer.global_step)
            self.writer = MetricsWriter(self.run_dir, self.cfg, trainer.global_step + 1, self.history)
        self.step_end = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        logged = trainer.callback_metrics
        loss = float(logged["reduced_train_loss"])
        grad_norm = float(logged["grad_norm"]) if "grad_norm" in logged else None
        now = time.perf_counter()
        elapsed, self.step_end = now - self.step_end, now
        lr = float(logged["lr"])  # NeMo logs it as the step starts; the scheduler has stepped again by now
        metrics = step_metrics(self.cfg, trainer.global_step, loss, grad_norm, lr, elapsed, trainer.world_size,
                               torch.cuda.max_memory_allocated() / 2**30)
        self.writer.write(metrics)
        if not math.isfinite(loss):
            raise NonFiniteError(loss, grad_norm, step=trainer.global_step)
        self.history.append(metrics)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()
        if trainer.is_global_zero and self.history:
            finish_run(self.cfg, self.history, trainer.world_size, self.run_dir)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
