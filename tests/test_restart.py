"""Restarting a job that lost a rank: saves in the background, the newest complete checkpoint, a changed world size,
and a torchrun job that restarts by itself and resumes exactly."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path
from tests import restart_workers as workers
from tests.helpers import free_port, run_distributed

WORLD = 3


def _saves(directory: Path, world_size: int = WORLD) -> dict[str, tuple[dict, list[dict]]]:
    """Each checkpoint file in `directory`, with every rank's shard of its save (asserts they exist)."""
    saves = {}
    for path in sorted(directory.glob("*.ckpt")):
        checkpoint = torch.load(path, weights_only=True)
        save_id = checkpoint[META_KEY]["save_id"]
        saves[path.name] = (
            checkpoint,
            [read_shard(shard_path(str(path), r, world_size, save_id)) for r in range(world_size)],
        )
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


@pytest.mark.slow
def test_saves_in_the_background_write_what_synchronous_saves_write(background: tuple[list[dict], Path]) -> None:
    results, root = background
    sync, in_background = _saves(root / "sync"), _saves(root / "background")
    assert (
        sorted(sync)
        == sorted(in_background)
        == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    )
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


@pytest.mark.slow
def test_a_resume_from_a_background_save_continues_every_replica_bit_for_bit(
    background: tuple[list[dict], Path],
) -> None:
    results, _ = background
    assert not torch.equal(results[0]["resumed"]["start"], results[1]["resumed"]["start"])  # from each own shard
    for r in results:
        assert torch.equal(r["resumed"]["end"], r["sync"]["end"])
        assert not r["resumed"]["warnings"]


@pytest.mark.slow
def test_a_resume_through_a_linked_last_checkpoint_continues_every_replica_bit_for_bit(
    background: tuple[list[dict], Path],
) -> None:
    """`ModelCheckpoint(save_last="link")`: `last.ckpt` is a link to the step's checkpoint, whose shards it finds."""
    results, root = background
    last = root / "linked" / "last.ckpt"  # after the resumed run: a link to its own last save
    assert last.is_symlink() and last.resolve().name == f"epoch=1-step={2 * workers.BATCHES}.ckpt"
    assert not torch.equal(results[0]["linked"]["start"], results[1]["linked"]["start"])  # from each own shard
    for r in results:
        assert r["linked"]["start step"] == workers.BATCHES and not r["linked"]["warnings"]
        assert torch.equal(r["linked"]["end"], r["sync"]["end"])


@pytest.mark.slow
def test_a_linked_last_checkpoint_with_saves_in_the_background_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """The link would name a file still being written: a failure then leaves `fit(ckpt_path="last")` nothing."""
    results = run_distributed(workers.linked_last_in_background, 2, timeout=120, root=str(tmp_path))
    for message in results:
        assert message.startswith("ModelCheckpoint(save_last='link') does not go with saves in the background")
        assert "Use save_last=True with AsyncCheckpointIO, or save_last='link' with synchronous saves" in message
    assert not list(tmp_path.iterdir())  # refused before training: nothing written


@pytest.mark.slow
def test_a_failed_background_save_stops_every_rank_and_removes_nothing(tmp_path: Path) -> None:
    """The second save fails on rank 1: the removal of the first, queued behind it, must not run."""
    results = run_distributed(workers.failed_background_save, 2, timeout=240, root=str(tmp_path))
    assert results[1] == "OSError: No space left on device (simulated)"
    assert (
        results[0]
        == "RuntimeError: Rank(s) [1] could not write its shard (their logs say why); no checkpoint was written."
    )
    saves = _saves(tmp_path, world_size=2)
    assert sorted(saves) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert all(file["global_step"] == workers.EVERY for file, _ in saves.values())


