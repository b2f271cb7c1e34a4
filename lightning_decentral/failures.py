"""What a rank raises when a peer fails: [`PeerFailure`][lightning_decentral.failures.PeerFailure], with the
backend's error as its cause. The collectives ([`agreement`][lightning_decentral.agreement]) and the gossip
exchange ([`gossip`][lightning_decentral.gossip]) both raise it. With `on_peer_failure="continue"` an exchange is
waited for with [`wait_works`][lightning_decentral.failures.wait_works], which a failure announced elsewhere ends
([`Abandoned`][lightning_decentral.failures.Abandoned]), and handed to a [`Survival`][lightning_decentral.failures.Survival];
every other collective goes through a [`Guard`][lightning_decentral.failures.Guard], which hands its failure to the
same survival and then runs it again among the survivors.
Ranks about to run different collectives find out at once through [`Activities`][lightning_decentral.failures.Activities]."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Optional, Protocol, TypeVar

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""The strategies' default `timeout`: how long a rank waits for a silent peer (a collective, an exchange, the
rendezvous) before it stops with an error naming it. Lightning's is 30 minutes, long enough to pass for a hang; ranks
that run different collectives stop at once ([`Activities`][lightning_decentral.failures.Activities])."""
POLL = 0.01  # seconds between two looks for a failure announced elsewhere, while an exchange is in flight
LATE = 1.0  # seconds the works may take to complete after a look failed (the store's host exits once its own did)


class PeerFailure(RuntimeError):
    """A collective or an exchange that could not complete on this rank: a peer died, stopped with an error, or did
    not answer within the process-group timeout. The message says what this rank was doing; the backend's error
    (gloo's `Connection closed by peer`, `Timed out waiting ...`) is its `__cause__`. `peers`: the ranks (of the
    process group's world) whose connection broke, when the backend says which."""

    peers: tuple[int, ...] = ()


class Abandoned(PeerFailure):
    """An exchange given up because a member of the run failed elsewhere (`on_peer_failure="continue"`): the
    survivors agree on who goes on."""


class Survival(Protocol):
    """What a mixer or a [`Guard`][lightning_decentral.failures.Guard] asks when a peer may have failed, with
    `on_peer_failure="continue"` (the driver's [`Survivors`][lightning_decentral.membership.Survivors])."""

    def poll(self) -> Optional[str]:
        """Why the exchange in flight should be given up now (a member failed), or `None`."""

    def survive(self, step: int, failure: PeerFailure) -> None:
        """Agree with the other survivors on the members and one step (the mixer is rebound to them before the
        first step they mix again); raise if the run cannot go on. Nothing once this rank is `alone`."""

    def form(self) -> None:
        """Make the survivors' process group now, if they agreed and have not made it yet (the mixer is rebound)."""

    @property
    def alone(self) -> bool:
        """Between the survivors' agreement and their process group: the default group is this rank's alone."""


Result = TypeVar("Result")


