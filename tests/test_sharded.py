"""Sharded replicas (`shard_size`): FSDP2 inside each replica, the update rules across replicas on the local shards."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy
from lightning_decentral.options import GossipOptions
from lightning_decentral.sharding import ReplicaLayout, check_same_sharding
from tests import sharded_workers
from tests.helpers import run_distributed, start_processes


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        (dict(staleness=1), "use staleness=0"),
        (dict(topology="hierarchical"), "use a flat topology"),
    ],
)
def test_what_does_not_compose_is_refused_naming_the_fix(options, fix):
    with pytest.raises(ValueError, match=fix):
        GossipOptions(shard_size=2, **options)
    GossipOptions(shard_size=1, **options)  # unsharded: as before


def test_rejoin_is_refused_with_sharded_replicas_naming_why_and_the_fix():
    with pytest.raises(ValueError, match=r"come back as 2 ranks at once.*Use rejoin=False"):
        DecentralizedStrategy(shard_size=2, on_peer_failure="continue", rejoin=True)


def test_shard_size_is_a_positive_integer():
    with pytest.raises(ValueError, match="shard_size"):
        GossipOptions(shard_size=0)


def test_a_world_size_shard_size_does_not_divide_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="not a multiple of it"):
        Trainer(strategy=DecentralizedStrategy(shard_size=3), accelerator="cpu", devices=4)
    assert ReplicaLayout.of(8, 2).column(1) == [1, 3, 5, 7]


def test_the_simulation_and_fabric_refuse_shard_size():
    with pytest.raises(ValueError, match="does not shard replicas"):
        SimulatedDecentralizedStrategy(workers=4, shard_size=2)
    with pytest.raises(ValueError, match="does not shard replicas"):
        FabricStrategy(shard_size=2)


def test_a_resume_across_a_change_of_sharding_is_refused():
    with pytest.raises(ValueError, match="saved with shard_size=2, this run has shard_size=1"):
        check_same_sharding(1, {"strategy": {"shard_size": "2"}}, "a.ckpt")
    with pytest.raises(ValueError, match="has none for this rank"):
        check_same_sharding(2, None, "a.ckpt")


@pytest.mark.slow
def test_a_sharded_run_equals_unsharded_workers_on_the_union_of_a_replicas_batches():
    """8 ranks as 4 replicas of 2 (FSDP2 inside) against 4 unsharded workers, each on the two batches of the replica
    it stands for: AWC, DecentLaM, DiLoCo and sign-compressed gossip, and a module the strategy shards itself."""
    names = list(sharded_workers.CONFIGS)
    sharded = run_distributed(sharded_workers.fit_configs, world_size=8, timeout=240, shard_size=2, names=names)
    names_unsharded = [n for n in names if n != "awc_root"]
    workers = run_distributed(
        sharded_workers.fit_configs, world_size=4, timeout=240, shard_size=1, union=2, names=names_unsharded
    )
    for name in names:
        reference = [w["awc" if name == "awc_root" else name] for w in workers]
        whole = reference[0]["parameters"].numel()
        for rank, run in enumerate(sharded):
            torch.testing.assert_close(run[name]["parameters"], reference[rank // 2]["parameters"], rtol=0, atol=1e-6)
            # the consensus distance over the replicas, ‖x̄‖ and Ξ per layer: as over the unsharded workers
            torch.testing.assert_close(run[name]["consensus"], reference[0]["consensus"], rtol=1e-5, atol=1e-8)
            # memory: this rank's exchange buffers and optimizer state hold half of the replica
            assert run[name]["held"] == whole // 2, name
            assert run[name]["optimizer_state_held"] == whole // 2, name
        if name != "outer":  # the outer step of the last step (6 = 2 · 3) averages every replica: equal
            spread = max((w["parameters"] - reference[0]["parameters"]).abs().max().item() for w in reference)
            assert spread > 1e-3, f"{name}: the replicas should differ, or the test shows nothing"


@pytest.mark.slow
def test_the_effective_learning_rate_over_sharded_replicas_equals_the_unsharded_runs():
    """EffectiveLearningRate at every step, 4 replicas of 2 ranks against 4 unsharded workers on the union of a
    replica's batches: the same α_e, α_e / γ and ‖η_d‖ on every rank, and the training it measured left as it was."""
    sharded = run_distributed(sharded_workers.fit_effective_lr, world_size=8, timeout=240, shard_size=2)
    workers = run_distributed(sharded_workers.fit_effective_lr, world_size=4, timeout=240, shard_size=1, union=2)
    for name in ("awc", "decentlam"):
        reference = workers[0][name]["logged"]
        for rank, run in enumerate(sharded):
            torch.testing.assert_close(run[name]["logged"], reference, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(
                run[name]["parameters"], workers[rank // 2][name]["parameters"], rtol=0, atol=1e-6
            )
        ratio, noise = reference[1:, 1], reference[1:, 2]  # step 0: every replica is x̄, α_e = γ
        assert (noise > 1e-4).all() and ((ratio - 1).abs() > 1e-6).all(), f"{name}: the replicas should differ"


@pytest.mark.slow
def test_clipping_by_norm_is_refused_with_sharded_replicas_that_survive_failures():
    with pytest.raises(RuntimeError, match="Clip by value"):
        run_distributed(sharded_workers.fit_clipped, world_size=2, timeout=120, algorithm="norm")
    run_distributed(sharded_workers.fit_clipped, world_size=2, timeout=120, algorithm="value")


@pytest.mark.slow
def test_a_module_sharded_on_another_mesh_is_refused_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"device_mesh\['shard'\]"):
        run_distributed(sharded_workers.fit_own_mesh, world_size=2, timeout=120)


@pytest.mark.slow
def test_validation_runs_on_x_bar_and_a_checkpoint_holds_it_whole_and_resumes_every_rank_exactly(tmp_path):
    path = str(tmp_path / "step2.ckpt")
    runs = run_distributed(sharded_workers.checkpoint_and_resume, world_size=4, timeout=240, path=path)
    for rank, run in enumerate(runs):
        torch.testing.assert_close(run["validated_on"], run["x_bar"], rtol=0, atol=1e-7)
        torch.testing.assert_close(run["file"], run["x_bar"], rtol=0, atol=1e-7)  # loaded by a plain module
        assert torch.equal(run["resumed_from"], run["saved"]), f"rank {rank}"  # its own replica and optimizer state
        assert torch.equal(run["resumed"], run["straight"]), f"rank {rank}"
    assert not torch.equal(runs[0]["own_after_validation"], runs[0]["x_bar"])  # each replica is its own again
    with pytest.raises(RuntimeError, match="saved with shard_size=2, this run has shard_size=1"):
        run_distributed(sharded_workers.resume_with, world_size=4, timeout=120, path=path, shard_size=1)
    with pytest.raises(RuntimeError, match="has none for this rank"):
        run_distributed(sharded_workers.resume_with, world_size=2, timeout=120, path=path, shard_size=2)


@pytest.mark.slow
def test_a_rank_that_fails_stops_every_rank_within_the_timeout(tmp_path):
    """on_peer_failure="stop": rank 1 (shard 1 of replica 0) raises at step 2; its replica's other rank (in FSDP's
    collectives) and the other replica (in the exchange) stop with an error, none waits past the strategy's timeout."""
    procs = start_processes(sharded_workers.fail_on_rank, 4, str(tmp_path), bad=1, timeout_s=20)
    deadline = time.monotonic() + 150
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} still running"
    for rank in range(4):
        with open(tmp_path / f"{rank}.pkl", "rb") as f:
            status, value = pickle.load(f)
        assert status == "error", f"rank {rank} finished"
        if rank == 1:
            assert "fails on purpose" in value


