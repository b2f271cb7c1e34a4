"""A Fabric checkpoint of this package's strategy, converted for the Trainer's `fit(ckpt_path=...)`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import (
    BATCHES_THAT_STEPPED,
    OptimizationProgress,
    Progress,
    ReadyCompletedTracker,
)
from lightning_decentral.fabric.checkpoints import STEP_KEY
from lightning_decentral.files import StrPath, atomic_write

# -- Fabric checkpoint -> Trainer checkpoint ----------------------------------------------------


def to_trainer_checkpoint(
    fabric_path: StrPath,
    trainer_path: StrPath,
    model_key: str = "model",
    optimizer_key: str = "optimizer",
    prefix: str = "",
    ranks: Iterable[int] | None = None,
) -> None:
    """Convert a checkpoint `fabric.save` wrote under this strategy into one
    `trainer.fit(model, ckpt_path=trainer_path)` resumes from, with the Trainer's
    [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy], shards included. Runs in one process (no
    process group), e.g. before launching the Trainer job.

    What is carried over: `x̄` (`state_dict`), the averaged optimizer state, the step counter `k` (the
    Trainer's `global_step`) and every rank's shard: its own replica, optimizer, precision and RNG state,
    rewritten beside `trainer_path` under the same save id. On the same world size every rank's replica
    then resumes from its own Fabric replica bit for bit; on another, every replica starts from `x̄`
    with one warning (as for any checkpoint).

    Shards on several nodes (no shared filesystem): run it on each node with `ranks=` the ranks whose shards
    that node holds; each writes the same checkpoint file and its own ranks' shards, where the Trainer's ranks on
    that node read them. Without `ranks`, every rank's shard must be readable here: if one is missing or cut short,
    it writes the checkpoint without shards (every replica then resumes from `x̄`, the Trainer says so) and warns
    naming the ranks; with `ranks`, such a shard is an error naming it. Either way nothing is written before every
    shard it needs is read.

    What is not, with a warning naming it: the position in the data (the Trainer starts epoch 0 from the
    first batch, with `global_step = k`), learning-rate schedulers and every other entry of the Fabric
    state besides the model, the optimizer and the step.

    Args:
        fabric_path: the file `fabric.save(fabric_path, state)` wrote (its shards beside it).
        trainer_path: where to write the Trainer checkpoint (its shards go to `<trainer_path>.shards`).
        model_key: the key of the model in the saved `state`.
        optimizer_key: the key of the optimizer in the saved `state` (needed: `fit` restores an optimizer).
        prefix: put before every parameter name: the attribute under which the LightningModule holds the
            Fabric model, e.g. `"net."` for a module whose `self.net` is that model.
        ranks: convert only these ranks' shards (those on this node); `None`: every rank's.

    Examples:
        ```python
        fabric.save("fabric.ckpt", {"model": model, "optimizer": optimizer})
        to_trainer_checkpoint("fabric.ckpt", "trainer.ckpt", prefix="net.")
        trainer.fit(lightning_module, ckpt_path="trainer.ckpt")  # same world size: every replica resumes
        ```
    """
    import lightning

    saved = torch.load(fabric_path, map_location="cpu", weights_only=True)
    missing = [key for key in (model_key, optimizer_key, STEP_KEY) if key not in saved]
    if missing:
        raise ValueError(
            f"{fabric_path} has no {missing}: pass the file `fabric.save(path, {{{model_key!r}: model, "
            f"{optimizer_key!r}: optimizer}})` wrote under lightning_decentral's Fabric strategy "
            "(`model_key`/`optimizer_key` name other keys)."
        )
    step = int(saved[STEP_KEY])
    optimization = OptimizationProgress()
    for tracker in (optimization.optimizer.step.total, optimization.optimizer.step.current):
        tracker.ready = tracker.completed = step
    for tracker in (optimization.optimizer.zero_grad.total, optimization.optimizer.zero_grad.current):
        tracker.ready = tracker.started = tracker.completed = step
    manual = Progress.from_defaults(ReadyCompletedTracker, ready=step, completed=step)
    checkpoint: dict[str, Any] = {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": {prefix + name: value for name, value in saved[model_key].items()},
        "loops": {
            "fit_loop": {
                "epoch_loop.automatic_optimization.optim_progress": optimization.state_dict(),
                "epoch_loop.manual_optimization.optim_step_progress": manual.state_dict(),
                "epoch_loop.state_dict": {BATCHES_THAT_STEPPED: step},
            }
        },
        "optimizer_states": [saved[optimizer_key]],
        "lr_schedulers": [],
    }
    meta = saved.get(shards.META_KEY)
    found = _read_shards(fabric_path, meta, ranks) if meta is not None else {}
    written: list[str] = []
    try:
        for rank, shard in found.items():
            shard["state_dict"] = {prefix + name: value for name, value in shard["state_dict"].items()}
            written.append(shards.shard_path(trainer_path, rank, meta["world_size"], meta["save_id"]))
            shards.write_shard(shard, written[-1])
    except BaseException:
        for path in written:
            shards.discard(path)  # no shard without its checkpoint file
        raise
    if found:
        checkpoint[shards.META_KEY] = meta
    atomic_write(trainer_path, lambda f: torch.save(checkpoint, f))
    dropped = sorted(str(key) for key in saved if key not in (model_key, optimizer_key, STEP_KEY, shards.META_KEY))
    warnings.warn(
        f"{trainer_path}: the Trainer resumes the model, the optimizer and every rank's shard at global_step {step}, "
        "but starts epoch 0 from the first batch (Fabric records no position in the data) and restores no "
        f"learning-rate scheduler; not carried over from {fabric_path}: {dropped or 'nothing else'}.",
        stacklevel=2,
    )


def _read_shards(fabric_path: StrPath, meta: dict[str, int], ranks: Iterable[int] | None) -> dict[int, dict[str, Any]]:
    """The shards of `ranks` (`None`: every rank) of the save `meta` names, by rank. Without `ranks`, a shard that
    cannot be read makes it `{}` with a warning (the Trainer then resumes every replica from `x̄`); with `ranks`, an
    error naming it."""
    world_size = meta["world_size"]
    wanted = range(world_size) if ranks is None else sorted(set(ranks))
    outside = [rank for rank in wanted if not 0 <= rank < world_size]
    if outside:
        raise ValueError(f"`ranks` {outside} are not ranks of {fabric_path}, which {world_size} ranks saved.")
    found = {}
    problems = {}
    for rank in wanted:
        shard, problem = shards.read_own_shard(fabric_path, meta, rank, world_size)
        if shard is None:
            problems[rank] = problem.describe()
        else:
            found[rank] = shard
    if not problems:
        return found
    where = f"in {shards.shard_directory(shards.resolve(fabric_path))}"
    named = "; ".join(f"rank {rank}: {problem}" for rank, problem in problems.items())
    if ranks is not None:
        raise FileNotFoundError(f"Cannot convert the shards of ranks {wanted} {where}: {named}. Nothing was written.")
    warnings.warn(
        f"{fabric_path}: not every rank's shard can be read {where} ({named}): the Trainer checkpoint is written "
        "without shards, so every replica resumes from the average x̄. If the other shards are on other nodes, run "
        "to_trainer_checkpoint on each node with `ranks=` the ranks whose shards it holds.",
        stacklevel=3,
    )
    return {}
