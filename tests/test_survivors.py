"""`on_peer_failure="continue"`: the survivors of a killed rank agree, go on training among themselves, and their
checkpoints resume exactly on as many processes; under the Trainer, under Fabric, under lightning-decentral-launch,
and as the simulation predicts (docs/reliability.md, "Surviving a failure")."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch

from lightning_decentral.checkpoint import shard_path
from tests import survival_workers as workers
from tests.helpers import free_port, run_distributed, start_processes, start_rank

BOUND = 240.0  # seconds any group of processes here may take, or the test fails (and they are killed)


def _every_rank_exits(fn: Callable, world_size: int, **kwargs: Any) -> tuple[list[Any], list[int]]:
    """Each rank's result (`None` for one that left none) and exit code; a rank's death does not end the others."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(fn, world_size, out, **kwargs)
        deadline = time.monotonic() + BOUND
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:
            procs[rank].kill()
            procs[rank].join()
        assert not hung, f"ranks {hung} still running after {BOUND:.0f} s"
        results = []
        for rank in range(world_size):
            path = Path(out) / f"{rank}.pkl"
            status, value = pickle.loads(path.read_bytes()) if path.exists() else ("ok", None)
            assert status == "ok", value
            results.append(value)
        return results, [p.exitcode for p in procs]


def _decision(members: tuple[int, ...], lost: tuple[int, ...], step: int, generation: int = 1) -> dict[str, Any]:
    survivors = tuple(i for i, m in enumerate(sorted(members + lost)) if m in members)
    return {"generation": generation, "members": members, "survivors": survivors, "lost": lost, "step": step}


@pytest.mark.slow
def test_the_survivors_of_a_killed_rank_finish_and_their_checkpoint_resumes_exactly_on_three(tmp_path: Path) -> None:
    """4 ranks on a ring; rank 2 is killed when step 20 of 60 starts. Ranks 0, 1 and 3 agree on one step (20, or 21
    when rank 0, which is not rank 2's neighbour, had finished exchange 20 first), finish all 60 steps and exit 0, as
    ranks 0, 1 and 2 of 3; Lightning's validation at the end of each epoch (x̄, and `val_loss` reduced with
    `sync_dist=True`) runs among them. The checkpoint of step 30 has 3 shards and its x̄ is theirs; resumed on 3 plain
    processes, each continues bit for bit to their replicas of step 60."""
    results, codes = _every_rank_exits(
        workers.survive, 4, root=str(tmp_path), deaths={2: 20}, steps=60, save_at=30, validate=True
    )
    assert codes == [0, 0, -9, 0] and results[2] is None
    survivors = [results[r] for r in (0, 1, 3)]
    (decision,) = survivors[0]["decisions"]
    assert decision in (_decision((0, 1, 3), (2,), 20), _decision((0, 1, 3), (2,), 21))
    for new_rank, r in enumerate(survivors):
        assert r["decisions"] == [decision] and (r["rank"], r["world_size"], r["global_step"]) == (new_rank, 3, 60)
    assert torch.isfinite(torch.stack([r["replica"] for r in survivors]).mean(0)).all()  # x̄ of the survivors
    val_losses = [r["val_loss"] for r in survivors]  # each survivor validates its own data: equal once reduced
    assert math.isfinite(val_losses[0]) and val_losses == pytest.approx([val_losses[0]] * 3, rel=1e-6)

    checkpoint = tmp_path / "epoch=2-step=30.ckpt"
    shards = sorted(p.name.split(".")[0] for p in Path(f"{checkpoint}.shards").iterdir())
    assert shards == ["rank-00000-of-00003", "rank-00001-of-00003", "rank-00002-of-00003"]
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["decentralized_shards"]["world_size"] == 3
    resumed = run_distributed(workers.resume, 3, checkpoint=str(checkpoint), data_of=[0, 1, 3], steps=60)
    for replica, survivor in zip(resumed, survivors):
        torch.testing.assert_close(replica, survivor["replica"], atol=0, rtol=0)


