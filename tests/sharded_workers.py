"""Functions the test processes of sharded replicas run: the same runs with replicas of `s` ranks (FSDP2 inside) and
with unsharded workers whose batch is the union of a replica's `s` batches."""

from __future__ import annotations

import functools
import os
import signal
from datetime import timedelta
from typing import Any

import networkx as nx
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.callbacks import EffectiveLearningRate
from lightning_decentral.compression import Sign
from lightning_decentral.measures import consensus_distance
from tests.workers import trainer_for

IN, HIDDEN, OUT, BATCH = 4, 8, 8, 2  # every dimension 0 a multiple of the shard sizes tested


class Blocks(Dataset):
    """Rank `rank`'s batches: batch `b` is block `(rank, b)` of `BATCH` samples; with `union` ranks `rank·union …
    rank·union + union − 1`'s blocks concatenated (the batch of an unsharded worker standing for a replica)."""

    def __init__(self, rank: int, steps: int, union: int = 1) -> None:
        self.rank, self.steps, self.union = rank, steps, union

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(block(self.rank * self.union + shard, b) for shard in range(self.union)))
        return torch.cat(xs), torch.cat(ys)


def block(rank: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + b)
    x = torch.randn(BATCH, IN, generator=generator)
    return x, torch.sin(x @ torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)) + 0.3 * (rank % 3)


def loader(rank: int, steps: int, union: int = 1) -> DataLoader:
    return DataLoader(Blocks(rank, steps, union), batch_size=None)


