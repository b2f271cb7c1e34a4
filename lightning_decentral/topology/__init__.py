"""Mixing matrices for gossip: who averages with whom at optimizer step `k`.

A topology is a sequence of doubly stochastic `n x n` matrices `W(k)` with period `tau`,
`W(k) = W(k mod tau)`. One gossip round on rank `i` is

    x_i <- sum_j W(k)_ij x_j

so rank `i` receives `x_j` from every `j` with `W(k)_ij > 0` and sends its own `x_i` to every
`j` with `W(k)_ji > 0`. Everything here is plain numpy. The graphs, their spectral gaps and
their costs are compared on the [topologies page](../topologies.md).

Examples:
    >>> from lightning_decentral.topology import Ring
    >>> ring = Ring(world_size=4)
    >>> print(3 * ring.mixing(0))
    [[1. 1. 0. 1.]
     [1. 1. 1. 0.]
     [0. 1. 1. 1.]
     [1. 0. 1. 1.]]
    >>> ring.in_neighbors(0, step=0) == ring.out_neighbors(0, step=0)  # W is symmetric
    True
"""

from lightning_decentral.topology.base import TOPOLOGIES, PerRound, Topology, topology_class
from lightning_decentral.topology.builtin import (
    Complete,
    Exponential,
    OnePeerExponential,
    OnePeerRing,
    RandomMatching,
    Ring,
    Torus,
)
from lightning_decentral.topology.custom import GraphTopology, MatrixTopology
from lightning_decentral.topology.hierarchical import Hierarchical
from lightning_decentral.topology.resolve import resolve_topology

__all__ = [
    "TOPOLOGIES",
    "Complete",
    "Exponential",
    "GraphTopology",
    "Hierarchical",
    "MatrixTopology",
    "OnePeerExponential",
    "OnePeerRing",
    "PerRound",
    "RandomMatching",
    "Ring",
    "Topology",
    "Torus",
    "resolve_topology",
    "topology_class",
]
