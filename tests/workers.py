"""Functions the spawned test workers run (importable, so ``spawn`` can find them)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_decentral import DecentralizedStrategy
from tests.models import Regression, init_seed, flat, loader
from tests.reference import Config


def trainer_for(world_size: int, strategy: Any, **kwargs: Any) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def fit_config(rank: int, world_size: int, config: Config, strategy: Any = None) -> torch.Tensor:
    """Train ``config`` on this rank's data; return this rank's parameters."""
    model = Regression(seed=init_seed(rank), batch_norm=config.batch_norm, **config.optimizer_spec())
    model = model.to(config.dtype)
    strategy = strategy if strategy is not None else DecentralizedStrategy(**config.strategy_kwargs())
    precision = "64-true" if config.dtype == torch.float64 else "32-true"
    trainer = trainer_for(
        world_size,
        strategy,
        max_steps=config.steps,
        accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip,
        precision=precision,
    )
    trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size, config.dtype))
    return flat(model)


def fit_configs(rank: int, world_size: int, configs: list[Config]) -> dict[str, torch.Tensor]:
    return {c.name: fit_config(rank, world_size, c) for c in configs}


def fit_ddp(rank: int, world_size: int, config: Config) -> torch.Tensor:
    return fit_config(rank, world_size, config, strategy="ddp")