@pytest.mark.slow
def test_a_fabric_loop_survives_the_same_way(tmp_path: Path) -> None:
    """The same under Fabric: rank 2 killed at step 20 of 60, `fabric.save` at step 30 by the survivors, resumed
    exactly on 3 processes with `fabric.load`."""
    results, codes = _every_rank_exits(
        workers.fabric_survive, 4, root=str(tmp_path), deaths={2: 20}, steps=60, save_at=30
    )
    assert codes == [0, 0, -9, 0]
    survivors = [results[r] for r in (0, 1, 3)]
    assert [r["rank"] for r in survivors] == [0, 1, 2]
    assert all(len(r["decisions"]) == 1 and r["decisions"] == survivors[0]["decisions"] for r in survivors)
    assert torch.isfinite(torch.stack([r["replica"] for r in survivors]).mean(0)).all()
    resumed = run_distributed(
        workers.fabric_resume, 3, checkpoint=str(tmp_path / "step=30.ckpt"), data_of=[0, 1, 3], start=30, steps=60
    )
    for replica, survivor in zip(resumed, survivors):
        torch.testing.assert_close(replica, survivor["replica"], atol=0, rtol=0)


def _complete_checkpoints(directory: Path, lost: tuple[int, ...] = ()) -> dict[str, int]:
    """Each checkpoint file in `directory` with the world size of its save, asserting that every shard of its save is
    there, and that a shard folder without its file holds only shards of the `lost` ranks (each rank removes its own
    shards of a checkpoint dropped, which a lost rank cannot do)."""
    found = {}
    for path in sorted(directory.glob("*.ckpt")):
        meta = torch.load(path, weights_only=True)["decentralized_shards"]
        for rank in range(meta["world_size"]):
            assert Path(shard_path(str(path), rank, meta["world_size"], meta["save_id"])).exists(), (path, rank)
        found[path.name] = meta["world_size"]
    for folder in directory.glob("*.shards"):
        if folder.name[: -len(".shards")] not in found:
            assert all(int(shard.name[5:10]) in lost for shard in folder.iterdir()), sorted(folder.iterdir())
    return found


@pytest.mark.slow
def test_a_save_in_the_steps_the_survivors_take_alone_is_written_by_them_and_keeps_the_best_path_true(
    tmp_path: Path,
) -> None:
    """3 ranks, `ModelCheckpoint(every_n_train_steps=5, save_top_k=1)`; rank 2 is killed when step 9 starts. Ranks 0
    and 1 agree on step 9, so the save of step 10 falls before they mix again, while each runs alone: they make their
    process group for it (it was skipped, and ModelCheckpoint then removed the checkpoint of step 5, leaving none).
    The checkpoint of step 10 is theirs (two shards) and `best_model_path` names it on both."""
    results, codes = _every_rank_exits(
        workers.survive, 3, root=str(tmp_path), deaths={2: 9}, steps=12, save_at=5, top_k=1
    )
    assert codes == [0, 0, -9]
    for r in results[:2]:
        assert r["decisions"] == [_decision((0, 1), (2,), 9)] and r["global_step"] == 12
        assert r["best_model_path"] == str(tmp_path / "epoch=0-step=10.ckpt")
    assert _complete_checkpoints(tmp_path, lost=(2,)) == {"epoch=0-step=10.ckpt": 2}


@pytest.mark.slow
def test_a_fabric_save_in_the_steps_the_survivors_take_alone_is_written_by_them(tmp_path: Path) -> None:
    """The same under Fabric: rank 2 killed at step 9 of 12, `fabric.save` at step 10 by the two survivors, who take
    it alone (it was skipped); resumed on 2 processes, each continues bit for bit."""
    results, codes = _every_rank_exits(
        workers.fabric_survive, 3, root=str(tmp_path), deaths={2: 9}, steps=12, save_at=10
    )
    assert codes == [0, 0, -9]
    assert [r["decisions"][0]["step"] for r in results[:2]] == [9, 9]
    assert _complete_checkpoints(tmp_path) == {"step=10.ckpt": 2}
    resumed = run_distributed(
        workers.fabric_resume, 2, checkpoint=str(tmp_path / "step=10.ckpt"), data_of=[0, 1], start=10, steps=12
    )
    for replica, survivor in zip(resumed, results[:2]):
        torch.testing.assert_close(replica, survivor["replica"], atol=0, rtol=0)


