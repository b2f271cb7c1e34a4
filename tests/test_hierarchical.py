"""``topology="hierarchical"``: ``W(k) = W_out(k) ⊗ W_in(k)`` on Lightning's node layout.

4 gloo processes emulate 2 nodes x 2 ranks, through Lightning's own layout (``num_nodes=2``,
``NODE_RANK``, ``LOCAL_RANK``) or an explicit ``ranks_per_node``, and must reproduce the dense
reference, whose ``W`` is written independently in ``tests/reference.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_decentral import DecentralizedStrategy, Hierarchical
from lightning_decentral.topology import Complete, OnePeerExponential, Ring, resolve_topology
from tests import reference, workers
from tests.helpers import run_distributed
from tests.reference import Config

WORLD = 4
MOMENTUM = {"lr": 0.05, "momentum": 0.9}
# Every built-in topology on 2 nodes is 11ᵀ/2, which would make W = 11ᵀ/4: a lazy outer matrix keeps the replicas apart.
LAZY = [[0.75, 0.25], [0.25, 0.75]]
CONFIGS = [
    Config("nodes-awc", topology="hierarchical", hierarchy=("complete", LAZY, None), num_nodes=2, optimizer=MOMENTUM),
    Config(
        "explicit-atc-rounds2", topology="hierarchical", hierarchy=("complete", LAZY, 2), combine="atc", gossip_steps=2
    ),
    Config(
        "nodes-decentlam",
        topology="hierarchical",
        hierarchy=("complete", LAZY, None),
        num_nodes=2,
        momentum="decentlam",
        optimizer={"lr": 0.1, "momentum": 0.9},
    ),
    Config(
        "nodes-awc-batchnorm-bf16",
        topology="hierarchical",
        hierarchy=("complete", LAZY, None),
        num_nodes=2,
        optimizer=MOMENTUM,
        batch_norm=True,
        gossip_dtype=torch.bfloat16,
    ),
    Config(
        "one-per-node-one_peer-atc",
        topology="hierarchical",
        hierarchy=("complete", "one_peer_exponential", 1),
        combine="atc",
    ),
    Config(
        "default-nodes-is-the-average",
        topology="hierarchical",
        hierarchy=("complete", "one_peer_exponential", None),
        num_nodes=2,
        combine="atc",
    ),
]


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    return run_distributed(workers.fit_configs, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_rank_matches_the_dense_reference(trained: list[dict[str, torch.Tensor]], config: Config) -> None:
    expected = reference.assert_every_rank_matches(trained, config, WORLD)
    spread = (expected - expected.mean(0)).abs().max()
    if config.name.startswith("default"):
        assert spread < 1e-6  # complete inside 2 nodes, one-peer across 2: W = 11ᵀ/4, and ATC mixes last
    else:
        assert spread > 1e-4


def test_mixing_is_the_kronecker_product_of_the_levels() -> None:
    topology = Hierarchical("ring", "one_peer_exponential", ranks_per_node=4).bind(32)  # 8 nodes x 4
    assert (topology.node_size, topology.num_nodes, topology.period) == (4, 8, 3)
    for step in range(7):
        w = topology.mixing(step)
        np.testing.assert_array_equal(
            w, np.kron(OnePeerExponential(world_size=8).mixing(step), Ring(world_size=4).mixing())
        )
        np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    # rank 5 = node 1, local rank 1: its node's ring neighbours, then the same local ranks on node 1 + 2^(k mod 3)
    assert [j for j, _ in topology.in_neighbors(5, 0)] == sorted({4 * a + i for a in (1, 2) for i in (0, 1, 2)} - {5})
    lazy = Hierarchical("complete", LAZY, ranks_per_node=2).bind(4)
    np.testing.assert_allclose(lazy.mixing(), np.kron(np.array(LAZY), np.full((2, 2), 0.5)))
    assert not lazy.is_average(0) and lazy.spectral_gap() == pytest.approx(0.5)


def test_spectral_gap_closed_forms() -> None:
    # complete inside: the eigenvalues are the outer ones (and zeros);
    # ring across N nodes: rho = 1/3 + 2/3 cos(2 pi / N)
    for nodes in (3, 5, 8, 16):
        gap = Hierarchical("complete", "ring", ranks_per_node=4).bind(4 * nodes).spectral_gap()
        assert gap == pytest.approx(1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / nodes)), abs=1e-10)
    # static levels: rho = max(rho_in, rho_out)
    both = Hierarchical("ring", "ring", ranks_per_node=5).bind(35)
    assert 1 - both.spectral_gap() == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / 7), abs=1e-10)
    # one-peer exponential across 2^t nodes averages exactly every t steps: so does the whole W after complete inside
    window = Hierarchical(ranks_per_node=2).bind(16)
    product = window.mixing(2) @ window.mixing(1) @ window.mixing(0)
    np.testing.assert_allclose(product, np.full((16, 16), 1 / 16), atol=1e-15)


def test_node_layout() -> None:
    by_nodes = resolve_topology("hierarchical", 8, num_nodes=2)
    assert isinstance(by_nodes, Hierarchical) and (by_nodes.node_size, by_nodes.num_nodes) == (4, 2)
    assert resolve_topology("hierarchical", 8).num_nodes == 1  # bound by hand: one node
    explicit = Hierarchical(ranks_per_node=2)
    assert resolve_topology(explicit, 8, num_nodes=4).num_nodes == 4
    assert resolve_topology(explicit, 8, num_nodes=1).node_size == 2  # an explicit ranks_per_node wins
    bound = Hierarchical(world_size=8)
    assert resolve_topology(bound, 8, num_nodes=2).num_nodes == 2 and bound.num_nodes == 1
    np.testing.assert_array_equal(resolve_topology("hierarchical", 6).mixing(), Complete(world_size=6).mixing())


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match=r"6 ranks do not split.*num_nodes=4.*ranks_per_node= one of \[1, 2, 3, 6\]"):
        resolve_topology("hierarchical", 6, num_nodes=4)
    with pytest.raises(ValueError, match=r"ranks_per_node=4.*\[1, 2, 3, 6\]"):
        Hierarchical(ranks_per_node=4).bind(6)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        Hierarchical(ranks_per_node=0)
    with pytest.raises(ValueError, match=r"inner topology on 2 ranks per node.*torus.*too small"):
        Hierarchical(inner="torus", ranks_per_node=2).bind(8)
    with pytest.raises(ValueError, match=r"outer topology on 2 nodes.*matrix is 3x3"):
        Hierarchical(outer=np.full((3, 3), 1 / 3), ranks_per_node=2).bind(4)
    with pytest.raises(ValueError, match=r"6 ranks do not split.*ranks_per_node=4"):  # when the Trainer is built
        workers.trainer_for(3, DecentralizedStrategy(topology=Hierarchical(ranks_per_node=4)), num_nodes=2)


def test_the_strategy_binds_lightnings_node_layout() -> None:
    trainer = workers.trainer_for(3, DecentralizedStrategy(topology="hierarchical"), num_nodes=2)
    topology = trainer.strategy.topology
    assert isinstance(topology, Hierarchical) and (topology.node_size, topology.num_nodes) == (3, 2)


def test_a_lost_rank_leaves_its_node_and_its_group_across_nodes() -> None:
    """3 nodes x 4, complete inside, ring across; rank 1 (node 0, local rank 1) dies, then rank 6 (node 1, local 2)."""
    topology = Hierarchical("complete", "ring", ranks_per_node=4).bind(12)
    once = topology.for_members([r for r in range(12) if r != 1])  # old rank r > 1 is new rank r - 1
    assert once.node_sizes == (3, 4, 4) and once.world_size == 11
    inner, outer = once.levels()
    assert inner.groups == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10]]
    assert outer.groups == [[0, 3, 7], [4, 8], [1, 5, 9], [2, 6, 10]]  # local rank 1's group lost node 0
    assert [repr(p) for p in outer.parts] == ["Ring(world_size=3)", "Ring(world_size=2)"] + ["Ring(world_size=3)"] * 2
    w = once.mixing(0)
    np.testing.assert_allclose(w, outer.matrix(0, 11) @ inner.matrix(0, 11))
    np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    twice = once.for_members([r for r in range(11) if r != 5])  # old rank 6
    assert twice.node_sizes == (3, 3, 4) and repr(twice).startswith(
        "Hierarchical(inner='complete', outer='ring', node_sizes=(3, 3, 4)"
    )
    assert twice.levels()[1].groups == [[0, 3, 6], [4, 7], [1, 8], [2, 5, 9]]
    assert 0 < twice.spectral_gap() <= 1


def test_a_node_left_with_one_rank_mixes_only_across_nodes() -> None:
    topology = Hierarchical("ring", "complete", ranks_per_node=2).bind(6)
    survivors = topology.for_members([0, 2, 3, 4, 5])  # node 0 keeps rank 0 alone
    assert survivors.node_sizes == (1, 2, 2)
    assert survivors.levels()[0].groups == [[1, 2], [3, 4]]
    assert [j for j, _ in survivors.in_neighbors(0, 0)] == [1, 2, 3, 4]  # rank 0's group across: 0, 1, 3