class Tiny(LightningModule):
    """A two-layer MLP; `shard="layers"` shards each layer and the root in `configure_model` (the documented way),
    `"none"` leaves sharding to the strategy, `"own_mesh"` shards on a mesh of its own."""

    def __init__(self, shard: str = "layers", optimizer: str = "momentum") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        self.shard, self.optimizer = shard, optimizer
        self.validation_losses: list[float] = []

    def configure_model(self) -> None:  # runs in every Trainer run: idempotent, as Lightning asks
        if isinstance(self.net, FSDPModule):
            return
        if self.device_mesh is not None and self.shard == "layers":
            fully_shard(self.net[0], mesh=self.device_mesh["shard"])
            fully_shard(self.net, mesh=self.device_mesh["shard"])
        if self.shard == "own_mesh":  # a mesh of its own: refused
            fully_shard(self.net, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.validation_losses.append(nn.functional.mse_loss(self.net(x), y).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


CONFIGS: dict[str, dict[str, Any]] = {
    "awc": dict(topology="ring"),
    "awc_root": dict(topology="ring"),  # the module left unsharded: the strategy shards its submodules
    "decentlam": dict(topology="ring", momentum="decentlam"),
    "outer": dict(
        topology="complete",
        gossip_every=3,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    ),
    # sign's scale is per block of a rank's flat buffer: blocks of 4 elements hold the same elements sharded or not here
    # (every row of a weight and every shard of a parameter is a multiple of 4 long), so the runs are equal
    "sign": dict(topology="ring", compression=Sign(block=4)),
}


def full_parameters(module: nn.Module) -> torch.Tensor:
    """The module's trainable parameters, whole, flattened (a collective inside each replica when sharded)."""
    return torch.cat(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in module.parameters()]
    )


def fit_own_mesh(rank: int, world_size: int) -> None:
    trainer = trainer_for(world_size, DecentralizedStrategy(shard_size=2), max_steps=1)
    trainer.fit(Tiny(shard="own_mesh"), train_dataloaders=loader(rank, 1))


def fit_clipped(rank: int, world_size: int, algorithm: str) -> None:
    strategy = DecentralizedStrategy(shard_size=2, on_peer_failure="continue")
    trainer = trainer_for(world_size, strategy, max_steps=1, gradient_clip_val=1.0, gradient_clip_algorithm=algorithm)
    trainer.fit(Tiny(), train_dataloaders=loader(rank, 1))


def fit_configs(
    rank: int, world_size: int, shard_size: int, names: list[str], steps: int = 6, **kwargs: Any
) -> dict[str, Any]:
    """Fit the configs `names` of `CONFIGS`: with `shard_size > 1` on this rank's blocks, else on the union of the
    blocks of the replica this worker stands for (`union` ranks); return each run's whole parameters and what this rank
    holds."""
    union = kwargs.pop("union", 1)
    out: dict[str, Any] = {}
    for name in names:
        options = CONFIGS[name]
        model = Tiny(shard="none" if name == "awc_root" else "layers", **kwargs)
        strategy = DecentralizedStrategy(shard_size=shard_size, **options)
        trainer = trainer_for(world_size, strategy, max_steps=steps)
        trainer.fit(model, train_dataloaders=loader(rank, steps, union))
        optimizer_state = [
            t for state in trainer.optimizers[0].state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ]
        out[name] = {
            "parameters": full_parameters(model),
            "consensus": consensus_distance(strategy, per_layer=True),  # what ConsensusDistance logs
            "held": sum(b.numel() for b in strategy.flat_parameters),
            "optimizer_state_held": sum(
                (t.to_local() if isinstance(t, DTensor) else t).numel() for t in optimizer_state if t.dim() > 0
            ),
        }
    return out


EFFECTIVE = ("lr/effective", "lr/effective_ratio", "noise/decentralized")


class Logged(Callback):
    """The values `EffectiveLearningRate` logged, at each optimizer step."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.rows.append([float(trainer.callback_metrics[key]) for key in EFFECTIVE])


def fit_effective_lr(rank: int, world_size: int, shard_size: int, union: int = 1, steps: int = 4) -> dict[str, Any]:
    """AWC and DecentLaM with `EffectiveLearningRate` at every step, as `fit_configs` runs them: what it logged at each
    step and the whole parameters at the end."""
    out: dict[str, Any] = {}
    for name in ("awc", "decentlam"):
        model, logged = Tiny(), Logged()
        strategy = DecentralizedStrategy(shard_size=shard_size, **CONFIGS[name])
        callbacks = [EffectiveLearningRate(every_n_steps=1), logged]
        trainer = trainer_for(world_size, strategy, max_steps=steps, callbacks=callbacks)
        trainer.fit(model, train_dataloaders=loader(rank, steps, union))
        out[name] = {"logged": torch.tensor(logged.rows, dtype=torch.float64), "parameters": full_parameters(model)}
    return out


def average_over_replicas(vector: torch.Tensor, shard_size: int) -> torch.Tensor:
    """`x̄`: the mean of every replica's whole `vector` (each of a replica's ranks holds the same one)."""
    gathered = [torch.empty_like(vector) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, vector)
    return torch.stack(gathered[::shard_size]).mean(0)


class SeesValidation(Tiny):
    """Records the whole parameters each validation runs on."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_losses.append(full_parameters(self))


class AtStart(Callback):
    """Records this rank's replica and optimizer state when training starts."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.state = own_state(trainer, module)


def own_state(trainer: Any, module: Any) -> torch.Tensor:
    """This rank's replica and optimizer state, whole, flattened (a collective inside each replica)."""
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0]
    whole = [(t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1) for t in state]
    return torch.cat([full_parameters(module), *whole])


