"""Bounded staleness (`staleness=s`): the rules in one process, on gloo processes under an imposed schedule and under
the newest-replica rule, checkpoints and evaluation while ranks are at different steps, and failures."""

from __future__ import annotations

import pickle
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_decentral import SimulatedDecentralizedStrategy
from lightning_decentral.mixing import RandomDelays, check_stale_topology
from lightning_decentral.options import GossipOptions
from lightning_decentral.topology import Hierarchical
from tests import reference, straggler_workers, workers
from tests.dense_executor import DenseExecutor
from tests.helpers import run_distributed, start_processes
from tests.reference import Config

WORLD = 4
MOMENTUM = {"lr": 0.05, "momentum": 0.9}


def one_behind(worker: int, neighbour: int, step: int, staleness: int) -> int:
    """Every worker mixes its neighbours' replica of the step before (a schedule given as a function)."""
    return 1


# -- the arguments ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staleness": -1}, "`staleness` must be an integer ≥ 0"),
        ({"staleness": 1.5}, "`staleness` must be an integer ≥ 0"),
        ({"delays": RandomDelays()}, "`delays` say how stale each neighbour's replica is: they need staleness ≥ 1"),
        ({"staleness": 1, "delays": 3}, "`delays` must be a schedule"),
        ({"staleness": 1, "momentum": "decentlam"}, "momentum='decentlam' .* use combine='awc' or 'atc'"),
        ({"staleness": 1, "gossip_every": 2}, "gossip_every=2 is not supported with it: use gossip_every=1"),
        ({"staleness": 1, "gossip_steps": 2}, "use gossip_steps=1"),
        ({"staleness": 1, "gossip_dtype": "bfloat16"}, "use gossip_dtype=None"),
        ({"staleness": 1, "on_peer_failure": "continue"}, "on_peer_failure='continue' .* use on_peer_failure='stop'"),
    ],
)
def test_what_staleness_cannot_run_is_refused_naming_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GossipOptions(**kwargs)


def test_a_topology_staleness_cannot_run_is_refused_when_the_trainer_is_built() -> None:
    with pytest.raises(ValueError, match=r"needs one static W .* OnePeerExponential"):
        SimulatedDecentralizedStrategy(workers=4, topology="one_peer_exponential", staleness=1)
    with pytest.raises(ValueError, match=r"needs one static W .* has two levels"):
        check_stale_topology(Hierarchical("ring", "ring", 2).bind(4), staleness=1)
    with pytest.raises(ValueError, match="use staleness=0 with it"):
        SimulatedDecentralizedStrategy(workers=4, staleness=1).extra_gossip(0, 1)


# -- in one process ----------------------------------------------------------------------------------------------

DENSE = [
    Config("awc-s2-random", staleness=2, delays=RandomDelays(1), optimizer=MOMENTUM, steps=8),
    Config("atc-s1-random-batchnorm", combine="atc", staleness=1, delays=RandomDelays(2), batch_norm=True, steps=8),
    Config(
        "awc-exponential-s1-one-behind-adam",
        topology="exponential",
        staleness=1,
        delays=one_behind,
        optimizer={"name": "adam", "lr": 0.01},
        steps=6,
    ),
    Config("awc-s2-no-delays", staleness=2, optimizer=MOMENTUM, steps=6),
    Config("atc-complete-s2-random", topology="complete", combine="atc", staleness=2, delays=RandomDelays(3), steps=6),
]


@pytest.mark.parametrize("config", DENSE, ids=lambda c: c.name)
def test_the_rules_with_delays_match_the_reference_in_one_process(config: Config) -> None:
    trained = DenseExecutor(config, WORLD).run()
    expected = reference.run(config, WORLD)
    torch.testing.assert_close(trained.double(), expected.double(), atol=1e-5, rtol=0)
    synchronous = reference.run(Config(**{**config.__dict__, "staleness": 0, "delays": None}), WORLD)
    if config.delays is None:  # no delay: the synchronous rule
        torch.testing.assert_close(expected, synchronous, atol=0, rtol=0)
    else:  # the delays matter: the check compares something
        assert (expected - synchronous).abs().max() > 1e-3


# -- on processes --------------------------------------------------------------------------------------------------

IMPOSED = [
    Config("awc-s2-random", staleness=2, delays=RandomDelays(1), optimizer=MOMENTUM, steps=8),
    Config("atc-s1-random-batchnorm", combine="atc", staleness=1, delays=RandomDelays(2), batch_norm=True, steps=8),
    Config("awc-exponential-s3-random", topology="exponential", staleness=3, delays=RandomDelays(3), steps=8),
]


@pytest.mark.slow
def test_processes_under_an_imposed_schedule_match_the_reference() -> None:
    """Exponential on 4 ranks is a directed graph (rank i sends to i + 1 and i + 2): each edge ends with its FINAL."""
    trained = run_distributed(workers.fit_configs, WORLD, timeout=240, configs=IMPOSED)
    for config in IMPOSED:
        reference.assert_every_rank_matches(trained, config, WORLD)


NEWEST = [
    Config("awc-s2-newest", staleness=2, optimizer=MOMENTUM, steps=12),
    Config("atc-s1-newest-batchnorm", combine="atc", staleness=1, batch_norm=True, steps=12),
]


