"""No collective on the default group at every step: a SIGTERM stops every rank at one step agreed through the
job's store ([`StopAgreement`][lightning_decentral.trainer.stop.StopAgreement]), in place of Lightning's per-batch
broadcast."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_decentral.topology import Complete, Ring, resolve_topology
from lightning_decentral.trainer.stop import StopAgreement, stop_margin
from tests import straggler_workers
from tests.helpers import run_distributed, start_processes

WORLD = 4


def test_ranks_signalled_together_adopt_the_first_proposal() -> None:
    store = dist.HashStore()
    ranks = [StopAgreement(store, "stop/1", margin=3) for _ in range(3)]
    ranks[2].request()
    ranks[0].request()
    assert [ranks[2].should_stop(5), ranks[0].should_stop(6), ranks[1].should_stop(4)] == [False, False, False]
    assert [r.stop_step for r in ranks] == [8, 8, 8]  # rank 0 proposed 9 at its step 6: the first proposal, 8, won
    assert [ranks[1].should_stop(k) for k in (5, 6, 7, 8)] == [False, False, False, True]


def test_a_rank_past_the_agreed_step_raises_instead_of_stopping_elsewhere() -> None:
    store = dist.HashStore()
    early, late = StopAgreement(store, "stop/2", margin=2), StopAgreement(store, "stop/2", margin=2)
    early.request()
    assert not early.should_stop(3)  # proposes 5
    with pytest.raises(RuntimeError, match="Step 6 is past the step 5 every rank agreed to stop at"):
        late.should_stop(6)


def test_a_stop_step_left_by_an_earlier_job_is_forgotten() -> None:
    store = dist.HashStore()
    StopAgreement(store, "stop/3", margin=2).store.set("stop/3", "4")
    agreement = StopAgreement(store, "stop/3", margin=2)
    agreement.forget_earlier_runs()
    assert not any(agreement.should_stop(k) for k in range(10))


def test_the_margin_covers_how_far_ranks_can_be_apart() -> None:
    """A rank leads a neighbour by at most (s + 1) steps per exchange (times gossip_every); over a ring of 8, four
    hops."""
    assert stop_margin(Ring(world_size=8)) == 4 + 2
    assert stop_margin(Ring(world_size=8), staleness=1, gossip_every=1) == 2 * 4 + 2
    assert stop_margin(Complete(world_size=8)) == 1 + 2
    assert stop_margin(Ring(world_size=8), gossip_every=3) == 3 * 4 + 2
    one_peer = resolve_topology("one_peer_exponential", 8)  # period 3; i sends to i + 1, 2, 4: 3 hops from 0 to 7
    assert stop_margin(one_peer) == 3 * 3 + 2


@pytest.mark.slow
def test_no_collective_runs_at_every_step() -> None:
    """Lightning broadcasts a SIGTERM flag from rank 0 at every batch: a barrier tying every rank to the slowest."""
    calls = run_distributed(straggler_workers.collectives_while_training, WORLD, timeout=240, stalenesses=[0, 1])
    assert calls == [{0: {}, 1: {}}] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize(("signalled", "staleness"), [(2, 0), (0, 1)])
def test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_step_with_the_checkpoint(
    signalled: int, staleness: int, tmp_path: Path
) -> None:
    """Lightning's own handling broadcasts inside the signal handler of the signalled rank alone, which then stops
    alone and waits in the checkpoint's collectives while the others train (a hang, here ended by the timeout)."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(
            straggler_workers.sigterm, WORLD, out, signalled_rank=signalled, root=str(tmp_path), staleness=staleness
        )
        try:
            for p in procs:
                p.join(90)
            alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
        finally:
            for p in procs:
                p.kill()
                p.join()
        assert not alive, f"ranks {alive} still running after 90 s"
        results = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes()) for rank in range(WORLD)]
    assert [status for status, _ in results] == ["ok"] * WORLD, results
    stops = {(r["stopped"], r["global_step"]) for _, r in results}
    assert len(stops) == 1, stops
    ((stopped, step),) = stops
    assert stopped == "SIGTERMException" and 5 < step < 60
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert saved["global_step"] == step
    # issue 38: one line for the job (rank 0's) naming the step and the checkpoint to resume from
    said = [line for _, r in results for line in r["logged"] if line.startswith("Stopped by SIGTERM")]
    assert said == [
        f"Stopped by SIGTERM before step {step}, every rank at the same step. Resume with trainer.fit(..., "
        f"ckpt_path={str(tmp_path / 'on_exception.ckpt')!r})."
    ]
    mean = torch.stack([r["params"] for _, r in results]).mean(0)
    torch.testing.assert_close(
        torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), mean, atol=1e-6, rtol=0
    )
