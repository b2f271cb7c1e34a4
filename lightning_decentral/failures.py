"""What a rank raises when a peer fails: [`PeerFailure`][lightning_decentral.failures.PeerFailure], with the
backend's error as its cause. The collectives ([`agreement`][lightning_decentral.agreement]) and the gossip
exchange ([`gossip`][lightning_decentral.gossip]) both raise it. With `on_peer_failure="continue"` an exchange is
waited for with [`wait_works`][lightning_decentral.failures.wait_works], which a failure announced elsewhere ends
([`Abandoned`][lightning_decentral.failures.Abandoned]), and handed to a [`Survival`][lightning_decentral.failures.Survival]."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Optional, Protocol

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""The strategies' default `timeout`: how long a rank waits for a silent peer (a collective, an exchange, the
rendezvous) before it stops with an error naming it. Lightning's is 30 minutes, long enough to pass for a hang; ranks
that run different collectives stop at once ([`Activities`][lightning_decentral.agreement.Activities])."""
POLL = 0.01  # seconds between two looks for a failure announced elsewhere, while an exchange is in flight


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
    """What a mixer asks when a peer may have failed, with `on_peer_failure="continue"` (the driver's
    [`Survivors`][lightning_decentral.driver.Survivors])."""

    def poll(self) -> Optional[str]:
        """Why the exchange in flight should be given up now (a member failed), or `None`."""

    def survive(self, step: int, failure: PeerFailure) -> None:
        """Agree with the other survivors on the members and one step (the mixer is rebound to them before the
        first step they mix again); raise if the run cannot go on."""

    def form(self) -> None:
        """Make the survivors' process group now, if they agreed and have not made it yet (the mixer is rebound)."""


class Disagreement(RuntimeError):
    """The ranks were about to run different collectives (a checkpoint load on one, an optimizer step on another):
    raised at once, naming what each rank does ([`Activities`][lightning_decentral.agreement.Activities])."""


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
        reason = poll()
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
