"""The membership protocol (lightning_decentral.membership) without processes: members are threads, each with its own
clients of one TCPStore, as ranks would be."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lightning_decentral.failures import LATE, wait_works
from lightning_decentral.membership import (
    LAUNCHER_KEY,
    Decision,
    Excluded,
    GuardedStore,
    Membership,
    ReplicaLost,
    StoreLost,
    TooFewWorkers,
    store_host,
)
from tests.helpers import start_rank

_MADE: list[Membership] = []


@pytest.fixture()
def connect() -> Callable[[], dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    port = server.port  # bound by the server itself: no other process can take it between a probe and the bind
    yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    while _MADE:  # stop the heartbeats before the store goes
        _MADE.pop().close()
    time.sleep(0.2)
    del server


def _members(
    connect: Callable, n: int, silence: float = 5.0, min_workers: int = 1, start: bool = True, replica_size: int = 1
) -> list[Membership]:
    members = []
    for rank in range(n):
        store = GuardedStore(connect, timeout=10.0, where="test")
        members.append(
            Membership(
                store, connect, "run", rank, n, silence=silence, min_workers=min_workers, replica_size=replica_size
            )
        )
        if start:
            members[-1].start()
    _MADE.extend(members)
    return members


def _in_threads(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Run each call in its own thread; each one's result, or the exception it raised."""
    out: dict[int, Any] = {}

    def run(rank: int, call: Callable[[], Any]) -> None:
        try:
            out[rank] = call()
        except Exception as error:
            out[rank] = error

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a member is still agreeing after 30 s"
    return out


def _late(seconds: float, call: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: (time.sleep(seconds), call())[1]


def test_survivors_agree_on_the_members_and_the_largest_step(connect: Callable) -> None:
    """Rank 2 dies; its neighbour 1 saw the broken connection at step 20, rank 0 (ahead) gives up step 21, rank 3
    joins last. Every survivor adopts one decision, half a second after the death is confirmed."""
    members = _members(connect, 4)
    members[2].close()  # dead: no heartbeat, never joins
    started = time.monotonic()
    out = _in_threads(
        {
            1: lambda: members[1].agree(20, "Connection closed by peer", broken=[2]),
            0: _late(0.1, lambda: members[0].agree(21, members[0].poll())),
            3: _late(0.2, lambda: members[3].agree(20, "announced")),
        }
    )
    expected = Decision(generation=1, members=(0, 1, 3), survivors=(0, 1, 3), lost=(2,), step=21)
    assert out == {0: expected, 1: expected, 3: expected}
    assert time.monotonic() - started < 3.0
    assert [(m.rank, m.world_size, m.generation) for m in (members[0], members[1], members[3])] == [
        (0, 3, 1),
        (1, 3, 1),
        (2, 3, 1),
    ]


def test_members_dying_together_are_all_found_gone_at_once(connect: Callable) -> None:
    """Ranks 1 and 2 die together; ranks 0, 3 and 4 each learn of it from the store (each gave up an exchange on an
    announcement: nobody names a broken connection). Each probes the members that have not joined: both are gone
    (their beacons refuse connections), and the survivors agree at once, not after the silence (five minutes here;
    the threads are given 30 s each)."""
    members = _members(connect, 5, silence=300.0)
    members[1].close()
    members[2].close()
    out = _in_threads({r: lambda r=r: members[r].agree(5, "announced") for r in (0, 3, 4)})
    expected = Decision(generation=1, members=(0, 3, 4), survivors=(0, 3, 4), lost=(1, 2), step=5)
    assert out == {0: expected, 3: expected, 4: expected}


def _member_until_killed(rank: int, world_size: int, store_port: int) -> None:
    """A member in a process of its own: it starts (heartbeat, beacon), says so, and beats until it is killed."""
    connect = lambda: dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=10))  # noqa: E731
    member = Membership(
        GuardedStore(connect, timeout=10.0, where="test"), connect, "run", rank, world_size, silence=60.0, min_workers=1
    )
    member.start()
    connect().set(f"started/{rank}", "1")
    time.sleep(120)


