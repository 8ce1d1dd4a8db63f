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
    round_step: int = 0,
    round_warmup_steps: int = 0,
) -> float:
    """Rate for optimizer step `step` (0-based): linear warmup, then cosine, linear or constant decay
    from `lr` to `lr * min_lr_ratio` at the last step; times the round's ramp (train.round_warmup_steps)
    where the step is the round's `round_step` (0-based) of its first `round_warmup_steps`."""
    rate = _scheduled(step, lr, total_steps, warmup_steps, schedule, min_lr_ratio)
    if round_step < round_warmup_steps:
        return rate * (round_step + 1) / (round_warmup_steps + 1)
    return rate


def _scheduled(
    step: int, lr: float, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float
) -> float:
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
