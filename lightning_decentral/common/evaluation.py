"""Evaluation on `x̄` and what the rules learn from Lightning's module and precision plugin: shared by the Trainer's
strategy and the simulation (and, for the grad scaler, Fabric's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden


class EvaluatesOnAverage:
    """Strategy hooks that validate, test and predict on `x̄` when `eval_on == "average"`, restoring every
    replica exactly afterwards; for a strategy with `eval_on`, `averaged_model()` and an `ExitStack`
    `_eval_context` (closed on an exception too)."""

    eval_on: str
    _eval_context: contextlib.ExitStack
    averaged_model: Callable[[], contextlib.AbstractContextManager]

    def on_validation_start(self) -> None:
        """Runs when validation starts: swap in `x̄` (`eval_on="average"`)."""
        self._enter_eval()

    def on_validation_end(self) -> None:
        """Runs when validation ends: restore every replica."""
        self._eval_context.close()

    def on_test_start(self) -> None:
        """Runs when testing starts: swap in `x̄` (`eval_on="average"`)."""
        self._enter_eval()

    def on_test_end(self) -> None:
        """Runs when testing ends: restore every replica."""
        self._eval_context.close()

    def on_predict_start(self) -> None:
        """Runs when prediction starts: swap in `x̄` (`eval_on="average"`)."""
        self._enter_eval()

    def on_predict_end(self) -> None:
        """Runs when prediction ends: restore every replica."""
        self._eval_context.close()

    def _enter_eval(self) -> None:
        if self.eval_on == "average":
            self._eval_context.enter_context(self.averaged_model())


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
