"""The training loop both engines run. Each step:

    learning rate      learning_rate(step): linear warm-up, cosine decay
    the step           the engine's: forward and backward of the step's micro-batches, the optimizer step (under
                       torch.profiler for trainer.profile_step)
    metrics            time, throughput, memory (recipes.metrics), written by the logging rank: a line of
                       metrics.jsonl, TensorBoard scalars, W&B (MetricsWriter)
    non-finite check   a NaN or inf loss, gradient norm or delayed-scaling amax is written down, and training stops
                       (NonFiniteError)
    dead check         a gradient norm of exactly 0 for DEAD_STEPS steps running: the network can no longer learn,
                       and training stops the same way (DeadNetworkError)
    log                the engine's progress line every trainer.log_interval steps and at the last one
    checkpoint         the engine's, every trainer.checkpoint.interval steps and at the last one (checkpoint_due)
    stop               on a signal, after the step: its checkpoint, and out (recipes.trainer.stopping)

and at the end summary.json (recipes.trainer.console.finish_run). An engine hands the loop its step, checkpoint
and log functions (`EngineSteps`) and where the run starts (`Start`: the first step and the metrics before it, from
recipes.trainer.checkpoints.restore); it sets up and restores before, and tears down after.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from recipes.config import Config, TrainerConfig
from recipes.metrics import MetricsWriter, StepMetrics, step_metrics
from recipes.profiling import profile_step_if_due
from recipes.trainer.checkpoints import Start
from recipes.trainer.console import finish_run
from recipes.trainer.stopping import Stopped, stop_signals


class NonFiniteError(RuntimeError):
    """The loss, the gradient norm or an amax recorded by delayed scaling is inf or NaN: training stops (before
    the step is applied where the engine can). `amaxes` names the layers and roles of such amaxes
    (recipes.fp8.training.non_finite_amaxes)."""

    def __init__(self, loss: float, grad_norm: float, amaxes: str = "", step: Optional[int] = None):
        problems = []
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            problems.append(f"loss {loss} / gradient norm {grad_norm} is not finite")
        if amaxes:
            problems.append(f"the amax of {amaxes} is inf or NaN (delayed scaling)")
        super().__init__(("" if step is None else f"step {step}: ") + "; ".join(problems))
        self.loss, self.grad_norm, self.amaxes = loss, grad_norm, amaxes


# Every gradient exactly 0, in FP32, over millions of weights, is no healthy step: the activations are saturated or
# zero, as after a weight decay, init_std or learning rate far too large; Adam's momentum then carries the weights on
# along old gradients (often into inf), and the gradient stays 0. Three steps running rather than one, so that a
# single step an engine skipped and reported as 0 stops nothing.
DEAD_STEPS = 3


class DeadNetworkError(NonFiniteError):
    """The gradient norm has been exactly 0 for DEAD_STEPS steps running. A NonFiniteError, so that the engines stop on
    it as they do on NaN/inf (exit status 1, one line): a run that can never learn again is better stopped than
    left to fill its steps (and its GPUs' hours) with a flat loss."""

    def __init__(self, step: int, loss: float, vocab_size: int):
        uniform = ", ln(model.vocab_size): a uniform guess" if abs(loss - math.log(vocab_size)) < 1e-3 else ""
        RuntimeError.__init__(
            self, f"step {step}: the gradient norm has been exactly 0 for {DEAD_STEPS} steps running (loss "
            f"{loss:.4f}{uniform}): the network is dead and will not learn again; look for a trainer.weight_decay, "
            "model.init_std or trainer.lr far too large")
        self.loss, self.grad_norm, self.amaxes = loss, 0.0, ""


def learning_rate(step: int, trainer: TrainerConfig) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps` (step is 1-based)."""
    if step <= trainer.warmup_steps:
        return trainer.lr * step / max(1, trainer.warmup_steps)
    progress = (step - trainer.warmup_steps) / max(1, trainer.max_steps - trainer.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return trainer.min_lr + (trainer.lr - trainer.min_lr) * cosine


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@dataclass
class EngineSteps:
    """What an engine gives the loop. Every rank calls step and save_checkpoint; the logging rank calls log."""

    # One optimizer step at this learning rate: (loss, gradient norm), the same on every rank. A non-finite step
    # the engine refuses to apply raises NonFiniteError; one it applied anyway (megatron-core) is returned.
    step: Callable[[int, float], tuple[float, float]]
    save_checkpoint: Callable[[int], Optional[Path]]  # the step's checkpoint; its folder on the logging rank
    # The progress line of the steps since the last one; the run's steps so far come too (the time left).
    log: Callable[[list[StepMetrics], list[StepMetrics]], None]
    log_first_step: bool = False  # also log step 1 (where compilation shows)
    facts: dict = field(default_factory=dict)  # what summary.json adds about the engine's kernels (attention, loss)


def checkpoint_due(cfg: Config, step: int) -> bool:
    interval = cfg.trainer.checkpoint.interval
    return interval > 0 and (step % interval == 0 or step == cfg.trainer.max_steps)


def save(engine: EngineSteps, writer: Optional[MetricsWriter], step: int) -> Optional[Path]:
    """The engine's checkpoint of `step`, with a copy of metrics.jsonl beside it on the logging rank: a resume from
    it keeps every step's metrics even where the run directory's file was lost. A stop signal meanwhile, a second
    Ctrl-C included, is only noted: the checkpoint is finished first (recipes.trainer.stopping)."""
    with stop_signals.saving():
        saved = engine.save_checkpoint(step)
    if saved and writer:
        writer.keep_copy(saved)
    return saved


def train_loop(cfg: Config, run_dir: Path, engine: EngineSteps, start: Start, rank: int, world_size: int,
               device: torch.device) -> dict:
    """Steps start.first_step..trainer.max_steps; returns the summary (on the logging rank, rank 0; {} elsewhere)."""
    is_logger, first_step = rank == 0, start.first_step
    # The whole run's steps, those of earlier attempts included (metrics.jsonl was cut back to the checkpoint).
    history = start.history
    writer = MetricsWriter(run_dir, cfg, first_step, history) if is_logger else None
    last_logged = first_step - 1
    zero_gradient_steps = 0
    stop_signals.graceful = True  # from here a signal stops the run after the step in progress
    try:
        for step in range(first_step, cfg.trainer.max_steps + 1):
            stop_signals.step_in_progress = step
            lr = learning_rate(step, cfg.trainer)
            start = time.perf_counter()
            try:
                with profile_step_if_due(step, cfg.trainer.profile_step, run_dir, rank, device):
                    loss, grad_norm = engine.step(step, lr)
            except NonFiniteError as error:  # refused before the weights were touched: no step time
                if writer:
                    writer.write(step_metrics(cfg, step, error.loss, error.grad_norm, lr, float("nan"), world_size,
                                              peak_memory_gib(device)))
                raise NonFiniteError(error.loss, error.grad_norm, error.amaxes, step) from None
            elapsed = time.perf_counter() - start
            metrics = step_metrics(cfg, step, loss, grad_norm, lr, elapsed, world_size, peak_memory_gib(device))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                # Applied already (megatron-core's optimizer steps first); the run stops before any checkpoint of it.
                if writer:
                    writer.write(metrics)
                raise NonFiniteError(loss, grad_norm, step=step)
            zero_gradient_steps = zero_gradient_steps + 1 if grad_norm == 0.0 else 0
            if zero_gradient_steps == DEAD_STEPS:  # recorded, and stopped before any checkpoint of it
                if writer:
                    writer.write(metrics)
                raise DeadNetworkError(step, loss, cfg.model.vocab_size)
            history.append(metrics)
            if writer:
                writer.write(metrics)
                if (step == 1 and engine.log_first_step) or step % cfg.trainer.log_interval == 0 \
                        or step == cfg.trainer.max_steps:
                    engine.log([m for m in history if m.step > last_logged], history)
                    last_logged = step
            saved = save(engine, writer, step) if checkpoint_due(cfg, step) else None
            if saved:
                print(f"saved checkpoint of step {step} to {saved}", flush=True)
            signum = stop_signals.agreed(device)
            if signum and step < cfg.trainer.max_steps:
                if cfg.trainer.checkpoint.interval > 0 and not checkpoint_due(cfg, step):
                    saved = save(engine, writer, step)
                raise Stopped(signum, step, saved)
    finally:
        stop_signals.graceful, stop_signals.step_in_progress = False, None
        if writer:
            writer.close()
    if is_logger and history:  # empty only when resumed at max_steps with metrics.jsonl gone
        return finish_run(cfg, history, world_size, run_dir, engine.facts)
    return {}
