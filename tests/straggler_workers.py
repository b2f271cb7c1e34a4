"""What the gloo processes of the straggler tests run: stragglers, the steps mixed, checkpoints, failures, SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.callbacks import ConsensusDistance
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver
from tests.models import Regression, flat, init_seed, loader
from tests.reference import Config
from tests.workers import trainer_for


class Straggler(Regression):
    """Sleeps `pause` seconds in the training steps `k` with `(k + rank) % every == 0`: ranks fall behind in turn."""

    def __init__(self, pause: float = 0.03, every: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pause, self.every = pause, every

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if (self.global_step + self.global_rank) % self.every == 0:
            time.sleep(self.pause)
        return super().training_step(batch, batch_idx)


class StepsMixed(Callback, ExchangeObserver):
    """`{k: {j: τ_ij(k)}}`: the step of each neighbour this rank mixed at step `k` (`ExchangeEvent.neighbour_steps`)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[int, int]] = {}

    def on_fit_start(self, trainer: Trainer, *args: Any) -> None:
        trainer.strategy.observe(self)

    def on_wait(self, event: ExchangeEvent) -> None:
        assert event.neighbour_steps is not None
        self.steps[event.step] = dict(event.neighbour_steps)


def fit_newest(rank: int, world_size: int, configs: list[Config]) -> dict[str, Any]:
    """Each config with stragglers and the newest rule: this rank's parameters and the steps it mixed."""
    out = {}
    for config in configs:
        model = Straggler(seed=init_seed(rank), batch_norm=config.batch_norm, **config.optimizer_spec())
        mixed = StepsMixed()
        strategy = DecentralizedStrategy(**config.strategy_kwargs())
        trainer = trainer_for(world_size, strategy, max_steps=config.steps, callbacks=[mixed])
        trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size))
        buffers = [b.reshape(-1) for b in model.buffers() if b.is_floating_point()]
        out[config.name] = {"state": torch.cat([flat(model), *buffers]), "mixed": mixed.steps}
    return out


