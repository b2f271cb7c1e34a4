"""Consensus control (Kong et al., ICML 2021): extra gossip rounds while the consensus distance `Ξ` exceeds a
target, estimated from the gossip residual between exact measurements (the estimate is defined in
[`consensus`][lightning_decentral.callbacks.consensus])."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_decentral.callbacks._common import StepEnd, check_every, decentralized, due, max_over_ranks
from lightning_decentral.measures import Monitored, consensus_distance, gossip_residual
from lightning_decentral.topology import Topology

_REFERENCES = ("absolute", "parameters")


class ConsensusControl(StepEnd):
    """Keep the consensus distance under `target` with extra gossip rounds (Kong et al.'s practical scheme).

    At the end of every optimizer step `k` that gossips, while the estimated `Ξ` exceeds the target, the
    replicas (and mixed buffers) take one more round `x <- W(k) x`, up to the cap `rounds_cap` at that
    step in all (the strategy's own `gossip_steps` rounds included). The estimate `Ξ̂` before the extra
    rounds is the exact `Ξ` on steps with `(k + 1) % every_n_steps == 0` (one all-reduce of the parameters;
    also whenever no calibration exists yet), else the calibrated proxy `c · R(k)` (a scalar all-reduce),
    `c` refreshed by every exact measurement of the step's state, this callback's or
    [`ConsensusDistance`][lightning_decentral.callbacks.ConsensusDistance]'s. `r` rounds shrink the
    distance at least by `‖W(k)^r − 11ᵀ/n‖₂`
    ([`contraction_bounds`][lightning_decentral.callbacks.control.contraction_bounds]): `Ξ̂_r = ‖W(k)^r − 11ᵀ/n‖₂ · Ξ̂`
    (a guaranteed bound, no measurement per round), and the control stops at the first `r` with `Ξ̂_r ≤ target`, or when
    one more round cannot lower the bound (a `W(k)` that reaches only some ranks, as in one-peer topologies):
    [`rounds_needed`][lightning_decentral.callbacks.control.rounds_needed].

    Every rank takes the same decision by construction: `Ξ̂` comes from all-reduced values and the rounds
    are then agreed with an all-reduce (max) before any round is sent.

    When the cap keeps the bound above the target, the step logs `consensus/rounds_capped = 1` and rank 0
    warns, once per epoch, naming the rounds the target needed: `own + ⌈ln(target / Ξ̂) / ln σ⌉`,
    `σ = ‖W(k) − 11ᵀ/n‖₂`. The default cap is
    [`default_max_gossip_steps`][lightning_decentral.callbacks.control.default_max_gossip_steps]: the rounds that shrink
    the disagreement 100-fold on the topology given, at most 32.

    The hand-over. Switching the control off at once lets `Ξ` jump within a step from the target to its
    uncontrolled level (at a large learning rate, a ring of 16 went from `Ξ/‖x̄‖ = 0.08` to 1.0 and
    diverged). So from epoch `until_epoch` on, the control relaxes over `handover_epochs` epochs: at the
    fraction `p ∈ (0, 1]` of the hand-over done (counted in training batches), the extra rounds of a step
    are at most `⌈(1 − p) · E⌉`, with `E` the mean extra rounds per gossip step over epoch
    `until_epoch − 1`; from epoch `until_epoch + handover_epochs` on, none.

    Args:
        target: the largest tolerated `Ξ` (`reference="absolute"`), or `Ξ / ‖x̄‖`
            (`reference="parameters"`, with the `‖x̄‖` of the latest exact measurement).
        reference: `"absolute"` or `"parameters"`.
        max_gossip_steps: the most gossip rounds at one step, the strategy's own included (the user's
            bound); `None`: [`default_max_gossip_steps`][lightning_decentral.callbacks.control.default_max_gossip_steps]
            of the strategy's topology, and at least the strategy's own most rounds.
        until_epoch: full control during epochs `< until_epoch` (the initial phase, where Kong et al.
            find the consensus distance matters most), then the hand-over; `None`: always.
        every_n_steps: measure `Ξ` exactly (and recalibrate) every this many steps.
        handover_epochs: the epochs over which the control relaxes after `until_epoch` (0: it stops at once).

    Logs `consensus/gossip_steps`, the number of gossip rounds each step took in all (0 on local steps), and
    on every step that gossips `consensus/rounds_capped` (1: the cap kept `Ξ` above the target, else 0).
    Under a strategy other than [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy] it
    warns and does nothing (`Ξ = 0`).

    Examples:
        >>> control = ConsensusControl(target=0.05, reference="parameters", until_epoch=30, handover_epochs=5)
        >>> control.max_gossip_steps, control.rounds_cap, control.calibration  # the cap is set when fit starts
        (None, None, None)
        >>> ConsensusControl(target=0.05, reference="relative")
        Traceback (most recent call last):
        ...
        ValueError: `reference` must be one of ['absolute', 'parameters'], got 'relative'.

        In a job: `callbacks=[ConsensusControl(target=0.05, reference="parameters"), ConsensusDistance()]`.
    """

    def __init__(
        self,
        target: float,
        reference: Literal["absolute", "parameters"] = "absolute",
        max_gossip_steps: int | None = None,
        until_epoch: int | None = None,
        every_n_steps: int = 1,
        handover_epochs: int = 2,
    ) -> None:
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
            raise ValueError(f"`target` must be a positive number, got {target!r}.")
        if reference not in _REFERENCES:
            raise ValueError(f"`reference` must be one of {list(_REFERENCES)}, got {reference!r}.")
        if max_gossip_steps is not None and (
            isinstance(max_gossip_steps, bool) or not isinstance(max_gossip_steps, int) or max_gossip_steps < 1
        ):
            raise ValueError(
                f"`max_gossip_steps` must be a positive integer (or None: from the topology), got {max_gossip_steps!r}."
            )
        if isinstance(handover_epochs, bool) or not isinstance(handover_epochs, int) or handover_epochs < 0:
            raise ValueError(
                f"`handover_epochs` must be an integer ≥ 0 (0: stop at until_epoch), got {handover_epochs!r}."
            )
        if until_epoch is not None and (isinstance(until_epoch, bool) or not isinstance(until_epoch, int)):
            raise ValueError(f"`until_epoch` must be an integer epoch or None, got {until_epoch!r}.")
        self.target = float(target)
        self.reference = reference
        self.max_gossip_steps = max_gossip_steps
        self.until_epoch = until_epoch
        self.every_n_steps = check_every(every_n_steps)
        self.handover_epochs = handover_epochs
        self.rounds_cap: int | None = None  # the most rounds at one step: max_gossip_steps, or from the topology
        self.calibration: float | None = None  # c = Ξ / R on the same step's end
        self.mean_norm: float | None = None  # ‖x̄‖ at the latest exact measurement
        self._done_step = -1
        self._extra = 0  # the extra rounds of step _done_step
        self._mixed_step = -2  # the latest step that ran extra rounds
        self._rounds = 0  # all rounds of step _done_step
        self._bounds: dict[tuple[int, int], list[float]] = {}
        self._extra_by_epoch: dict[
            int, tuple[int, int]
        ] = {}  # epoch -> (extra rounds, gossip steps) under full control
        self._capped = False  # the cap kept step _done_step's bound above the target
        self._warned_epoch = -1

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._done_step = -1
        strategy = decentralized(trainer)
        if strategy is None:
            rank_zero_warn(_nothing_to_control(trainer))
            return
        own = strategy.gossip_steps.most
        if self.max_gossip_steps is None:
            self.rounds_cap = max(own, default_max_gossip_steps(strategy.topology))
        elif own > self.max_gossip_steps:
            raise ValueError(
                f"ConsensusControl(max_gossip_steps={self.max_gossip_steps}) is below the strategy's own "
                f"gossip_steps={strategy.gossip_steps}: raise max_gossip_steps, or lower gossip_steps."
            )
        else:
            self.rounds_cap = self.max_gossip_steps
        strategy.measure_residuals()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = self._ended_step(trainer)
        if step is None:
            return
        self.run_extra_rounds(trainer, step)
        pl_module.log("consensus/gossip_steps", float(self._rounds), on_step=True, on_epoch=False)
        if self._rounds:
            pl_module.log("consensus/rounds_capped", float(self._capped), on_step=True, on_epoch=False)

    def handover_cap(self, epoch: int, fraction: float) -> int | None:
        """The most extra rounds at a step of epoch `epoch`, `fraction` of the way through it (`None`: no limit
        but the cap; 0: no control): full control before `until_epoch`, then `⌈(1 − p) · E⌉` during the hand-over.

        Examples:
            >>> control = ConsensusControl(target=1.0, until_epoch=2, handover_epochs=2)
            >>> control.record_extra_rounds(epoch=1, extra=12, gossip_steps=3)  # E = 4 extra rounds per step
            >>> points = [(1, 1.0), (2, 0.5), (2, 1.0), (3, 0.5), (4, 0.5)]  # (epoch, fraction of it)
            >>> [control.handover_cap(epoch, fraction) for epoch, fraction in points]
            [None, 3, 2, 1, 0]
        """
        if self.until_epoch is None or epoch < self.until_epoch:
            return None
        progress = (epoch - self.until_epoch + fraction) / self.handover_epochs if self.handover_epochs else 1.0
        if progress >= 1.0:
            return 0
        extra, steps = self._extra_by_epoch.get(self.until_epoch - 1, (0, 0))
        return math.ceil((1.0 - progress) * extra / steps) if steps else 0

    def record_extra_rounds(self, epoch: int, extra: int, gossip_steps: int = 1) -> None:
        """Count `extra` rounds over `gossip_steps` controlled steps of epoch `epoch` (the hand-over starts from
        the mean of epoch `until_epoch − 1`)."""
        total, steps = self._extra_by_epoch.get(epoch, (0, 0))
        self._extra_by_epoch = {epoch: (total + extra, steps + gossip_steps)}  # only the latest epoch matters

    def _extra_cap(self, trainer: Trainer) -> int | None:
        """The hand-over's cap on the extra rounds of the current step; `None` while the control is full."""
        if self.until_epoch is None or trainer.current_epoch < self.until_epoch:
            return None
        batches = trainer.num_training_batches
        fraction = (trainer.fit_loop.epoch_loop.batch_idx + 1) / batches if batches and math.isfinite(batches) else 1.0
        return self.handover_cap(trainer.current_epoch, min(fraction, 1.0))

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints: the calibration and the extra rounds of the latest controlled epoch."""
        return {
            "calibration": self.calibration,
            "mean_norm": self.mean_norm,
            "extra_by_epoch": dict(self._extra_by_epoch),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored on resume, so that a hand-over continues from the same `E`."""
        self.calibration = state_dict["calibration"]
        self.mean_norm = state_dict["mean_norm"]
        self._extra_by_epoch = dict(state_dict["extra_by_epoch"])

    def run_extra_rounds(self, trainer: Trainer, step: int) -> None:
        """Decide and run the extra gossip rounds of optimizer step `step`, at its end.

        Acts once per step, whichever callback calls first: this one from `on_train_batch_end`, or
        [`ConsensusDistance`][lightning_decentral.callbacks.ConsensusDistance] just before it measures,
        so that `Ξ` is measured after the control. A collective: every rank calls it at the same step.
        """
        if self._done_step == step:
            return
        if self._extra:
            self._mixed_step = self._done_step
        self._done_step = step
        self._extra = 0
        self._rounds = 0
        self._capped = False
        strategy = decentralized(trainer)
        if strategy is None:
            return
        self._rounds = own = strategy.gossip_rounds(step)
        handover = self._extra_cap(trainer)
        if not own or handover == 0:
            return
        residual = gossip_residual(strategy, step)
        assert residual is not None
        exact = (
            due(step, self.every_n_steps)
            or self.calibration is None
            or (self.reference == "parameters" and self.mean_norm is None)
        )
        if exact:
            measured = consensus_distance(strategy)
            self.calibrate(step, measured["distance"], residual, measured["mean_norm"])
            estimate = float(measured["distance"])
        else:
            estimate = self.calibration * float(residual)
        target = self.target * (self.mean_norm or 0.0) if self.reference == "parameters" else self.target
        assert self.rounds_cap is not None, "the cap is set when fit starts"
        limit = self.rounds_cap - own
        bounds = self._contraction(strategy.topology, step, limit)
        extra = rounds_needed(bounds, estimate, target, limit)
        extra = int(max_over_ranks(torch.tensor(extra, device=strategy.root_device)))
        self._capped = extra == limit and bounds[limit] * estimate > target
        if handover is None:
            self.record_extra_rounds(trainer.current_epoch, extra)
            if self._capped and trainer.current_epoch != self._warned_epoch:
                self._warned_epoch = trainer.current_epoch
                rank_zero_warn(self._capped_message(step, trainer.current_epoch, own, bounds, estimate, target))
        else:
            extra = min(extra, handover)
        strategy.extra_gossip(step, extra)
        self._extra = extra
        self._rounds = own + extra

    def _capped_message(
        self, step: int, epoch: int, own: int, bounds: list[float], estimate: float, target: float
    ) -> str:
        """The warning of a step whose cap kept the bound above the target: the rounds the target needed."""
        sigma = bounds[1] if len(bounds) > 1 else 1.0
        needed = (
            f"{own + math.ceil(math.log(target / estimate) / math.log(sigma))} gossip rounds"
            if sigma < 1.0
            else "more rounds than one W(k) can give (a round of it does not contract every rank)"
        )
        return (
            f"ConsensusControl: at step {step} (epoch {epoch}) holding Ξ ≤ {target:.3g} from Ξ̂ = {estimate:.3g} needed "
            f"{needed}, but the cap is {self.rounds_cap}: Ξ stays above the target (told once per epoch; "
            "`consensus/rounds_capped` logs every step). Raise max_gossip_steps, or the target."
        )

    def calibrate(self, step: int, distance: Tensor, residual: Tensor | None, mean_norm: Tensor) -> None:
        """Take an exact `Ξ` (`distance`) and `‖x̄‖` (`mean_norm`) of the state at the end of `step`,
        measured after [`run_extra_rounds`][lightning_decentral.callbacks.ConsensusControl.run_extra_rounds]
        for that step and before any extra round.

        It sets `c = Ξ / R(step)` (`residual = R(step)`) unless step `step - 1` ran extra rounds (then
        `R(step)` measured a state the control had just contracted, not the training dynamics the proxy is
        meant to follow) or `R` is at the level of rounding (replicas still equal). A measurement of another
        step, or of a state the control has already mixed, is ignored.
        """
        if step != self._done_step or self._extra:
            return  # not this step's state before the control, or the replicas were mixed since
        self.mean_norm = float(mean_norm)
        if residual is None or self._mixed_step == step - 1:
            return
        r = float(residual)
        xi = float(distance)
        if r > 1e-6 * self.mean_norm and math.isfinite(xi):
            self.calibration = xi / r

    def _contraction(self, topology: Topology, step: int, limit: int) -> list[float]:
        """[`contraction_bounds`][lightning_decentral.callbacks.control.contraction_bounds], cached per phase."""
        key = (step % topology.period, limit)
        if key not in self._bounds:
            self._bounds[key] = contraction_bounds(topology, step, limit)
        return self._bounds[key]


def default_max_gossip_steps(topology: Topology, reduction: float = 100.0, most: int = 32) -> int:
    """The rounds that shrink the disagreement `x − x̄` by the factor `reduction` at the topology's per-step
    contraction `ρ = 1 −` [`spectral_gap`][lightning_decentral.topology.Topology.spectral_gap]:
    `⌈ln(reduction) / −ln ρ⌉`, within `[1, most]`. `ConsensusControl`'s cap when `max_gossip_steps=None`.

    Examples:
        >>> from lightning_decentral.topology import Complete, Ring
        >>> [default_max_gossip_steps(Ring(world_size=n)) for n in (4, 8, 16)]  # ρ = 0.33, 0.80, 0.95
        [5, 22, 32]
        >>> default_max_gossip_steps(Complete(world_size=16))
        1
    """
    rho = 1.0 - topology.spectral_gap()
    if rho <= 0.0:
        return 1
    if rho >= 1.0:
        return most
    return max(1, min(most, math.ceil(math.log(reduction) / -math.log(rho))))


def contraction_bounds(topology: Topology, step: int, limit: int) -> list[float]:
    """`[‖W^r − J‖₂ for r = 0..limit]` with `W = W(step)`, `J = 11ᵀ/n`: `r` gossip rounds shrink `Ξ` at
    least by the factor `‖W^r − J‖₂`, since `(W − J)^r = W^r − J` and `W^r x − x̄ = (W^r − J)(x − x̄)`.

    Examples:
        >>> from lightning_decentral.topology import OnePeerExponential, Ring
        >>> [f"{b:.3f}" for b in contraction_bounds(Ring(world_size=8), step=0, limit=3)]  # 0.805^r
        ['1.000', '0.805', '0.648', '0.521']
        >>> one_peer = OnePeerExponential(world_size=8)  # W(2) mixes i with i + 4 only: no bound
        >>> [f"{b:.3f}" for b in contraction_bounds(one_peer, step=2, limit=2)]
        ['1.000', '1.000', '1.000']
    """
    n = topology.world_size
    deviation = topology.mixing(step) - np.full((n, n), 1.0 / n)  # (W − J)^r = W^r − J
    power = np.eye(n) - np.full((n, n), 1.0 / n)
    bounds = []
    for _ in range(limit + 1):
        bounds.append(float(np.linalg.norm(power, 2)))
        power = deviation @ power
    return bounds


def rounds_needed(bounds: list[float], estimate: float, target: float, limit: int) -> int:
    """The fewest gossip rounds `r <= limit` with `bounds[r] · estimate <= target`, or fewer where one more
    round no longer lowers the bound (`bounds[r + 1] ≥ bounds[r]`); `bounds` from
    [`contraction_bounds`][lightning_decentral.callbacks.control.contraction_bounds].

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> bounds = contraction_bounds(Ring(world_size=8), step=0, limit=3)  # 1, 0.80, 0.65, 0.52
        >>> rounds_needed(bounds, estimate=0.1, target=0.07, limit=3)  # 0.1 · 0.65 ≤ 0.07
        2
        >>> rounds_needed(bounds, estimate=0.1, target=0.01, limit=3)  # the most allowed
        3
        >>> rounds_needed([1.0, 1.0, 1.0], estimate=0.1, target=0.01, limit=2)  # a round would not help
        0
    """
    rounds = 0
    while rounds < limit and bounds[rounds] * estimate > target and bounds[rounds + 1] < bounds[rounds] - 1e-12:
        rounds += 1
    return rounds


def _nothing_to_control(trainer: Trainer) -> str:
    """Why `ConsensusControl` does nothing under this Trainer, and what would give it replicas to control."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    if isinstance(strategy, Monitored):
        return (
            f"ConsensusControl has nothing to control: {name} runs one worker, whose replica is the model "
            "(Ξ = 0). Train on more workers: devices > 1 (or num_nodes > 1), or n workers simulated on one "
            "device with SimulatedDecentralizedStrategy(workers=n)."
        )
    return (
        f"ConsensusControl has nothing to control under {name} with {trainer.world_size} rank(s): the "
        "replicas are one model (Ξ = 0). Use strategy='dpsgd'."
    )
