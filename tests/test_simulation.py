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