@pytest.mark.slow
def test_the_simulation_loses_a_worker_as_the_processes_lose_a_rank() -> None:
    """Rank 2 neighbours every other rank, so none of them completes exchange 5 once it is killed there: they agree
    on step 5 everywhere. `SimulatedDecentralizedStrategy(failures={5: [2]})` gives the same replicas: step 5 local,
    then Metropolis-Hastings weights on the path 0 - 1 - 3 the survivors induce."""
    graph = nx.Graph([(2, 0), (2, 1), (2, 3), (0, 1), (1, 3)])
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(workers.survive, 4, root=root, deaths={2: 5}, steps=10, topology=graph)
    assert codes == [0, 0, -9, 0]
    assert all(results[r]["decisions"] == [_decision((0, 1, 3), (2,), 5)] for r in (0, 1, 3))
    simulated = workers.simulate(4, {2: 5}, 10, graph)
    processes = torch.stack([results[r]["replica"] for r in (0, 1, 3)])
    assert (processes[0] - processes[1]).abs().max() > 1e-4  # the survivors differ: a real test of each
    torch.testing.assert_close(torch.stack(simulated), processes, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_below_min_workers_every_survivor_stops_with_a_clear_error() -> None:
    """3 ranks, min_workers=3: rank 1 dies at step 5; ranks 0 and 2 agree, then stop alike, naming the fix."""
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(
            workers.survive_or_error, 3, root=root, deaths={1: 5}, steps=10, min_workers=3
        )
    assert codes == [0, -9, 0]
    for r in (results[0], results[2]):
        assert r.startswith(
            "TooFewWorkers: Only 2 workers are left after step 5 (ranks [0, 2] of the start; lost: [1])"
        )
        assert "fewer than min_workers=3: the run stops on every survivor. Lower min_workers" in r


@pytest.mark.slow
def test_under_lightning_decentral_launch_the_store_hosts_usual_rank_dies_and_a_second_failure_is_survived(
    tmp_path: Path,
) -> None:
    """Under lightning-decentral-launch the store lives in the launcher, so rank 0 (which hosts it under Lightning's
    own launch) may die: 3 workers, rank 0 killed when step 10 starts, then rank 1 at step 20; rank 2 finishes all 30
    steps alone (min_workers=1), and the launcher exits 0, having reported each death. No warning about the store."""
    script = Path(__file__).with_name("survival_script.py")
    command = [sys.executable, "-m", "lightning_decentral.membership.launch", "--nproc-per-node", "3", str(script)]
    arguments = ["--out", str(tmp_path), "--deaths", "0:10,1:20", "--steps", "30", "--min-workers", "1"]
    done = subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank, how in ((0, "was killed by SIGKILL"), (1, "was killed by SIGKILL"), (2, "exited with 0")):
        assert f"lightning-decentral-launch: worker {rank} (pid" in done.stdout and how in done.stdout
    assert "hosts the job's store" not in done.stderr
    last = torch.load(tmp_path / "rank-2.pt", weights_only=False)
    assert (last["rank"], last["world_size"], last["global_step"]) == (0, 1, 30)
    first, second = last["decisions"]
    assert {**first, "step": None} == _decision((1, 2), (0,), None) and first["step"] in (10, 11)
    assert {**second, "step": None} == _decision((2,), (1,), None, generation=2) and second["step"] in (20, 21)
    assert torch.isfinite(last["replica"]).all()


@pytest.mark.slow
def test_a_silent_rank_is_left_behind_after_the_timeout_and_stops_when_it_wakes_up(tmp_path: Path) -> None:
    """3 ranks, timeout 5 s: rank 1 stops (SIGSTOP) when step 5 starts, its connections open. Ranks 0 and 2 give it up
    once it has been silent past the timeout (its heartbeat, or gloo's wait), finish their 12 steps as 2 ranks; woken
    up once they have decided, rank 1 finds a decision without it and stops with a clear error."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(
            workers.survive_or_error, 3, out, root=str(tmp_path), deaths={}, stops={1: 5}, steps=12, timeout=5.0
        )
        try:
            deadline = time.monotonic() + BOUND
            while not (tmp_path / "decided").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(int((tmp_path / "stopped-1").read_text()), signal.SIGCONT)
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            assert [p.exitcode for p in procs] == [0, 0, 0]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        results = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in range(3)]
    for r in (results[0], results[2]):
        assert r["decisions"] == [_decision((0, 2), (1,), 5)] and (r["world_size"], r["global_step"]) == (2, 12)
    assert results[1].startswith("Excluded: The other ranks went on without rank 1 after step 5")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_when_the_store_host_stops_or_dies_every_survivor_ends_with_store_lost(tmp_path: Path, how: str) -> None:
    """4 ranks on a ring, timeout 5 s, every rank waiting at the end of step 4; then rank 0, whose process hosts the
    job's store (a launch like Lightning's), is stopped (SIGSTOP) or killed, and the others go on. Ranks 1, 2 and 3
    end with `StoreLost` naming the store: every call to the store on a per-batch path runs under the watchdog.
    Without it, the stop check at the start of step 5 (a call to the store) hung with the host stopped, and raised
    `DistNetworkError: Connection reset by peer` with the host killed."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(
            workers.survive_or_error, 4, out, root=str(tmp_path), deaths={}, steps=12, timeout=5.0, hold_after=4
        )
        try:
            deadline = time.monotonic() + 120.0
            while not all((tmp_path / f"held-{r}").exists() for r in range(4)) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(procs[0].pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)  # ours
            (tmp_path / "released").touch()
            for p in procs[1:]:
                p.join(max(0.0, deadline - time.monotonic()))
            assert [p.exitcode for p in procs[1:]] == [0, 0, 0], "a survivor hung or died"
        finally:
            for p in procs:  # rank 0, stopped: SIGKILL ends it too
                if p.is_alive():
                    p.kill()
                    p.join()
        results = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (1, 2, 3)]
    for r in results:
        assert r.startswith("StoreLost: The job's store at 127.0.0.1:"), r
        assert ("did not answer within 5 s" if how == "stopped" else "is gone") in r


