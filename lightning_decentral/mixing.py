"""Mixers: what the update rules call to apply `W(k)^r` to a replica's flat buffers.

A mixer has one operation, split in two so that computation can run while bytes travel:

```python
pending = mixer.start(buffers, step, rounds)   # post round one of W(step)^rounds
...                                            # forward, backward
pending.wait()                                 # buffers now hold W(step)^rounds x
```

With `out=` the buffers are only read and `out` receives `W^r x − x` (adapt-with-combine's
correction). Two mixers implement it:

* [`Gossip`][lightning_decentral.gossip.Gossip]: rank `i` of `n` processes, over `torch.distributed`;
* [`DenseMixer`][lightning_decentral.mixing.DenseMixer]: all `n` workers in one process, `W` applied
  to their stacked buffers. The rules are tested against the dense reference with it.

Every exchange is published to the mixer's `observers` as an
[`ExchangeEvent`][lightning_decentral.mixing.ExchangeEvent]: the one public way to watch the bytes
and the timing of the communication (the monitors, the tests and the benchmarks use it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_decentral.topology import Hierarchical, Topology


@dataclass
class ExchangeEvent:
    """One exchange as this worker saw it; times are `time.perf_counter()` seconds.

    Attributes:
        step: the optimizer step whose `W(step)` was applied.
        tag: the exchange's tag (DecentLaM: the bucket index; the mixed module buffers come last).
        rounds: rounds of `W(step)`.
        bytes_sent: bytes this worker sends, all rounds together.
        post_started: when `start` was called.
        posted: when `start` returned (round one in flight).
        wait_started: when `wait` was called, `None` before.
        waited: when `wait` returned (the buffers are mixed), `None` before.
    """

    step: int
    tag: int
    rounds: int
    bytes_sent: int
    post_started: float
    posted: float = 0.0
    wait_started: Optional[float] = None
    waited: Optional[float] = None


class ExchangeObserver:
    """Told of every exchange of a mixer; override either method.

    Add one with `mixer.observers.append(observer)`, or, in a Trainer, with
    [`DecentralizedStrategy.observe`][lightning_decentral.DecentralizedStrategy.observe] (this rank's
    exchanges from then on). The methods run on the thread that calls `start` and `wait`, so they
    add to the step time: keep them cheap. Observers must not touch the buffers in flight.

    Examples:
        Count the bytes one step of a ring of 4 sends (each worker: 4 float32 values to each of
        its 2 neighbours):

        >>> from lightning_decentral.topology import Ring
        >>> class Bytes(ExchangeObserver):
        ...     def __init__(self):
        ...         self.sent, self.waited = 0, 0
        ...     def on_post(self, event):
        ...         self.sent += event.bytes_sent
        ...     def on_wait(self, event):
        ...         self.waited += 1
        >>> mixer, count = DenseMixer(Ring(world_size=4)), Bytes()
        >>> mixer.observers.append(count)
        >>> pending = [mixer.worker(i).start([torch.zeros(4)], step=0) for i in range(4)]
        >>> for p in pending:
        ...     p.wait()
        >>> count.sent, count.waited
        (128, 4)
    """

    def on_post(self, event: ExchangeEvent) -> None:
        """`start` has posted the exchange (`event.posted` is set)."""

    def on_wait(self, event: ExchangeEvent) -> None:
        """`wait` has finished it (`event.waited` is set)."""


class Pending(Protocol):
    """An exchange in flight, as `Mixer.start` returns it.

    After `wait()`, `residuals` holds one 0-dim tensor per buffer when the mixer measured them
    (`measure_residuals`), else `None`.
    """

    residuals: Optional[list[Tensor]]

    def wait(self) -> None:
        """Finish the exchange and combine."""


class Mixer(Protocol):
    """`x <- W(step)^rounds x` on one worker's flat buffers (see the module docstring).

    Implemented by [`Gossip`][lightning_decentral.gossip.Gossip] (one process per worker) and by
    `DenseMixer.worker(i)` (all workers in one process). `observers` are told of every exchange;
    `measure_residuals` makes the first round record `‖y_i − Σ_j w_ij y_j‖²` per buffer in
    `Pending.residuals`.
    """

    observers: list[ExchangeObserver]
    measure_residuals: bool

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Optional[Sequence[Tensor]] = None,
        check_finite: bool = True,
    ) -> Pending:
        """Post round one of `rounds`; the buffers must not be written until `wait()` returns.

        Exchanges in flight at the same time need distinct `tag`s. With `out`, the buffers are only
        read and `out` receives `W^r x − x`. `check_finite`: raise `FloatingPointError` before anything
        is sent if a buffer holds a NaN or an Inf.
        """


def raise_if_not_finite(buffers: Sequence[Tensor], rank: int, step: int) -> None:
    """Raise `FloatingPointError` if a buffer holds a NaN or an Inf, before it reaches a neighbour.

    One reduction per flat buffer (a sum, accumulated in at least float32 so that finite values
    do not overflow; a NaN or Inf anywhere makes it non-finite) and one host sync for them all.

    Examples:
        >>> raise_if_not_finite([torch.tensor([1.0, float("nan")])], rank=2, step=7)
        Traceback (most recent call last):
        ...
        FloatingPointError: Rank 2 holds a NaN or an Inf in what it was about to send to its neighbours at step 7; ...
    """
    sums = torch.stack([b.sum(dtype=torch.promote_types(b.dtype, torch.float32)).double() for b in buffers])
    if not bool(torch.isfinite(sums).all()):
        raise FloatingPointError(
            f"Rank {rank} holds a NaN or an Inf in what it was about to send to its neighbours at step {step}; "
            "training stops here, before the values spread (the other ranks stop within the process-group "
            "timeout, and the checkpoints written before this step are intact). Lower the learning rate, clip "
            "the gradients (Trainer(gradient_clip_val=...)) or look for the source with torch.autograd.detect_anomaly."
        )


def notify_post(observers: Sequence[ExchangeObserver], event: Optional[ExchangeEvent]) -> None:
    """Stamp `event.posted` and tell `observers` (nothing when there is no event)."""
    if event is not None:
        event.posted = time.perf_counter()
        for observer in observers:
            observer.on_post(event)


def notify_wait(observers: Sequence[ExchangeObserver], event: Optional[ExchangeEvent], started: float) -> None:
    """Stamp `event.wait_started` and `event.waited` and tell `observers`."""
    if event is not None:
        event.wait_started, event.waited = started, time.perf_counter()
        for observer in observers:
            observer.on_wait(event)


def stages(topology: Topology, step: int) -> list[tuple[Tensor, bool]]:
    """The exchanges of one round at `step`, in order, each `(W, exact average)`, `W` float64.

    `[W(step)]`, or for a [`Hierarchical`][lightning_decentral.topology.Hierarchical] topology with `m`
    ranks per node `[I_N ⊗ W_in, W_out ⊗ I_m]` (identity factors left out), as the gossip engine runs them.
    """
    if topology.is_identity(step):
        return []
    if not isinstance(topology, Hierarchical) or topology.is_average(step):
        return [(torch.from_numpy(topology.mixing(step).copy()), topology.is_average(step))]
    m, nodes = topology.node_size, topology.num_nodes
    parts = (
        (topology.inner_topology, lambda w: torch.kron(torch.eye(nodes, dtype=w.dtype), w)),
        (topology.outer_topology, lambda w: torch.kron(w, torch.eye(m, dtype=w.dtype))),
    )
    return [
        (widen(torch.from_numpy(part.mixing(step).copy())), part.is_average(step))
        for part, widen in parts
        if not part.is_identity(step)
    ]


class DenseMixer:
    """All `n` workers' exchanges in one process: `W(step)` applied to their stacked buffers.

    Each worker talks to its own view, `mixer.worker(i)`, exactly as rank `i` talks to a
    [`Gossip`][lightning_decentral.gossip.Gossip]. An exchange is computed when the first worker waits
    for it, so every worker must `start` it before any waits (a single-process executor runs the
    workers phase by phase). In low precision (`dtype`) a round is `x <- x + W q − q` with `q`
    the buffers rounded to `dtype`; exact averages stay in full precision, as on processes.

    Args:
        topology: a topology bound to `n` workers.
        dtype: the precision messages travel in; `None`: the buffers' own.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> mixer = DenseMixer(Ring(world_size=3))
        >>> x = [torch.tensor([3.0 * i]) for i in range(3)]
        >>> pending = [mixer.worker(i).start([x[i]], step=0) for i in range(3)]
        >>> for p in pending: p.wait()
        >>> [round(v.item(), 4) for v in x]   # W = 11ᵀ/3 on a ring of 3: everyone holds the mean
        [3.0, 3.0, 3.0]
    """

    def __init__(self, topology: Topology, dtype: Optional[torch.dtype] = None) -> None:
        self.topology = topology
        self.dtype = dtype
        self.observers: list[ExchangeObserver] = []
        self.measure_residuals = False
        self._posted: dict[tuple[int, int], dict[int, _DensePending]] = {}

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
        total = 0
        for matrix, average in stages(self.topology, step):
            size = sum(b.numel() * b.element_size() for b in buffers)
            if average:
                n = self.topology.world_size
                total += size * 2 * (n - 1) // n
            else:
                wire = sum(b.numel() * (self.dtype or b.dtype).itemsize for b in buffers)
                column = matrix[:, rank]
                total += wire * int(((column > 0) & (torch.arange(len(column)) != rank)).sum())
        return total

    def _post(self, pending: _DensePending) -> None:
        posted = self._posted.setdefault((pending.step, pending.tag), {})
        if pending.rank in posted:
            raise RuntimeError(f"Worker {pending.rank} started exchange (step {pending.step}, tag {pending.tag}) twice.")
        posted[pending.rank] = pending

    def _complete(self, step: int, tag: int) -> None:
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
        for index in range(len(order[0].buffers)):
            x = torch.stack([p.buffers[index].detach().reshape(-1) for p in order]).double()
            mixed, change = self.mix(x, step, order[0].rounds, order[0].buffers[index].dtype)
            residuals = change.square().sum(1) if change is not None else [None] * n
            for worker, row, original, residual in zip(order, mixed, x, residuals):
                target = worker.out[index] if worker.out is not None else worker.buffers[index]
                value = row - original if worker.out is not None else row
                target.copy_(value.view_as(target).to(target.dtype))
                if residual is not None:
                    worker.residuals = (worker.residuals or []) + [residual]
        for worker in order:
            worker.done = True

    def mix(self, x: Tensor, step: int, rounds: int, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
        """`W(step)^rounds x` for the workers' buffers stacked as the rows of `x` (`[n, m]`, float64), in the
        arithmetic of every exchange of this mixer; and, if `measure_residuals`, the first round's change
        `Σ_j w_ij y_j − y_i` (whose squared row norms are the residuals; else `None`). `dtype` is the buffers'
        own dtype: in low precision each round sends `x` rounded to `dtype`, then to the mixer's `dtype`."""
        change = None
        for r in range(rounds):
            before = x
            for matrix, average in stages(self.topology, step):
                if self.dtype is None or average:
                    x = matrix.to(x.device) @ x
                else:
                    q = x.to(dtype).to(self.dtype).double()
                    x = x + matrix.to(x.device) @ q - q
            if r == 0 and self.measure_residuals:
                change = x - before
        return x, change

    def all_workers(self) -> StackedMixer:
        """A [`Mixer`][lightning_decentral.mixing.Mixer] over every worker at once (see
        [`StackedMixer`][lightning_decentral.mixing.StackedMixer]), sharing this mixer's observers."""
        return StackedMixer(self)


