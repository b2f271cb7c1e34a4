"""[`Guard`][lightning_decentral.membership.guard.Guard]: the one path every collective of a run on processes goes
through besides the gossip exchange, so that with `on_peer_failure="continue"` a failure anywhere (a save's
agreements, Lightning's reduce, `x̄`, what each rank does) is handed to the survivors and the collective completes
among them; a new collective written with [`Ranks`][lightning_decentral.agreement.Ranks] or `guard.run` cannot forget
it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lightning_decentral.failures import PeerFailure, Survival, peers_answer

Result = TypeVar("Result")


class Guard:
    """The one path every collective of a run goes through besides the gossip exchange (which discards a failed
    exchange instead): [`run`][lightning_decentral.membership.guard.Guard.run] for a collective,
    [`operation`][lightning_decentral.membership.guard.Guard.operation] for several that stand or fall together.
    Without a `survival` it only names a failure ([`peers_answer`][lightning_decentral.failures.peers_answer]).

    With `on_peer_failure="continue"`, the driver sets `survival` and keeps `step` (the optimizer step this rank is
    in, or begins next: what it joins the survivors' agreement with). A collective that fails then has the survivors
    agree (`survival.survive(step, failure)`) and runs again: on the survivors' default process group, which is this
    rank alone until they mix again. So its caller gets the collective's result among the ranks it can still reach: a
    metric reduced over this rank, `x̄` of this replica, a barrier passed. An operation (a checkpoint save) runs again
    as a whole, and its collectives leave their failure to it: a save starts again, among the survivors.
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
        self.survival: Survival | None = None
        self.step = 0
        self._depth = 0  # operations running on this thread, one inside the other

    def run(self, what: str, collective: Callable[[], Result], peers: str = "a peer") -> Result:
        """`collective()`, whose backend error is a [`PeerFailure`][lightning_decentral.failures.PeerFailure]
        naming `what` and `peers`; an [`operation`][lightning_decentral.membership.guard.Guard.operation] of its own."""

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

    def poll(self) -> str | None:
        """Why a wait for the other ranks should end now: a member failed (see `Survival.poll`); `None` without one."""
        return self.survival.poll() if self.survival is not None else None

    @property
    def alone(self) -> bool:
        """Whether this rank is alone: the survivors of a failure agreed and have not made their group yet."""
        return self.survival is not None and self.survival.alone


def from_its_value_now(tensor: Any, collective: Callable[[], Result]) -> Callable[[], Result]:
    """`collective`, which writes `tensor` in place (an all-reduce), made to start each try from `tensor`'s value now:
    a try that failed may have written part of it before a [`Guard`][lightning_decentral.membership.guard.Guard]
    runs it again."""
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
