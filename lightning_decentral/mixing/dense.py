"""All `n` workers' exchanges in one process: [`DenseMixer`][lightning_decentral.mixing.DenseMixer]."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_decentral.compression import Choco, ChocoExchange, Compressor, exchange_in_process
from lightning_decentral.mixing.delays import DelayedMixing
from lightning_decentral.mixing.protocol import (
    SIMULATION,
    ExchangeEvent,
    ExchangeObserver,
    Watch,
    Watched,
    notify_post,
    notify_wait,
    raise_if_not_finite,
)
from lightning_decentral.topology import Hierarchical, Topology


def stages(topology: Topology, step: int) -> list[tuple[Tensor, Tensor]]:
    """The exchanges of one round at `step`, in order, each `(W, averaged)`: `W` float64, `averaged[i]` whether
    rank `i`'s part of it is an exact average over its group (an all-reduce on processes, always in full precision).

    `[W(step)]`, or for a [`Hierarchical`][lightning_decentral.topology.Hierarchical] topology one `W` per level (the
    groups' matrices on their ranks, identity elsewhere; levels that move nothing left out), as the gossip engine
    runs them.
    """
    if topology.is_identity(step):
        return []
    n = topology.world_size
    if not isinstance(topology, Hierarchical) or topology.is_average(step):
        return [(torch.from_numpy(topology.mixing(step).copy()), torch.full((n,), topology.is_average(step)))]
    out = []
    for level in topology.levels():
        moving = [(group, part) for group, part in zip(*level) if not part.is_identity(step)]
        if not moving:
            continue
        averaged = torch.zeros(n, dtype=torch.bool)
        for group, part in moving:
            averaged[group] = part.is_average(step)
        out.append((torch.from_numpy(level.matrix(step, n)), averaged))
    return out


class DenseMixer(Watched):
    """All `n` workers' exchanges in one process: `W(step)` applied to their stacked buffers.

    Each worker talks to its own view, `mixer.worker(i)`, exactly as rank `i` talks to a
    [`Gossip`][lightning_decentral.gossip.Gossip]. An exchange is computed when the first worker waits
    for it, so every worker must `start` it before any waits (a single-process executor runs the
    workers phase by phase). In low precision (`dtype`) a round is `x <- x + W q − q` with `q`
    the buffers rounded to `dtype`; exact averages stay in full precision, as on processes.

    Args:
        topology: a topology bound to `n` workers.
        dtype: the precision messages travel in; `None`: the buffers' own.
        delayed: bounded staleness: each worker mixes with its neighbours' buffers of the steps this
            [`DelayedMixing`][lightning_decentral.mixing.DelayedMixing] says (one round, full precision).
        watch: the observers (of every worker's exchanges), residual measurement and error phrasing its owner shares
            with it ([`Watch`][lightning_decentral.mixing.Watch]); `None`: a new one, speaking of workers.
        compression: compressed gossip: each worker runs [`Choco`][lightning_decentral.compression.Choco] with this
            compressor, its messages handed to its in-neighbours in the process (the arithmetic of
            [`CompressedGossip`][lightning_decentral.gossip.CompressedGossip] on processes).
        consensus_step: CHOCO's `γ` (`None`: the compressor's `consensus_step`).
        from_copy: compressed gossip ends each round from the worker's own public copy
            ([`Choco`][lightning_decentral.compression.Choco]'s `from_copy`: the outer step's mixing).

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> mixer = DenseMixer(Ring(world_size=3))
        >>> x = [torch.tensor([3.0 * i]) for i in range(3)]
        >>> pending = [mixer.worker(i).start([x[i]], step=0) for i in range(3)]
        >>> for p in pending: p.wait()
        >>> [round(v.item(), 4) for v in x]   # W = 11ᵀ/3 on a ring of 3: everyone holds the mean
        [3.0, 3.0, 3.0]
    """

    def __init__(
        self,
        topology: Topology,
        dtype: torch.dtype | None = None,
        delayed: DelayedMixing | None = None,
        watch: Watch | None = None,
        compression: Compressor | None = None,
        consensus_step: float | None = None,
        from_copy: bool = False,
    ) -> None:
        self.topology = topology
        self.dtype = dtype
        self.delayed = delayed
        self.watch = watch if watch is not None else Watch(phrasing=SIMULATION)
        self._posted: dict[tuple[int, int], dict[int, _DensePending]] = {}
        self.chocos: list[Choco] = []  # compressed gossip: worker i's side of the rule
        if compression is not None:
            step = compression.consensus_step if consensus_step is None else consensus_step
            self.chocos = [Choco(compression, step, rank, from_copy) for rank in range(topology.world_size)]

    def rebind(self, topology: Topology) -> None:
        """Mix with `topology` from now on (the survivors of a failure; nothing may be in flight). Worker `i` of
        the new topology talks to a view of rank `i`: whoever runs the workers re-numbers its views. Compressed
        gossip starts again from empty public copies."""
        if self._posted:
            raise RuntimeError(f"{len(self._posted)} exchanges are in flight: rebind the mixer between steps.")
        self.topology = topology
        if self.chocos:
            first = self.chocos[0]
            self.chocos[:] = [
                Choco(first.compressor, first.consensus_step, rank, first.from_copy)
                for rank in range(topology.world_size)
            ]

    def choco_exchange(
        self, rank: int, buffers: Sequence[Tensor], step: int, rounds: int, tag: int, out: Sequence[Tensor] | None
    ) -> ChocoExchange:
        """Compressed gossip: worker `rank`'s exchange of `buffers` (with `out`: the correction there); the messages
        move between the workers in [`exchange_in_process`][lightning_decentral.compression.exchange_in_process]."""
        return ChocoExchange(self.chocos[rank], self.topology, buffers, step, rounds, tag, out, self.measure_residuals)

    @property
    def in_flight(self) -> int:
        """How many exchanges some worker has started and none has waited for yet."""
        return len(self._posted)

    def worker(self, rank: int) -> _WorkerMixer:
        """The [`Mixer`][lightning_decentral.mixing.Mixer] worker `rank` uses."""
        if not 0 <= rank < self.topology.world_size:
            raise ValueError(f"rank must be in [0, {self.topology.world_size}), got {rank}.")
        return _WorkerMixer(self, rank)

    def bytes_sent(self, buffers: Sequence[Tensor], rank: int, step: int) -> int:
        """Bytes rank `rank` would send for one round on processes (an exact average: the ring all-reduce figure)."""
        if self.chocos:
            return self.chocos[rank].bytes_sent(buffers, self.topology, step)
        total = 0
        for matrix, averaged in stages(self.topology, step):
            size = sum(b.numel() * b.element_size() for b in buffers)
            if averaged[rank]:
                n = self.topology.world_size
                total += size * 2 * (n - 1) // n
            else:
                wire = sum(b.numel() * (self.dtype or b.dtype).itemsize for b in buffers)
                column = matrix[:, rank]
                total += wire * int(((column > 0) & (torch.arange(len(column)) != rank)).sum())
        return total

    def post(self, pending: _DensePending) -> None:
        """Record a worker's started exchange; it is mixed, with every worker's, by the first wait (`complete`)."""
        posted = self._posted.setdefault((pending.step, pending.tag), {})
        if pending.rank in posted:
            raise RuntimeError(
                f"Worker {pending.rank} started exchange (step {pending.step}, tag {pending.tag}) twice."
            )
        posted[pending.rank] = pending

    def complete(self, step: int, tag: int) -> None:
        """Mix the exchange `(step, tag)` of every worker at once."""
        posted = self._posted.pop((step, tag), {})
        n = self.topology.world_size
        missing = sorted(set(range(n)) - posted.keys())
        if missing:
            raise RuntimeError(
                f"Workers {missing} have not started exchange (step {step}, tag {tag}) yet: with a DenseMixer every "
                "worker starts an exchange before any worker waits for it."
            )
        order = [posted[i] for i in range(n)]
        if self.chocos:  # each worker compressed its round one when it started
            exchange_in_process([p.exchange for p in order], first=[p.messages for p in order])
            for worker in order:
                worker.residuals = worker.exchange.residuals
                worker.done = True
            return
        for index in range(len(order[0].buffers)):
            x = torch.stack([p.buffers[index].detach().reshape(-1) for p in order]).double()
            mixed, change = self.mix(x, step, order[0].rounds, order[0].buffers[index].dtype, key=(tag, index))
            residuals = change.square().sum(1) if change is not None else [None] * n
            for worker, row, original, residual in zip(order, mixed, x, residuals):
                target = worker.out[index] if worker.out is not None else worker.buffers[index]
                value = row - original if worker.out is not None else row
                target.copy_(value.view_as(target).to(target.dtype))
                if residual is not None:
                    worker.residuals = (worker.residuals or []) + [residual]
        for worker in order:
            worker.done = True

    def mix(
        self, x: Tensor, step: int, rounds: int, dtype: torch.dtype, key: object = None
    ) -> tuple[Tensor, Tensor | None]:
        """`W(step)^rounds x` for the workers' buffers stacked as the rows of `x` (`[n, m]`, float64), in the
        arithmetic of every exchange of this mixer; and, if `measure_residuals`, the first round's change
        `Σ_j w_ij y_j − y_i` (whose squared row norms are the residuals; else `None`). `dtype` is the buffers'
        own dtype: in low precision each round sends `x` rounded to `dtype`, then to the mixer's `dtype`.
        With `delayed`, the neighbours' rows are those of earlier steps of the exchange `key` (its tag and buffer)."""
        if self.delayed is not None:
            mixed = self.delayed.combine(key, x, step)
            return mixed, (mixed - x if self.measure_residuals else None)
        change = None
        for r in range(rounds):
            before = x
            for matrix, averaged in stages(self.topology, step):
                matrix = matrix.to(x.device)
                if self.dtype is None or averaged.all():
                    x = matrix @ x
                else:  # all-reduces stay in full precision
                    q = x.to(dtype).to(self.dtype).double()
                    x = torch.where(averaged.to(x.device)[:, None], matrix @ x, x + matrix @ q - q)
            if r == 0 and self.measure_residuals:
                change = x - before
        return x, change


class DenseView:
    """A [`Mixer`][lightning_decentral.mixing.Mixer] view of a [`DenseMixer`][lightning_decentral.mixing.DenseMixer]:
    its own observers, the dense mixer's `measure_residuals`."""

    def __init__(self, dense: DenseMixer) -> None:
        self.dense = dense
        self.observers: list[ExchangeObserver] = []

    @property
    def measure_residuals(self) -> bool:
        return self.dense.measure_residuals

    @measure_residuals.setter
    def measure_residuals(self, value: bool) -> None:
        self.dense.measure_residuals = value


class _WorkerMixer(DenseView):
    """Worker `rank`'s [`Mixer`][lightning_decentral.mixing.Mixer] on a shared
    [`DenseMixer`][lightning_decentral.mixing.DenseMixer]."""

    def __init__(self, dense: DenseMixer, rank: int) -> None:
        super().__init__(dense)
        self.rank = rank

    def start_copies_at(self, buffers: Sequence[Tensor], tag: int = 0) -> None:
        """Compressed gossip: this worker's new public copies start at `buffers`
        ([`StartsCopies`][lightning_decentral.mixing.StartsCopies])."""
        if self.dense.chocos:
            self.dense.chocos[self.rank].start_copies_at(buffers, tag)

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Sequence[Tensor] | None = None,
        check_finite: bool = True,
    ) -> _DensePending:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        observers = self.observers + self.dense.observers
        event = None
        if observers:
            event = ExchangeEvent(
                step, tag, rounds, rounds * self.dense.bytes_sent(buffers, self.rank, step), time.perf_counter()
            )
        if check_finite:
            raise_if_not_finite(buffers, self.rank, step, self.dense.phrasing)
        pending = _DensePending(self.dense, self.rank, list(buffers), step, rounds, tag, out, observers, event)
        if not stages(self.dense.topology, step):  # W = I: nothing moves
            for o in out or []:
                o.zero_()
            pending.done = True
        else:
            if self.dense.chocos:  # compressed as on processes: now, from the buffers as they are
                pending.exchange = self.dense.choco_exchange(self.rank, buffers, step, rounds, tag, out)
                pending.messages = pending.exchange.outgoing(0)
            self.dense.post(pending)
        notify_post(observers, event)
        return pending


class _DensePending:
    def __init__(
        self,
        dense: DenseMixer,
        rank: int,
        buffers: list[Tensor],
        step: int,
        rounds: int,
        tag: int,
        out: Sequence[Tensor] | None,
        observers: list[ExchangeObserver],
        event: ExchangeEvent | None,
    ) -> None:
        self.dense = dense
        self.rank = rank
        self.buffers = buffers
        self.step = step
        self.rounds = rounds
        self.tag = tag
        self.out = None if out is None else list(out)
        self.observers = observers
        self.event = event
        self.residuals: list[Tensor] | None = None
        self.exchange: ChocoExchange | None = None  # compressed gossip: this worker's, and its round-one messages
        self.messages: dict[int, Tensor] = {}
        self.done = False
        self._reported = False

    def wait(self) -> None:
        started = time.perf_counter()
        if not self.done:
            self.dense.complete(self.step, self.tag)
        if not self._reported:
            self._reported = True
            notify_wait(self.observers, self.event, started)