@pytest.mark.slow
def test_a_lost_rank_started_again_stops_at_once_while_the_survivors_go_on(tmp_path: Path) -> None:
    """3 ranks, rank 2 killed when step 3 starts. Once ranks 0 and 1 have decided to go on without it (they then wait
    at step 6), rank 2 is started again with the same command: it stops with `LeftOut` instead of waiting the 30 s
    timeout for ranks that will not come, and the survivors finish their 10 steps as 2 ranks."""
    port = free_port()
    run = dict(root=str(tmp_path), steps=10, hold_at=6)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as again:
        procs = start_processes(workers.survive_or_error, 3, out, port=port, deaths={2: 3}, **run)
        restarted = None
        try:
            deadline = time.monotonic() + BOUND
            while not (tmp_path / "decided").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            restarted = start_rank(workers.survive_or_error, 2, 3, port, again, deaths={}, **run)
            restarted.join(max(0.0, deadline - time.monotonic()))
            (tmp_path / "released").touch()
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            assert [procs[0].exitcode, procs[1].exitcode, restarted.exitcode] == [0, 0, 0]
        finally:
            for p in [*procs, restarted]:
                if p is not None and p.is_alive():
                    p.kill()
        started_again = pickle.loads((Path(again) / "2.pkl").read_bytes())[1]
        survivors = [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())[1] for rank in (0, 1)]
    assert started_again.startswith("LeftOut: Rank 2 was lost by a run that goes on without it"), started_again
    for r in survivors:
        assert (r["world_size"], r["global_step"]) == (2, 10) and r["decisions"][0]["lost"] == (2,)


@pytest.mark.parametrize("on_peer_failure", ["stop", "continue"])
def test_on_peer_failure_and_min_workers_are_checked_before_anything_runs(on_peer_failure: str) -> None:
    from lightning_decentral import DecentralizedStrategy
    from tests.workers import trainer_for

    with pytest.raises(ValueError, match=r"`on_peer_failure` must be one of \['stop', 'continue'\], got 'go on'"):
        DecentralizedStrategy(on_peer_failure="go on")
    with pytest.raises(
        ValueError, match=r"`min_workers` must be a positive integer \(the fewest workers a run goes on with\)"
    ):
        DecentralizedStrategy(on_peer_failure=on_peer_failure, min_workers=0)
    with pytest.raises(ValueError, match="min_workers=5 is more than the 4 workers of the run: pass at most 4"):
        trainer_for(4, DecentralizedStrategy(on_peer_failure=on_peer_failure, min_workers=5))


