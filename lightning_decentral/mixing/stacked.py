"""Every worker's exchange in one call, over rows of stacked tensors:
[`StackedMixer`][lightning_decentral.mixing.StackedMixer]."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from lightning_decentral.mixing.dense import DenseMixer, DenseView, stages
from lightning_decentral.mixing.protocol import (
    ExchangeEvent,
    ExchangeObserver,
    Phrasing,
    notify_post,
    notify_wait,
    raise_if_not_finite,
)


class StackedMixer(DenseView):
    """Every worker's exchange in one call: each buffer holds the `n` workers' buffers as consecutive rows
    (a `[n, ...]` tensor, flat), and `start` applies `W(step)^rounds` to its rows at once, as
    [`DenseMixer`][lightning_decentral.mixing.DenseMixer] does for `n` separate buffers. The vectorized
    simulation's rules run on it. Each exchange is one
    [`ExchangeEvent`][lightning_decentral.mixing.ExchangeEvent] whose `bytes_sent` is all workers' together;
    a residual is the sum over the workers.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> x = torch.tensor([[0.0, 3.0], [3.0, 6.0], [6.0, 0.0]])   # 3 workers' buffers, as rows
        >>> StackedMixer(DenseMixer(Ring(world_size=3))).start([x.view(-1)], step=0).wait()
        >>> x                                                         # W = 11ᵀ/3: every row is the mean
        tensor([[3., 3.],
                [3., 3.],
                [3., 3.]])
    """

    def __init__(self, dense: DenseMixer) -> None:
        if dense.chocos:
            raise ValueError("Compressed gossip compresses each worker's flat buffers: run it on DenseMixer.worker(i).")
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
        out: Sequence[Tensor] | None = None,
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
            _raise_if_a_row_not_finite(rows, step, self.dense.phrasing)
        residuals: list[Tensor] | None = None
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
                key = (tag, tuple(group))
                mixed, change = self._mix(x, step, rounds, rows[group[0]].dtype, out is not None, key)
                for i, part in zip(group, mixed.split(widths, dim=1)):
                    (out[i].view(n, -1) if out is not None else rows[i]).copy_(part)
                if change is not None:
                    found.update((i, part.square().sum()) for i, part in zip(group, change.split(widths, dim=1)))
            residuals = [found[i] for i in range(len(rows))] if found else None
        notify_post(observers, event)
        return _Mixed(residuals, observers, event)

    def _mix(
        self, x: Tensor, step: int, rounds: int, dtype: torch.dtype, correction: bool, key: object
    ) -> tuple[Tensor, Tensor | None]:
        """[`DenseMixer.mix`][lightning_decentral.mixing.DenseMixer.mix] of `x` (the exchange `key`), or `W x − x` if
        `correction`. One round of one full-precision `W` (the common case) is one product into work space,
        `(W − I) x` for the correction: no tens-of-MB temporaries per step."""
        plan = stages(self.dense.topology, step)
        general = rounds > 1 or len(plan) > 1 or self.measure_residuals or self.dense.delayed is not None
        if general or not (self.dense.dtype is None or plan[0][1].all()):
            mixed, change = self.dense.mix(x, step, rounds, dtype, key)
            return (mixed - x if correction else mixed), change
        matrix = plan[0][0] - torch.eye(len(x), dtype=torch.float64) if correction else plan[0][0]
        return torch.mm(matrix.to(x.device), x, out=self._workspace(1, len(x), x.shape[1], x.device)), None


class _Mixed:
    """A [`StackedMixer`][lightning_decentral.mixing.StackedMixer] exchange: done when posted."""

    def __init__(
        self, residuals: list[Tensor] | None, observers: list[ExchangeObserver], event: ExchangeEvent | None
    ) -> None:
        self.residuals = residuals
        self.observers = observers
        self.event = event
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


def _raise_if_a_row_not_finite(rows: Sequence[Tensor], step: int, phrasing: Phrasing) -> None:
    """`raise_if_not_finite` for stacked workers (`[n, m]` rows), naming the first worker whose row is not finite."""
    sums = torch.stack([r.sum(1, dtype=torch.promote_types(r.dtype, torch.float32)).double() for r in rows]).sum(0)
    bad = torch.nonzero(~torch.isfinite(sums))
    if len(bad):
        worker = int(bad[0])
        raise_if_not_finite([r[worker] for r in rows], worker, step, phrasing)
