"""Local steps with an outer optimizer (`outer_optimizer=`): the Trainer's and Fabric's strategies on gloo processes,
the simulation (workers apart and stacked) and the references written from the papers (tests/outer_reference.py) give
the same replicas; a checkpoint in the middle of a round resumes exactly; what does not compose is refused."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.checkpoint import read_shard, shard_path
from tests import fabric_workers, outer_reference
from tests import simulation_workers as sim
from tests.helpers import assert_resumed_as_straight, run_distributed
from tests.marks import slow_cases
from tests.reference import Config

WORLD = 4
SGD = {"lr": 0.05, "momentum": 0.9}
NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
CONFIGS = [
    Config("diloco", topology="complete", optimizer=SGD, outer=NESTEROV, gossip_every=3, steps=9),
    Config(
        "outer_one_peer_batch_norm",
        topology="one_peer_exponential",
        optimizer=SGD,
        outer=NESTEROV,
        gossip_every=3,
        steps=9,
        batch_norm=True,
    ),
    Config("outer_ring_overlap", optimizer=SGD, outer=NESTEROV, outer_overlap=True, gossip_every=2, steps=9),
]


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_simulated_workers_equal_the_ranks(config: Config, vectorize: bool, on_processes: list[dict[str, Any]]) -> None:
    simulated = sim.fit_simulated(config, WORLD, vectorize=vectorize)
    ranks = torch.stack([r[config.name]["state"] for r in on_processes]).double()
    if config.topology != "complete":
        assert (ranks[0] - ranks[1]).abs().max() > 1e-4  # the replicas differ: a real test of every worker
    torch.testing.assert_close(torch.stack(simulated["states"]).double(), ranks, atol=1e-5, rtol=0)


def _expected(config: Config) -> torch.Tensor:
    expected = outer_reference.decentralized(config, WORLD)
    if config.topology == "complete" and not config.outer_overlap:  # DiLoCo exactly
        torch.testing.assert_close(expected, outer_reference.diloco(config, WORLD), atol=1e-5, rtol=0)
    return expected


@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
@pytest.mark.parametrize("config", slow_cases(CONFIGS, {"outer_one_peer_batch_norm"}), ids=lambda c: c.name)
def test_the_simulation_is_the_reference(config: Config, vectorize: bool) -> None:
    simulated = sim.fit_simulated_on_rank_data(config, WORLD, vectorize=vectorize)
    torch.testing.assert_close(simulated.double(), _expected(config), atol=1e-5, rtol=0)


@pytest.mark.parametrize("failures", [{2: [1]}, {4: [0], 6: [3]}], ids=["at-a-round-end", "inside-rounds"])
def test_workers_lost_on_the_way_match_the_reference(failures: dict[int, list[int]]) -> None:
    """The simulation's failures= runs on_peer_failure="continue"'s rule of repair: the step a worker is lost at
    exchanges nothing (`W = I`: a round that ends there takes its outer step with the worker's own pseudo-gradient),
    then the survivors mix with the topology at their number, each keeping its anchor and outer momentum."""
    config = Config("outer_ring_failures", optimizer=SGD, outer=NESTEROV, gossip_every=3, steps=9, failures=failures)
    simulated = sim.fit_simulated_on_rank_data(config, 6)
    expected = outer_reference.decentralized(config, 6)
    assert simulated.shape == expected.shape == (6 - sum(len(v) for v in failures.values()), expected.shape[1])
    torch.testing.assert_close(simulated.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_fabric_on_processes_is_the_reference() -> None:
    trained = run_distributed(fabric_workers.fit_configs, WORLD, configs=CONFIGS)
    for config in CONFIGS:
        ranks = torch.stack([r[config.name] for r in trained]).double()
        torch.testing.assert_close(ranks, _expected(config), atol=1e-5, rtol=0, msg=config.name)


# -- checkpoints in the middle of a round ---------------------------------------------------------------------

OUTER = {"outer_optimizer": functools.partial(torch.optim.SGD, **NESTEROV), "gossip_every": 3}  # 4 steps per epoch


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 epochs straight and 1 + 1 through a checkpoint at step 4, one step into the second round (steps 3-5)."""
    root = tmp_path_factory.mktemp("outer_resume")
    out: dict[str, Any] = {"root": root}
    runs = {
        "per_worker": {"topology": "ring", "dropout": 0.2},
        "vectorized": {"topology": "ring", "vectorize": True, "dropout": 0.0},
        "overlap": {"topology": "ring", "outer_overlap": True, "dropout": 0.2},
    }
    for name, kwargs in runs.items():
        path = str(root / f"{name}.ckpt")
        out[name] = {
            "first": sim.resume_simulated(WORLD, save=path, **OUTER, **kwargs),
            "straight": sim.resume_simulated(WORLD, **OUTER, **kwargs),
            "resumed": sim.resume_simulated(WORLD, load=path, **OUTER, **kwargs),
        }
    vectorized = str(root / "vectorized.ckpt")
    out["per_worker_from_vectorized"] = sim.resume_simulated(
        WORLD, load=vectorized, dropout=0.0, topology="ring", **OUTER
    )
    processes, path = 2, str(root / "processes.ckpt")
    run_distributed(sim.resume_processes, processes, save=path, **OUTER, topology="complete")
    out["processes"] = {
        "straight": run_distributed(sim.resume_processes, processes, **OUTER, topology="complete"),
        "resumed": run_distributed(sim.resume_processes, processes, load=path, **OUTER, topology="complete"),
    }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["per_worker", "vectorized", "overlap", "processes"])
