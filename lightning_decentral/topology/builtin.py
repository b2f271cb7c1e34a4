"""The built-in graphs: ring, torus, static and one-peer exponential, the one-peer ring, complete."""

from __future__ import annotations

import numpy as np

from lightning_decentral.topology.base import Topology


def _circulant(n: int, weights: dict[int, float]) -> np.ndarray:
    """`W[i, (i + offset) mod n] += weight` for each `offset: weight`."""
    w = np.zeros((n, n))
    rows = np.arange(n)
    for offset, weight in weights.items():
        w[rows, (rows + offset) % n] += weight
    return w


class Ring(Topology, name="ring"):
    """`w_ii = w_i,i±1 = 1/3` (`n = 2`: `1/2, 1/2`; `n = 1`: `[[1]]`).

    `rho = 1/3 + (2/3) cos(2 pi / n)` for `n >= 3`. For `n <= 3` every rank is a neighbour,
    `W = 11ᵀ/n`, and the gossip runs as one all-reduce.

    Examples:
        >>> ring = Ring(world_size=6)
        >>> [j for j, _ in ring.in_neighbors(0, step=0)]
        [1, 5]
        >>> print(f"{ring.spectral_gap():.4f}")  # 1 - (1/3 + (2/3) cos(2 pi / 6))
        0.3333
        >>> Ring(world_size=3).is_average(0)
        True
    """

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n <= 2:
            return np.full((n, n), 1.0 / n)
        return _circulant(n, {0: 1 / 3, 1: 1 / 3, -1: 1 / 3})


def _torus_sizes(limit: int) -> list[int]:
    return [m for m in range(4, limit + 1) if any(m % r == 0 for r in range(2, int(m**0.5) + 1))]


