"""Evaluation on `x̄` ([`EvaluationOnAverage`][lightning_decentral.common.EvaluationOnAverage]) and what the rules
learn from Lightning's module and precision plugin: shared by the Trainer's strategy and the simulation (and, for the
grad scaler, Fabric's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden


class EvaluationOnAverage:
    """Validation, test and prediction on `x̄` when `eval_on == "average"`:
    [`begin`][lightning_decentral.common.evaluation.EvaluationOnAverage.begin] swaps `x̄` in,
    [`end`][lightning_decentral.common.evaluation.EvaluationOnAverage.end] restores every replica exactly. Held by
    the Trainer's strategy and the simulation, whose `on_validation_start`, `on_test_start` and `on_predict_start`
    begin it, and whose matching ends and `on_exception` end it.

    Args:
        eval_on: `"average"` (evaluate `x̄`) or `"local"` (each replica as it is: `begin` does nothing).
        averaged_model: the strategy's `averaged_model`: a context inside which its module holds `x̄`.
    """

    def __init__(self, eval_on: str, averaged_model: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.eval_on = eval_on
        self.averaged_model = averaged_model
        self._context = contextlib.ExitStack()

    def begin(self) -> None:
        """Swap in `x̄` (`eval_on="average"`)."""
        if self.eval_on == "average":
            self._context.enter_context(self.averaged_model())

    def end(self) -> None:
        """Restore every replica (nothing if none was swapped out)."""
        self._context.close()


class HoldsEvaluation(Protocol):
    """A strategy that holds an [`EvaluationOnAverage`][lightning_decentral.common.evaluation.EvaluationOnAverage] as
    `evaluation`: the Trainer's and the simulation's."""

    evaluation: EvaluationOnAverage


def swap_in_average(strategy: HoldsEvaluation) -> None:
    """Lightning's `on_validation_start`, `on_test_start` and `on_predict_start` of a strategy holding
    `evaluation`: swap `x̄` into its module (`eval_on="average"`). Defined once and assigned to the hooks of both
    strategies (their Lightning bases differ, and a base class of this package shared by both would be a mixin)."""
    strategy.evaluation.begin()


def restore_replicas(strategy: HoldsEvaluation) -> None:
    """Lightning's `on_validation_end`, `on_test_end` and `on_predict_end` of a strategy holding `evaluation`:
    restore every replica (nothing if none was swapped out)."""
    strategy.evaluation.end()


def backward_may_overlap(module: LightningModule) -> bool:
    """Whether communication may start during backward: optimization is automatic, and no clipping (or module hook
    that may edit the gradients after backward) needs every gradient first."""
    edits_gradients = bool(module.trainer.gradient_clip_val) or any(
        is_overridden(hook, module)
        for hook in ("configure_gradient_clipping", "on_after_backward", "on_before_optimizer_step")
    )
    return module.automatic_optimization and not edits_gradients


def enabled_grad_scaler(precision: Any) -> torch.amp.GradScaler | None:
    """The enabled GradScaler of a precision plugin (fp16 mixed precision), else `None`: what the rules skip a step
    on when a rank's gradients overflowed."""
    scaler = getattr(precision, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None
