"""This job's store: where the ranks meet, with a namespace of its own for every generation of workers.

A process group is made on a key-value store (`torch.distributed.TCPStore`): each rank writes its
address under a key and reads its peers'. Under torchrun the store is hosted by torchrun's agent and
outlives the workers; without it, rank 0 hosts it. When torchrun restarts the workers after a failure
(`--max-restarts`), the new workers meet on the *same* store, and torch names the keys the same in
every generation (gloo's `<group>/cpu//0/<rank>`, NCCL's unique id): a relaunched rank can read a
dead worker's address before its live peer has rewritten it, and fails (`Gloo connectFullMesh failed
... Connection refused`) or waits for the timeout.

So the default process group is made on `PrefixStore("lightning_decentral/<generation>", store)`, where
`<generation>` is a token new for every generation and the same on every rank of it:
[`agree_generation`][lightning_decentral.rendezvous.agree_generation]. torchrun's own count of restarts
(`TORCHELASTIC_RESTART_COUNT`) would not do: each agent counts only the failures of its own workers,
so the nodes of one job can disagree on it.

Other code that needs to meet the other ranks outside the process group (announce a failure, watch for
stragglers) calls [`job_store`][lightning_decentral.rendezvous.job_store] and keeps its keys under a
prefix of its own: everything under it is this generation's.

A run whose survivors went on without a lost rank (`on_peer_failure="continue"`) marks that rank
([`keep_out`][lightning_decentral.rendezvous.keep_out]): a process started again as it stops at once with
[`LeftOut`][lightning_decentral.rendezvous.LeftOut] instead of waiting the timeout for a generation that will not
come.

Calls to the job's store that cannot hang: [`GuardedStore`][lightning_decentral.rendezvous.GuardedStore] raises
[`StoreLost`][lightning_decentral.rendezvous.StoreLost] when the store does not answer within the timeout or is gone.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_decentral._compat import default_store

NAMESPACE = "lightning_decentral"
HANDSHAKE = f"{NAMESPACE}/handshake"  # agree_generation's keys, the same for every generation
_POLL_SECONDS = 0.01
KEPT_OUT_LOOK = 0.5  # seconds a rank watches its keep_out mark (the survivors move it every heartbeat, 0.1 s)
_current: dist.Store | None = None  # the store connect() made last in this process
_token: str | None = None  # its generation's token


class LeftOut(RuntimeError):
    """This rank is one that a run still in progress lost and went on without (`on_peer_failure="continue"`): a
    process started again as it cannot rejoin that run."""


def connect(address: str, port: int, rank: int, world_size: int, timeout: timedelta | None = None) -> dist.Store:
    """The store to make the default process group on, `init_process_group(..., store=connect(...))`: the
    store `env://` would use, under a namespace new for this generation of workers.

    The store is torchrun's agent's when torchrun exports it (`TORCHELASTIC_USE_AGENT_STORE=True` with
    `MASTER_ADDR:MASTER_PORT` equal to `address:port`); else rank 0 hosts one at `address:port` and the others
    connect to it, as `env://` does. Every rank must call it together; it waits at most `timeout` (default: torch's
    30 minutes) for the others. [`job_store`][lightning_decentral.rendezvous.job_store] returns it afterwards.
    """
    global _current, _token
    timeout = default_pg_timeout if timeout is None else timeout
    if _agent_serves(address, port):
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    else:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    _token = agree_generation(store, rank, world_size, timeout)
    _current = dist.PrefixStore(f"{NAMESPACE}/{_token}", store)
    return _current


def job_token() -> str | None:
    """The token of the generation [`connect`][lightning_decentral.rendezvous.connect] joined last in this process
    (`None` before): what a lost rank started again needs to find the same
    [`job_store`][lightning_decentral.rendezvous.job_store]."""
    return _token


def rejoin_store(store: dist.Store, token: str) -> dist.Store:
    """A lost rank started again: from now on [`job_store`][lightning_decentral.rendezvous.job_store] is the
    namespace of the generation `token` names (the members', who published it), on `store`."""
    global _current, _token
    _token = token
    _current = dist.PrefixStore(f"{NAMESPACE}/{token}", store)
    return _current


def job_store() -> dist.Store:
    """The store this generation of the job's workers made its default process group on
    ([`connect`][lightning_decentral.rendezvous.connect]): every rank of the generation sees the same keys, no
    other generation does. Put your keys under a prefix of your own (`PrefixStore("my_feature", job_store())`).
    A default group made by other code (`init_process_group` called before the strategy) gives its own store.

    Under torchrun the agent hosts it, so it outlives any worker; under another launcher rank 0 hosts it, and it
    is gone when rank 0 is.
    """
    if _current is not None:
        return _current
    if dist.is_initialized():
        return default_store()
    raise RuntimeError(
        "This process has no job store: no default process group yet. The strategies make it when the Trainer or "
        "Fabric launches; elsewhere call lightning_decentral.rendezvous.connect(...) and pass its store to "
        "init_process_group(store=...)."
    )


def agree_generation(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A token new for this generation of workers, the same on every rank: rank 0's `uuid4`.

    Rank `r > 0` writes a nonce of its own to `hello/<r>` and waits for `ack/<nonce>`: only the live rank 0 can
    write that key, since the nonce is new, so no rank takes up an earlier generation's token. Rank 0 acks every
    nonce it finds under `hello/*` (a dead worker's too: harmless, the live one overwrites it) until `world_size - 1`
    ranks have joined under its token. Plain `set`/`get`/`add`/`wait`: any c10d store will do.

    Examples:
        >>> store = dist.HashStore()
        >>> len(agree_generation(store, rank=0, world_size=1, timeout=timedelta(seconds=1)))
        32
    """
    if world_size == 1:
        return uuid.uuid4().hex
    base = dist.PrefixStore(HANDSHAKE, store)
    over = _refuse_if_kept_out(base, rank)
    if rank == 0:
        return _hand_out_token(base, world_size, timeout)
    nonce = uuid.uuid4().hex
    base.set(f"hello/{rank}", nonce)
    why = (
        f" (rank {rank} was lost by an earlier run on this store, which is over: start every rank again)"
        if over
        else ""
    )
    _wait(base, [f"ack/{nonce}"], timeout, f"rank {rank} waited for rank 0 to answer{why}")
    token = base.get(f"ack/{nonce}").decode()
    base.delete_key(f"ack/{nonce}")
    base.add(f"joined/{token}", 1)
    return token


def keep_out(store: dist.Store, ranks: Iterable[int]) -> None:
    """Mark `ranks` (ranks at the start of the run) as lost by a run that goes on without them; the run's survivors
    call it at every heartbeat. A process started again as one of them finds the mark moving in
    [`agree_generation`][lightning_decentral.rendezvous.agree_generation] and raises `LeftOut` at once, instead of
    waiting the timeout for ranks that will not come; a mark that no longer moves (that run is over) stops nobody.

    Examples:
        >>> store = dist.HashStore()
        >>> keep_out(store, [2])
        >>> store.check([f"{HANDSHAKE}/left_out/2"])
        True
    """
    for rank in ranks:
        store.add(f"{HANDSHAKE}/left_out/{rank}", 1)


def _refuse_if_kept_out(base: dist.Store, rank: int) -> bool:
    """Raise `LeftOut` if a run in progress keeps `rank` out: its `keep_out` mark moves within `KEPT_OUT_LOOK` s.
    Whether an earlier run on this store, now over, had left `rank` out (its mark stands still)."""
    key = f"left_out/{rank}"
    if not base.check([key]):
        return False
    first = base.get(key)
    time.sleep(KEPT_OUT_LOOK)
    if base.get(key) != first:
        raise LeftOut(
            f"Rank {rank} was lost by a run that goes on without it (on_peer_failure='continue': its survivors are "
            "training): a lost rank cannot rejoin a run in progress. Let the survivors finish (their checkpoints "
            "resume on as many processes), or stop them and start the whole job again from its newest checkpoint, "
            "every rank together."
        )
    return True


def _hand_out_token(base: dist.Store, world_size: int, timeout: timedelta) -> str:
    """Rank 0's side of `agree_generation`: ack every rank's latest nonce with a fresh token."""
    token = uuid.uuid4().hex
    hellos = [f"hello/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    _wait(base, hellos, timeout, "rank 0 waited for the other ranks to start")
    acked: dict[str, bytes] = {}
    while base.add(f"joined/{token}", 0) < world_size - 1:
        answers = {key: nonce for key, nonce in zip(hellos, base.multi_get(hellos)) if acked.get(key) != nonce}
        if answers:
            base.multi_set([f"ack/{nonce.decode()}" for nonce in answers.values()], [token] * len(answers))
            acked.update(answers)
        elif time.monotonic() > deadline:
            raise TimeoutError(_timed_out("rank 0 waited for the other ranks to join this generation", timeout))
        else:
            time.sleep(_POLL_SECONDS)
    return token


def _wait(store: dist.Store, keys: list[str], timeout: timedelta, what: str) -> None:
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError as exc:
        raise TimeoutError(_timed_out(what, timeout)) from exc


def _timed_out(what: str, timeout: timedelta) -> str:
    return (
        f"Making the process group: {what} for longer than the timeout ({timeout}). A rank did not start, or started "
        "more than the timeout after the others: start every rank, or raise the strategy's `timeout`."
    )


def _agent_serves(address: str, port: int) -> bool:
    """Whether torchrun's agent hosts the store at `address:port` (as `torch.distributed` decides it)."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == address
        and os.environ.get("MASTER_PORT") == str(port)
    )


class StoreLost(RuntimeError):
    """The job's store did not answer within the timeout (its host is stopped or unreachable) or is gone (its host
    died): ranks that agree through it (the survivors of a failure, a stop at one step, what each rank does) cannot,
    and the run stops."""


class GuardedStore:
    """A client of the job's store whose calls raise [`StoreLost`][lightning_decentral.rendezvous.StoreLost] when the
    store does not answer within `timeout` seconds or is gone, instead of hanging (a store host that is stopped, not
    dead, leaves a plain client waiting for ever) or raising torch's error (`DistNetworkError: Connection reset by
    peer`). Every call to the job's store on a per-step path runs through one (`Activities`, the stop agreement, the
    survivors' membership).

    The calls run one at a time on a daemon thread; once one has timed out, every later call raises at once. The
    thread ends with [`close`][lightning_decentral.rendezvous.GuardedStore.close], or when the object is garbage.

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
        self.timeout = timeout
        self.where = where
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