def test_continue_refuses_saves_in_the_background_when_the_trainer_is_built() -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_decentral import DecentralizedStrategy
    from tests.workers import trainer_for

    with pytest.raises(
        ValueError, match=r"on_peer_failure='continue' does not save in the background .* Drop the AsyncCheckpointIO"
    ):
        trainer_for(2, DecentralizedStrategy(on_peer_failure="continue"), plugins=[AsyncCheckpointIO()])
    trainer_for(
        2, DecentralizedStrategy(on_peer_failure="stop"), plugins=[AsyncCheckpointIO()]
    )  # restarts resume instead


def test_a_launch_by_lightning_is_told_apart_from_one_process_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's own launcher (devices=n from a script, or '_spawn') ends every process when one fails: the strategy
    knows it was started that way (and warns at start with "continue"); a process started by another launcher
    (LOCAL_RANK and the rest set) was not."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from lightning_decentral import DecentralizedStrategy
    from tests.workers import trainer_for

    # a Trainer built with RANK=1 makes this process Lightning's rank 1: restore rank 0 after, for the tests that follow
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    for name in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "TORCHELASTIC_RUN_ID",
        "SLURM_NTASKS",
        "SLURM_JOB_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    assert trainer_for(2, DecentralizedStrategy(on_peer_failure="continue")).strategy.launched_by_lightning
    assert trainer_for(
        2, DecentralizedStrategy(on_peer_failure="continue", start_method="spawn")
    ).strategy.launched_by_lightning
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not trainer_for(2, DecentralizedStrategy(on_peer_failure="continue")).strategy.launched_by_lightning


def test_continue_on_nccl_is_refused_when_the_trainer_or_fabric_is_built() -> None:
    """Before: neither built nor refused (the survivors' regrouping relies on gloo). The backend passed, or a GPU's
    default (NCCL), is checked when the Trainer or Fabric is built; gloo and `"stop"` on NCCL are accepted."""
    from lightning.fabric import Fabric

    from lightning_decentral import DecentralizedStrategy, fabric
    from lightning_decentral.options import GossipOptions
    from tests.workers import trainer_for

    refused = (
        r"on_peer_failure='continue' is supported on the gloo backend only \(CPU training\), not nccl: "
        r".* use on_peer_failure='stop'"
    )
    with pytest.raises(ValueError, match=refused):
        trainer_for(2, DecentralizedStrategy(on_peer_failure="continue", process_group_backend="nccl"))
    with pytest.raises(ValueError, match=refused):
        Fabric(
            strategy=fabric.DecentralizedStrategy(on_peer_failure="continue", process_group_backend="nccl"),
            accelerator="cpu",
            devices=2,
        )
    with pytest.raises(ValueError, match=refused):  # what a GPU's device gets by default
        GossipOptions(on_peer_failure="continue").check_backend(
            torch.distributed.Backend.default_device_backend_map["cuda"]
        )
    trainer_for(2, DecentralizedStrategy(on_peer_failure="continue"))
    trainer_for(2, DecentralizedStrategy(on_peer_failure="stop", process_group_backend="nccl"))


@pytest.mark.slow
def test_a_run_left_with_too_few_workers_ends_with_one_traceback_per_rank() -> None:
    """Before: each survivor printed three tracebacks (gloo's error, the PeerFailure it caused, then TooFewWorkers
    raised while handling that). 3 ranks, min_workers=3, rank 1 killed when step 3 starts: what Python prints for the
    error of ranks 0 and 2 is one traceback, ending with TooFewWorkers' message."""
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(
            workers.survive_or_traceback, 3, root=root, deaths={1: 3}, steps=8, min_workers=3
        )
    assert codes == [0, -9, 0]
    for printed in (results[0], results[2]):
        assert printed.count("Traceback (most recent call last)") == 1, printed
        assert "The above exception was" not in printed and "During handling" not in printed
        last = printed.rstrip().splitlines()[-1]
        assert last.startswith(
            "lightning_decentral.membership.protocol.TooFewWorkers: Only 2 workers are left after step 3"
        )


