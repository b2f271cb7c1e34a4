"""[`ShardedCheckpoints`][lightning_decentral.common.checkpoints.ShardedCheckpoints]: the shard protocol of a save and
a resume on processes ([`checkpoint`][lightning_decentral.checkpoint]), held by the Trainer's and Fabric's
strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_decentral import checkpoint as shards
from lightning_decentral.agreement import Ranks
from lightning_decentral.driver import StepDriver
from lightning_decentral.files import StrPath


class ShardedCheckpoints:
    """This rank's shards: what a save writes beside the checkpoint file (`save`), which shard a resume reads
    (`read`: every rank's of the same save, or none) and what it restores from it (`restore`).

    Args:
        driver: the update rule's driver: a shard records its rule and holds every part its
            [`StateRegistry`][lightning_decentral.checkpoint.StateRegistry] holds.
        ranks: the strategy's collectives over the current world (its rank and world size name the shard).
    """

    def __init__(self, driver: StepDriver, ranks: Callable[[], Ranks]) -> None:
        self.driver = driver
        self.ranks = ranks

    def save(
        self,
        checkpoint: dict[str, Any],
        path: StrPath,
        contents: dict[str, Any],
        write_file: Callable[[], None],
        earlier: shards.EarlierShards | None = None,
    ) -> None:
        """Every rank writes its shard (`contents`:
        [`shard_contents`][lightning_decentral.driver.StepDriver.shard_contents]), then `write_file` the checkpoint file
        ([`save_with_shards`][lightning_decentral.checkpoint.save_with_shards];
        `earlier`: this rank's shard of an earlier save of the step, to link)."""
        ranks = self.ranks()

        def make_shard(save_id: int) -> dict[str, Any]:
            return shards.make_shard(save_id, ranks.rank, ranks.world_size, **contents)

        shards.save_with_shards(ranks, checkpoint, path, make_shard=make_shard, write_file=write_file, earlier=earlier)

    def read(self, path: StrPath, meta: dict[str, int] | None) -> dict[str, Any] | None:
        """This rank's shard of the save `meta` (the checkpoint file's) names, if every rank can read its own (else
        `None` on every rank and one warning saying why); a resume under another update rule warns."""
        shard = shards.load_own_shard(self.ranks(), path, meta, rank_zero_warn)
        if shard is not None:
            changed = shards.rule_change_warning(path, shard, self.driver.rule_record())
            if changed is not None:
                rank_zero_warn(changed)
        return shard

    def restore(self, shard: dict[str, Any], step: int, full: bool = True) -> None:
        """Every registered part (the random state among them) from `shard`, saved at `step` (checked first;
        `full=False`: a load without the optimizer state restores none that needs it)."""
        shards.check_saved_step(shard, step)
        self.driver.state.load([shard], full)