class Torus(Topology, name="torus"):
    """A periodic `rows x cols` grid, rank `i = a * cols + b` at `(a, b)`.

    `W = (I + up + down + left + right) / 5`; where two neighbours are the same rank (`rows`
    or `cols` = 2) their weights add, so `W` stays doubly stochastic.
    `rho = (3 + 2 cos(2 pi / max(rows, cols))) / 5` once `max(rows, cols) >= 4`.

    Args:
        rows: the grid's row count; `None` picks the divisor of `n` closest to `sqrt(n)` with
            `2 <= rows <= cols`.
        world_size: see [`Topology`][lightning_decentral.topology.Topology].

    Examples:
        >>> torus = Torus(world_size=16)  # 4 x 4
        >>> [j for j, _ in torus.in_neighbors(5, step=0)]
        [1, 4, 6, 9]
        >>> print(f"{torus.spectral_gap():.4f}")  # 1 - (3 + 2 cos(2 pi / 4)) / 5
        0.4000
        >>> Torus(world_size=7)
        Traceback (most recent call last):
        ...
        ValueError: A torus needs world_size = rows x cols with rows, cols >= 2, but 7 is prime. ...
    """

    def __init__(self, rows: int | None = None, world_size: int | None = None) -> None:
        self.rows = rows
        self._grid: tuple[int, int] | None = None
        super().__init__(world_size)

    def _on_bind(self, world_size: int) -> None:
        n = world_size
        fits = [r for r in range(2, n // 2 + 1) if n % r == 0]
        if not fits:
            reason = "too small" if n < 4 else "prime"
            raise ValueError(
                f"A torus needs world_size = rows x cols with rows, cols >= 2, but {n} is {reason}. "
                f"World sizes that fit a torus: {_torus_sizes(max(2 * n, 9))}. "
                f"For {n} ranks use 'ring' or 'exponential'."
            )
        if self.rows is None:
            rows = max(r for r in fits if r * r <= n)
        elif self.rows in fits:
            rows = self.rows
        else:
            raise ValueError(
                f"Torus(rows={self.rows}) does not fit {n} ranks: rows must divide the world size with "
                f"rows, cols = {n} / rows >= 2. Rows that fit {n} ranks: {fits}, or leave rows=None."
            )
        self._grid = (rows, n // rows)

    @property
    def grid(self) -> tuple[int, int]:
        """`(rows, cols)` of the bound grid (the rows chosen here when `rows=None`).

        Examples:
            >>> Torus(world_size=12).grid
            (3, 4)
        """
        if self._grid is None:
            raise ValueError(f"{self!r} is not bound to a world size yet: bind it with .bind(world_size) first.")
        return self._grid

    def _matrix(self, step: int) -> np.ndarray:
        rows, cols = self._grid
        index = np.arange(rows * cols).reshape(rows, cols)
        w = np.zeros((rows * cols, rows * cols))
        w[index, index] += 0.2
        for shift, axis in ((1, 0), (-1, 0), (1, 1), (-1, 1)):
            w[index, np.roll(index, shift, axis=axis)] += 0.2
        return w

    def __repr__(self) -> str:
        rows = self.rows if self._grid is None else self._grid[0]
        return f"Torus(rows={rows}, world_size={self._world_size})"


class Exponential(Topology, name="exponential"):
    """Static exponential graph: `W[i, (i + 2^m) mod n] = W[i, i] = 1/(2 + floor(log2(n - 1)))`
    for every `m` with `2^m < n` (`n = 1`: `[[1]]`).

    `rho = 1 - 2/(2 + floor(log2(n - 1)))` when `n` is a power of two.

    Examples:
        >>> graph = Exponential(world_size=8)
        >>> [j for j, _ in graph.in_neighbors(0, step=0)]  # offsets 1, 2, 4
        [1, 2, 4]
        >>> print(f"{graph.spectral_gap():.4f}")  # 2 / (2 + floor(log2 7))
        0.5000
    """

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n == 1:
            return np.ones((1, 1))
        hops = (n - 1).bit_length()  # offsets 2^0 .. 2^(hops-1) < n; hops = 1 + floor(log2(n - 1))
        return _circulant(n, {offset: 1.0 / (1 + hops) for offset in [0] + [2**m for m in range(hops)]})


class OnePeerExponential(Topology, name="one_peer_exponential"):
    """Time-varying one-peer exponential graph, period `tau = ceil(log2 n)`:
    `W(k)[i, i] = W(k)[i, (i + 2^(k mod tau)) mod n] = 1/2`.

    Each rank sends to one peer and receives from one per step. For `n = 2^tau`,
    `W(tau-1) ... W(0) = 11ᵀ/n` exactly, from any starting step.

    Examples:
        >>> graph = OnePeerExponential(world_size=8)
        >>> graph.period
        3
        >>> [graph.in_neighbors(0, step) for step in range(4)]
        [[(1, 0.5)], [(2, 0.5)], [(4, 0.5)], [(1, 0.5)]]
        >>> product = graph.mixing(2) @ graph.mixing(1) @ graph.mixing(0)
        >>> bool(abs(product - 1 / 8).max() < 1e-12)  # one period averages exactly
        True
    """

    @property
    def period(self) -> int:
        return max(1, (self.world_size - 1).bit_length())

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n == 1:
            return np.ones((1, 1))
        return _circulant(n, {0: 0.5, 2**step: 0.5})


class OnePeerRing(Topology, name="one_peer_ring"):
    """A static directed ring: `W[i, i] = W[i, (i + 1) mod n] = 1/2`.

    Each rank receives from one peer and sends to one, at every step: `one_peer_exponential`'s bytes on a graph
    that does not vary, so compressed gossip keeps its public copies current (`compression=` refuses a time-varying
    graph). `W` is doubly stochastic but not symmetric; its eigenvalues are `(1 + e^(2 pi i k / n)) / 2`, so
    consensus contracts by `cos(pi / n)` a step, slower than the ring's `1/3 + (2/3) cos(2 pi / n)`.

    Examples:
        >>> graph = OnePeerRing(world_size=4)
        >>> [graph.in_neighbors(rank, step=0) for rank in range(4)]
        [[(1, 0.5)], [(2, 0.5)], [(3, 0.5)], [(0, 0.5)]]
        >>> graph.period
        1
    """

    def _matrix(self, step: int) -> np.ndarray:
        return _circulant(self.world_size, {0: 0.5, 1: 0.5})


class Complete(Topology, name="complete"):
    """`W = 11ᵀ/n`: the exact average (one all-reduce), `rho = 0`.

    Examples:
        >>> Complete(world_size=4).is_average(0)
        True
    """

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        return np.full((n, n), 1.0 / n)


class RandomMatching(Topology, name="random_matching"):
    """Time-varying random matching (NoLoCo's one random peer per round): at step `k` the ranks are paired by a
    perfect matching drawn from `(seed, k)`, the same on every rank, `W(k)[i, i] = W(k)[i, j] = 1/2` for each pair
    `{i, j}`. With `n` odd the rank left over sits the step out, `W(k)[i, i] = 1`. The draws repeat with `period`.

    The matching of step `k` is `π = permutation(n)` of `numpy.random.default_rng([seed, k])`, pairs
    `{π(2a), π(2a + 1)}`, and `π(n − 1)` alone when `n` is odd. Each rank sends to one peer and receives from it.

    Args:
        seed: the seed of the draws (every rank must pass the same: the ranks compare the topology before training).
        period: the number of distinct matchings, `W(k) = W(k mod period)`.
        world_size: see [`Topology`][lightning_decentral.topology.Topology].

    Examples:
        >>> graph = RandomMatching(world_size=6)
        >>> [graph.in_neighbors(0, step) for step in range(3)] != [graph.in_neighbors(0, 0)] * 3  # a new peer
        True
        >>> all(len(graph.in_neighbors(rank, 5)) == 1 for rank in range(6))  # everyone paired
        True
        >>> odd = RandomMatching(world_size=5)
        >>> sorted(int(odd.mixing(0)[i, i] * 2) for i in range(5))  # one rank sits the step out
        [1, 1, 1, 1, 2]
    """

    def __init__(self, seed: int = 0, period: int = 64, world_size: int | None = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"`seed` must be an integer ≥ 0 (every rank the same), got {seed!r}.")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"`period` must be a positive integer (the distinct matchings), got {period!r}.")
        self.seed = seed
        self._period = period
        super().__init__(world_size)

    @property
    def period(self) -> int:
        return self._period

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        order = np.random.default_rng([self.seed, step]).permutation(n)
        w = np.eye(n)
        for a, b in zip(order[0 : n - 1 : 2], order[1::2]):
            w[[a, a, b, b], [a, b, a, b]] = 0.5
        return w

    def __repr__(self) -> str:
        return f"RandomMatching(seed={self.seed}, period={self._period}, world_size={self._world_size})"
