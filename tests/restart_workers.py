"""Workers of tests/test_restart.py: saves in the background, the newest complete checkpoint, a changed world size,
and the job torchrun launches (`python tests/restart_workers.py ...` under torchrun, see `main`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # under torchrun: `tests` is importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy
from lightning_decentral import checkpoint as checkpoint_io
from lightning_decentral.agreement import Ranks
from tests.models import Regression, flat, init_seed, rank_data
from tests.workers import trainer_for

BATCHES = 4  # per epoch
BATCH = 8
EVERY = 2  # a checkpoint every EVERY steps
MOMENTUM_SGD = {"lr": 0.05, "momentum": 0.9}


class FirstStep(Callback):
    """The step training starts from, and the wall time (`time.time()`) the first step of this fit ends."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.ended: float | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.ended = self.ended or time.time()


class Pause(Callback):
    """At the start of step `step`, on rank `rank` only: write this process's pid to `pid_file`, then wait there
    (to be killed; a bound of 120 s)."""

    def __init__(self, rank: int, step: int, pid_file: str) -> None:
        self.rank, self.step, self.pid_file = rank, step, pid_file

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(f"{self.pid_file}.partial").write_text(str(os.getpid()))
            os.replace(f"{self.pid_file}.partial", self.pid_file)  # never read half written
            time.sleep(120)


def fit(
    rank: int,
    world_size: int,
    directory: str,
    max_steps: int,
    ckpt_path: str | None = None,
    background: bool = False,
    top_k: int = -1,
    strategy: dict | None = None,
    callbacks: list | None = None,
    catch_warnings: bool = True,
    save_last: bool | str = True,
) -> dict[str, Any]:
    """Train the regression of tests/models.py (momentum SGD, shuffled data: the order of each epoch comes from the
    RNG the shards restore) with a checkpoint every `EVERY` steps in `directory` and `last.ckpt`; return this rank's
    replica at the start and the end, the step it started from, when its first step ended, and the resume warnings
    (with `catch_warnings=False`, none: they are shown as usual)."""
    torch.manual_seed(0)  # the shuffling's generator, the same in every run
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    saves = ModelCheckpoint(directory, every_n_train_steps=EVERY, save_top_k=top_k, save_last=save_last)
    trainer = trainer_for(
        world_size,
        DecentralizedStrategy(**(strategy or {})),
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[saves, *(callbacks or [])],
        plugins=[AsyncCheckpointIO()] if background else None,
    )
    train = DataLoader(TensorDataset(*rank_data(rank, BATCHES * BATCH)), batch_size=BATCH, shuffle=True)
    first = FirstStep()
    trainer.callbacks.append(first)
    recording = warnings.catch_warnings(record=True) if catch_warnings else contextlib.nullcontext([])
    with recording as caught:
        if catch_warnings:
            warnings.simplefilter("always")
        trainer.fit(model, train, ckpt_path=ckpt_path)
    return {
        "start": model.train_start_params,
        "end": flat(model),
        "start step": first.step,
        "first step ended": first.ended,
        "warnings": [str(w.message) for w in caught if "Resuming from" in str(w.message)],
    }


def background_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The same run saving synchronously and in the background; then a resume from a background save; then the run
    stopped at the end of its first epoch with `last.ckpt` a link (`save_last="link"`), resumed from the link with
    `fit(ckpt_path="last")`."""
    steps = 2 * BATCHES
    out = {
        mode: fit(rank, world_size, f"{root}/{mode}", steps, background=mode == "background")
        for mode in ("sync", "background")
    }
    start = f"{root}/background/epoch=0-step={BATCHES}.ckpt"  # an epoch boundary
    resumed = fit(rank, world_size, f"{root}/resumed", steps, ckpt_path=start, background=True)
    out["resumed"] = resumed
    fit(rank, world_size, f"{root}/linked", BATCHES, save_last="link")
    newest = {"resume": "newest_complete"}
    out["linked"] = fit(rank, world_size, f"{root}/linked", steps, ckpt_path="last", save_last="link", strategy=newest)
    return out


def linked_last_in_background(rank: int, world_size: int, root: str) -> str:
    """`save_last="link"` under `AsyncCheckpointIO`: the error every rank raises."""
    try:
        fit(rank, world_size, root, EVERY, background=True, save_last="link")
        return "no error"
    except ValueError as exc:
        return str(exc)


class DiskFullFrom(Callback):
    """Rank `rank` cannot write its shard of a save at step `step` or later."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if trainer.global_rank == self.rank:
            write_shard = checkpoint_io.write_shard

            def full(shard: dict[str, Any], path: str) -> None:
                if shard["strategy"]["step"] >= self.step:
                    raise OSError("No space left on device (simulated)")
                write_shard(shard, path)

            checkpoint_io.write_shard = full


