"""Mixing matrices for gossip: who averages with whom at optimizer step ``k``.

A topology is a sequence of doubly stochastic ``n x n`` matrices ``W(k)`` with
period ``tau``, ``W(k) = W(k mod tau)``. One gossip round on rank ``i`` is

    x_i <- sum_j W(k)_ij x_j

so rank ``i`` receives ``x_j`` from every ``j`` with ``W(k)_ij > 0`` and sends its
own ``x_i`` to every ``j`` with ``W(k)_ji > 0``. Everything here is plain numpy.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

_SUM_TOL = 1e-6  # row / column sums of W must be 1 to within this
_EXACT_TOL = 1e-12  # W counts as 11ᵀ/n or I to within this
_MH_HINT = (
    "Metropolis-Hastings weights make any connected undirected graph doubly stochastic: "
    "pass GraphTopology(networkx_graph)."
)


class _Phase(NamedTuple):
    matrix: np.ndarray
    average: bool
    identity: bool


class Topology:
    """A sequence of doubly stochastic mixing matrices ``W(k)``, ``k`` = optimizer step.

    Subclasses define ``_matrix(step)`` for ``0 <= step < period`` and, if the
    matrices vary with ``k``, ``period``.

    Args:
        world_size: the number of ranks ``n``; ``None`` leaves it unbound until
            :meth:`bind` (the strategy binds it to the world size).
    """

    def __init__(self, world_size: int | None = None) -> None:
        self._world_size: int | None = None
        self._phases: dict[int, _Phase] = {}
        if world_size is not None:
            self._attach(world_size)

    # -- to implement -------------------------------------------------------------

    def _matrix(self, step: int) -> np.ndarray:
        """``W(step)`` for ``0 <= step < period``, ``n x n`` float64."""
        raise NotImplementedError

    @property
    def period(self) -> int:
        """The number of distinct matrices: ``W(k) = W(k mod period)`` (1 for a static ``W``)."""
        return 1

    def _on_bind(self, world_size: int) -> None:
        """Check that ``world_size`` suits this topology and set what depends on it."""

    def _mismatch_hint(self, world_size: int) -> str:
        return f"create it with world_size={world_size}, or leave world_size unset"

    # -- binding ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The number of ranks ``n`` this topology is bound to."""
        if self._world_size is None:
            raise ValueError(
                f"{type(self).__name__} is not bound to a world size yet; bind it with "
                ".bind(world_size) or pass world_size= when creating it."
            )
        return self._world_size

    def bind(self, world_size: int) -> Topology:
        """This topology for ``world_size`` ranks, validated.

        Returns ``self`` if it is already bound to ``world_size``, otherwise a bound
        copy; a topology bound to another size raises ``ValueError``.
        """
        if self._world_size is None:
            bound = copy.copy(self)
            bound._attach(world_size)
            return bound
        if world_size != self._world_size:
            raise ValueError(
                f"{self!r} is bound to {self._world_size} ranks but the world size is "
                f"{world_size}: {self._mismatch_hint(world_size)}."
            )
        return self

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
        """The dense ``W(step)``, read-only."""
        return self._phase(step).matrix

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}.")

    def in_neighbors(self, rank: int, step: int) -> list[tuple[int, float]]:
        """``(j, W_rank,j)`` for ``j != rank`` with ``W_rank,j > 0``, by ``j``: whom ``rank`` receives from."""
        self._check_rank(rank)
        row = self.mixing(step)[rank]
        return [(int(j), float(row[j])) for j in np.flatnonzero(row > 0) if j != rank]

    def out_neighbors(self, rank: int, step: int) -> list[tuple[int, float]]:
        """``(j, W_j,rank)`` for ``j != rank`` with ``W_j,rank > 0``, by ``j``: whom ``rank`` sends to."""
        self._check_rank(rank)
        column = self.mixing(step)[:, rank]
        return [(int(j), float(column[j])) for j in np.flatnonzero(column > 0) if j != rank]

    def self_weight(self, rank: int, step: int) -> float:
        """``W_rank,rank``: the weight of a rank's own value."""
        self._check_rank(rank)
        return float(self.mixing(step)[rank, rank])

    def is_average(self, step: int) -> bool:
        """Whether ``W(step) = 11ᵀ/n``: an exact average, i.e. one all-reduce."""
        return self._phase(step).average

    def is_identity(self, step: int) -> bool:
        """Whether ``W(step) = I``: no communication."""
        return self._phase(step).identity

    def spectral_gap(self) -> float:
        """``1 - rho``, the per-step contraction of the disagreement ``x - x̄``.

        For a static ``W``, ``rho`` is the largest ``|lambda|`` over the eigenvalues of
        ``W`` with the eigenvalue 1 removed once (``max(|lambda_2|, |lambda_n|)`` for a
        symmetric ``W``). For ``period = tau > 1``, ``rho = rho(P)^(1/tau)`` with
        ``P = W(tau-1) ... W(0)``: the contraction per step, averaged over one period.
        """
        if self.world_size == 1:
            return 1.0
        product = np.eye(self.world_size)
        for step in range(self.period):
            product = self.mixing(step) @ product
        eigenvalues = np.linalg.eigvals(product)
        rest = np.delete(eigenvalues, np.argmin(np.abs(eigenvalues - 1.0)))
        rho = float(np.max(np.abs(rest))) ** (1.0 / self.period)
        return 1.0 - rho

    # -- validation ---------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` unless every ``W(k)`` is a doubly stochastic ``n x n`` matrix
        and the union of their graphs over one period is strongly connected."""
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
        """Raise ``ValueError`` unless the union of the graphs of ``W(k)``, ``k`` in ``steps``,
        is strongly connected (``context`` and ``fix`` go into the message)."""
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


def _circulant(n: int, weights: dict[int, float]) -> np.ndarray:
    """``W[i, (i + offset) mod n] += weight`` for each ``offset: weight``."""
    w = np.zeros((n, n))
    rows = np.arange(n)
    for offset, weight in weights.items():
        w[rows, (rows + offset) % n] += weight
    return w


class Ring(Topology):
    """``w_ii = w_i,i±1 = 1/3`` (``n = 2``: ``1/2, 1/2``; ``n = 1``: ``[[1]]``).

    ``rho = 1/3 + (2/3) cos(2 pi / n)`` for ``n >= 3``. For ``n <= 3`` every rank is a
    neighbour, ``W = 11ᵀ/n``, and the gossip runs as one all-reduce.
    """

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n <= 2:
            return np.full((n, n), 1.0 / n)
        return _circulant(n, {0: 1 / 3, 1: 1 / 3, -1: 1 / 3})


def _torus_sizes(limit: int) -> list[int]:
    return [m for m in range(4, limit + 1) if any(m % r == 0 for r in range(2, int(m**0.5) + 1))]


class Torus(Topology):
    """A periodic ``rows x cols`` grid, rank ``i = a * cols + b`` at ``(a, b)``.

    ``W = (I + up + down + left + right) / 5``; where two neighbours are the same
    rank (``rows`` or ``cols`` = 2) their weights add, so ``W`` stays doubly
    stochastic. ``rho = (3 + 2 cos(2 pi / max(rows, cols))) / 5`` once ``max(rows, cols) >= 4``.

    Args:
        rows: the grid's row count; ``None`` picks the divisor of ``n`` closest to
            ``sqrt(n)`` with ``2 <= rows <= cols``.
        world_size: see :class:`Topology`.
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