class Guard:
    """The one path every collective of a run goes through besides the gossip exchange (which discards a failed
    exchange instead): [`run`][lightning_decentral.failures.Guard.run] for a collective,
    [`operation`][lightning_decentral.failures.Guard.operation] for several that stand or fall together. Without a
    `survival` it only names a failure ([`peers_answer`][lightning_decentral.failures.peers_answer]).

    With `on_peer_failure="continue"`, the driver sets `survival` and keeps `step` (the optimizer step this rank is
    in, or begins next: what it joins the survivors' agreement with). A collective that fails then has the survivors agree
    (`survival.survive(step, failure)`) and runs again: on the survivors' default process group, which is this rank
    alone until they mix again. So its caller gets the collective's result among the ranks it can still reach: a
    metric reduced over this rank, `x̄` of this replica, a barrier passed. An operation (a checkpoint save) runs again
    as a whole, and its collectives leave their failure to it: a save starts again and finds it cannot save alone.
    Called on the training thread.

    Examples:
        Without a survival, a failure is named (and raised):

        >>> Guard().run("Lightning's reduce", lambda: 1 + 1)
        2
        >>> def dies():
        ...     raise RuntimeError("Connection closed by peer")
        >>> Guard().run("Lightning's reduce", dies)
        Traceback (most recent call last):
        ...
        lightning_decentral.failures.PeerFailure: Lightning's reduce failed on this rank: a peer died, ...
    """

    def __init__(self) -> None:
        self.survival: Optional[Survival] = None
        self.step = 0
        self._depth = 0  # operations running on this thread, one inside the other

    def run(self, what: str, collective: Callable[[], Result], peers: str = "a peer") -> Result:
        """`collective()`, whose backend error is a [`PeerFailure`][lightning_decentral.failures.PeerFailure]
        naming `what` and `peers`; an [`operation`][lightning_decentral.failures.Guard.operation] of its own."""

        def answered() -> Result:
            with peers_answer(what, peers):
                return collective()

        return self.operation(answered)

    def operation(self, body: Callable[[], Result]) -> Result:
        """`body()`; a [`PeerFailure`][lightning_decentral.failures.PeerFailure] it raises is raised on, unless this
        is the outermost operation and the survivors of the failure agree: then `body()` again (see the class
        docstring). Any other error is raised as it is."""
        while True:
            outermost = self._depth == 0
            self._depth += 1
            try:
                return body()
            except PeerFailure as failure:
                survival = self.survival
                if not outermost or survival is None or survival.alone:
                    raise  # the enclosing operation's; no survivors; or a group of a generation given up
                failed = failure
            finally:
                self._depth -= 1
            survival.survive(self.step, failed)

    def poll(self) -> Optional[str]:
        """Why a wait for the other ranks should end now: a member failed (see `Survival.poll`); `None` without one."""
        return self.survival.poll() if self.survival is not None else None

    @property
    def alone(self) -> bool:
        """Whether this rank is alone: the survivors of a failure agreed and have not made their group yet."""
        return self.survival is not None and self.survival.alone


class Disagreement(RuntimeError):
    """The ranks were about to run different collectives (a checkpoint load on one, an optimizer step on another):
    raised at once, naming what each rank does ([`Activities`][lightning_decentral.failures.Activities])."""


@contextlib.contextmanager
def peers_answer(what: str, peers: str = "a peer") -> Iterator[None]:
    """Raise the backend's error of a collective or exchange inside the block as a
    [`PeerFailure`][lightning_decentral.failures.PeerFailure] that names `what` this rank was doing and `peers`.

    Examples:
        >>> with peers_answer("The all-gather of step 3"):
        ...     raise RuntimeError("Connection closed by peer [127.0.0.1]:3736")
        Traceback (most recent call last):
        ...
        lightning_decentral.failures.PeerFailure: The all-gather of step 3 failed on this rank: a peer died, ...
    """
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as exc:  # gloo and NCCL (DistBackendError) raise this when a peer is gone or the timeout passed
        raise PeerFailure(
            f"{what} failed on this rank: {peers} died, stopped with an error, or did not answer within the "
            "process-group timeout (DecentralizedStrategy(timeout=...)). The first error in the other ranks' logs is "
            f"the cause. ({exc})"
        ) from exc


def from_its_value_now(tensor: Any, collective: Callable[[], Result]) -> Callable[[], Result]:
    """`collective`, which writes `tensor` in place (an all-reduce), made to start each try from `tensor`'s value now:
    a try that failed may have written part of it before a [`Guard`][lightning_decentral.failures.Guard] runs it again."""
    if not hasattr(tensor, "detach"):
        return collective
    value = tensor.detach().clone()
    tries = 0

    def each_try() -> Result:
        nonlocal tries
        if tries:
            tensor.detach().copy_(value)
        tries += 1
        return collective()

    return each_try


