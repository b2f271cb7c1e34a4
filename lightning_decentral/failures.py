"""What a rank raises when a peer fails: [`PeerFailure`][lightning_decentral.failures.PeerFailure], with the
backend's error as its cause. The collectives ([`agreement`][lightning_decentral.agreement]) and the gossip
exchange ([`gossip`][lightning_decentral.gossip]) both raise it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""The strategies' default `timeout`: how long a rank waits for a silent peer (a collective, an exchange, the
rendezvous) before it stops with an error naming it. Lightning's is 30 minutes, long enough to pass for a hang; ranks
that run different collectives stop at once ([`Activities`][lightning_decentral.agreement.Activities])."""


class PeerFailure(RuntimeError):
    """A collective or an exchange that could not complete on this rank: a peer died, stopped with an error, or did
    not answer within the process-group timeout. The message says what this rank was doing; the backend's error
    (gloo's `Connection closed by peer`, `Timed out waiting ...`) is its `__cause__`."""


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