def failed_background_save(rank: int, world_size: int, root: str) -> str:
    """Rank 1 cannot write its shard of the second save: every rank raises, and the first save, which
    `ModelCheckpoint(save_top_k=1)` removes right after asking for the second, stays."""
    try:
        fit(rank, world_size, root, 3 * EVERY, background=True, top_k=1, callbacks=[DiskFullFrom(1, 2 * EVERY)])
        return "no error"
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"


class AllReduces:
    """Counts the all-reduces of tensors of `numel` elements (from any thread) while entered."""

    def __init__(self, numel: int) -> None:
        self.numel, self.count = numel, 0

    def __enter__(self) -> AllReduces:
        self.all_reduce = torch.distributed.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += tensor.numel() == self.numel
            return self.all_reduce(tensor, *args, **kwargs)

        torch.distributed.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.distributed.all_reduce = self.all_reduce


class ChangedBetweenSaves(Callback):
    """At step `step`: `trainer.save_checkpoint` to `before.ckpt`, add 1 to every parameter of rank `rank`'s replica,
    save `after.ckpt` (then `ModelCheckpoint` saves the step's checkpoint and last.ckpt)."""

    def __init__(self, rank: int, step: int, directory: str) -> None:
        self.rank, self.step, self.directory = rank, step, directory

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(f"{self.directory}/before.ckpt")
            if trainer.global_rank == self.rank:
                with torch.no_grad():
                    for p in module.parameters():
                        p.add_(1.0)
            trainer.save_checkpoint(f"{self.directory}/after.ckpt")


def saves_of_one_step(rank: int, world_size: int, root: str) -> dict[str, int]:
    """Synchronously and in the background: the all-reduces of the model's size during a fit without gossip (on 2
    ranks the ring's exchange is one) saving a checkpoint and last.ckpt every `EVERY` of `2 * EVERY` steps; then, in
    `root/<mode>-changed`, a fit whose step `EVERY` saves around an in-place change of rank 0's replica."""
    numel = sum(p.numel() for p in Regression().parameters())
    counts = {}
    for mode in ("sync", "background"):
        with AllReduces(numel) as all_reduces:
            local = {"gossip_every": 4 * EVERY}
            fit(rank, world_size, f"{root}/{mode}", 2 * EVERY, background=mode == "background", strategy=local)
        counts[mode] = all_reduces.count
        changed = ChangedBetweenSaves(0, EVERY, f"{root}/{mode}-changed")
        fit(rank, world_size, f"{root}/{mode}-changed", EVERY, background=mode == "background", callbacks=[changed])
    return counts


class Gathers:
    """Counts the ranks' agreements (`Ranks.gather`, from any thread) while entered: those of the shard protocol
    (`"protocol"`) and whether a save reuses an earlier save's mean (`"reuse"`)."""

    def __enter__(self) -> Gathers:
        self.counts = {"protocol": 0, "reuse": 0}
        self.gather = Ranks.gather

        def counted(ranks: Ranks, values: list[int], what: str = "") -> Any:
            if what.startswith("Saving"):
                self.counts["protocol"] += 1
            elif "agreeing whether an earlier save" in what:
                self.counts["reuse"] += 1
            return self.gather(ranks, values, what)

        Ranks.gather = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Ranks.gather = self.gather  # type: ignore[method-assign]


def linked_shards(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Synchronously and in the background, `2 * EVERY` steps saving the step's checkpoint and last.ckpt (counting
    the agreements); whether last.ckpt's shard of the last save step is a link of the step checkpoint's; then that
    checkpoint and its shards deleted, a resume from last.ckpt for one more step; and the same step without a resume."""
    out: dict[str, Any] = {"straight": fit(rank, world_size, f"{root}/straight", 2 * EVERY + 1)["end"]}
    for mode in ("sync", "background"):
        directory, background = f"{root}/{mode}", mode == "background"
        with Gathers() as gathers:
            trained = fit(rank, world_size, directory, 2 * EVERY, background=background)["end"]
        step = f"{directory}/epoch=0-step={2 * EVERY}.ckpt"
        last = f"{directory}/last.ckpt"
        linked = os.path.samefile(_own_shard(last, rank, world_size), _own_shard(step, rank, world_size))
        torch.distributed.barrier()
        if rank == 0:
            os.remove(step)
            shutil.rmtree(checkpoint_io.shard_directory(step))
        torch.distributed.barrier()
        resumed = fit(rank, world_size, directory, 2 * EVERY + 1, ckpt_path=last, background=background)
        out[mode] = {"gathers": gathers.counts, "linked": linked, "trained": trained, "resumed": resumed}
    return out


def _own_shard(checkpoint: str, rank: int, world_size: int) -> str:
    save_id = torch.load(checkpoint, weights_only=True)[checkpoint_io.META_KEY]["save_id"]
    return checkpoint_io.shard_path(checkpoint, rank, world_size, save_id)


def newest_complete(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Checkpoints every 2 of 8 steps; then `fit(ckpt_path="last")` with `resume="newest_complete"` twice: after
    last.ckpt was truncated, and after rank 2 lost its shard of the new last.ckpt and rank 1 its shard of step 8."""
    trained = fit(rank, world_size, root, 2 * BATCHES)["end"]
    if rank == 0:
        with open(f"{root}/last.ckpt", "r+b") as f:
            f.truncate(100)
    torch.distributed.barrier()
    newest = {"resume": "newest_complete"}
    out = {
        "trained": trained,
        "truncated": fit(rank, world_size, root, 2 * BATCHES + 1, ckpt_path="last", strategy=newest),
    }
    lost = {2: f"{root}/last.ckpt", 1: f"{root}/epoch=1-step=8.ckpt"}.get(rank)
    if lost is not None:
        os.remove(_own_shard(lost, rank, world_size))
    torch.distributed.barrier()
    out["shards lost"] = fit(rank, world_size, root, 2 * BATCHES + 1, ckpt_path="last", strategy=newest)
    return out


