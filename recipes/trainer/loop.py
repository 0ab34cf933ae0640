"""The training loop both engines share."""

from __future__ import annotations

import math

from recipes.config import TrainerConfig


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is inf or NaN: the step is not applied and training stops."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"loss {loss} / gradient norm {grad_norm} is not finite")
        self.loss, self.grad_norm = loss, grad_norm


def learning_rate(step: int, trainer: TrainerConfig) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps` (step is 1-based)."""
    if step <= trainer.warmup_steps:
        return trainer.lr * step / max(1, trainer.warmup_steps)
    progress = (step - trainer.warmup_steps) / max(1, trainer.max_steps - trainer.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return trainer.min_lr + (trainer.lr - trainer.min_lr) * cosine
