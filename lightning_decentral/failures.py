"""What a rank raises when a peer fails, and the waits a failure ends:
[`PeerFailure`][lightning_decentral.failures.PeerFailure] (the backend's error as its cause), raised by the collectives
([`agreement`][lightning_decentral.agreement]) and the
gossip exchange ([`gossip`][lightning_decentral.gossip]) alike. With `on_peer_failure="continue"` an exchange is waited
for with [`wait_works`][lightning_decentral.failures.wait_works], which a failure announced elsewhere ends
([`Abandoned`][lightning_decentral.failures.Abandoned]), and handed to the run's
[`Survival`][lightning_decentral.failures.Survival]."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from lightning_decentral.rendezvous import StoreLost

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
    """What a mixer, a [`Guard`][lightning_decentral.membership.guard.Guard] and the driver ask when a peer may have
    failed, with `on_peer_failure="continue"` (the one implementation:
    [`Survivors`][lightning_decentral.membership.Survivors]). A mixer asks `poll`, `survive` and `form`; the guard also
    `alone`; the driver `begin`, at every step."""

    def poll(self) -> str | None:
        """Why the exchange in flight should be given up now (a member failed), or `None`."""

    def survive(self, step: int, failure: PeerFailure) -> None:
        """Agree with the other survivors on the members and one step (the mixer is rebound to them before the
        first step they mix again); raise if the run cannot go on."""

    def form(self) -> None:
        """Make the survivors' process group now, if they agreed and have not made it yet (the mixer is rebound)."""

    @property
    def alone(self) -> bool:
        """Between the survivors' agreement and their process group: the default group is this rank's alone."""

    def begin(self, step: int) -> None:
        """Before step `step`: make the survivors' group if they mix again from this step on."""


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