@pytest.mark.slow
def test_a_replica_that_loses_a_rank_leaves_whole_and_the_others_go_on_as_unsharded_survivors(tmp_path):
    """on_peer_failure="continue", ATC, 4 replicas of 2 ranks: rank 5 (shard 1 of replica 2) is killed when step 3 of
    8 starts. Its replica's other rank, 4, stops with ReplicaLost naming rank 5; replicas 0, 1 and 3 agree on step 3,
    keep their FSDP groups and go on as 6 ranks over their own graph, and end where 4 unsharded workers on the union of
    a replica's batches end when worker 2 is killed at the same step: the same replicas, consensus distance, and x̄ in
    the checkpoint they save after it."""
    files = {name: str(tmp_path / f"{name}.ckpt") for name in ("sharded", "workers")}
    kwargs = dict(at=3, steps=8)
    sharded = _every_rank_exits(
        sharded_workers.survive, 8, tmp_path / "sharded", shard_size=2, dies=5, save_to=files["sharded"], **kwargs
    )
    workers = _every_rank_exits(
        sharded_workers.survive,
        4,
        tmp_path / "workers",
        shard_size=1,
        union=2,
        dies=2,
        save_to=files["workers"],
        **kwargs,
    )
    assert [code for code, _ in sharded] == [0, 0, 0, 0, 0, -9, 0, 0]
    assert [code for code, _ in workers] == [0, 0, -9, 0]
    stopped = sharded[4][1]
    assert stopped.startswith("ReplicaLost: Rank 4 stops: its replica (ranks 4 to 5) lost rank 5 after step 3"), stopped
    decision = {"generation": 1, "members": (0, 1, 2, 3, 6, 7), "survivors": (0, 1, 2, 3, 6, 7), "lost": (4, 5)}
    reference = {0: workers[0][1], 1: workers[1][1], 3: workers[3][1]}
    for rank in (0, 1, 2, 3, 6, 7):
        run = sharded[rank][1]
        assert [{**d, "step": None} for d in run["decisions"]] == [{**decision, "step": None}], run["decisions"]
        assert run["decisions"][0]["step"] == reference[0]["decisions"][0]["step"] == 3
        assert (run["world_size"], run["global_step"]) == (6, 8)
        torch.testing.assert_close(run["parameters"], reference[rank // 2]["parameters"], rtol=0, atol=1e-6)
        torch.testing.assert_close(run["consensus"], reference[0]["consensus"], rtol=1e-5, atol=1e-8)
    x_bar = torch.stack([reference[r]["parameters"] for r in (0, 1, 3)]).mean(0)
    for path in files.values():  # the file's state_dict: x̄ of the surviving replicas, whole
        state = torch.load(path, weights_only=True)["state_dict"]
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in state.values()]), x_bar, rtol=0, atol=1e-6)
    spread = (reference[0]["parameters"] - reference[1]["parameters"]).abs().max()
    assert spread > 1e-3, "the survivors should differ, or the test shows nothing"


