"""The optimizer and its learning-rate schedule: AdamW over the drafter's trainable parameters, a linear warm-up over
``--warmup-ratio`` of the steps, then a cosine decay to zero at the last step (a resume that moves the last step
stretches the cosine to it)."""

from __future__ import annotations

import math

import torch


def optimizer_and_schedule(parameters, options, total_steps: int):
    """(AdamW with the run's lr, betas and weight decay; its schedule over ``total_steps``)."""
    optimizer = torch.optim.AdamW(parameters, lr=options.lr, betas=options.betas, weight_decay=options.weight_decay)
    warmup = max(1, round(options.warmup_ratio * total_steps))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, total_steps))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to zero at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
