"""The outer optimizer with `on_peer_failure="continue"` on gloo processes: a rank killed (`SIGKILL`, by its own pid)
when the step that ends a round starts; the survivors discard that round's exchange (`W = I`: each takes its outer
step with its own pseudo-gradient `θ_i − x_i`, docs/algorithms.md, "Outer steps"), then mix among themselves with
their own anchors and outer momentum, and finish the run, as the simulation's `failures=` does. Every process is
bounded by `tests.test_survivors.BOUND`."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from tests import survival_workers as workers
from tests.test_survivors import _decision, _every_rank_exits

pytestmark = pytest.mark.slow  # every test here starts processes

OUTER = {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), "gossip_every": 3}


def test_the_survivors_of_a_killed_rank_finish_with_the_outer_optimizer() -> None:
    """4 ranks, `topology="complete"` (DiLoCo: without a failure the replicas stay equal), 12 steps, rounds ending at
    steps 2, 5, 8, 11; rank 2 is killed when step 5 starts. Ranks 0, 1, 3 all meet the loss in exchange 5, agree on
    step 5, end that round alone and go on as DiLoCo of 3 from anchors that now differ."""
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(
            workers.survive, 4, root=root, deaths={2: 5}, steps=12, topology="complete", timeout=5.0, **OUTER
        )
    assert codes == [0, 0, -9, 0] and results[2] is None
    survivors = [results[r] for r in (0, 1, 3)]
    for new_rank, r in enumerate(survivors):
        assert r["decisions"] == [_decision((0, 1, 3), (2,), 5)]
        assert (r["rank"], r["world_size"], r["global_step"]) == (new_rank, 3, 12)
    processes = torch.stack([r["replica"] for r in survivors])
    assert torch.isfinite(processes).all()
    assert (processes[0] - processes[1]).abs().max() > 1e-4  # the round of step 5 was each survivor's own (W = I)
    simulated = workers.simulate(4, {2: 5}, 12, "complete", **OUTER)
    torch.testing.assert_close(torch.stack(simulated), processes, atol=1e-5, rtol=0)
    lossless = workers.simulate(4, {}, 12, "complete", **OUTER)
    assert (lossless[0] - lossless[1]).abs().max() == 0  # DiLoCo: one anchor while every rank lives
