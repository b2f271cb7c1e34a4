"""From what the user passes (a name, a topology, a graph, a matrix) to a bound topology."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_decentral.topology.base import Topology
from lightning_decentral.topology.builtin import Complete, Exponential, OnePeerExponential, Ring, Torus
from lightning_decentral.topology.custom import GraphTopology, Hierarchical, MatrixTopology

TOPOLOGIES: dict[str, type[Topology]] = {
    "ring": Ring,
    "torus": Torus,
    "exponential": Exponential,
    "one_peer_exponential": OnePeerExponential,
    "complete": Complete,
    "hierarchical": Hierarchical,
}
"""The built-in topologies by name, as `DecentralizedStrategy(topology=...)` accepts them."""


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
