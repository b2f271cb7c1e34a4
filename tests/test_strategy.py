"""The strategy in Lightning: evaluation and checkpoints on x̄, precisions, launchers, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_decentral  # noqa: F401
from lightning_decentral import DecentralizedStrategy, Torus
from tests import workers
from tests.helpers import run_distributed
from tests.models import RecordingRegression, Regression, flat, loader

WORLD = 4


@pytest.fixture(scope="module", params=["average", "local"])
def evaluated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, str]:
    path = str(tmp_path_factory.mktemp("ckpt") / "model.ckpt")
    return (
        request.param,
        run_distributed(workers.evaluate_and_checkpoint, WORLD, path=path, eval_on=request.param),
        path,
    )


@pytest.mark.slow
def test_evaluation_runs_on_the_average_and_restores_replicas(evaluated: tuple[str, list, str]) -> None:
    eval_on, results, _ = evaluated
    replicas = torch.stack([r["replica"] for r in results])
    mean = replicas.mean(0)
    assert (replicas[0] - replicas[1]).abs().max() > 1e-3  # the replicas are distinct
    for rank, r in enumerate(results):
        expected = mean if eval_on == "average" else replicas[rank]
        for seen in ("fit_validation", "validate"):
            torch.testing.assert_close(r[seen], expected, atol=1e-6, rtol=0)
        for after in ("after_save", "after_validate", "after_predict"):  # this rank's replica, bit for bit
            assert torch.equal(r[after], replicas[rank]), after


@pytest.mark.slow
def test_predictions_come_from_the_evaluated_model(evaluated: tuple[str, list, str]) -> None:
    eval_on, results, _ = evaluated
    replicas = torch.stack([r["replica"] for r in results])
    for rank, r in enumerate(results):
        module = Regression()
        torch.nn.utils.vector_to_parameters(
            replicas.mean(0) if eval_on == "average" else replicas[rank], module.parameters()
        )
        torch.testing.assert_close(r["predictions"], module(r["predict_inputs"]).detach(), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_checkpoint_holds_the_average_and_loads_without_the_strategy(evaluated: tuple[str, list, str]) -> None:
    _, results, path = evaluated
    mean = torch.stack([r["replica"] for r in results]).mean(0)
    checkpoint = torch.load(path, weights_only=True)
    plain = torch.nn.Module()
    plain.net = Regression().net  # a bare nn.Module: no Lightning, no strategy
    plain.load_state_dict(checkpoint["state_dict"])
    torch.testing.assert_close(flat(plain), mean, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_checkpoint_holds_the_averaged_momentum(evaluated: tuple[str, list, str]) -> None:
    _, results, path = evaluated
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    saved = torch.cat([state[i]["momentum_buffer"].reshape(-1) for i in sorted(state)])
    momenta = torch.stack([r["momentum"] for r in results])
    assert (momenta[0] - momenta[1]).abs().max() > 1e-4
    torch.testing.assert_close(saved, momenta.mean(0), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_each_fit_leaves_no_process_group_behind(evaluated: tuple[str, list, str]) -> None:
    _, results, _ = evaluated
    for r in results:  # the gossip group of the first fit was destroyed when it ended
        assert r["process_groups"][0] == r["process_groups"][1] == 1, r["process_groups"]


@pytest.mark.slow
def test_resume_continues_every_replica_from_its_shard(evaluated: tuple[str, list, str]) -> None:
    """Each rank saved its own shard next to the average; the fallback to x̄ is in test_reliability.py."""
    _, results, _ = evaluated
    for r in results:
        assert torch.equal(r["resume_start"], r["replica"])
        assert r["resume_global_step"] == 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, momentum", [("bf16-mixed", "local"), ("64-true", "local"), ("bf16-mixed", "decentlam")]
)
def test_trains_in_other_precisions(precision: str, momentum: str) -> None:
    results = run_distributed(workers.fit_precision, WORLD, precision=precision, momentum=momentum)
    replicas = torch.stack([r["replica"] for r in results])
    assert torch.isfinite(replicas).all()
    assert (replicas[0] - replicas[1]).abs().max() > 1e-4
    assert replicas.dtype == (torch.float64 if precision == "64-true" else torch.float32)
    assert all(r["global_step"] == 12 for r in results)  # max_epochs=2 of 6 batches
    if momentum == "local":  # AWC posts x(k) before the forward pass
        assert all(r["in_flight"] == [True] * 12 for r in results)


@pytest.mark.slow
def test_more_than_one_optimizer_is_refused_on_every_rank() -> None:
    messages = run_distributed(workers.two_optimizers, 2)
    assert all("exactly one optimizer" in m and "parameter groups" in m for m in messages)


@pytest.mark.slow
def test_spawn_launcher_returns_the_average_to_the_main_process(tmp_path) -> None:
    model = RecordingRegression(str(tmp_path), momentum=0.9, lr=0.05)
    trainer = Trainer(
        strategy="dpsgd_spawn",
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert isinstance(trainer.strategy, DecentralizedStrategy)
    trainer.fit(model, train_dataloaders=loader(0, 48, 8))
    replicas = torch.stack([torch.load(tmp_path / f"{rank}.pt") for rank in range(2)])
    assert (replicas[0] - replicas[1]).abs().max() > 1e-4
    torch.testing.assert_close(flat(model), replicas.mean(0), atol=1e-6, rtol=0)


_FORK_FIT = """
import sys, torch
from lightning.pytorch import Trainer
import lightning_decentral
from lightning_decentral import DecentralizedStrategy
from tests.models import RecordingRegression, flat, loader

