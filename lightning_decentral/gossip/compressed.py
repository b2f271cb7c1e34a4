"""[`CompressedGossip`][lightning_decentral.gossip.CompressedGossip]: CHOCO gossip between processes, the messages of
[`Choco`][lightning_decentral.compression.Choco] over a [`Gossip`][lightning_decentral.gossip.Gossip] engine's
point-to-point transport.

With `overlap` (`DecentralizedStrategy(compression_overlap=True)`) an exchange of CPU buffers runs on
the mixer's [`ExchangeThread`][lightning_decentral.gossip.compressed.ExchangeThread], one helper thread started at
the first exchange and joined when the mixer leaves, closes or aborts: `start` checks the buffers and counts the bytes
on the calling (training) thread and hands the rest over; the helper thread runs every round, the encode
(`x − x̂`, scale, codes, packing, the sent copy's update), the messages' post and wait, and the decode (the received
copies, `γ Δ` into the buffers or `out`); `wait` blocks until it is done and raises what it raised. Under AWC the
exchange of `x(k)` is started before the forward pass and waited for after backward, so all of its arithmetic runs
while the training thread computes forward and backward. Exchanges run one after the other in the order they were
started, the same on every rank. On CUDA buffers the exchange stays on the calling thread and the current stream
(the messages travel on NCCL, whose calls every rank must issue in one order with the training thread's collectives).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral.compression import Choco, ChocoExchange, Compressor
from lightning_decentral.failures import peers_answer, wait_works
from lightning_decentral.gossip.engine import Gossip
from lightning_decentral.mixing import ExchangeEvent, Watched, notify_post, notify_wait, raise_if_not_finite
from lightning_decentral.topology import Topology


class CompressedGossip(Watched):
    """The [`Mixer`][lightning_decentral.mixing.Mixer] of rank `i` under compressed gossip: each round of `W(k)`
    sends every out-neighbour one uint8 message of a size fixed in advance (the payloads of `C(x_i − x̂_{i→j})`, one
    per buffer), receives one from every in-neighbour, and moves `x_i` by `γ (Σ_j w_ij x̂_{j→i} − Σ_j w_ji x̂_{i→j})`
    ([`Choco`][lightning_decentral.compression.Choco]; docs/algorithms.md, "Compressed gossip (CHOCO)"). The
    [`DenseMixer`][lightning_decentral.mixing.DenseMixer] with the same `compression` runs the same arithmetic for
    all ranks in one process.

    `wire_bytes` counts the bytes of every message this rank has posted; each
    [`ExchangeEvent`][lightning_decentral.mixing.ExchangeEvent] carries those of its exchange. `state_dict()` (the
    public copies) belongs in the rank's checkpoint shard: a resume from it continues bit for bit.

    Args:
        gossip: the engine whose group, topology, point-to-point transport and
            [`Watch`][lightning_decentral.mixing.Watch] (observers, residual measurement, phrasing) serve this mixer.
        compression: the compressor `C`.
        consensus_step: `γ` (`None`: the compressor's `consensus_step`).
        from_copy: end each round from this rank's own public copy ([`Choco`][lightning_decentral.compression.Choco]'s
            `from_copy`: the outer step's mixing).
        overlap: run each exchange of CPU buffers on the mixer's helper thread, between `start` and `wait` (the module
            docstring); the same messages and results either way.

    Examples:
        Inside a process group (every rank runs this, with the same `k`):

        ```python
        mixer = CompressedGossip(Gossip(resolve_topology("one_peer_exponential", dist.get_world_size())), Sign())
        mixer.start([flat], step=k).wait()          # flat <- flat + γ Δ; mixer.wire_bytes grows by one message
        ```
    """

    def __init__(
        self,
        gossip: Gossip,
        compression: Compressor,
        consensus_step: float | None = None,
        from_copy: bool = False,
        overlap: bool = False,
    ) -> None:
        self.gossip = gossip
        step = compression.consensus_step if consensus_step is None else consensus_step
        self.choco = Choco(compression, step, gossip.rank, from_copy)
        self.watch = gossip.watch
        self.thread = ExchangeThread(f"lightning_decentral-compressed-{gossip.rank}") if overlap else None
        self._receive: dict[tuple[int, int], Tensor] = {}  # (tag, peer) -> a message's worth of bytes

    @property
    def topology(self) -> Topology:
        """The engine's topology."""
        return self.gossip.topology

    @property
    def rank(self) -> int:
        """This rank in the engine's group."""
        return self.gossip.rank

    @property
    def chocos(self) -> list[Choco]:
        """This rank's side of the rule, as the only worker this mixer serves."""
        return [self.choco]

    @property
    def wire_bytes(self) -> int:
        """Bytes of every message this rank has posted (payloads: what crosses the wire)."""
        return self.choco.wire_bytes

    def bytes_sent(self, buffers: Sequence[Tensor], step: int) -> int:
        """Bytes this rank sends for one round of `start(buffers, step)`."""
        return self.choco.bytes_sent(buffers, self.topology, step)

    def start_copies_at(self, buffers: Sequence[Tensor], tag: int = 0) -> None:
        """New public copies start at `buffers`
        ([`Choco.start_copies_at`][lightning_decentral.compression.Choco.start_copies_at])."""
        self.settle()
        self.choco.start_copies_at(buffers, tag)

    def state_dict(self) -> dict[str, Any]:
        """The public copies and the byte count
        ([`Choco.state_dict`][lightning_decentral.compression.Choco.state_dict]), once the exchanges started so far
        are done."""
        self.settle()
        return self.choco.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.settle()
        self.choco.load_state_dict(state)

    def rebind(self, topology: Topology, group: dist.ProcessGroup | None = None) -> None:
        """[`Gossip.rebind`][lightning_decentral.gossip.Gossip.rebind]; every public copy is forgotten (every rank
        rebinds together, so both ends of every edge start again from zero)."""
        self.settle()
        self.gossip.rebind(topology, group)
        self.choco.rebind(self.gossip.rank)
        self._receive = {}

    def settle(self) -> None:
        """Block until every exchange started so far is done on the helper thread (their errors stay for `wait`)."""
        if self.thread is not None:
            self.thread.settle()

    def groups(self) -> list[dist.ProcessGroup]:
        return self.gossip.groups()

    def leave(self, step: int = 0) -> None:
        """End the helper thread (every exchange was waited for), then
        [`Gossip.leave`][lightning_decentral.gossip.Gossip.leave]."""
        if self.thread is not None:
            self.thread.stop()
        self.gossip.leave(step)

    def abort(self) -> None:
        """After a failure: end the helper thread, waiting `ABORT_LIMIT` seconds at most for an exchange it still runs
        (its messages complete, fail, or reach the timeout), then the engine's `abort`."""
        if self.thread is not None:
            self.thread.stop(ABORT_LIMIT)
        self.gossip.abort()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        self.gossip.close()

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Sequence[Tensor] | None = None,
        check_finite: bool = True,
    ) -> PendingCompressed:
        """Compress and post round one of `rounds` (the [`Mixer`][lightning_decentral.mixing.Mixer] contract: the
        buffers are read now and not written until `wait()`; with `out`, they are only read and `out` receives
        the correction)."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        event = None
        if self.observers:
            event = ExchangeEvent(step, tag, rounds, rounds * self.bytes_sent(buffers, step), time.perf_counter())
        if self.topology.is_identity(step):
            for o in out or []:
                o.zero_()
            return PendingCompressed(self, None, tag, event)
        if check_finite:
            raise_if_not_finite(buffers, self.rank, step, self.phrasing)
        exchange = ChocoExchange(self.choco, self.topology, buffers, step, rounds, tag, out, self.measure_residuals)
        return PendingCompressed(self, exchange, tag, event)

    def receive_buffers(self, exchange: ChocoExchange, tag: int) -> dict[int, Tensor]:
        """A message's worth of bytes for each in-neighbour of the exchange's step (kept from step to step)."""
        size = self.choco.message_bytes(exchange.buffers)
        device = exchange.buffers[0].device
        received = {}
        for peer, _ in self.topology.in_neighbors(self.rank, exchange.step):
            buffer = self._receive.get((tag, peer))
            if buffer is None or buffer.numel() != size or buffer.device != device:
                buffer = self._receive[(tag, peer)] = torch.empty(size, dtype=torch.uint8, device=device)
            received[peer] = buffer
        return received


class PendingCompressed:
    """A [`CompressedGossip`][lightning_decentral.gossip.CompressedGossip] exchange in flight: every round runs on the
    mixer's helper thread (overlap, CPU buffers), or round one is posted and `wait()` finishes it and runs the other
    rounds one after the other."""

    def __init__(
        self, mixer: CompressedGossip, exchange: ChocoExchange | None, tag: int, event: ExchangeEvent | None
    ) -> None:
        self._mixer = mixer
        self._exchange = exchange
        self._tag = tag
        self._event = event
        self._observers = list(mixer.observers)
        self.residuals: list[Tensor] | None = None
        self._round = 0
        self._works = None
        self._ranks = []
        self._received: dict[int, Tensor] = {}
        self._job: Future | None = None
        on_cpu = exchange is not None and all(b.device.type == "cpu" for b in exchange.buffers)
        self._threaded = mixer.thread is not None and on_cpu  # CUDA buffers: this thread and the current stream
        if exchange is not None:
            names = mixer.gossip.neighbour_names(exchange.step)
            self._what = f"The compressed gossip exchange of step {exchange.step}"
            self._peers = f"a neighbour ({', '.join(names) or 'none'})"
            if self._threaded:
                assert mixer.thread is not None
                mixer.choco.wire_bytes += exchange.round_bytes  # round one counted now, as without the thread
                self._job = mixer.thread.run(self._run)
            else:
                self._post()
        notify_post(self._observers, event)

    def _post(self) -> None:
        assert self._exchange is not None
        # the bytes are counted on the training thread: what it logs mid-step does not depend on the helper's progress
        messages = self._exchange.outgoing(self._round, count=not self._threaded)
        self._received = self._mixer.receive_buffers(self._exchange, self._tag)
        with peers_answer(self._what, self._peers):
            self._works, self._ranks = self._mixer.gossip.post_messages(messages, self._received, self._tag)

    def _run(self) -> None:
        """The whole exchange (on the helper thread)."""
        self._post()
        self._finish()

    def _finish(self) -> None:
        """Wait for the round in flight, decode it, and run the rounds left."""
        while self._works is not None:
            assert self._exchange is not None
            wait_works(self._works, None, self._what, self._peers, self._ranks)
            self._exchange.incoming(self._round, self._received)
            self._round += 1
            self._works = None
            if self._round < self._exchange.rounds:
                self._post()
            else:
                self.residuals = self._exchange.residuals

    def wait(self) -> None:
        """Block until the buffers (or `out`) hold the exchange's result; raise what the helper thread raised."""
        started = time.perf_counter()
        job, self._job = self._job, None
        if job is not None:
            job.result()
            assert self._exchange is not None
            self._mixer.choco.wire_bytes += (self._exchange.rounds - 1) * self._exchange.round_bytes  # the later rounds
        else:
            self._finish()
        notify_wait(self._observers, self._event, started)
        self._event = None  # reported once


