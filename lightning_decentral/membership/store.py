"""The job's key-value store, which the survivors of a failure agree through: reaching it, calls that cannot hang
([`GuardedStore`][lightning_decentral.membership.GuardedStore]), and where it lives
([`store_host`][lightning_decentral.membership.store_host]).

Every launcher of `torch.distributed` has one `TCPStore`, at `MASTER_ADDR:MASTER_PORT`: rank 0's process hosts it
(Lightning's own launcher, `mp.spawn`, SLURM's `srun`, a plain `init_process_group("env://")`), or torchrun's agent
does (`TORCHELASTIC_USE_AGENT_STORE=True`), or `lightning-decentral-launch` does (it marks the store with
`LAUNCHER_KEY`). Whoever hosts it is the one process whose death nothing survives.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

LAUNCHER_KEY = "lightning_decentral/launcher"  # set by lightning-decentral-launch in the store it hosts


class StoreLost(RuntimeError):
    """The job's store did not answer (its host died, hangs, or the network to it is gone): the survivors of a
    failure cannot agree without it, and the run stops."""


def store_client(timeout: timedelta) -> dist.TCPStore:
    """A new client of the job's store at `MASTER_ADDR:MASTER_PORT` (set by every launcher, or by Lightning before
    it makes the process group): the membership's own connection, outside any generation's namespace
    ([`rendezvous.job_store`][lightning_decentral.rendezvous.job_store] is the default group's), so that it is
    there, and can be reconnected, whatever becomes of the process groups."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise RuntimeError(
            "on_peer_failure='continue' agrees through the job's store at MASTER_ADDR:MASTER_PORT, but they are not set: "
            "start the run with a launcher (lightning-decentral-launch, torchrun, or Lightning's own)."
        )
    return dist.TCPStore(address, int(port), is_master=False, timeout=timeout)


def store_host(store: Any) -> tuple[bool, str]:
    """Whether the job's store outlives every worker, and who hosts it, in words.

    Examples:
        ```python
        store_host(store_client(timedelta(seconds=30)))
        # (False, "rank 0's process hosts the job's store (...)")
        ```
    """
    if store.check([LAUNCHER_KEY]):
        return True, f"lightning-decentral-launch hosts the job's store ({store.get(LAUNCHER_KEY).decode()}), outside the workers"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False, (
            "torchrun's agent on the first node hosts the job's store, but torchrun stops every worker of a node when "
            "one of them fails: launch with lightning-decentral-launch, or one process per worker (srun without "
            "--kill-on-bad-exit)"
        )
    return False, (
        "rank 0's process hosts the job's store (a launch by Lightning, mp.spawn, srun or a plain env:// process "
        "group): the survivors go on after any failure but rank 0's; to survive that too, launch with "
        "lightning-decentral-launch, which hosts the store outside the workers"
    )


class GuardedStore:
    """A client of the job's store whose calls raise [`StoreLost`][lightning_decentral.membership.StoreLost] when the
    store does not answer within `timeout` seconds, instead of hanging (a store host that is stopped, not dead,
    leaves a plain client waiting for ever).

    The calls run one at a time on a daemon thread; once one has timed out, every later call raises at once.

    Args:
        connect: makes the client (a new connection), run under the same watchdog.
        timeout: seconds a call may take.
        where: the store's address, for the error.
    """

    def __init__(self, connect: Callable[[], Any], timeout: float, where: str) -> None:
        self.timeout, self.where = timeout, where
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lost: Optional[str] = None
        threading.Thread(target=self._serve, daemon=True, name="lightning_decentral-store").start()
        self._store = self._call(connect)

    def _serve(self) -> None:
        while True:
            call, args, answer, done = self._requests.get()
            if call is None:
                return
            try:
                answer.append((True, call(*args)))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                answer.append((False, error))
            done.set()

    def _call(self, call: Callable[..., Any], *args: Any) -> Any:
        if self._lost is not None:
            raise StoreLost(self._lost)
        answer: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._requests.put((call, args, answer, done))
        if not done.wait(self.timeout):
            self._lost = (
                f"The job's store at {self.where} did not answer within {self.timeout:.0f} s (its host is stopped or "
                "unreachable). It is the one process a run cannot lose: the survivors cannot agree without it."
            )
            raise StoreLost(self._lost)
        ok, value = answer[0]
        if ok:
            return value
        if isinstance(value, (dist.DistError, RuntimeError)):
            self._lost = (
                f"The job's store at {self.where} is gone ({type(value).__name__}: {str(value).splitlines()[0]}): its "
                "host died. It is the one process a run cannot lose: the survivors cannot agree without it."
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

    def close(self) -> None:
        """Stop the call thread (one stuck in a call stays until the call returns: it is a daemon)."""
        self._requests.put((None, (), [], threading.Event()))
