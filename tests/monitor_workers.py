"""Spawned workers for tests/test_monitors.py: fits with the monitors attached, and what each rank saw."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.callbacks import ConsensusControl, ConsensusDistance, EffectiveLearningRate
from tests.models import Regression, flat, init_seed, loader
from tests.workers import trainer_for

STEPS = 6
BATCH = 8


class TwoPart(Regression):
    """The regression MLP as two top-level submodules (``encoder``, ``decoder``), optionally with dropout."""

    def __init__(self, dropout: float = 0.0, batch_norm: bool = False, **kwargs: Any) -> None:
        super().__init__(batch_norm=batch_norm, **kwargs)
        layers = list(self.net)
        del self.net
        self.encoder = nn.Sequential(*layers[:-1], nn.Dropout(dropout))
        self.decoder = layers[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class Recorder(Callback):
    """Per optimizer step: the replica before (``x_i(k)``) and after everything, the batch, the logged values."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.batches: list[Any] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before.append(flat(pl_module))
        self.batches.append([t.clone() for t in batch])

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.after.append(flat(pl_module))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(
    rank: int,
    world_size: int,
    strategy: Any,
    callbacks: list[Callback],
    model: Regression | None = None,
    steps: int = STEPS,
    logger: Any = False,
    **trainer_kwargs: Any,
) -> tuple[Regression, Recorder, Trainer]:
    recorder = Recorder()
    model = model if model is not None else TwoPart(seed=init_seed(rank), lr=0.1)
    trainer_kwargs.setdefault("max_steps", steps)
    trainer = trainer_for(
        world_size, strategy, callbacks=[*callbacks, recorder], logger=logger, log_every_n_steps=1, **trainer_kwargs
    )
    trainer.fit(model, train_dataloaders=loader(rank, STEPS * BATCH, BATCH))
    return model, recorder, trainer


def _record(recorder: Recorder) -> dict[str, Any]:
    return {
        "before": recorder.before,
        "after": recorder.after,
        "batches": recorder.batches,
        "metrics": recorder.metrics,
    }


def _state(model: Regression, trainer: Trainer) -> torch.Tensor:
    (optimizer,) = trainer.optimizers
    momentum = [optimizer.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()]
    return torch.cat([flat(model)] + [b.double().reshape(-1) for b in model.buffers()] + momentum)


def monitors(rank: int, world_size: int, log_dir: str) -> dict[str, Any]:
    """Every scenario of tests/test_monitors.py in one process group."""
    out: dict[str, Any] = {}

    # Exact Ξ (per layer), the residual proxy and α_e, logged through a CSV logger.
    callbacks = [ConsensusDistance(every_n_steps=1, per_layer=True), EffectiveLearningRate(every_n_steps=2)]
    logger = CSVLogger(log_dir, name="ring", version=0)
    _, recorder, _ = _fit(rank, world_size, DecentralizedStrategy(), callbacks, logger=logger)
    out["ring"] = _record(recorder)

    # Bit-identical training with EffectiveLearningRate, with dropout and BatchNorm (AWC and DecentLaM).
    for momentum in ("local", "decentlam"):
        states = []
        for callbacks in ([], [EffectiveLearningRate(every_n_steps=1)]):
            model = TwoPart(dropout=0.3, batch_norm=True, seed=init_seed(rank), lr=0.05, momentum=0.9)
            torch.manual_seed(rank)  # dropout masks differ per rank, equal across the two runs
            _, _, trainer = _fit(rank, world_size, DecentralizedStrategy(momentum=momentum), callbacks, model)
            states.append(_state(model, trainer))
        out[f"identical-{momentum}"] = states

    # The control under the largest Ξ of plain ring gossip above (exact every step; AWC, ATC, DecentLaM).
    # ATC and DecentLaM (β = 0, the same rule) mix after the local step: their Ξ is about 1/3 of AWC's.
    largest = max(m["consensus/distance"] for m in out["ring"]["metrics"])
    out["targets"] = {"awc": 0.5 * largest, "atc": 0.15 * largest, "decentlam": 0.15 * largest}
    for name, kwargs in (("awc", {}), ("atc", {"combine": "atc"}), ("decentlam", {"momentum": "decentlam"})):
        control = [ConsensusControl(out["targets"][name]), ConsensusDistance(every_n_steps=1)]
        logger = CSVLogger(log_dir, name=f"control-{name}", version=0)
        _, recorder, _ = _fit(rank, world_size, DecentralizedStrategy(**kwargs), control, logger=logger)
        out[f"control-{name}"] = _record(recorder)

    # The proxy between exact measurements, a target relative to ‖x̄‖, control in epoch 0 only (no hand-over).
    relative = 0.9 * max(m["consensus/relative"] for m in out["ring"]["metrics"])
    control = [
        ConsensusDistance(every_n_steps=3),
        ConsensusControl(relative, "parameters", 4, 1, every_n_steps=3, handover_epochs=0),
    ]
    _, recorder, _ = _fit(rank, world_size, DecentralizedStrategy(), control, max_epochs=2, max_steps=-1)
    out["proxy"] = _record(recorder)
    out["relative_target"] = relative
    out["proxy_calibration"] = control[1].calibration

    # Plain DDP: the replicas are one model.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callbacks = [ConsensusDistance(every_n_steps=1), EffectiveLearningRate(every_n_steps=1), ConsensusControl(1.0)]
        _, recorder, _ = _fit(rank, world_size, "ddp", callbacks, steps=2)
    out["ddp"] = _record(recorder)
    out["ddp_warnings"] = [str(w.message) for w in caught if "ConsensusControl" in str(w.message)]
    return out


def one_worker_control_warnings(rank: int, world_size: int, strategy: str) -> list[str]:
    """Fit one step on ``devices=1`` with ``ConsensusControl``: its warnings. In a process of its own, since
    ``"dpsgd"`` initializes a process group (and binds its port) that would outlive a test in pytest's process."""
    import lightning_decentral  # noqa: F401  # registers "dpsgd"

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        callbacks=[ConsensusControl(target=1.0)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoPart(), train_dataloaders=loader(0, 8, 8))
    return [str(w.message) for w in caught if "ConsensusControl" in str(w.message)]
