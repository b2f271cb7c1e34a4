"""What a rank raises when a peer fails: [`PeerFailure`][lightning_decentral.failures.PeerFailure], with the
backend's error as its cause. The collectives ([`agreement`][lightning_decentral.agreement]) and the gossip
exchange ([`gossip`][lightning_decentral.gossip]) both raise it. With `on_peer_failure="continue"` an exchange is
waited for with [`wait_works`][lightning_decentral.failures.wait_works], which a failure announced elsewhere ends
([`Abandoned`][lightning_decentral.failures.Abandoned]), and handed to a
[`Survival`][lightning_decentral.failures.Survival]. Ranks about to run different collectives find out at once through
[`Activities`][lightning_decentral.failures.Activities]. Calls to the job's store that cannot hang:
[`GuardedStore`][lightning_decentral.failures.GuardedStore]."""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_decentral._compat import default_store

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""The strategies' default `timeout`: how long a rank waits for a silent peer (a collective, an exchange, the
rendezvous) before it stops with an error naming it. Lightning's is 30 minutes, long enough to pass for a hang; ranks
that run different collectives stop at once ([`Activities`][lightning_decentral.failures.Activities])."""


def checked_timeout(timeout: Any) -> timedelta:
    """The strategies' `timeout` argument, checked when they are built (the Trainer's and Fabric's
    `DecentralizedStrategy` call it): a positive `datetime.timedelta`. A bare number is refused rather than taken as
    seconds, as Lightning's and torch's `timeout` are (a `timedelta` says its unit); `None` is torch's default, 30
    minutes. Without the check, a zero, negative or numeric timeout fails only when the ranks meet, with torch's
    error.

    Examples:
        >>> checked_timeout(timedelta(seconds=30)), checked_timeout(None)
        (datetime.timedelta(seconds=30), datetime.timedelta(seconds=1800))
        >>> checked_timeout(30)
        Traceback (most recent call last):
        ...
        TypeError: timeout=30 is a number: pass a datetime.timedelta, e.g. timeout=timedelta(seconds=30) ...
        >>> checked_timeout(timedelta(0))
        Traceback (most recent call last):
        ...
        ValueError: timeout=timedelta(0) is not positive: ...
    """
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        raise TypeError(
            f"timeout={timeout!r} is a number: pass a datetime.timedelta, e.g. timeout=timedelta(seconds={timeout!r}) "
            "(how long a rank waits for a silent peer; a number is refused, its unit would be a guess)."
        )
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=5), got {type(timeout).__name__} "
            f"{timeout!r}."
        )
    if timeout <= timedelta(0):
        shown = "timedelta(0)" if not timeout else f"timedelta(seconds={timeout.total_seconds():g})"
        raise ValueError(
            f"timeout={shown} is not positive: it is how long a rank waits for a silent peer before it stops with an "
            f"error; pass a positive datetime.timedelta (the default is {DEFAULT_TIMEOUT})."
        )
    return timeout


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
    """What a mixer or a [`Guard`][lightning_decentral.membership.guard.Guard] asks when a peer may have failed, with
    `on_peer_failure="continue"` (the driver's [`Survivors`][lightning_decentral.membership.Survivors])."""

    def poll(self) -> str | None:
        """Why the exchange in flight should be given up now (a member failed), or `None`."""

    def survive(self, step: int, failure: PeerFailure) -> None:
        """Agree with the other survivors on the members and one step (the mixer is rebound to them before the
        first step they mix again); raise if the run cannot go on."""

    def form(self) -> None:
        """Make the survivors' process group now, if they agreed and have not made it yet (the mixer is rebound)."""


class Disagreement(RuntimeError):
    """The ranks were about to run different collectives (a checkpoint load on one, an optimizer step on another):
    raised at once, naming what each rank does ([`Activities`][lightning_decentral.failures.Activities])."""


class StoreLost(RuntimeError):
    """The job's store did not answer within the timeout (its host is stopped or unreachable) or is gone (its host
    died): ranks that agree through it (the survivors of a failure, a stop at one step, what each rank does) cannot,
    and the run stops."""


class GuardedStore:
    """A client of the job's store whose calls raise [`StoreLost`][lightning_decentral.failures.StoreLost] when the
    store does not answer within `timeout` seconds or is gone, instead of hanging (a store host that is stopped, not
    dead, leaves a plain client waiting for ever) or raising torch's error (`DistNetworkError: Connection reset by
    peer`). Every call to the job's store on a per-step path runs through one (`Activities`, the stop agreement, the
    survivors' membership).

    The calls run one at a time on a daemon thread; once one has timed out, every later call raises at once. The
    thread ends with [`close`][lightning_decentral.failures.GuardedStore.close], or when the object is garbage.

    Args:
        connect: makes the client (a new connection), run under the same watchdog.
        timeout: seconds a call may take.
        where: the store's address, for the error.

    Examples:
        >>> store = GuardedStore.around(dist.HashStore(), timedelta(seconds=5))
        >>> store.set("k", "v"), store.check(["k"]), store.get("k")
        (None, True, b'v')
    """

    def __init__(self, connect: Callable[[], Any], timeout: float, where: str) -> None:
        self.timeout, self.where = timeout, where
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lost: str | None = None
        threading.Thread(target=_serve, args=(self._requests,), daemon=True, name="lightning_decentral-store").start()
        weakref.finalize(self, self._requests.put, None)  # the thread ends when nobody can call any more
        self._store = self._call(connect)

    @classmethod
    def around(cls, store: Any, timeout: timedelta) -> GuardedStore:
        """`store`, a client of the job's store this process already has (the default group's), under the watchdog."""
        where = (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            if "MASTER_PORT" in os.environ
            else "(in process)"
        )
        return cls(lambda: store, timeout.total_seconds(), where)

    def _call(self, call: Callable[..., Any], *args: Any) -> Any:
        if self._lost is not None:
            raise StoreLost(self._lost)
        answer: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._requests.put((call, args, answer, done))
        if not done.wait(self.timeout):
            self._lost = (
                f"The job's store at {self.where} did not answer within {self.timeout:.0f} s (its host is stopped or "
                "unreachable). It is the one process a run cannot lose: the ranks cannot agree without it."
            )
            raise StoreLost(self._lost)
        ok, value = answer[0]
        if ok:
            return value
        if isinstance(value, (dist.DistError, RuntimeError)):
            self._lost = (
                f"The job's store at {self.where} is gone ({type(value).__name__}: {str(value).splitlines()[0]}): its "
                "host died. It is the one process a run cannot lose: the ranks cannot agree without it."
            )
            raise StoreLost(self._lost) from value
        raise value

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (never blocks on a missing key)."""
        return self._call(self._store.check, keys)

    def get(self, key: str) -> bytes:
        """The value of `key`, which must exist."""
        return self._call(self._store.get, key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of `keys`, which must exist."""
        return self._call(self._store.multi_get, keys)

    def set(self, key: str, value: str) -> None:
        """Set `key`."""
        self._call(self._store.set, key, value)

    def add(self, key: str, amount: int) -> int:
        """Add to the counter `key` (0 reads it) and return its value."""
        return self._call(self._store.add, key, amount)

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        """Set `key` to `value` if it holds `expected` (`""`: if it does not exist); the value it holds after."""
        return self._call(self._store.compare_set, key, expected, value)

    def delete_key(self, key: str) -> bool:
        """Remove `key`; whether it existed."""
        return self._call(self._store.delete_key, key)

    def close(self) -> None:
        """Stop the call thread (one stuck in a call stays until the call returns: it is a daemon)."""
        self._requests.put(None)


def _serve(requests: queue.SimpleQueue) -> None:
    """A `GuardedStore`'s thread: run each call put in `requests` until `None` comes (it holds nothing else, so the
    store object can be collected)."""
    while True:
        request = requests.get()
        if request is None:
            return
        call, args, answer, done = request
        try:
            answer.append((True, call(*args)))
        except BaseException as error:
            answer.append((False, error))
        done.set()


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
    except (PeerFailure, StoreLost):
        raise
    except RuntimeError as exc:  # gloo and NCCL (DistBackendError) raise this when a peer is gone or the timeout passed
        raise PeerFailure(
            f"{what} failed on this rank: {peers} died, stopped with an error, or did not answer within the "
            "process-group timeout (DecentralizedStrategy(timeout=...)). The first error in the other ranks' logs is "
            f"the cause. ({exc})"
        ) from _without_frames(exc)


def _without_frames(error: BaseException) -> BaseException:
    """`error` and the errors under it (`__cause__`) without their frames (where in this package's waits they were
    raised, which says nothing): a `PeerFailure` prints its own traceback, then each cause in one line."""
    cause: BaseException | None = error
    while cause is not None:
        cause.__traceback__ = None
        cause = cause.__cause__
    return error


def wait_works(
    works: Sequence[Any],
    poll: Callable[[], str | None] | None,
    what: str,
    peers: str = "a peer",
    ranks: Sequence[int | None] = (),
) -> None:
    """Wait for every `torch.distributed` work of `works`; a failure raises
    [`PeerFailure`][lightning_decentral.failures.PeerFailure] (`what`, `peers` as for
    [`peers_answer`][lightning_decentral.failures.peers_answer]; `ranks[i]` is the peer of `works[i]`, if known).

    With `poll`, the works are waited for on a thread while this one asks `poll()` every `POLL` seconds (after the
    first `POLL`: a quick exchange costs no look), and a reason it returns raises
    [`Abandoned`][lightning_decentral.failures.Abandoned]. The thread is needed on gloo: a receive from a dead peer
    never reports itself completed, and a wait with a timeout closes every connection of the group when it expires; only
    a plain `wait()` raises the peer's error. A look that raises (the store is gone) is raised only if the works are not
    complete `LATE` seconds later: the process hosting the store may exit as soon as its own part of the last barrier is
    done, before this one's.
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
                except BaseException as error:
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
    seconds `warn` says who it waits for. Its calls to the store run under a
    [`GuardedStore`][lightning_decentral.failures.GuardedStore] of the same timeout (`start` runs at every step). With
    a [`Guard`][lightning_decentral.membership.guard.Guard], the wait is one of its operations, ended by a failure it
    polls; a rank alone agrees with nobody.

    Examples:
        Two ranks in one process, over an in-memory store: rank 1 loads while rank 0 trains.

        >>> store = dist.HashStore()
        >>> ranks = [Activities(store, rank, 2, timeout=1.0) for rank in range(2)]
        >>> ranks[0].start("optimizer step 0")
        >>> ranks[1].agree("fabric.load('last.ckpt')")
        Traceback (most recent call last):
        ...
        lightning_decentral.failures.Disagreement: The ranks are not doing the same thing: rank 1 is in
        fabric.load('last.ckpt') while rank 0 is in optimizer step 0. ...
    """

    def __init__(
        self,
        store: dist.Store | None,
        rank: int,
        world_size: int,
        timeout: float,
        warn_after: float = 30.0,
        warn: Callable[[str], None] = lambda message: warnings.warn(message, stacklevel=3),
        guard: Any = None,
    ) -> None:
        self.store = None if store is None else GuardedStore.around(store, timedelta(seconds=timeout))
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.warn_after, self.warn = warn_after, warn
        self.guard = guard
        self.count = 0  # activities this rank has published
        self.current = ""

    @classmethod
    def of_group(cls, ranks: Any, timeout: timedelta | None) -> Activities:
        """Activities of the ranks of the default process group (`ranks`, a
        [`Ranks`][lightning_decentral.agreement.Ranks], whose guard they share), under keys of their own (one all-gather
        agrees on them) of the default group's store; published nowhere without a process group, or with one rank."""
        seconds = (timeout or timedelta(minutes=30)).total_seconds()
        if not dist.is_initialized() or ranks.world_size == 1:
            return cls(None, ranks.rank, ranks.world_size, seconds, guard=ranks.guard)
        tag = int(ranks.gather([secrets.randbits(62)], "Agreeing on where the ranks publish their activities")[0, 0])
        prefixed = dist.PrefixStore(f"lightning_decentral/activities/{tag}/", default_store())
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
        if self.guard is None:
            return self._wait_for_every_rank(what)
        self.guard.operation(lambda: self._wait_for_every_rank(what))

    def _wait_for_every_rank(self, what: str) -> None:
        if self.store is None or (self.guard is not None and self.guard.alone):
            return
        started = time.monotonic()
        pause, warned = 0.005, False
        while True:
            reason = self.guard.poll() if self.guard is not None else None
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
                self.warn(
                    f"Rank {self.rank} has waited {waited:.1f} s in {what} for {named}; it gives up after "
                    f"{self.timeout:.1f} s."
                )
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
                number, _, what = (
                    self.store.get(key).decode().partition("|") if self.store.check([key]) else ("0", "", "")
                )
                seen[rank] = (int(number), what)
        return seen
