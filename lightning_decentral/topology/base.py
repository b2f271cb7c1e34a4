"""The base class of every topology: binding to a world size, the matrices, neighbours, validation."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

_SUM_TOL = 1e-6  # row / column sums of W must be 1 to within this
_EXACT_TOL = 1e-12  # W counts as 11ᵀ/n or I to within this
_MH_HINT = (
    "Metropolis-Hastings weights make any connected undirected graph doubly stochastic: "
    "pass GraphTopology(networkx_graph)."
)


TOPOLOGIES: dict[str, type[Topology]] = {}
"""The topologies by name, as `DecentralizedStrategy(topology=...)` accepts them: every subclass declared with a
name (`class Ring(Topology, name="ring")`), the built-in ones first."""


def topology_class(name: str) -> type[Topology]:
    """The topology registered as `name`.

    Examples:
        >>> topology_class("ring")
        <class 'lightning_decentral.topology.builtin.Ring'>
        >>> topology_class("rign")
        Traceback (most recent call last):
        ...
        ValueError: Unknown topology 'rign'. Choose one of ['complete', ...], or pass ... The closest name is 'ring'.
    """
    if name not in TOPOLOGIES:
        close = difflib.get_close_matches(name, list(TOPOLOGIES), n=1)
        raise ValueError(
            f"Unknown topology {name!r}. Choose one of {sorted(TOPOLOGIES)}, or pass a Topology, "
            "a mixing matrix or a networkx graph." + (f" The closest name is {close[0]!r}." if close else "")
        )
    return TOPOLOGIES[name]


def metropolis_hastings(adjacency: np.ndarray) -> np.ndarray:
    """The Metropolis-Hastings mixing matrix of a symmetric boolean adjacency matrix (the diagonal is ignored):
    `w_ij = 1 / (1 + max(d_i, d_j))` on each edge, `w_ii = 1 - Σ_j w_ij`, `d_i` the degree of node `i`.

    Examples:
        >>> print(3 * metropolis_hastings(np.array([[0, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=bool)))  # a star
        [[1. 1. 1.]
         [1. 2. 0.]
         [1. 0. 2.]]
    """
    adjacency = np.asarray(adjacency, dtype=bool) & ~np.eye(len(adjacency), dtype=bool)
    degree = adjacency.sum(axis=1)
    w = np.where(adjacency, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
    w[np.diag_indices(len(w))] = 1.0 - w.sum(axis=1)
    return w


class _Phase(NamedTuple):
    matrix: np.ndarray
    average: bool
    identity: bool


class Topology:
    """A sequence of doubly stochastic mixing matrices `W(k)`, `k` = optimizer step.

    Subclasses define `_matrix(step)` for `0 <= step < period` and, if the matrices vary
    with `k`, [`period`][lightning_decentral.topology.Topology.period]. A subclass declared with a
    name, `class Pairs(Topology, name="pairs")`, is registered in
    [`TOPOLOGIES`][lightning_decentral.topology.TOPOLOGIES]: `topology="pairs"` then selects it.

    Args:
        world_size: the number of ranks `n`; `None` leaves it unbound until
            [`bind`][lightning_decentral.topology.Topology.bind] (the strategy binds it to the
            world size).

    Examples:
        >>> import numpy as np
        >>> class Pairs(Topology):  # ranks 2a and 2a + 1 average
        ...     def _matrix(self, step):
        ...         return np.kron(np.eye(self.world_size // 2), np.full((2, 2), 0.5))
        >>> Pairs().bind(4)
        Traceback (most recent call last):
        ...
        ValueError: The mixing matrices are not connected: information from rank 0 never reaches ranks [2, 3], ...
    """

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            TOPOLOGIES[name] = cls

    def __init__(self, world_size: int | None = None) -> None:
        self._world_size: int | None = None
        self._phases: dict[int, _Phase] = {}
        if world_size is not None:
            self._attach(world_size)

    # -- to implement -------------------------------------------------------------

    def _matrix(self, step: int) -> np.ndarray:
        """`W(step)` for `0 <= step < period`, `n x n` float64."""
        raise NotImplementedError

    @property
    def period(self) -> int:
        """The number of distinct matrices: `W(k) = W(k mod period)` (1 for a static `W`)."""
        return 1

    def _on_bind(self, world_size: int) -> None:
        """Check that `world_size` suits this topology and set what depends on it."""

    def _mismatch_hint(self, world_size: int) -> str:
        return f"create it with world_size={world_size}, or leave world_size unset"

    def on_nodes(self, num_nodes: int) -> Topology:
        """This topology laid out on a job of `num_nodes` nodes (most topologies ignore the nodes: `self`)."""
        return self

    def _resized(self, world_size: int) -> Topology | None:
        """This topology's own kind on `world_size` ranks, or `None` if it has no other size (a given matrix) or
        does not fit that one (a torus of a prime number of ranks)."""
        resized = copy.copy(self)
        resized._world_size = None
        try:
            return resized.bind(world_size)
        except ValueError:
            return None

    # -- binding ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The number of ranks `n` this topology is bound to."""
        if self._world_size is None:
            raise ValueError(
                f"{type(self).__name__} is not bound to a world size yet; bind it with "
                ".bind(world_size) or pass world_size= when creating it."
            )
        return self._world_size

    @property
    def is_bound(self) -> bool:
        """Whether the world size is set (`world_size=` when created, or `bind`).

        Examples:
            >>> from lightning_decentral.topology import Ring
            >>> Ring().is_bound, Ring().bind(4).is_bound
            (False, True)
        """
        return self._world_size is not None

    def bind(self, world_size: int) -> Topology:
        """This topology for `world_size` ranks, validated.

        Returns `self` if it is already bound to `world_size`, otherwise a bound copy; a
        topology bound to another size raises `ValueError`.

        Examples:
            >>> from lightning_decentral.topology import Ring
            >>> Ring().bind(8)
            Ring(world_size=8)
            >>> Ring(world_size=4).bind(8)
            Traceback (most recent call last):
            ...
            ValueError: Ring(world_size=4) is bound to 4 ranks but the world size is 8: ...
        """
        if not self.is_bound:
            bound = copy.copy(self)
            bound._attach(world_size)
            return bound
        if world_size != self._world_size:
            raise ValueError(
                f"{self!r} is bound to {self._world_size} ranks but the world size is "
                f"{world_size}: {self._mismatch_hint(world_size)}."
            )
        return self

    def for_members(self, members: Sequence[int]) -> Topology:
        """`W` for the ranks `members` of this topology alone (the survivors of a failure), member `members[i]`
        becoming rank `i`, validated.

        The rule: a topology that exists at every size (the named ones) is rebuilt at the new size (a ring of
        `n - 1`, a one-peer exponential graph over `n - 1`, ...); anything else (a matrix or a graph, a torus that
        does not fit) becomes the subgraph the members induce, each `W(k)`'s edges (`w_ij > 0` or `w_ji > 0`)
        among them, reweighted by Metropolis-Hastings, `w_ij = 1 / (1 + max(d_i, d_j))`, `w_ii = 1 - Σ_j w_ij`:
        symmetric, so doubly stochastic. A [`Hierarchical`][lightning_decentral.topology.Hierarchical] topology
        keeps its levels: the lost ranks leave their nodes. A subgraph that falls apart raises `ValueError`.

        Examples:
            >>> from lightning_decentral.topology import MatrixTopology, Ring
            >>> Ring(world_size=5).for_members([0, 1, 3, 4])
            Ring(world_size=4)
            >>> path = MatrixTopology([[0.5, 0.5, 0, 0], [0.5, 0.25, 0.25, 0],
            ...                        [0, 0.25, 0.5, 0.25], [0, 0, 0.25, 0.75]])
            >>> print(path.for_members([0, 1, 2]).mixing(0))  # the path 0-1-2: Metropolis-Hastings weights
            [[0.66666667 0.33333333 0.        ]
             [0.33333333 0.33333333 0.33333333]
             [0.         0.33333333 0.66666667]]
        """
        members = self._checked_members(members)
        if members == list(range(self.world_size)):
            return self
        return self._resized(len(members)) or InducedSubgraph(self, members)

    def _checked_members(self, members: Sequence[int]) -> list[int]:
        checked = [int(m) for m in members]
        n = self.world_size
        if not checked or checked != sorted(set(checked)) or not 0 <= checked[0] <= checked[-1] < n:
            raise ValueError(
                f"members must be ranks in [0, {n}) in increasing order, at least one, got {list(members)}."
            )
        return checked

    def _attach(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
        self._world_size = int(world_size)
        self._phases = {}
        self._on_bind(self._world_size)
        self.validate()

    # -- the matrices -------------------------------------------------------------

    def _phase(self, step: int) -> _Phase:
        key = step % self.period
        phase = self._phases.get(key)
        if phase is None:
            w = np.asarray(self._matrix(key), dtype=np.float64)
            n = self.world_size
            if w.shape != (n, n):
                name = "W" if self.period == 1 else f"W({key})"
                raise ValueError(
                    f"The mixing matrix {name} has shape {w.shape}, but {n} ranks need a square "
                    f"{n}x{n} matrix: pass one row and one column per rank."
                )
            w.setflags(write=False)
            phase = _Phase(
                w,
                average=bool(np.all(np.abs(w - 1.0 / n) <= _EXACT_TOL)),
                identity=bool(np.all(np.abs(w - np.eye(n)) <= _EXACT_TOL)),
            )
            self._phases[key] = phase
        return phase

    def mixing(self, step: int = 0) -> np.ndarray:
        """The dense `W(step)`, read-only.

        Examples:
            >>> from lightning_decentral.topology import Ring
            >>> print(3 * Ring(world_size=4).mixing(0))
            [[1. 1. 0. 1.]
             [1. 1. 1. 0.]
             [0. 1. 1. 1.]
             [1. 0. 1. 1.]]
        """
        return self._phase(step).matrix

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}.")

    def in_neighbors(self, rank: int, step: int) -> list[tuple[int, float]]:
        """Whom `rank` receives from: `(j, W(step)[rank, j])` for every `j != rank` with a positive
        weight, by `j`.

        Examples:
            >>> from lightning_decentral.topology import OnePeerExponential
            >>> OnePeerExponential(world_size=8).in_neighbors(0, step=2)
            [(4, 0.5)]
        """
        self._check_rank(rank)
        row = self.mixing(step)[rank]
        return [(int(j), float(row[j])) for j in np.flatnonzero(row > 0) if j != rank]

    def out_neighbors(self, rank: int, step: int) -> list[tuple[int, float]]:
        """Whom `rank` sends to: `(j, W(step)[j, rank])` for every `j != rank` with a positive
        weight, by `j`.

        Examples:
            >>> from lightning_decentral.topology import OnePeerExponential
            >>> OnePeerExponential(world_size=8).out_neighbors(0, step=0)
            [(7, 0.5)]
        """
        self._check_rank(rank)
        column = self.mixing(step)[:, rank]
        return [(int(j), float(column[j])) for j in np.flatnonzero(column > 0) if j != rank]

    def self_weight(self, rank: int, step: int) -> float:
        """`W(step)[rank, rank]`: the weight of a rank's own value."""
        self._check_rank(rank)
        return float(self.mixing(step)[rank, rank])

    def is_average(self, step: int) -> bool:
        """Whether `W(step) = 11ᵀ/n`: an exact average, i.e. one all-reduce."""
        return self._phase(step).average

    def is_identity(self, step: int) -> bool:
        """Whether `W(step) = I`: no communication."""
        return self._phase(step).identity

    def spectral_gap(self) -> float:
        """`1 - rho`, the per-step contraction of the disagreement `x - x̄`.

        For a static `W`, `rho` is the largest `|lambda|` over the eigenvalues of `W` with the
        eigenvalue 1 removed once (`max(|lambda_2|, |lambda_n|)` for a symmetric `W`). For
        `period = tau > 1`, `rho = rho(P)^(1/tau)` with `P = W(tau-1) ... W(0)`: the
        contraction per step, averaged over one period.

        Examples:
            >>> from lightning_decentral.topology import Complete, Ring
            >>> print(f"{Ring(world_size=8).spectral_gap():.4f}")  # 1 - (1/3 + (2/3) cos(2 pi / 8))
            0.1953
            >>> print(f"{Complete(world_size=8).spectral_gap():.4f}")
            1.0000
        """
        if self.world_size == 1:
            return 1.0
        product = np.eye(self.world_size)
        for step in range(self.period):
            product = self.mixing(step) @ product
        eigenvalues = np.linalg.eigvals(product)
        rest = np.delete(eigenvalues, np.argmin(np.abs(eigenvalues - 1.0)))
        largest = float(np.max(np.abs(rest)))
        if largest < 1e-12:  # a product that averages exactly: its rounding noise (1e-19 or 1e-16, by LAPACK) is 0
            return 1.0
        return 1.0 - largest ** (1.0 / self.period)

    # -- validation ---------------------------------------------------------------

    def validate(self) -> None:
        """Raise `ValueError` unless every `W(k)` is a doubly stochastic `n x n` matrix and the
        union of their graphs over one period is strongly connected."""
        for step in range(self.period):
            w = self.mixing(step)  # raises on a wrong shape
            name = "W" if self.period == 1 else f"W({step})"
            bad = np.argwhere(~np.isfinite(w))
            if len(bad):
                i, j = bad[0]
                raise ValueError(
                    f"{name}[{i}, {j}] is {w[i, j]}: every mixing weight must be a finite number (no NaN or inf)."
                )
            bad = np.argwhere(w < 0)
            if len(bad):
                i, j = bad[0]
                raise ValueError(
                    f"{name}[{i}, {j}] = {w[i, j]:.6g} is negative: mixing weights must be >= 0. {_MH_HINT}"
                )
            for axis, what in ((1, "row"), (0, "column")):
                sums = w.sum(axis=axis)
                off = np.flatnonzero(np.abs(sums - 1.0) > _SUM_TOL)
                if len(off):
                    raise ValueError(
                        f"{name} is not doubly stochastic: {what} {off[0]} sums to {sums[off[0]]:.6g}, "
                        f"but every row and column must sum to 1. {_MH_HINT}"
                    )
        over = "" if self.period == 1 else f" over a period of {self.period} steps"
        self.check_connected(range(self.period), over)

    def check_connected(self, steps: Iterable[int], context: str = "", fix: str = "") -> None:
        """Raise `ValueError` unless the union of the graphs of `W(k)`, `k` in `steps`, is strongly
        connected (`context` and `fix` go into the message)."""
        n = self.world_size
        reach = np.zeros((n, n), dtype=bool)  # reach[i, j]: i hears from j in some W(k)
        for step in steps:
            reach |= self.mixing(step) > 0
        for forward in (True, False):
            seen = np.zeros(n, dtype=bool)
            seen[0] = True
            while True:
                grown = seen | (reach[:, seen].any(axis=1) if forward else reach[seen, :].any(axis=0))
                if (grown == seen).all():
                    break
                seen = grown
            if not seen.all():
                lost = np.flatnonzero(~seen).tolist()
                flow = f"from rank 0 never reaches ranks {lost}"
                if not forward:
                    flow = f"from ranks {lost} never reaches rank 0"
                fix = fix or f"Use a connected graph (e.g. 'ring'). {_MH_HINT}"
                raise ValueError(
                    f"The mixing matrices are not connected: information {flow}{context}, so the replicas "
                    f"cannot reach consensus. {fix}"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self._world_size})"


class InducedSubgraph(Topology):
    """The subgraph the ranks `members` of `topology` induce in each `W(k)` (its edges, `w_ij > 0` or `w_ji > 0`,
    among them), member `members[i]` becoming rank `i`, reweighted by Metropolis-Hastings: what
    [`for_members`][lightning_decentral.topology.Topology.for_members] gives for a topology without a kind of its own
    at the new size. Validated when made: a subgraph that falls apart raises `ValueError`.

    Examples:
        >>> from lightning_decentral.topology import Torus
        >>> InducedSubgraph(Torus(world_size=6), [0, 1, 2, 4, 5])  # 5 ranks: no torus
        InducedSubgraph(Torus(rows=2, world_size=6), members=[0, 1, 2, 4, 5])
    """

    def __init__(self, topology: Topology, members: Sequence[int]) -> None:
        self.topology = topology
        self.members = list(members)
        index = np.asarray(self.members)
        self._matrices = []
        for step in range(topology.period):
            w = topology.mixing(step)[np.ix_(index, index)]
            self._matrices.append(metropolis_hastings((w > 0) | (w.T > 0)))
        super().__init__(world_size=len(self.members))

    @property
    def period(self) -> int:
        return len(self._matrices)

    def _matrix(self, step: int) -> np.ndarray:
        return self._matrices[step]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.topology!r}, members={self.members})"


class PerRound(Topology):
    """`topology` advanced one matrix per gossip round when only every `every`-th step gossips (`gossip_every`):
    `W(k) = W_topology(⌊k / every⌋)`, so the rounds, at steps `every − 1, 2·every − 1, …`, apply `W_topology(0),
    W_topology(1), …` in turn, whatever `every` is (a step that does not gossip does not read its matrix). Period
    `every · topology.period`. [`GossipSchedule`][lightning_decentral.schedule.GossipSchedule] makes it.

    Examples:
        >>> from lightning_decentral.topology import OnePeerExponential
        >>> rounds = PerRound(OnePeerExponential(world_size=4), every=10)
        >>> rounds.out_neighbors(0, step=9), rounds.out_neighbors(0, step=19), rounds.period
        ([(3, 0.5)], [(2, 0.5)], 20)
    """

    def __init__(self, topology: Topology, every: int) -> None:
        self.topology, self.every = topology, every
        super().__init__(world_size=topology.world_size)

    @property
    def period(self) -> int:
        return self.every * self.topology.period

    def _matrix(self, step: int) -> np.ndarray:
        return self.topology.mixing(step // self.every)

    def validate(self) -> None:
        """Nothing more to check: `topology` was validated when it was bound, and its matrices are these."""

    def for_members(self, members: Sequence[int]) -> Topology:
        """[`Topology.for_members`][lightning_decentral.topology.Topology.for_members] of `topology`, per round."""
        members = self._checked_members(members)
        if members == list(range(self.world_size)):
            return self
        return PerRound(self.topology.for_members(members), self.every)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.topology!r}, every={self.every})"
