"""The job's store: every generation of workers agrees on a namespace of its own and never sees an earlier one's keys.
(The torchrun restart itself: tests/test_restart.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_decentral import rendezvous
from tests.helpers import free_port

TIMEOUT = timedelta(seconds=20)


def _on_threads(world_size: int, fn: Callable[[int], Any], late: dict[int, float] | None = None) -> list[Any]:
    """`fn(rank)` for every rank, each on its own thread (rank `r` starting `late[r]` seconds after the others)."""
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        time.sleep((late or {}).get(rank, 0.0))
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported to the test below
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return results


def test_every_generation_agrees_on_a_token_of_its_own() -> None:
    store = dist.HashStore()
    first = _on_threads(4, lambda rank: rendezvous.agree_generation(store, rank, 4, TIMEOUT))
    # the next generation meets the first one's keys in the store (hello/<r> and the rest), and its ranks start late
    second = _on_threads(4, lambda rank: rendezvous.agree_generation(store, rank, 4, TIMEOUT), late={0: 0.3, 2: 0.5})
    assert len(set(first)) == 1 and len(set(second)) == 1, (first, second)
    assert first[0] != second[0]


def test_a_rank_waits_for_the_live_rank_0_instead_of_taking_a_dead_ones_token() -> None:
    """Rank 0 of the new generation starts last: ranks 1-3 find only the previous generation's keys meanwhile."""
    store = dist.HashStore()
    (old, _) = _on_threads(2, lambda rank: rendezvous.agree_generation(store, rank, 2, TIMEOUT))
    new = _on_threads(2, lambda rank: rendezvous.agree_generation(store, rank, 2, TIMEOUT), late={0: 0.5})
    assert new[0] == new[1] != old


def test_a_rank_that_never_starts_ends_the_others_with_a_timeout_naming_the_fix() -> None:
    store = dist.HashStore()
    short = timedelta(seconds=0.5)
    (error,) = _on_threads(1, lambda rank: rendezvous.agree_generation(store, rank + 1, 3, short))
    assert isinstance(error, TimeoutError)
    assert "rank 1 waited for rank 0 to answer" in str(error) and "raise the strategy's `timeout`" in str(error)
    (error,) = _on_threads(1, lambda rank: rendezvous.agree_generation(store, 0, 3, short))
    assert isinstance(error, TimeoutError) and "rank 0 waited for the other ranks" in str(error)


def test_a_new_generation_on_the_same_store_sees_none_of_the_earlier_ones_keys() -> None:
    """What broke torchrun restarts: the agent's store outlives the workers and torch names the keys alike in every
    generation. Here the store is hosted by this process, as rank 0 (or torchrun's agent) hosts it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    port = server.port  # bound by the server itself: no other process can take it between a probe and the bind

    def rank_of_a_generation(rank: int) -> dist.Store:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        return dist.PrefixStore(
            f"{rendezvous.NAMESPACE}/{rendezvous.agree_generation(client, rank, 2, TIMEOUT)}", client
        )

    first = _on_threads(2, rank_of_a_generation)
    first[1].set("default_pg/0//cpu//0/1", "a dead worker's address")
    assert first[0].check(["default_pg/0//cpu//0/1"])  # one generation shares its keys
    second = _on_threads(2, rank_of_a_generation)
    assert not second[0].check(["default_pg/0//cpu//0/1"])  # the next generation does not see them
    assert server.check([f"{rendezvous.NAMESPACE}/handshake/hello/1"])  # the handshake's keys are the store's own


def test_a_rank_that_a_run_in_progress_went_on_without_stops_at_once_and_an_old_mark_stops_nobody() -> None:
    """The survivors of a failure move the lost ranks' marks at every heartbeat (`keep_out`): a process started again
    as one of those ranks (rank 0 too, when a launcher hosts the store) raises `LeftOut` instead of waiting the
    timeout for ranks that are training; once nobody moves the marks, a new generation forms as usual."""
    store = dist.HashStore()
    survivors_train = threading.Event()

    def heartbeats() -> None:
        while not survivors_train.wait(0.1):
            rendezvous.keep_out(store, [0, 2])

    beating = threading.Thread(target=heartbeats, daemon=True)
    rendezvous.keep_out(store, [0, 2])
    beating.start()
    try:
        errors = _on_threads(
            3, lambda rank: rendezvous.agree_generation(store, rank, 3, TIMEOUT) if rank != 1 else None
        )
    finally:
        survivors_train.set()
        beating.join()
    for rank in (0, 2):
        assert isinstance(errors[rank], rendezvous.LeftOut), errors[rank]
        assert str(errors[rank]).startswith(f"Rank {rank} was lost by a run that goes on without it")
        assert "start the whole job again from its newest checkpoint" in str(errors[rank])
    tokens = _on_threads(3, lambda rank: rendezvous.agree_generation(store, rank, 3, TIMEOUT))
    assert len(set(tokens)) == 1 and all(isinstance(t, str) for t in tokens), tokens


def test_a_rank_alone_after_the_run_that_lost_it_is_over_times_out_saying_so() -> None:
    """A lost rank started again after its run finished (its mark stands still) waits for a new generation, as any
    rank would, and its timeout says why nobody answers; a rank never lost gets the plain timeout."""
    store, short = dist.HashStore(), timedelta(seconds=0.5)
    rendezvous.keep_out(store, [2])
    (lost,) = _on_threads(1, lambda rank: rendezvous.agree_generation(store, 2, 3, short))
    assert isinstance(lost, TimeoutError)
    assert "rank 2 was lost by an earlier run on this store, which is over: start every rank again" in str(lost)
    (plain,) = _on_threads(1, lambda rank: rendezvous.agree_generation(store, 1, 3, short))
    assert isinstance(plain, TimeoutError) and "earlier run" not in str(plain)


def test_job_store_is_the_store_connect_made() -> None:
    port = free_port()
    store = rendezvous.connect("127.0.0.1", port, rank=0, world_size=1, timeout=TIMEOUT)
    assert rendezvous.job_store() is store
    store.set("key", "value")
    assert rendezvous.job_store().get("key") == b"value"