ABORT_LIMIT = 5.0
"""Seconds `CompressedGossip.abort` waits for an exchange still running on the helper thread."""


class ExchangeThread:
    """One helper thread that runs jobs (a mixer's exchanges) one at a time, in the order they were handed over.

    Started at the first job, ended by `stop`. A job runs with the torch thread count the handing thread had (the same
    arithmetic, so the same results); what it raises is raised by its `Future.result()`, on the thread that waits.
    It is a daemon thread: a process whose training thread failed is never held at exit by an exchange left running.

    Examples:
        >>> thread = ExchangeThread("example")
        >>> order = []
        >>> jobs = [thread.run(lambda i=i: order.append(i)) for i in range(3)]
        >>> failed = thread.run(lambda: 1 / 0)
        >>> [job.result() for job in jobs], order
        ([None, None, None], [0, 1, 2])
        >>> failed.result()
        Traceback (most recent call last):
        ...
        ZeroDivisionError: division by zero
        >>> thread.stop()
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, job: Callable[[], None]) -> Future:
        """Hand `job` over: it runs after every job handed over before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name=self.name)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((job, future, torch.get_num_threads()))
        return future

    def settle(self) -> None:
        """Block until every job handed over so far has run (what they raised stays in their futures)."""
        if self._thread is not None:
            self.run(lambda: None).result()

    def stop(self, limit: float | None = None) -> None:
        """End the thread once the jobs handed over have run, waiting at most `limit` seconds (`None`: until then)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(limit)
            self._thread = None

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future, threads = item
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            future.set_running_or_notify_cancel()
            try:
                job()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(None)
