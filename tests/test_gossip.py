"""The gossip engine alone: ``x <- W(k)^r x`` and its residual ``‖x_i − Σ_j w_ij x_j‖²``, against dense W."""

from __future__ import annotations

import pytest
import torch

from tests import gossip_workers
from tests.helpers import run_distributed
from tests.reference import mixing

pytestmark = pytest.mark.slow  # every test here starts processes

WORLD = 4


CASES = [("ring", 0), ("one_peer_exponential", 1), ("complete", 0)]


@pytest.fixture(scope="module")
def exchanged() -> list[dict]:
    """Every case gossiped twice (``W^2``), in one group of 4 processes."""
    return run_distributed(gossip_workers.exchanges, WORLD, cases=CASES, rounds=2)


@pytest.mark.parametrize("topology, step", CASES)
def test_exchange_and_its_residual_match_the_dense_matrix(exchanged: list[dict], topology: str, step: int) -> None:
    out = [per_rank[(topology, step)] for per_rank in exchanged]
    mix = mixing(topology, WORLD, step)
    for b in range(2):
        x = torch.stack([o["before"][b] for o in out])
        expected = mix @ mix @ x
        torch.testing.assert_close(torch.stack([o["measured"][b] for o in out]), expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(torch.stack([o["plain"][b] for o in out]), expected, atol=1e-12, rtol=0)
        first_round = ((mix @ x - x) ** 2).sum(1)  # the residual of the first round only
        torch.testing.assert_close(torch.tensor([o["residuals"][b] for o in out], dtype=torch.float64), first_round)
        assert first_round.min() > 1e-3
    assert all(o["unmeasured_residuals"] is None for o in out)