class Recorder(Callback):
    """The global step and the parameters of every validation (after the strategy swapped in `x̄`), and the
    consensus distance `ConsensusDistance` logged at the end of every `every`-th step."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.validated: list[tuple[int, torch.Tensor]] = []
        self.distances: list[tuple[int, float]] = []

    def on_validation_epoch_start(self, trainer: Trainer, module: Any) -> None:
        self.validated.append((trainer.global_step, flat(module)))

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.distances.append((trainer.global_step, float(trainer.callback_metrics["consensus/distance"])))


def checkpoint_and_resume(rank: int, world_size: int, config: Config, root: str) -> dict[str, Any]:
    """Stragglers: epochs of `config.epoch_steps` steps, each ending with the consensus distance, a validation on `x̄`
    and a checkpoint (ranks reach them at different times); then a resume from the first checkpoint to
    `config.steps`."""
    epoch = config.epoch_steps
    assert epoch is not None
    data = loader(rank, config.samples, config.batch_size)
    validation = loader(world_size + rank, 8, 8)
    model = Straggler(seed=init_seed(rank), **config.optimizer_spec())
    recorder = Recorder(epoch)
    saves = ModelCheckpoint(dirpath=root, every_n_train_steps=epoch, save_top_k=-1, filename="{step}")
    trainer = trainer_for(
        world_size,
        DecentralizedStrategy(**config.strategy_kwargs()),
        max_steps=2 * epoch,
        log_every_n_steps=epoch,
        callbacks=[ConsensusDistance(every_n_steps=epoch), recorder, saves],
        enable_checkpointing=True,
        limit_val_batches=1,
    )
    trainer.fit(model, train_dataloaders=data, val_dataloaders=validation)
    resumed = Straggler(seed=init_seed(rank), **config.optimizer_spec())
    trainer = trainer_for(world_size, DecentralizedStrategy(**config.strategy_kwargs()), max_steps=config.steps)
    trainer.fit(resumed, train_dataloaders=data, ckpt_path=str(Path(root) / f"step={epoch}.ckpt"))
    return {"validated": recorder.validated, "distances": recorder.distances, "params": flat(resumed)}


class DiesOrHangs(Regression):
    """On `bad_rank`, at the start of step `bad_step`: `kill -9` or `SIGSTOP` of its own process (after writing the
    time to `stamp`)."""

    def __init__(self, bad_rank: int, bad_step: int, how: signal.Signals, stamp: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step, self.how, self.stamp = bad_rank, bad_step, how, stamp

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            Path(self.stamp).write_text(repr(time.monotonic()))
            os.kill(os.getpid(), self.how)


def peer_fails(rank: int, world_size: int, how: int, stamp: str, timeout: float, staleness: int) -> dict[str, Any]:
    """Rank 1 dies or hangs at step 3 of a stale ring: what the others raise, and when."""
    model = DiesOrHangs(1, 3, signal.Signals(how), stamp, seed=init_seed(rank), lr=0.05)
    strategy = DecentralizedStrategy(staleness=staleness, timeout=timedelta(seconds=timeout))
    trainer = trainer_for(world_size, strategy, max_steps=40)
    error: BaseException | None = None
    try:
        trainer.fit(model, loader(rank, 40 * 8, 8))
    except RuntimeError as exc:
        error = exc
    return {
        "error": "no error" if error is None else f"{type(error).__name__}: {error}",
        "cause": repr(error.__cause__) if error is not None else "",
        "stopped_at": time.monotonic(),
        "threads": sorted(t.name for t in __import__("threading").enumerate() if t.name.startswith("gossip-")),
    }


class SignalledOnRank(Straggler):
    """`SIGTERM` to its own process on `signalled_rank` when step `signal_step` starts (rank 0 pauses most steps)."""

    def __init__(self, signalled_rank: int, signal_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signalled_rank, self.signal_step = signalled_rank, signal_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.signalled_rank and self.global_step == self.signal_step:
            os.kill(os.getpid(), signal.SIGTERM)


def sigterm(rank: int, world_size: int, signalled_rank: int, root: str, staleness: int) -> dict[str, Any]:
    """A SIGTERM on `signalled_rank` alone, at step 5 of 60: where each rank stopped, and what it raised."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    model = SignalledOnRank(signalled_rank, 5, pause=0.02, every=2, seed=init_seed(rank), lr=0.05)
    strategy = DecentralizedStrategy(staleness=staleness, timeout=timedelta(seconds=10))
    trainer = trainer_for(
        world_size, strategy, max_steps=60, callbacks=[OnExceptionCheckpoint(root)], enable_checkpointing=True
    )
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_decentral").addHandler(handler)
    try:
        trainer.fit(model, loader(rank, 60 * 8, 8))
        stopped = "no error"
    except BaseException as exc:  # SIGTERMException is a SystemExit
        stopped = type(exc).__name__
    finally:
        logging.getLogger("lightning_decentral").removeHandler(handler)
    return {"stopped": stopped, "global_step": trainer.global_step, "params": flat(model), "logged": lines}


class Collectives(Callback):
    """Counts the collectives of `torch.distributed` this process calls while training (setup and teardown aside)."""

    NAMES = ("broadcast", "all_reduce", "all_gather", "barrier", "reduce", "all_gather_object", "broadcast_object_list")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._originals: dict[str, Any] = {}

    def _counted(self, name: str, collective: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return collective(*args, **kwargs)

        return counted

    def on_train_start(self, *args: Any) -> None:
        for name in self.NAMES:
            self._originals[name] = getattr(torch.distributed, name)
            setattr(torch.distributed, name, self._counted(name, self._originals[name]))

    def on_train_end(self, *args: Any) -> None:
        for name, collective in self._originals.items():
            setattr(torch.distributed, name, collective)


def collectives_while_training(rank: int, world_size: int, stalenesses: list[int]) -> dict[int, dict[str, int]]:
    """For each staleness, the collectives one rank calls during 12 steps of AWC (no validation, checkpoint or
    synchronized logging)."""
    calls = {}
    for staleness in stalenesses:
        counter = Collectives()
        trainer = trainer_for(world_size, DecentralizedStrategy(staleness=staleness), max_steps=12, callbacks=[counter])
        trainer.fit(Regression(seed=init_seed(rank), lr=0.05), loader(rank, 12 * 8, 8))
        calls[staleness] = counter.calls
    return calls
