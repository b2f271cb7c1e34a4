"""The mixer protocol the update rules call, and the one public way to watch its exchanges."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_decentral.failures import Survival


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
        neighbour_steps: under bounded staleness, `{j: τ_ij}` after `wait`: the step of each in-neighbour `j`
            (global rank) that was mixed; `None` otherwise.
    """

    step: int
    tag: int
    rounds: int
    bytes_sent: int
    post_started: float
    posted: float = 0.0
    wait_started: float | None = None
    waited: float | None = None
    neighbour_steps: dict[int, int] | None = None


class ExchangeObserver:
    """Told of every exchange of a mixer; override either method.

    Add one with `mixer.observers.append(observer)`, or, in a Trainer, with
    [`strategy.observe`][lightning_decentral.driver.Driven.observe] (this rank's
    exchanges from then on). The methods run on the thread that calls `start` and `wait`, so they
    add to the step time: keep them cheap. Observers must not touch the buffers in flight.

    Examples:
        Count the bytes one step of a ring of 4 sends (each worker: 4 float32 values to each of
        its 2 neighbours):

        >>> from lightning_decentral.mixing import DenseMixer
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


class BytesSent(ExchangeObserver):
    """`total`: the bytes of every exchange posted since it was added (`ExchangeEvent.bytes_sent`, all rounds).

    Examples:
        >>> from lightning_decentral.mixing import DenseMixer
        >>> from lightning_decentral.topology import Ring
        >>> mixer, sent = DenseMixer(Ring(world_size=4)), BytesSent()
        >>> mixer.observers.append(sent)
        >>> pending = [mixer.worker(i).start([torch.zeros(4)], step=0, rounds=2) for i in range(4)]
        >>> sent.total  # each worker: 16 bytes to each of 2 neighbours, twice
        256
    """

    def __init__(self) -> None:
        self.total = 0

    def on_post(self, event: ExchangeEvent) -> None:
        self.total += event.bytes_sent


class Pending(Protocol):
    """An exchange in flight, as `Mixer.start` returns it.

    After `wait()`, `residuals` holds one 0-dim tensor per buffer when the mixer measured them
    (`measure_residuals`), else `None`.
    """

    residuals: list[Tensor] | None

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
        out: Sequence[Tensor] | None = None,
        check_finite: bool = True,
    ) -> Pending:
        """Post round one of `rounds`; the buffers must not be written until `wait()` returns.

        Exchanges in flight at the same time need distinct `tag`s. With `out`, the buffers are only
        read and `out` receives `W^r x − x`. `check_finite`: raise `FloatingPointError` before anything
        is sent if a buffer holds a NaN or an Inf.
        """


@runtime_checkable
class StartsCopies(Protocol):
    """A mixer of compressed gossip whose public copies may start at the models every worker starts from
    ([`Choco.start_copies_at`][lightning_decentral.compression.Choco.start_copies_at]): the outer step's."""

    def start_copies_at(self, buffers: Sequence[Tensor], tag: int = 0) -> None: ...


@dataclass(frozen=True)
class Phrasing:
    """How an error of a mixer speaks of its executor: `worker` (`"Rank"`, `"Worker"`), what becomes of the `others`,
    and how to `clip` the gradients there."""

    worker: str
    others: str
    clip: str


TRAINER = Phrasing("Rank", "the other ranks stop within the process-group timeout", "Trainer(gradient_clip_val=...)")
FABRIC = Phrasing(
    "Rank",
    "the other ranks stop within the process-group timeout",
    "fabric.clip_gradients(model, optimizer, max_norm=...)",
)
SIMULATION = Phrasing("Worker", "the simulation stops with it", "Trainer(gradient_clip_val=...)")


@dataclass
class Watch:
    """What the owner of a run's mixers (the [driver][lightning_decentral.driver.StepDriver]) shares with every mixer it
    builds, handed to each by its constructor: the `observers` told of each exchange, whether exchanges
    `measure_residuals`, how an error speaks of the executor (`phrasing`), and whom to ask when a peer fails
    (`survival`, processes with `on_peer_failure="continue"`). The owner changes its own `Watch`; the mixers read it."""

    observers: list[ExchangeObserver] = field(default_factory=list)
    measure_residuals: bool = False
    phrasing: Phrasing = TRAINER
    survival: Survival | None = None


class Watched:
    """A mixer's view of its [`Watch`][lightning_decentral.mixing.Watch] (`self.watch`): `observers`, `phrasing`,
    `survival`, and `measure_residuals`, which a mixer used alone may also switch itself."""

    watch: Watch

    @property
    def observers(self) -> list[ExchangeObserver]:
        """Told of every exchange (append to add one)."""
        return self.watch.observers

    @property
    def measure_residuals(self) -> bool:
        """Whether the first round records `‖y_i − Σ_j w_ij y_j‖²` per buffer."""
        return self.watch.measure_residuals

    @measure_residuals.setter
    def measure_residuals(self, value: bool) -> None:
        self.watch.measure_residuals = value

    @property
    def phrasing(self) -> Phrasing:
        """How an error of this mixer speaks of its executor."""
        return self.watch.phrasing

    @property
    def survival(self) -> Survival | None:
        """Whom to ask when a peer may have failed (`None`: a failure stops the run)."""
        return self.watch.survival


def raise_if_not_finite(buffers: Sequence[Tensor], rank: int, step: int, phrasing: Phrasing = TRAINER) -> None:
    """Raise `FloatingPointError` if a buffer holds a NaN or an Inf, before it reaches a neighbour; the message
    speaks of worker `rank` as `phrasing` says.

    One reduction per flat buffer (a sum, accumulated in at least float32 so that finite values
    do not overflow; a NaN or Inf anywhere makes it non-finite) and one host sync for them all.

    Examples:
        >>> raise_if_not_finite([torch.tensor([1.0, float("nan")])], rank=2, step=7)
        Traceback (most recent call last):
        ...
        FloatingPointError: Rank 2 holds a NaN or an Inf in what it was about to send to its neighbours at step 7; ...
        >>> raise_if_not_finite([torch.tensor([float("inf")])], rank=2, step=7, phrasing=SIMULATION)
        Traceback (most recent call last):
        ...
        FloatingPointError: Worker 2 holds a NaN or an Inf ... (the simulation stops with it, and the checkpoints ...
    """
    sums = torch.stack([b.sum(dtype=torch.promote_types(b.dtype, torch.float32)).double() for b in buffers])
    if not bool(torch.isfinite(sums).all()):
        raise FloatingPointError(
            f"{phrasing.worker} {rank} holds a NaN or an Inf in what it was about to send to its neighbours at step "
            f"{step}; training stops here, before the values spread ({phrasing.others}, and the checkpoints written "
            f"before this step are intact). Lower the learning rate, clip the gradients ({phrasing.clip}) or look "
            "for the source with torch.autograd.detect_anomaly."
        )


def notify_post(observers: Sequence[ExchangeObserver], event: ExchangeEvent | None) -> None:
    """Stamp `event.posted` and tell `observers` (nothing when there is no event)."""
    if event is not None:
        event.posted = time.perf_counter()
        for observer in observers:
            observer.on_post(event)


def notify_wait(observers: Sequence[ExchangeObserver], event: ExchangeEvent | None, started: float) -> None:
    """Stamp `event.wait_started` and `event.waited` and tell `observers`."""
    if event is not None:
        event.wait_started = started
        event.waited = time.perf_counter()
        for observer in observers:
            observer.on_wait(event)
