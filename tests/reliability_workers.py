"""Spawned workers of tests/test_reliability.py: exact resume, fallbacks, bad configurations, failures."""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy
from lightning_decentral import checkpoint as checkpoint_io
from lightning_decentral.checkpoint import shards_of_rank
from tests.models import BadLossOnRank, Regression, flat, init_seed, loader, rank_data
from tests.workers import trainer_for

K = 3  # steps per epoch; a run of 2K steps is resumed from the checkpoint of step K (an epoch boundary)
BATCH = 8
MOMENTUM_SGD = {"lr": 0.05, "momentum": 0.9}


class ResumeConfig(NamedTuple):
    strategy: dict
    optimizer: dict
    on_validation: bool = False  # checkpoint at the end of validation (the module holds x̄) instead of every K steps
    shuffle: bool = False  # the next epoch's order comes from the global RNG: the shard's RNG state must be restored


RESUME_CONFIGS = {
    "awc": ResumeConfig({}, MOMENTUM_SGD, shuffle=True),
    "atc": ResumeConfig({"combine": "atc"}, MOMENTUM_SGD, on_validation=True),
    "decentlam": ResumeConfig({"momentum": "decentlam"}, MOMENTUM_SGD),
    "one_peer_exponential": ResumeConfig({"topology": "one_peer_exponential"}, {"name": "adam", "lr": 0.01}),
}


def _fit(rank: int, world_size: int, name: str, root: str, ckpt_path: Any = None, seed: int = 0) -> Regression:
    """``2K`` steps of config ``name`` with its checkpoints in ``root/name`` (and, for "awc", a top-2 set)."""
    strategy_kwargs, optimizer, on_validation, shuffle = RESUME_CONFIGS[name]
    callbacks = [ModelCheckpoint(f"{root}/{name}", every_n_train_steps=None if on_validation else K, save_top_k=-1)]
    if name == "awc" and ckpt_path is None:  # the uninterrupted run only: a resumed one would add versions
        callbacks.append(
            ModelCheckpoint(
                f"{root}/top_k", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
            )
        )
    model = Regression(seed=init_seed(rank) + seed, **optimizer)
    trainer = trainer_for(
        world_size,
        DecentralizedStrategy(**strategy_kwargs),
        max_steps=2 * K,
        callbacks=callbacks,
        enable_checkpointing=True,
        limit_val_batches=1 if on_validation else 0,
    )
    val = loader(rank + world_size, BATCH, BATCH) if on_validation else None
    train = DataLoader(TensorDataset(*rank_data(rank, K * BATCH)), batch_size=BATCH, shuffle=shuffle)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model


