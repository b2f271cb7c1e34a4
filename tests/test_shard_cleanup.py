"""Shard cleanup in one process: idempotent under a concurrent remover, and no leftovers after a save."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_decentral import checkpoint
from lightning_decentral.checkpoint import (
    META_KEY,
    remove_shards,
    save_with_shards,
    shard_directory,
    shard_path,
)
from lightning_decentral.files import temporary_name
from lightning_decentral.trainer.reuse import StepShards


class OneOfRanks:
    """The `RankGroup` of rank `rank` of `world_size`, with the collectives of a group that always agrees: every
    rank gathers this rank's values, but in the first gather of a save rank 0's draw of its id is `save_id`."""

    def __init__(self, rank: int, world_size: int, save_id: int) -> None:
        self.rank, self.world_size, self.save_id = rank, world_size, save_id

    def gather(self, values: list[int], what: str = "") -> Any:
        row = [self.save_id, *values[1:]] if "save id" in what else values
        return np.array([row] * self.world_size)

    def on_every_rank(self, action: Callable[[], Any], what: str, during: str = "") -> None:
        action()


def _shard(save_id: int) -> dict[str, Any]:
    return {"save_id": save_id, "state_dict": {"w": torch.ones(2)}, "strategy": {"step": 3}}


def _save(path: Path, save_id: int, rank: int = 0, world_size: int = 2) -> str:
    """A save of ``path`` as seen by ``rank``: its shard, then (rank 0) the file; returns the shard's path."""
    state: dict[str, Any] = {}

    def write_file() -> None:
        if rank == 0:
            torch.save(state, path)

    save_with_shards(OneOfRanks(rank, world_size, save_id), state, str(path), _shard, write_file)
    assert torch.load(path, weights_only=True)[META_KEY]["save_id"] == save_id
    return shard_path(str(path), rank, world_size, save_id)


def _names(directory: str) -> set[str]:
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def test_a_shard_removed_by_another_job_between_listing_and_delete_is_no_error(tmp_path: Path, monkeypatch) -> None:
    """Two jobs saving to one path: the other removes our shard after we listed it, before we delete it."""
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    listed = checkpoint.shards_of_rank

    def listed_then_removed_by_the_other_job(checkpoint_path: Any, rank: int) -> list[str]:
        found = listed(checkpoint_path, rank)
        for shard in found:
            os.remove(shard)  # every listed shard vanishes before the delete: the other job was faster
        return found

    monkeypatch.setattr(checkpoint, "shards_of_rank", listed_then_removed_by_the_other_job)
    remove_shards(str(path), 0)  # the checkpoint's removal
    assert not os.path.exists(shard_directory(path))
    remove_shards(str(path), 0)  # again, with the directory gone: still no error


def test_the_shard_directory_removed_by_another_rank_while_this_one_lists_it_is_no_error(
    tmp_path: Path, monkeypatch
) -> None:
    """Each rank removes its own shards, and a rank that finds the directory empty removes it: another rank may do so
    while this one lists the directory, and fsspec's glob then raises `FileNotFoundError` (it ended a rank of the
    quickstart when `ModelCheckpoint` removed its previous checkpoint)."""
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    real = checkpoint.get_filesystem

    class Vanishing:
        def __init__(self, fs: Any) -> None:
            self.fs = fs

        def glob(self, pattern: str) -> list[str]:
            raise FileNotFoundError(pattern)  # the directory went away during the walk

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fs, name)

    monkeypatch.setattr(checkpoint, "get_filesystem", lambda p: Vanishing(real(p)))
    assert checkpoint.shards_of_rank(str(path), 0) == checkpoint.temporary_files_of_rank(str(path), 0) == []
    remove_shards(str(path), 0)


