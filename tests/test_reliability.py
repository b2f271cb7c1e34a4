"""Checkpoints of every replica, exact resume, fallbacks, configuration checks and failures that end."""

from __future__ import annotations

import pickle
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral.checkpoint import META_KEY, read_shard, shard_directory, shard_path
from tests import reliability_workers as workers
from tests.helpers import run_distributed, start_processes

WORLD = 4


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("resume")
    return run_distributed(workers.exact_resume, WORLD, root=str(root)), root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(workers.RESUME_CONFIGS))
def test_resume_continues_every_replica_bit_for_bit(resumed: tuple[list[dict], Path], name: str) -> None:
    results, _ = resumed
    replicas = [r[name] for r in results]
    assert (replicas[0]["full"] - replicas[1]["full"]).abs().max() > 1e-4  # n models, not one
    assert (replicas[0]["resume_start"] - replicas[1]["resume_start"]).abs().max() > 1e-4
    for rank, replica in enumerate(replicas):
        assert torch.equal(replica["resumed"], replica["full"]), f"rank {rank}"


def _checkpoint_files(directory: Path, world_size: int = WORLD) -> dict[str, list[str]]:
    """Each checkpoint file in ``directory`` with its shard files; asserts the shards belong to its save."""
    files = {}
    for path in sorted(directory.glob("*.ckpt")):
        meta = torch.load(path, weights_only=True)[META_KEY]
        shards = sorted(Path(shard_directory(path)).iterdir())
        for rank, shard in enumerate(shards):
            content = read_shard(str(shard))
            assert (content["save_id"], content["rank"], content["world_size"]) == (meta["save_id"], rank, world_size)
        files[path.name] = [s.name for s in shards]
    return files


@pytest.mark.slow
def test_shards_follow_top_k_and_last(resumed: tuple[list[dict], Path]) -> None:
    _, root = resumed
    files = _checkpoint_files(root / "top_k")
    assert sorted(files) == [
        f"epoch=1-step={2 * workers.K - 1}.ckpt",
        f"epoch=1-step={2 * workers.K}.ckpt",
        "last.ckpt",
    ]
    for shards in files.values():  # one shard per rank, of this save only
        assert [re.sub(r"\.\d+\.pt$", "", s) for s in shards] == [f"rank-{r:05d}-of-{WORLD:05d}" for r in range(WORLD)]
    leftovers = {p.name for p in (root / "top_k").iterdir()} - set(files) - {f"{f}.shards" for f in files}
    assert not leftovers  # removed checkpoints took their shards along; no temporary file is left


@pytest.mark.slow
def test_shards_hold_the_replica_while_the_file_holds_the_average(resumed: tuple[list[dict], Path]) -> None:
    """The ATC checkpoint is written at the end of validation, while the module holds x̄."""
    _, root = resumed
    path = root / "atc" / f"epoch=0-step={workers.K}.ckpt"
    average = torch.load(path, weights_only=True)["state_dict"]
    shards = sorted(Path(shard_directory(path)).iterdir())
    replicas = [read_shard(str(s))["state_dict"] for s in shards]
    for key in average:
        torch.testing.assert_close(torch.stack([r[key] for r in replicas]).mean(0), average[key], atol=1e-6, rtol=0)
    assert not torch.equal(replicas[0]["net.0.weight"], replicas[1]["net.0.weight"])


def _average_of(path: Path) -> torch.Tensor:
    state = torch.load(path, weights_only=True)["state_dict"]
    return torch.cat([v.reshape(-1) for v in state.values()])


@pytest.mark.slow
def test_missing_shard_restarts_every_replica_from_the_average(resumed: tuple[list[dict], Path]) -> None:
    results, root = resumed
    average = _average_of(root / "awc" / f"epoch=0-step={workers.K}.ckpt")
    for r in results:
        assert torch.equal(r["missing_shard"]["resume_start"], average)
    (warning,) = results[0]["missing_shard"]["warnings"]
    assert "rank(s) [2]: the shard is missing" in warning
    assert all(not r["missing_shard"]["warnings"] for r in results[1:])  # one warning, from rank 0


