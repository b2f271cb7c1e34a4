"""A gossip_steps schedule by epoch under the Trainer: on processes and in the simulation, straight or resumed."""

from __future__ import annotations

from typing import Any

import torch

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver
from tests.simulation_workers import RESUME, _resume_model, _resume_trainer, _state, shared_loader

BY_EPOCH = {"epoch": {0: 1, 1: 3, 2: 2}}
STEPS_PER_EPOCH = RESUME.steps  # shared_loader(RESUME, n) holds one epoch of RESUME.steps steps per worker


class Rounds(ExchangeObserver):
    """The rounds of every exchange posted, by optimizer step."""

    def __init__(self) -> None:
        self.by_step: dict[int, set[int]] = {}

    def on_post(self, event: ExchangeEvent) -> None:
        self.by_step.setdefault(event.step, set()).add(event.rounds)


def _kwargs() -> dict[str, Any]:
    return {**RESUME.strategy_kwargs(), "gossip_steps": BY_EPOCH}


def fit_processes(rank: int, world_size: int, epochs: int) -> dict[str, Any]:
    """``epochs`` epochs on processes: this rank's state and the rounds of its exchanges."""
    model, rounds = _resume_model(rank), Rounds()
    strategy = DecentralizedStrategy(**_kwargs())
    strategy.observe(rounds)
    _resume_trainer(strategy, world_size, epochs).fit(model, train_dataloaders=shared_loader(RESUME, world_size))
    return {"state": _state(model), "rounds": rounds.by_step}


def fit_simulated(workers: int, epochs: int, save: str = "", load: str = "") -> dict[str, Any]:
    """Fit to ``epochs`` epochs in the simulation (from ``load`` if given; then save to ``save`` if given)."""
    model, rounds = _resume_model(0), Rounds()
    strategy = SimulatedDecentralizedStrategy(workers=workers, **_kwargs())
    strategy.observe(rounds)
    trainer = _resume_trainer(strategy, 1, epochs)
    trainer.fit(model, train_dataloaders=shared_loader(RESUME, workers), ckpt_path=load or None)
    if save:
        trainer.save_checkpoint(save)
    return {"states": torch.stack([_state(m) for m in strategy.worker_modules()]), "rounds": rounds.by_step}