def test_a_shard_of_this_save_removed_meanwhile_is_no_error(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "model.ckpt"
    _save(path, 1)
    os.makedirs(shard_directory(path), exist_ok=True)
    listed = checkpoint.shards_of_rank
    vanished = shard_path(str(path), 0, 2, 99)
    monkeypatch.setattr(checkpoint, "shards_of_rank", lambda p, r: [*listed(p, r), vanished])  # gone by now
    kept = _save(path, 3)  # the cleanup after this save meets the vanished shard
    assert _names(shard_directory(path)) == {os.path.basename(kept)}


@pytest.mark.slow
def test_a_save_leaves_only_its_shard_of_this_rank_and_what_no_other_process_may_still_need(tmp_path: Path) -> None:
    """A shard write killed midway left a temporary file; a save of this process failed before its file: the next
    save to the path removes both. Files of another process stay (its writes in progress, its shards), and so do
    other ranks' files and other checkpoints' shards."""
    path, other = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=3.ckpt"
    other_shard = _save(other, 7)
    directory = shard_directory(path)
    os.makedirs(directory)
    killed_write = temporary_name(shard_path(str(path), 0, 2, 11), pid=_ended())  # its writer is gone
    checkpoint.write_shard(_shard(12), shard_path(str(path), 0, 2, 12))  # this process's: the file was never written
    live_write = temporary_name(shard_path(str(path), 0, 2, 13), pid=os.getppid())  # another job writing now
    other_job = shard_path(str(path), 0, 2, 14)  # another process's shard: its file may be about to name it
    unknown = shard_path(str(path), 0, 4, 15) + ".tmp"  # an older version's temporary name: its writer is unknown
    foreign = [
        shard_path(str(path), 1, 2, 12),
        temporary_name(shard_path(str(path), 1, 2, 11), pid=_ended()),
    ]  # rank 1's
    for leftover in (killed_write, live_write, other_job, unknown, *foreign):
        Path(leftover).write_bytes(b"partial")

    kept = _save(path, 16)
    assert _names(directory) == {os.path.basename(p) for p in (kept, live_write, other_job, unknown, *foreign)}
    assert _names(shard_directory(other)) == {os.path.basename(other_shard)}  # another checkpoint's shards stay


def _ended() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_removing_a_checkpoint_removes_this_ranks_temporary_files_too(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0-step=3.ckpt"
    _save(path, 1)
    Path(temporary_name(shard_path(str(path), 0, 2, 2))).write_bytes(b"partial")  # this process's failed write
    os.remove(path)  # rank 0 removed the file (`ModelCheckpoint` pushed it out of the top k)
    remove_shards(str(path), 0)
    assert not os.path.exists(shard_directory(path))


@pytest.mark.parametrize("leftover", ["orphan", "temporary"])
def test_a_failed_save_keeps_the_previous_one_and_deletes_its_shard_only_before_every_shard_is_in_place(
    tmp_path: Path, monkeypatch, leftover: str
) -> None:
    """A shard write that fails: its shard is deleted. The file's write that fails once every shard is in place:
    no shard of that save is deleted (another rank may have seen the file written); the next save removes it."""
    path = tmp_path / "last.ckpt"
    previous = _save(path, 1)

    def disk_full() -> None:
        raise OSError("No space left on device (simulated)")

    def write_shard_then_fail(shard: dict, target: str) -> None:
        Path(temporary_name(target) if leftover == "temporary" else target).write_bytes(b"partial")
        raise OSError("No space left on device (simulated)")

    write_file: Callable[[], None] = disk_full  # the shard is in place, the file fails
    if leftover == "temporary":  # the shard fails midway
        monkeypatch.setattr(checkpoint, "write_shard", write_shard_then_fail)

        def write_file():
            return None

    with pytest.raises(OSError, match="simulated"):
        save_with_shards(OneOfRanks(0, 2, 2), {}, str(path), _shard, write_file)
    kept = {previous} | ({shard_path(str(path), 0, 2, 2)} if leftover == "orphan" else set())
    assert _names(shard_directory(path)) == {os.path.basename(p) for p in kept}
    monkeypatch.undo()
    latest = _save(path, 3)
    assert _names(shard_directory(path)) == {os.path.basename(latest)}  # the next save cleans up


def test_a_non_finite_replica_or_optimizer_state_writes_and_removes_nothing(tmp_path: Path) -> None:
    """(The fake group reports this rank's values for both ranks.)"""
    path = tmp_path / "last.ckpt"
    previous = _save(path, 1)
    before = path.read_bytes()
    nan, inf = torch.tensor([float("nan")]), torch.tensor([float("inf")])
    for bad in ({"state_dict": {"w": nan}}, {"optimizer_states": [{"state": {0: {"momentum_buffer": inf}}}]}):
        with pytest.raises(
            FloatingPointError, match=r"Rank\(s\) \[0, 1\] hold a NaN or an Inf .* at step 3: the checkpoint"
        ):
            save_with_shards(OneOfRanks(0, 2, 2), {}, str(path), lambda i, bad=bad: {**_shard(i), **bad}, lambda: None)
    assert path.read_bytes() == before
    assert _names(shard_directory(path)) == {os.path.basename(previous)}


@pytest.mark.slow
def test_two_jobs_saving_to_one_path_never_delete_each_others_files(tmp_path: Path) -> None:
    """Before, a job's cleanup deleted the other's shard while it was being written (`FileNotFoundError`)."""
    from tests import reliability_workers
    from tests.helpers import run_distributed

    path = tmp_path / "last.ckpt"
    results = run_distributed(reliability_workers.save_beside_another_job, 2, timeout=120, path=str(path), saves=40)
    assert [r["error"] for r in results] == [None, None]
    meta = torch.load(path, weights_only=True)[META_KEY]  # whichever job saved last: its shard is there
    assert checkpoint.read_shard(shard_path(str(path), 0, 1, meta["save_id"]))["save_id"] == meta["save_id"]


class Differs(OneOfRanks):
    """`OneOfRanks` whose other rank holds another shard than at its earlier save (it links nothing)."""

    def gather(self, values: list[int], what: str = "") -> Any:
        table = super().gather(values, what)
        if "save id" in what:
            table[1, 2] = -1
        return table


def _save_of_step(ranks: OneOfRanks, path: Path, shard: dict[str, Any], earlier: StepShards) -> tuple[int, str]:
    """Save `shard` to `path` as rank 0, with `earlier`: the save id and this rank's shard."""
    state: dict[str, Any] = {}
    save_with_shards(
        ranks, state, str(path), lambda i: {**shard, "save_id": i}, lambda: torch.save(state, path), earlier
    )
    save_id = torch.load(path, weights_only=True)[META_KEY]["save_id"]
    return save_id, shard_path(str(path), 0, 2, save_id)


def test_a_second_save_of_the_same_shard_links_it_where_every_rank_can_else_writes_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The step's checkpoint, then last.ckpt and more saves of the same replica: last.ckpt takes the first save's id
    and links its shard, which outlives the first checkpoint's removal. Where the link fails (no hard links, another
    filesystem) the shard is written, with the same id; where another rank's shard changed, every rank writes its
    own under a new id."""
    earlier = StepShards()
    shard = {"state_dict": {"w": torch.ones(2)}, "strategy": {"step": 3}, "rng": checkpoint.rng_state()}
    step_id, step_shard = _save_of_step(OneOfRanks(0, 2, 1), tmp_path / "step.ckpt", shard, earlier)
    last_id, last_shard = _save_of_step(OneOfRanks(0, 2, 2), tmp_path / "last.ckpt", shard, earlier)
    assert (step_id, last_id) == (1, 1) and os.path.samefile(step_shard, last_shard)
    os.remove(tmp_path / "step.ckpt")
    remove_shards(str(tmp_path / "step.ckpt"), 0)  # ModelCheckpoint drops the step's checkpoint
    assert not os.path.exists(step_shard) and checkpoint.read_shard(last_shard)["save_id"] == 1

    def no_links(source: str, target: str) -> None:
        raise OSError("Operation not permitted (simulated: no hard links)")

    monkeypatch.setattr(os, "link", no_links)
    written_id, written = _save_of_step(OneOfRanks(0, 2, 3), tmp_path / "copy.ckpt", shard, earlier)
    assert written_id == 1 and not os.path.samefile(written, last_shard)
    assert _names(shard_directory(tmp_path / "copy.ckpt")) == {os.path.basename(written)}  # no temporary link left
    assert Path(written).read_bytes() == Path(last_shard).read_bytes()
    monkeypatch.undo()
    other_id, other = _save_of_step(Differs(0, 2, 4), tmp_path / "other.ckpt", shard, earlier)
    assert other_id == 4 and checkpoint.read_shard(other)["save_id"] == 4 and os.stat(other).st_nlink == 1