@pytest.fixture(scope="module")
def two_ranks(resumed: tuple[list[dict], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    _, resume_root = resumed
    checkpoint = resume_root / "atc" / f"epoch=0-step={workers.K}.ckpt"
    root = tmp_path_factory.mktemp("two_ranks")
    results = run_distributed(workers.other_world_size_mismatch_and_nan, 2, checkpoint=str(checkpoint), root=str(root))
    return results, checkpoint, root


@pytest.mark.slow
def test_other_world_size_restarts_every_replica_from_the_average(two_ranks: tuple) -> None:
    results, checkpoint, _ = two_ranks
    for r in results:
        assert torch.equal(r["resume_start"], _average_of(checkpoint))
    (warning,) = results[0]["warnings"]
    assert "saved by 4 ranks and this run has 2" in warning


@pytest.mark.slow
def test_a_failed_save_leaves_the_previous_checkpoint_whole(two_ranks: tuple) -> None:
    results, _, root = two_ranks
    healthy, failed = results
    assert failed["interrupted"] == "OSError: No space left on device (simulated)"
    assert (
        healthy["interrupted"]
        == "RuntimeError: Rank(s) [1] could not write its shard (their logs say why); no checkpoint was written."
    )
    for r in results:  # the new shard of rank 0 was discarded; the first save's shards are still there
        assert r["shards_after"] == r["shards_before"] and len(r["shards_before"]) == 1
    assert list(_checkpoint_files(root, world_size=2)) == ["overwritten.ckpt"]  # its shards match its save_id


@pytest.mark.slow
def test_a_rank_with_another_configuration_stops_every_rank_at_setup(two_ranks: tuple) -> None:
    results, _, _ = two_ranks
    for r in results:
        assert "rank 1 has gossip_steps=2 where rank 0 has 1" in r["mismatch"]
        assert "rank 1 has trainable parameters (elements)=" in r["mismatch"]


@pytest.mark.slow
def test_nan_stops_its_rank_before_sending_and_the_others_through_the_timeout(two_ranks: tuple) -> None:
    results, _, root = two_ranks
    healthy, bad = results
    assert bad["failure"].startswith("FloatingPointError: Rank 1 holds a NaN or an Inf")
    assert "at step 3" in bad["failure"]
    assert healthy["failure"].startswith("PeerFailure: The gossip exchange of step 3 failed")
    assert "GLHF" in healthy["failure"] or "Timed out" in healthy["failure"]  # gloo's text, under the library's
    assert healthy["stopped_at"] - bad["stopped_at"] < healthy["timeout"] + 60  # not the default 30 minutes
    assert torch.isfinite(healthy["replica"]).all()  # nothing reached rank 0
    (last_good,) = (root / "nan").glob("*.ckpt")  # written at step 2, before the NaN: whole and finite
    assert last_good.name == "epoch=0-step=2.ckpt"
    assert torch.isfinite(_average_of(last_good)).all()
    for shard in Path(shard_directory(last_good)).iterdir():
        assert all(torch.isfinite(v).all() for v in read_shard(str(shard))["state_dict"].values())


def _run_until_every_rank_exits(fn: Callable, world_size: int, bound: float, **kwargs: Any) -> list[Any]:
    """Like ``run_distributed``, but a rank that dies does not end the others: each ends on its own, within
    ``bound`` seconds, or the test fails. ``None`` for a rank that left no result."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(fn, world_size, out, **kwargs)
        deadline = time.monotonic() + bound
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:
            procs[rank].kill()
            procs[rank].join()
        assert not hung, f"ranks {hung} still running after {bound:.0f} s"
        results = []
        for rank in range(world_size):
            path = Path(out) / f"{rank}.pkl"
            results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
        return results


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    stamp = tmp_path / "killed_at"
    timeout = 20.0
    survivor, killed = _run_until_every_rank_exits(workers.killed_peer, 2, bound=240, stamp=str(stamp), timeout=timeout)
    assert killed is None  # kill -9 leaves nothing behind
    status, result = survivor
    assert status == "ok", result
    assert result["failure"].startswith("The gossip exchange of step 2 failed on this rank")
    assert result["stopped_at"] - float(stamp.read_text()) < timeout


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["helper-thread", "training-thread"])
def test_a_killed_rank_stops_the_others_with_a_clear_error_under_compression(tmp_path: Path, overlap: bool) -> None:
    """`compression="sign"`: with `compression_overlap` the survivor's exchange fails on the mixer's helper thread,
    and the training thread raises the error the exchange raises on it without the helper."""
    stamp = tmp_path / "killed_at"
    timeout = 20.0
    options = {"compression": "sign", "compression_overlap": overlap}
    survivor, killed = _run_until_every_rank_exits(
        workers.killed_peer, 2, bound=240, stamp=str(stamp), timeout=timeout, **options
    )
    assert killed is None
    status, result = survivor
    assert status == "ok", result
    assert result["failure"].startswith("The compressed gossip exchange of step 2 failed on this rank: a neighbour")
    assert result["stopped_at"] - float(stamp.read_text()) < timeout


@pytest.mark.slow
def test_ranks_given_different_ckpt_paths_all_stop_naming_it(tmp_path: Path) -> None:
    """Lightning reads a checkpoint only on the ranks given one: without the check at `setup_environment` the
    shard protocol's all-gather met another collective on the other rank (gloo aborts, or a hang)."""
    start = time.monotonic()
    results = run_distributed(workers.ckpt_path_disagreement, 2, timeout=240, root=str(tmp_path), pg_timeout=20.0)
    assert time.monotonic() - start < 240
    for rank, r in enumerate(results):
        for name in ("one_without", "different"):
            assert r[name].startswith("ValueError: The ranks do not resume from the same checkpoint"), (rank, r[name])
            assert "rank 0 has ckpt_path='" in r[name] and f"step={workers.K}.ckpt'" in r[name]
            assert "pass the same `trainer.fit(ckpt_path=...)` on every rank" in r[name]
        assert "rank 1 has ckpt_path=None" in r["one_without"]
        assert "rank 1 has ckpt_path='" in r["different"] and f"step={workers.K - 1}.ckpt'" in r["different"]


@pytest.mark.slow
def test_ranks_with_different_optimizers_stop_at_setup() -> None:
    results = run_distributed(workers.optimizer_disagreement, 2, timeout=240)
    for r in results:
        assert r["lr"].startswith("ValueError: The ranks do not run the same configuration"), r["lr"]
        assert "rank 1 has lr='0.1' where rank 0 has '0.05'" in r["lr"]
        assert "rank 1 has optimizer class='torch.optim.adam.Adam' where rank 0 has 'torch.optim.sgd.SGD'" in r["class"]


@pytest.mark.slow
def test_ranks_with_different_compression_or_consensus_step_stop_at_setup() -> None:
    """Ranks started with `sign` and `int8` ended in a gloo abort ("Received data size doesn't match") on one rank and a
    `PeerFailure` on the other, `sign` against none in "a neighbour died", another `top_k` fraction likewise, and
    `consensus_step` 1.0 against 0.5 trained to the end while `x̄` drifted: each now stops every rank at setup, naming
    the field, both values and the fix (`compression_overlap` too, which changes no message: one setting per run)."""
    expected = {
        "compression": "rank 1 has compression='Quantize(bits=8, block=1024, consensus_step=1.0)' where rank 0 has "
        "'Sign(block=1024, consensus_step=1.0)'",
        "compression against none": "rank 1 has compression='' where rank 0 has 'Sign(block=1024, consensus_step=1.0)'",
        "compression parameters": "rank 1 has compression='TopK(fraction=0.2, consensus_step=0.6)' where rank 0 has "
        "'TopK(fraction=0.1, consensus_step=0.3)'",
        "consensus_step": "rank 1 has consensus_step='0.5' where rank 0 has '1.0'",
        "compression_overlap": "rank 1 has compression_overlap=0 where rank 0 has 1",
    }
    for r in run_distributed(workers.option_disagreement, 2, timeout=240):
        for name, difference in expected.items():
            assert r[name].startswith("ValueError: The ranks do not run the same configuration"), (name, r[name])
            assert difference in r[name], (name, r[name])
            assert "Build the same DecentralizedStrategy and the same model on every rank" in r[name]


@pytest.mark.slow
def test_a_public_copy_altered_in_a_shard_stops_every_rank_at_resume(tmp_path: Path) -> None:
    """One bit flipped in rank 1's copy of rank 0's model (a shard of a compressed run): resumed, `x̄` drifted without
    bound, silently (1.3 after 10 steps, 2.6 after 20). Now the resume stops every rank, naming the edge and the fix,
    from digests of the copies; a resume from an unaltered save goes on."""
    for r in run_distributed(workers.public_copy_altered, 2, timeout=240, root=str(tmp_path)):
        assert r[f"step {workers.K - 1}"] == "no error", r
        altered = r[f"step {workers.K}"]
        assert altered.startswith("ValueError: The two ends of an edge of compressed gossip do not hold the same"), r
        assert "rank 1's copy of rank 0's model differs from rank 0's (edge 0 → 1)" in altered, altered
        assert "edge 1 → 0" not in altered, altered
        assert "Resume every rank from the shards of one save, as that save wrote them" in altered, altered


@pytest.mark.slow
def test_resuming_under_another_update_rule_warns_once(tmp_path: Path) -> None:
    rank0, rank1 = run_distributed(workers.rule_change_on_resume, 2, timeout=240, root=str(tmp_path))
    (warning,) = rank0["atc"]["rule warnings"]
    assert "rule 'awc' -> 'atc'" in warning and "combine" in warning
    assert not rank1["atc"]["rule warnings"]  # once: from rank 0
    assert not rank0["awc"]["rule warnings"] and not rank1["awc"]["rule warnings"]
    for r in (rank0, rank1):  # an exact resume from the shards, both times
        assert not r["atc"]["fallback warnings"] and not r["awc"]["fallback warnings"]


def _whole(path: Path, world_size: int) -> dict[str, torch.Tensor]:
    """The average in checkpoint ``path`` (and each rank's shard of its save, loaded): asserts both exist."""
    checkpoint = torch.load(path, weights_only=True)
    meta = checkpoint[META_KEY]
    for rank in range(world_size):
        shard = read_shard(shard_path(str(path), rank, world_size, meta["save_id"]))
        assert (shard["save_id"], shard["rank"]) == (meta["save_id"], rank)
        assert all(torch.isfinite(v).all() for v in shard["state_dict"].values())
    return checkpoint["state_dict"]


@pytest.mark.slow
def test_a_nan_never_reaches_a_checkpoint_and_never_costs_the_last_finite_one(tmp_path: Path) -> None:
    """AWC: step 9's NaN update sits in rank 1's replica when the checkpoint of step 10 is due, one post before the
    exchange would catch it. The save refuses on every rank; step 5's checkpoint and last.ckpt stay whole."""
    results = run_distributed(workers.nan_between_exchange_and_checkpoint, 2, timeout=120, root=str(tmp_path))
    for r in results:
        assert r["error"].startswith("FloatingPointError: Rank(s) [1] hold a NaN or an Inf"), r["error"]
        assert f"at step {workers.NAN_STEP + 1}: the checkpoint" in r["error"]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=5.ckpt", "last.ckpt"):
        assert all(torch.isfinite(v).all() for v in _whole(tmp_path / name, 2).values())


@pytest.mark.slow
def test_a_rank_killed_while_rank_0_writes_the_file_leaves_a_checkpoint_with_all_its_shards(tmp_path: Path) -> None:
    """Rank 2 dies once every shard of the second save is on disk, while rank 0 writes last.ckpt: the survivors stop
    with the library's error (gloo's under it) and keep their shards, so last.ckpt names shards that exist."""
    results = _run_until_every_rank_exits(workers.killed_while_rank0_writes, 3, bound=120, root=str(tmp_path), victim=2)
    assert results[2] is None  # kill -9
    for status, r in results[:2]:
        assert status == "ok", r
        assert r["error"].startswith("PeerFailure: Saving "), r["error"]
        assert "at step 2, agreeing that every rank could write the checkpoint file, failed on this rank" in r["error"]
        assert r["cause"].startswith("RuntimeError: ") and r["cause"][14:] in r["error"]  # gloo's text, kept
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2
    _whole(tmp_path / "last.ckpt", 3)


@pytest.mark.slow
def test_a_rank_killed_during_validation_stops_the_others_with_the_librarys_error() -> None:
    results = _run_until_every_rank_exits(workers.killed_during_validation, 2, bound=120)
    status, survivor = results[0]
    assert status == "ok", survivor
    assert survivor["error"].startswith("PeerFailure: Averaging the replicas into x̄"), survivor["error"]
    assert survivor["cause"].startswith("RuntimeError: ")


@pytest.mark.slow
def test_ranks_with_different_max_steps_stop_at_setup() -> None:
    for message in run_distributed(workers.max_steps_disagreement, 2, timeout=120):
        assert message.startswith("ValueError: The ranks do not run the same configuration"), message
        assert f"rank 1 has max_steps={workers.K - 1} where rank 0 has {workers.K}" in message


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 of 2 stops (SIGSTOP) after step 2. Lightning's broadcast at the next batch times out first and swallows
    its error; the exchange that follows must fail at once, not wait a second timeout."""
    timeout, stamp = 8.0, tmp_path / "stopped_at"
    results = {0: _with_a_hung_rank(stamp, timeout)}
    for rank, (status, r) in results.items():
        assert status == "ok", r
        assert r["error"].startswith("PeerFailure: The gossip exchange of step 2 failed on this rank"), (rank, r)
        assert r["cause"].startswith("RuntimeError: ")  # gloo's own error, under the library's
        assert r["stopped_at"] - float(stamp.read_text()) < timeout + 5  # not 2 x timeout


def _with_a_hung_rank(stamp: Path, timeout: float, **options: Any) -> tuple[str, Any]:
    """Rank 0's result of `workers.hung_peer` on 2 ranks (rank 1 stopped by SIGSTOP after step 2), every process
    bounded and killed at the end."""
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(workers.hung_peer, 2, out, stamp=str(stamp), timeout=timeout, **options)
        try:
            procs[0].join(120)
        finally:
            for p in procs:
                p.kill()
                p.join()
        return pickle.loads((Path(out) / "0.pkl").read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["helper-thread", "training-thread"])
def test_a_hung_rank_stops_the_others_within_the_timeout_under_compression(tmp_path: Path, overlap: bool) -> None:
    """As above with `compression="sign"`: the exchange after the broadcast's timeout fails at once, on the helper
    thread with `compression_overlap` (raised by the training thread's wait) as on the training thread without it."""
    timeout, stamp = 8.0, tmp_path / "stopped_at"
    status, r = _with_a_hung_rank(stamp, timeout, compression="sign", compression_overlap=overlap)
    assert status == "ok", r
    assert r["error"].startswith("PeerFailure: The compressed gossip exchange of step 2 failed on this rank"), r
    assert r["cause"].startswith("RuntimeError: ")
    assert r["stopped_at"] - float(stamp.read_text()) < timeout + 5


@pytest.mark.slow
def test_a_rank_that_saves_alone_stops_every_rank_within_the_timeout_naming_what_each_does(tmp_path: Path) -> None:
    """`if trainer.is_global_zero: trainer.save_checkpoint(...)`: rank 0 waits to average x̄ for the file, rank 1 goes
    on to its next batch. Before, nothing named it. Rank 0 names rank 1's activity: at once if rank 1 began its next
    batch, else (rank 1 held in a collective before it publishes) after the timeout."""
    timeout = 10.0
    saver, other = run_distributed(
        workers.save_on_rank_zero_only, 2, timeout=120, root=str(tmp_path), pg_timeout=timeout
    )
    at_once = (
        "Disagreement: The ranks are not doing the same thing: rank 0 is in a checkpoint save (trainer.save_checkpoint "
        "or a checkpoint callback) while rank 1 is in training batch 2 (optimizer step 2)."
    )
    after_the_timeout = "PeerFailure: a checkpoint save (trainer.save_checkpoint or a checkpoint callback) waited 10."
    assert saver["error"].startswith((at_once, after_the_timeout)), saver["error"]
    assert "rank 1" in saver["error"] and "training batch" in saver["error"]  # what rank 1 does, named
    assert other["error"].startswith("PeerFailure: The gossip exchange of step 2 failed"), other["error"]
    assert saver["seconds"] < timeout + 5 and other["seconds"] < timeout + 10
    assert not (tmp_path / "alone.ckpt").exists()


def test_a_rank_that_passed_an_agreement_and_went_on_lets_a_slower_rank_pass_it() -> None:
    """No collective follows an agreement when the call fails before it (`fabric.load` of a file without the model's
    weights raises on every rank): a fast rank goes on to its next activity while a slow one still waits to read. The
    slow one passes (every rank had begun it); before, it saw the fast one past the agreement and raised
    `Disagreement` (seen on CI in tests/test_fabric.py)."""
    import threading
    import time

    import torch.distributed as dist

    from lightning_decentral.agreement import Activities

    store = dist.HashStore()
    fast, slow = Activities(store, 0, 2, timeout=5.0), Activities(store, 1, 2, timeout=5.0)
    errors: list[BaseException] = []

    def wait_slowly() -> None:
        try:
            slow.agree("fabric.load('a.ckpt')")  # reads rank 0 behind, then sleeps between reads
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=wait_slowly)
    thread.start()
    time.sleep(0.1)  # rank 1 has published and is asleep between two reads
    fast.agree("fabric.load('a.ckpt')")  # sees rank 1 at the same activity: passes at once
    fast.start("optimizer step 0")  # and goes on, with no collective in between
    thread.join(5)
    assert not thread.is_alive() and not errors, errors
    assert (fast.count, slow.count) == (2, 1)


def test_ranks_that_agree_pass_and_a_rank_that_never_begins_is_named_after_the_timeout() -> None:
    """`Activities` over an in-memory store, the ranks as threads of this process."""
    import threading

    import torch.distributed as dist

    from lightning_decentral.agreement import Activities
    from lightning_decentral.failures import PeerFailure

    store, warned = dist.HashStore(), []
    ranks = [Activities(store, rank, 3, timeout=0.5, warn_after=0.2, warn=warned.append) for rank in range(3)]
    together = [threading.Thread(target=ranks[r].agree, args=("fabric.save('a.ckpt')",)) for r in range(3)]
    for thread in together:
        thread.start()
    for thread in together:
        thread.join(5)
    assert not any(thread.is_alive() for thread in together) and [r.count for r in ranks] == [1, 1, 1]

    for rank in ranks:
        rank.start("optimizer step 0")
    ranks[2].start("fabric.load('b.ckpt')")  # as its agree() publishes it; rank 1 never begins the load
    with pytest.raises(PeerFailure) as raised:
        ranks[0].agree("fabric.load('b.ckpt')")
    assert re.search(
        r"fabric.load\('b.ckpt'\) waited 0\.\d s \(the timeout\) on rank 0 for rank 1 \(optimizer step 0\) to begin",
        str(raised.value),
    )
    assert len(warned) == 1 and re.search(
        r"Rank 0 has waited 0\.\d s in fabric.load\('b.ckpt'\) for rank 1 \(optimizer step 0\)", warned[0]
    )


@pytest.mark.parametrize("executor", ["trainer", "fabric"])
def test_a_timeout_that_is_not_a_positive_timedelta_is_refused_when_the_strategy_is_built(executor: str) -> None:
    """`timedelta(0)`, a negative one and a bare number passed the constructor and failed when the ranks met, with
    torch's error; a number is refused (not taken as seconds), naming the fix."""
    from datetime import timedelta

    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy

    strategy = {"trainer": DecentralizedStrategy, "fabric": FabricStrategy}[executor]
    with pytest.raises(
        TypeError, match=r"timeout=30 is a number: pass a datetime.timedelta, e.g. timeout=timedelta\(seconds=30\)"
    ):
        strategy(timeout=30)
    with pytest.raises(
        TypeError, match=r"timeout must be a datetime.timedelta, e.g. timedelta\(minutes=5\), got str '30s'"
    ):
        strategy(timeout="30s")
    for bad, shown in ((timedelta(0), "timedelta(0)"), (timedelta(seconds=-5), "timedelta(seconds=-5)")):
        with pytest.raises(
            ValueError, match=rf"timeout={re.escape(shown)} is not positive: .* pass a positive datetime.timedelta"
        ):
            strategy(timeout=bad)
    strategy(timeout=None)  # torch's default
