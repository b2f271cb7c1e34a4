"""The same runs on n gloo processes and in one process (SimulatedDecentralizedStrategy), for the equivalence tests."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from tests.models import HIDDEN, IN, OUT, Regression, flat, init_seed, rank_data
from tests.reference import Config

SEED = 7


class LoggingRegression(Regression):
    """Logs its loss as a rank would (``sync_dist=True``); optionally with dropout (random state per worker)."""

    def __init__(self, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.dropout(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss


def shared_loader(config: Config, workers: int, shuffle: bool = True) -> DataLoader:
    """One dataset for all workers: Lightning's DistributedSampler splits it (and shuffles it, whatever `shuffle`)."""
    samples = config.steps * config.accumulate * config.batch_size * workers
    return DataLoader(
        TensorDataset(*rank_data(0, samples, config.dtype)), batch_size=config.batch_size, shuffle=shuffle
    )


def _trainer(strategy: Any, config: Config, devices: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=config.steps,
        accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip,
        precision=kwargs.pop("precision", "64-true" if config.dtype == torch.float64 else "32-true"),
        **{
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **kwargs,
        },
    )


def _state(module: nn.Module) -> torch.Tensor:
    buffers = [b.detach().reshape(-1).cpu() for b in module.buffers() if b.is_floating_point()]
    return torch.cat([flat(module), *buffers])


def _counts(module: nn.Module) -> list[int]:
    """The module's integer buffers (BatchNorm's `num_batches_tracked`)."""
    return [int(b) for b in module.buffers() if not b.is_floating_point()]


def fit_processes(rank: int, world_size: int, configs: list[Config], dropout: float = 0.0) -> dict[str, Any]:
    """Each config on ``world_size`` gloo processes: this rank's final state and its logged loss."""
    out = {}
    for config in configs:
        model = LoggingRegression(
            dropout, seed=init_seed(rank), batch_norm=config.batch_norm, **config.optimizer_spec()
        )
        pl.seed_everything(SEED, verbose=False)  # after the model, whose init seeds by rank: every rank alike
        trainer = _trainer(DecentralizedStrategy(**config.strategy_kwargs()), config, world_size)
        trainer.fit(model.to(config.dtype), train_dataloaders=shared_loader(config, world_size))
        out[config.name] = {
            "state": _state(model),
            "counts": _counts(model),
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "bytes_sent": trainer.strategy.bytes_sent,
            "logged_bytes": _logged_bytes(trainer),
        }
    return out


LOADER_CASES = [(False, True), (True, True), (False, False), (True, False)]
"""`(shuffle, use_distributed_sampler)` of the data-order comparison."""


def fit_processes_per_loader(rank: int, world_size: int, config: Config) -> dict[tuple[bool, bool], torch.Tensor]:
    """``config`` on ``world_size`` gloo processes with each of `LOADER_CASES`: this rank's final state."""
    out = {}
    for shuffle, distributed in LOADER_CASES:
        model = LoggingRegression(seed=init_seed(rank), **config.optimizer_spec())
        pl.seed_everything(SEED, verbose=False)
        strategy = DecentralizedStrategy(**config.strategy_kwargs())
        trainer = _trainer(strategy, config, world_size, use_distributed_sampler=distributed)
        trainer.fit(model, train_dataloaders=shared_loader(config, world_size, shuffle))
        out[(shuffle, distributed)] = _state(model)
    return out


