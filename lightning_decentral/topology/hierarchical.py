"""Two levels of topologies for multi-node jobs: inside each node, and across nodes."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from lightning_decentral.topology.base import Topology
from lightning_decentral.topology.resolve import resolve_topology


class Hierarchical(Topology, name="hierarchical"):
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
    try:
        return resolve_topology(spec, size)
    except (ValueError, TypeError) as error:
        raise type(error)(f"Hierarchical {role} topology on {size} {what}: {error}") from None