class Exponential(Topology):
    """Static exponential graph: ``W[i, (i + 2^m) mod n] = W[i, i] = 1/(2 + floor(log2(n - 1)))``
    for every ``m`` with ``2^m < n`` (``n = 1``: ``[[1]]``).

    ``rho = 1 - 2/(2 + floor(log2(n - 1)))`` when ``n`` is a power of two.
    """

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n == 1:
            return np.ones((1, 1))
        hops = (n - 1).bit_length()  # offsets 2^0 .. 2^(hops-1) < n; hops = 1 + floor(log2(n - 1))
        return _circulant(n, {offset: 1.0 / (1 + hops) for offset in [0] + [2**m for m in range(hops)]})


class OnePeerExponential(Topology):
    """Time-varying one-peer exponential graph, period ``tau = ceil(log2 n)``:

    ``W(k)[i, i] = W(k)[i, (i + 2^(k mod tau)) mod n] = 1/2``.

    Each rank sends to one peer and receives from one per step. For ``n = 2^tau``,
    ``W(tau-1) ... W(0) = 11ᵀ/n`` exactly, from any starting step.
    """

    @property
    def period(self) -> int:
        return max(1, (self.world_size - 1).bit_length())

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        if n == 1:
            return np.ones((1, 1))
        return _circulant(n, {0: 0.5, 2**step: 0.5})


class Complete(Topology):
    """``W = 11ᵀ/n``: the exact average (one all-reduce), ``rho = 0``."""

    def _matrix(self, step: int) -> np.ndarray:
        n = self.world_size
        return np.full((n, n), 1.0 / n)