def fit_simulated_with_loader(
    config: Config, workers: int, shuffle: bool, distributed: bool, vectorize: Any
) -> list[torch.Tensor]:
    """``config`` on ``workers`` simulated workers with a training DataLoader of `shuffle` and the Trainer's
    `use_distributed_sampler=distributed`: every worker's final state."""
    model = LoggingRegression(seed=init_seed(0), **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    trainer = _trainer(strategy, config, 1, use_distributed_sampler=distributed)
    trainer.fit(model, train_dataloaders=shared_loader(config, workers, shuffle))
    return [_state(module) for module in strategy.worker_modules()]


def fit_simulated(
    config: Config,
    workers: int,
    dropout: float = 0.0,
    vectorize: Any = False,
    module: type = LoggingRegression,
    precision: str = "32-true",
    dataset_class: type = TensorDataset,
) -> dict[str, Any]:
    """The same config on ``workers`` simulated workers (the samples of ``shared_loader`` in a ``dataset_class``):
    every worker's final state, integer buffers and module, and the logged loss."""
    model = module(dropout, seed=init_seed(0), batch_norm=config.batch_norm, **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    trainer = _trainer(strategy, config, 1, **({} if precision == "32-true" else {"precision": precision}))
    loader = shared_loader(config, workers)
    loader = DataLoader(dataset_class(*loader.dataset.tensors), batch_size=loader.batch_size, shuffle=True)
    trainer.fit(model.to(config.dtype), train_dataloaders=loader)
    return {
        "states": [_state(module) for module in strategy.worker_modules()],
        "counts": [_counts(module) for module in strategy.worker_modules()],
        "modules": strategy.worker_modules(),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "bytes_sent": strategy.bytes_sent,
        "logged_bytes": _logged_bytes(trainer),
    }


def _logged_bytes(trainer: pl.Trainer) -> Any:
    """What the strategy logged as `gossip/bytes_sent` at the last step (compressed gossip), else `None`."""
    value = trainer.callback_metrics.get("gossip/bytes_sent")
    return None if value is None else float(value)


class InOrder(DistributedSampler):
    """Rank ``i`` of ``n``'s samples ``i, i + n, ...`` in order (a DistributedSampler without shuffling), which a
    simulated worker ``i`` asks for by ``for_rank``: the simulation shuffles a training DataLoader's samples as the
    Trainer's processes do, whatever its ``shuffle`` says."""

    def __init__(self, dataset: Any, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)

    def for_rank(self, rank: int, num_replicas: int) -> InOrder:
        return InOrder(self.dataset, num_replicas, rank)


def interleaved_loader(config: Config, workers: int) -> DataLoader:
    """Worker ``i`` of ``workers`` (samples i, i + n, ... in order) gets exactly ``rank_data(i)``, the data the dense
    reference gives rank ``i``."""
    parts = [rank_data(i, config.samples, config.dtype) for i in range(workers)]
    x = torch.stack([p[0] for p in parts], dim=1).flatten(0, 1)
    y = torch.stack([p[1] for p in parts], dim=1).flatten(0, 1)
    dataset = TensorDataset(x, y)
    return DataLoader(dataset, batch_size=config.batch_size, sampler=InOrder(dataset))


def fit_simulated_on_rank_data(config: Config, workers: int, vectorize: bool = False) -> torch.Tensor:
    """``config`` simulated on the dense reference's per-rank data: every worker's final state, ``n × d``."""
    model = LoggingRegression(seed=init_seed(0), batch_norm=config.batch_norm, **config.optimizer_spec())
    strategy = SimulatedDecentralizedStrategy(
        workers=workers, vectorize=vectorize, failures=config.failures, **config.strategy_kwargs()
    )
    _trainer(strategy, config, 1).fit(model.to(config.dtype), train_dataloaders=interleaved_loader(config, workers))
    return torch.stack([_state(module) for module in strategy.worker_modules()])


def validate_simulated(config: Config, workers: int, eval_on: str) -> dict[str, Any]:
    """Fit, then validate: the parameters validation saw, every worker's, and worker 0's afterwards."""
    model = LoggingRegression(seed=init_seed(0), **config.optimizer_spec())
    strategy = SimulatedDecentralizedStrategy(workers=workers, eval_on=eval_on, **config.strategy_kwargs())
    trainer = _trainer(strategy, config, 1, limit_val_batches=1)
    trainer.fit(model, train_dataloaders=shared_loader(config, workers))
    trainer.validate(model, shared_loader(config, workers), verbose=False)
    return {
        "validated": model.validation_params[-1],
        "workers": [flat(module) for module in strategy.worker_modules()],
        "after": flat(model),
    }


class MetricsPerStep(pl.Callback):
    """What Lightning holds as logged after every optimizer step."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _monitors() -> list[pl.Callback]:
    from lightning_decentral.callbacks import ConsensusControl, ConsensusDistance, EffectiveLearningRate

    control = ConsensusControl(target=0.02, reference="parameters", every_n_steps=3, max_gossip_steps=4)
    return [control, ConsensusDistance(every_n_steps=1, per_layer=True), EffectiveLearningRate(every_n_steps=2)]


def fit_processes_monitored(rank: int, world_size: int, config: Config, dropout: float) -> dict[str, Any]:
    """``config`` on gloo processes with every monitor attached: the logged values after each step."""
    model = LoggingRegression(dropout, seed=init_seed(rank), **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    recorder = MetricsPerStep()
    trainer = _trainer(
        DecentralizedStrategy(**config.strategy_kwargs()), config, world_size, callbacks=[*_monitors(), recorder]
    )
    trainer.fit(model, train_dataloaders=shared_loader(config, world_size))
    return {"metrics": recorder.metrics, "state": _state(model)}


def fit_simulated_monitored(config: Config, workers: int, dropout: float, vectorize: bool = False) -> dict[str, Any]:
    model = LoggingRegression(dropout, seed=init_seed(0), **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    recorder = MetricsPerStep()
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    trainer = _trainer(strategy, config, 1, callbacks=[*_monitors(), recorder])
    trainer.fit(model, train_dataloaders=shared_loader(config, workers))
    return {"metrics": recorder.metrics, "states": [_state(module) for module in strategy.worker_modules()]}


RESUME = Config("resume", optimizer={"lr": 0.05, "momentum": 0.9}, steps=4)


def _resume_trainer(strategy: Any, devices: int, epochs: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _resume_model(rank: int, dropout: float = 0.2) -> LoggingRegression:
    model = LoggingRegression(dropout, seed=init_seed(rank), **RESUME.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    return model


def resume_processes(
    rank: int, world_size: int, save: str = "", load: str = "", **strategy_kwargs: Any
) -> torch.Tensor:
    """On processes: fit 1 epoch and save to ``save``, or resume from ``load`` to epoch 2, or (neither) fit 2
    epochs straight; this rank's final state."""
    model = _resume_model(rank)
    strategy = DecentralizedStrategy(**{**RESUME.strategy_kwargs(), **strategy_kwargs})
    trainer = _resume_trainer(strategy, world_size, 1 if save else 2)
    trainer.fit(model, train_dataloaders=shared_loader(RESUME, world_size), ckpt_path=load or None)
    if save:
        trainer.save_checkpoint(save)
    return _state(model)


def resume_simulated(
    workers: int, save: str = "", load: str = "", vectorize: bool = False, dropout: float = 0.2, **strategy_kwargs: Any
) -> list[torch.Tensor]:
    """The same in the simulation: every worker's final state."""
    model = _resume_model(0, dropout)
    strategy = SimulatedDecentralizedStrategy(
        workers=workers, vectorize=vectorize, **{**RESUME.strategy_kwargs(), **strategy_kwargs}
    )
    trainer = _resume_trainer(strategy, 1, 1 if save else 2)
    trainer.fit(model, train_dataloaders=shared_loader(RESUME, workers), ckpt_path=load or None)
    if save:
        trainer.save_checkpoint(save)
    return [_state(module) for module in strategy.worker_modules()]


class NeedsAName(torch.optim.SGD):
    """An optimizer whose constructor takes an argument its ``defaults`` do not hold."""

    def __init__(self, params: Any, name: str, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.name = name


class SubclassedSGD(torch.optim.SGD):
    """SGD under another class: not known to be elementwise."""


def fit_with_optimizer(
    optimizer_class: type, workers: int, vectorize: Any = False, dropout: float = 0.0, **kwargs: Any
) -> list[torch.Tensor]:
    """A few steps with ``optimizer_class(params, **kwargs)``: every worker's final state."""

    class WithOptimizer(LoggingRegression):
        def configure_optimizers(self) -> Any:
            return optimizer_class(self.parameters(), **kwargs)

    config = Config("optimizer", optimizer={"lr": 0.1})
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize)
    model = WithOptimizer(dropout, seed=init_seed(0))
    pl.seed_everything(SEED, verbose=False)
    _trainer(strategy, config, 1).fit(model, train_dataloaders=shared_loader(config, workers))
    return [_state(module) for module in strategy.worker_modules()]


class PoisonWorker(pl.Callback):
    """After the optimizer step that reaches ``global_step == at``, a NaN in worker ``worker``'s replica."""

    def __init__(self, worker: int, at: int) -> None:
        self.worker, self.at = worker, at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                next(trainer.strategy.worker_modules()[self.worker].parameters()).view(-1)[0] = float("nan")


def fit_simulated_into_nan(directory: str, workers: int, vectorize: bool) -> None:
    """Checkpoints every 2 steps (``last.ckpt`` only); worker 2 turns NaN at step 6, before the save of step 6."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    config = Config("nan", optimizer={"lr": 0.05, "momentum": 0.9}, steps=8)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize)
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=0, save_last=True)
    trainer = _trainer(strategy, config, 1, callbacks=[PoisonWorker(2, 6), checkpoints], enable_checkpointing=True)
    trainer.fit(
        LoggingRegression(seed=init_seed(0), **config.optimizer_spec()),
        train_dataloaders=shared_loader(config, workers),
    )


class WithTemperature(LoggingRegression):
    """A learnable 0-dim temperature scales the output: a parameter whose every optimizer state entry is 0-dim too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.temperature


def resume_with_temperature(workers: int, save: str = "", load: str = "", vectorize: bool = True) -> list[torch.Tensor]:
    """``resume_simulated`` of a module with a 0-dim parameter, under Adam (its ``step`` is a 0-dim tensor as well)."""
    config = Config("temperature", optimizer={"name": "adam", "lr": 0.01}, steps=4)
    model = WithTemperature(seed=init_seed(0), **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    trainer = _resume_trainer(strategy, 1, 1 if save else 2)
    trainer.fit(model, train_dataloaders=shared_loader(config, workers), ckpt_path=load or None)
    if save:
        trainer.save_checkpoint(save)
    return [_state(module) for module in strategy.worker_modules()]


class ReadsItsLoss(LoggingRegression):
    """Keeps its last loss as a Python float (`.item()`): a training_step that cannot run under torch.vmap."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()
        return loss


class Jittered(TensorDataset):
    """Each sample's features plus a little noise: a random transform, drawn from torch's generator when loaded."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + 0.01 * torch.randn_like(x), y


class DrawsAtRandom(LoggingRegression):
    """Draws from torch's generator when an epoch starts, from Python's and then torch's in every training_step (noise
    on its inputs: random numbers, which stop a trial under torch.vmap), and counts its training steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shift, self.steps_seen = 0.0, 0

    def on_train_epoch_start(self) -> None:
        self.shift = 0.01 * float(torch.rand(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen += 1
        x, y = batch
        x = x * (1 + 0.01 * random.random()) + self.shift + 0.1 * torch.randn_like(x)
        return super().training_step((x, y), batch_idx)


class BiasFreeBatchNorm(LoggingRegression):
    """Linear without bias, then BatchNorm (as a conv without bias before BatchNorm in a ResNet): under bf16-mixed the
    BatchNorm sees bf16 activations with float32 running statistics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        torch.manual_seed(kwargs["seed"])
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN, bias=False), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


class ChecksItsRangeUnderAutocast(LoggingRegression):
    """Under autocast only, keeps its largest output as a Python float (`.item()`): a training_step that runs under
    torch.vmap in full precision, not in the run's bf16-mixed."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            self.largest = self(batch[0]).abs().max().item()
        return super().training_step(batch, batch_idx)


class FreezesBatchNorm(LoggingRegression):
    """Puts its BatchNorm in eval mode (running statistics frozen) at every training batch from step 2 on, and halves
    its learning rate from step 3 on in its own `optimizer_step`: hooks each replica runs on its own."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step >= 2:
            self.net[1].eval()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.global_step == 3:
            for group in optimizer.param_groups:
                group["lr"] /= 2
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


def fit_processes_with_hooks(rank: int, world_size: int, config: Config) -> torch.Tensor:
    """``config`` on gloo processes with `FreezesBatchNorm`: this rank's final state."""
    model = FreezesBatchNorm(seed=init_seed(rank), batch_norm=True, **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    _trainer(DecentralizedStrategy(**config.strategy_kwargs()), config, world_size).fit(
        model, shared_loader(config, world_size)
    )
    return _state(model)


def fit_simulated_with_hooks(config: Config, workers: int, vectorize: Any) -> list[torch.Tensor]:
    """The same in the simulation: every worker's final state."""
    model = FreezesBatchNorm(seed=init_seed(0), batch_norm=True, **config.optimizer_spec())
    pl.seed_everything(SEED, verbose=False)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    _trainer(strategy, config, 1).fit(model, train_dataloaders=shared_loader(config, workers))
    return [_state(module) for module in strategy.worker_modules()]


class CosineOverTheRun(LoggingRegression):
    """Its learning rate follows a cosine over the run's steps, which `configure_optimizers` reads from
    `trainer.estimated_stepping_batches` (under `max_epochs`, Lightning loads the training data to count them)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_cosine_for_an_epoch(config: Config, workers: int, vectorize: Any) -> list[torch.Tensor]:
    """`CosineOverTheRun` for one epoch (`max_epochs=1`) of ``config``'s data: every worker's final state."""
    model = CosineOverTheRun(seed=init_seed(0))
    pl.seed_everything(SEED, verbose=False)
    strategy = SimulatedDecentralizedStrategy(workers=workers, vectorize=vectorize, **config.strategy_kwargs())
    trainer = _trainer(strategy, config, 1, max_epochs=1)  # and max_steps=config.steps: the data has as many
    trainer.fit(model, train_dataloaders=shared_loader(config, workers))
    return [_state(module) for module in strategy.worker_modules()]
