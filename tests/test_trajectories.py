"""n = 4 gloo processes training with the strategy reproduce the dense reference to 1e-5."""

from __future__ import annotations

import pytest
import torch

from tests import reference, workers
from tests.helpers import run_distributed
from tests.reference import Config

pytestmark = pytest.mark.slow  # every test here starts processes

WORLD = 4
SGD = {"lr": 0.1}
MOMENTUM = {"lr": 0.05, "momentum": 0.9}

CONFIGS = [
    Config(f"{topology}-{combine}-{opt}", topology=topology, combine=combine, optimizer=kwargs)
    for topology in ("ring", "exponential", "one_peer_exponential", "complete")
    for combine in ("awc", "atc")
    for opt, kwargs in (("sgd", SGD), ("momentum", MOMENTUM))
] + [
    Config("ring-awc-every2", gossip_every=2, optimizer=MOMENTUM),
    Config("ring-atc-every2", combine="atc", gossip_every=2),
    Config("ring-awc-rounds2", gossip_steps=2, optimizer=MOMENTUM),
    Config("one_peer-atc-rounds2", topology="one_peer_exponential", combine="atc", gossip_steps=2),
    Config("exponential-awc-every2-rounds2", topology="exponential", gossip_every=2, gossip_steps=2),
    Config(
        "ring-awc-nesterov-wd-scheduler",
        optimizer={"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        scheduler="step",
    ),
    Config("ring-awc-adam", optimizer={"name": "adam", "lr": 0.01}),
    Config("ring-awc-accumulate-clip", optimizer=MOMENTUM, accumulate=2, clip=0.05),
    Config("one_peer-atc-accumulate-clip", topology="one_peer_exponential", combine="atc", accumulate=3, clip=0.05),
    Config("ring-awc-float64", optimizer=MOMENTUM, dtype=torch.float64),
    Config("ring-awc-batchnorm", optimizer=MOMENTUM, batch_norm=True),
    Config("one_peer-atc-batchnorm", topology="one_peer_exponential", combine="atc", batch_norm=True),
]


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    """Every config trained once, in one group of 4 processes."""
    return run_distributed(workers.fit_configs, WORLD, configs=CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_rank_matches_the_dense_reference(trained: list[dict[str, torch.Tensor]], config: Config) -> None:
    expected = reference.assert_every_rank_matches(trained, config, WORLD)
    if config.topology != "complete":  # decentralized: the replicas really differ
        assert (expected[0] - expected[1]).abs().max() > 1e-4


def test_complete_atc_with_sgd_is_ddp() -> None:
    """With W = 11ᵀ/n, ATC with plain SGD is parallel SGD: the trajectory of DDP."""
    config = Config("complete-atc-sgd", topology="complete", combine="atc", optimizer=SGD)
    ddp = run_distributed(workers.fit_ddp, WORLD, config=config)
    decentralized = run_distributed(workers.fit_configs, WORLD, configs=[config])
    for rank in range(WORLD):
        torch.testing.assert_close(decentralized[rank][config.name], ddp[rank], atol=1e-6, rtol=0)