class Hierarchical(Topology):
    """Two levels for multi-node jobs: ``inner`` mixing inside each node, then ``outer`` mixing
    across nodes between the ranks with the same local rank.

    With ``m`` ranks per node and ``N = n / m`` nodes, rank ``i = a m + l`` is local rank ``l`` of
    node ``a`` (Lightning's layout: ``global_rank = node_rank * devices + local_rank``), and

        W(k) = (W_out(k) ⊗ I_m) (I_N ⊗ W_in(k)) = W_out(k) ⊗ W_in(k)

    with ``W_in(k)`` the inner topology on ``m`` ranks and ``W_out(k)`` the outer one on ``N``
    nodes. Kronecker products of doubly stochastic matrices are doubly stochastic; the period is
    ``lcm(tau_in, tau_out)``; the eigenvalues are the products ``lambda_out lambda_in``. The gossip
    engine runs the two factors as two exchanges: ``I_N ⊗ W_in`` inside the nodes (one all-reduce
    per node when ``inner="complete"``), then ``W_out ⊗ I_m`` between same-local-rank peers.

    Args:
        inner: the topology inside a node: a name from :data:`TOPOLOGIES`, a :class:`Topology`
            or a mixing matrix (``m x m``).
        outer: the topology across nodes, the same kinds (``N x N``).
        ranks_per_node: ``m``. ``None`` takes the node layout of the job (``DecentralizedStrategy``
            binds ``world_size // num_nodes``; bound by hand, one node). An explicit value wins,
            which emulates several nodes on one machine.
        world_size: see :class:`Topology`.
    """

    def __init__(
        self,
        inner: Any = "complete",
        outer: Any = "one_peer_exponential",
        ranks_per_node: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}.")
        self.inner, self.outer, self.ranks_per_node = inner, outer, ranks_per_node
        self._num_nodes = 1  # the job's layout, used when ranks_per_node is None
        self.inner_topology: Topology | None = None  # bound to m ranks
        self.outer_topology: Topology | None = None  # bound to N nodes
        super().__init__(world_size)

    def on_nodes(self, num_nodes: int) -> Hierarchical:
        """This topology laid out on the job's ``num_nodes`` nodes (an explicit ``ranks_per_node`` wins)."""
        if self.ranks_per_node is not None or num_nodes == self._num_nodes:
            return self
        laid_out = copy.copy(self)
        laid_out._num_nodes = num_nodes
        if self._world_size is not None:
            laid_out._attach(self._world_size)
        return laid_out

    @property
    def node_size(self) -> int:
        """``m``, the ranks per node."""
        assert self.inner_topology is not None, "bind the topology first"
        return self.inner_topology.world_size

    @property
    def num_nodes(self) -> int:
        """``N``, the number of nodes."""
        assert self.outer_topology is not None, "bind the topology first"
        return self.outer_topology.world_size

    def _on_bind(self, world_size: int) -> None:
        n = world_size
        if self.ranks_per_node is not None:
            m, source = int(self.ranks_per_node), f"ranks_per_node={self.ranks_per_node}"
        elif n % self._num_nodes == 0:
            m, source = n // self._num_nodes, f"num_nodes={self._num_nodes}"
        else:
            m, source = 0, f"num_nodes={self._num_nodes}"
        if m < 1 or n % m:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"Hierarchical: {n} ranks do not split into equal nodes with {source}. Pass ranks_per_node= "
                f"one of {divisors} (a divisor of the world size), or run the same number of devices on every node."
            )
        self.inner_topology = _part("inner", self.inner, m, "ranks per node")
        self.outer_topology = _part("outer", self.outer, n // m, "nodes")

    @property
    def period(self) -> int:
        return math.lcm(self.inner_topology.period, self.outer_topology.period)

    def _matrix(self, step: int) -> np.ndarray:
        return np.kron(self.outer_topology.mixing(step), self.inner_topology.mixing(step))

    def _mismatch_hint(self, world_size: int) -> str:
        return "create it without world_size, or with the job's world size"

    def __repr__(self) -> str:
        return (
            f"Hierarchical(inner={self.inner!r}, outer={self.outer!r}, ranks_per_node={self.ranks_per_node}, "
            f"world_size={self._world_size})"
        )


def _part(role: str, spec: Any, size: int, what: str) -> Topology:
    try:
        return resolve_topology(spec, size)
    except (ValueError, TypeError) as error:
        raise type(error)(f"Hierarchical {role} topology on {size} {what}: {error}") from None


def _as_matrix(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, possibly on an accelerator
        value = value.detach().cpu()
    return np.array(value, dtype=np.float64)  # a private copy: freezing it leaves the caller's array alone


class MatrixTopology(Topology):
    """A user-given ``W``, or a schedule ``[W(0), ..., W(tau-1)]`` repeated with period ``tau``.

    Args:
        matrices: an ``n x n`` array-like (numpy array, torch tensor, nested lists), or
            a sequence of them (or an array of shape ``(tau, n, n)``). The world size
            is ``n``.
    """

    def __init__(self, matrices: Any) -> None:
        if isinstance(matrices, (list, tuple)) and matrices and all(getattr(m, "ndim", 0) == 2 for m in matrices):
            schedule = [_as_matrix(m) for m in matrices]
        else:
            try:
                stacked = _as_matrix(matrices)
            except ValueError as error:
                raise ValueError(f"A mixing matrix must be an n x n array of numbers: {error}") from None
            if stacked.ndim not in (2, 3) or 0 in stacked.shape:
                raise ValueError(
                    "A mixing matrix must be 2-D (n x n), or a sequence of n x n matrices; got shape "
                    f"{stacked.shape}."
                )
            schedule = [stacked] if stacked.ndim == 2 else list(stacked)
        self._matrices = schedule
        super().__init__(world_size=schedule[0].shape[0])

    @property
    def period(self) -> int:
        return len(self._matrices)

    def _matrix(self, step: int) -> np.ndarray:
        return self._matrices[step]

    def _mismatch_hint(self, world_size: int) -> str:
        n = self._world_size
        return f"the mixing matrix is {n}x{n}; pass one with {world_size} rows and columns or run on {n} ranks"

    def __repr__(self) -> str:
        period = "" if self.period == 1 else f", period={self.period}"
        return f"{type(self).__name__}(world_size={self._world_size}{period})"


class GraphTopology(MatrixTopology):
    """Metropolis-Hastings weights on an undirected ``networkx`` graph.

    ``w_ij = 1/(1 + max(d_i, d_j))`` on each edge, ``w_ii = 1 - sum_j w_ij``, with
    ``d_i`` the degree of node ``i`` (self loops ignored). Nodes become ranks in
    ``sorted(graph.nodes)`` order; the world size is the number of nodes.
    """

    def __init__(self, graph: Any) -> None:
        import networkx as nx

        if not isinstance(graph, nx.Graph):
            raise TypeError(f"GraphTopology needs a networkx graph, got {type(graph).__name__}.")
        if graph.is_directed():
            raise ValueError(
                "GraphTopology needs an undirected graph (Metropolis-Hastings weights are symmetric); "
                "pass graph.to_undirected()."
            )
        if graph.number_of_nodes() == 0:
            raise ValueError("The graph has no nodes: it needs one node per rank.")
        rank = {node: i for i, node in enumerate(sorted(graph.nodes))}
        n = len(rank)
        edges = {(rank[a], rank[b]) for a, b in graph.edges() if a != b}
        adjacency = np.zeros((n, n), dtype=bool)
        for i, j in edges:
            adjacency[i, j] = adjacency[j, i] = True
        degree = adjacency.sum(axis=1)
        w = np.where(adjacency, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
        w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
        super().__init__(w)

    def _mismatch_hint(self, world_size: int) -> str:
        return f"the graph has {self._world_size} nodes; pass a graph with {world_size} nodes (one per rank)"


TOPOLOGIES: dict[str, type[Topology]] = {
    "ring": Ring,
    "torus": Torus,
    "exponential": Exponential,
    "one_peer_exponential": OnePeerExponential,
    "complete": Complete,
    "hierarchical": Hierarchical,
}


def resolve_topology(spec: Any, world_size: int, num_nodes: int = 1) -> Topology:
    """A bound, validated topology from ``spec``.

    ``spec`` is a name from :data:`TOPOLOGIES`, a :class:`Topology`, a ``networkx``
    graph, or a mixing matrix / sequence of matrices (numpy array, torch tensor,
    nested lists). ``num_nodes`` is the job's node layout, which :class:`Hierarchical` uses.
    """
    if isinstance(spec, str):
        if spec not in TOPOLOGIES:
            raise ValueError(
                f"Unknown topology {spec!r}. Choose one of {sorted(TOPOLOGIES)}, or pass a Topology, "
                "a mixing matrix or a networkx graph."
            )
        spec = TOPOLOGIES[spec]()
    if isinstance(spec, Hierarchical):
        spec = spec.on_nodes(num_nodes)
    if isinstance(spec, Topology):
        return spec.bind(world_size)
    networkx = sys.modules.get("networkx")  # a graph exists only if networkx was imported
    if networkx is not None and isinstance(spec, networkx.Graph):
        return GraphTopology(spec).bind(world_size)
    if isinstance(spec, (np.ndarray, Sequence)) or hasattr(spec, "__array__"):
        return MatrixTopology(spec).bind(world_size)
    raise TypeError(
        f"Cannot make a topology from {type(spec).__name__}. Pass one of {sorted(TOPOLOGIES)}, a Topology, "
        "a networkx graph, or a mixing matrix (numpy array, torch tensor or nested lists) or a list of them."
    )
