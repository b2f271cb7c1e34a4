"""[`Survivors`][lightning_decentral.membership.Survivors]: what a rank does when a peer fails, with
`on_peer_failure="continue"`, for the driver of any executor on processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Protocol

import torch.distributed as dist

from lightning_decentral._compat import default_store
from lightning_decentral.failures import Abandoned, GuardedStore, PeerFailure
from lightning_decentral.membership.groups import alone, poison
from lightning_decentral.membership.protocol import Decision, Membership
from lightning_decentral.membership.report import decision_line
from lightning_decentral.membership.store import store_client, store_host

log = logging.getLogger(__name__)  # shown as Lightning's own messages are (membership/report.py)


class Keeper(Protocol):
    """What [`Survivors`][lightning_decentral.membership.Survivors] asks of the driver
    ([`StepDriver`][lightning_decentral.driver.StepDriver])."""

    def keep(self, members: Any, first_step: int) -> None: ...

    def rebind_mixers(self) -> None: ...

    @property
    def mixers(self) -> list[Any]: ...

    @property
    def topology(self) -> Any: ...


class Survivors:
    """The [`Survival`][lightning_decentral.failures.Survival] of a rank's mixer: when an exchange of step `k` fails
    here, or `poll` says a member failed elsewhere, the rank

    1. closes every process group of this generation ([`poison`][lightning_decentral.membership.poison]): whatever
       waits on them, here or at a peer, fails at once (Lightning's broadcast at a batch start included);
    2. agrees with the other survivors on the members and one step `s`
       ([`Membership.agree`][lightning_decentral.membership.Membership.agree]; `k` is what it joins with);
    3. takes the steps up to `s` as local steps (`driver.keep(survivors, s + 1)`), logs one line saying so
       ([`decision_line`][lightning_decentral.membership.report.decision_line]), on a process group of its own:
       what Lightning or the loop runs on the default group at every batch (a broadcast, `sync_dist` metrics) then
       stays paired among the survivors, who are not all at the same batch when they agree;
    4. when step `s + 1` begins ([`begin`][lightning_decentral.membership.Survivors.begin], every survivor
       together), makes the survivors' default process group, rebinds the mixer to it and tells the executor
       (`on_change(decision)`). A survivor that dies before (after the agreement, in the steps taken alone, or while
       the group is made) is found there ([`Membership.form_group`][lightning_decentral.membership.Membership.form_group]):
       the others agree again, from step 2, and make the group of those left.

    A failure seen after the agreement by something of the generation given up (an exchange of it waited for late)
    is no new failure: `survive` ignores it.

    Args:
        membership: this run's membership, started.
        driver: the driver to re-bind (`keep`, `rebind_mixers`) and whose `mixers` to close when a peer fails.
        backend: the process-group backend to rebuild with.
        timeout: the process-group timeout.
        on_change: called with each decision, once the survivors' group exists.
    """

    def __init__(
        self,
        membership: Membership,
        driver: Keeper,
        backend: str,
        timeout: timedelta,
        on_change: Callable[[Decision], None] = lambda decision: None,
    ) -> None:
        self.membership, self.driver, self.backend, self.timeout = membership, driver, backend, timeout
        self.on_change = on_change
        self.pending: Optional[Decision] = None  # agreed; the survivors' group is not made yet
        self._server = default_store()  # rank 0's may host the job's store: it lives as long as this object, so it
        # must outlive the default group, which the survivors replace

    @classmethod
    def start(
        cls, driver: Keeper, run: int, min_workers: int, backend: str, timeout: timedelta, on_change: Callable[[Decision], None]
    ) -> tuple[Survivors, str]:
        """This rank's survivors of run `run` (a number the same on every rank and new to the store), its heartbeat
        beating; and, if the job's store cannot outlive a worker, why (a warning for the executor to give)."""
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        store = GuardedStore(lambda: store_client(timeout), timeout.total_seconds(), where)
        outlives, words = store_host(store)
        membership = Membership(
            store, lambda: store_client(timeout), f"{run:x}", dist.get_rank(), dist.get_world_size(),
            silence=timeout.total_seconds(), min_workers=min_workers, toward=os.environ.get("MASTER_ADDR"),
        )
        membership.start()
        warning = "" if outlives else f"on_peer_failure='continue': {words}. The store's host is the run's single point of failure."
        return cls(membership, driver, backend, timeout, on_change), warning

    @property
    def alone(self) -> bool:
        """Between an agreement and the survivors' group: this rank runs on a process group of its own."""
        return self.pending is not None

    # -- the Survival protocol ----------------------------------------------------------------------------------

    def poll(self) -> Optional[str]:
        """A member failed elsewhere (announced, or silent): why; else `None`."""
        return self.membership.poll()

    def survive(self, step: int, failure: PeerFailure) -> None:
        """Steps 1 to 3 above, for a failure seen at step `step` (in its exchange, or in a collective of this rank
        while it is in that step or about to begin it); nothing once this rank is alone (see the class docstring)."""
        if self.pending is not None:
            return
        for mixer in self.driver.mixers:
            for group in mixer.groups():
                poison(group)
        if dist.is_initialized():
            poison()
        self._agree(step, failure)

    def _agree(self, step: int, failure: PeerFailure) -> None:
        """Steps 2 and 3 above: agree, keep the survivors' topology from the step after the agreed one, go on alone."""
        members = self.membership.members
        broken = [members[r] for r in failure.peers if r < len(members)]
        reason = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
        decision = self.membership.agree(step, reason, broken, any_broken=not broken and not isinstance(failure, Abandoned))
        self.driver.keep(decision.survivors, decision.step + 1)
        log.warning(decision_line(decision, self.membership.first_rank, self.driver.topology))  # on every survivor
        alone(self.backend, self.timeout)
        self.pending = decision

    # -- the survivors' group ----------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Before step `step`: make the survivors' group if they mix again from this step on."""
        if self.pending is not None and step > self.pending.step:
            self.form()

    def form(self) -> None:
        """Make the survivors' default process group now (every survivor together), rebind the mixers to it. A
        survivor lost meanwhile: the others agree again (joining with the step they would mix from) and make theirs."""
        while self.pending is not None:
            decision = self.pending
            try:
                self.membership.form_group(self.backend, self.timeout)
            except PeerFailure as failure:
                self._agree(decision.step + 1, failure)
                continue
            self.pending = None
            self.driver.rebind_mixers()
            self.on_change(decision)

    def close(self) -> None:
        """Stop the heartbeat."""
        self.membership.close()


def form_for_save(survivors: Optional[Survivors]) -> None:
    """Before a checkpoint save (every rank calls it first): if this rank is in the steps the survivors of a failure
    take alone, make their process group now, instead of at step `s + 1`, so that the save is theirs (`x̄` of the
    survivors, a shard each) rather than skipped.

    Every survivor is alone at the same save: a survivor becomes alone only when the decision is written, while each is
    in the step it joined with, `s` the largest. A save after a step `k < s` would find the survivor that joined with
    `s` still in the old generation, whose process groups the others closed: its save fails there. So the only
    saves of a run that survives are those after step `s`, where every survivor is alone, and all form the group
    together. No-op without `on_peer_failure="continue"` (`survivors` is `None`) or outside those steps.
    """
    if survivors is not None:
        survivors.form()

