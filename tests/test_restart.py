"""Restarting a job that lost a rank: saves in the background, the newest complete checkpoint, a changed world size,
and a torchrun job that restarts by itself and resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path
from tests import restart_workers as workers
from tests.helpers import run_distributed

WORLD = 3


def _saves(directory: Path, world_size: int = WORLD) -> dict[str, tuple[dict, list[dict]]]:
    """Each checkpoint file in `directory`, with every rank's shard of its save (asserts they exist)."""
    saves = {}
    for path in sorted(directory.glob("*.ckpt")):
        checkpoint = torch.load(path, weights_only=True)
        save_id = checkpoint[META_KEY]["save_id"]
        saves[path.name] = checkpoint, [read_shard(shard_path(str(path), r, world_size, save_id)) for r in range(world_size)]
    return saves


def _equal(a: Any, b: Any) -> bool:
    """`a == b`, tensors bit for bit, in nested dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def background(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("background")
    return run_distributed(workers.background_saves, WORLD, timeout=240, root=str(root)), root


def test_saves_in_the_background_write_what_synchronous_saves_write(background: tuple[list[dict], Path]) -> None:
    results, root = background
    sync, in_background = _saves(root / "sync"), _saves(root / "background")
    assert sorted(sync) == sorted(in_background) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    for name, (file, shards) in sync.items():
        other_file, other_shards = in_background[name]
        assert other_file["global_step"] == file["global_step"]
        for key, value in file["state_dict"].items():  # x̄, averaged by another all-reduce
            torch.testing.assert_close(other_file["state_dict"][key], value, rtol=0, atol=1e-7)
        torch.testing.assert_close(other_file["optimizer_states"], file["optimizer_states"], rtol=0, atol=1e-7)
        for shard, other in zip(shards, other_shards):  # each rank's own state, bit for bit
            for key in ("state_dict", "optimizer_states", "strategy", "rng"):
                assert _equal(other[key], shard[key]), (name, key)
    for r in results:  # saving in the background leaves training alone
        assert torch.equal(r["background"]["end"], r["sync"]["end"])


def test_a_resume_from_a_background_save_continues_every_replica_bit_for_bit(background: tuple[list[dict], Path]) -> None:
    results, _ = background
    assert not torch.equal(results[0]["resumed"]["start"], results[1]["resumed"]["start"])  # from each own shard
    for r in results:
        assert torch.equal(r["resumed"]["end"], r["sync"]["end"])
        assert not r["resumed"]["warnings"]


def test_a_failed_background_save_stops_every_rank_and_removes_nothing(tmp_path: Path) -> None:
    """The second save fails on rank 1: the removal of the first, queued behind it, must not run."""
    results = run_distributed(workers.failed_background_save, 2, timeout=240, root=str(tmp_path))
    assert results[1] == "OSError: No space left on device (simulated)"
    assert results[0] == "RuntimeError: Rank(s) [1] could not write its shard (their logs say why); no checkpoint was written."
    saves = _saves(tmp_path, world_size=2)
    assert sorted(saves) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert all(file["global_step"] == workers.EVERY for file, _ in saves.values())