def exact_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per config: the replica after 2K uninterrupted steps and after K steps + resume + K steps; then a resume
    whose shard on rank 2 is gone (every replica must restart from the average, with a warning)."""
    out: dict[str, Any] = {}
    for name in RESUME_CONFIGS:
        full = flat(_fit(rank, world_size, name, root))
        resumed = _fit(rank, world_size, name, root, ckpt_path=f"{root}/{name}/epoch=0-step={K}.ckpt", seed=50)
        out[name] = {"full": full, "resumed": flat(resumed), "resume_start": resumed.train_start_params}

    checkpoint = f"{root}/awc/epoch=0-step={K}.ckpt"
    if rank == 2:
        for shard in shards_of_rank(checkpoint, rank):
            os.remove(shard)
    dist.barrier()
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    trainer = trainer_for(world_size, DecentralizedStrategy(), max_steps=K + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(rank, K * BATCH, BATCH), ckpt_path=checkpoint)
    out["missing_shard"] = {"resume_start": model.train_start_params, "warnings": _resume_warnings(caught)}
    return out


def _resume_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "restarted from the averaged model" in str(w.message)]


def _disk_full(*args: Any) -> None:
    raise OSError("No space left on device (simulated)")


class _NaNOnRank(Regression):
    """Writes a NaN into its first weight on ``bad_rank`` when step ``bad_step`` starts."""

    def __init__(self, bad_rank: int, bad_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step = bad_rank, bad_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")


def other_world_size_mismatch_and_nan(rank: int, world_size: int, checkpoint: str, root: str) -> dict[str, Any]:
    """Four scenarios on one process group, the one that breaks it last:

    1. resume a checkpoint of 4 ranks on ``world_size`` ranks: every replica starts from the average;
       then save a checkpoint, and overwrite it with a save whose shard write fails on rank 1;
    2. rank 1 builds another strategy and another model: every rank stops at setup, naming both;
    3. rank 1's replica turns NaN at step 3, after a checkpoint at step 2: rank 1 raises before sending and
       lingers (alive, its connections open) until rank 0 has given up waiting, through the timeout.
    """
    out: dict[str, Any] = {}
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    trainer = trainer_for(world_size, DecentralizedStrategy(), max_steps=K + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(rank, K * BATCH, BATCH), ckpt_path=checkpoint)
    out["resume_start"] = model.train_start_params
    out["warnings"] = _resume_warnings(caught)

    path = f"{root}/overwritten.ckpt"
    trainer.save_checkpoint(path)
    out["shards_before"] = shards_of_rank(path, rank)
    write_shard = checkpoint_io.write_shard
    if rank == 1:
        checkpoint_io.write_shard = _disk_full
    try:
        trainer.save_checkpoint(path)
        out["interrupted"] = "no error"
    except (OSError, RuntimeError) as exc:
        out["interrupted"] = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint_io.write_shard = write_shard
    out["shards_after"] = shards_of_rank(path, rank)

    strategy = DecentralizedStrategy(gossip_steps=2 if rank == 1 else 1)
    trainer = trainer_for(world_size, strategy, max_steps=1)
    try:
        trainer.fit(Regression(batch_norm=rank == 1), loader(rank, BATCH, BATCH))
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)

    timeout = 8.0
    done = Path(root) / "rank0_stopped"
    model = _NaNOnRank(1, 3, seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=timeout))
    callbacks = [ModelCheckpoint(f"{root}/nan", every_n_train_steps=2, save_top_k=-1)]
    trainer = trainer_for(world_size, strategy, max_steps=2 * K, callbacks=callbacks, enable_checkpointing=True)
    try:
        trainer.fit(model, loader(rank, K * BATCH, BATCH))
        out["failure"] = "no error"
    except (FloatingPointError, RuntimeError) as exc:
        out["failure"] = f"{type(exc).__name__}: {exc}"
    out["stopped_at"] = time.monotonic()
    out["replica"] = flat(model)
    if rank == 0:
        done.touch()
    else:  # a rank that failed but has not exited: the others can only notice through the timeout
        deadline = time.monotonic() + 10 * timeout
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    out["timeout"] = timeout
    return out


class _KilledOnRank(Regression):
    """``kill -9`` of its own process on ``bad_rank`` when step ``bad_step`` starts."""

    def __init__(self, bad_rank: int, bad_step: int, stamp: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step, self.stamp = bad_rank, bad_step, stamp

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            Path(self.stamp).write_text(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)


def killed_peer(rank: int, world_size: int, stamp: str, timeout: float, **options: Any) -> dict[str, Any]:
    """Rank 1 kills itself when step 2 starts; `options`: more of the strategy's arguments."""
    model = _KilledOnRank(1, 2, stamp, seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=timeout), **options)
    trainer = trainer_for(world_size, strategy, max_steps=2 * K)
    try:
        trainer.fit(model, loader(rank, K * BATCH, BATCH))
        failure = "no error"
    except RuntimeError as exc:
        failure = str(exc)
    return {"failure": failure, "stopped_at": time.monotonic()}


