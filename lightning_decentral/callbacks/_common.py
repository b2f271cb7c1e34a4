"""What the monitors share: which steps they act on, the step that just ended, and sums over ranks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_decentral.measures import Monitored


def check_every(every_n_steps: Any) -> int:
    """`every_n_steps`, checked: a positive integer."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
        raise ValueError(f"`every_n_steps` must be a positive integer (1 = every step), got {every_n_steps!r}.")
    return every_n_steps


def due(step: int, every_n_steps: int) -> bool:
    """Whether optimizer step `step` (0-based) is measured: `(step + 1) % every_n_steps == 0`, the
    steps Lightning writes to the loggers when `every_n_steps` is a multiple of `log_every_n_steps`.

    Examples:
        >>> [step for step in range(200) if due(step, every_n_steps=50)]
        [49, 99, 149, 199]
    """
    return (step + 1) % every_n_steps == 0


def decentralized(trainer: Trainer) -> Monitored | None:
    """The trainer's decentralized strategy (on processes or simulated) with more than one worker, else
    `None` (the replicas are one model). Its monitoring values are this process's sums over its workers:
    a sum over the ranks, divided by `num_workers`, gives the mean over every worker."""
    strategy = trainer.strategy
    if isinstance(strategy, Monitored) and strategy.num_workers > 1:
        return strategy
    return None


def max_over_ranks(tensor: Tensor) -> Tensor:
    """`max_i tensor_i`, in place: a decision every rank then shares, whatever each computed."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def warn_unless_written(every_n_steps: int, trainer: Trainer, name: str) -> None:
    """Warn when some measured steps would never reach the loggers."""
    log_every = trainer.log_every_n_steps
    if trainer.loggers and log_every and every_n_steps % log_every:
        rank_zero_warn(
            f"{name}(every_n_steps={every_n_steps}) measures at steps that Lightning does not write to the loggers "
            f"(log_every_n_steps={log_every}): make every_n_steps a multiple of Trainer(log_every_n_steps=...)."
        )


class StepEnd(Callback):
    """Tells which optimizer step ended, once per step, from `on_train_batch_end` of the batch that stepped."""

    _seen_step = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen_step = trainer.global_step  # a resumed fit starts counting here

    def _ended_step(self, trainer: Trainer) -> int | None:
        """The optimizer step `k` that ended since the last call, else `None` (accumulating)."""
        if trainer.global_step == self._seen_step:
            return None
        self._seen_step = trainer.global_step
        return trainer.global_step - 1
