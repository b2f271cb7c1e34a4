"""Spawned workers of tests/test_survivors.py: ranks that die, and the ones that go on."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_decentral import DecentralizedStrategy
from lightning_decentral import checkpoint as shards
from lightning_decentral.callbacks import FaultPlan
from tests.models import Regression, flat, init_seed, loader
from tests.workers import trainer_for

BATCH = 8
EPOCH = 10  # batches per epoch: a checkpoint every multiple of it resumes at an epoch boundary, exactly
MOMENTUM_SGD = {"lr": 0.05, "momentum": 0.9}


DIES_IN = ("batch", "validation", "shard write", "file_exists", "save agreement", "take over")
"""Where a rank of `deaths` dies at its step: when the step starts; in the validation after it (`validation_step`);
inside the write of its shard of the save after it; in `ModelCheckpoint.file_exists` (the broadcast that starts
that save); or right after it, so that the others wait for it in the agreement that every rank is in the save
(`Activities.agree`); or, a rank that rejoins, once admitted, when it would take a member's state over (at any step)."""


def _die(stamps: str, rank: int) -> None:
    """`SIGKILL` to this process, after stamping the time in `stamps/killed-<rank>`."""
    Path(stamps, f"killed-{rank}").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


class Mortal(Regression):
    """The ranks of `deaths` ({first rank: step}) kill themselves (`SIGKILL`) at that step, where `dies_in` says
    (`DIES_IN`; the strategy and the checkpoint callback die in the others), after stamping the time in
    `stamps/killed-<rank>`; those of `stops` stop (`SIGSTOP`: alive and silent) after stamping their pid in
    `stamps/stopped-<rank>`. With `stops` or `hold_at`, the survivors of a failure touch `stamps/decided`; at the start
    of step `hold_at` every rank waits (at most a minute) for `stamps/released`, and so at the end of step
    `hold_after`, after stamping `stamps/held-<rank>` with its pid. Every rank records its replica when each step of
    `record` starts, and when each step ends the time (`finished[step]`)."""

    def __init__(
        self,
        deaths: dict[int, int],
        stamps: str,
        record: tuple[int, ...] = (),
        stops: dict[int, int] | None = None,
        hold_at: int = -1,
        hold_after: int = -1,
        dies_in: str = "batch",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.deaths, self.stamps, self.record, self.stops, self.hold_at = deaths, stamps, record, stops or {}, hold_at
        self.hold_after, self.dies_in = hold_after, dies_in
        self.recorded: dict[int, torch.Tensor] = {}
        self.finished: dict[int, float] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        rank = self.trainer.strategy.first_rank
        if self.dies_in == "batch" and self.deaths.get(rank) == self.global_step:
            _die(self.stamps, rank)
        if self.stops.get(rank) == self.global_step:
            Path(self.stamps, f"stopped-{rank}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if (self.stops or self.hold_at >= 0) and self.trainer.strategy.failures_survived:
            Path(self.stamps, "decided").touch()
        if self.global_step == self.hold_at:
            self._wait_for_release()

    def _wait_for_release(self) -> None:
        deadline = time.monotonic() + 60
        while not Path(self.stamps, "released").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def on_train_end(self) -> None:
        """With stopped ranks: wait (at most a minute) until each has woken up and stopped, while the store lives."""
        deadline = time.monotonic() + 60
        while not all(Path(self.stamps, f"done-{r}").exists() for r in self.stops) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.global_step in self.record:
            self.recorded[self.global_step] = flat(self).clone()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.finished[self.global_step - 1] = time.time()
        if self.global_step - 1 == self.hold_after:
            Path(self.stamps, f"held-{self.trainer.strategy.first_rank}").write_text(str(os.getpid()))
            self._wait_for_release()

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rank = self.trainer.strategy.first_rank
        if self.dies_in == "validation" and self.deaths.get(rank) == self.global_step:
            _die(self.stamps, rank)
        return super().validation_step(batch, batch_idx)


class MortalCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose ranks of `deaths` die in the first `file_exists` (the broadcast that starts a save) of
    their step, with `dies_in="file_exists"`, or right after it (`"save agreement"`)."""

    def __init__(self, deaths: dict[int, int], stamps: str, dies_in: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deaths, self.stamps, self.dies_in = deaths, stamps, dies_in

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        self._dies(trainer, "file_exists")
        exists = super().file_exists(filepath, trainer)
        self._dies(trainer, "save agreement")
        return exists

    def _dies(self, trainer: Any, where: str) -> None:
        rank = trainer.strategy.first_rank
        if self.dies_in == where and self.deaths.get(rank) == trainer.global_step:
            _die(self.stamps, rank)


def _mortal_shard_writes(rank: int, step: int | None, stamps: str) -> Any:
    """A patch of `write_shard` in which this rank dies when it writes its shard of a save at `step`."""
    original = shards.write_shard

    def write_shard(shard: dict[str, Any], path: str) -> None:
        if shard["strategy"]["step"] == step:
            _die(stamps, rank)
        original(shard, path)

    return mock.patch.object(shards, "write_shard", write_shard)


def _mortal_take_over(rank: int, stamps: str) -> Any:
    """A patch of the rejoining rank's `take_over` in which it dies instead: admitted, before it receives the state."""
    from lightning_decentral.trainer import rejoin

    return mock.patch.object(rejoin, "take_over", lambda source: _die(stamps, rank))


def survive(
    rank: int,
    world_size: int,
    root: str,
    deaths: dict[int, int],
    steps: int,
    save_at: int = 0,
    record: tuple[int, ...] = (),
    topology: Any = "ring",
    timeout: float = 30.0,
    stops: dict[int, int] | None = None,
    validate: bool = False,
    hold_at: int = -1,
    top_k: int = -1,
    hold_after: int = -1,
    dies_in: str = "batch",
    lr: float = MOMENTUM_SGD["lr"],
    fault_plan: dict[int, list[int]] | None = None,
    save_last: bool = False,
    **strategy: Any,
) -> dict[str, Any]:
    """`steps` steps of momentum SGD (learning rate `lr`) with `on_peer_failure="continue"`; the ranks of `deaths`
    ({rank: step}) die there (where `dies_in` says: `DIES_IN`), those of `stops` stop there; every rank waits for
    `root/released` at the start of step `hold_at`, or at the end of step `hold_after` (see `Mortal`). A checkpoint
    every `save_at` steps (0: none), the best `top_k` kept (-1: all), and `last.ckpt` with `save_last`; with
    `validate`, a validation at the end of each epoch (`val_loss` logged with `sync_dist=True`).
    Each survivor's final replica, recorded replicas, step end times, the decisions, the last `val_loss` (NaN without
    `validate`), the checkpoint callback's `best_model_path`, and what the fit logged and warned. With `fault_plan`, a
    [`FaultPlan`][lightning_decentral.callbacks.FaultPlan] of it kills ranks too."""
    assert dies_in in DIES_IN, dies_in
    optimizer = {**MOMENTUM_SGD, "lr": lr}
    model = Mortal(deaths, root, record, stops, hold_at, hold_after, dies_in, seed=init_seed(rank), **optimizer)
    checkpoints = MortalCheckpoint(
        deaths, root, dies_in, dirpath=root, every_n_train_steps=save_at, save_top_k=top_k, save_last=save_last
    )
    callbacks: list[Any] = [checkpoints] if save_at else []
    callbacks += [FaultPlan(kill=fault_plan)] if fault_plan else []
    strategy_ = DecentralizedStrategy(
        topology=topology, on_peer_failure="continue", timeout=timedelta(seconds=timeout), **strategy
    )
    trainer = trainer_for(
        world_size, strategy_, max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(save_at)
    )
    dying = contextlib.nullcontext()
    if dies_in == "shard write":
        dying = _mortal_shard_writes(rank, deaths.get(rank), root)
    elif dies_in == "take over":
        dying = _mortal_take_over(rank, root)
    with dying, _LoggedLines() as logged, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(model, loader(rank, EPOCH * BATCH, BATCH), loader(rank, 2 * BATCH, BATCH) if validate else None)
    return {
        "logged": logged.lines,
        "warnings": [str(w.message) for w in warned],
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("survivors/")},
        "replica": flat(model),
        "recorded": model.recorded,
        "finished": model.finished,
        "decisions": [d.__dict__ for d in strategy_.failures_survived],
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "batches_ready": trainer.fit_loop.epoch_loop.batch_progress.total.ready,
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "best_model_path": checkpoints.best_model_path if save_at else "",
    }


class _LoggedLines(logging.Handler):
    """Inside its `with`: the lines the package logs (`logging.getLogger("lightning_decentral")`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> _LoggedLines:
        logging.getLogger("lightning_decentral").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("lightning_decentral").removeHandler(self)


def survive_or_error(rank: int, world_size: int, **kwargs: Any) -> Any:
    """`survive(...)`, or the error it stopped with (type and message; then `root/done-<rank>` is touched)."""
    try:
        return survive(rank, world_size, **kwargs)
    except RuntimeError as error:
        Path(kwargs["root"], f"done-{rank}").touch()
        return f"{type(error).__name__}: {error}"


def survive_or_traceback(rank: int, world_size: int, **kwargs: Any) -> Any:
    """`survive(...)`, or what Python prints for the error it stopped with (its traceback, causes and context)."""
    try:
        return survive(rank, world_size, **kwargs)
    except RuntimeError as error:
        return "".join(traceback.format_exception(error))


def resume(
    rank: int, world_size: int, checkpoint: str, data_of: list[int], steps: int, topology: Any = "ring"
) -> torch.Tensor:
    """Resume `checkpoint` on `world_size` plain processes, rank `i` on the data of rank `data_of[i]` of the run that
    saved it; train to `steps`; this rank's replica."""
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    trainer = trainer_for(world_size, DecentralizedStrategy(topology=topology), max_steps=steps)
    trainer.fit(model, loader(data_of[rank], EPOCH * BATCH, BATCH), ckpt_path=checkpoint)
    return flat(model)


def fabric_survive(
    rank: int, world_size: int, root: str, deaths: dict[int, int], steps: int, save_at: int
) -> dict[str, Any]:
    """A Fabric loop of `steps` steps with `on_peer_failure="continue"`; the ranks of `deaths` die at their step; every
    survivor saves at `save_at` (`fabric.save`). Each survivor's final replica and the decisions."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy
    from tests.models import initial_net

    strategy = FabricStrategy(on_peer_failure="continue", timeout=timedelta(seconds=30))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    model, optimizer = fabric.setup(*_net_and_optimizer(initial_net(init_seed(rank))))
    x, y = loader(rank, EPOCH * BATCH, BATCH).dataset.tensors
    for k in range(steps):
        if deaths.get(strategy.first_rank) == k:
            os.kill(os.getpid(), signal.SIGKILL)
        if k == save_at:
            fabric.save(f"{root}/step={k}.ckpt", {"model": model, "optimizer": optimizer})
        rows = slice((k % EPOCH) * BATCH, (k % EPOCH + 1) * BATCH)
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
    strategy.teardown()
    return {
        "replica": flat(model),
        "decisions": [d.__dict__ for d in strategy.failures_survived],
        "rank": fabric.global_rank,
    }


def fabric_resume(
    rank: int, world_size: int, checkpoint: str, data_of: list[int], start: int, steps: int
) -> torch.Tensor:
    """`fabric.load` of `checkpoint` on `world_size` plain processes (rank `i` on the data of `data_of[i]`), then the
    same loop from step `start` to `steps`; this rank's replica."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy
    from tests.models import initial_net

    strategy = FabricStrategy()
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    model, optimizer = fabric.setup(*_net_and_optimizer(initial_net(init_seed(rank))))
    fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    x, y = loader(data_of[rank], EPOCH * BATCH, BATCH).dataset.tensors
    for k in range(start, steps):
        rows = slice((k % EPOCH) * BATCH, (k % EPOCH + 1) * BATCH)
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
    strategy.teardown()
    return flat(model)


def _net_and_optimizer(net: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return net, torch.optim.SGD(net.parameters(), **MOMENTUM_SGD)


def simulate(workers: int, deaths: dict[int, int], steps: int, topology: Any, **strategy: Any) -> list[torch.Tensor]:
    """The run of `survive` in one process: `SimulatedDecentralizedStrategy(failures=..., **strategy)`, worker `i` on
    rank `i`'s data; every survivor's final replica."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_decentral import SimulatedDecentralizedStrategy
    from tests.models import rank_data
    from tests.simulation_workers import InOrder

    parts = [rank_data(i, EPOCH * BATCH) for i in range(workers)]  # worker i takes samples i, i + n, ... in order
    interleaved = TensorDataset(*[torch.stack([p[j] for p in parts], dim=1).flatten(0, 1) for j in (0, 1)])
    failures: dict[int, list[int]] = {}
    for rank, step in deaths.items():
        failures.setdefault(step, []).append(rank)
    simulated = SimulatedDecentralizedStrategy(workers=workers, topology=topology, failures=failures, **strategy)
    trainer = Trainer(
        strategy=simulated,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = DataLoader(interleaved, batch_size=BATCH, sampler=InOrder(interleaved))  # the simulation shuffles otherwise
    trainer.fit(Regression(seed=init_seed(0), **MOMENTUM_SGD), data)
    return [flat(module) for module in simulated.worker_modules()]


class Signalled(Mortal):
    """`Mortal`, and the rank `slow` (a first rank) sleeps `pause` seconds in each training step (its neighbours wait
    for it: the farther a rank, the farther ahead it may run) and sends itself `SIGTERM` when step `signal_at`
    starts."""

    def __init__(self, slow: int, pause: float, signal_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow, self.pause, self.signal_at = slow, pause, signal_at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.trainer.strategy.first_rank == self.slow and self.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.strategy.first_rank == self.slow:
            time.sleep(self.pause)
        return super().training_step(batch, batch_idx)


def stop_after_failure(
    rank: int, world_size: int, root: str, deaths: dict[int, int], topology: Any, slow: int, signal_at: int, steps: int
) -> dict[str, Any]:
    """`on_peer_failure="continue"` on `topology`: the ranks of `deaths` die when their step starts; later the slow
    rank `slow` is sent `SIGTERM` at step `signal_at` (see `Signalled`). What stopped this rank, where, and the
    decisions."""
    model = Signalled(slow, 0.15, signal_at, deaths=deaths, stamps=root, seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(topology=topology, on_peer_failure="continue", timeout=timedelta(seconds=10))
    trainer = trainer_for(world_size, strategy, max_steps=steps)
    try:
        trainer.fit(model, loader(rank, EPOCH * BATCH, BATCH))
        stopped = "no error"
    except BaseException as error:  # SIGTERMException is a SystemExit
        stopped = f"{type(error).__name__}: {error}"
    return {
        "stopped": stopped,
        "global_step": trainer.global_step,
        "decisions": [d.__dict__ for d in strategy.failures_survived],
    }