def test_a_resume_in_the_middle_of_a_round_is_exact(resumed: dict[str, Any], name: str) -> None:
    assert_resumed_as_straight(resumed[name])


@pytest.mark.slow
def test_the_shards_hold_the_anchor_and_the_outer_momentum(resumed: dict[str, Any]) -> None:
    """Mid-round, the anchor is not the replica: without it in the shard, the resume could not be exact."""
    path = str(resumed["root"] / "per_worker.ckpt")
    meta = torch.load(path, weights_only=True)["decentralized_shards"]
    for worker in range(WORLD):
        shard = read_shard(shard_path(path, worker, WORLD, meta["save_id"]))
        state = shard["rule_state"]
        replica = torch.cat(
            [v.reshape(-1) for k, v in shard["state_dict"].items() if "running" not in k and "num_batches" not in k]
        )
        assert [a.numel() for a in state["anchor"]] == [40, 8, 24, 3]  # one per parameter, whatever the packing
        assert (torch.cat(state["anchor"]) - replica).abs().max() > 1e-4
        momentum = state["outer_optimizer"]["state"]
        assert [set(momentum[k]) for k in range(4)] == [{"momentum_buffer"}] * 4
    torch.testing.assert_close(
        torch.stack(resumed["per_worker_from_vectorized"]),
        torch.stack(resumed["vectorized"]["straight"]),
        atol=1e-5,
        rtol=0,
    )


# -- what does not compose is refused, naming the fix ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"momentum": "decentlam"}, "momentum='decentlam' .* use momentum='local'"),
        ({"staleness": 1, "gossip_every": 1}, "staleness=1 .* use staleness=0"),
        ({"outer_overlap": True, "on_peer_failure": "continue"}, "use outer_overlap=False"),
        (
            {"outer_optimizer": torch.optim.SGD(torch.nn.Linear(1, 1).parameters())},
            "must be a factory, parameters -> optimizer",
        ),
        (
            {"outer_optimizer": functools.partial(torch.optim.SGD, lr=-0.7)},
            "building it failed: .*Invalid learning rate",
        ),
    ],
    ids=["decentlam", "staleness", "overlap-continue", "an-optimizer", "bad-lr"],
)
def test_what_does_not_compose_is_refused_when_built(kwargs: dict[str, Any], match: str) -> None:
    options = {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7), "gossip_every": 4, **kwargs}
    for strategy in (DecentralizedStrategy, SimulatedDecentralizedStrategy):
        if strategy is SimulatedDecentralizedStrategy and "on_peer_failure" in kwargs:
            continue  # the simulation names its lost workers with failures=
        with pytest.raises(ValueError, match=match):
            strategy(**options)


def test_overlap_without_an_outer_optimizer_or_with_lost_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="needs an outer_optimizer"):
        DecentralizedStrategy(outer_overlap=True)
    outer = functools.partial(torch.optim.SGD, lr=0.7)
    with pytest.raises(ValueError, match="use outer_overlap=False with failures"):
        SimulatedDecentralizedStrategy(failures={3: [1]}, outer_optimizer=outer, outer_overlap=True, gossip_every=4)


def test_a_non_elementwise_outer_optimizer_keeps_the_simulated_workers_apart() -> None:
    from lightning_decentral.simulation.vectorized import stacking_problem

    net = torch.nn.Linear(2, 1)
    outer = torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
    problem = stacking_problem(net, torch.optim.SGD(net.parameters(), lr=0.1), outer=outer)
    assert problem is not None and "the outer optimizer LBFGS" in problem


def test_the_rule_is_recorded_and_a_resume_under_another_warns(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "outer.ckpt")
    sim.resume_simulated(WORLD, save=checkpoint, dropout=0.0, **OUTER)
    assert (
        read_shard(
            shard_path(
                checkpoint, 0, WORLD, torch.load(checkpoint, weights_only=True)["decentralized_shards"]["save_id"]
            )
        )["strategy"]["rule"]
        == "outer"
    )
    with pytest.warns(UserWarning, match="'outer' -> 'awc'"):
        sim.resume_simulated(WORLD, load=checkpoint, dropout=0.0)


def test_every_rank_must_run_the_same_outer_optimizer() -> None:
    """What the ranks compare before the first exchange names the outer optimizer by its class and defaults (a
    functools.partial or jsonargparse's callable has an address in its repr: that would differ from rank to rank)."""
    from lightning_decentral.agreement import run_configuration
    from tests.models import make_net

    def configuration(**options: Any) -> dict[str, Any]:
        return run_configuration(
            SimulatedDecentralizedStrategy(workers=4, gossip_every=4, **options), make_net(), "32-true"
        )

    seven = configuration(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
    assert seven["outer_optimizer"].startswith("SGD(lr=0.7, momentum=0.9, dampening=0,") and seven["outer_overlap"] == 0
    assert seven == configuration(
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    )
    assert (
        seven["outer_optimizer"]
        != configuration(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.5))["outer_optimizer"]
    )
    assert configuration()["outer_optimizer"] == ""