def _outcome(action: Any, *args: Any, **kwargs: Any) -> str:
    """``action(*args, **kwargs)``: ``"no error"``, or the exception's type and message (the rank goes on)."""
    try:
        action(*args, **kwargs)
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def ckpt_path_disagreement(rank: int, world_size: int, root: str, pg_timeout: float) -> dict[str, Any]:
    """Save checkpoints at steps 1..K; then fit with rank 0 given a checkpoint and rank 1 none, then with
    two different checkpoints. Every rank must stop with a ``ValueError`` before reading one."""
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=pg_timeout))
    callbacks = [ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1)]
    trainer = trainer_for(world_size, strategy, max_steps=K, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH))
    out: dict[str, Any] = {}
    for name, paths in {
        "one_without": [f"{root}/epoch=0-step={K}.ckpt", None],
        "different": [f"{root}/epoch=0-step={K}.ckpt", f"{root}/epoch=0-step={K - 1}.ckpt"],
    }.items():
        model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
        trainer = trainer_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=pg_timeout)), max_steps=K + 1)
        out[name] = _outcome(trainer.fit, model, loader(rank, K * BATCH, BATCH), ckpt_path=paths[rank])
    return out


def optimizer_disagreement(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 with another learning rate, then with another optimizer class: every rank must stop at setup."""
    out = {}
    for name, optimizer in {
        "lr": {"lr": 0.05 if rank == 0 else 0.1},
        "class": {"name": "sgd" if rank == 0 else "adam", "lr": 0.05},
    }.items():
        model = Regression(seed=init_seed(rank), **optimizer)
        trainer = trainer_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=30)), max_steps=1)
        out[name] = _outcome(trainer.fit, model, loader(rank, BATCH, BATCH))
    return out


OPTION_DISAGREEMENTS = {
    "compression": ({"compression": "sign"}, {"compression": "int8"}),
    "compression against none": ({"compression": "sign"}, {}),
    "compression parameters": ({"compression": "top_k:0.1"}, {"compression": "top_k:0.2"}),
    "consensus_step": ({"compression": "int8", "consensus_step": 1.0}, {"compression": "int8", "consensus_step": 0.5}),
    "compression_overlap": ({"compression": "sign", "compression_overlap": True}, {"compression": "sign"}),
}
"""Options rank 0 and rank 1 start with, by the field they differ in (`option_disagreement`)."""


def option_disagreement(rank: int, world_size: int) -> dict[str, str]:
    """For each case of `OPTION_DISAGREEMENTS`, a fit with rank 0's options on rank 0 and rank 1's on the others: how
    it ended on this rank (every rank must stop at setup, naming the field)."""
    out = {}
    for name, options in OPTION_DISAGREEMENTS.items():
        strategy = DecentralizedStrategy(timeout=timedelta(seconds=30), **options[min(rank, 1)])
        trainer = trainer_for(world_size, strategy, max_steps=2 * K)
        out[name] = _outcome(
            trainer.fit, Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH)
        )
    return out


def public_copy_altered(rank: int, world_size: int, root: str) -> dict[str, str]:
    """`compression="sign"` on a ring, saving at every step to `K`; rank 1 then flips one bit of its copy of rank 0's
    model in its shard of step K's save. Resumes from step K − 1's save (as written) and from step K's: how each
    ended on this rank."""
    strategy = dict(compression="sign", timeout=timedelta(seconds=30))
    saves = ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1)
    trainer = trainer_for(
        world_size, DecentralizedStrategy(**strategy), max_steps=K, callbacks=[saves], enable_checkpointing=True
    )
    trainer.fit(Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH))
    if rank == 1:
        (path,) = shards_of_rank(f"{root}/epoch=0-step={K}.ckpt", 1)
        shard = torch.load(path, weights_only=True)
        copy = shard["gossip"]["copies"][0]["received"][0]  # x̂_{0→1}, rank 1's copy of rank 0's model
        copy.view(torch.int32)[0] ^= 1  # its lowest bit
        torch.save(shard, path)
    dist.barrier()
    out = {}
    for step in (K - 1, K):
        trainer = trainer_for(world_size, DecentralizedStrategy(**strategy), max_steps=K + 2)
        model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
        out[f"step {step}"] = _outcome(
            trainer.fit, model, loader(rank, K * BATCH, BATCH), ckpt_path=f"{root}/epoch=0-step={step}.ckpt"
        )
    return out


def rule_change_on_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save at step K under AWC, then resume exactly under ATC and under AWC; the warnings of each resume."""
    callbacks = [ModelCheckpoint(root, every_n_train_steps=K, save_top_k=-1)]
    trainer = trainer_for(
        world_size, DecentralizedStrategy(), max_steps=K, callbacks=callbacks, enable_checkpointing=True
    )
    trainer.fit(Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH))
    out: dict[str, Any] = {}
    for combine in ("atc", "awc"):
        model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
        trainer = trainer_for(world_size, DecentralizedStrategy(combine=combine), max_steps=K + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(rank, K * BATCH, BATCH), ckpt_path=f"{root}/epoch=0-step={K}.ckpt")
        out[combine] = {
            "rule warnings": [str(w.message) for w in caught if "another update rule" in str(w.message)],
            "fallback warnings": _resume_warnings(caught),
        }
    return out


