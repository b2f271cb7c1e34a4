"""A step at which every rank stops, agreed through the job's store instead of a collective at every step:
[`StopAgreement`][lightning_decentral.trainer.stop.StopAgreement].

Lightning broadcasts a SIGTERM flag from rank 0 at the start of every training batch: a barrier centred on rank 0
that ties every rank to the slowest, whatever the topology. Here a signal only sets a flag; at the start of step
`k` (counted alike on every rank) a rank whose flag is set proposes `S = k + margin` to the store with one
`compare_set` (the first proposal wins, and every proposer learns the winner), and the others look for the key
with one `check` per step (a round trip to the store, no wait for any rank). Every rank then runs the steps
before `S` and stops before step `S`, all at the same step. `margin` covers how far ranks can be apart
([`stop_margin`][lightning_decentral.trainer.stop.stop_margin]), so no rank has started `S` when it is proposed; a rank
that finds itself past `S` raises instead of stopping elsewhere. The calls run under a
[`GuardedStore`][lightning_decentral.rendezvous.GuardedStore]: a store that is stopped or gone raises
[`StoreLost`][lightning_decentral.rendezvous.StoreLost] within the timeout instead of hanging the batch.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from datetime import timedelta
from typing import Any

from lightning_decentral.rendezvous import GuardedStore
from lightning_decentral.timeouts import DEFAULT_TIMEOUT
from lightning_decentral.topology import Topology

KEY_PREFIX = "lightning_decentral/stop"
_RUNS = itertools.count()  # the fits of this process: every rank runs the same ones, in the same order


def next_key() -> str:
    """The key of this process's next run: the same on every rank of a job that runs the same fits."""
    return f"{KEY_PREFIX}/{next(_RUNS)}"


class StopAgreement:
    """Agree on a step `S` at which every rank stops (see the module docstring).

    Args:
        store: the job's store (`torch.distributed.Store`: its `compare_set`, `check` and `get`).
        key: the key of this run (the same on every rank, fresh for each run).
        margin: `S = k + margin` for a request seen at step `k`: more than the most steps ranks can be apart.
        timeout: how long a call to the store may take (the strategy's `timeout`), else it raises `StoreLost`.

    Examples:
        Two ranks of one job, each with its own agreement over the job's store; rank 1 is signalled at its step 3:

        >>> import torch.distributed as dist
        >>> store, timeout = dist.HashStore(), timedelta(seconds=30)
        >>> ranks = [StopAgreement(store, "stop/0", margin=4, timeout=timeout) for _ in range(2)]
        >>> [ranks[0].should_stop(k) for k in range(3)]
        [False, False, False]
        >>> [ranks[1].should_stop(k) for k in range(3)]
        [False, False, False]
        >>> ranks[1].request()  # in the signal handler: a flag, nothing else
        >>> [ranks[1].should_stop(k) for k in range(3, 8)]  # proposes S = 3 + 4 at step 3
        [False, False, False, False, True]
        >>> [ranks[0].should_stop(k) for k in range(3, 8)], ranks[0].stop_step
        ([False, False, False, False, True], 7)
    """

    def __init__(self, store: Any, key: str, margin: int, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if margin < 1:
            raise ValueError(f"margin must be at least 1, got {margin}.")
        self.store = GuardedStore.around(store, timeout)
        self.key = key
        self.margin = margin
        self.requested = False
        self.stop_step: int | None = None

    def request(self) -> None:
        """Ask every rank to stop (safe in a signal handler: it only sets a flag)."""
        self.requested = True

    def forget_earlier_runs(self) -> None:
        """Remove a stop step left under this key by an earlier job on the same store. Call it on one rank,
        before the collectives that start the run (no rank proposes before them)."""
        self.store.delete_key(self.key)

    def should_stop(self, step: int) -> bool:
        """Whether to stop before starting step `step` (call it at every step, with the step counted alike on
        every rank): one store round trip while no stop step is known, none after."""
        if self.stop_step is None:
            if self.requested:
                self.stop_step = int(self.store.compare_set(self.key, "", str(step + self.margin)))
            elif self.store.check([self.key]):
                self.stop_step = int(self.store.get(self.key))
        if self.stop_step is None:
            return False
        if step > self.stop_step:
            raise RuntimeError(
                f"Step {step} is past the step {self.stop_step} every rank agreed to stop at after a SIGTERM: the "
                f"ranks were more than {self.margin} steps apart. This is a bug of lightning_decentral's stop margin; "
                "please report it with the topology and staleness."
            )
        return step == self.stop_step


def stop_margin(topology: Topology, staleness: int = 0, gossip_every: int = 1) -> int:
    """A margin larger than the most steps two ranks can be apart: a rank waits at each exchange for its in-neighbours
    to have started a step at most `staleness` behind (the synchronous exchange also for its out-neighbours), so it
    leads a neighbour by at most `(staleness + 1)` gossip steps, and any rank by that times the longest shortest path
    `D` of the graph of every edge over a period, times the steps over which the edges repeat, `lcm(gossip_every,
    period)` (a time-varying topology under `gossip_every` has a period of `gossip_every` times its own); plus 2.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> stop_margin(Ring(world_size=8)), stop_margin(Ring(world_size=8), staleness=2)
        (6, 14)
    """
    matrices = [topology.mixing(k) for k in range(topology.period)]
    n = topology.world_size
    receives_from = [{j for w in matrices for j in range(n) if j != i and w[i, j] != 0} for i in range(n)]
    diameter = max(_eccentricity(receives_from, i) for i in range(n))
    return (staleness + 1) * math.lcm(gossip_every, topology.period) * diameter + 2


def _eccentricity(receives_from: list[set[int]], start: int) -> int:
    """The most edges on a shortest path from `start` (along `j -> i` for `j` in `receives_from[i]`)."""
    sends_to: list[set[int]] = [set() for _ in receives_from]
    for i, sources in enumerate(receives_from):
        for j in sources:
            sends_to[j].add(i)
    distance = {start: 0}
    frontier = deque([start])
    while frontier:
        node = frontier.popleft()
        for nxt in sends_to[node] - distance.keys():
            distance[nxt] = distance[node] + 1
            frontier.append(nxt)
    return max(distance.values()) if len(distance) == len(receives_from) else len(receives_from)
