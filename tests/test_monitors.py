"""The monitors of docs/monitoring.md on n = 4 gloo processes, checked against independent computations
from every rank's parameters, gradients and batches (plain torch, not the code under test)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_decentral import plot
from lightning_decentral.callbacks import ConsensusControl, ConsensusDistance, EffectiveLearningRate
from tests import monitor_workers
from tests.helpers import run_distributed
from tests.models import make_net
from tests.reference import mixing

WORLD = 4


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("monitor_logs")


@pytest.fixture(scope="module")
def runs(logs: Path) -> list[dict[str, Any]]:
    """Every scenario, once, in one group of 4 processes."""
    return run_distributed(monitor_workers.monitors, WORLD, log_dir=str(logs))


def _stack(runs: list[dict[str, Any]], scenario: str, key: str, step: int) -> torch.Tensor:
    return torch.stack([r[scenario][key][step] for r in runs]).double()  # n × d


def _distance(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)).square().sum(1).mean().sqrt()


def _logged(runs: list[dict[str, Any]], scenario: str, name: str) -> list[float]:
    """``name`` at every step (``None`` before it is first logged), after checking every rank logged the same."""
    per_rank = [[m.get(name) for m in r[scenario]["metrics"]] for r in runs]
    assert all(values == per_rank[0] for values in per_rank), per_rank
    return per_rank[0]


@pytest.mark.slow
def test_consensus_distance_and_residual_match_every_replica(runs: list[dict[str, Any]], logs: Path) -> None:
    distance, relative = _logged(runs, "ring", "consensus/distance"), _logged(runs, "ring", "consensus/relative")
    encoder, decoder = (
        _logged(runs, "ring", "consensus/distance/encoder"),
        _logged(runs, "ring", "consensus/distance/decoder"),
    )
    residual = _logged(runs, "ring", "consensus/residual")
    n_encoder = sum(p.numel() for p in make_net()[0].parameters())
    for k in range(monitor_workers.STEPS):
        after = _stack(runs, "ring", "after", k)
        assert distance[k] == pytest.approx(float(_distance(after)), rel=1e-5)
        assert encoder[k] == pytest.approx(float(_distance(after[:, :n_encoder])), rel=1e-5)
        assert decoder[k] == pytest.approx(float(_distance(after[:, n_encoder:])), rel=1e-5)
        assert relative[k] == pytest.approx(float(_distance(after) / after.mean(0).norm()), rel=1e-5)
        before = _stack(runs, "ring", "before", k)  # AWC mixes x(k)
        expected = (before - mixing("ring", WORLD, k) @ before).square().sum(1).mean().sqrt()
        assert residual[k] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert max(distance) > 1e-3  # the replicas really differ

    # Written once by the CSV logger (rank zero), one row per step, the values logged.
    with open(logs / "ring" / "version_0" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("consensus/distance")]
    assert [int(row["step"]) for row in rows] == list(range(monitor_workers.STEPS))
    assert [float(row["consensus/distance"]) for row in rows] == pytest.approx(distance, rel=1e-6)


def _gradient(x: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
    net = make_net().double()
    nn.utils.vector_to_parameters(x, net.parameters())
    loss = nn.functional.mse_loss(net(batch[0].double()), batch[1].double())
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(net.parameters()))])


@pytest.mark.slow
def test_effective_learning_rate_matches_gradients_at_replicas_and_average(runs: list[dict[str, Any]]) -> None:
    ratio, effective = _logged(runs, "ring", "lr/effective_ratio"), _logged(runs, "ring", "lr/effective")
    noise = _logged(runs, "ring", "noise/decentralized")
    for k in (1, 3, 5):  # every_n_steps=2
        x = _stack(runs, "ring", "before", k)
        batches = [r["ring"]["batches"][k] for r in runs]
        local = torch.stack([_gradient(x[i], batches[i]) for i in range(WORLD)]).mean(0)
        at_mean = torch.stack([_gradient(x.mean(0), batches[i]) for i in range(WORLD)]).mean(0)
        expected = float(local @ at_mean / (at_mean @ at_mean))
        assert ratio[k] == pytest.approx(expected, rel=1e-4)
        assert effective[k] == pytest.approx(0.1 * expected, rel=1e-4)
        assert noise[k] == pytest.approx(float((local - at_mean).norm()), rel=1e-3)
        assert float((local - at_mean).norm()) > 1e-4  # x_i != x̄: the two gradients really differ


@pytest.mark.slow
@pytest.mark.parametrize("momentum", ["local", "decentlam"])
def test_effective_learning_rate_leaves_training_bit_identical(runs: list[dict[str, Any]], momentum: str) -> None:
    """Dropout and BatchNorm, measured every step: parameters, buffers and momentum equal bit for bit."""
    for r in runs:
        without, with_callback = r[f"identical-{momentum}"]
        assert torch.equal(without, with_callback)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["awc", "atc", "decentlam"])
def test_consensus_control_keeps_distance_under_target(runs: list[dict[str, Any]], mode: str) -> None:
    target = runs[0]["targets"][mode]
    scenario = f"control-{mode}"
    distance, rounds = _logged(runs, scenario, "consensus/distance"), _logged(runs, scenario, "consensus/gossip_steps")
    if mode == "awc":
        assert max(_logged(runs, "ring", "consensus/distance")) > target  # plain ring gossip exceeds it
    assert max(distance) <= target * (1 + 1e-6), (distance, target)
    assert max(rounds) > 1 and min(rounds) >= 1 and max(rounds) <= 8
    for k in range(monitor_workers.STEPS):
        assert distance[k] == pytest.approx(float(_distance(_stack(runs, scenario, "after", k))), rel=1e-5)


@pytest.mark.slow
def test_consensus_control_on_the_proxy_with_a_relative_target_and_until_epoch(runs: list[dict[str, Any]]) -> None:
    rounds = _logged(runs, "proxy", "consensus/gossip_steps")  # equal on every rank
    steps_per_epoch = monitor_workers.STEPS
    assert len(rounds) == 2 * steps_per_epoch
    assert max(rounds[:steps_per_epoch]) > 1 and max(rounds) <= 4
    assert rounds[steps_per_epoch:] == [1.0] * steps_per_epoch  # until_epoch=1: no control in epoch 1
    assert runs[0]["proxy_calibration"] is not None


@pytest.mark.slow
def test_plain_ddp_logs_one_model(runs: list[dict[str, Any]]) -> None:
    for name, value in {
        "consensus/distance": 0.0,
        "consensus/relative": 0.0,
        "consensus/residual": 0.0,
        "consensus/gossip_steps": 0.0,
        "lr/effective_ratio": 1.0,
        "lr/effective": 0.1,
        "noise/decentralized": 0.0,
    }.items():
        assert _logged(runs, "ddp", name) == [pytest.approx(value)] * 2, name
    assert runs[0]["ddp_warnings"] and "nothing to control" in runs[0]["ddp_warnings"][0]


@pytest.mark.slow
def test_plot_command_writes_pngs_from_the_runs(runs: list[dict[str, Any]], logs: Path, tmp_path: Path) -> None:
    """The entry point of ``python -m lightning_decentral.plot`` (run as a command in tests/test_plot.py)."""
    assert plot.main([str(logs / "ring"), str(logs / "control-awc"), "--out", str(tmp_path)]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert written == {"loss.png", "consensus_distance.png", "effective_lr_ratio.png", "gossip_steps.png"}
    for name in written:
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ConsensusDistance(every_n_steps=0), "every_n_steps"),
        (lambda: EffectiveLearningRate(every_n_steps=1.5), "every_n_steps"),
        (lambda: ConsensusControl(target=0.0), "target"),
        (lambda: ConsensusControl(target=1.0, reference="relative"), "reference"),
        (lambda: ConsensusControl(target=1.0, max_gossip_steps=0), "max_gossip_steps"),
        (lambda: ConsensusControl(target=1.0, until_epoch=1.5), "until_epoch"),
        (lambda: ConsensusControl(target=1.0, handover_epochs=-1), "handover_epochs"),
    ],
)
def test_bad_arguments_fail_when_built(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_warns_when_measurements_would_never_be_written(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from tests.models import loader

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        log_every_n_steps=5,
        logger=CSVLogger(tmp_path),
        callbacks=[ConsensusDistance(every_n_steps=7), EffectiveLearningRate(every_n_steps=10)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match=r"ConsensusDistance\(every_n_steps=7\).*multiple of") as caught:
        trainer.fit(monitor_workers.TwoPart(), train_dataloaders=loader(0, 8, 8))
    assert not any("EffectiveLearningRate" in str(w.message) for w in caught)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, expected, unexpected",
    [
        (
            "dpsgd",
            [
                "nothing to control",
                "DecentralizedStrategy runs one worker",
                "devices > 1",
                "SimulatedDecentralizedStrategy(workers=n)",
            ],
            "strategy='dpsgd'",
        ),
        ("auto", ["nothing to control", "1 rank(s)", "Use strategy='dpsgd'"], "SimulatedDecentralizedStrategy"),
    ],
    ids=["one-worker-dpsgd", "other-strategy"],
)
def test_consensus_control_with_one_worker_says_what_to_change(
    strategy: str, expected: list[str], unexpected: str
) -> None:
    """On a decentralized strategy with one worker the advice is more workers, not the strategy it already uses."""
    (messages,) = run_distributed(monitor_workers.one_worker_control_warnings, 1, strategy=strategy)
    assert len(messages) == 1, messages
    for text in expected:
        assert text in messages[0], (text, messages[0])
    assert unexpected not in messages[0]
