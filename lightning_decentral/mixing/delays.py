"""Which step of each neighbour a worker mixes with under bounded staleness, and that mixing for workers in one process.

With `staleness=s`, worker `i` at step `k` mixes with the replica its neighbour `j` had at step
`τ_ij(k) ∈ [max(k − s, k₀), k]` (`k₀`: the run's first step; docs/algorithms.md, "Bounded staleness"). On
processes `τ` is the newest step received, unless a [`DelaySchedule`][lightning_decentral.mixing.DelaySchedule]
imposes it: `τ_ij(k) = max(k − d, k₀)` with `d = delays(i, j, k, s)`. In one process
([`DelayedMixing`][lightning_decentral.mixing.DelayedMixing]) a schedule always says which step: a run of the
simulation equals the processes run under the same schedule.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_decentral.topology import Hierarchical, Topology


@runtime_checkable
class DelaySchedule(Protocol):
    """`delays(worker, neighbour, step, staleness) -> d`, `0 ≤ d ≤ staleness`: worker `worker` mixes, at optimizer
    step `step`, with the replica `neighbour` had at step `step − d` (at the run's first step if that is earlier).

    Any function of these four integers is a schedule (a table of a test, a model of stragglers); it must give
    the same `d` on every process that asks. [`RandomDelays`][lightning_decentral.mixing.RandomDelays] draws them.
    """

    def __call__(self, worker: int, neighbour: int, step: int, staleness: int) -> int: ...


@dataclass(frozen=True)
class RandomDelays:
    """Delays drawn uniformly from `{0, …, staleness}`, independently for every worker, neighbour and step, from
    `seed`: the same on every process and in the simulation (a hash of the seed, the worker, the neighbour and the step;
    no generator state).

    Args:
        seed: the schedule's seed.

    Examples:
        >>> delays = RandomDelays(seed=3)
        >>> [delays(0, 1, step, staleness=2) for step in range(8)]
        [2, 2, 2, 2, 2, 0, 1, 2]
        >>> delays(0, 1, 7, staleness=2) == RandomDelays(seed=3)(0, 1, 7, 2), delays(0, 1, 7, staleness=0)
        (True, 0)
    """

    seed: int = 0

    def __call__(self, worker: int, neighbour: int, step: int, staleness: int) -> int:
        key = b"".join(int(v).to_bytes(8, "little", signed=True) for v in (self.seed, worker, neighbour, step))
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (staleness + 1)


def check_stale_topology(topology: Topology, staleness: int) -> None:
    """Raise `ValueError` naming the fix unless `staleness=staleness` can run on `topology`: one static `W` (period
    1), exchanged point to point with each neighbour (not the two levels of a hierarchical topology).

    Examples:
        >>> from lightning_decentral.topology import Complete, OnePeerExponential
        >>> check_stale_topology(Complete(world_size=4), staleness=2)  # point to point with the 3 others
        >>> check_stale_topology(OnePeerExponential(world_size=4), staleness=2)
        Traceback (most recent call last):
        ...
        ValueError: staleness=2 needs one static W (ring, torus, exponential, complete, a matrix or a graph);
        OnePeerExponential(world_size=4) ...
    """
    if staleness and (topology.period != 1 or isinstance(topology, Hierarchical)):
        raise ValueError(
            f"staleness={staleness} needs one static W (ring, torus, exponential, complete, a matrix or a graph); "
            f"{topology!r} changes with the step or has two levels. Choose such a topology, or staleness=0."
        )


def imposed_step(delays: DelaySchedule, worker: int, neighbour: int, step: int, staleness: int, first: int) -> int:
    """`τ = max(step − d, first)` with `d = delays(worker, neighbour, step, staleness)`; a `d` outside
    `[0, staleness]` raises `ValueError` naming the schedule's fix.

    Examples:
        >>> (imposed_step(lambda i, j, k, s: 2, 0, 1, step=5, staleness=2, first=0),
        ...  imposed_step(RandomDelays(), 0, 1, 1, 2, first=1))
        (3, 1)
    """
    d = delays(worker, neighbour, step, staleness)
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= staleness:
        raise ValueError(
            f"The delay schedule gave d={d!r} for worker {worker}, neighbour {neighbour} at step {step}: a delay is an "
            f"integer in [0, staleness={staleness}]. Fix the schedule, or raise `staleness`."
        )
    return max(step - d, first)


class DelayedMixing:
    """`W(k)` with delays for `n` workers in one process: `y_i <- w_ii y_i(k) + Σ_{j≠i} w_ij y_j(τ_ij(k))`.

    Keeps, for each exchanged buffer, the stacked rows `Y(t)` posted at the last `staleness` steps; `τ` comes from
    the schedule ([`imposed_step`][lightning_decentral.mixing.delays.imposed_step]), `k₀` is the first step it mixed (a
    run, a fit or a resume, makes a new one). The dense mixers call
    [`combine`][lightning_decentral.mixing.DelayedMixing.combine] instead of `W(k) Y(k)`.

    Args:
        topology: a topology bound to `n` workers.
        staleness: `s`, the most steps a neighbour's replica may be behind.
        delays: the schedule of `d = k − τ`; `None`: `d = 0` everywhere (the synchronous rule).

    Examples:
        Three workers on a ring (`W = 11ᵀ/3`) that all mix with their neighbours' step `k − 1`:

        >>> from lightning_decentral.topology import Ring
        >>> mixing = DelayedMixing(Ring(world_size=3), staleness=1, delays=lambda i, j, k, s: 1)
        >>> mixing.combine("x", torch.tensor([[0.0], [3.0], [6.0]], dtype=torch.float64), step=0).flatten().tolist()
        [3.0, 3.0, 3.0]
        >>> mixing.combine("x", torch.tensor([[3.0], [3.0], [9.0]], dtype=torch.float64), step=1).flatten().tolist()
        [4.0, 3.0, 4.0]
    """

    def __init__(self, topology: Topology, staleness: int, delays: DelaySchedule | None = None) -> None:
        self.topology = topology
        self.staleness = staleness
        self.delays = delays
        self._history: dict[object, dict[int, Tensor]] = {}
        self._first: int | None = None

    def taus(self, step: int) -> dict[tuple[int, int], int]:
        """`{(i, j): τ_ij(step)}` for every edge `j → i` of `W(step)` (`j ≠ i`)."""
        first = step if self._first is None else self._first
        matrix = self.topology.mixing(step)
        n = len(matrix)
        return {
            (i, j): step if self.delays is None else imposed_step(self.delays, i, j, step, self.staleness, first)
            for i in range(n)
            for j in range(n)
            if j != i and matrix[i, j] != 0
        }

    def combine(self, key: object, rows: Tensor, step: int) -> Tensor:
        """`Σ_t W⁽ᵗ⁾(step) Y(t)` for the buffer `key` whose rows (one per worker, float64) were posted at `step`,
        where `W⁽ᵗ⁾_ij = w_ij` on the edges with `τ_ij(step) = t` and the diagonal `w_ii` is in `W⁽ˢᵗᵉᵖ⁾`."""
        if self._first is None:
            self._first = step
        history = self._history.setdefault(key, {})
        history[step] = rows.clone()
        for old in [t for t in history if t < step - self.staleness]:
            del history[old]
        matrix = torch.from_numpy(self.topology.mixing(step).copy()).to(rows.device)
        parts = {step: torch.diag(torch.diagonal(matrix))}
        for (i, j), tau in self.taus(step).items():
            parts.setdefault(tau, torch.zeros_like(matrix))[i, j] = matrix[i, j]
        return sum(part @ history[tau] for tau, part in parts.items())