@pytest.mark.slow
def test_the_saves_of_one_step_average_once_and_see_a_replica_changed_between_them(tmp_path: Path) -> None:
    """`ModelCheckpoint(save_last=True)`: the step's checkpoint and last.ckpt share one x̄ and one averaged momentum
    (synchronously and in the background); a replica written in place between two saves of a step, on one rank only,
    is averaged again on every rank."""
    counts = run_distributed(workers.saves_of_one_step, 2, timeout=240, root=str(tmp_path))
    for rank_counts in counts:  # 2 save steps, each averaging the parameters and the momentum once
        assert rank_counts == {"sync": 4, "background": 4}, rank_counts
    for mode in ("sync", "background"):
        directory = tmp_path / f"{mode}-changed"
        files = {
            name: torch.load(directory / name, weights_only=True) for name in ("before.ckpt", "after.ckpt", "last.ckpt")
        }
        before, after = files["before.ckpt"]["state_dict"], files["after.ckpt"]["state_dict"]
        for key, value in before.items():  # rank 0's replica + 1, over 2 ranks
            torch.testing.assert_close(after[key], value + 0.5, rtol=0, atol=1e-6)
            assert torch.equal(files["last.ckpt"]["state_dict"][key], after[key]), (mode, key)  # after's x̄, reused
        assert _equal(files["after.ckpt"]["optimizer_states"], files["before.ckpt"]["optimizer_states"])
        # every rank wrote after.ckpt's shard (rank 1's replica unchanged too); the next two saves link it
        step = f"epoch=0-step={workers.EVERY}.ckpt"
        ids = {name: torch.load(directory / name, weights_only=True)[META_KEY]["save_id"] for name in (*files, step)}
        assert ids["after.ckpt"] != ids["before.ckpt"] and ids[step] == ids["last.ckpt"] == ids["after.ckpt"], ids
        for rank in range(2):
            shard = {name: shard_path(str(directory / name), rank, 2, ids[name]) for name in ids}
            assert not os.path.samefile(shard["before.ckpt"], shard["after.ckpt"]), (mode, rank)
            assert os.path.samefile(shard["after.ckpt"], shard[step]) and os.path.samefile(
                shard[step], shard["last.ckpt"]
            )


@pytest.mark.slow
def test_last_checkpoint_links_the_shards_of_the_step_checkpoint_and_resumes_exactly_without_it(tmp_path: Path) -> None:
    """`ModelCheckpoint(save_last=True)`: last.ckpt takes the step checkpoint's save id and its shards are hard links
    of the step checkpoint's (synchronously and in the background); each save agrees three times (its id with the
    values' finiteness and the link, and in the background whether to reuse x̄ and the momentum; every shard in place;
    the file written), and synchronously last.ckpt twice more (reusing x̄, reusing the momentum). With the step
    checkpoint and its shards deleted, last.ckpt resumes every replica bit for bit."""
    results = run_distributed(workers.linked_shards, 2, timeout=240, root=str(tmp_path))
    for mode, reuse in (("sync", 2 * 2), ("background", 0)):  # 2 save steps, 2 saves each
        for rank, r in enumerate(results):
            assert r[mode]["gathers"] == {"protocol": 2 * 2 * 3, "reuse": reuse}, (mode, rank, r[mode]["gathers"])
            assert r[mode]["linked"], (mode, rank)
            assert r[mode]["resumed"]["start step"] == 2 * workers.EVERY
            assert not r[mode]["resumed"]["warnings"], (mode, r[mode]["resumed"]["warnings"])
            assert torch.equal(r[mode]["resumed"]["start"], r[mode]["trained"]), (mode, rank)
            assert torch.equal(r[mode]["resumed"]["end"], r["straight"]), (mode, rank)
        assert not (tmp_path / mode / f"epoch=0-step={2 * workers.EVERY}.ckpt.shards").exists()


def _replica_in(checkpoint: Path, rank: int, world_size: int = WORLD) -> torch.Tensor:
    save_id = torch.load(checkpoint, weights_only=True)[META_KEY]["save_id"]
    shard = read_shard(shard_path(str(checkpoint), rank, world_size, save_id))
    return torch.cat([v.reshape(-1) for v in shard["state_dict"].values()])