def wait_works(
    works: Sequence[Any],
    poll: Optional[Callable[[], Optional[str]]],
    what: str,
    peers: str = "a peer",
    ranks: Sequence[Optional[int]] = (),
) -> None:
    """Wait for every `torch.distributed` work of `works`; a failure raises [`PeerFailure`][lightning_decentral.failures.PeerFailure]
    (`what`, `peers` as for [`peers_answer`][lightning_decentral.failures.peers_answer]; `ranks[i]` is the peer of
    `works[i]`, if known).

    With `poll`, the works are waited for on a thread while this one asks `poll()` every `POLL` seconds (after the
    first `POLL`: a quick exchange costs no look), and a reason it returns raises [`Abandoned`][lightning_decentral.failures.Abandoned].
    The thread is needed on gloo: a receive from a dead peer never reports itself completed, and a wait with a
    timeout closes every connection of the group when it expires; only a plain `wait()` raises the peer's error.
    A look that raises (the store is gone) is raised only if the works are not complete `LATE` seconds later: the
    process hosting the store may exit as soon as its own part of the last barrier is done, before this one's.
    """
    if poll is None:
        with peers_answer(what, peers):
            for work in works:
                work.wait()
        return
    done = threading.Event()
    failed: list[tuple[int, BaseException]] = []

    def wait_all() -> None:
        try:
            for index, work in enumerate(works):
                try:
                    work.wait()
                except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                    failed.append((index, error))
                    return
        finally:
            done.set()

    threading.Thread(target=wait_all, daemon=True, name="lightning_decentral-wait").start()
    while not done.wait(POLL):
        try:
            reason = poll()
        except BaseException:
            if done.wait(LATE):
                break
            raise
        if reason is not None:
            raise Abandoned(f"{what} was given up on this rank: {reason}.")
    if failed:
        index, error = failed[0]
        try:
            with peers_answer(what, peers):
                raise error
        except PeerFailure as failure:
            if index < len(ranks) and ranks[index] is not None:
                failure.peers = (int(ranks[index]),)
            raise


