"""The mixing matrices of docs/topologies.md: structure, closed-form spectral gaps, errors."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
import torch

from lightning_decentral.topology import (
    TOPOLOGIES,
    Complete,
    Exponential,
    GraphTopology,
    MatrixTopology,
    OnePeerExponential,
    Ring,
    Topology,
    Torus,
    resolve_topology,
)

SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 32]


def _valid(name: str, n: int) -> bool:
    return name != "torus" or (n >= 4 and any(n % r == 0 for r in range(2, n)))


CASES = [(name, n) for name in TOPOLOGIES for n in SIZES if _valid(name, n)]


@pytest.mark.parametrize(("name", "n"), CASES)
def test_doubly_stochastic_and_neighbours_agree(name: str, n: int) -> None:
    topology = resolve_topology(name, n)
    assert topology.world_size == n
    for step in range(2 * topology.period + 1):
        w = topology.mixing(step)
        assert w.shape == (n, n) and w.dtype == np.float64
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        rebuilt_in, rebuilt_out = np.zeros((n, n)), np.zeros((n, n))
        for rank in range(n):
            rebuilt_in[rank, rank] = rebuilt_out[rank, rank] = topology.self_weight(rank, step)
            incoming = topology.in_neighbors(rank, step)
            outgoing = topology.out_neighbors(rank, step)
            assert [j for j, _ in incoming] == sorted(j for j, _ in incoming)
            assert [j for j, _ in outgoing] == sorted(j for j, _ in outgoing)
            for j, weight in incoming:
                assert j != rank and weight > 0
                rebuilt_in[rank, j] = weight
            for j, weight in outgoing:
                assert j != rank and weight > 0
                rebuilt_out[j, rank] = weight
        np.testing.assert_array_equal(rebuilt_in, w)
        np.testing.assert_array_equal(rebuilt_out, w)
    assert 0.0 < topology.spectral_gap() <= 1.0 + 1e-12


@pytest.mark.parametrize(("name", "n"), CASES)
def test_mixing_is_read_only(name: str, n: int) -> None:
    w = resolve_topology(name, n).mixing(0)
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 0.5


def test_small_world_sizes() -> None:
    for cls in (Ring, Exponential, OnePeerExponential, Complete):
        np.testing.assert_array_equal(cls(world_size=1).mixing(), [[1.0]])
        np.testing.assert_array_equal(cls(world_size=2).mixing(), np.full((2, 2), 0.5))
        assert cls(world_size=1).spectral_gap() == 1.0
        assert cls(world_size=1).is_identity(0) and cls(world_size=1).is_average(0)
    assert OnePeerExponential(world_size=1).period == 1
    np.testing.assert_allclose(Ring(world_size=3).mixing(), np.full((3, 3), 1 / 3))


def test_ring_weights_and_gap() -> None:
    w = Ring(world_size=8).mixing()
    assert w[0, 0] == w[0, 1] == w[0, 7] == pytest.approx(1 / 3) and w[0, 2] == 0
    for n, gap in ((8, 0.8047), (16, 0.9493), (32, 0.9872)):
        assert 1 - Ring(world_size=n).spectral_gap() == pytest.approx(gap, abs=1e-4)
    for n in range(3, 40):
        rho = 1 / 3 + 2 / 3 * math.cos(2 * math.pi / n)
        assert Ring(world_size=n).spectral_gap() == pytest.approx(1 - rho, abs=1e-10)


def test_torus_weights_and_gap() -> None:
    assert 1 - Torus(world_size=16).spectral_gap() == pytest.approx(0.60, abs=1e-10)
    assert 1 - Torus(world_size=64).spectral_gap() == pytest.approx(0.883, abs=1e-3)
    assert 1 - Torus(world_size=64).spectral_gap() == pytest.approx((3 + 2 * math.cos(math.pi / 4)) / 5, abs=1e-10)
    for rows, n in ((4, 16), (2, 8), (4, 8), (3, 12), (4, 20), (5, 35), (6, 24), (8, 64)):
        rho = (3 + 2 * math.cos(2 * math.pi / max(rows, n // rows))) / 5
        assert 1 - Torus(rows, world_size=n).spectral_gap() == pytest.approx(rho, abs=1e-10)
    w = Torus(world_size=16).mixing()  # 4x4, rank 5 = (1, 1)
    assert sorted(j for j, _ in Torus(world_size=16).in_neighbors(5, 0)) == [1, 4, 6, 9]
    assert all(weight == pytest.approx(0.2) for _, weight in Torus(world_size=16).in_neighbors(5, 0))
    assert w[5, 5] == pytest.approx(0.2)
    # 2 x 4: the up and down neighbours coincide, their weights add
    two = Torus(world_size=8)
    assert repr(two) == "Torus(rows=2, world_size=8)"
    assert dict(two.in_neighbors(0, 0)) == pytest.approx({1: 0.2, 3: 0.2, 4: 0.4})
    assert repr(Torus(rows=4, world_size=8)) == "Torus(rows=4, world_size=8)"
    assert repr(Torus(world_size=36)) == "Torus(rows=6, world_size=36)"


def test_exponential_weights_and_gap() -> None:
    w = Exponential(world_size=8).mixing()
    assert sorted(np.flatnonzero(w[0]).tolist()) == [0, 1, 2, 4]
    np.testing.assert_allclose(w[0, [0, 1, 2, 4]], 0.25)
    np.testing.assert_allclose(w[3, [3, 4, 5, 7]], 0.25)  # W[i, (i + 2^m) mod n]
    assert 1 - Exponential(world_size=32).spectral_gap() == pytest.approx(0.667, abs=1e-3)
    for tau in range(1, 8):
        n = 2**tau
        expected = 1 - 2 / (2 + math.floor(math.log2(n - 1)))
        assert 1 - Exponential(world_size=n).spectral_gap() == pytest.approx(expected, abs=1e-10)
    w = Exponential(world_size=6).mixing()  # offsets 1, 2, 4: weight 1/(2 + 2)
    np.testing.assert_allclose(w[0, [0, 1, 2, 4]], 0.25)


def test_one_peer_exponential_exact_average() -> None:
    topology = OnePeerExponential(world_size=8)
    assert topology.period == 3
    average = np.full((8, 8), 1 / 8)
    for start in range(7):
        window = [topology.mixing(start + t) for t in range(3)]
        np.testing.assert_allclose(window[2] @ window[1] @ window[0], average, rtol=0, atol=1e-15)
        assert not any(topology.is_average(start + t) for t in range(3))
    x = np.random.default_rng(0).standard_normal((8, 5))
    for start in (0, 1, 2, 11):
        y = x
        for t in range(3):
            y = topology.mixing(start + t) @ y
        np.testing.assert_allclose(y, np.broadcast_to(x.mean(axis=0), x.shape), rtol=0, atol=1e-15)
    for step in range(10):
        np.testing.assert_array_equal(topology.mixing(step), topology.mixing(step + 3))
        assert topology.in_neighbors(0, step) == [(2 ** (step % 3), 0.5)]  # W[i, i + 2^(k mod tau)]
        assert topology.out_neighbors(0, step) == [(-(2 ** (step % 3)) % 8, 0.5)]
        assert topology.self_weight(0, step) == 0.5
    # rho(P) is round-off (~1e-17) and rho = rho(P)^(1/3) magnifies it
    assert topology.spectral_gap() == pytest.approx(1.0, abs=1e-4)
    assert OnePeerExponential(world_size=9).period == 4
    assert OnePeerExponential(world_size=2).period == 1


def test_complete() -> None:
    topology = Complete(world_size=5)
    np.testing.assert_allclose(topology.mixing(), np.full((5, 5), 0.2))
    assert topology.is_average(0) and topology.is_average(17) and not topology.is_identity(0)
    assert topology.spectral_gap() == pytest.approx(1.0, abs=1e-12)
    assert not Ring(world_size=8).is_average(0) and not Ring(world_size=8).is_identity(0)


@pytest.mark.parametrize("n", [3, 4, 5, 8, 16])
def test_graph_cycle_is_ring(n: int) -> None:
    topology = GraphTopology(nx.cycle_graph(n))
    np.testing.assert_allclose(topology.mixing(), Ring(world_size=n).mixing(), atol=1e-15)
    assert topology.world_size == n


@pytest.mark.parametrize("graph", [nx.star_graph(6), nx.path_graph(5), nx.barbell_graph(3, 2), nx.complete_graph(4)])
def test_graph_metropolis_hastings(graph: nx.Graph) -> None:
    topology = GraphTopology(graph)
    w = topology.mixing()
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= 0).all() and topology.spectral_gap() > 0
    degree = dict(graph.degree())
    for a, b in graph.edges():
        assert w[a, b] == pytest.approx(1 / (1 + max(degree[a], degree[b])))


def test_graph_node_order_and_self_loops() -> None:
    graph = nx.Graph([("c", "a"), ("a", "b"), ("b", "c"), ("c", "d"), ("d", "d")])
    w = GraphTopology(graph).mixing()  # ranks a=0, b=1, c=2, d=3; the loop on d is ignored
    assert w[3, 2] == pytest.approx(1 / 4) and w[3, 3] == pytest.approx(3 / 4)
    assert w[0, 1] == pytest.approx(1 / 3) and w[0, 2] == pytest.approx(1 / 4)


def test_matrix_topology_round_trip() -> None:
    reference = Exponential(world_size=8)
    for spec in (reference.mixing(), torch.from_numpy(reference.mixing().copy()), reference.mixing().tolist()):
        topology = MatrixTopology(spec)
        assert topology.world_size == 8 and topology.period == 1
        np.testing.assert_array_equal(topology.mixing(), reference.mixing())
        assert topology.spectral_gap() == pytest.approx(reference.spectral_gap(), abs=1e-12)
    one_peer = OnePeerExponential(world_size=8)
    schedule = [one_peer.mixing(k) for k in range(3)]
    for spec in (schedule, [torch.from_numpy(m.copy()) for m in schedule], np.stack(schedule)):
        topology = MatrixTopology(spec)
        assert topology.period == 3
        for step in range(7):
            np.testing.assert_array_equal(topology.mixing(step), one_peer.mixing(step))
        assert topology.spectral_gap() == pytest.approx(one_peer.spectral_gap(), abs=1e-12)
    user = np.full((2, 2), 0.5)
    MatrixTopology(user).mixing()
    user[0, 0] = 0.5  # the caller's array stays writable
    assert repr(MatrixTopology(schedule)) == "MatrixTopology(world_size=8, period=3)"


def test_resolve_topology() -> None:
    assert isinstance(resolve_topology("ring", 4), Ring) and resolve_topology("ring", 4).world_size == 4
    assert isinstance(resolve_topology(nx.cycle_graph(4), 4), GraphTopology)
    assert isinstance(resolve_topology(np.eye(1), 1), MatrixTopology)
    assert isinstance(resolve_topology(torch.full((3, 3), 1 / 3), 3), MatrixTopology)
    assert isinstance(resolve_topology([[0.5, 0.5], [0.5, 0.5]], 2), MatrixTopology)
    unbound = Torus(rows=2)
    bound = resolve_topology(unbound, 6)
    assert bound is not unbound and bound.world_size == 6 and not unbound.is_bound
    assert bound.bind(6) is bound and resolve_topology(bound, 6) is bound
    assert repr(Ring(world_size=8)) == "Ring(world_size=8)"
    assert set(TOPOLOGIES) == {
        "ring",
        "torus",
        "exponential",
        "one_peer_exponential",
        "one_peer_ring",
        "complete",
        "random_matching",
        "hierarchical",
    }
    assert all(issubclass(cls, Topology) for cls in TOPOLOGIES.values())


def _bad(w: list[list[float]]) -> np.ndarray:
    return np.asarray(w, dtype=np.float64)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (_bad([[0.6, 0.5], [0.4, 0.5]]), r"row 0 sums to 1\.1.*Metropolis-Hastings"),
        (_bad([[0.5, 0.5], [0.4, 0.6]]), r"column 0 sums to 0\.9.*GraphTopology"),
        (_bad([[1.5, -0.5], [-0.5, 1.5]]), r"negative.*>= 0"),
        (_bad([[np.nan, 0.5], [0.5, 0.5]]), r"NaN"),
        (np.kron(np.eye(2), np.full((2, 2), 0.5)), r"not connected.*ranks \[2, 3\].*connected graph"),
        (_bad([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]), r"shape \(2, 3\).*square"),
        (np.ones(3), r"2-D"),
        ([[0.5, 0.5], [0.5]], r"n x n"),
        ([np.eye(2), np.eye(3)], r"W\(1\) has shape \(3, 3\)"),
        ([np.eye(2), np.eye(2)], r"not connected.*over a period of 2 steps"),
    ],
)
def test_bad_matrix(spec: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MatrixTopology(spec)
    with pytest.raises(ValueError, match=match):
        resolve_topology(spec, len(spec))


def test_one_way_connectivity() -> None:
    # 0 -> 1 -> 2 -> 0 one-way cycle is fine; a rank nobody hears from is not
    cycle = np.roll(np.eye(3), 1, axis=1) * 0.5 + np.eye(3) * 0.5
    MatrixTopology(cycle)
    with pytest.raises(ValueError, match="not connected"):
        MatrixTopology(np.kron(np.eye(2), np.eye(2)))


def test_bind_errors() -> None:
    with pytest.raises(ValueError, match=r"world size is 8.*matrix is 4x4.*8 rows and columns or run on 4 ranks"):
        MatrixTopology(Ring(world_size=4).mixing()).bind(8)
    with pytest.raises(ValueError, match=r"world size is 8.*graph with 8 nodes"):
        resolve_topology(nx.cycle_graph(4), 8)
    with pytest.raises(ValueError, match=r"Ring\(world_size=4\) is bound to 4 ranks.*world size is 8"):
        Ring(world_size=4).bind(8)
    with pytest.raises(ValueError, match="positive integer"):
        Ring().bind(0)


def test_unbound() -> None:
    ring = Ring()
    assert repr(ring) == "Ring(world_size=None)"
    with pytest.raises(ValueError, match=r"bind it with \.bind\(world_size\)"):
        _ = ring.world_size
    with pytest.raises(ValueError, match="bind"):
        ring.mixing()


def test_torus_errors() -> None:
    with pytest.raises(ValueError, match=r"7 is prime.*\[4, 6, 8, 9, 10, 12, 14\].*'ring' or 'exponential'"):
        Torus(world_size=7)
    with pytest.raises(ValueError, match=r"rows, cols >= 2.*too small"):
        resolve_topology("torus", 2)
    with pytest.raises(ValueError, match=r"rows=3.*must divide.*\[2, 4\]"):
        Torus(rows=3, world_size=8)
    with pytest.raises(ValueError, match=r"rows=8.*must divide"):
        Torus(rows=8).bind(8)


def test_other_errors() -> None:
    with pytest.raises(ValueError, match=r"Unknown topology 'rnig'.*'complete'.*'ring'"):
        resolve_topology("rnig", 4)
    with pytest.raises(TypeError, match=r"networkx graph.*mixing matrix"):
        resolve_topology(3.5, 4)
    with pytest.raises(ValueError, match="undirected"):
        GraphTopology(nx.DiGraph([(0, 1), (1, 0)]))
    with pytest.raises(ValueError, match="not connected"):
        GraphTopology(nx.Graph([(0, 1), (2, 3)]))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        Ring(world_size=4).in_neighbors(4, 0)


def test_graph_edge_weights_are_the_mixing_weights() -> None:
    """An edge `weight` is `w_ij`; the self-weight makes each row sum to 1; unweighted graphs keep
    Metropolis-Hastings."""
    graph = nx.Graph()
    graph.add_weighted_edges_from([(0, 1, 0.5), (1, 2, 0.25), (2, 3, 0.5), (3, 0, 0.25)])
    w = GraphTopology(graph).mixing()
    expected = np.array(
        [[0.25, 0.5, 0.0, 0.25], [0.5, 0.25, 0.25, 0.0], [0.0, 0.25, 0.25, 0.5], [0.25, 0.0, 0.5, 0.25]]
    )
    np.testing.assert_allclose(w, expected, atol=1e-15)
    assert isinstance(resolve_topology(graph, 4), GraphTopology)
    np.testing.assert_allclose(resolve_topology(graph, 4).mixing(), expected, atol=1e-15)
    # labels other than 0..n-1 and a self loop (ignored: w_ii is 1 minus the row's other weights)
    labelled = nx.Graph()
    labelled.add_weighted_edges_from([("a", "b", 0.3), ("b", "c", 0.6), ("c", "c", 0.9)])
    np.testing.assert_allclose(
        GraphTopology(labelled).mixing(), [[0.7, 0.3, 0.0], [0.3, 0.1, 0.6], [0.0, 0.6, 0.4]], atol=1e-15
    )


@pytest.mark.parametrize(
    ("edges", "match"),
    [
        ([(0, 1, 0.8), (1, 2, 0.4), (2, 0, 0.1)], r"W\[1, 1\] = -0\.2 is negative.*>= 0"),
        ([(0, 1, -0.5), (1, 2, 0.5)], r"negative.*>= 0"),
        ([(0, 1, 0.0), (1, 2, 0.5)], r"not connected"),
    ],
    ids=["row-over-one", "negative-weight", "zero-weight-disconnects"],
)
def test_graph_bad_edge_weights(edges: list[tuple[int, int, float]], match: str) -> None:
    graph = nx.Graph()
    graph.add_weighted_edges_from(edges)
    with pytest.raises(ValueError, match=match):
        GraphTopology(graph)


def test_graph_weights_on_some_edges_only() -> None:
    graph = nx.Graph([(0, 1), (1, 2), (2, 0)])
    graph.edges[0, 1]["weight"] = 0.3
    with pytest.raises(ValueError, match=r"2 of 3 edges have no 'weight'.*\(0, 2\).*every edge a weight, or none"):
        GraphTopology(graph)


def test_graph_mixed_node_labels() -> None:
    graph = nx.Graph([(0, 1), (1, "a"), ("a", 0)])
    with pytest.raises(ValueError, match=r"cannot be sorted.*convert_node_labels_to_integers"):
        GraphTopology(graph)
    np.testing.assert_allclose(
        GraphTopology(nx.convert_node_labels_to_integers(graph)).mixing(), Ring(world_size=3).mixing(), atol=1e-15
    )


# -- the topology of the survivors (for_members) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "members", "expected"),
    [
        (Ring(world_size=5), [0, 1, 3, 4], Ring(world_size=4)),
        (OnePeerExponential(world_size=8), [0, 1, 2, 3, 4, 5, 7], OnePeerExponential(world_size=7)),
        (Exponential(world_size=8), [1, 2, 3, 4, 5, 6, 7], Exponential(world_size=7)),
        (Complete(world_size=4), [0, 3], Complete(world_size=2)),
        (Torus(world_size=16), list(range(15)), Torus(world_size=15)),  # 4 x 4 -> 3 x 5
    ],
    ids=["ring", "one_peer_exponential", "exponential", "complete", "torus"],
)
def test_a_named_topology_of_the_survivors_is_the_same_kind_at_the_new_size(
    topology: Topology, members: list[int], expected: Topology
) -> None:
    survivors = topology.for_members(members)
    assert repr(survivors) == repr(expected)
    for step in range(expected.period):
        np.testing.assert_array_equal(survivors.mixing(step), expected.mixing(step))


def _metropolis_hastings_of(edges: set[tuple[int, int]], n: int) -> np.ndarray:
    """The Metropolis-Hastings matrix of an undirected edge set, written out here."""
    degree = [sum(1 for e in edges if i in e) for i in range(n)]
    w = np.zeros((n, n))
    for i, j in edges:
        w[i, j] = w[j, i] = 1 / (1 + max(degree[i], degree[j]))
    return w + np.diag(1 - w.sum(axis=1))


def test_a_matrix_of_the_survivors_is_their_induced_subgraph_with_metropolis_hastings_weights() -> None:
    # two phases on 5 ranks; rank 1 dies. Phase 0: the path 0-1-2-3-4 plus the chord 0-2 (the survivors keep
    # 0-2, 2-3, 3-4); phase 1: a directed cycle 0->1->2->3->4->0 (edges count in either direction).
    path = _metropolis_hastings_of({(0, 1), (1, 2), (2, 3), (3, 4), (0, 2)}, 5)
    cycle = (np.eye(5) + np.roll(np.eye(5), 1, axis=1)) / 2
    survivors = MatrixTopology([path, cycle]).for_members([0, 2, 3, 4])  # new ranks 0, 1, 2, 3
    np.testing.assert_allclose(survivors.mixing(0), _metropolis_hastings_of({(0, 1), (1, 2), (2, 3)}, 4))
    np.testing.assert_allclose(survivors.mixing(1), _metropolis_hastings_of({(1, 2), (2, 3), (3, 0)}, 4))
    assert survivors.period == 2


def test_a_graph_of_the_survivors_is_the_graph_they_induce() -> None:
    graph = nx.petersen_graph()
    members = [m for m in range(10) if m not in (3, 7)]
    induced = nx.convert_node_labels_to_integers(graph.subgraph(members), ordering="sorted")
    np.testing.assert_allclose(GraphTopology(graph).for_members(members).mixing(), GraphTopology(induced).mixing())


def test_a_torus_that_does_not_fit_the_survivors_becomes_their_induced_subgraph() -> None:
    survivors = Torus(world_size=6).for_members([0, 1, 2, 4, 5])  # 2 x 3 -> 5 ranks, prime
    torus = Torus(world_size=6).mixing()[np.ix_([0, 1, 2, 4, 5], [0, 1, 2, 4, 5])]
    edges = {(i, j) for i in range(5) for j in range(i + 1, 5) if torus[i, j] > 0}
    np.testing.assert_allclose(survivors.mixing(), _metropolis_hastings_of(edges, 5))


def test_survivors_that_fall_apart_and_bad_members_are_refused() -> None:
    star = GraphTopology(nx.star_graph(3))  # the centre 0 dies: the leaves share no edge
    with pytest.raises(ValueError, match="not connected"):
        star.for_members([1, 2, 3])
    ring = Ring(world_size=4)
    for members in ([], [0, 0, 1], [2, 1], [0, 4]):
        with pytest.raises(ValueError, match=r"members must be ranks in \[0, 4\) in increasing order"):
            ring.for_members(members)
    assert ring.for_members([0, 1, 2, 3]) is ring
    assert Ring(world_size=4).for_members([2]).mixing().tolist() == [[1.0]]