@pytest.mark.slow
def test_resume_newest_complete_takes_the_newest_checkpoint_every_rank_has_whole(tmp_path: Path) -> None:
    """`fit(ckpt_path="last")` after last.ckpt was truncated, then after ranks lost their shards of it and of step 8."""
    results = run_distributed(workers.newest_complete, WORLD, timeout=240, root=str(tmp_path))
    cases = {
        "truncated": ("epoch=1-step=8.ckpt", "rank(s) [0, 1, 2] cannot read the file"),
        "shards lost": ("epoch=1-step=6.ckpt", "rank(s) [2] lack their shard of its save"),
    }
    for case, (chosen, problem) in cases.items():
        (warning,) = results[0][case]["warnings"]  # once, on rank 0
        assert warning.startswith(
            f"Resuming from {tmp_path / chosen} (step {chosen[-6]}) instead of {tmp_path / 'last.ckpt'}"
        )
        assert problem in warning and "the newest complete checkpoint in its directory" in warning
        assert all(not r[case]["warnings"] for r in results[1:])
    for rank, r in enumerate(results):  # each replica resumed from its own shard of the checkpoint chosen
        assert torch.equal(r["truncated"]["start"], r["trained"])
        assert torch.equal(r["shards lost"]["start"], _replica_in(tmp_path / "epoch=1-step=6.ckpt", rank)), rank


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("damaged")
    return run_distributed(workers.damaged, WORLD, timeout=240, root=str(root)), root


@pytest.mark.slow
def test_resume_newest_complete_reads_each_shard_and_passes_over_a_truncated_one(
    damaged: tuple[list[dict], Path],
) -> None:
    """Rank 1's shard of last.ckpt cut in half: last.ckpt is incomplete (the shard was only looked for: every replica
    restarted from x̄), so each replica resumes from its own shard of step 8's checkpoint, saved at the same step."""
    results, root = damaged
    (warning,) = results[0]["truncated"]["warnings"]
    assert warning.startswith(
        f"Resuming from {root / 'truncated' / 'epoch=1-step=8.ckpt'} (step 8) instead of "
        f"{root / 'truncated' / 'last.ckpt'}"
    )
    assert "rank(s) [1] cannot read their shard of its save (truncated or damaged)" in warning
    assert all(not r["truncated"]["warnings"] for r in results[1:])
    for r in results:
        assert torch.equal(r["truncated"]["start"], r["trained"])


@pytest.mark.slow
def test_resume_newest_complete_falls_back_from_a_last_link_whose_file_is_gone(
    damaged: tuple[list[dict], Path],
) -> None:
    """`save_last="link"`, and the file last.ckpt links to (step 8's) deleted: Lightning resolves `ckpt_path="last"` to
    no checkpoint (a start from step 0); the strategy resumes from step 6's, naming both."""
    results, root = damaged
    directory = root / "dangling"
    (warning,) = results[0]["dangling"]["warnings"]
    assert warning.startswith(
        f"Resuming from {directory / 'epoch=1-step=6.ckpt'} (step 6) instead of {directory / 'last.ckpt'}"
    )
    assert "it links to epoch=1-step=8.ckpt, which is gone" in warning
    for rank, r in enumerate(results):
        assert r["dangling"]["start step"] == 6
        assert torch.equal(r["dangling"]["start"], _replica_in(directory / "epoch=1-step=6.ckpt", rank)), rank


def test_an_unknown_resume_value_fails_when_built() -> None:
    with pytest.raises(ValueError, match=r"resume='newest' is not one of \('checkpoint', 'newest_complete'\)"):
        DecentralizedStrategy(resume="newest")


# -- under torchrun -----------------------------------------------------------------------------------------------

STEPS, PAUSE = 12, 9  # rank 2 is killed at the start of step 9 (PAUSE) of 12: the last checkpoint is step 8's
JOB = Path(workers.__file__)