record_dir = sys.argv[1]
model = RecordingRegression(record_dir, momentum=0.9, lr=0.05)
trainer = Trainer(
    strategy="dpsgd_fork", accelerator="cpu", devices=2, max_steps=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
assert isinstance(trainer.strategy, DecentralizedStrategy) and trainer.strategy.start_method == "fork"
trainer.fit(model, train_dataloaders=loader(0, 48, 8))
torch.save(flat(model), f"{record_dir}/main.pt")
"""


@pytest.mark.slow
def test_fork_launcher_returns_the_average_to_the_main_process(tmp_path) -> None:
    """`strategy="dpsgd_fork"` forks the calling process, so it runs in a fresh interpreter, not in pytest's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PL_DISABLE_FORK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-c", _FORK_FIT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    replicas = torch.stack([torch.load(tmp_path / f"{rank}.pt") for rank in range(2)])
    assert (replicas[0] - replicas[1]).abs().max() > 1e-4
    torch.testing.assert_close(torch.load(tmp_path / "main.pt"), replicas.mean(0), atol=1e-6, rtol=0)


def test_names_are_registered() -> None:
    for name, start_method in (("dpsgd", "popen"), ("dpsgd_spawn", "spawn")):
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, DecentralizedStrategy) and strategy.start_method == start_method
    for name, momentum, start_method in (
        ("dpsgd_fork", "local", "fork"),
        ("decentlam_fork", "decentlam", "fork"),
        ("decentlam_spawn", "decentlam", "spawn"),
    ):
        assert name in StrategyRegistry, name
        assert StrategyRegistry[name]["init_params"] == {"momentum": momentum, "start_method": start_method}
    trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.topology.world_size == 4 and type(trainer.strategy.topology).__name__ == "Ring"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"combine": "sum"}, r"`combine` must be one of \['awc', 'atc'\]"),
        ({"eval_on": "rank0"}, r"`eval_on` must be one of \['average', 'local'\]"),
        ({"gossip_every": 0}, r"`gossip_every` must be a positive integer"),
        ({"gossip_steps": 1.5}, r"`gossip_steps` must be a positive integer"),
        ({"topology": "hypercube"}, r"Unknown topology 'hypercube'. Choose one of .*'ring'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecentralizedStrategy(**kwargs)


@pytest.mark.parametrize(
    "topology, devices, match",
    [
        ("torus", 7, r"7 is prime.*'ring' or 'exponential'"),
        (Torus(rows=3), 8, r"rows"),
        (np.full((3, 3), 1 / 3), 4, r"3x3.*4"),
        (np.array([[0.5, 0.5], [0.25, 0.75]]), 2, r"(column|col).*sum"),
        (np.array([[1.0, 0.0], [0.0, 1.0]]), 2, r"(connected|reach)"),
        (np.array([[1.5, -0.5], [-0.5, 1.5]]), 2, r"negative"),
    ],
)
def test_bad_topologies_fail_when_the_trainer_is_built(topology: object, devices: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Trainer(strategy=DecentralizedStrategy(topology=topology), accelerator="cpu", devices=devices, logger=False)


@pytest.mark.parametrize("every", [2, 3, 10])
def test_a_time_varying_topology_advances_one_matrix_per_gossip_round(every: int) -> None:
    """Issue 38 changed this: the matrix was indexed by the step, so `gossip_every=2` (or 10) on 4 ranks, a multiple
    of the period 2, only ever used W(1) and was refused as never connected."""
    strategy = DecentralizedStrategy(topology="one_peer_exponential", gossip_every=every)  # 4 ranks: period 2
    Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    rounds = [k for k in range(6 * every) if strategy.driver.schedule.rounds(k)]
    assert rounds == [every - 1 + every * r for r in range(6)]
    offsets = [strategy.topology.out_neighbors(0, k)[0][0] for k in rounds]
    assert offsets == [3, 2] * 3  # rank 0 sends to 0 − 1, then 0 − 2 (mod 4): W(0), W(1), W(0), ...


@pytest.mark.slow
def test_unfreezing_during_fit_stops_every_rank_with_the_fix() -> None:
    messages = run_distributed(workers.unfreeze_during_fit, 2)
    assert all("trainable parameters changed during fit" in m and "before fit" in m for m in messages)


@pytest.mark.parametrize("cap", [float("inf"), float("nan"), 0.0, -1.0, "4"])
def test_a_bucket_cap_that_is_not_a_positive_finite_number_is_refused_by_every_executor(cap: Any) -> None:
    """Before, `bucket_cap_mb=float("inf")` passed the constructor and failed in fit with a raw OverflowError."""
    from lightning_decentral import SimulatedDecentralizedStrategy, fabric

    for executor in (DecentralizedStrategy, fabric.DecentralizedStrategy, SimulatedDecentralizedStrategy):
        with pytest.raises(ValueError, match=r"`bucket_cap_mb` must be positive and finite \(the MB of one bucket\)"):
            executor(bucket_cap_mb=cap)
