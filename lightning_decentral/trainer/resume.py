"""Which checkpoint a restarted job resumes from, with `DecentralizedStrategy(resume="newest_complete")`: the one
`fit(ckpt_path=...)` names (`"last"` as Lightning resolves it) if it is complete, else the newest complete checkpoint
in its directory.

A checkpoint is *complete* when every rank can read its file and its own shard of the file's save: then every
replica resumes exactly. A rank reads its shard as the resume would, but maps the tensors from the file instead of
reading them (`torch.load(mmap=True)`, local files): the archive's index at the end of the file (a truncated shard has
none), the pickled structure, and the shard's save id and rank. That costs milliseconds however large the shard;
what it does not see is a damaged byte inside a tensor's data, which no check short of reading every byte would. Each
rank can only look for its own shard (the ranks of different nodes need not share a filesystem), so the ranks decide
together, from all-gathers of integers: first about the checkpoint named; only if it is not complete, about every
checkpoint in its directory, each known by the random `save_id` its file records. A checkpoint saved by another number
of ranks is taken as it is (the job was resized on purpose: every replica restarts from `x̄`), as is one saved without
shards.

`fit(ckpt_path="last")` is resolved by Lightning before the strategy sees it, to the newest `last*.ckpt` that exists,
and to nothing (a start from step 0) when the only one is a link whose file is gone (`ModelCheckpoint(save_last=
"link")`). The strategy's launcher ([`ResolvesLast`][lightning_decentral.trainer.resume.ResolvesLast]), which Lightning
hands `fit`'s arguments to, gives Lightning that link instead: the choice above then falls back from it.
"""

from __future__ import annotations

import enum
import inspect
import os
import re
import zlib
from collections.abc import Callable
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import SubprocessScriptLauncher
from lightning_decentral.files import StrPath

RESUME = ("checkpoint", "newest_complete")  # the values of DecentralizedStrategy(resume=...)


class Found(enum.IntEnum):
    """What one rank finds of one checkpoint (an `IntEnum`: it travels in an all-gather)."""

    UNREADABLE = 0  # the file is missing, truncated or not a checkpoint
    SHARD_MISSING = 1  # readable, saved at this world size, but this rank's shard of its save is not there
    SHARD_UNREADABLE = 2  # readable, but this rank's shard of its save is truncated, damaged or another save's
    AS_IT_IS = 3  # readable, saved without shards or by another number of ranks: nothing better to look for
    COMPLETE = 4  # readable, and so is this rank's shard of its save

    def describe(self) -> str:
        return {
            Found.UNREADABLE: "cannot read the file",
            Found.SHARD_MISSING: "lack their shard of its save",
            Found.SHARD_UNREADABLE: "cannot read their shard of its save (truncated or damaged)",
        }[self]


def choose_checkpoint(ranks: shards.RankGroup, path: StrPath, warn: Callable[[str], None]) -> StrPath:
    """`path`, unless some rank cannot read it or lacks its shard of its save: then the newest checkpoint in its
    directory that every rank has complete (else the newest every rank can read, else `path`), and `warn` (rank
    0's) names both. Every rank must call it together."""
    found, _ = examine(path, ranks.rank, ranks.world_size)
    named = [Found(f) for f in ranks.gather([found], f"Resuming from {path}, checking it is complete,")[:, 0].tolist()]
    if min(named) >= Found.AS_IT_IS:
        return path
    mine = _directory(path, ranks.rank, ranks.world_size)
    rows = [[key, step, found] for key, (_, step, found) in mine.items()]
    tables = _gather_rows(ranks, rows, f"Resuming from {path}, looking for the newest complete checkpoint beside it,")
    best = newest_complete(tables)
    if best is None or mine[best][0] == str(path):
        return path
    choice, step, found = mine[best]
    problems = "; ".join(
        f"rank(s) {[r for r, f in enumerate(named) if f == problem]} {problem.describe()}"
        for problem in sorted(set(named) - {Found.AS_IT_IS, Found.COMPLETE})
    )
    if os.path.islink(path) and not os.path.exists(path):
        problems += f": it links to {os.readlink(path)}, which is gone"
    warn(
        f"Resuming from {choice} (step {step}) instead of {path}, which is incomplete ({problems}): it is the newest "
        + (
            "complete checkpoint in its directory."
            if found == Found.COMPLETE
            else "checkpoint in its directory every "
            "rank can read, but none is complete: every replica restarts from the averaged model."
        )
    )
    return choice


def newest_complete(tables: list[list[list[int]]]) -> int | None:
    """The key of the best checkpoint every rank found: `tables[r]` holds rank `r`'s rows `[key, step, found]` (the
    key: `_key`, a save id mixed with the file name). A checkpoint counts as what its worst rank found; a complete one
    beats a readable one, then the higher step wins (then the higher key, so that every rank picks the same). `None`
    if no rank-wide one.

    Examples:
        >>> rank0 = [[11, 20, Found.COMPLETE], [12, 10, Found.COMPLETE]]
        >>> rank1 = [[11, 20, Found.SHARD_MISSING], [12, 10, Found.COMPLETE]]   # rank 1 lost its shard of step 20
        >>> newest_complete([rank0, rank1])
        12
        >>> newest_complete([rank0, [[11, 20, Found.SHARD_MISSING]]]) # nothing complete: the newest readable one
        11
    """
    common = set.intersection(*({row[0] for row in table} for table in tables))
    found = {save_id: min(row[2] for table in tables for row in table if row[0] == save_id) for save_id in common}
    steps = {row[0]: row[1] for row in tables[0]}
    return max(common, key=lambda save_id: (found[save_id] == Found.COMPLETE, steps[save_id], save_id), default=None)