class Activities:
    """What each rank is doing, published out of band in the process group's key-value store, so that ranks about to
    run different collectives find out at once instead of waiting for each other until the timeout.

    Every rank publishes the same sequence of activities when it runs the same program: `start(what)` when it begins
    something that needs no agreement (an optimizer step), `agree(what)` before a collective every rank must enter
    together (a checkpoint save or load, `x̄`). `agree` waits until every rank has published the same activity as its
    activity number `c`; a rank whose activity `c` is another, or that is past `c` without having passed this
    agreement, is doing something else: every rank that waits raises
    [`Disagreement`][lightning_decentral.failures.Disagreement] naming what each does. A rank that passed it (it saw
    every rank at `c`) says so under a key of its own, so a slower rank still waiting lets it be past `c`: it may have
    gone on when no collective follows the agreement, an error raised before the collective, say. A rank
    that publishes nothing new (it is busy, or blocked in a collective it started earlier) is named after `timeout`
    seconds with its last activity ([`PeerFailure`][lightning_decentral.failures.PeerFailure]); after `warn_after`
    seconds `warn` says who it waits for. With a `guard`, the wait is one of its operations: a member failed
    (`guard.poll()`) ends it at once, the survivors agree, and a rank alone agrees with nobody.

    Examples:
        Two ranks in one process, over an in-memory store: rank 1 loads while rank 0 trains.

        >>> store = dist.HashStore()
        >>> ranks = [Activities(store, rank, 2, timeout=1.0) for rank in range(2)]
        >>> ranks[0].start("optimizer step 0")
        >>> ranks[1].agree("fabric.load('last.ckpt')")
        Traceback (most recent call last):
        ...
        lightning_decentral.failures.Disagreement: The ranks are not doing the same thing: rank 1 is in fabric.load('last.ckpt') while rank 0 is in optimizer step 0. ...
    """

    def __init__(
        self,
        store: Optional[dist.Store],
        rank: int,
        world_size: int,
        timeout: float,
        warn_after: float = 30.0,
        warn: Callable[[str], None] = lambda message: warnings.warn(message, stacklevel=3),
        guard: Optional[Guard] = None,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.warn_after, self.warn = warn_after, warn
        self.guard = guard if guard is not None else Guard()
        self.count = 0  # activities this rank has published
        self.current = ""

    @classmethod
    def of_group(cls, ranks: Any, timeout: Optional[timedelta]) -> Activities:
        """Activities of the ranks of the default process group (`ranks`, a [`Ranks`][lightning_decentral.agreement.Ranks],
        whose guard they share), under keys of their own (one all-gather agrees on them); published nowhere without a
        process group, or with a store torch does not expose."""
        seconds = (timeout or timedelta(minutes=30)).total_seconds()
        if not dist.is_initialized() or ranks.world_size == 1:
            return cls(None, ranks.rank, ranks.world_size, seconds, guard=ranks.guard)
        tag = int(ranks.gather([secrets.randbits(62)], "Agreeing on where the ranks publish their activities")[0, 0])
        store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()  # torch has no public accessor
        prefixed = dist.PrefixStore(f"lightning_decentral/activities/{tag}/", store) if store is not None else None
        return cls(prefixed, ranks.rank, ranks.world_size, seconds, guard=ranks.guard)

    def start(self, what: str) -> None:
        """This rank begins `what` (its activity number `count + 1`), which needs no agreement."""
        self.count += 1
        self.current = what
        if self.store is not None:
            self.store.set(str(self.rank), f"{self.count}|{what}")

    def agree(self, what: str) -> None:
        """Begin `what`, a collective, once every rank has begun it as the same activity (see the class docstring).

        Call it right before the collective's first exchange, and begin or agree on nothing else until then: a rank
        that passed may publish its next activity only once every rank has passed (entered that collective)."""
        self.start(what)
        self.guard.operation(lambda: self._wait_for_every_rank(what))

    def _wait_for_every_rank(self, what: str) -> None:
        if self.store is None or self.guard.alone:
            return
        started = time.monotonic()
        pause, warned = 0.005, False
        while True:
            reason = self.guard.poll()
            if reason is not None:
                raise Abandoned(f"{what} was given up on rank {self.rank}: {reason}.")
            with peers_answer(f"{what}, reading what the other ranks do,"):
                seen = self._published()
            ahead = [r for r, (c, _) in seen.items() if c > self.count]
            if ahead and any(self._passed(r) == self.count for r in ahead):
                return self._pass()  # a rank passed this agreement: every rank had begun it
            elsewhere = {r: w for r, (c, w) in seen.items() if c > self.count or (c == self.count and w != what)}
            if elsewhere:
                raise Disagreement(
                    f"The ranks are not doing the same thing: rank {self.rank} is in {what} while "
                    + ", ".join(f"rank {r} is in {w}" for r, w in sorted(elsewhere.items()))
                    + ". It is a collective every rank must run at the same point: call it on every rank (not under "
                    "`if global_rank == 0`), with the same arguments."
                )
            behind = {r: w for r, (c, w) in seen.items() if c < self.count}
            if not behind:
                return self._pass()
            waited = time.monotonic() - started
            named = ", ".join(f"rank {r} ({w or 'nothing yet'})" for r, w in sorted(behind.items()))
            if waited > self.timeout:
                raise PeerFailure(
                    f"{what} waited {waited:.1f} s (the timeout) on rank {self.rank} for {named} to begin it: those "
                    "ranks are still busy, blocked in something else, or gone."
                )
            if waited > self.warn_after and not warned:
                warned = True
                self.warn(f"Rank {self.rank} has waited {waited:.1f} s in {what} for {named}; it gives up after {self.timeout:.1f} s.")
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _pass(self) -> None:
        """This rank saw every rank begin its activity `count`: say so before it goes on (see `agree`)."""
        assert self.store is not None
        with peers_answer(f"{self.current}, saying it agreed,"):
            self.store.set(f"{self.rank}/passed", str(self.count))

    def _passed(self, rank: int) -> int:
        """The activity number of the last agreement `rank` passed (0: none)."""
        assert self.store is not None
        key = f"{rank}/passed"
        with peers_answer(f"{self.current}, reading what the other ranks agreed,"):
            return int(self.store.get(key)) if self.store.check([key]) else 0

    def _published(self) -> dict[int, tuple[int, str]]:
        """Every other rank's last activity: `rank -> (number, what)` (`(0, "")` before its first)."""
        assert self.store is not None
        seen = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                key = str(rank)
                number, _, what = self.store.get(key).decode().partition("|") if self.store.check([key]) else ("0", "", "")
                seen[rank] = (int(number), what)
        return seen
