"""`on_peer_failure="continue"` survives a death wherever the survivors are when it happens, not only inside a gossip
exchange: in a checkpoint save (its shard writes, the broadcast that starts it, the agreement that every rank is in
it), in a validation with
`self.log(..., sync_dist=True)`, while the survivors of a first failure have not regrouped yet; several deaths at
once cost what one costs; and a SIGTERM after a failure stops every survivor at one step of their graph
(docs/reliability.md, "Surviving a failure")."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import networkx as nx
import pytest
import torch

from tests import survival_workers as workers
from tests.test_survivors import _decision, _every_rank_exits

pytestmark = pytest.mark.slow  # every test here starts processes


def _survivors_finished(results: list, codes: list[int], dead: tuple[int, ...], steps: int) -> list[dict]:
    """The survivors' results, once each exited 0 as rank `i` of the survivors at step `steps` (the dead: SIGKILL),
    with the same decisions, each logged in one line."""
    assert codes == [-9 if r in dead else 0 for r in range(len(codes))], codes
    survivors = [results[r] for r in range(len(codes)) if r not in dead]
    for new_rank, r in enumerate(survivors):
        assert (r["rank"], r["world_size"], r["global_step"]) == (new_rank, len(survivors), steps)
        assert r["decisions"] == survivors[0]["decisions"]
        logged = [line for line in r["logged"] if line.startswith("Survived failure")]
        assert [line.split(":")[0] for line in logged] == [
            f"Survived failure {d['generation']}" for d in r["decisions"]
        ]
    return survivors


@pytest.mark.parametrize("dies_in", ["shard write", "file_exists", "save agreement"])
def test_a_rank_killed_in_a_save_is_survived_and_the_save_written_by_the_survivors(
    dies_in: str, tmp_path: Path
) -> None:
    """4 ranks, a checkpoint every 5 steps; rank 2 dies in the save of step 10: inside the write of its shard, in
    `ModelCheckpoint.file_exists` (the broadcast that starts the save), or right after it (the others wait for it to
    begin the save: `Activities.agree`, which took the timeout). Every survivor is in that save: they agree on step 10,
    make their group, and write it as 3 ranks, `x̄` the mean of their 3 shards (not of the 4 replicas averaged before
    the death); then the saves of steps 15 and 20."""
    results, codes = _every_rank_exits(
        workers.survive, 4, root=str(tmp_path), deaths={2: 10}, steps=20, save_at=5, timeout=10.0, dies_in=dies_in
    )
    survivors = _survivors_finished(results, codes, dead=(2,), steps=20)
    assert survivors[0]["decisions"] == [_decision((0, 1, 3), (2,), 10)]
    for step in (10, 15, 20):
        (checkpoint,) = tmp_path.glob(f"*step={step}.ckpt")
        saved = torch.load(checkpoint, weights_only=True)
        assert saved["decentralized_shards"]["world_size"] == 3
        shards = sorted(Path(f"{checkpoint}.shards").glob("*-of-00003.*.pt"))
        assert len(shards) == 3
        replicas = [torch.load(shard, weights_only=True)["state_dict"] for shard in shards]
        for name, mean in saved["state_dict"].items():
            torch.testing.assert_close(mean, torch.stack([r[name] for r in replicas]).mean(0), atol=1e-6, rtol=0)


def test_a_rank_killed_during_validation_with_sync_dist_is_survived(tmp_path: Path) -> None:
    """4 ranks validate (`val_loss` logged with `sync_dist=True`) at the end of each epoch of 10 steps; rank 2 dies in
    its first validation step at step 10. The others find out in Lightning's reduce: they agree on step 10 and go on;
    the validation of step 20 runs among the 3 survivors (one `val_loss`, reduced)."""
    results, codes = _every_rank_exits(
        workers.survive,
        4,
        root=str(tmp_path),
        deaths={2: 10},
        steps=20,
        validate=True,
        timeout=10.0,
        dies_in="validation",
    )
    survivors = _survivors_finished(results, codes, dead=(2,), steps=20)
    assert survivors[0]["decisions"] == [_decision((0, 1, 3), (2,), 10)]
    val_losses = [r["val_loss"] for r in survivors]
    assert math.isfinite(val_losses[0]) and val_losses == pytest.approx([val_losses[0]] * 3, rel=1e-6)


def test_a_second_death_before_the_survivors_regroup_is_survived(tmp_path: Path) -> None:
    """4 ranks on a ring; rank 2 dies when step 10 starts, and rank 1, one of its survivors, when step 11 starts:
    after the survivors agreed, before they made their process group. Ranks 0 and 3 find it gone while they wait for
    it there, agree again, and finish as 2 ranks (without it, every survivor failed after the timeout with
    `DistStoreError: wait timeout`)."""
    results, codes = _every_rank_exits(
        workers.survive, 4, root=str(tmp_path), deaths={2: 10, 1: 11}, steps=20, timeout=10.0
    )
    survivors = _survivors_finished(results, codes, dead=(1, 2), steps=20)
    first, second = survivors[0]["decisions"]
    assert first in (_decision((0, 1, 3), (2,), 10), _decision((0, 1, 3), (2,), 11))
    assert second == _decision((0, 3), (1,), first["step"] + 1, generation=2)


def test_two_ranks_dying_together_cost_what_one_costs(tmp_path: Path) -> None:
    """A ring of 5 with `timeout=30`: neighbours 1 and 2 are killed together when step 5 starts; ranks 0, 3 and 4
    agree and mix again (step `s + 1` ends) well within the timeout. End to end only: whether a survivor names a dead
    neighbour itself or learns of the failure from the store first is a race here (the old code cost a whole timeout
    when no survivor named the second one); `tests/test_membership.py` pins that case down (members found gone)."""
    timeout = 30.0
    results, codes = _every_rank_exits(
        workers.survive, 5, root=str(tmp_path), deaths={1: 5, 2: 5}, steps=12, timeout=timeout
    )
    survivors = _survivors_finished(results, codes, dead=(1, 2), steps=12)
    (decision,) = survivors[0]["decisions"]
    assert {**decision, "step": None} == _decision((0, 3, 4), (1, 2), None) and decision["step"] in (5, 6)
    killed = max(float((tmp_path / f"killed-{r}").read_text()) for r in (1, 2))
    mixed_again = max(r["finished"][decision["step"] + 1] for r in survivors)
    assert mixed_again - killed < timeout / 2, (
        f"the survivors mixed again {mixed_again - killed:.1f} s after the deaths"
    )


def test_a_sigterm_after_a_failure_stops_every_survivor_at_one_step(tmp_path: Path) -> None:
    """A fan of 7 (rank 6 the hub, ranks 0 - 1 - ... - 5 a path): its diameter is 2 (stop margin 4), the survivors'
    path's 5 (margin 7). The hub dies at step 3; at step 15 the slow rank 0, at one end of the path, is sent SIGTERM.
    Rank 5 runs up to 5 steps ahead of it: with the fan's margin, it would have begun the agreed step before it learns
    of it, and fail past it; with the margin of the survivors' graph, every survivor stops at the same step."""
    graph = nx.Graph([(6, i) for i in range(6)] + [(i, i + 1) for i in range(5)])
    with tempfile.TemporaryDirectory() as root:
        results, codes = _every_rank_exits(
            workers.stop_after_failure, 7, root=root, deaths={6: 3}, topology=graph, slow=0, signal_at=15, steps=60
        )
    assert codes == [0, 0, 0, 0, 0, 0, -9]
    survivors = results[:6]
    assert all(r["stopped"].startswith("SIGTERMException") for r in survivors), [r["stopped"] for r in survivors]
    assert len({r["global_step"] for r in survivors}) == 1 and 15 < survivors[0]["global_step"] < 60
    assert all(r["decisions"][0]["lost"] == (6,) for r in survivors)
