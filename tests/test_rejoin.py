"""A lost rank started again rejoins the run in progress (`rejoin=True`): processes launched one by one as a launcher
would, `SIGKILL`ed by themselves, started again; every process bounded (`BOUND`)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_decentral import SimulatedDecentralizedStrategy
from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path
from lightning_decentral.membership.rejoin import asking
from tests import survival_workers as workers
from tests.helpers import free_port, start_processes, start_rank

BOUND = 240.0  # seconds any process of a test may run (seconds alone; minutes when the 2 cores are shared ten ways)


def _wait_for(condition, deadline: float) -> None:
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_rejoin(tmp_path: Path, world_size: int, dead: int, die_at: int, hold_at: int, steps: int, **strategy):
    """`world_size` ranks, `dead` killed when step `die_at` starts; once the others decided to go on (they then wait at
    the start of step `hold_at`), `dead` is started again with the same command, and the others are released once it
    asks to rejoin. Every process's result (or error), by rank: the first `world_size` then the one started again."""
    run = dict(root=str(tmp_path), steps=steps, hold_at=hold_at, **strategy)
    members = [r for r in range(world_size) if r != dead]
    return _start_again(tmp_path, workers.survive_or_error, world_size, dead, {dead: die_at}, {}, members, True, run)


def _start_again(
    tmp_path: Path,
    worker,
    world_size: int,
    again: int,
    deaths: dict[int, int],
    restart: dict,
    members: list[int],
    restarted_result: bool,
    run: dict,
):
    """`world_size` ranks of `worker` (`deaths`: rank -> the step it is killed at); once the survivors decided to go on
    (they wait at `run["hold_at"]`), rank `again` started again (with `restart` added to its arguments), and the
    survivors released once it asks to rejoin (or it is gone), every process bounded. The results of `members`, and
    of the rank started again if `restarted_result`, by rank."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as later:
        procs = start_processes(worker, world_size, out, port=port, deaths=deaths, **run)
        restarted = None
        try:
            deadline = time.monotonic() + BOUND
            _wait_for(lambda: (tmp_path / "decided").exists(), deadline)
            restarted = start_rank(worker, again, world_size, port, later, deaths={}, **run, **restart)
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            _wait_for(lambda: asking(store) == [again] or not restarted.is_alive(), deadline)
            (tmp_path / "released").touch()
            for p in [*procs, restarted]:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in [*procs, restarted]:
                if p is not None and p.is_alive():
                    p.kill()
        results = {r: pickle.loads((Path(out) / f"{r}.pkl").read_bytes())[1] for r in members}
        if restarted_result:
            results[again] = pickle.loads((Path(later) / f"{again}.pkl").read_bytes())[1]
    return results


@pytest.mark.slow
def test_a_killed_rank_started_again_rejoins_and_ends_with_the_others(tmp_path: Path) -> None:
    """3 ranks on a ring, momentum SGD, rank 2 killed at step 3; the survivors go on as 2; rank 2 started again asks
    while they wait at step 11: at step 15 (they look every 5 steps) they agree on the join step 20 (the first multiple
    of 5 from 15 + 3, the stop margin of a ring of 2), rank 0 (its lowest-ranked neighbour) hands it its state, and
    all three end at step 30 as 3 ranks, finite and close."""
    results = _kill_rejoin(tmp_path, 3, dead=2, die_at=3, hold_at=11, steps=30, save_at=25, validate=True, rejoin=True)
    for rank, r in sorted(results.items(), reverse=True):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert (r["world_size"], r["global_step"]) == (3, 30), (rank, r["world_size"], r["global_step"])
        assert r["batches_ready"] == 30, (rank, r["batches_ready"])  # the join step's batch counted once (else it
        assert torch.isfinite(r["replica"]).all()  # validates a step before the members: their collectives wait)
    last = results[0]["decisions"][-1]
    assert (last["joined"], last["members"], last["step"]) == ((2,), (0, 1, 2), 19), last
    assert results[2]["decisions"][-1] == last
    replicas = torch.stack([results[r]["replica"] for r in range(3)])
    apart = (replicas - replicas.mean(0)).norm(dim=1)  # after 10 steps mixing: as near x̄ as the members
    assert apart[2] <= 2 * apart[:2].max(), apart
    # issue 38: every rank logs the same survivor metrics (before: lost 1.0 on the members, 0.0 on the rank that
    # rejoined), and one rank ends with one line (not a warning) that counts the rejoin (before: "went on with 2")
    assert [results[r]["metrics"] for r in range(3)] == [{"survivors/workers": 3.0, "survivors/lost": 0.0}] * 3
    ended = [line for r in range(3) for line in results[r]["logged"] if line.startswith("This run lost")]
    assert ended == [
        "This run lost 1 of its 3 workers: rank 2 (the survivors agreed on step 3). Rank 2 rejoined (from step 20). "
        "It ended with 3 (strategy.failures_survived lists the decisions)."
    ]
    assert not [w for r in range(3) for w in results[r]["warnings"] if w.startswith("This run lost")]


@pytest.mark.slow
def test_a_rank_started_again_with_another_configuration_is_refused_and_the_members_go_on(tmp_path: Path) -> None:
    """3 ranks with rejoin=True, rank 2 killed at step 3; while the survivors wait at step 6, rank 2 is started again
    with gossip_every=2 (the run has 1), then with another learning rate. It was admitted without a check (its set-up
    took the members' state over), its exchanges met the members' at other steps, and a phantom "Survived failure 3:
    lost rank ()" was logged at the end. Now each is refused before it asks, naming the field and both values, and the
    members finish as 2, one failure decided, no other."""
    port = free_port()
    run = dict(root=str(tmp_path), steps=12, hold_at=6, rejoin=True)
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(workers.survive_or_error, 3, out, port=port, deaths={2: 3}, **run)
        refused = {}
        try:
            deadline = time.monotonic() + BOUND
            _wait_for(lambda: (tmp_path / "decided").exists(), deadline)
            for name, other in {"gossip_every": dict(gossip_every=2), "lr": dict(lr=0.1)}.items():
                with tempfile.TemporaryDirectory() as restart:
                    restarted = start_rank(workers.survive_or_error, 2, 3, port, restart, deaths={}, **run, **other)
                    restarted.join(max(0.0, deadline - time.monotonic()))
                    assert restarted.exitcode == 0, (name, restarted.exitcode)
                    refused[name] = pickle.loads((Path(restart) / "2.pkl").read_bytes())[1]
            (tmp_path / "released").touch()
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            assert [p.exitcode for p in procs[:2]] == [0, 0]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        members = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (0, 1)]
    refusal = "CannotRejoin: Rank 2 cannot rejoin: it does not run the members' configuration: "
    assert refused["gossip_every"].startswith(refusal + "it has gossip_every=2 where the members have 1."), refused
    assert refused["lr"].startswith(refusal + "it has lr='0.1' where the members have '0.05'."), refused
    assert all("The members go on without it. Start it again with the command" in r for r in refused.values())
    for r in members:
        assert isinstance(r, dict), r
        assert (r["world_size"], r["global_step"]) == (2, 12), r
        assert [d["lost"] for d in r["decisions"]] == [(2,)], r["decisions"]
        assert not [line for line in r["logged"] if "lost rank ()" in line or "Rejoined" in line], r["logged"]


@pytest.mark.slow
def test_a_fault_plan_that_kills_two_of_three_and_one_rank_started_again(tmp_path: Path) -> None:
    """3 ranks, `FaultPlan({8: [1, 2]})`, min_workers=1: rank 0 goes on alone; rank 1 alone is started again (with the
    same plan). It checked the plan's ranks against the members' world size (2) and raised once admitted, and the lone
    survivor then died with an IndexError. Now it checks them against the run's start, rejoins, and both end at step
    30 as 2 ranks."""
    run = dict(root=str(tmp_path), steps=30, hold_at=11, rejoin=True, min_workers=1, fault_plan={8: [1, 2]})
    results = list(_start_again(tmp_path, workers.survive_or_traceback, 3, 1, {}, {}, [0], True, run).values())
    for r in results:
        assert isinstance(r, dict), r
        assert (r["world_size"], r["global_step"]) == (2, 30), r
        assert [(d["lost"], d.get("joined", ())) for d in r["decisions"]][-1] == ((), (1,)), r["decisions"]
    assert [d["lost"] for d in results[0]["decisions"]] == [(1, 2), ()], results[0]["decisions"]


@pytest.mark.slow
def test_a_rank_that_dies_once_admitted_leaves_the_members_going_on(tmp_path: Path) -> None:
    """3 ranks, rank 2 killed at step 3 and started again; admitted at step 20, it dies before it takes the state
    over. Its source's hand-over fails: the members survive it as a failure (that decision replaces the join), and end
    at step 30 as 2, instead of stopping with gloo's error."""
    run = dict(root=str(tmp_path), steps=30, hold_at=11, rejoin=True)
    dies = {"dies_in": "take over"}
    results = list(
        _start_again(tmp_path, workers.survive_or_traceback, 3, 2, {2: 3}, dies, [0, 1], False, run).values()
    )
    assert (tmp_path / "killed-2").exists()
    for r in results:
        assert isinstance(r, dict), r
        assert (r["world_size"], r["global_step"]) == (2, 30), r
        assert [(d["lost"], d.get("joined", ())) for d in r["decisions"]] == [((2,), ()), ((), (2,)), ((2,), ())], r[
            "decisions"
        ]


@pytest.mark.slow
def test_after_two_rejoins_last_ckpt_is_one_complete_current_save(tmp_path: Path) -> None:
    """3 ranks saving every 5 steps with save_last=True; rank 2 killed at step 3 rejoins at step 20, is killed again at
    step 22 and rejoins at step 30. Its ModelCheckpoint started afresh and named its saves `last-v1.ckpt` beside the
    members' `last.ckpt`: one save's shards under two names, `last.ckpt` without rank 2's. Now it takes the members'
    paths over: `last.ckpt` alone, of step 40, with a shard of every rank of its save."""
    port = free_port()
    run = dict(root=str(tmp_path), steps=40, save_at=5, save_last=True, rejoin=True, hold_at=11, hold_after=24)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as again:
        procs = start_processes(workers.survive_or_traceback, 3, out, port=port, deaths={2: 3}, **run)
        started = []
        try:
            deadline = time.monotonic() + BOUND
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            _wait_for(lambda: (tmp_path / "decided").exists(), deadline)  # the members wait at step 11
            started.append(start_rank(workers.survive_or_traceback, 2, 3, port, again, deaths={2: 22}, **run))
            _wait_for(lambda: asking(store) == [2] or not started[-1].is_alive(), deadline)
            (tmp_path / "released").touch()
            _wait_for(lambda: not started[-1].is_alive(), deadline)  # rejoined at 20, killed at 22
            (tmp_path / "released").unlink()
            held = [tmp_path / f"held-{rank}" for rank in (0, 1)]  # the members wait at the end of step 24
            _wait_for(lambda: all(h.exists() for h in held), deadline)
            started.append(start_rank(workers.survive_or_traceback, 2, 3, port, again, deaths={}, **run))
            _wait_for(lambda: asking(store) == [2] or not started[-1].is_alive(), deadline)
            (tmp_path / "released").touch()
            for p in [*procs, *started]:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in [*procs, *started]:
                if p.is_alive():
                    p.kill()
        results = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (0, 1)]
        results.append(pickle.loads((Path(again) / "2.pkl").read_bytes())[1])
    for r in results:
        assert isinstance(r, dict), r
        assert (r["world_size"], r["global_step"]) == (3, 40), r
    assert not list(tmp_path.glob("last-v*")), sorted(p.name for p in tmp_path.iterdir())  # files, shard folders
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    meta = last[META_KEY]
    assert (last["global_step"], meta["world_size"]) == (40, 3), (last["global_step"], meta)
    for rank in range(3):
        shard = read_shard(shard_path(str(tmp_path / "last.ckpt"), rank, 3, meta["save_id"]))
        assert (shard["save_id"], shard["rank"]) == (meta["save_id"], rank)


