"""The learning rate as a pure function of the step, as in nanoGPT: nothing to save but the step."""

from __future__ import annotations

import math


def learning_rate(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.1,
) -> float:
    """Rate for optimizer step `step` (0-based): linear warmup, then cosine, linear or constant decay
    from `lr` to `lr * min_lr_ratio` at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    min_lr = lr * min_lr_ratio
    if schedule == "constant" or total_steps <= warmup_steps + 1:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - 1 - warmup_steps))
    if schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
    if schedule == "linear":
        return lr - progress * (lr - min_lr)
    raise ValueError(f"unknown schedule {schedule!r}")