def checkpoint_and_resume(rank: int, world_size: int, path: str, shard_size: int = 2) -> dict[str, Any]:
    """Two epochs of 2 steps straight; one epoch, validated on `x̄` and saved, its file's `state_dict` loaded into a
    plain module; a resume from it to the end of the second epoch."""

    def fit(epochs: int, ckpt_path: str | None = None, callbacks: list | None = None) -> tuple[SeesValidation, Any]:
        model = SeesValidation()
        strategy = DecentralizedStrategy(shard_size=shard_size)
        trainer = trainer_for(world_size, strategy, max_epochs=epochs, callbacks=callbacks or [])
        trainer.fit(model, train_dataloaders=loader(rank, 2), ckpt_path=ckpt_path)
        return model, trainer

    straight, _ = fit(2)
    first, trainer = fit(1)
    x_bar = average_over_replicas(full_parameters(first), shard_size)
    trainer.validate(first, dataloaders=loader(rank, 1), verbose=False)
    saved = own_state(trainer, first)
    trainer.save_checkpoint(path)
    plain = Tiny(shard="none")
    plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"], strict=True)
    start = AtStart()
    resumed, _ = fit(2, ckpt_path=path, callbacks=[start])
    return {
        "validated_on": first.validation_losses[-1],
        "x_bar": x_bar,
        "own_after_validation": full_parameters(first),
        "file": torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
        "saved": saved,
        "resumed_from": start.state,
        "straight": full_parameters(straight),
        "resumed": full_parameters(resumed),
    }


def resume_with(rank: int, world_size: int, path: str, shard_size: int) -> None:
    trainer = trainer_for(world_size, DecentralizedStrategy(shard_size=shard_size), max_steps=4)
    trainer.fit(Tiny(), train_dataloaders=loader(rank, 4), ckpt_path=path)


class FailsOnRank(Tiny):
    """Raises in `training_step` at batch 2 on rank `bad`."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2 and self.global_rank == self.bad:
            raise ValueError(f"rank {self.bad} fails on purpose")
        return super().training_step(batch, batch_idx)


def fail_on_rank(rank: int, world_size: int, bad: int, timeout_s: float) -> None:
    from datetime import timedelta

    strategy = DecentralizedStrategy(shard_size=2, timeout=timedelta(seconds=timeout_s))
    trainer = trainer_for(world_size, strategy, max_steps=6)
    trainer.fit(FailsOnRank(bad), train_dataloaders=loader(rank, 6))


SURVIVAL_GRAPH = nx.Graph([(2, 0), (2, 1), (2, 3), (0, 1), (1, 3)])
"""Replica (or worker) 2 neighbours every other one: every survivor gives up the exchange of the step it dies at. The
survivors 0 - 1 - 3 form a path, whose Metropolis-Hastings weights keep their replicas apart."""


class DiesAt(Tiny):
    """Rank `dies` (of the start) kills itself (`SIGKILL`) when optimizer step `at` starts."""

    def __init__(self, dies: int, at: int) -> None:
        super().__init__()
        self.dies, self.at = dies, at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.strategy.first_rank == self.dies and self.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def survive(
    rank: int,
    world_size: int,
    shard_size: int,
    dies: int,
    at: int,
    steps: int,
    save_to: str,
    union: int = 1,
    combine: str = "atc",
) -> dict[str, Any] | str:
    """`combine` on `SURVIVAL_GRAPH` with `on_peer_failure="continue"`; rank `dies` is killed when step `at` starts; the
    survivors then measure the consensus distance and save a checkpoint to `save_to`. A survivor's whole parameters,
    decisions, world size, steps and consensus distance; a rank that stops, its error (type and message)."""
    strategy = DecentralizedStrategy(
        shard_size=shard_size,
        topology=SURVIVAL_GRAPH,
        combine=combine,
        on_peer_failure="continue",
        timeout=timedelta(seconds=30),
    )
    model = DiesAt(dies, at)
    trainer = trainer_for(world_size, strategy, max_steps=steps)
    try:
        trainer.fit(model, train_dataloaders=loader(rank, steps, union))
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    parameters = dict(model.named_parameters())
    whole = strategy.sharding.full_tensors(parameters) if strategy.sharding is not None else parameters
    consensus = consensus_distance(strategy)["distance"]
    trainer.save_checkpoint(save_to)
    return {
        "parameters": torch.cat([p.detach().reshape(-1) for p in whole.values()]),
        "decisions": [d.__dict__ for d in strategy.failures_survived],
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "consensus": consensus,
    }