def _failure(exc: BaseException) -> dict[str, str]:
    """The error a rank ended with, and the backend's error under it (its ``__cause__``)."""
    cause = exc.__cause__
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "cause": "" if cause is None else f"{type(cause).__name__}: {cause}",
    }


NAN_STEP = 9  # the step whose loss turns NaN; the checkpoint of step 10 must not be written


def nan_between_exchange_and_checkpoint(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """AWC posts x(k) before the step and checks it there: a NaN from step 9's update is in x(10) when the
    checkpoint of step 10 is saved, before step 10 posts (and would check) it."""
    model = BadLossOnRank(1, NAN_STEP, float("nan"), seed=init_seed(rank), **MOMENTUM_SGD)
    callbacks = [ModelCheckpoint(root, every_n_train_steps=5, save_top_k=1, save_last=True)]
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=10))
    trainer = trainer_for(world_size, strategy, max_steps=12, callbacks=callbacks, enable_checkpointing=True)
    try:
        trainer.fit(model, loader(rank, 12 * BATCH, BATCH))
        return {"error": "no error"}
    except (FloatingPointError, RuntimeError) as exc:
        return _failure(exc)


class _KillsDuringFileWrite(TorchCheckpointIO):
    """Rank 0's checkpoint writer: at its ``when``-th file, ``kill -9`` of the rank whose pid is in ``pid_file``
    first (the other ranks are then waiting to hear that the file is written)."""

    def __init__(self, pid_file: str, when: int) -> None:
        super().__init__()
        self.pid_file, self.when, self.writes = pid_file, when, 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.writes += 1
        if self.writes == self.when:
            os.kill(int(Path(self.pid_file).read_text()), signal.SIGKILL)
        super().save_checkpoint(checkpoint, path, storage_options)


def killed_while_rank0_writes(rank: int, world_size: int, root: str, victim: int) -> dict[str, Any]:
    """``last.ckpt`` every step; at the second save, rank ``victim`` is killed while rank 0 writes the file."""
    pid_file = f"{root}/pid"
    if rank == victim:
        Path(pid_file + ".partial").write_text(str(os.getpid()))
        os.replace(pid_file + ".partial", pid_file)
    plugins = [_KillsDuringFileWrite(pid_file, when=2)] if rank == 0 else []
    callbacks = [ModelCheckpoint(root, every_n_train_steps=1, save_top_k=0, save_last=True)]
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=10))
    trainer = trainer_for(
        world_size, strategy, max_steps=K, callbacks=callbacks, enable_checkpointing=True, plugins=plugins
    )
    try:
        trainer.fit(Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH))
        return {"error": "no error"}
    except RuntimeError as exc:
        return _failure(exc)