def _launch_toy(tmp_path: Path, script: str, workers: int, restarts: int) -> subprocess.CompletedProcess:
    """`lightning-decentral-launch --max-restarts restarts` of `workers` toy workers running `script` (written to
    `tmp_path/worker.py`, given `tmp_path` as its argument), bounded."""
    (tmp_path / "worker.py").write_text(script)
    command = [
        sys.executable,
        "-m",
        "lightning_decentral.membership.launch",
        "--nproc-per-node",
        str(workers),
        "--max-restarts",
        str(restarts),
        str(tmp_path / "worker.py"),
        str(tmp_path),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=BOUND)


@pytest.mark.slow
def test_the_launcher_starts_nobody_again_once_the_run_is_over(tmp_path: Path) -> None:
    """Worker 0 finishes with 0 (the run is over), then worker 1 fails: with restarts left, nobody is started again
    (there is nothing to rejoin), and the launcher exits 0; a worker that fails while none has finished is started
    again."""
    script = (
        "import os, sys, time\n"
        "rank, marks = os.environ['RANK'], sys.argv[1]\n"
        "open(os.path.join(marks, 'start-' + rank), 'a').write('x')\n"
        "if rank == '0':\n"
        "    sys.exit(0)\n"
        "while not os.path.exists(os.path.join(marks, 'start-0')): time.sleep(0.05)\n"
        "time.sleep(0.5)\n"
        "sys.exit(3)\n"
    )
    done = _launch_toy(tmp_path, script, workers=2, restarts=2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker 1 (pid" in done.stdout and "exited with 3" in done.stdout and "started again" not in done.stdout
    assert (tmp_path / "start-1").read_text() == "x"  # started once

    (tmp_path / "start-0").unlink()
    (tmp_path / "start-1").unlink()
    done = _launch_toy(
        tmp_path, script.replace("if rank == '0':\n    sys.exit(0)", "if rank == '0':\n    sys.exit(2)"), 2, 2
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "worker 1 started again" in done.stdout and (tmp_path / "start-1").read_text() == "xxx"  # 2 restarts


@pytest.mark.slow
def test_the_launcher_starts_nobody_again_once_every_member_left(tmp_path: Path) -> None:
    """A worker fails after the run it belongs to published itself and every member said it leaves (`run_over`), as
    a rank that cannot rejoin a finished run does: with restarts left, it is not started again."""
    script = (
        "import json, os, sys\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,\n"
        "                      timeout=timedelta(seconds=30))\n"
        "open(os.path.join(sys.argv[1], 'starts'), 'a').write('x')\n"
        "store.set('lightning_decentral/current', json.dumps({'run': 'r', 'generation': 1, 'members': [0, 1],\n"
        "                                                     'start_size': 3, 'rejoin': True}))\n"
        "for member in (0, 1):\n"
        "    store.set(f'lightning_decentral/r/left/{member}', '1')\n"
        "sys.exit(3)\n"
    )
    done = _launch_toy(tmp_path, script, workers=1, restarts=2)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "started again" not in done.stdout and (tmp_path / "starts").read_text() == "x", done.stdout


@pytest.mark.slow
def test_the_simulation_brings_a_worker_back_as_the_processes_bring_a_rank_back(tmp_path: Path) -> None:
    """The run of the first test to step 26 (the join step 20 is an epoch boundary: the rank started again reads its
    shard from the epoch's start), against `SimulatedDecentralizedStrategy(failures={s: [2]}, rejoins={20: [2]})` with
    the processes' agreed failure step `s`: the same replicas, to float tolerance."""
    results = _kill_rejoin(tmp_path, 3, dead=2, die_at=3, hold_at=11, steps=26, rejoin=True)
    assert all(isinstance(r, dict) for r in results.values()), results
    lost, joined = results[0]["decisions"]
    assert joined["joined"] == (2,) and joined["step"] == 19, joined
    simulated = workers.simulate(3, {2: lost["step"]}, 26, "ring", rejoins={20: [2]})
    for rank in range(3):
        torch.testing.assert_close(simulated[rank], results[rank]["replica"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_rank_that_cannot_rejoin_stops_at_once_with_a_clear_error(tmp_path: Path) -> None:
    """3 ranks without rejoin=True, rank 2 killed at step 3; while the survivors wait at step 6, rank 2 started again
    with rejoin=True stops at once (the run does not take rejoins), and so does a new rank 3 of 4 (a new rank cannot
    join); the survivors finish as 2."""
    port = free_port()
    run = dict(root=str(tmp_path), steps=10, hold_at=6)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as again:
        procs = start_processes(workers.survive_or_error, 3, out, port=port, deaths={2: 3}, **run)
        started = []
        try:
            deadline = time.monotonic() + BOUND
            _wait_for(lambda: (tmp_path / "decided").exists(), deadline)
            started = [
                start_rank(workers.survive_or_error, 2, 3, port, again, deaths={}, rejoin=True, **run),
                start_rank(workers.survive_or_error, 3, 4, port, again, deaths={}, rejoin=True, **run),
            ]
            for p in started:
                p.join(max(0.0, deadline - time.monotonic()))
            (tmp_path / "released").touch()
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            assert [p.exitcode for p in [*procs[:2], *started]] == [0, 0, 0, 0]
        finally:
            for p in [*procs, *started]:
                if p.is_alive():
                    p.kill()
        lost, new = (pickle.loads((Path(again) / f"{rank}.pkl").read_bytes())[1] for rank in (2, 3))
        survivors = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (0, 1)]
    assert lost.startswith(
        "CannotRejoin: Rank 2 cannot rejoin the run in progress: it does not take rejoins. Pass rejoin=True"
    ), lost
    assert new.startswith(
        "CannotRejoin: Rank 3 of 4 found a run of 3 ranks in progress on this store: a new rank cannot join"
    ), new
    for r in survivors:
        assert (r["world_size"], r["global_step"]) == (2, 10)


@pytest.mark.slow
def test_a_rank_started_again_after_its_run_is_over_stops_at_once(tmp_path: Path) -> None:
    """3 ranks with rejoin=True on a store that outlives them (hosted here, as torchrun's agent hosts it), rank 2
    killed at step 3; the survivors finish as 2 and leave. Rank 2 started again then stops with `CannotRejoin` (the
    run is over) before its timeout of 10 minutes: without the check it would wait that long for a new generation."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    run = dict(root=str(tmp_path), steps=10, rejoin=True)
    with (
        mock.patch.dict("os.environ", TORCHELASTIC_USE_AGENT_STORE="True"),
        tempfile.TemporaryDirectory() as out,
        tempfile.TemporaryDirectory() as again,
    ):
        procs = start_processes(workers.survive_or_error, 3, out, port=port, deaths={2: 3}, **run)
        restarted = None
        try:
            deadline = time.monotonic() + BOUND
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            restarted = start_rank(workers.survive_or_error, 2, 3, port, again, deaths={}, timeout=600.0, **run)
            restarted.join(max(0.0, deadline - time.monotonic()))
            assert [p.exitcode for p in [*procs[:2], restarted]] == [0, 0, 0]
        finally:
            for p in [*procs, restarted]:
                if p is not None and p.is_alive():
                    p.kill()
        survivors = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (0, 1)]
        lost = pickle.loads((Path(again) / "2.pkl").read_bytes())[1]
    del store
    for r in survivors:
        assert (r["world_size"], r["global_step"]) == (2, 10), r
    assert lost.startswith("CannotRejoin: Rank 2 cannot rejoin: the run it was lost by is over (its members [0, 1]"), (
        lost
    )


def test_rejoin_is_checked_when_the_strategy_is_built() -> None:
    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy

    with pytest.raises(
        ValueError,
        match="rejoin=True lets a lost rank rejoin the survivors of a failure: pass on_peer_failure='continue'",
    ):
        DecentralizedStrategy(rejoin=True)
    with pytest.raises(ValueError, match="rejoin=True is supported by the Trainer's DecentralizedStrategy only"):
        FabricStrategy(on_peer_failure="continue", rejoin=True)
    with pytest.raises(
        ValueError, match=r"`rejoins` maps an optimizer step to workers lost by `failures` at an earlier step"
    ):
        SimulatedDecentralizedStrategy(workers=4, failures={3: [2]}, rejoins={3: [2]})
