"""What the three reproduction scripts share: the digits MLP, one training run per cell and seed (simulated, or on
gloo processes), the command line, the Markdown table of mean ± std over seeds, and the plots."""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy, DirichletSampler, SimulatedDecentralizedStrategy
from lightning_decentral.callbacks import ConsensusControl, ConsensusDistance, EffectiveLearningRate

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one line per cell, not Lightning's banners

DIVERGED = 0.15  # a final accuracy at or below this (10 classes) counts as a diverged run


@dataclass(frozen=True)
class Cell:
    """One configuration of an experiment (its table row is `label`).

    `method`: `"sync"` (the complete graph with adapt-then-combine: every replica takes the averaged update,
    synchronous momentum SGD), `"awc"`, `"atc"` (D-PSGD / DmSGD on `topology`) or `"decentlam"`.
    """

    label: str
    method: str = "awc"
    topology: str = "ring"
    workers: int = 16
    global_batch: int = 512
    lr: float = 0.1
    momentum: float = 0.9
    epochs: int = 30
    milestones: tuple[int, ...] = ()  # step decay ×0.1 at these epochs
    alpha: float | None = None  # Dirichlet label skew; None: IID
    control: dict[str, Any] | None = None  # ConsensusControl arguments
    monitor_every: int = 0  # log Ξ and α_e/γ every this many steps (0: not at all)
    shifted: bool = False  # train on the digits and their four one-pixel shifts (5 × 1,438 samples)

    def strategy_kwargs(self) -> dict[str, Any]:
        if self.method == "sync":
            return {"topology": "complete", "combine": "atc"}
        if self.method == "decentlam":
            return {"topology": self.topology, "momentum": "decentlam"}
        return {"topology": self.topology, "combine": self.method}


