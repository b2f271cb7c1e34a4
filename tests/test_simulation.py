"""SimulatedDecentralizedStrategy: n workers in one process reproduce DecentralizedStrategy on n gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import simulation_workers as sim
from tests.helpers import run_distributed
from tests.reference import Config

WORLD = 4
SGD = {"lr": 0.05, "momentum": 0.9}
CONFIGS = [
    Config("awc_ring", optimizer=SGD),
    Config("atc_ring", combine="atc", optimizer=SGD),
    Config("decentlam_ring", momentum="decentlam", optimizer=SGD),
    Config("awc_one_peer_adam", topology="one_peer_exponential", optimizer={"name": "adam", "lr": 0.01}),
    Config("atc_exponential_scheduler", topology="exponential", combine="atc", optimizer=SGD, scheduler="step"),
    Config("decentlam_one_peer_clip_accumulate", topology="one_peer_exponential", momentum="decentlam", optimizer=SGD,
           accumulate=2, clip=0.5),
    Config("awc_clip_accumulate_batch_norm", optimizer=SGD, accumulate=2, clip=0.5, batch_norm=True),
    Config("decentlam_exponential_batch_norm", topology="exponential", momentum="decentlam", optimizer=SGD,
           batch_norm=True),
    Config("awc_bf16_gossip", optimizer=SGD, gossip_dtype=torch.bfloat16),
    Config("atc_gossip_every_2_steps_2", combine="atc", optimizer=SGD, gossip_every=2, gossip_steps=2),
]


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_simulated_workers_equal_the_ranks(config: Config, on_processes: list[dict[str, Any]], monkeypatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    simulated = sim.fit_simulated(config, WORLD)
    ranks = torch.stack([r[config.name]["state"] for r in on_processes]).double()
    workers = torch.stack(simulated["states"]).double()
    assert (ranks[0] - ranks[1]).abs().max() > 1e-4  # the replicas differ: a real test of every worker
    torch.testing.assert_close(workers, ranks, atol=1e-5, rtol=0)
    # what training_step logs is the mean over the workers, as sync_dist=True gives on n ranks
    assert simulated["train_loss"] == pytest.approx(on_processes[0][config.name]["train_loss"], abs=1e-5)


REFERENCE_CONFIGS = [
    Config("awc_sgd", optimizer={"lr": 0.1}),
    Config("awc_momentum_one_peer", topology="one_peer_exponential", optimizer=SGD),
    Config("atc_adam_exponential", topology="exponential", combine="atc", optimizer={"name": "adam", "lr": 0.01}),
    Config("decentlam_ring_warmup", momentum="decentlam", optimizer=SGD, scheduler="warmup"),
    Config("decentlam_complete", topology="complete", momentum="decentlam", optimizer=SGD),
    Config("atc_batch_norm_clip_accumulate", combine="atc", optimizer=SGD, batch_norm=True, clip=0.5, accumulate=2),
    Config("awc_bf16_gossip_batch_norm", optimizer=SGD, gossip_dtype=torch.bfloat16, batch_norm=True),
]


@pytest.mark.parametrize("config", REFERENCE_CONFIGS, ids=lambda c: c.name)
def test_every_rule_matches_the_dense_reference(config: Config) -> None:
    from tests.reference import run

    simulated = sim.fit_simulated_on_rank_data(config, WORLD)
    torch.testing.assert_close(simulated.double(), run(config, WORLD).double(), atol=1e-5, rtol=0)


def test_each_worker_draws_from_its_own_random_state(monkeypatch) -> None:
    """Dropout masks: worker i draws what rank i draws (every rank starts from the same seed)."""
    config = Config("awc_dropout", optimizer=SGD)
    ranks = run_distributed(sim.fit_processes, WORLD, configs=[config], dropout=0.3)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    simulated = sim.fit_simulated(config, WORLD, dropout=0.3)
    without = sim.fit_simulated(config, WORLD)
    expected = torch.stack([r[config.name]["state"] for r in ranks])
    assert (torch.stack(without["states"]) - expected).abs().max() > 1e-3  # dropout changed the run
    torch.testing.assert_close(torch.stack(simulated["states"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("devices, num_nodes", [(2, 1), (1, 2)])
def test_more_than_one_device_or_node_is_refused(devices: int, num_nodes: int) -> None:
    import lightning.pytorch as pl

    from lightning_decentral import SimulatedDecentralizedStrategy

    with pytest.raises(ValueError, match="devices=1|num_nodes=1"):
        pl.Trainer(strategy=SimulatedDecentralizedStrategy(workers=4), accelerator="cpu", devices=devices, num_nodes=num_nodes)


def test_string_names_and_bad_arguments() -> None:
    import lightning.pytorch as pl

    import lightning_decentral  # noqa: F401
    from lightning_decentral import SimulatedDecentralizedStrategy

    trainer = pl.Trainer(strategy="decentlam_sim", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, SimulatedDecentralizedStrategy)
    assert trainer.strategy.workers == 8 and trainer.strategy.momentum == "decentlam"
    with pytest.raises(ValueError, match="positive integer"):
        SimulatedDecentralizedStrategy(workers=0)
    with pytest.raises(ValueError, match="combine"):
        SimulatedDecentralizedStrategy(workers=4, combine="acw")


def test_evaluation_runs_on_the_average_or_on_worker_zero() -> None:
    for eval_on in ("average", "local"):
        seen = sim.validate_simulated(Config("eval", optimizer=SGD), WORLD, eval_on)
        workers = torch.stack(seen["workers"])
        expected = workers.mean(0) if eval_on == "average" else workers[0]
        torch.testing.assert_close(seen["validated"], expected, atol=1e-6, rtol=0)
        assert torch.equal(seen["after"], workers[0])  # worker 0's replica is back, bit for bit


@pytest.mark.parametrize("config", [Config("awc", optimizer=SGD), Config("decentlam", momentum="decentlam", optimizer=SGD)],
                         ids=lambda c: c.name)
def test_monitors_log_what_they_log_on_processes(config: Config, monkeypatch) -> None:
    """ConsensusDistance (per layer), EffectiveLearningRate (with dropout: the forward at x̄ replays each
    worker's random state) and ConsensusControl log, step by step, the values of the 4-process run."""
    ranks = run_distributed(sim.fit_processes_monitored, WORLD, config=config, dropout=0.2)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    simulated = sim.fit_simulated_monitored(config, WORLD, dropout=0.2)
    expected = ranks[0]["metrics"]
    assert len(simulated["metrics"]) == len(expected) == config.steps
    assert {"consensus/distance", "consensus/residual", "lr/effective_ratio", "consensus/gossip_steps"} <= set(expected[-1])
    assert max(m["consensus/gossip_steps"] for m in expected) > 1 or config.momentum == "decentlam"  # control acted
    for step, (seen, want) in enumerate(zip(simulated["metrics"], expected)):
        assert seen.keys() == want.keys(), step
        for key in want:
            assert seen[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    torch.testing.assert_close(torch.stack(simulated["states"]), torch.stack([r["state"] for r in ranks]), atol=1e-5, rtol=0)
