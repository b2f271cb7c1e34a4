"""Topologies built from the user's input: a mixing matrix, a `networkx` graph, two levels of topologies."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from lightning_decentral.topology.base import Topology


def _as_matrix(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, possibly on an accelerator
        value = value.detach().cpu()
    return np.array(value, dtype=np.float64)  # a private copy: freezing it leaves the caller's array alone


class MatrixTopology(Topology):
    """A user-given `W`, or a schedule `[W(0), ..., W(tau-1)]` repeated with period `tau`.

    Args:
        matrices: an `n x n` array-like (numpy array, torch tensor, nested lists), or a sequence
            of them (or an array of shape `(tau, n, n)`). The world size is `n`.

    Examples:
        >>> MatrixTopology([[0.5, 0.5], [0.5, 0.5]])
        MatrixTopology(world_size=2)
        >>> MatrixTopology([[0.9, 0.1], [0.2, 0.8]])
        Traceback (most recent call last):
        ...
        ValueError: W is not doubly stochastic: column 0 sums to 1.1, but every row and column must sum to 1. ...
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
    """The mixing matrix of an undirected `networkx` graph: its edge weights, or Metropolis-Hastings weights.

    If the edges carry a `weight` attribute (`graph.add_weighted_edges_from(...)`), `w_ij` is the
    weight of edge `(i, j)` and `w_ii = 1 - sum_j w_ij`: every edge needs a weight then, each node's
    weights may sum to at most 1 (else `w_ii` would be negative and the graph is refused), and a
    weight of 0 is no link. Without weights, `w_ij = 1/(1 + max(d_i, d_j))` on each edge (Metropolis-
    Hastings), `w_ii = 1 - sum_j w_ij`, with `d_i` the degree of node `i`. Either way `W` is symmetric,
    so doubly stochastic, and self loops are ignored. Nodes become ranks in `sorted(graph.nodes)`
    order (labels of one type that sort: integers, or strings; else relabel the nodes with
    `networkx.convert_node_labels_to_integers`); the world size is the number of nodes.

    Examples:
        >>> import networkx as nx
        >>> star = GraphTopology(nx.star_graph(3))  # centre 0, leaves 1, 2, 3
        >>> print(4 * star.mixing(0))
        [[1. 1. 1. 1.]
         [1. 3. 0. 0.]
         [1. 0. 3. 0.]
         [1. 0. 0. 3.]]
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
        try:
            nodes = sorted(graph.nodes)
        except TypeError as error:
            raise ValueError(
                f"The graph's node labels cannot be sorted into ranks ({error}): relabel the nodes to 0..n-1 "
                "with networkx.convert_node_labels_to_integers(graph), or use labels of one type."
            ) from None
        rank = {node: i for i, node in enumerate(nodes)}
        n = len(rank)
        edges = [(a, b, data) for a, b, data in graph.edges(data=True) if a != b]
        unweighted = [(a, b) for a, b, data in edges if "weight" not in data]
        if len(unweighted) == len(edges):  # Metropolis-Hastings
            adjacency = np.zeros((n, n), dtype=bool)
            for a, b, _ in edges:
                adjacency[rank[a], rank[b]] = adjacency[rank[b], rank[a]] = True
            degree = adjacency.sum(axis=1)
            w = np.where(adjacency, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
        elif unweighted:
            raise ValueError(
                f"{len(unweighted)} of {len(edges)} edges have no 'weight' attribute (e.g. {unweighted[0]!r}): give "
                "every edge a weight, or none for Metropolis-Hastings weights."
            )
        else:  # the user's weights
            w = np.zeros((n, n), dtype=np.float64)
            for a, b, data in edges:
                try:
                    w[rank[a], rank[b]] = w[rank[b], rank[a]] = float(data["weight"])
                except (TypeError, ValueError):
                    raise ValueError(f"The weight of edge {(a, b)!r} must be a number, got {data['weight']!r}.") from None
        w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
        super().__init__(w)  # validates: a negative weight, or a self-weight below 0, is refused here

    def _mismatch_hint(self, world_size: int) -> str:
        return f"the graph has {self._world_size} nodes; pass a graph with {world_size} nodes (one per rank)"


class Hierarchical(Topology):
    """Two levels for multi-node jobs: `inner` mixing inside each node, then `outer` mixing across
    nodes between the ranks with the same local rank.

    With `m` ranks per node and `N = n / m` nodes, rank `i = a m + l` is local rank `l` of node `a`
    (Lightning's layout: `global_rank = node_rank * devices + local_rank`), and

        W(k) = (W_out(k) ⊗ I_m) (I_N ⊗ W_in(k)) = W_out(k) ⊗ W_in(k)

    with `W_in(k)` the inner topology on `m` ranks and `W_out(k)` the outer one on `N` nodes.
    Kronecker products of doubly stochastic matrices are doubly stochastic; the period is
    `lcm(tau_in, tau_out)`; the eigenvalues are the products `lambda_out lambda_in`. The gossip
    engine runs the two factors as two exchanges: `I_N ⊗ W_in` inside the nodes (one all-reduce
    per node when `inner="complete"`), then `W_out ⊗ I_m` between same-local-rank peers.

    Args:
        inner: the topology inside a node: a name from
            [`TOPOLOGIES`][lightning_decentral.topology.TOPOLOGIES], a
            [`Topology`][lightning_decentral.topology.Topology] or a mixing matrix (`m x m`).
        outer: the topology across nodes, the same kinds (`N x N`).
        ranks_per_node: `m`. `None` takes the node layout of the job (`DecentralizedStrategy`
            binds `world_size // num_nodes`; bound by hand, one node). An explicit value wins,
            which emulates several nodes on one machine.
        world_size: see [`Topology`][lightning_decentral.topology.Topology].

    Examples:
        >>> two_nodes = Hierarchical("complete", "ring", ranks_per_node=4, world_size=8)
        >>> two_nodes.node_size, two_nodes.num_nodes
        (4, 2)
        >>> [j for j, _ in two_nodes.in_neighbors(0, step=0)]  # its node, then rank 4 of node 1
        [1, 2, 3, 4, 5, 6, 7]
        >>> print(f"{two_nodes.spectral_gap():.4f}")  # W = (11ᵀ/2) ⊗ (11ᵀ/4) = 11ᵀ/8
        1.0000
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
        """This topology laid out on the job's `num_nodes` nodes (an explicit `ranks_per_node` wins)."""
        if self.ranks_per_node is not None or num_nodes == self._num_nodes:
            return self
        laid_out = copy.copy(self)
        laid_out._num_nodes = num_nodes
        if self._world_size is not None:
            laid_out._attach(self._world_size)
        return laid_out

    @property
    def node_size(self) -> int:
        """`m`, the ranks per node."""
        assert self.inner_topology is not None, "bind the topology first"
        return self.inner_topology.world_size

    @property
    def num_nodes(self) -> int:
        """`N`, the number of nodes."""
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
    from lightning_decentral.topology.resolve import resolve_topology  # resolve.py names Hierarchical

    try:
        return resolve_topology(spec, size)
    except (ValueError, TypeError) as error:
        raise type(error)(f"Hierarchical {role} topology on {size} {what}: {error}") from None