class DigitsMLP(pl.LightningModule):
    """The research set-up: scikit-learn's digits, an MLP 64-128-128-10, momentum SGD, optional step decay."""

    def __init__(
        self,
        lr: float,
        momentum: float,
        milestones: Sequence[int] = (),
        batch: int = 32,
        alpha: float | None = None,
        seed: int = 0,
        shifted: bool = False,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr, self.momentum, self.milestones = lr, momentum, list(milestones)
        self.batch, self.alpha, self.seed, self.shifted = batch, alpha, seed, shifted

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if not self.milestones:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.MultiStepLR(optimizer, self.milestones, gamma=0.1)]

    def train_dataloader(self) -> DataLoader:
        train, _ = digits(self.shifted)
        if self.alpha is None:
            return DataLoader(train, batch_size=self.batch, shuffle=True)
        sampler = DirichletSampler(train, train.tensors[1], self.alpha, seed=self.seed)
        return DataLoader(train, batch_size=self.batch, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(digits()[1], batch_size=512)


def digits(shifted: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 digits as 64 features in [0, 1]: a fixed 80/20 split (1,438 to train, 359 to validate);
    `shifted`: the training images also moved by one pixel up, down, left and right (zeros fill in), 7,190 to
    train, for batches larger than the 1,438."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x, dtype=torch.float32)[order] / 16.0, torch.tensor(y)[order]
    cut = len(y) - len(y) // 5
    train_x, train_y = x[:cut], y[:cut]
    if shifted:
        images = train_x.view(-1, 8, 8)
        moved = [torch.roll(images, step, dim) for dim in (1, 2) for step in (1, -1)]
        for image, (dim, step) in zip(moved, [(1, 1), (1, -1), (2, 1), (2, -1)]):
            edge = 0 if step == 1 else -1  # the row or column that wrapped around: blank it
            image.select(dim, edge).zero_()
        train_x = torch.cat([images, *moved]).view(-1, 64)
        train_y = train_y.repeat(5)
    return TensorDataset(train_x, train_y), TensorDataset(x[cut:], y[cut:])


class Series(pl.Callback):
    """The monitors' values after every optimizer step: `{name: [(step, value), ...]}`."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names, self.values = list(names), {name: [] for name in names}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for name in self.names:
            if name in trainer.callback_metrics:
                self.values[name].append((trainer.global_step, float(trainer.callback_metrics[name])))


def fit(cell: Cell, seed: int, processes: bool = False) -> dict[str, Any]:
    """Train `cell` from `seed`: the final accuracy of `x̄`, whether it diverged, and the monitors' series."""
    pl.seed_everything(seed, verbose=False)
    torch.set_num_threads(1)
    batch = cell.global_batch // cell.workers
    model = DigitsMLP(cell.lr, cell.momentum, cell.milestones, batch, cell.alpha, seed, cell.shifted)
    names = ["consensus/relative", "lr/effective_ratio", "consensus/gossip_steps"]
    series = Series(names)
    callbacks: list[pl.Callback] = [series]
    if cell.control is not None:
        callbacks.insert(0, ConsensusControl(**cell.control))
    if cell.monitor_every or cell.control is not None:
        every = cell.monitor_every or 1
        callbacks[-1:-1] = [ConsensusDistance(every_n_steps=every), EffectiveLearningRate(every_n_steps=every)]
    if processes:
        strategy: Any = DecentralizedStrategy(**cell.strategy_kwargs(), start_method="spawn")
        devices = cell.workers
    else:
        strategy, devices = (
            SimulatedDecentralizedStrategy(workers=cell.workers, vectorize=True, **cell.strategy_kwargs()),
            1,
        )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=cell.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=cell.epochs,
        callbacks=callbacks,
    )
    trainer.fit(model)
    accuracy = float(trainer.callback_metrics.get("val_acc", float("nan")))
    loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
    diverged = not math.isfinite(loss) or not accuracy > DIVERGED
    return {"accuracy": accuracy, "diverged": diverged, "series": series.values}


def mean_std(values: Sequence[float]) -> str:
    """`mean ± std` over seeds (std 0 for one seed)."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "—"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def parser(description: str, seeds: int, workers: int, epochs: int) -> argparse.ArgumentParser:
    """The flags every script takes, with its defaults."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, default=seeds, help="seeds per cell (mean ± std over them)")
    p.add_argument("--workers", type=int, default=workers, help="workers n (a script that sweeps n caps it here)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument(
        "--processes", action="store_true", help="the same cells on n gloo processes instead of the simulation"
    )
    p.add_argument("--smoke", action="store_true", help="a few seconds: 1 seed, 1 epoch, 4 workers, a reduced grid")
    p.add_argument("--out", type=Path, default=Path("reproduce_out"), help="where the table and the plots go")
    return p


def settings(args: argparse.Namespace) -> argparse.Namespace:
    """`--smoke` shrinks everything."""
    if args.smoke:
        args.seeds, args.workers, args.epochs = 1, 4, 1
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def run_cells(cells: Sequence[Cell], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every cell over `args.seeds` seeds (0, 1, ...): `{label: [result per seed]}`."""
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for cell in cells:
        results[cell.label] = [fit(cell, seed, args.processes) for seed in range(args.seeds)]
        accuracies = [r["accuracy"] for r in results[cell.label]]
        print(
            f"[{time.perf_counter() - started:7.1f} s] {cell.label}: accuracy of x̄ {mean_std(accuracies)}", flush=True
        )
    return results


def accuracy_row(label: str, results: list[dict[str, Any]]) -> list[str]:
    """`label`, accuracy mean ± std, the fraction of seeds that diverged."""
    diverged = sum(r["diverged"] for r in results)
    return [label, mean_std([r["accuracy"] for r in results]), f"{diverged}/{len(results)}"]


def write(args: argparse.Namespace, name: str, text: str) -> None:
    """Print `text` and save it as `args.out / name`."""
    print(text)
    (args.out / name).write_text(text + "\n")


def plot(
    args: argparse.Namespace, name: str, curves: dict[str, list[tuple[int, float]]], ylabel: str, **options: Any
) -> Path | None:
    """`draw(curves, ylabel, **options)` into `args.out / name`; `None` (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no matplotlib: {name} not drawn; pip install 'lightning-decentral[plot]')")
        return None
    figure = draw(curves, ylabel, **options)
    path = args.out / name
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def draw(
    curves: dict[str, list[tuple[int, float]]],
    ylabel: str,
    log: bool = False,
    xlabel: str = "optimizer step",
    ylim: tuple[float, float] | None = None,
    markers: bool = False,
    levels: dict[str, float] | None = None,
) -> Any:
    """A matplotlib figure with one line per curve (`markers`: a dot at each point, so that a curve of one point
    shows) and a dashed horizontal line per entry of `levels` (label: value)."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, points in curves.items():
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], label=label, marker="o" if markers else None)
    for label, value in (levels or {}).items():
        axes.axhline(value, color="black", linestyle="--", linewidth=1, label=label)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if log:
        axes.set_yscale("log")
    if ylim is not None:
        axes.set_ylim(*ylim)
    axes.legend(fontsize=7)
    return figure


def median_series(results: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """A monitor's series as the median over seeds, step by step (the steps every seed logged): a seed whose run
    blows up (α_e/γ of ±10⁶ as its steps vanish) does not drown the others."""
    per_seed = [dict(r["series"].get(name, [])) for r in results]
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    return [(k, statistics.median(s[k] for s in per_seed)) for k in steps]


def part_mean(points: list[tuple[int, float]], first: bool, fraction: float = 0.2) -> float:
    """The mean of the first (or last) `fraction` of a series' values, at least one (nan if empty)."""
    values = [v for _, v in points if math.isfinite(v)]
    if not values:
        return float("nan")
    count = max(1, int(len(values) * fraction))
    return statistics.mean(values[:count] if first else values[-count:])
