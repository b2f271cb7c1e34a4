"""Functions the spawned test workers run (importable, so ``spawn`` can find them)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver
from tests.models import BadLossOnRank, Regression, flat, init_seed, loader
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
    per_node = world_size // config.num_nodes
    # nodes emulated on one machine: Lightning reads the layout from these variables
    os.environ.update(NODE_RANK=str(rank // per_node), LOCAL_RANK=str(rank % per_node))
    trainer = trainer_for(
        per_node,
        strategy,
        num_nodes=config.num_nodes,
        max_steps=config.steps,
        accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip,
        precision=precision,
    )
    trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size, config.dtype))
    buffers = [b.reshape(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat([flat(model), *buffers])


def fit_configs(rank: int, world_size: int, configs: list[Config]) -> dict[str, torch.Tensor]:
    return {c.name: fit_config(rank, world_size, c) for c in configs}


def fit_ddp(rank: int, world_size: int, config: Config) -> torch.Tensor:
    return fit_config(rank, world_size, config, strategy="ddp")


def evaluate_and_checkpoint(rank: int, world_size: int, path: str, eval_on: str) -> dict[str, Any]:
    """Fit with validation, save, validate/test/predict outside fit, then resume from the checkpoint."""
    config = Config("checkpoint", optimizer={"lr": 0.05, "momentum": 0.9})
    model = Regression(seed=init_seed(rank), **config.optimizer_spec())
    train, val = loader(rank, config.samples, config.batch_size), loader(rank + world_size, 16, 8)
    strategy = DecentralizedStrategy(eval_on=eval_on)
    trainer = trainer_for(world_size, strategy, max_steps=config.steps, limit_val_batches=1)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    (optimizer,) = trainer.optimizers
    momentum = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    out: dict[str, Any] = {"replica": flat(model), "fit_validation": model.validation_params[-1], "momentum": momentum}
    out["process_groups"] = [_process_groups()]
    trainer.save_checkpoint(path)
    out["after_save"] = flat(model)
    trainer.validate(model, val, verbose=False)
    out["validate"] = model.validation_params[-1]
    out["after_validate"] = flat(model)
    out["predictions"] = torch.cat(trainer.predict(model, val))
    out["after_predict"] = flat(model)
    out["predict_inputs"] = torch.cat([x for x, _ in val])

    resumed = Regression(seed=init_seed(rank), **config.optimizer_spec())
    trainer = trainer_for(world_size, DecentralizedStrategy(eval_on=eval_on), max_steps=config.steps + 2)
    trainer.fit(resumed, train_dataloaders=train, ckpt_path=path)
    out["resume_start"] = resumed.train_start_params
    out["resume_global_step"] = trainer.global_step
    out["process_groups"].append(_process_groups())
    return out


def _process_groups() -> int:
    """How many process groups this process holds (the world and every subgroup not destroyed)."""
    return len(torch.distributed.distributed_c10d._world.pg_map)


class _InFlight(ExchangeObserver):
    """The exchanges posted and not yet waited for."""

    def __init__(self) -> None:
        self.open: set[int] = set()

    def on_post(self, event: ExchangeEvent) -> None:
        self.open.add(id(event))

    def on_wait(self, event: ExchangeEvent) -> None:
        self.open.discard(id(event))


class _SeesExchangeInFlight(Regression):
    """Records, inside every training_step, whether the AWC exchange has already been posted."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.in_flight: list[bool] = []
        self.exchanges = _InFlight()

    def on_fit_start(self) -> None:
        self.trainer.strategy.observe(self.exchanges)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.in_flight.append(bool(self.exchanges.open))
        return super().training_step(batch, batch_idx)


def fit_precision(rank: int, world_size: int, precision: str, momentum: str) -> dict[str, Any]:
    config = Config(precision, optimizer={"lr": 0.05, "momentum": 0.9})
    model = _SeesExchangeInFlight(seed=init_seed(rank), **config.optimizer_spec())
    trainer = trainer_for(world_size, DecentralizedStrategy(momentum=momentum), max_epochs=2, precision=precision)
    trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size))
    return {"replica": flat(model), "global_step": trainer.global_step, "in_flight": model.in_flight}


def two_optimizers(rank: int, world_size: int) -> str:
    class TwoOptimizers(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

    trainer = trainer_for(world_size, DecentralizedStrategy(), max_steps=1)
    try:
        trainer.fit(TwoOptimizers(), train_dataloaders=loader(rank, 8, 8))
    except ValueError as exc:
        return str(exc)
    return "no error"


class _StepRecorder(Callback, ExchangeObserver):
    """Records, after every optimizer step, this rank's parameters, GradScaler scale and the exchanges
    posted while backward ran (DecentLaM's buckets)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.posted_in_backward: list[int] = []
        self.in_backward = False
        self.posted = 0

    def on_fit_start(self, trainer: Trainer, *args: Any) -> None:
        trainer.strategy.observe(self)

    def on_before_backward(self, *args: Any) -> None:
        self.in_backward = True

    def on_after_backward(self, *args: Any) -> None:
        self.in_backward = False

    def on_post(self, event: ExchangeEvent) -> None:
        self.posted += self.in_backward

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.params.append(flat(trainer.lightning_module))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)
        self.posted_in_backward.append(self.posted)
        self.posted = 0


def decentlam_steps(rank: int, world_size: int, config: Config, scaler: bool, bad_rank: int = -1) -> dict[str, Any]:
    """Train DecentLaM recording every step (optionally fp16 with a GradScaler and an inf on one rank)."""
    model = BadLossOnRank(bad_rank, 2, float("inf"), seed=init_seed(rank), **config.optimizer_spec())
    recorder = _StepRecorder()
    plugins = (
        [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))] if scaler else []
    )
    trainer = trainer_for(
        world_size,
        DecentralizedStrategy(**config.strategy_kwargs()),
        max_steps=config.steps,
        callbacks=[recorder],
        plugins=plugins,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size))
    return {
        "params": recorder.params,
        "scales": recorder.scales,
        "posted_in_backward": recorder.posted_in_backward,
        "warnings": [str(w.message) for w in caught if "DecentLaM" in str(w.message)],
    }


def unfreeze_during_fit(rank: int, world_size: int) -> str:
    class UnfreezeAtEpoch1(Callback):
        def on_train_epoch_start(self, trainer: Trainer, module: Any) -> None:
            if trainer.current_epoch == 1:
                module.net[0].requires_grad_(True)

    model = Regression(seed=init_seed(rank))
    model.net[0].requires_grad_(False)
    trainer = trainer_for(world_size, DecentralizedStrategy(), max_epochs=2, callbacks=[UnfreezeAtEpoch1()])
    try:
        trainer.fit(model, train_dataloaders=loader(rank, 16, 8))
    except RuntimeError as exc:
        return str(exc)
    return "no error"