class _DenseView:
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


class StackedMixer(_DenseView):
    """Every worker's exchange in one call: each buffer holds the `n` workers' buffers as consecutive rows
    (a `[n, ...]` tensor, flat), and `start` applies `W(step)^rounds` to its rows at once, as
    [`DenseMixer`][lightning_decentral.mixing.DenseMixer] does for `n` separate buffers. The vectorized
    simulation's rules run on it. Each exchange is one
    [`ExchangeEvent`][lightning_decentral.mixing.ExchangeEvent] whose `bytes_sent` is all workers' together;
    a residual is the sum over the workers.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> x = torch.tensor([[0.0, 3.0], [3.0, 6.0], [6.0, 0.0]])   # 3 workers' buffers, as rows
        >>> DenseMixer(Ring(world_size=3)).all_workers().start([x.view(-1)], step=0).wait()
        >>> x                                                         # W = 11ᵀ/3: every row is the mean
        tensor([[3., 3.],
                [3., 3.],
                [3., 3.]])
    """

    def __init__(self, dense: DenseMixer) -> None:
        super().__init__(dense)
        self._space: dict[int, Tensor] = {}

    def _workspace(self, slot: int, n: int, width: int, device: torch.device) -> Tensor:
        """A float64 `[n, width]` tensor kept for reuse (allocating tens of MB per exchange costs page faults)."""
        space = self._space.get(slot)
        if space is None or space.numel() < n * width or space.device != device:
            space = self._space[slot] = torch.empty(n * width, dtype=torch.float64, device=device)
        return space[: n * width].view(n, width)

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Optional[Sequence[Tensor]] = None,
        check_finite: bool = True,
    ) -> _Mixed:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        n = self.dense.topology.world_size
        rows = [b.view(n, -1) for b in buffers]
        observers = self.observers + self.dense.observers
        event = None
        if observers:
            sent = sum(self.dense.bytes_sent([r[0] for r in rows], rank, step) for rank in range(n))
            event = ExchangeEvent(step, tag, rounds, rounds * sent, time.perf_counter())
        if check_finite:
            _raise_if_a_row_not_finite(rows, step)
        residuals: Optional[list[Tensor]] = None
        if not stages(self.dense.topology, step):  # W = I: nothing moves
            for o in out or []:
                o.zero_()
        else:
            found: dict[int, Tensor] = {}  # buffer index -> its residual
            for group in _same_dtype(range(len(rows)), lambda i: rows[i].dtype):
                # one product for the buffers of one dtype, in float64 work space kept from call to call
                widths = [rows[i].shape[1] for i in group]
                x = self._workspace(0, n, sum(widths), rows[group[0]].device)
                for part, i in zip(x.split(widths, dim=1), group):
                    part.copy_(rows[i])
                mixed, change = self._mix(x, step, rounds, rows[group[0]].dtype, correction=out is not None)
                for i, part in zip(group, mixed.split(widths, dim=1)):
                    (out[i].view(n, -1) if out is not None else rows[i]).copy_(part)
                if change is not None:
                    found.update((i, part.square().sum()) for i, part in zip(group, change.split(widths, dim=1)))
            residuals = [found[i] for i in range(len(rows))] if found else None
        notify_post(observers, event)
        return _Mixed(residuals, observers, event)

    def _mix(self, x: Tensor, step: int, rounds: int, dtype: torch.dtype, correction: bool) -> tuple[Tensor, Optional[Tensor]]:
        """[`DenseMixer.mix`][lightning_decentral.mixing.DenseMixer.mix] of `x`, or `W x − x` if `correction`. One
        round of one full-precision `W` (the common case) is one product into work space, `(W − I) x` for the
        correction: no tens-of-MB temporaries per step."""
        plan = stages(self.dense.topology, step)
        if rounds > 1 or len(plan) > 1 or self.measure_residuals or not (self.dense.dtype is None or plan[0][1]):
            mixed, change = self.dense.mix(x, step, rounds, dtype)
            return (mixed - x if correction else mixed), change
        matrix = plan[0][0] - torch.eye(len(x), dtype=torch.float64) if correction else plan[0][0]
        return torch.mm(matrix.to(x.device), x, out=self._workspace(1, len(x), x.shape[1], x.device)), None


