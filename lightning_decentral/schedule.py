"""What happens at optimizer step `k`: how many rounds of `W(k)`, or a local step.

The schedule is decided here, once per step, and handed down as a [`StepPlan`][lightning_decentral.schedule.StepPlan]
to the update rule and the mixer; no other layer re-decides it (docs/algorithms.md, "Variants").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_decentral.topology import Hierarchical, PerRound, Topology


@dataclass(frozen=True)
class StepPlan:
    """Optimizer step `step` applies `W(step)^rounds`; `rounds == 0` is a local step (`W = I`).

    Made by [`GossipSchedule.plan`][lightning_decentral.schedule.GossipSchedule.plan] once per step and
    handed to the update rule's `begin_step`; the rule passes `step` and `rounds` to its mixer.

    Examples:
        >>> StepPlan(step=4, rounds=2).gossips, StepPlan(step=5, rounds=0).gossips
        (True, False)
    """

    step: int
    rounds: int

    @property
    def gossips(self) -> bool:
        """Whether this step exchanges anything."""
        return self.rounds > 0


UNITS = ("epoch", "step")


class RoundsSchedule:
    """Gossip rounds per gossip step, piecewise constant over epochs or optimizer steps: `milestones[m]`
    rounds from epoch (or step) `m` until the next milestone. Milestone 0 must be given.

    What `gossip_steps` takes, besides an integer: a `RoundsSchedule`, or the dictionary
    `{"epoch": {0: 4, 5: 2, 10: 1}}` (or `{"step": {...}}`),
    read by [`of`][lightning_decentral.schedule.RoundsSchedule.of].

    Args:
        milestones: `{first epoch (or step): rounds}`, each rounds a positive integer.
        unit: `"epoch"` (the Trainer's `current_epoch`; under Fabric, `strategy.set_epoch`) or `"step"`
            (the optimizer step `k`).

    Raises:
        ValueError: naming the fix, for a bad unit, milestone or number of rounds.

    Examples:
        >>> schedule = RoundsSchedule({0: 4, 5: 2, 10: 1}, unit="epoch")
        >>> [schedule.rounds(step=0, epoch=e) for e in (0, 4, 5, 9, 10, 99)]
        [4, 4, 2, 2, 1, 1]
        >>> schedule, schedule.most
        (RoundsSchedule({0: 4, 5: 2, 10: 1}, unit='epoch'), 4)
        >>> RoundsSchedule.of({"step": {0: 3, 100: 1}}).rounds(step=100, epoch=0), RoundsSchedule.of(2)
        (1, RoundsSchedule({0: 2}, unit='step'))
        >>> print(schedule, RoundsSchedule.of(2))
        {'epoch': {0: 4, 5: 2, 10: 1}} 2
    """

    def __init__(self, milestones: dict[int, int], unit: Literal["epoch", "step"] = "epoch") -> None:
        if unit not in UNITS:
            raise ValueError(f"A gossip_steps schedule is by 'epoch' or by 'step', got unit={unit!r}.")
        if not isinstance(milestones, dict) or 0 not in milestones:
            raise ValueError(
                f"A gossip_steps schedule needs its rounds from {unit} 0 on, as {{0: rounds, ...}}, got {milestones!r}."
            )
        for start, rounds in milestones.items():
            if not _is_int(start) or start < 0 or not _is_int(rounds) or rounds < 1:
                raise ValueError(
                    f"A gossip_steps schedule maps a first {unit} (an integer ≥ 0) to rounds (a positive integer), "
                    f"got {start!r}: {rounds!r}."
                )
        self.unit = unit
        self.milestones = dict(sorted(milestones.items()))

    @classmethod
    def of(cls, spec: Any) -> RoundsSchedule:
        """A `RoundsSchedule` from what `gossip_steps` takes: a positive integer (every step), a `RoundsSchedule`,
        or `{"epoch": {first epoch: rounds, ...}}` / `{"step": {first step: rounds, ...}}`.

        Raises:
            ValueError: naming the forms it takes.
        """
        if isinstance(spec, RoundsSchedule):
            return spec
        if _is_int(spec) and spec >= 1:
            return cls({0: spec}, unit="step")
        if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in UNITS:
            unit, milestones = next(iter(spec.items()))
            if isinstance(milestones, dict):
                return cls({_int_key(k): v for k, v in milestones.items()}, unit=unit)
        raise ValueError(
            "`gossip_steps` must be a positive integer (rounds on every gossip step), a RoundsSchedule, or a schedule "
            f'{{"epoch": {{0: 4, 5: 2, 10: 1}}}} (or {{"step": {{...}}}}): rounds from each epoch (step) on; got '
            f"{spec!r}."
        )

    @property
    def by_epoch(self) -> bool:
        """Whether the rounds change with the epoch (the executor must tell it)."""
        return self.unit == "epoch" and len(self.milestones) > 1

    @property
    def most(self) -> int:
        """The most rounds any step takes."""
        return max(self.milestones.values())

    def rounds(self, step: int, epoch: int) -> int:
        """Rounds on a gossip step of optimizer step `step`, in epoch `epoch`."""
        at = epoch if self.unit == "epoch" else step
        return next(r for start, r in reversed(self.milestones.items()) if start <= at)

    def __repr__(self) -> str:
        return f"RoundsSchedule({self.milestones}, unit={self.unit!r})"

    def __str__(self) -> str:
        """As `gossip_steps` takes it: `"2"` for two rounds on every gossip step, else `"{'epoch': {0: 4, 5: 2}}"`."""
        if len(self.milestones) == 1:
            return str(self.milestones[0])
        return str({self.unit: self.milestones})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoundsSchedule) and (self.unit, self.milestones) == (other.unit, other.milestones)

    def __hash__(self) -> int:
        return hash((self.unit, tuple(self.milestones.items())))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_key(key: Any) -> Any:
    """A milestone as YAML or JSON may give it: `5` or `"5"`."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


class GossipSchedule:
    """Rounds of `W(k)` on the steps with `(k + 1) % gossip_every == 0` (what the strategy's `gossip_steps`, a
    [`RoundsSchedule`][lightning_decentral.schedule.RoundsSchedule], gives at that step and epoch), none on
    the others.

    A step whose `W(k)` is the identity is local too. A time-varying topology advances one matrix per gossip round,
    not per step ([`PerRound`][lightning_decentral.topology.PerRound]): under `gossip_every = H` the rounds apply
    `W(0), W(1), …` of the topology in turn, so every matrix of its period is used.

    Args:
        topology: a topology bound to the world size.
        gossip_every: gossip on every this many steps (1: every step).
        rounds: rounds of `W(k)` on a step that gossips: an integer, a `RoundsSchedule` or its
            dictionary form (`{"epoch": {0: 4, 5: 2}}`).
        first_step: the steps before it are local (the survivors of a failure mix again from there).

    Raises:
        ValueError: if the steps that gossip never connect every rank (a time-varying `Hierarchical` topology,
            indexed by the step, whose period shares a factor with `gossip_every`).

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> schedule = GossipSchedule(Ring(world_size=4), gossip_every=2, rounds=3)
        >>> [schedule.rounds(k) for k in range(4)]
        [0, 3, 0, 3]
        >>> schedule.plan(1)
        StepPlan(step=1, rounds=3)
        >>> by_epoch = GossipSchedule(Ring(world_size=4), rounds={"epoch": {0: 4, 2: 1}})
        >>> by_epoch.plan(7, epoch=1), by_epoch.plan(8, epoch=2)
        (StepPlan(step=7, rounds=4), StepPlan(step=8, rounds=1))
        >>> [GossipSchedule(Ring(world_size=3), first_step=2).rounds(k) for k in range(4)]  # survivors, from step 2
        [0, 0, 1, 1]
        >>> from lightning_decentral.topology import OnePeerExponential
        >>> GossipSchedule(OnePeerExponential(world_size=4), gossip_every=10).topology  # one matrix per round
        PerRound(OnePeerExponential(world_size=4), every=10)
    """

    def __init__(
        self,
        topology: Topology,
        gossip_every: int = 1,
        rounds: int | RoundsSchedule | dict = 1,
        first_step: int = 0,
    ) -> None:
        if gossip_every > 1 and topology.period > 1 and not isinstance(topology, (PerRound, Hierarchical)):
            topology = PerRound(topology, gossip_every)
        self.topology = topology
        self.gossip_every = gossip_every
        self.first_step = first_step
        self.rounds_per_gossip = RoundsSchedule.of(rounds)
        if gossip_every > 1 and isinstance(topology, Hierarchical) and topology.period > 1:  # by the step: (k+1) % H
            cycle = math.lcm(gossip_every, topology.period)
            topology.check_connected(
                range(gossip_every - 1, cycle, gossip_every),
                f" on the steps that gossip with gossip_every={gossip_every}",
                f"The topology repeats every {topology.period} steps: choose a gossip_every that shares "
                f"no factor with {topology.period}, or a static topology.",
            )

    def rounds(self, step: int, epoch: int = 0) -> int:
        """Rounds of `W(step)` at optimizer step `step`, in epoch `epoch` (0: a local step)."""
        if step < self.first_step or (step + 1) % self.gossip_every or self.topology.is_identity(step):
            return 0
        return self.rounds_per_gossip.rounds(step, epoch)

    def plan(self, step: int, epoch: int = 0) -> StepPlan:
        """The plan of optimizer step `step`, in epoch `epoch` (read only by a schedule by epoch)."""
        return StepPlan(step, self.rounds(step, epoch))
