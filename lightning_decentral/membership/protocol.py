"""Who is still in the run: heartbeats, the announcement of a failure, and the survivors' agreement on the members and
one step, all through the job's store ([`Membership`][lightning_decentral.membership.Membership])."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_decentral.failures import Abandoned, peers_answer
from lightning_decentral.membership.beacon import Beacon, gone
from lightning_decentral.membership.groups import rebuild_world
from lightning_decentral.rendezvous import GuardedStore, StoreLost, keep_out

HEARTBEAT = 0.1  # seconds between two heartbeats of a rank
POLL = 0.01  # seconds between two looks at the store while agreeing
CONFIRM = 0.5  # seconds of silence that make a member lost once a connection to it broke
IN_NEXT_STEP = 5.0  # seconds (at most half the silence) after which a rank of a replica that joined is in its next step


class Excluded(RuntimeError):
    """The other ranks went on without this one: it did not join their agreement in time (it was stopped, swapped out
    or silent past the timeout)."""


class ReplicaLost(Excluded):
    """With sharded replicas: a rank of this rank's replica failed, and a replica goes on only whole (FSDP's process
    group inside it cannot be rebuilt without that rank), so the other replicas went on without this one."""


class TooFewWorkers(RuntimeError):
    """Fewer workers survive than `min_workers`: the run stops on every survivor."""


@dataclass(frozen=True)
class Decision:
    """What the survivors of generation `generation - 1` agreed on.

    Attributes:
        generation: the new generation (0 is the run's start).
        members: the survivors, by their first rank, in order: rank `i` of the new world is `members[i]`.
        survivors: the same ranks as positions in the previous generation (for
            [`for_members`][lightning_decentral.topology.Topology.for_members]).
        lost: the members of the previous generation that did not survive, by their first rank.
        step: the last optimizer step whose exchange is discarded: every survivor discards each exchange it has not
            completed, takes local steps up to this one, and mixes among the survivors from the next.
    """

    generation: int
    members: tuple[int, ...]
    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    step: int


@dataclass(frozen=True)
class Join(Decision):
    """A decision that admits ranks that rejoin ([`admit`][lightning_decentral.membership.Membership.admit]): `step` is
    the last step of the previous members, the grown members mix from the next; `joined` the ranks admitted (by their
    first rank); `lost`, members lost meanwhile."""

    joined: tuple[int, ...] = ()


class Membership:
    """The members of one run and their agreement after a failure, through the job's store.

    Every rank beats a heartbeat (a counter in the store, `HEARTBEAT` seconds apart, from a thread with its own
    client) and keeps a [`Beacon`][lightning_decentral.membership.beacon.Beacon] open, whose address it publishes. When
    a rank sees a failure (an exchange that broke, or [`poll`][lightning_decentral.membership.Membership.poll] says
    so), it calls [`agree`][lightning_decentral.membership.Membership.agree]: it announces the failure (`abort/g`,
    which every other member's `poll` sees within one poll), joins with the step of the exchange it gave up, and waits
    until every member of the generation has joined or is lost; one decision (members, step) is written once
    (compare-and-set) and every survivor adopts it. A member is lost when its process is gone (its beacon refuses a
    probe: every member not yet joined is probed, so several deaths at once cost what one costs, and the first rank
    to find one marks it for the others), when its heartbeat has been silent for `silence` seconds, for `CONFIRM`
    seconds once a connection to it broke, or when it has not joined within `silence` of the announcement; a member
    that is alive but slow is waited for.

    Args:
        store: the job's store, guarded against hanging.
        connect: makes a new client of the store (the heartbeat's, each generation's process group's).
        run: this run's key prefix, the same on every rank and never used before.
        rank: this rank's rank at the start of the run.
        world_size: the ranks at the start.
        silence: seconds of silence that make a member lost (the process-group timeout).
        min_workers: below this many survivors, [`agree`][lightning_decentral.membership.Membership.agree] raises
            [`TooFewWorkers`][lightning_decentral.membership.TooFewWorkers] on every survivor.
        toward: the store's host: the beacon's address is this machine's on the route to it.
        replica_size: the ranks of one worker (sharded replicas: ranks `g·s … g·s+s−1` of the start hold worker
            `g`), which survive or are lost together: a member whose replica lost a rank is not waited for and is
            left out of the decision (it stops with [`ReplicaLost`][lightning_decentral.membership.ReplicaLost]);
            `min_workers` counts replicas.
    """

    def __init__(
        self,
        store: GuardedStore,
        connect: Callable[[], Any],
        run: str,
        rank: int,
        world_size: int,
        silence: float,
        min_workers: int,
        toward: str | None = None,
        replica_size: int = 1,
    ) -> None:
        self.store = store
        self.replica_size = replica_size
        self._connect = connect
        self.run = run
        self.prefix = f"lightning_decentral/{run}"
        self.first_rank = rank
        self.start_size = world_size
        self.members = list(range(world_size))
        self.generation = 0
        self.silence = silence
        self.min_workers = min_workers
        self.decisions: list[Decision] = []
        self._heard: dict[int, tuple[bytes, float]] = {}  # member -> (its counter, when it last changed, our clock)
        self._listened = 0.0
        self._started = time.monotonic()
        self._stopped = threading.Event()
        self._toward = toward
        self._beacon: Beacon | None = None
        self._addresses: dict[int, str] = {}  # member -> its beacon's address
        self._probed: dict[int, float] = {}  # member -> when this rank last probed it
        self._gone: set[int] = set()  # members whose process is gone
        self._left: set[int] = set()  # members that said they leave (their run is over: it ended, or raised)

    @property
    def rank(self) -> int:
        """This rank's rank among the current members."""
        return self.members.index(self.first_rank)

    @property
    def world_size(self) -> int:
        """The current number of members."""
        return len(self.members)

    @property
    def left_out(self) -> list[int]:
        """The ranks of the start that are not members now (lost, and not rejoined)."""
        members = tuple(self.members)
        return [rank for rank in range(self.start_size) if rank not in members]

    def key(self, *parts: Any) -> str:
        """The store key of `parts` under this run's prefix."""
        return "/".join([self.prefix, *map(str, parts)])

    # -- heartbeats -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open this rank's beacon and publish its address, beat the first heartbeat, then go on beating from a thread
        until [`close`][lightning_decentral.membership.Membership.close]. (A rank that rejoins first clears what its
        earlier process left: its marks of gone and left.)"""
        for mark in (self.key("gone", self.first_rank), self.key("left", self.first_rank)):
            self.store.delete_key(mark)
        self._beacon = Beacon(self._toward)
        self.store.set(self.key("address", self.first_rank), self._beacon.address)
        self.store.add(self.key("heartbeat", self.first_rank), 1)
        threading.Thread(target=self._beat, daemon=True, name="lightning_decentral-heartbeat").start()

    def _beat(self) -> None:
        """Every `HEARTBEAT` seconds: this rank's heartbeat, and the mark that keeps the lost ranks out of a restart
        ([`keep_out`][lightning_decentral.rendezvous.keep_out])."""
        try:
            store = self._connect()
            while not self._stopped.wait(HEARTBEAT):
                store.add(self.key("heartbeat", self.first_rank), 1)
                keep_out(store, self.left_out)
        except Exception:
            return

    def _listen(self) -> None:
        """Read every other member's heartbeat counter (one call) and note which changed."""
        now = self._listened = time.monotonic()
        others = [m for m in self.members if m != self.first_rank]
        keys = [self.key("heartbeat", m) for m in others]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # a member that has not beaten yet (the run is starting)
            values = [self.store.get(k) if self.store.check([k]) else b"" for k in keys]
        for member, value in zip(others, values):
            if self._heard.get(member, (None,))[0] != value:
                self._heard[member] = (value, now)

    def silent_for(self, member: int) -> float:
        """Seconds since `member`'s heartbeat last changed, on this rank's clock (as of the last look)."""
        return self._listened - self._heard.get(member, (b"", self._started))[1]

    def gone(self, member: int) -> bool:
        """Whether `member`'s process is gone: a member marked it so, or its beacon refuses a probe now (then this
        rank marks it, for every member and generation). At most one probe per member every `HEARTBEAT` seconds."""
        if member in self._gone:
            return True
        now = time.monotonic()
        if now - self._probed.get(member, -HEARTBEAT) < HEARTBEAT:
            return False
        self._probed[member] = now
        mark = self.key("gone", member)
        if self.store.check([mark]):
            self._gone.add(member)
        elif (address := self._address(member)) is not None and gone(address):
            self.store.set(mark, "1")
            self._gone.add(member)
        return member in self._gone

    def left(self, member: int) -> bool:
        """Whether `member` said it leaves ([`close`][lightning_decentral.membership.Membership.close]): its run is
        over, and no failure to look for (an exchange with it, if one still waits, fails on its own)."""
        if member not in self._left and self.store.check([self.key("left", member)]):
            self._left.add(member)
        return member in self._left

    def _silent_and_left(self, member: int) -> bool:
        return member != self.first_rank and self.silent_for(member) > CONFIRM and self.left(member)

    def _address(self, member: int) -> str | None:
        """`member`'s beacon address (`None` before it published one)."""
        if member not in self._addresses:
            key = self.key("address", member)
            if not self.store.check([key]):
                return None
            self._addresses[member] = self.store.get(key).decode()
        return self._addresses[member]

    def close(self) -> None:
        """Say this rank leaves, then stop the heartbeat (the others then see this rank silent), the beacon (they find
        it gone) and the store's call thread; once."""
        if self._stopped.is_set():
            return
        with contextlib.suppress(StoreLost):  # the run is over anyway
            self.store.set(self.key("left", self.first_rank), "1")
        self._stopped.set()
        if self._beacon is not None:
            self._beacon.close()
        self.store.close()

    # -- failures -------------------------------------------------------------------------------------------------

    def poll(self) -> str | None:
        """Why this rank should give up what it waits for, or `None`: a member announced a failure, a member's
        heartbeat has been silent for `silence` seconds, or for `CONFIRM` seconds and its process is gone, unless it
        said it leaves (a rank that stopped at the step every rank agreed on, say). One look at the store (and the
        heartbeats every `HEARTBEAT` seconds)."""
        abort = self.key("abort", self.generation)
        if self.store.check([abort]):
            return json.loads(self.store.get(abort))["reason"]
        if time.monotonic() - self._listened > HEARTBEAT:
            self._listen()
            for member in self.members:
                if self._silent_and_left(member):
                    continue
                silent = self.silent_for(member) if member != self.first_rank else 0.0
                if silent > self.silence:
                    return f"rank {member} has been silent for {silent:.1f} s (no heartbeat)"
                if silent > CONFIRM and self.gone(member):
                    return (
                        f"rank {member}'s process is gone (silent for {silent:.1f} s, its address refuses connections)"
                    )
        return None

    def agree(self, step: int, reason: str, broken: Sequence[int] = (), any_broken: bool = False) -> Decision:
        """Agree with the other survivors on the members and one step, after a failure seen at `step` (the step of the
        exchange this rank gives up); returns the decision, already adopted.

        Args:
            step: the optimizer step of the exchange this rank did not complete.
            reason: what it saw, for the others (`poll` returns it to them).
            broken: the members (first ranks) whose connection to this rank broke.
            any_broken: a connection broke, to a member this rank cannot name (a collective's).

        Raises:
            Excluded: the others decided without this rank.
            TooFewWorkers: fewer than `min_workers` survive (on every survivor alike).
        """
        g = self.generation
        announced = json.dumps({"reason": f"rank {self.first_rank} saw: {reason}"})
        self.store.compare_set(self.key("abort", g), "", announced)  # the first announcement stays
        for member in broken:
            self.store.set(self.key("broken", g, member), "1")
        if any_broken:
            self.store.set(self.key("broken", g, "any"), "1")
        self.store.set(self.key("join", g, self.first_rank), json.dumps({"step": step}))
        since = time.monotonic()
        decided = self.key("decide", g)
        while not self.store.check([decided]):
            proposal = self._proposal(g, since)
            if proposal is not None:
                self.store.compare_set(decided, "", json.dumps(proposal))  # another proposal may have won: read it
                break
            time.sleep(POLL)
        return self.adopt(json.loads(self.store.get(decided)))

    def admit(self, step: int, asking: Sequence[int]) -> Decision:
        """Agree with the other members to let the ranks `asking` rejoin after `step` (the last step of the members as
        they are: every member calls it when it is about to begin `step + 1`, the join step they agreed on); returns the
        decision, adopted. A member lost meanwhile is left out of it as
        [`agree`][lightning_decentral.membership.Membership.agree] leaves it; a failure agreed first (its decision is
        written first) is what every member adopts instead."""
        g = self.generation
        self.store.set(self.key("join", g, self.first_rank), json.dumps({"step": step}))
        since = time.monotonic()
        decided = self.key("decide", g)
        while not self.store.check([decided]):
            proposal = self._proposal(g, since)
            if proposal is not None:
                proposal["joined"] = sorted(set(asking) - set(proposal["members"]))
                proposal["members"] = sorted({*proposal["members"], *proposal["joined"]})
                self.store.compare_set(decided, "", json.dumps(proposal))
                break
            time.sleep(POLL)
        return self.adopt(json.loads(self.store.get(decided)))

    def enter(self, generation: int, members: Sequence[int]) -> None:
        """A rank that rejoins: take the members' generation as they published it, to ask to join it and then
        [`adopt`][lightning_decentral.membership.Membership.adopt] their decision."""
        self.members = list(members)
        self.generation = generation

    def _proposal(self, g: int, since: float) -> dict[str, Any] | None:
        """The decision to propose, once every member of generation `g` has joined or is lost; else `None`."""
        joins = {m: self.key("join", g, m) for m in self.members}
        joined = {m: json.loads(self.store.get(k))["step"] for m, k in joins.items() if self.store.check([k])}
        self._listen()
        any_broken = self.store.check([self.key("broken", g, "any")])
        waited = time.monotonic() - since

        def lost(member: int) -> bool:
            if self.silent_for(member) > self.silence or waited > self.silence or self.gone(member):
                return True
            broken = any_broken or self.store.check([self.key("broken", g, member)])
            return broken and self.silent_for(member) > CONFIRM

        missing = [m for m in self.members if m not in joined]
        failed = [m for m in missing if lost(m)]
        broken_replicas = {self.replica_of(m) for m in failed}
        if self.replica_size > 1 and waited > min(IN_NEXT_STEP, self.silence / 2):
            joined.update(self._in_next_step(joined, [m for m in missing if self.replica_of(m) not in broken_replicas]))
            missing = [m for m in missing if m not in joined]
        if any(m not in failed and self.replica_of(m) not in broken_replicas for m in missing):
            return None
        out = [m for m in self.members if self.replica_of(m) in broken_replicas]  # a replica is lost whole
        members = [m for m in sorted(joined) if m not in out]
        proposal = {"members": members, "lost": out, "step": max(joined[m] for m in members) if members else 0}
        return {**proposal, "failed": failed} if self.replica_size > 1 else proposal

    def _in_next_step(self, joined: dict[int, int], missing: list[int]) -> dict[int, int]:
        """The members of `missing` (alive) a rank of whose replica joined (`joined`: member -> step), each with the
        step after the largest its replica joined with: a rank that joined with step `k` has run step `k`'s forward
        and backward, whose FSDP collectives its replica's other ranks ran too, so they are in step `k` or `k + 1`;
        one that has not joined is most likely blocked in a collective of step `k + 1` with the rank that joined
        (the replica's ranks may complete different exchanges of a step), and will join once the agreed step lets
        that rank go on. Agreeing on `k + 1` covers both."""
        steps: dict[int, int] = {}
        for member, step in joined.items():
            replica = self.replica_of(member)
            steps[replica] = max(step, steps.get(replica, step))
        return {m: steps[self.replica_of(m)] + 1 for m in missing if self.replica_of(m) in steps}

    def replica_of(self, member: int) -> int:
        """The worker (replica) member `member` (a rank of the start) holds a part of."""
        return member // self.replica_size

    def adopt(self, decided: dict[str, Any]) -> Decision:
        """Take up the decision written for this generation (a dict as the store holds it): the next generation's
        members. Raises `Excluded` if this rank is not one of them, `TooFewWorkers` if fewer than `min_workers` are."""
        if self.first_rank not in decided["members"]:
            mates = [m for m in decided.get("failed", ()) if self.replica_of(m) == self.replica_of(self.first_rank)]
            if mates and self.first_rank not in mates:
                first = self.replica_of(self.first_rank) * self.replica_size
                raise ReplicaLost(
                    f"Rank {self.first_rank} stops: its replica (ranks {first} to {first + self.replica_size - 1}) "
                    f"lost rank {mates[0]} after step {decided['step']}, and a replica goes on only whole (FSDP's "
                    "process group inside it cannot be rebuilt without that rank). The other replicas go on without "
                    "it; resume the whole run from a checkpoint to train it again."
                ) from None
            raise Excluded(
                f"The other ranks went on without rank {self.first_rank} after step {decided['step']}: it did not join "
                f"their agreement in time (silent for more than {CONFIRM} s after a connection to it broke, or for "
                f"{self.silence:.0f} s). It stops here; its replica is not part of the run any more."
            ) from None  # the failure this rank saw first adds nothing: one traceback
        agreed = dict(
            generation=self.generation + 1,
            members=tuple(decided["members"]),
            survivors=tuple(self.members.index(m) for m in decided["members"] if m in self.members),
            lost=tuple(decided["lost"]),
            step=int(decided["step"]),
        )
        joined = tuple(decided.get("joined", ()))
        decision = Join(**agreed, joined=joined) if joined else Decision(**agreed)
        for member in joined:  # what this rank knew of its earlier process
            self._gone.discard(member)
            self._left.discard(member)
            self._addresses.pop(member, None)
            self._heard[member] = (b"", time.monotonic())  # heard from now on: its new heartbeat counts
        adopted = self.store.add(self.key("adopted", self.generation), 1)
        self.members = list(decision.members)
        self.generation = decision.generation
        self.decisions.append(decision)
        keep_out(self.store, self.left_out)  # at once, not at the next heartbeat: a lost rank started now sees it
        if len(self.members) // self.replica_size < self.min_workers:
            # the run ends here: let every survivor read the decision before any leaves (one may host the store, and
            # it leaves only once every survivor has read it: a store gone meanwhile means they all have)
            since = time.monotonic()
            while adopted < len(self.members) and time.monotonic() - since < self.silence:
                time.sleep(POLL)
                try:
                    adopted = self.store.add(self.key("adopted", decision.generation - 1), 0)
                except StoreLost:
                    break
            raise TooFewWorkers(
                f"Only {len(self.members) // self.replica_size} workers are left after step {decision.step} (ranks "
                f"{list(decision.members)} of the start; lost: {list(decision.lost)}), fewer than "
                f"min_workers={self.min_workers}: the run stops on every survivor. Lower min_workers to go on with "
                "fewer, or resume from the last checkpoint."
            ) from None  # the failure this rank saw first adds nothing: one traceback
        return decision

    def form_group(self, backend: str, timeout: timedelta) -> None:
        """Replace the default process group by the current members' (every member calls it together, after
        [`agree`][lightning_decentral.membership.Membership.agree]).

        Each member first says it is here (`here/g`) and waits for the others, looking out as
        [`poll`][lightning_decentral.membership.Membership.poll] does: a member that dies before it comes (its
        process gone, silent, or a failure announced for this generation) raises
        [`Abandoned`][lightning_decentral.failures.Abandoned] here, on every member, instead of a process group waiting
        `timeout` for it; the members then agree again. A failure while the group is made raises
        [`PeerFailure`][lightning_decentral.failures.PeerFailure]."""
        g = self.generation
        self.store.set(self.key("here", g, self.first_rank), "1")
        here = {m: self.key("here", g, m) for m in self.members}
        while not self.store.check(list(here.values())):
            reason = self.poll() or next(
                (
                    f"rank {m} left"
                    for m, key in here.items()
                    if self._silent_and_left(m) and not self.store.check([key])
                ),
                None,
            )
            if reason is not None:
                raise Abandoned(
                    f"Making the survivors' process group (generation {g}) was given up on rank {self.first_rank}: "
                    f"{reason}."
                )
            time.sleep(POLL)
        with peers_answer(f"Making the survivors' process group (generation {g})", "a survivor"):
            rebuild_world(self._connect(), self.key("world", g), self.rank, self.world_size, timeout, backend)
