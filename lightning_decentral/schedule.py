"""What happens at optimizer step `k`: how many rounds of `W(k)`, or a local step.

The schedule is decided here, once per step, and handed down as a [`StepPlan`][lightning_decentral.schedule.StepPlan]
to the update rule and the mixer; no other layer re-decides it (docs/algorithms.md, "Variants").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_decentral.topology import Topology


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


class GossipSchedule:
    """`gossip_steps` rounds of `W(k)` on the steps with `(k + 1) % gossip_every == 0`, none on the others.

    A step whose `W(k)` is the identity is local too.

    Args:
        topology: a topology bound to the world size.
        gossip_every: gossip on every this many steps (1: every step).
        gossip_steps: rounds of `W(k)` on a step that gossips.

    Raises:
        ValueError: if the steps that gossip never connect every rank (a time-varying topology
            whose period shares a factor with `gossip_every`).

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> schedule = GossipSchedule(Ring(world_size=4), gossip_every=2, gossip_steps=3)
        >>> [schedule.rounds(k) for k in range(4)]
        [0, 3, 0, 3]
        >>> schedule.plan(1)
        StepPlan(step=1, rounds=3)
    """

    def __init__(self, topology: Topology, gossip_every: int = 1, gossip_steps: int = 1) -> None:
        self.topology = topology
        self.gossip_every = gossip_every
        self.gossip_steps = gossip_steps
        if gossip_every > 1 and topology.period > 1:  # only the phases (k + 1) % p == 0 mix
            cycle = math.lcm(gossip_every, topology.period)
            topology.check_connected(
                range(gossip_every - 1, cycle, gossip_every),
                f" on the steps that gossip with gossip_every={gossip_every}",
                f"The topology repeats every {topology.period} steps: choose a gossip_every that shares "
                f"no factor with {topology.period}, or a static topology.",
            )

    def rounds(self, step: int) -> int:
        """Rounds of `W(step)` at optimizer step `step` (0: a local step)."""
        if (step + 1) % self.gossip_every or self.topology.is_identity(step):
            return 0
        return self.gossip_steps

    def plan(self, step: int) -> StepPlan:
        """The plan of optimizer step `step`."""
        return StepPlan(step, self.rounds(step))
