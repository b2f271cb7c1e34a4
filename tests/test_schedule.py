"""gossip_steps as a schedule by epoch or step: parsed and checked, honoured alike by the simulation and the
processes, resumed from a checkpoint, and part of the configuration the ranks agree on (the dense reference
cases are in tests/test_rules.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.agreement import run_configuration
from lightning_decentral.schedule import GossipSchedule, RoundsSchedule
from lightning_decentral.topology import Ring
from tests import schedule_workers as sw
from tests.helpers import run_distributed
from tests.models import make_net

WORLD = 4
ROOT = Path(__file__).resolve().parents[1]


def _expected(first_step: int, last_step: int) -> dict[int, set[int]]:
    table = sw.BY_EPOCH["epoch"]
    return {k: {table[max(e for e in table if e <= k // sw.STEPS_PER_EPOCH)]} for k in range(first_step, last_step)}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"epochs": {0: 2}}, "a RoundsSchedule, or a schedule"),
        ({"epoch": {1: 2}}, "rounds from epoch 0 on"),
        ({"step": {0: 2, 10: 0}}, r"rounds \(a positive integer\), got 10: 0"),
        ({"epoch": {0: 2, -1: 1}}, r"an integer ≥ 0"),
        (0, "`gossip_steps` must be a positive integer"),
    ],
)
def test_a_bad_schedule_is_refused_before_anything_runs(spec, match: str) -> None:
    for strategy in (DecentralizedStrategy, SimulatedDecentralizedStrategy):
        with pytest.raises(ValueError, match=match):
            strategy(gossip_steps=spec)


def test_the_dictionary_form_as_yaml_gives_it_and_the_schedule_object_are_one_schedule() -> None:
    from_yaml = RoundsSchedule.of({"epoch": {"0": 4, "5": 2}})  # keys as strings (JSON)
    assert from_yaml == RoundsSchedule({0: 4, 5: 2}) == RoundsSchedule.of({"epoch": {5: 2, 0: 4}})
    schedule = GossipSchedule(Ring(world_size=4), gossip_every=2, rounds={"step": {0: 3, 4: 1}})
    assert [schedule.rounds(k) for k in range(8)] == [0, 3, 0, 3, 0, 1, 0, 1]


def test_the_ranks_agree_on_the_schedule() -> None:
    """run_configuration holds the schedule: ranks given different ones stop at set-up, naming it."""

    configurations = [
        run_configuration(SimulatedDecentralizedStrategy(workers=4, gossip_steps=spec), make_net(), "32-true")
        for spec in (2, RoundsSchedule({0: 2}, unit="step"), {"epoch": {0: 4, 5: 2}}, {"epoch": {0: 4, 6: 2}})
    ]
    fields = [(c["gossip_steps"], c["gossip_steps schedule"]) for c in configurations]
    assert fields[0] == fields[1] != fields[2] != fields[3]
    assert fields[0] == (2, "") and fields[2] == (4, "{'epoch': {0: 4, 5: 2}}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    checkpoint = str(Path(tmp_path_factory.mktemp("schedule")) / "epoch1.ckpt")
    return {
        "straight": sw.fit_simulated(WORLD, epochs=3),
        "first": sw.fit_simulated(WORLD, epochs=1, save=checkpoint),
        "resumed": sw.fit_simulated(WORLD, epochs=3, load=checkpoint),
        "processes": run_distributed(sw.fit_processes, WORLD, epochs=3),
    }


@pytest.mark.slow
def test_the_simulation_gossips_the_rounds_of_each_epoch(runs: dict) -> None:
    assert runs["straight"]["rounds"] == _expected(0, 3 * sw.STEPS_PER_EPOCH)  # 1, then 3, then 2 rounds


@pytest.mark.slow
def test_the_processes_gossip_the_same_rounds_and_reach_the_same_replicas(runs: dict) -> None:
    for rank in runs["processes"]:
        assert rank["rounds"] == _expected(0, 3 * sw.STEPS_PER_EPOCH)
    ranks = torch.stack([rank["state"] for rank in runs["processes"]])
    torch.testing.assert_close(runs["straight"]["states"], ranks, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_resumed_run_continues_the_schedule_from_its_epoch(runs: dict) -> None:
    assert runs["resumed"]["rounds"] == _expected(sw.STEPS_PER_EPOCH, 3 * sw.STEPS_PER_EPOCH)
    assert torch.equal(runs["resumed"]["states"], runs["straight"]["states"])
    assert not torch.equal(runs["first"]["states"], runs["straight"]["states"])


def test_a_yaml_config_gives_the_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_decentral.cli import DecentralizedCLI

    config = tmp_path / "schedule.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_decentral.SimulatedDecentralizedStrategy\n"
        "    init_args:\n      workers: 4\n      gossip_steps:\n        epoch: {0: 4, 5: 2, 10: 1}\n"
    )
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])
    cli = DecentralizedCLI(
        args=["--config", "examples/configs/digits_simulated.yaml", "--config", str(config)], run=False
    )
    assert RoundsSchedule.of(cli.trainer.strategy.gossip_steps) == RoundsSchedule({0: 4, 5: 2, 10: 1}, unit="epoch")
