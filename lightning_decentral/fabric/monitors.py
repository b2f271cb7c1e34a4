"""The monitors as functions a Fabric loop calls every N steps and logs with `fabric.log_dict`: what the
Trainer's callbacks log, computed the same way ([`measures`][lightning_decentral.measures])."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_decentral._compat.lightning import as_fabric_backward
from lightning_decentral.fabric.strategy import DecentralizedStrategy
from lightning_decentral.measures import (
    consensus_distance,
    effective_ratio,
    gossip_residual,
    random_state,
    set_random_state,
)

# -- monitors a Fabric loop calls ---------------------------------------------------------------


def consensus_metrics(strategy: DecentralizedStrategy, per_layer: bool = False) -> dict[str, Tensor]:
    """What [`ConsensusDistance`][lightning_decentral.callbacks.ConsensusDistance] logs, now: `consensus/distance`
    (`Ξ`), `consensus/relative` (`Ξ / ‖x̄‖`), with `per_layer` `consensus/distance/<name>`, and
    `consensus/residual` of the last step if it gossiped and `strategy.measure_residuals()` ran.

    Call it between optimizer steps on every rank; the values are equal on every rank.
    """
    metrics: dict[str, Tensor] = {}
    if strategy.step > 0 and strategy.driver.residuals_measured:
        residual = gossip_residual(strategy, strategy.step - 1)
        if residual is not None:
            metrics["consensus/residual"] = residual
    measured = consensus_distance(strategy, per_layer)
    mean_norm = measured.pop("mean_norm")
    metrics.update({f"consensus/{key}": value for key, value in measured.items()})
    metrics["consensus/relative"] = measured["distance"] / mean_norm
    return metrics


def gossip_metrics(strategy: DecentralizedStrategy) -> dict[str, Tensor]:
    """What the Trainer's strategies log of the exchange: `gossip/bytes_sent`, the bytes this rank has sent so far
    (`strategy.bytes_sent`, float64: exact). Call it on any rank, any time."""
    return strategy.driver.bytes_metrics()


def effective_lr_metrics(
    strategy: DecentralizedStrategy, lr: float, loss_fn: Callable[[Any], Tensor], batches: Iterable[Any]
) -> dict[str, Tensor]:
    """What [`EffectiveLearningRate`][lightning_decentral.callbacks.EffectiveLearningRate] logs: `lr/effective`,
    `lr/effective_ratio` (`α_e / γ`) and `noise/decentralized` (`‖η_d‖`).

    Call it after the step's last `fabric.backward` and before `optimizer.step()`, on every rank. `lr` is `γ`;
    `loss_fn(batch)` must return the loss that was back-propagated for `batch` (divided as it was, when
    accumulating), and `batches` must be the step's micro-batches, in the order they were trained on: the
    `i`-th batch is run from the random state the step's `i`-th training forward started from
    ([`forward_random_states`][lightning_decentral.fabric.DecentralizedStrategy.forward_random_states]), so a
    model with dropout draws the same masks as in training, as the callback does. The gradients at `x̄` are
    computed with `torch.autograd.grad` (no `p.grad` changes); buffers and the random state are restored
    afterwards.

    Raises:
        ValueError: the number of batches is not the number of training forwards of the step.
    """
    module = strategy.module
    batches = list(batches)
    states = strategy.forward_random_states
    if len(states) != len(batches):
        raise ValueError(
            f"effective_lr_metrics got {len(batches)} batches but the step ran {len(states)} training forwards: "
            "`batches` must be the step's micro-batches, in order, one training forward of the model each (call it "
            "after the step's last `fabric.backward` and before `optimizer.step()`)."
        )
    params = [p for p in module.parameters() if p.requires_grad]
    scaler = strategy.grad_scaler
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    local = [p.grad / scale if p.grad is not None else torch.zeros_like(p) for p in params]
    at_mean = [torch.zeros_like(p) for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = random_state(strategy.root_device)
    try:
        with as_fabric_backward(), strategy.averaged_model(), torch.enable_grad():  # a differentiation, no training
            for batch, state in zip(batches, states):
                set_random_state(state)
                parts = torch.autograd.grad(loss_fn(batch), params, allow_unused=True)
                for total, part in zip(at_mean, parts):
                    if part is not None:
                        total.add_(part)
    finally:
        set_random_state(rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    ratio, noise = effective_ratio(strategy, local, at_mean)
    return {"lr/effective": ratio * lr, "lr/effective_ratio": ratio, "noise/decentralized": noise}