@pytest.mark.slow
def test_with_awc_the_ranks_of_a_replica_that_complete_different_exchanges_are_not_left_behind(tmp_path):
    """AWC posts x(3) before the forward, so the lost replica's rank 4 sends its shard of x(3) before it stops: the
    mesh column of rank 4 may complete exchange 3 while the other fails it. A rank of column 0 then runs on into step
    4's forward and waits there, in FSDP's collective, for its replica's rank of column 1, which is in the agreement:
    the agreement takes it to be in step 4 (it does not wait past the timeout for it and lose its replica). Every
    healthy replica stays, all agree on one step, finish the 8 steps as 6 ranks, and save x̄ of their replicas."""
    path = str(tmp_path / "awc.ckpt")
    runs = _every_rank_exits(
        sharded_workers.survive, 8, tmp_path / "out", shard_size=2, dies=5, at=3, steps=8, save_to=path, combine="awc"
    )
    assert [code for code, _ in runs] == [0, 0, 0, 0, 0, -9, 0, 0]
    assert runs[4][1].startswith("ReplicaLost: Rank 4 stops: its replica (ranks 4 to 5) lost rank 5 after step"), runs[
        4
    ]
    survivors = [runs[rank][1] for rank in (0, 1, 2, 3, 6, 7)]
    decisions = survivors[0]["decisions"]
    assert len(decisions) == 1 and decisions[0]["members"] == (0, 1, 2, 3, 6, 7) and decisions[0]["step"] in (3, 4)
    for run in survivors:
        assert run["decisions"] == decisions and (run["world_size"], run["global_step"]) == (6, 8)
    x_bar = torch.stack([run["parameters"] for run in survivors[::2]]).mean(0)
    state = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in state.values()]), x_bar, rtol=0, atol=1e-6)


def _every_rank_exits(fn, world_size, out, **kwargs):
    """Each rank's exit code and result; a rank's death does not end the others, every process is bounded."""
    out.mkdir()
    procs = start_processes(fn, world_size, str(out), **kwargs)
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running"
    results = []
    for rank, p in enumerate(procs):
        path = out / f"{rank}.pkl"
        status, value = pickle.loads(path.read_bytes()) if path.exists() else ("ok", None)
        assert status == "ok", value
        results.append((p.exitcode, value))
    return results