class _Mixed:
    """A [`StackedMixer`][lightning_decentral.mixing.StackedMixer] exchange: done when posted."""

    def __init__(self, residuals: Optional[list[Tensor]], observers: list[ExchangeObserver], event: Optional[ExchangeEvent]) -> None:
        self.residuals, self.observers, self.event = residuals, observers, event
        self._reported = False

    def wait(self) -> None:
        if not self._reported:
            self._reported = True
            notify_wait(self.observers, self.event, time.perf_counter())


def _same_dtype(indices: Iterable[int], dtype_of: Callable[[int], torch.dtype]) -> list[list[int]]:
    """`indices` grouped by `dtype_of`, in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i in indices:
        groups.setdefault(dtype_of(i), []).append(i)
    return list(groups.values())


def _raise_if_a_row_not_finite(rows: Sequence[Tensor], step: int) -> None:
    """`raise_if_not_finite` for stacked workers (`[n, m]` rows), naming the first worker whose row is not finite."""
    sums = torch.stack([r.sum(1, dtype=torch.promote_types(r.dtype, torch.float32)).double() for r in rows]).sum(0)
    bad = torch.nonzero(~torch.isfinite(sums))
    if len(bad):
        worker = int(bad[0])
        raise_if_not_finite([r[worker] for r in rows], worker, step)


class _WorkerMixer(_DenseView):
    """Worker `rank`'s [`Mixer`][lightning_decentral.mixing.Mixer] on a shared [`DenseMixer`][lightning_decentral.mixing.DenseMixer]."""

    def __init__(self, dense: DenseMixer, rank: int) -> None:
        super().__init__(dense)
        self.rank = rank

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Optional[Sequence[Tensor]] = None,
        check_finite: bool = True,
    ) -> _DensePending:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        observers = self.observers + self.dense.observers
        event = None
        if observers:
            event = ExchangeEvent(step, tag, rounds, rounds * self.dense.bytes_sent(buffers, self.rank, step), time.perf_counter())
        if check_finite:
            raise_if_not_finite(buffers, self.rank, step)
        pending = _DensePending(self.dense, self.rank, list(buffers), step, rounds, tag, out, observers, event)
        if not stages(self.dense.topology, step):  # W = I: nothing moves
            for o in out or []:
                o.zero_()
            pending.done = True
        else:
            self.dense._post(pending)
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
        out: Optional[Sequence[Tensor]],
        observers: list[ExchangeObserver],
        event: Optional[ExchangeEvent],
    ) -> None:
        self.dense, self.rank, self.buffers, self.step, self.rounds, self.tag = dense, rank, buffers, step, rounds, tag
        self.out = None if out is None else list(out)
        self.observers, self.event = observers, event
        self.residuals: Optional[list[Tensor]] = None
        self.done = False
        self._reported = False

    def wait(self) -> None:
        started = time.perf_counter()
        if not self.done:
            self.dense._complete(self.step, self.tag)
        if not self._reported:
            self._reported = True
            notify_wait(self.observers, self.event, started)