@pytest.mark.slow
def test_the_newest_rule_is_the_reference_under_the_steps_each_rank_mixed() -> None:
    """Ranks pause in turn; each records `τ_ij(k)`, the step of each neighbour it mixed, and the reference replays
    exactly those steps."""
    results = run_distributed(straggler_workers.fit_newest, WORLD, timeout=240, configs=NEWEST)
    for config in NEWEST:
        mixed = [r[config.name]["mixed"] for r in results]
        behind = Counter(k - tau for steps in mixed for k, taus in steps.items() for tau in taus.values())
        assert set(behind) <= set(range(config.staleness + 1)), behind
        assert behind[0] < sum(behind.values()), behind  # some step mixed a neighbour's older replica

        def replayed(i: int, j: int, k: int, s: int, mixed: list = mixed) -> int:
            return k - mixed[i][k][j]

        trained = [{config.name: r[config.name]["state"]} for r in results]
        reference.assert_every_rank_matches(trained, Config(**{**config.__dict__, "delays": replayed}), WORLD)


@pytest.mark.slow
def test_checkpoints_monitors_and_evaluation_while_ranks_are_at_different_steps_and_the_resume(tmp_path: Path) -> None:
    """Ranks pause in turn, so they reach a monitor, a validation or a save at different times; each enters it at its
    own step `k`: the consensus distance is the replicas' at `k`, validation sees `x̄(k)`, the file holds it, and a
    resume from it continues the reference, whose delay window restarts at the resumed step (no neighbour's earlier
    step exists in the new run)."""
    epoch = 4
    config = Config(
        "awc-s2-resume", staleness=2, delays=RandomDelays(4), optimizer=MOMENTUM, steps=3 * epoch, epoch_steps=epoch
    )
    results = run_distributed(
        straggler_workers.checkpoint_and_resume, WORLD, timeout=240, config=config, root=str(tmp_path)
    )
    width = results[0]["params"].numel()
    replicas = {
        k: reference.run(Config(**{**config.__dict__, "steps": k}), WORLD)[:, :width] for k in (epoch, 2 * epoch)
    }
    means = {k: x.mean(0) for k, x in replicas.items()}
    distances = [(k, float((x - x.mean(0)).square().sum(1).mean().sqrt())) for k, x in replicas.items()]
    for result in results:
        assert [k for k, _ in result["distances"]] == [k for k, _ in distances]
        assert [d for _, d in result["distances"]] == pytest.approx([d for _, d in distances], rel=1e-4)
        assert [k for k, _ in result["validated"]] == [epoch, 2 * epoch]
        for k, seen in result["validated"]:
            torch.testing.assert_close(seen.double(), means[k].double(), atol=1e-5, rtol=0)
    saved = torch.load(tmp_path / f"step={epoch}.ckpt", weights_only=True)["state_dict"]
    torch.testing.assert_close(
        torch.cat([v.reshape(-1) for v in saved.values()]).double(), means[epoch].double(), atol=1e-5, rtol=0
    )
    resumed = Config(**{**config.__dict__, "restarts": (epoch,)})
    reference.assert_every_rank_matches([{resumed.name: r["params"]} for r in results], resumed, WORLD)
    uninterrupted = reference.run(config, WORLD)
    assert (uninterrupted - reference.run(resumed, WORLD)).abs().max() > 1e-4  # the restart of the window is seen


def _until_every_survivor_exits(
    how: signal.Signals, timeout: float, bound: float, tmp_path: Path
) -> tuple[list, list, float]:
    """Run `peer_fails` on 4 ranks; return each survivor's result and exit code, and when rank 1 failed."""
    stamp = tmp_path / "failed_at"
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(
            straggler_workers.peer_fails, WORLD, out, how=int(how), stamp=str(stamp), timeout=timeout, staleness=2
        )
        try:
            deadline = time.monotonic() + bound
            for rank in (0, 2, 3):
                procs[rank].join(max(0.0, deadline - time.monotonic()))
            hung = [rank for rank in (0, 2, 3) if procs[rank].is_alive()]
        finally:
            for p in procs:
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} still running after {bound:.0f} s"
        results = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes()) for rank in (0, 2, 3)]
        codes = [procs[rank].exitcode for rank in (0, 2, 3)]
    return results, codes, float(stamp.read_text())


@pytest.mark.slow
def test_a_killed_rank_stops_every_other_rank_at_once(tmp_path: Path) -> None:
    """Its neighbours' receiving threads see the connection close; they stop and close theirs, which stops rank 3
    (no neighbour of rank 1). Every survivor exits cleanly (a thread left in a gloo receive would abort it)."""
    timeout = 60.0
    results, codes, killed_at = _until_every_survivor_exits(signal.SIGKILL, timeout, bound=120, tmp_path=tmp_path)
    for rank, (status, result) in zip((0, 2, 3), results):
        assert status == "ok", result
        assert result["error"].startswith("PeerFailure: The gossip exchange of step"), (rank, result)
        assert result["stopped_at"] - killed_at < timeout / 2, (rank, result)
        assert result["threads"] == [], (rank, result)
    assert codes == [0, 0, 0]


@pytest.mark.slow
def test_a_rank_more_than_s_steps_behind_past_the_timeout_is_a_peer_failure(tmp_path: Path) -> None:
    timeout = 6.0
    results, codes, stopped_at = _until_every_survivor_exits(signal.SIGSTOP, timeout, bound=120, tmp_path=tmp_path)
    errors = {rank: result["error"] for rank, (_, result) in zip((0, 2, 3), results)}
    for rank in (0, 2):  # rank 1's neighbours
        assert "rank 1 was more than staleness=2 steps behind for the process-group timeout (6 s" in errors[rank], (
            errors
        )
    assert errors[3].startswith("PeerFailure: The gossip exchange of step"), errors  # told by rank 0 or 2 closing
    for rank, (status, result) in zip((0, 2, 3), results):
        assert status == "ok", result
        assert result["stopped_at"] - stopped_at < timeout + 5, (rank, result)
        assert result["threads"] == [], (rank, result)
    assert codes == [0, 0, 0]
