"""[`Survivors`][lightning_decentral.membership.Survivors]: what a rank does when a peer fails, with
`on_peer_failure="continue"`, for the driver of any executor on processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from lightning_decentral._compat import default_store
from lightning_decentral.failures import Abandoned, PeerFailure, peers_answer
from lightning_decentral.membership.groups import alone, poison
from lightning_decentral.membership.protocol import Decision, Join, Membership
from lightning_decentral.membership.rejoin import CannotRejoin, Joins, ask, hand_over, publish, source_for
from lightning_decentral.membership.report import decision_line
from lightning_decentral.membership.store import store_client, store_host
from lightning_decentral.rendezvous import GuardedStore

log = logging.getLogger(__name__)  # shown as Lightning's own messages are (membership/report.py)


class Keeper(Protocol):
    """What [`Survivors`][lightning_decentral.membership.Survivors] asks of the driver
    ([`StepDriver`][lightning_decentral.driver.StepDriver])."""

    def keep(self, members: Any, first_step: int, of: Any = None) -> None: ...

    def rebind_mixers(self, group: Any = None) -> None: ...

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
       the group is made) is found there
       ([`Membership.form_group`][lightning_decentral.membership.Membership.form_group]): the others agree again, from
       step 2, and make the group of those left.

    A failure seen after the agreement by something of the generation given up (an exchange of it waited for late)
    is no new failure: `survive` ignores it.

    With `joins` (`rejoin=True`), [`begin`][lightning_decentral.membership.Survivors.begin] also looks for a lost rank
    started again that asks to rejoin ([`rejoin`][lightning_decentral.membership.rejoin]): at the join step the members
    [`admit`][lightning_decentral.membership.Membership.admit] it, make the grown group (`W` of the grown members, from
    the topology at the start), and the source ([`source_for`][lightning_decentral.membership.rejoin.source_for]) hands
    it `handover()`, its state.

    Args:
        membership: this run's membership, started.
        driver: the driver to re-bind (`keep`, `rebind_mixers`) and whose `mixers` to close when a peer fails.
        backend: the process-group backend to rebuild with.
        timeout: the process-group timeout.
        on_change: called with each decision, once the survivors' group exists.
        joins: with `rejoin=True`, the members' watch for ranks asking to rejoin.
        handover: the state a source hands to a rank that rejoins (the executor's: replica, optimizer, loop).
        exchange_group: with sharded replicas (the membership's `replica_size` above 1, whole replicas survive), once
            the survivors' group exists (every survivor together): the group of this rank's mesh column among them,
            which the mixers are rebound on (`None`: they mix on the survivors' group itself).
    """

    def __init__(
        self,
        membership: Membership,
        driver: Keeper,
        backend: str,
        timeout: timedelta,
        on_change: Callable[[Decision], None] = lambda decision: None,
        joins: Joins | None = None,
        handover: Callable[[], Any] | None = None,
        exchange_group: Callable[[], Any] | None = None,
    ) -> None:
        self.membership = membership
        self.exchange_group = exchange_group
        self.driver = driver
        self.backend = backend
        self.timeout = timeout
        self.on_change = on_change
        self.joins = joins
        self.handover = handover
        self.start_topology = driver.topology  # what the members of a join take their graph from
        self.published: dict[str, Any] = {"rejoin": False}  # what publish() says besides the membership
        self.pending: Decision | None = None  # agreed; the survivors' group is not made yet
        self._server = (
            default_store() if dist.is_initialized() else None
        )  # rank 0's may host the job's store: it lives as long as this object, so it
        # must outlive the default group, which the survivors replace

    @classmethod
    def start(
        cls,
        driver: Keeper,
        run: int,
        min_workers: int,
        backend: str,
        timeout: timedelta,
        on_change: Callable[[Decision], None],
        rejoin: tuple[Callable[[], int], str] | None = None,
        handover: Callable[[], Any] | None = None,
        replica_size: int = 1,
        exchange_group: Callable[[], Any] | None = None,
    ) -> tuple[Survivors, str]:
        """This rank's survivors of run `run` (a number the same on every rank and new to the store), its heartbeat
        beating; and, if the job's store cannot outlive a worker, why (a warning for the executor to give). With
        `rejoin` (the join margin, the job's token: [`job_token`][lightning_decentral.rendezvous.job_token]), lost
        ranks started again may rejoin: what they need is published, and every step looks for them. With
        `replica_size` above 1 (sharded replicas), a worker is that many ranks, lost or kept together, and
        `min_workers` counts them; `exchange_group` as for the class."""
        store = cls._store(timeout)
        outlives, words = store_host(store)
        membership = cls._membership(
            store, f"{run:x}", dist.get_rank(), dist.get_world_size(), min_workers, timeout, replica_size
        )
        membership.start()
        joins = Joins(membership, rejoin[0]) if rejoin is not None else None
        survivors = cls(membership, driver, backend, timeout, on_change, joins, handover, exchange_group)
        survivors.published = {"rejoin": True, "token": rejoin[1]} if rejoin is not None else {"rejoin": False}
        publish(store, membership, **survivors.published)
        warning = (
            ""
            if outlives
            else f"on_peer_failure='continue': {words}. The store's host is the run's single point of failure."
        )
        return survivors, warning

    @classmethod
    def rejoin(
        cls,
        driver: Keeper,
        info: dict[str, Any],
        rank: int,
        min_workers: int,
        backend: str,
        timeout: timedelta,
        on_change: Callable[[Decision], None],
        handover: Callable[[], Any],
        margin: Callable[[], int],
        configuration: dict[str, int | str] | None = None,
    ) -> tuple[Survivors, Join]:
        """A lost rank started again (`rank`, of the run `info` describes,
        [`current`][lightning_decentral.membership.rejoin.current]): unless its `configuration` differs from the one
        the members published (then `CannotRejoin` names each field, and the members never see it), ask to rejoin, wait
        until the members admit it, make the grown group with them (the default process group, this rank's place in it
        as the decision says) and keep `W` of the grown members from the join step. Returns its survivors and the
        decision; the executor then takes its state from the decision's source."""
        store = cls._store(timeout)
        membership = cls._membership(store, info["run"], rank, info["start_size"], min_workers, timeout)
        membership.start()
        survivors = cls(membership, driver, backend, timeout, on_change, Joins(membership, margin), handover)
        survivors.published = {"rejoin": True, "token": info["token"], "configuration": configuration}
        try:
            decision = ask(membership, driver.topology, timeout.total_seconds(), configuration)
        except CannotRejoin:
            membership.close()  # its heartbeat and beacon stop with it
            raise
        assert isinstance(decision, Join)  # a decision that admits it
        driver.keep(decision.members, decision.step + 1, of=survivors.start_topology)
        log.warning(decision_line(decision, rank, driver.topology))
        membership.form_group(backend, timeout)
        return survivors, decision

    def publish_configuration(self, configuration: dict[str, int | str]) -> None:
        """Publish what every member runs (the fields of the check that every rank runs the same configuration and
        optimizers, at set-up), with the rest of what a rank that rejoins reads
        ([`publish`][lightning_decentral.membership.rejoin.publish]): it compares its own with it before it asks."""
        self.published["configuration"] = configuration
        publish(self.membership.store, self.membership, **self.published)

    @staticmethod
    def _store(timeout: timedelta) -> GuardedStore:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return GuardedStore(lambda: store_client(timeout), timeout.total_seconds(), where)

    @staticmethod
    def _membership(
        store: GuardedStore,
        run: str,
        rank: int,
        size: int,
        min_workers: int,
        timeout: timedelta,
        replica_size: int = 1,
    ) -> Membership:
        return Membership(
            store,
            lambda: store_client(timeout),
            run,
            rank,
            size,
            silence=timeout.total_seconds(),
            min_workers=min_workers,
            toward=os.environ.get("MASTER_ADDR"),
            replica_size=replica_size,
        )

    @property
    def alone(self) -> bool:
        """Between an agreement and the survivors' group: this rank runs on a process group of its own."""
        return self.pending is not None

    # -- the Survival protocol ----------------------------------------------------------------------------------

    def poll(self) -> str | None:
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
        decision = self.membership.agree(
            step, reason, broken, any_broken=not broken and not isinstance(failure, Abandoned)
        )
        size = self.membership.replica_size  # whole replicas survive: each one's first rank stands for it
        self.driver.keep([position // size for position in decision.survivors[::size]], decision.step + 1)
        log.warning(decision_line(decision, self.membership.first_rank, self.driver.topology))  # on every survivor
        alone(self.backend, self.timeout)
        self.pending = decision

    # -- the survivors' group ----------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Before step `step`: make the survivors' group if they mix again from this step on; with `joins`, admit the
        ranks asking to rejoin if this is the join step."""
        if self.pending is not None and step > self.pending.step:
            self.form()
        elif self.pending is None and self.joins is not None and self.joins.due(step):
            self._admit(step)

    def _admit(self, step: int) -> None:
        """At the join step `step`: agree (the askers join, a member lost meanwhile is left out), keep `W` of the
        members decided from the topology at the start, make their group now (or, when a failure decided a later step
        first, go on alone until then)."""
        decision = self.membership.admit(step - 1, self.joins.asking() if self.joins is not None else [])
        self.driver.keep(decision.members, decision.step + 1, of=self.start_topology)
        log.warning(decision_line(decision, self.membership.first_rank, self.driver.topology))
        self.pending = decision
        if step > decision.step:
            self.form()
        else:
            alone(self.backend, self.timeout)

    def form(self) -> None:
        """Make the survivors' default process group now (every survivor together), rebind the mixers to it. A
        survivor lost meanwhile: the others agree again (joining with the step they would mix from) and make theirs."""
        while self.pending is not None:
            decision = self.pending
            try:
                self.membership.form_group(self.backend, self.timeout)
                group = self._exchange_group()
            except PeerFailure as failure:
                self._agree(decision.step + 1, failure)
                continue
            self.pending = None
            self.driver.rebind_mixers(group)
            self.on_change(decision)
            if self.pending is not None:  # a failure in on_change was survived: its decision replaced this one, and
                return  # its group is made when its step begins (nobody is handed this decision's state)
            publish(self.membership.store, self.membership, **self.published)
            try:
                self._hand_over(decision)
            except PeerFailure as failure:  # the rank that rejoins failed before it took the state over: a failure
                self._agree(decision.step + 1, failure)  # survived, whose group is made when its step begins
                return

    def _exchange_group(self) -> Any:
        """The group the mixers are rebound on (`exchange_group`'s, made by every survivor together), or `None`."""
        if self.exchange_group is None:
            return None
        with peers_answer("Making the survivors' groups of the replicas' mesh columns", "a survivor"):
            return self.exchange_group()

    def _hand_over(self, decision: Decision) -> None:
        """This member is the source of a rank that rejoins with `decision`: hand it this rank's state."""
        for joiner in decision.joined if isinstance(decision, Join) else ():
            source = source_for(joiner, decision.members, decision.joined, self.driver.topology)
            if source == self.membership.first_rank and self.handover is not None:
                with peers_answer(f"Handing this rank's state over to rank {joiner}, which rejoins", f"rank {joiner}"):
                    hand_over(self.handover(), to=decision.members.index(joiner))

    def close(self) -> None:
        """Stop the heartbeat."""
        self.membership.close()


def form_for_save(survivors: Survivors | None) -> None:
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
