"""`topology="random_matching"` (NoLoCo's one random peer per round): each `W(k)` is a perfect matching drawn from a
seed every rank shares, halves on each pair (`n` odd: one rank sits out); it runs plain gossip, the outer optimizer
and the survivors of a failure, the simulation equal to the dense reference and to the ranks on gloo processes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_decentral import DecentralizedStrategy, RandomMatching
from lightning_decentral.topology import resolve_topology
from tests import outer_reference
from tests import simulation_workers as sim
from tests.helpers import run_distributed
from tests.reference import Config, mixing, run

WORLD = 4
SGD = {"lr": 0.05, "momentum": 0.9}
NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@pytest.mark.parametrize("n", [2, 5, 8])
def test_every_step_is_a_matching_drawn_from_the_shared_seed(n: int) -> None:
    graph, again = RandomMatching(world_size=n), resolve_topology("random_matching", n)
    pairs = set()
    for step in range(64):
        w = graph.mixing(step)
        assert np.array_equal(w, again.mixing(step)) and np.array_equal(w, mixing("random_matching", n, step).numpy())
        assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.array_equal(w, w.T)
        alone = [i for i in range(n) if w[i, i] == 1]
        assert len(alone) == n % 2  # odd n: one rank sits the step out
        for i in range(n):
            if i not in alone:
                ((peer, weight),) = graph.in_neighbors(i, step)
                assert weight == 0.5 and graph.in_neighbors(peer, step) == [(i, 0.5)]
                pairs.add((min(i, peer), max(i, peer)))
    assert len(pairs) == n * (n - 1) // 2  # in 64 steps every rank has met every other
    assert not np.array_equal(RandomMatching(seed=1, world_size=n).mixing(3), graph.mixing(3)) or n == 2


def test_survivors_draw_among_themselves_with_the_same_seed() -> None:
    survivors = RandomMatching(seed=7, world_size=6).for_members([0, 2, 3, 4, 5])
    assert repr(survivors) == "RandomMatching(seed=7, period=64, world_size=5)"
    with pytest.raises(ValueError, match="`seed` must be an integer"):
        RandomMatching(seed=-1)
    assert DecentralizedStrategy(topology=RandomMatching(seed=3)).options.topology.seed == 3


PLAIN = Config("awc_random_matching", topology="random_matching", optimizer=SGD, steps=6)
OUTER = Config(
    "outer_random_matching", topology="random_matching", optimizer=SGD, outer=NESTEROV, gossip_every=2, steps=8
)


@pytest.mark.parametrize("n", [4, 5])
def test_the_simulation_is_the_reference(n: int) -> None:
    torch.testing.assert_close(
        sim.fit_simulated_on_rank_data(PLAIN, n).double(), run(PLAIN, n).double(), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        sim.fit_simulated_on_rank_data(OUTER, n).double(), outer_reference.decentralized(OUTER, n), atol=1e-5, rtol=0
    )


def test_lost_workers_go_on_with_a_matching_of_the_survivors() -> None:
    """The simulation's failures= runs on_peer_failure="continue"'s rule (the step of the loss exchanges nothing, then
    the survivors' own random matching), with plain gossip and with the outer optimizer."""
    for config, reference in [(PLAIN, run), (OUTER, outer_reference.decentralized)]:
        lost = Config(**{**config.__dict__, "name": f"{config.name}_lost", "failures": {3: [2]}})
        simulated = sim.fit_simulated_on_rank_data(lost, 6)
        assert simulated.shape[0] == 5
        torch.testing.assert_close(simulated.double(), reference(lost, 6).double(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=[PLAIN, OUTER])


@pytest.mark.slow
@pytest.mark.parametrize("config", [PLAIN, OUTER], ids=lambda c: c.name)
def test_the_simulation_equals_the_processes(config: Config, on_processes: list[dict[str, Any]]) -> None:
    simulated = sim.fit_simulated(config, WORLD)
    ranks = torch.stack([r[config.name]["state"] for r in on_processes])
    assert (ranks[0] - ranks[1]).abs().max() > 1e-4
    torch.testing.assert_close(torch.stack(simulated["states"]), ranks, atol=1e-5, rtol=0)
