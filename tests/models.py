"""Small models and deterministic per-rank data shared by the workers and the dense reference."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, HIDDEN, OUT = 5, 8, 3


def make_net(batch_norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(HIDDEN))
    layers += [nn.Tanh(), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers)


def init_seed(rank: int) -> int:
    """Each rank builds its module from a different seed: the strategy must broadcast rank 0's."""
    return 100 + rank


def initial_net(seed: int = 0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return make_net(batch_norm)


def rank_data(rank: int, samples: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples rank ``rank`` trains on, in order: different on every rank, same on every run."""
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(samples, IN, generator=generator, dtype=torch.float64)
    y = torch.sin(x @ torch.linspace(-1, 1, IN * OUT, dtype=torch.float64).reshape(IN, OUT)) + 0.3 * rank
    return x.to(dtype), y.to(dtype)


def make_optimizer(params: Any, name: str = "sgd", lr: float = 0.1, **kwargs: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kwargs)
    raise ValueError(name)


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str | None) -> Any | None:
    if kind is None:
        return None
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if kind == "warmup":  # linear warm-up from lr = 0
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 3))
    raise ValueError(kind)


class Regression(LightningModule):
    """An MLP regressing per-rank targets; records what the strategy shows it."""

    def __init__(
        self,
        seed: int = 0,
        batch_norm: bool = False,
        scheduler: str | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        """``optimizer_kwargs`` go to :func:`make_optimizer` (``name``, ``lr``, ...)."""
        super().__init__()
        self.net = initial_net(seed, batch_norm)
        self.optimizer_kwargs = optimizer_kwargs
        self.scheduler_kind = scheduler
        self.validation_params: list[torch.Tensor] = []
        self.train_start_params: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_validation_epoch_start(self) -> None:
        self.validation_params.append(flat(self).clone())

    def on_train_start(self) -> None:
        self.train_start_params = flat(self).clone()

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.parameters(), **self.optimizer_kwargs)
        scheduler = make_scheduler(optimizer, self.scheduler_kind)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BadLossOnRank(Regression):
    """Its loss is multiplied by ``factor`` (``nan`` or ``inf``) on ``bad_rank`` at step ``bad_step``."""

    def __init__(self, bad_rank: int, bad_step: int, factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step, self.factor = bad_rank, bad_step, factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            loss = loss * self.factor
        return loss


def flat(module: nn.Module) -> torch.Tensor:
    """All parameters of ``module`` in one vector (registration order)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()


def loader(rank: int, samples: int, batch_size: int, dtype: torch.dtype = torch.float32) -> DataLoader:
    return DataLoader(TensorDataset(*rank_data(rank, samples, dtype)), batch_size=batch_size, shuffle=False)


class RecordingRegression(Regression):
    """Saves each rank's final replica to ``record_dir/<rank>.pt`` (for launcher tests)."""

    def __init__(self, record_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def on_train_end(self) -> None:
        torch.save(flat(self), f"{self.record_dir}/{self.global_rank}.pt")
