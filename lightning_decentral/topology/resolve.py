"""From what the user passes (a name, a topology, a graph, a matrix) to a bound topology."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_decentral.topology.base import Topology, topology_class
from lightning_decentral.topology.custom import GraphTopology, MatrixTopology


def resolve_topology(spec: Any, world_size: int, num_nodes: int = 1) -> Topology:
    """A bound, validated topology from `spec`.

    `spec` is a name from [`TOPOLOGIES`][lightning_decentral.topology.TOPOLOGIES], a
    [`Topology`][lightning_decentral.topology.Topology], a `networkx` graph, or a mixing matrix /
    sequence of matrices (numpy array, torch tensor, nested lists). `num_nodes` is the job's node
    layout, which [`Hierarchical`][lightning_decentral.topology.Hierarchical] uses.

    Examples:
        >>> resolve_topology("ring", world_size=8)
        Ring(world_size=8)
        >>> resolve_topology("hierarchical", world_size=8, num_nodes=2).node_size
        4
        >>> resolve_topology([[0.5, 0.5], [0.5, 0.5]], world_size=2)
        MatrixTopology(world_size=2)
        >>> resolve_topology("rign", world_size=8)
        Traceback (most recent call last):
        ...
        ValueError: Unknown topology 'rign'. Choose one of ['complete', 'exponential', 'hierarchical', ...
    """
    if isinstance(spec, str):
        spec = topology_class(spec)()
    if isinstance(spec, Topology):
        return spec.on_nodes(num_nodes).bind(world_size)
    networkx = sys.modules.get("networkx")  # a graph exists only if networkx was imported
    if networkx is not None and isinstance(spec, networkx.Graph):
        return GraphTopology(spec).bind(world_size)
    if isinstance(spec, (np.ndarray, Sequence)) or hasattr(spec, "__array__"):
        return MatrixTopology(spec).bind(world_size)
    raise TypeError(
        f"Cannot make a topology from {type(spec).__name__}. Pass a name of TOPOLOGIES, a Topology, a networkx "
        "graph, or a mixing matrix (numpy array, torch tensor or nested lists) or a list of them."
    )
