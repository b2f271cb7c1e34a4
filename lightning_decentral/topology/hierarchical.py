"""Two levels of topologies for multi-node jobs: inside each node, and across nodes."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from lightning_decentral.topology.base import Topology
from lightning_decentral.topology.resolve import resolve_topology


class Level(NamedTuple):
    """One exchange of a hierarchical round: disjoint `groups` of ranks, group `g` mixing with `parts[g]` (bound to
    `len(groups[g])` ranks, its rank `i` being `groups[g][i]`)."""

    groups: list[list[int]]
    parts: list[Topology]

    def matrix(self, step: int, world_size: int) -> np.ndarray:
        """The level's `n x n` mixing matrix at `step`: each group's `W(step)` on its ranks, 1 for a rank in no
        group."""
        w = np.eye(world_size)
        for group, part in zip(self.groups, self.parts):
            w[np.ix_(group, group)] = part.mixing(step)
        return w

    def part_of(self, rank: int) -> tuple[list[int], Topology] | None:
        """The group holding `rank` and its topology, or `None` if `rank` mixes with no one at this level."""
        return next(((g, p) for g, p in zip(self.groups, self.parts) if rank in g), None)


class Hierarchical(Topology, name="hierarchical"):
    """Two levels for multi-node jobs: `inner` mixing inside each node, then `outer` mixing across
    nodes between the ranks with the same local rank.

    With `m` ranks per node and `N = n / m` nodes, rank `i = a m + l` is local rank `l` of node `a`
    (Lightning's layout: `global_rank = node_rank * devices + local_rank`), and

        W(k) = (W_out(k) ⊗ I_m) (I_N ⊗ W_in(k)) = W_out(k) ⊗ W_in(k)

    with `W_in(k)` the inner topology on `m` ranks and `W_out(k)` the outer one on `N` nodes.
    Kronecker products of doubly stochastic matrices are doubly stochastic; the period is
    `lcm(tau_in, tau_out)`; the eigenvalues are the products `lambda_out lambda_in`. The gossip
    engine runs the two factors as two exchanges ([`levels`][lightning_decentral.topology.Hierarchical.levels]):
    `I_N ⊗ W_in` inside the nodes (one all-reduce per node when `inner="complete"`), then `W_out ⊗ I_m`
    between same-local-rank peers.

    After a failure ([`for_members`][lightning_decentral.topology.Topology.for_members]) each lost rank leaves its
    node and its group across nodes; every group that lost a rank mixes with its topology's own rule for
    members (the inner one on the node's `m_a` remaining ranks, the outer one on the nodes left in that group).
    Each level is block-diagonal with doubly stochastic blocks, so `W(k) = S_out(k) S_in(k)` stays doubly
    stochastic (no longer a Kronecker product).

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
        >>> two_nodes.for_members([0, 1, 2, 4, 5, 6, 7])  # rank 3 leaves node 0
        Hierarchical(inner='complete', outer='ring', node_sizes=(3, 4), world_size=7)
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
        self.inner = inner
        self.outer = outer
        self.ranks_per_node = ranks_per_node
        self._num_nodes = 1  # the job's layout, used when ranks_per_node is None
        self._left: tuple[list[list[int]], list[Level]] | None = None  # nodes and levels once ranks have left
        self._nodes: list[list[int]] = []
        self._levels: list[Level] = []
        super().__init__(world_size)

    def on_nodes(self, num_nodes: int) -> Hierarchical:
        """This topology laid out on the job's `num_nodes` nodes (an explicit `ranks_per_node` wins)."""
        if self.ranks_per_node is not None or num_nodes == self._num_nodes:
            return self
        laid_out = copy.copy(self)
        laid_out._num_nodes = num_nodes
        if self.is_bound:
            laid_out._attach(self.world_size)
        return laid_out

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """The ranks of each node, nodes in rank order (`(m,) * N` until a rank leaves its node)."""
        _ = self.world_size  # raises if unbound
        return tuple(len(node) for node in self._nodes)

    @property
    def node_size(self) -> int:
        """`m`, the ranks per node (the same on every node)."""
        sizes = self.node_sizes
        if len(set(sizes)) != 1:
            raise ValueError(f"The nodes hold different numbers of ranks, {sizes}: read node_sizes.")
        return sizes[0]

    @property
    def num_nodes(self) -> int:
        """`N`, the number of nodes."""
        return len(self.node_sizes)

    def levels(self) -> list[Level]:
        """The two exchanges of one round, in order: inside each node (`groups`: the nodes), then across nodes
        (`groups`: the ranks of local rank `l`, for each `l`). Groups of one rank are left out."""
        _ = self.world_size  # raises if unbound
        return self._levels

    def _on_bind(self, world_size: int) -> None:
        if self._left is not None:
            self._nodes, self._levels = self._left
            return
        n = world_size
        if self.ranks_per_node is not None:
            m = int(self.ranks_per_node)
            source = f"ranks_per_node={self.ranks_per_node}"
        elif n % self._num_nodes == 0:
            m = n // self._num_nodes
            source = f"num_nodes={self._num_nodes}"
        else:
            m = 0
            source = f"num_nodes={self._num_nodes}"
        if m < 1 or n % m:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"Hierarchical: {n} ranks do not split into equal nodes with {source}. Pass ranks_per_node= "
                f"one of {divisors} (a divisor of the world size), or run the same number of devices on every node."
            )
        inner = _part("inner", self.inner, m, "ranks per node")
        outer = _part("outer", self.outer, n // m, "nodes")
        self._nodes = [list(range(a * m, (a + 1) * m)) for a in range(n // m)]
        across = [list(range(local, n, m)) for local in range(m)]
        self._levels = [Level(self._nodes, [inner] * len(self._nodes)), Level(across, [outer] * m)]
        self._levels = [Level(*_without_singles(level)) for level in self._levels]

    @property
    def period(self) -> int:
        return math.lcm(1, *(part.period for level in self.levels() for part in level.parts))

    def _matrix(self, step: int) -> np.ndarray:
        inner, outer = (level.matrix(step, self.world_size) for level in self.levels())
        return outer @ inner  # each entry is one product: W_out ⊗ W_in exactly, for equal nodes

    def for_members(self, members: Sequence[int]) -> Topology:
        """The hierarchy of `members`: each lost rank leaves its node and its group across nodes (see the class
        docstring)."""
        members = self._checked_members(members)
        if members == list(range(self.world_size)):
            return self
        new = {old: i for i, old in enumerate(members)}
        levels = []
        for level in self.levels():
            groups = []
            parts = []
            for group, part in zip(*level):
                at = [i for i, r in enumerate(group) if r in new]  # the group's members that are left
                if len(at) > 1:
                    groups.append([new[group[i]] for i in at])
                    parts.append(part.for_members(at))
            levels.append(Level(groups, parts))
        left = copy.copy(self)
        left._world_size = None
        left._left = (
            [[new[r] for r in node if r in new] for node in self._nodes if any(r in new for r in node)],
            levels,
        )
        return left.bind(len(members))

    def _mismatch_hint(self, world_size: int) -> str:
        return "create it without world_size, or with the job's world size"

    def __repr__(self) -> str:
        layout = f"ranks_per_node={self.ranks_per_node}" if self._left is None else f"node_sizes={self.node_sizes}"
        return f"Hierarchical(inner={self.inner!r}, outer={self.outer!r}, {layout}, world_size={self._world_size})"


def _part(role: str, spec: Any, size: int, what: str) -> Topology:
    try:
        return resolve_topology(spec, size)
    except (ValueError, TypeError) as error:
        raise type(error)(f"Hierarchical {role} topology on {size} {what}: {error}") from None


def _without_singles(level: tuple[list[list[int]], list[Topology]]) -> tuple[list[list[int]], list[Topology]]:
    """A level's groups and parts without the groups of one rank (they mix with no one)."""
    pairs = [(g, p) for g, p in zip(*level) if len(g) > 1]
    return [g for g, _ in pairs], [p for _, p in pairs]