def _torchrun(
    root: Path,
    processes: int,
    max_restarts: int,
    *args: str,
    bound: float,
    kill_when: Callable[[], bool] | None = None,
    tee: bool = False,
) -> tuple[int, str]:
    """Run the job of `tests/restart_workers.py` under torchrun (c10d rendezvous) with `processes` ranks, saving in
    the background: its exit code and its output (`tee`: each line prefixed with its rank, `[default<rank>]:`).
    With `kill_when`, SIGKILL the rank that paused once `kill_when()` holds. Every process it started is killed once
    `bound` seconds have passed."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={processes}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.1",
        *(["--tee=3"] if tee else []),
        str(JOB),
        "--root",
        str(root),
        "--background",
        *args,
    ]
    log, paused = root / "torchrun.log", root / "paused"
    with open(log, "w") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    deadline = time.monotonic() + bound
    try:
        while (
            kill_when and not (paused.exists() and kill_when()) and agent.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        if kill_when and paused.exists():
            os.kill(int(paused.read_text()), signal.SIGKILL)
        code = agent.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for pid in [agent.pid, *(int(p.read_text()) for p in (root / "pids").glob("*"))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # each is ours: torchrun, or a worker it started (own session)
    return code, log.read_text()


def _saved(checkpoint: Path, step: int, world_size: int) -> bool:
    """Whether `checkpoint` is the save of `step` with all its shards (its file is renamed into place last)."""
    try:
        file = torch.load(checkpoint, weights_only=True)
    except Exception:  # not there yet
        return False
    shards = [Path(shard_path(str(checkpoint), r, world_size, file[META_KEY]["save_id"])) for r in range(world_size)]
    return file["global_step"] == step and all(shard.exists() for shard in shards)


def _records(root: Path, attempt: int, world_size: int) -> list[dict[str, Any]]:
    return [torch.load(root / "records" / f"{attempt}-{rank}.pt") for rank in range(world_size)]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    root = tmp_path_factory.mktemp("torchrun")
    last_saved = functools.partial(_saved, root / "checkpoints" / "last.ckpt", PAUSE - 1, 4)  # in the background
    code, output = _torchrun(
        root,
        4,
        1,
        "--steps",
        str(STEPS),
        "--pause-rank",
        "2",
        "--pause-step",
        str(PAUSE),
        bound=300,
        kill_when=last_saved,
    )
    return root, code, output


@pytest.mark.slow
def test_a_job_that_loses_a_rank_restarts_by_itself_under_torchrun_and_resumes_exactly(
    restarted: tuple, tmp_path: Path
) -> None:
    root, code, output = restarted
    assert code == 0, output[-5000:]
    assert not list((root / "records").glob("0-*"))  # no rank of the first attempt reached the end
    records = _records(root, 1, 4)  # the second attempt ran to the end on every rank
    assert [r["start step"] for r in records] == [PAUSE - 1] * 4  # the newest complete checkpoint: step 8's
    reference = run_distributed(
        workers.stopped_and_resumed, 4, timeout=240, root=str(tmp_path), stop=PAUSE - 1, steps=STEPS
    )
    for rank, (record, replica) in enumerate(zip(records, reference)):
        assert torch.equal(record["end"], replica), f"rank {rank}"
    assert not torch.equal(records[0]["end"], records[1]["end"])  # four models, not one


def _average_in(checkpoint: Path) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in torch.load(checkpoint, weights_only=True)["state_dict"].values()])


@pytest.mark.slow
def test_a_job_restarted_on_fewer_then_more_ranks_restarts_every_replica_from_the_average(
    restarted: tuple, tmp_path: Path
) -> None:
    """The same checkpoints, as a job resubmitted on other nodes finds them: 4 -> 3 under torchrun (the warning in
    its output, from rank 0), then 3 -> 4."""
    job, code, output = restarted
    assert code == 0, output[-5000:]
    checkpoints = job / "checkpoints"
    average = _average_in(checkpoints / "last.ckpt")  # step 12, 4 ranks
    (tmp_path / "three").mkdir()
    code, output = _torchrun(
        tmp_path / "three", 3, 0, "--checkpoints", str(checkpoints), "--steps", str(STEPS + 2), bound=240, tee=True
    )
    assert code == 0, output[-5000:]
    warnings = [line for line in output.splitlines() if "with every replica restarted from the averaged model" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[default0]:"), warnings  # once, from rank 0
    assert "it was saved by 4 ranks and this run has 3" in warnings[0]
    for record in _records(tmp_path / "three", 0, 3):
        assert record["start step"] == STEPS and torch.equal(record["start"], average)

    average = _average_in(checkpoints / "last.ckpt")  # step 14, 3 ranks
    results = run_distributed(workers.resized, 4, timeout=240, root=str(checkpoints), steps=STEPS + 3)
    (warning,) = results[0]["warnings"]
    assert "it was saved by 3 ranks and this run has 4" in warning and not any(r["warnings"] for r in results[1:])
    for r in results:
        assert r["start step"] == STEPS + 2 and torch.equal(r["start"], average)
