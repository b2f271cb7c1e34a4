"""Topologies built from the user's input: a mixing matrix, a `networkx` graph."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_decentral.topology.base import Topology, metropolis_hastings


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
                    f"A mixing matrix must be 2-D (n x n), or a sequence of n x n matrices; got shape {stacked.shape}."
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
            super().__init__(metropolis_hastings(adjacency))
            return
        if unweighted:
            raise ValueError(
                f"{len(unweighted)} of {len(edges)} edges have no 'weight' attribute (e.g. {unweighted[0]!r}): give "
                "every edge a weight, or none for Metropolis-Hastings weights."
            )
        w = np.zeros((n, n), dtype=np.float64)  # the user's weights
        for a, b, data in edges:
            try:
                w[rank[a], rank[b]] = w[rank[b], rank[a]] = float(data["weight"])
            except (TypeError, ValueError):
                raise ValueError(f"The weight of edge {(a, b)!r} must be a number, got {data['weight']!r}.") from None
        w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
        super().__init__(w)  # validates: a negative weight, or a self-weight below 0, is refused here

    def _mismatch_hint(self, world_size: int) -> str:
        return f"the graph has {self._world_size} nodes; pass a graph with {world_size} nodes (one per rank)"