class _KilledOnValidation(Regression):
    def on_validation_start(self) -> None:
        if self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def killed_during_validation(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 dies as validation starts, while the others average the replicas into x̄."""
    model = _KilledOnValidation(seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=10))
    trainer = trainer_for(world_size, strategy, max_steps=K, limit_val_batches=1, val_check_interval=2)
    try:
        trainer.fit(model, loader(rank, K * BATCH, BATCH), loader(rank, BATCH, BATCH))
        return {"error": "no error"}
    except RuntimeError as exc:
        return _failure(exc)


def max_steps_disagreement(rank: int, world_size: int) -> str:
    """Rank 1 would stop a step early and leave the others waiting for its exchange: every rank stops at setup."""
    trainer = trainer_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=10)), max_steps=K - rank)
    return _outcome(trainer.fit, Regression(seed=init_seed(rank), **MOMENTUM_SGD), loader(rank, K * BATCH, BATCH))


class _StoppedOnRank(Regression):
    """``SIGSTOP`` of its own process on ``bad_rank`` when step ``bad_step`` ends (alive, silent, connections open)."""

    def __init__(self, bad_rank: int, bad_step: int, stamp: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step, self.stamp = bad_rank, bad_step, stamp

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            Path(self.stamp).write_text(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGSTOP)


def hung_peer(rank: int, world_size: int, stamp: str, timeout: float, **options: Any) -> dict[str, Any]:
    """Rank 1 hangs after its second step: the other ranks stop with the library's error. `options`: more of the
    strategy's arguments."""
    model = _StoppedOnRank(1, 2, stamp, seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=timeout), **options)
    trainer = trainer_for(world_size, strategy, max_steps=4 * K)
    try:
        trainer.fit(model, loader(rank, 4 * K * BATCH, BATCH))
        return {"error": "no error", "stopped_at": time.monotonic()}
    except RuntimeError as exc:
        return {**_failure(exc), "stopped_at": time.monotonic()}


class _OneRankJob:
    """The collectives of a job of one rank: every agreement is its own."""

    rank, world_size = 0, 1

    def gather(self, values: list[int], what: str = "") -> torch.Tensor:
        return torch.tensor([values])

    def on_every_rank(self, action: Any, what: str, during: str = "") -> None:
        action()


def save_beside_another_job(job: int, jobs: int, path: str, saves: int) -> dict[str, Any]:
    """One of ``jobs`` jobs of one rank each, saving a checkpoint with its shard to the same ``path`` ``saves`` times:
    the error that stopped it, if any."""
    content = {"state_dict": {"w": torch.full((2**16,), float(job))}, "strategy": {"step": 0}}
    state: dict[str, Any] = {"job": job}
    try:
        for _ in range(saves):
            checkpoint_io.save_with_shards(
                _OneRankJob(),
                state,
                path,
                make_shard=lambda save_id: {**content, "save_id": save_id, "rank": 0},
                write_file=lambda: TorchCheckpointIO().save_checkpoint(state, path),
            )
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


class _SavesOnRankZeroOnly(pl.Callback):
    """`if trainer.is_global_zero: trainer.save_checkpoint(...)` after step 2: a collective on one rank."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2 and trainer.is_global_zero:
            trainer.save_checkpoint(self.path)


def save_on_rank_zero_only(rank: int, world_size: int, root: str, pg_timeout: float) -> dict[str, Any]:
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    strategy = DecentralizedStrategy(timeout=timedelta(seconds=pg_timeout))
    trainer = trainer_for(world_size, strategy, max_steps=2 * K, callbacks=[_SavesOnRankZeroOnly(f"{root}/alone.ckpt")])
    start = time.monotonic()
    try:
        trainer.fit(model, loader(rank, K * BATCH, BATCH))
        error = "no error"
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}
