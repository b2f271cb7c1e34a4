"""[`StaleGossip`][lightning_decentral.gossip.StaleGossip]: the mixer of one rank under bounded staleness, which
waits for a neighbour only when it is more than `s` steps behind.

At step `k` rank `i` sends its buffers `y_i(k)` (AWC: `x_i(k)`, ATC: `U(x_i(k), g_i)`) to its out-neighbours and
mixes, for each in-neighbour `j`, the newest `y_j(τ)` it has received with `max(k − s, k₀) ≤ τ ≤ k` (`k₀`: the
run's first step):

    y_i <- w_ii y_i(k) + Σ_{j≠i} w_ij y_j(τ_ij(k))

It waits only while it holds no such step of `j`, at most the process-group timeout. With a
[`DelaySchedule`][lightning_decentral.mixing.DelaySchedule], `τ_ij(k) = max(k − d, k₀)` exactly (a deterministic
run, what the simulation computes). The messages travel on [`Links`][lightning_decentral.gossip.links.Links]:
threads that keep a receive posted, on a gloo group of their own (whatever the training backend; a GPU's buffers
go through host memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral.failures import PeerFailure, peers_answer
from lightning_decentral.gossip.links import IDLE, Links, message_bytes, payload_layout
from lightning_decentral.mixing import (
    DelaySchedule,
    ExchangeEvent,
    Watch,
    Watched,
    imposed_step,
    notify_post,
    notify_wait,
    raise_if_not_finite,
)
from lightning_decentral.timeouts import DEFAULT_TIMEOUT
from lightning_decentral.topology import Topology


class StaleGossip(Watched):
    """`y_i <- w_ii y_i(k) + Σ_j w_ij y_j(τ_ij(k))`, `k − τ ≤ s`, over `torch.distributed` (the module docstring):
    the [`Mixer`][lightning_decentral.mixing.Mixer] of rank `i` under `DecentralizedStrategy(staleness=s)`.

    Args:
        topology: a static, point-to-point topology bound to the group's size.
        staleness: `s ≥ 1`.
        delays: impose `τ_ij(k) = max(k − d, k₀)`, `d = delays(i, j, k, s)`; `None`: the newest step received.
        group: a gloo group of every rank for the messages alone (see
            [`on_new_group`][lightning_decentral.gossip.StaleGossip.on_new_group]).
        timeout: the longest a step waits for a neighbour before raising
            [`PeerFailure`][lightning_decentral.failures.PeerFailure] (the strategy's `timeout`).
        watch: the observers, residual measurement and error phrasing its owner shares with it
            ([`Watch`][lightning_decentral.mixing.Watch]); `None`: a new one.

    The arguments are taken as checked: `staleness` by [`GossipOptions`][lightning_decentral.options.GossipOptions],
    the topology by [`check_stale_topology`][lightning_decentral.mixing.check_stale_topology] (the driver's `bind`).

    One exchange per step (tag 0), one round, the same buffers every step. After
    [`wait`][lightning_decentral.gossip.stale.PendingStale.wait], `last_steps` holds `{j: τ_ij(k)}` (global ranks),
    also given to the observers as `ExchangeEvent.neighbour_steps`.
    """

    def __init__(
        self,
        topology: Topology,
        staleness: int,
        delays: DelaySchedule | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        watch: Watch | None = None,
    ) -> None:
        world = group if group is not None else dist.group.WORLD
        self.topology = topology
        self.staleness = staleness
        self.delays = delays
        self.group = group
        self.rank = dist.get_rank(world)
        if dist.get_world_size(world) != topology.world_size:
            raise ValueError(
                f"The topology is bound to {topology.world_size} ranks but the group has {dist.get_world_size(world)}."
            )
        self.sources = [(j, w) for j, w in topology.in_neighbors(self.rank, 0)]
        self.destinations = [j for j, _ in topology.out_neighbors(self.rank, 0)]
        self.self_weight = topology.self_weight(self.rank, 0)
        self.timeout = (timeout or DEFAULT_TIMEOUT).total_seconds()
        self.watch = watch if watch is not None else Watch()
        self.last_steps: dict[int, int] = {}
        self.links: Links | None = None  # made at the first exchange, when the buffers are known
        self.layout: list[tuple[int, int]] = []  # (offset, bytes) of each buffer in a message (links.payload_layout)
        peers = sorted({j for j, _ in self.sources} | set(self.destinations))
        self._names = [f"rank {dist.get_global_rank(world, j)}" for j in peers]
        self._first: int | None = None  # k₀
        self._last: int | None = None  # the last step exchanged

    @classmethod
    def on_new_group(
        cls,
        topology: Topology,
        staleness: int,
        delays: DelaySchedule | None = None,
        timeout: timedelta | None = None,
        watch: Watch | None = None,
    ) -> StaleGossip:
        """A mixer on a new gloo group of every rank (op timeout `IDLE`: its links may stay idle); every rank calls
        it together."""
        return cls(topology, staleness, delays, dist.new_group(backend="gloo", timeout=IDLE), timeout, watch)

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Sequence[Tensor] | None = None,
        check_finite: bool = True,
    ) -> PendingStale:
        """Send a copy of `buffers` as this rank's `y(step)`; the returned exchange's `wait()` mixes (into `buffers`,
        or with `out=`, `out <- W y − y` and the buffers only read)."""
        if rounds != 1 or tag != 0:
            raise ValueError(f"StaleGossip runs one round of one exchange per step, got rounds={rounds}, tag={tag}.")
        if self._last is not None and step <= self._last:
            raise ValueError(
                f"StaleGossip exchanges once per step and forward in steps: step {step} after step {self._last}."
            )
        event = None
        if self.observers:
            event = ExchangeEvent(step, tag, 1, self.bytes_sent(buffers), time.perf_counter())
        if check_finite:
            raise_if_not_finite(buffers, self.rank, step, self.phrasing)
        links = self._links_for(buffers)
        message = links.new_message()
        for (offset, size), buffer in zip(self.layout, buffers):
            message[offset : offset + size].view(buffer.dtype).copy_(buffer.reshape(-1))
        links.send(message, step)
        self._first = step if self._first is None else self._first
        self._last = step
        notify_post(self.observers, event)
        return PendingStale(self, list(buffers), step, out, event)

    def bytes_sent(self, buffers: Sequence[Tensor]) -> int:
        """Bytes this rank sends for one exchange of `buffers` (payloads and headers)."""
        return len(self.destinations) * message_bytes(buffers)

    def neighbour_names(self) -> list[str]:
        """The global ranks of this rank's neighbours, as `"rank j"`."""
        return list(self._names)

    def leave(self, step: int = 0) -> None:
        """The run is over on this rank: send FINAL on every edge, wait (at most `timeout`) for the neighbours' FINAL,
        then for every rank (a barrier of the default group: the job's store, on rank 0, outlives every rank's use
        of it), and destroy the links' group. After a clean run only. `step` is
        [`Gossip.leave`][lightning_decentral.gossip.Gossip.leave]'s, for survivors of a failure, which a stale run does
        not have (`on_peer_failure="stop"`): unused."""
        if self.links is not None:
            try:
                with peers_answer("Finishing training (the last messages of the stale gossip)", "a neighbour"):
                    late = self.links.close(self._last if self._last is not None else -1, self.timeout)
            except PeerFailure:
                self.abort()  # no thread may be left in a receive
                raise
            if late:
                self.abort()
                raise PeerFailure(
                    f"Finishing training, rank(s) {late} did not send their last message within the process-group "
                    "timeout (DecentralizedStrategy(timeout=...)): do all ranks run the same number of steps?"
                )
        with peers_answer("Finishing training together (a barrier of every rank after the last step)", "a rank"):
            dist.barrier()
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.links = None

    def abort(self) -> None:
        """After a failure: close the links' connections (the threads end, the neighbours learn of it at once)."""
        if self.links is not None:
            self.links.abort()

    def _links_for(self, buffers: Sequence[Tensor]) -> Links:
        layout = payload_layout(buffers)
        if self.links is None:
            self.layout = layout
            self.links = Links(self.group, [j for j, _ in self.sources], self.destinations, message_bytes(buffers))
        elif layout != self.layout:
            raise ValueError("StaleGossip sends the same buffers at every step; their sizes changed.")
        return self.links

    def choose(self, source: int, step: int) -> int | None:
        """The step of `source` to mix at `step` among those held (the links locked), or `None`: wait."""
        assert self.links is not None and self._first is not None
        held = self.links.held(source)
        if self.delays is not None:
            need = imposed_step(self.delays, self.rank, source, step, self.staleness, self._first)
            return need if need in held else None
        newest = max((t for t in held if t <= step), default=None)
        return newest if newest is not None and newest >= step - self.staleness else None


class PendingStale:
    """A [`StaleGossip`][lightning_decentral.gossip.StaleGossip] exchange in flight; `wait()` mixes."""

    def __init__(
        self,
        gossip: StaleGossip,
        buffers: list[Tensor],
        step: int,
        out: Sequence[Tensor] | None,
        event: ExchangeEvent | None,
    ) -> None:
        self._gossip = gossip
        self._buffers = buffers
        self._step = step
        self._event = event
        self._out = None if out is None else list(out)
        self._observers = list(gossip.observers)
        self.residuals: list[Tensor] | None = None
        self._done = False

    def wait(self) -> None:
        """Block until every in-neighbour's `y_j(τ)`, `τ ≥ k − s`, is here (at most `timeout`), then mix."""
        if self._done:
            return
        started = time.perf_counter()
        gossip = self._gossip
        step = self._step
        links = gossip.links
        assert links is not None
        taus = {source: self._arrived(source) for source, _ in gossip.sources}
        residuals = []
        for index, buffer in enumerate(self._buffers):
            delta = self._out[index] if self._out is not None else torch.empty_like(buffer)
            torch.mul(
                buffer, gossip.self_weight - 1, out=delta
            )  # w_ii y_i − y_i (the buffers are unchanged since start)
            for source, weight in gossip.sources:
                offset, size = gossip.layout[index]
                neighbour = links.held(source)[taus[source]][offset : offset + size].view(buffer.dtype)
                delta.add_(neighbour.view_as(buffer).to(buffer.device), alpha=weight)
            if gossip.measure_residuals:
                residuals.append(torch.dot(delta.reshape(-1), delta.reshape(-1)))
            if self._out is None:
                buffer.add_(delta)
        floor = step + 1 - gossip.staleness if gossip.delays is not None else None
        for source, _ in gossip.sources:  # what no later step can choose
            links.release(source, floor if floor is not None else taus[source])
        self.residuals = residuals or None
        gossip.last_steps = {links.global_rank(j): tau for j, tau in taus.items()}
        if self._event is not None:
            self._event.neighbour_steps = dict(gossip.last_steps)
        self._done = True
        notify_wait(self._observers, self._event, started)

    def _arrived(self, source: int) -> int:
        """The step of `source` to mix, once it is here; a failure or the timeout raises `PeerFailure`."""
        gossip = self._gossip
        step = self._step
        links = gossip.links
        assert links is not None
        chosen: list[int | None] = [None]

        def ready() -> bool:
            chosen[0] = gossip.choose(source, step)
            finished = links.final.get(source)
            if chosen[0] is None and finished is not None:
                raise PeerFailure(
                    f"The gossip exchange of step {step} failed on this rank: rank {links.global_rank(source)} "
                    f"finished training after step {finished}, which is more than staleness={gossip.staleness} steps "
                    "behind. Do all ranks run the same number of steps?"
                )
            return chosen[0] is not None

        what = f"The gossip exchange of step {step}"
        with peers_answer(what, f"a neighbour ({', '.join(gossip.neighbour_names())})"):
            arrived = links.wait_until(ready, time.monotonic() + gossip.timeout)
        if not arrived:
            newest = max(links.held(source), default=None)
            raise PeerFailure(
                f"{what} failed on this rank: rank {links.global_rank(source)} was more than "
                f"staleness={gossip.staleness} steps behind for the process-group timeout ({gossip.timeout:g} s; the "
                f"newest of its steps here: {newest}). It hung, or died without closing its connections "
                "(DecentralizedStrategy(timeout=...)); the first error in the other ranks' logs is the cause."
            )
        assert chosen[0] is not None
        return chosen[0]
