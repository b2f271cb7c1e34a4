"""The simulation's members across `failures=` and `rejoins=`:
[`Comings`][lightning_decentral.simulation.rejoins.Comings].

A worker lost at a failure step comes back at a later step as a rank started again comes back on processes
(`DecentralizedStrategy(on_peer_failure="continue", rejoin=True)`,
[`membership.rejoin`][lightning_decentral.membership.rejoin]): at the start of its rejoin step `J` it takes the replica,
optimizer state and rule state of the member [`source_for`][lightning_decentral.membership.rejoin.source_for] names (the
processes' choice, written once), keeps its own random state, and every member mixes with `W` of the grown members (of
the topology at the start) from step `J`. Its data: its own shard at the members' position: a worker away that comes
back later is visited meanwhile ([`visited`][lightning_decentral.simulation.rejoins.Comings.visited]), its batches
unused. (A rank started again on processes with a plain DataLoader starts its epoch's iterator again, as Lightning
resumes one: at an epoch boundary the two agree.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from lightning_decentral.driver import StepDriver
from lightning_decentral.membership.rejoin import source_for
from lightning_decentral.simulation.workers import SimulatedWorker, SimulatedWorkers
from lightning_decentral.topology import Topology

RuleMaker = Callable[[Any, Any, Any], Any]  # (replica, mixer, optimizer) -> a worker's rule


def checked_rejoins(rejoins: dict[int, list[int]] | None, failures: dict[int, list[int]]) -> dict[int, list[int]]:
    """`rejoins` checked: each names, at a step, workers that `failures` lost at an earlier step, not worker 0 (the
    LightningModule, which stays worker 0 when others come back), nor worker 0 lost at all.

    Examples:
        >>> checked_rejoins({6: [2]}, {3: [2]})
        {6: [2]}
    """
    if not rejoins:
        return {}
    back = {step: list(ws) if isinstance(ws, (list, tuple)) else [ws] for step, ws in rejoins.items()}
    lost_at = {w: step for step, ws in failures.items() for w in ws}
    for step, ws in back.items():
        for w in ws:
            if w == 0 or 0 in lost_at or w not in lost_at or not isinstance(step, int) or step <= lost_at[w]:
                raise ValueError(
                    f"`rejoins` maps an optimizer step to workers lost by `failures` at an earlier step (not worker 0, "
                    f"and with worker 0 never lost: it is the LightningModule), e.g. failures={{3: [2]}}, "
                    f"rejoins={{6: [2]}}; got rejoins={rejoins!r} with failures={failures!r}."
                )
    return back


class Comings:
    """Who leaves and who comes back at each step of the simulation.

    Args:
        failures: `{step: [workers]}` lost at that step (a local step, mixing among the others from the next).
        rejoins: `{step: [workers]}` back at the start of that step.
        start: the topology at the start (bound to every worker).
        make_rule: a returning worker's rule over its replica, mixer and optimizer.
    """

    def __init__(
        self, failures: dict[int, list[int]], rejoins: dict[int, list[int]], start: Topology, make_rule: RuleMaker
    ) -> None:
        self.failures = failures
        self.rejoins = rejoins
        self.start = start
        self.make_rule = make_rule
        self._away: list[SimulatedWorker] = []  # the workers lost: what a worker that comes back is made of
        self._step = -1  # the step begun last

    def visited(self, group: SimulatedWorkers) -> list[int]:
        """The shards the data loader visits: the members' (in order), then those of workers away that come back."""
        later = {w for step, ws in self.rejoins.items() if step > self._step for w in ws}
        return [*group.origins, *sorted(later - set(group.origins))]

    def at(self, step: int, group: SimulatedWorkers, driver: StepDriver) -> None:
        """Before step `step` begins: the workers lost there leave, those back there come back."""
        self._step = step
        lost = [group.origins.index(w) for w in self.failures.get(step, []) if w in group.origins]
        if lost:
            survivors = [i for i in range(len(group.origins)) if i not in lost]
            before = list(group.workers)
            group.remove(lost)
            self._away += [w for w in before if w not in group.workers]
            driver.keep(survivors, first_step=step + 1)
            driver.rebind_mixers()
        back = [w for w in self.rejoins.get(step, []) if w not in group.origins]
        if back:
            self._come_back(step, back, group, driver)

    def _come_back(self, step: int, back: list[int], group: SimulatedWorkers, driver: StepDriver) -> None:
        members = sorted([*group.origins, *back])
        driver.keep(members, first_step=step, of=self.start)
        driver.rebind_mixers()
        sources = {w: group.workers[group.origins.index(source_for(w, members, back, driver.topology))] for w in back}
        workers = list(group.workers)
        for w in back:
            vessel = self._away.pop()
            source = sources[w]
            vessel.module.load_state_dict(source.module.state_dict())
            vessel.optimizer.load_state_dict(copy.deepcopy(source.optimizer.state_dict()))  # its own buffers
            rule = self.make_rule(vessel.replica, group.mixer.worker(members.index(w)), vessel.optimizer)
            rule.load_state_dict(copy.deepcopy(source.rule.state_dict()))
            vessel.rule = rule
            vessel.origin = w
            workers.insert(members.index(w), vessel)
        group.workers = workers
        group.modules = [worker.module for worker in workers]
        group.rules = [worker.rule for worker in workers]
        for position, worker in enumerate(workers):
            worker.rule.mixer.rank = position  # its view of the dense mixer: the members' numbering