@pytest.mark.slow
def test_a_member_whose_process_is_gone_is_polled_before_the_silence() -> None:
    """Rank 1 is killed (`SIGKILL`) while rank 0 waits for the others (a collective, an agreement on what each rank
    does) and nobody announces anything: once rank 1 has been silent for the confirmation window, its beacon is probed
    and `poll` says it is gone, long before the silence (a minute). A member that said it leaves (its run is over) is
    no failure to poll for."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    port = server.port  # bound by the server itself: no other process can take it between a probe and the bind
    connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # noqa: E731
    process = start_rank(_member_until_killed, 1, 3, port, tempfile.gettempdir(), store_port=port)
    members = [
        Membership(GuardedStore(connect, timeout=10.0, where="test"), connect, "run", r, 3, silence=60.0, min_workers=1)
        for r in (0, 2)
    ]
    try:
        for member in members:
            member.start()
        server.wait(["started/1"], timedelta(seconds=60))
        members[1].close()  # rank 2 leaves
        time.sleep(1.0)
        assert members[0].poll() is None
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (reason := members[0].poll()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reason is not None and reason.startswith("rank 1's process is gone (silent for"), reason
    finally:
        process.kill()
        process.join()
        members[0].close()


def test_every_member_sees_the_announcement_in_one_poll(connect: Callable) -> None:
    members = _members(connect, 3)
    assert members[0].poll() is None
    members[2].close()

    def rank_0() -> tuple[str, Decision]:  # waits on an exchange, polling, until the announcement comes
        while (reason := members[0].poll()) is None:
            time.sleep(0.01)
        return reason, members[0].agree(5, reason)

    out = _in_threads({1: lambda: members[1].agree(5, "Connection closed by peer", broken=[2]), 0: rank_0})
    assert out[0] == ("rank 1 saw: Connection closed by peer", out[1])


def test_a_slow_survivor_is_waited_for_and_a_second_failure_is_agreed_the_same_way(connect: Callable) -> None:
    """Rank 3 beats its heartbeat but joins 1.5 s late (3x the confirmation window): it stays. Then rank 0 dies too."""
    members = _members(connect, 4, silence=5.0)
    members[2].close()
    out = _in_threads(
        {
            0: lambda: members[0].agree(7, "Connection closed by peer", broken=[2]),
            1: lambda: members[1].agree(7, "Connection closed by peer", broken=[2]),
            3: _late(1.5, lambda: members[3].agree(8, "announced")),
        }
    )
    assert {d.members for d in out.values()} == {(0, 1, 3)} and {d.step for d in out.values()} == {8}
    members[0].close()
    second = _in_threads(
        {
            1: lambda: members[1].agree(30, "Connection closed by peer", broken=[0]),
            3: lambda: members[3].agree(30, "announced"),
        }
    )
    expected = Decision(generation=2, members=(1, 3), survivors=(1, 2), lost=(0,), step=30)
    assert second == {1: expected, 3: expected}
    assert (members[3].rank, members[3].world_size) == (1, 2)


def test_a_silent_member_is_lost_and_stops_when_it_comes_back(connect: Callable) -> None:
    """Rank 2 is stopped (no heartbeat, no broken connection): lost once silent for `silence`; when it wakes up and
    joins, the decision does not name it and it stops."""
    members = _members(connect, 3, silence=1.0, start=False)
    members[0].start()
    members[1].start()  # rank 2 never beats
    out = _in_threads(
        {0: lambda: members[0].agree(4, "rank 2 has been silent"), 1: lambda: members[1].agree(4, "announced")}
    )
    assert {d.members for d in out.values()} == {(0, 1)}
    with pytest.raises(Excluded, match="went on without rank 2 after step 4"):
        members[2].agree(4, "woke up")


def test_a_replica_that_lost_a_rank_is_lost_whole_without_waiting_for_its_other_rank(connect: Callable) -> None:
    """Replicas of 2 ranks: rank 3 dies; ranks 0, 1, 4 and 5 agree at once (the silence is five minutes), without
    waiting for rank 2, alive but never joining (in FSDP's collective with rank 3); when it does, it stops with
    ReplicaLost naming rank 3."""
    members = _members(connect, 6, silence=300.0, replica_size=2)
    members[3].close()
    out = _in_threads({r: lambda r=r: members[r].agree(7, "announced") for r in (0, 1, 4, 5)})
    expected = Decision(generation=1, members=(0, 1, 4, 5), survivors=(0, 1, 4, 5), lost=(2, 3), step=7)
    assert out == {r: expected for r in (0, 1, 4, 5)}
    with pytest.raises(ReplicaLost, match=r"Rank 2 stops: its replica \(ranks 2 to 3\) lost rank 3 after step 7"):
        members[2].agree(7, "Connection closed by peer")


@pytest.mark.slow
def test_a_rank_of_a_replica_that_joined_and_stays_silent_is_taken_to_be_in_the_next_step(connect: Callable) -> None:
    """Replicas of 2 ranks, rank 5 dead: ranks 1, 2 and 3 join with step 3, rank 0 (alive, blocked in its replica's
    collective of step 4 with rank 1) does not join. After IN_NEXT_STEP they agree on step 4, rank 0 among the members
    (not lost after the silence, which would lose replica 0), and rank 0 adopts the same decision when it joins."""
    members = _members(connect, 6, silence=60.0, replica_size=2)
    members[5].close()
    out = _in_threads({r: lambda r=r: members[r].agree(3, "announced") for r in (1, 2, 3)})
    expected = Decision(generation=1, members=(0, 1, 2, 3), survivors=(0, 1, 2, 3), lost=(4, 5), step=4)
    assert out == {r: expected for r in (1, 2, 3)}
    assert members[0].agree(4, "announced") == expected


def test_below_min_workers_every_survivor_stops_alike(connect: Callable) -> None:
    members = _members(connect, 4, min_workers=3)
    members[2].close()
    members[3].close()
    out = _in_threads({r: lambda r=r: members[r].agree(9, "Connection closed by peer", broken=[2, 3]) for r in (0, 1)})
    for error in out.values():
        assert isinstance(error, TooFewWorkers)
        assert (
            "Only 2 workers are left after step 9 (ranks [0, 1] of the start; lost: [2, 3]), fewer than min_workers=3"
            in str(error)
        )


class _Hung:
    """A store client whose host stopped answering."""

    def check(self, keys: list[str]) -> bool:
        time.sleep(5)
        return True


def test_a_store_that_does_not_answer_raises_instead_of_hanging() -> None:
    store = GuardedStore(_Hung, timeout=0.2, where="10.0.0.1:29500")
    started = time.monotonic()
    with pytest.raises(StoreLost, match=r"store at 10.0.0.1:29500 did not answer within 0 s"):
        store.check(["x"])
    with pytest.raises(StoreLost):  # at once, from now on
        store.check(["y"])
    assert time.monotonic() - started < 1.0


def test_where_the_store_lives_is_explained(connect: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    store = connect()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    outlives, words = store_host(store)
    assert not outlives and "rank 0's process hosts the job's store" in words and "lightning-decentral-launch" in words
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    outlives, words = store_host(store)
    assert not outlives and "torchrun stops every worker of a node when one of them fails" in words
    store.set(LAUNCHER_KEY, "pid 42 on host-a")
    assert store_host(store) == (
        True,
        "lightning-decentral-launch hosts the job's store (pid 42 on host-a), outside the workers",
    )


class _Late:
    """A `torch.distributed` work that completes `after` seconds after it is waited for."""

    def __init__(self, after: float) -> None:
        self.after = after

    def wait(self) -> bool:
        time.sleep(self.after)
        return True


def _store_gone() -> None:
    raise RuntimeError("the store is gone")


def test_a_store_gone_while_the_last_barrier_completes_is_no_error() -> None:
    """Rank 0 hosts the store and exits once its part of the last barrier is done; another rank's look at the store
    then fails while its own part is about to complete."""
    wait_works([_Late(0.1)], _store_gone, "Finishing training together")


def test_a_store_gone_is_raised_when_the_works_do_not_complete() -> None:
    with pytest.raises(RuntimeError, match="the store is gone"):
        wait_works([_Late(LATE + 2)], _store_gone, "The gossip exchange of step 3")