def damaged(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Checkpoints every 2 of 8 steps, then `fit(ckpt_path="last")` with `resume="newest_complete"`: in `root/truncated`
    after rank 1's shard of last.ckpt was replaced by half of it (step 8's, the same file until then, stays whole); in
    `root/dangling` (`save_last="link"`) after the file last.ckpt links to, step 8's, was deleted."""
    newest = {"resume": "newest_complete"}
    out = {"trained": fit(rank, world_size, f"{root}/truncated", 2 * BATCHES)["end"]}
    if rank == 1:  # the shard is a hard link of step 8's (one file): cut in half in place, step 8's would be too
        shard = Path(_own_shard(f"{root}/truncated/last.ckpt", rank, world_size))
        whole = shard.read_bytes()
        shard.unlink()
        shard.write_bytes(whole[: len(whole) // 2])
    torch.distributed.barrier()
    out["truncated"] = fit(rank, world_size, f"{root}/truncated", 2 * BATCHES + 1, ckpt_path="last", strategy=newest)
    fit(rank, world_size, f"{root}/dangling", 2 * BATCHES, save_last="link")
    torch.distributed.barrier()
    if rank == 0:
        os.remove(f"{root}/dangling/epoch=1-step={2 * BATCHES}.ckpt")
    torch.distributed.barrier()
    out["dangling"] = fit(
        rank, world_size, f"{root}/dangling", 2 * BATCHES + 1, ckpt_path="last", save_last="link", strategy=newest
    )
    return out


def stopped_and_resumed(rank: int, world_size: int, root: str, stop: int, steps: int) -> torch.Tensor:
    """A run stopped cleanly at step `stop` (its last checkpoint), then resumed from it up to `steps`: this rank's
    replica at the end."""
    fit(rank, world_size, f"{root}/stopped", stop)
    return fit(rank, world_size, f"{root}/resumed", steps, ckpt_path=f"{root}/stopped/last.ckpt")["end"]


def resized(rank: int, world_size: int, root: str, steps: int) -> dict[str, Any]:
    """`fit(ckpt_path="last")` from the checkpoints in `root` (saved by another number of ranks)."""
    return fit(rank, world_size, root, steps, ckpt_path="last", strategy={"resume": "newest_complete"})


def main() -> None:
    """One rank of a job launched by torchrun: `fit(ckpt_path="last")` with `resume="newest_complete"`; on the first
    attempt, rank `--pause-rank` waits at step `--pause-step` to be killed. Each rank writes its pid to
    `<root>/pids/` when it starts and what `fit` returned to `<root>/records/` when it ends."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--checkpoints", default=None, help="where to save and resume from (default: ROOT/checkpoints)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--pause-rank", type=int, default=-1)
    parser.add_argument("--pause-step", type=int, default=-1)
    parser.add_argument("--background", action="store_true", help="save under AsyncCheckpointIO")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    root = Path(args.root)
    for folder in ("pids", "records"):
        (root / folder).mkdir(exist_ok=True)
    (root / "pids" / f"{attempt}-{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    pause = [Pause(args.pause_rank, args.pause_step, str(root / "paused"))] if attempt == 0 else []
    strategy = {"resume": "newest_complete", "timeout": timedelta(seconds=60)}
    result = fit(
        rank,
        world_size,
        args.checkpoints or str(root / "checkpoints"),
        args.steps,
        ckpt_path="last",
        background=args.background,
        strategy=strategy,
        callbacks=pause,
        catch_warnings=False,
    )
    torch.save({**result, "world size": world_size}, root / "records" / f"{attempt}-{rank}.pt")


if __name__ == "__main__":
    main()