def test_a_peer_failure_prints_one_traceback_with_the_backends_error_in_one_line() -> None:
    """The backend's error stays the `__cause__` (and in the message); its frames, in the package's waits, are not
    printed: one traceback, then the PeerFailure."""
    import traceback

    from lightning_decentral.failures import PeerFailure, peers_answer

    with pytest.raises(PeerFailure) as caught:
        with peers_answer("The all-gather of step 3"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:3736")
    printed = "".join(traceback.format_exception(caught.value))
    assert printed.count("Traceback (most recent call last)") == 1
    assert printed.startswith(
        "RuntimeError: Connection closed by peer [127.0.0.1]:3736\n\nThe above exception was the direct cause"
    )
    assert isinstance(caught.value.__cause__, RuntimeError) and "(Connection closed by peer" in str(caught.value)


@pytest.mark.slow
def test_every_survivor_logs_each_decision_and_the_run_says_at_the_end_what_it_lost() -> None:
    """Before: losing a worker printed nothing. 3 ranks on a ring, rank 1 killed when step 5 starts: ranks 0 and 2 each
    log one line for the decision (the rank lost, the agreed step, the survivors' graph), `survivors/workers` and
    `survivors/lost` are in the logged metrics, and the end of the run says what was lost. Issue 38 changed the end:
    one log line (it was a Python warning), which says "It ended with" (it said "It went on with")."""
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(workers.survive, 3, root=root, deaths={1: 5}, steps=10)
    assert codes == [0, -9, 0]
    for first_rank, r in ((0, results[0]), (2, results[2])):
        (line,) = [line for line in r["logged"] if "Survived failure" in line]
        assert line.startswith(
            "Survived failure 1: lost rank 1 (ranks of the start). The 2 survivors [0, 2] agreed on step 5"
        )
        assert "mix again from step 6 on Ring(world_size=2)" in line
        assert line.endswith(f"rank {first_rank} of the start, rank {first_rank // 2} now.")
        assert r["metrics"] == {"survivors/workers": 2.0, "survivors/lost": 1.0}
    ended = [line for line in results[0]["logged"] if line.startswith("This run lost")]
    assert ended == [
        "This run lost 1 of its 3 workers: rank 1 (the survivors agreed on step 5). It ended with 2 "
        "(strategy.failures_survived lists the decisions)."
    ]
    assert not [line for line in results[2]["logged"] if line.startswith("This run lost")]  # once: one rank says it
    assert not [w for r in (results[0], results[2]) for w in r["warnings"] if w.startswith("This run lost")]


@pytest.mark.slow
def test_under_lightnings_own_launcher_continue_warns_and_a_killed_rank_stops_every_rank(tmp_path: Path) -> None:
    """Before: no warning at start (rank 0 looked launched by someone else: Lightning sets LOCAL_RANK in it), and
    with rank 1 killed the others trained to the end and the script exited 0, unless Lightning's launcher, which polls
    its children every 5 s, killed them first. Now: `Trainer(devices=3)` from a script warns at start that
    `"continue"` has no effect there, and a rank killed by its PID (a process Lightning started) stops every rank:
    the script exits non-zero, no rank finishes, no process is left."""
    script = Path(__file__).with_name("lightning_launcher_script.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    with open(tmp_path / "output.txt", "w+") as output:
        main = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)], env=env, stdout=output, stderr=subprocess.STDOUT
        )
        pids: list[int] = []
        try:
            deadline = time.monotonic() + BOUND
            while not (tmp_path / "pid-1").exists() and main.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            pids = [
                int((tmp_path / f"pid-{rank}").read_text()) for rank in range(3) if (tmp_path / f"pid-{rank}").exists()
            ]
            os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
            code = main.wait(max(1.0, deadline - time.monotonic()))
            while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = [pid for pid in pids if _running(pid)]
        finally:
            if main.poll() is None:
                main.kill()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        output.seek(0)
        printed = output.read()
    assert code != 0, printed[-4000:]
    assert "on_peer_failure='continue' has no effect under Lightning's own launcher" in " ".join(printed.split())
    assert "finished" not in printed and not left


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
