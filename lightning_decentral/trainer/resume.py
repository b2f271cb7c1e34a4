"""Which checkpoint a restarted job resumes from, with `DecentralizedStrategy(resume="newest_complete")`: the one
`fit(ckpt_path=...)` names (`"last"` as Lightning resolves it) if it is complete, else the newest complete checkpoint
in its directory.

A checkpoint is *complete* when every rank can read its file and finds its own shard of the file's save: then every
replica resumes exactly. Each rank can only look for its own shard (the ranks of different nodes need not share a
filesystem), so the ranks decide together, from all-gathers of integers: first about the checkpoint named; only if
it is not complete, about every checkpoint in its directory, each known by the random `save_id` its file records.
A checkpoint saved by another number of ranks is taken as it is (the job was resized on purpose: every replica
restarts from `x̄`), as is one saved without shards.
"""

from __future__ import annotations

import enum
import os
from typing import Any, Callable, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_decentral import checkpoint as shards
from lightning_decentral.files import StrPath

RESUME = ("checkpoint", "newest_complete")  # the values of DecentralizedStrategy(resume=...)


class Found(enum.IntEnum):
    """What one rank finds of one checkpoint (an `IntEnum`: it travels in an all-gather)."""

    UNREADABLE = 0  # the file is missing, truncated or not a checkpoint
    SHARD_MISSING = 1  # readable, saved at this world size, but this rank's shard of its save is not there
    AS_IT_IS = 2  # readable, saved without shards or by another number of ranks: nothing better to look for
    COMPLETE = 3  # readable, and this rank's shard of its save is there

    def describe(self) -> str:
        return {Found.UNREADABLE: "cannot read the file", Found.SHARD_MISSING: "lack their shard of its save"}[self]


def choose_checkpoint(ranks: shards.RankGroup, path: StrPath, warn: Callable[[str], None]) -> StrPath:
    """`path`, unless some rank cannot read it or lacks its shard of its save: then the newest checkpoint in its
    directory that every rank has complete (else the newest every rank can read, else `path`), and `warn` (rank
    0's) names both. Every rank must call it together."""
    found, _ = examine(path, ranks.rank, ranks.world_size)
    named = [Found(f) for f in ranks.gather([found], f"Resuming from {path}, checking it is complete,")[:, 0].tolist()]
    if min(named) >= Found.AS_IT_IS:
        return path
    mine = _directory(path, ranks.rank, ranks.world_size)
    rows = [[save_id, step, found] for save_id, (_, step, found) in mine.items()]
    tables = _gather_rows(ranks, rows, f"Resuming from {path}, looking for the newest complete checkpoint beside it,")
    best = newest_complete(tables)
    if best is None or mine[best][0] == str(path):
        return path
    choice, step, found = mine[best]
    problems = "; ".join(
        f"rank(s) {[r for r, f in enumerate(named) if f == problem]} {problem.describe()}"
        for problem in sorted(set(named) - {Found.AS_IT_IS, Found.COMPLETE})
    )
    warn(
        f"Resuming from {choice} (step {step}) instead of {path}, which is incomplete ({problems}): it is the newest "
        + ("complete checkpoint in its directory." if found == Found.COMPLETE else "checkpoint in its directory every "
        "rank can read, but none is complete: every replica restarts from the averaged model.")
    )
    return choice


def newest_complete(tables: list[list[list[int]]]) -> Optional[int]:
    """The save id of the best checkpoint every rank found: `tables[r]` holds rank `r`'s rows `[save_id, step,
    found]`. A checkpoint counts as what its worst rank found; a complete one beats a readable one, then the higher
    step wins (then the higher save id, so that every rank picks the same). `None` if no rank-wide one.

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


def examine(path: StrPath, rank: int, world_size: int) -> tuple[Found, Optional[dict[str, int]]]:
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
    return (Found.COMPLETE if get_filesystem(shard).exists(shard) else Found.SHARD_MISSING), record


def _directory(path: StrPath, rank: int, world_size: int) -> dict[int, tuple[str, int, Found]]:
    """Every checkpoint beside `path` (`*.ckpt`) this rank can read and that records shards: save id -> (path, step,
    what this rank found)."""
    fs = get_filesystem(path)
    found = {}
    for candidate in sorted(fs.glob(f"{os.path.dirname(str(path)) or '.'}/*.ckpt")):
        what, record = examine(candidate, rank, world_size)
        if record is not None:
            found[record["save_id"]] = (str(candidate), record["step"], what)
    return found


def _read(path: StrPath) -> dict[str, Any]:
    """The checkpoint at `path`, its tensors mapped from the file rather than read where the file is local."""
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
