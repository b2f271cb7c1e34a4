"""Consensus distance (Kong et al., ICML 2021): watch it, and keep it under a target.

    Ξ(k) = sqrt( (1/n) Σ_i ‖x_i(k) − x̄(k)‖² )        over the trainable parameters

(defined on the [monitoring page](../monitoring.md#consensus-distance)). Both callbacks act at the end
of optimizer step `k`, on the replicas `x(k+1)` the strategy has just produced, when no exchange is in
flight. The free proxy is the *gossip residual* of step `k`,

    R(k) = sqrt( (1/n) Σ_i ‖y_i − Σ_j w_ij(k) y_j‖² )

over the state `y` that step's first gossip round mixed (AWC: `x(k)`; ATC: `U(x(k), g)`; DecentLaM:
`z = x(k) − γ g`, not `x`). Because `(I − W)` vanishes on consensus, `R` is `Ξ(y)` scaled by a factor
between `1 − λ₂(W)` and `1 − λ_min(W)` (symmetric `W`); the *calibration* `c = Ξ(k) / R(k)`, the exact
distance at the end of a step over that step's residual, turns it into an estimate `Ξ̂(k) = c · R(k)` of
the distance at the end of later steps.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_decentral.callbacks._common import StepEnd, check_every, decentralized, due, warn_unless_written
from lightning_decentral.callbacks.control import ConsensusControl
from lightning_decentral.measures import consensus_distance, gossip_residual


class ConsensusDistance(StepEnd):
    """Log the consensus distance `Ξ` between the replicas, and its free proxy, to every logger.

    * every `every_n_steps` optimizer steps: `consensus/distance` (`Ξ`, exact) and `consensus/relative`
      (`Ξ / ‖x̄‖`); with `per_layer=True` also `consensus/distance/<name>` per top-level submodule.
      Cost: one all-reduce of the parameters (about one gossip round of bytes).
    * every step that gossips: `consensus/residual` (`R(k)`, see the module docstring). Cost: a scalar
      all-reduce; the residual itself is computed while the exchange is combined.

    The values are all-reduced, hence equal on every rank, and logged with `LightningModule.log`: the
    loggers (rank zero only) write them once, at the steps Lightning writes (`log_every_n_steps`); they
    also reach `trainer.callback_metrics` (e.g. for `ModelCheckpoint(monitor="consensus/distance")`).
    Measured states are the replicas after the step (and after
    [`ConsensusControl`][lightning_decentral.callbacks.ConsensusControl]'s extra rounds). Under any other
    strategy the replicas are one model: `Ξ = 0` is logged and nothing is communicated.

    Args:
        every_n_steps: measure `Ξ` exactly every this many optimizer steps (step `k` when
            `(k + 1) % every_n_steps == 0`); best a multiple of `Trainer(log_every_n_steps=...)`.
        per_layer: also log `Ξ` of each top-level submodule.

    Examples:
        >>> ConsensusDistance(every_n_steps=50).every_n_steps
        50
        >>> ConsensusDistance(every_n_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: `every_n_steps` must be a positive integer (1 = every step), got 0.

        In a job: `Trainer(strategy="dpsgd", devices=8, callbacks=[ConsensusDistance(every_n_steps=50)])`.
    """

    def __init__(self, every_n_steps: int = 50, per_layer: bool = False) -> None:
        self.every_n_steps = check_every(every_n_steps)
        self.per_layer = per_layer
        self._control: ConsensusControl | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._control = next((c for c in trainer.callbacks if isinstance(c, ConsensusControl)), None)
        strategy = decentralized(trainer)
        if strategy is not None:
            strategy.measure_residuals()
        warn_unless_written(self.every_n_steps, trainer, type(self).__name__)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = self._ended_step(trainer)
        if step is None:
            return
        if self._control is not None:
            self._control.run_extra_rounds(trainer, step)  # the control acts first: Ξ is measured after it
        strategy = decentralized(trainer)
        metrics: dict[str, Any] = {}
        if strategy is None:
            metrics["consensus/residual"] = 0.0
            if due(step, self.every_n_steps):
                metrics["consensus/distance"] = metrics["consensus/relative"] = 0.0
                names = {name.split(".", 1)[0] for name, p in pl_module.named_parameters() if p.requires_grad}
                metrics.update({f"consensus/distance/{name}": 0.0 for name in sorted(names) if self.per_layer})
        else:
            residual = gossip_residual(strategy, step)
            if residual is not None:
                metrics["consensus/residual"] = residual
            if due(step, self.every_n_steps):
                measured = consensus_distance(strategy, self.per_layer)
                mean_norm = measured.pop("mean_norm")
                metrics.update({f"consensus/{key}": value for key, value in measured.items()})
                metrics["consensus/relative"] = measured["distance"] / mean_norm
                if self._control is not None:
                    self._control.calibrate(step, measured["distance"], residual, mean_norm)
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