def examine(path: StrPath, rank: int, world_size: int) -> tuple[Found, dict[str, int] | None]:
    """What this rank finds of the checkpoint at `path`, and the record of its save (`save_id`, `world_size`, and
    the file's `step`; `None` for a file without shards or that cannot be read)."""
    try:
        checkpoint = _read(path)
    except Exception:  # missing, truncated, or not a checkpoint
        return Found.UNREADABLE, None
    meta = checkpoint.get(shards.META_KEY)
    if meta is None:
        return Found.AS_IT_IS, None
    record = {**meta, "step": int(checkpoint.get("global_step", 0))}
    if meta["world_size"] != world_size:
        return Found.AS_IT_IS, record
    shard = shards.shard_path(shards.resolve(path), rank, world_size, meta["save_id"])
    if not get_filesystem(shard).exists(shard):
        return Found.SHARD_MISSING, record
    try:
        content = _read(shard)
    except Exception:  # truncated or damaged
        return Found.SHARD_UNREADABLE, record
    if (content.get("save_id"), content.get("rank")) != (meta["save_id"], rank):
        return Found.SHARD_UNREADABLE, record
    return Found.COMPLETE, record


def _directory(path: StrPath, rank: int, world_size: int) -> dict[int, tuple[str, int, Found]]:
    """Every checkpoint beside `path` (`*.ckpt`) this rank can read and that records shards: its key (`_key`) ->
    (path, step, what this rank found)."""
    fs = get_filesystem(path)
    found = {}
    for candidate in sorted(fs.glob(f"{os.path.dirname(str(path)) or '.'}/*.ckpt")):
        what, record = examine(candidate, rank, world_size)
        if record is not None:
            found[_key(record["save_id"], candidate)] = (str(candidate), record["step"], what)
    return found


def _key(save_id: int, path: StrPath) -> int:
    """A checkpoint file's key, the same on every rank: its save id mixed with its file name (the saves of one step
    share a save id where the second links the first's shards, `last.ckpt` after the step's checkpoint).

    Examples:
        >>> _key(5, "a/last.ckpt") == _key(5, "b/last.ckpt") != _key(5, "a/epoch=0-step=2.ckpt")
        True
    """
    return save_id ^ (zlib.crc32(os.path.basename(str(path)).encode()) << 30)


def _read(path: StrPath) -> dict[str, Any]:
    """The checkpoint or shard at `path`, its tensors mapped from the file rather than read where the file is local."""
    if isinstance(get_filesystem(path), LocalFileSystem):
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    with get_filesystem(path).open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def _gather_rows(ranks: shards.RankGroup, rows: list[list[int]], what: str) -> list[list[list[int]]]:
    """Every rank's `rows` (each of 3 integers, as many as it has): two all-gathers, the counts, then the rows."""
    counts = ranks.gather([len(rows)], what)[:, 0].tolist()
    padded = [value for row in rows for value in row] + [0] * 3 * (max(counts) - len(rows))
    table = ranks.gather(padded or [0], what)
    return [[table[r, 3 * i : 3 * i + 3].tolist() for i in range(n)] for r, n in enumerate(counts)]


def dangling_last(trainer: Trainer) -> str | None:
    """The `last*.ckpt` link whose file is gone (the newest, if several) in a `ModelCheckpoint`'s `dirpath`, when that
    directory holds no `last*.ckpt` that exists: what `ckpt_path="last"` named before its file went. `None` otherwise,
    and for a callback whose `dirpath` is not set yet (Lightning resolves it when fit starts)."""
    links = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None or not os.path.isdir(callback.dirpath):
            continue
        pattern = re.compile(
            rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-\d+)?{re.escape(callback.FILE_EXTENSION)}$"
        )
        for name in os.listdir(callback.dirpath):
            path = os.path.join(callback.dirpath, name)
            if pattern.match(name):
                if os.path.exists(path):
                    return None  # Lightning finds a last checkpoint: its choice stands
                if os.path.islink(path):
                    links.append(path)
    return max(links, key=lambda link: os.lstat(link).st_mtime, default=None)


class ResolvesLast:
    """A launcher of a strategy with `resume="newest_complete"` that, for `fit(ckpt_path="last")`, hands Lightning a
    `last.ckpt` link whose file is gone ([`dangling_last`][lightning_decentral.trainer.resume.dangling_last]) instead
    of `"last"`, which Lightning would resolve to no checkpoint: the strategy then falls back from it to the newest
    complete checkpoint, with a warning naming both. List it before Lightning's launcher class."""

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and getattr(trainer.strategy, "resume", None) == RESUME[1]
        ):
            call = inspect.signature(function).bind(*args, **kwargs)
            link = dangling_last(trainer) if call.arguments.get("ckpt_path") == "last" else None
            if link is not None:
                call.arguments["ckpt_path"] = link
                args = call.args
                kwargs = call.kwargs
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]  # the launcher listed after it


class ScriptLauncher(ResolvesLast, SubprocessScriptLauncher):
    """Lightning's launcher of `start_method="popen"` (it starts the other ranks of `devices=n` from a script, or none
    when another launcher started them: torchrun, srun, lightning-decentral-launch), after
    [`ResolvesLast`][lightning_decentral.trainer.resume.ResolvesLast]."""
