"""Fabric checkpoints of this package's strategy: `x̄` and the averaged optimizer state in the file, one shard per
rank beside it ([`checkpoint`][lightning_decentral.checkpoint]), the optimizer step `k` under `STEP_KEY`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import checkpoint as shards
from lightning_decentral.agreement import Ranks, mean_optimizer_state
from lightning_decentral.driver import StepDriver

STEP_KEY = "decentralized_step"  # in a checkpoint file Fabric saved: the strategy's optimizer step k


class ShardedCheckpoints:
    """`fabric.save` and `fabric.load` of Fabric's [`DecentralizedStrategy`][lightning_decentral.fabric.DecentralizedStrategy]
    (the strategy's own checkpoint hooks, kept apart from its step)."""

    step: int  # and Fabric's DDPStrategy's: global_rank, world_size, precision, checkpoint_io, load/save_checkpoint
    driver: StepDriver
    _live: Callable[[Optional[Any]], Any]
    _module: Optional[Module]
    _optimizer: Optional[Optimizer]
    _ranks: Ranks
    averaged_model: Callable[[], AbstractContextManager]
    rule_record: Callable[[], dict[str, str]]

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Runs in `fabric.save`, on every rank: the file holds `x̄` and the averaged optimizer state; each
        rank writes its shard beside it, then rank 0 the file
        ([`save_with_shards`][lightning_decentral.checkpoint.save_with_shards])."""
        module_key, optimizer_key = self._keys(state)
        if module_key is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if self.driver.alone:
            rank_zero_warn(f"{path} is not saved: the survivors of a failure take this step alone, before they mix again.")
            return None
        with self.averaged_model():
            converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
            converted[module_key] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in converted[module_key].items()}
        if optimizer_key is not None:
            converted[optimizer_key] = mean_optimizer_state(self._ranks, converted[optimizer_key])
        converted[STEP_KEY] = self.step

        def make_shard(save_id: int) -> dict[str, Any]:
            return shards.make_shard(
                save_id, self.global_rank, self.world_size, state_dict=self._live(self._module).state_dict(),
                step=self.step, optimizer_states=[self._optimizer.state_dict()] if optimizer_key is not None else None,
                precision=self.precision.state_dict(), rule=self.rule_record(),
            )

        def write_file() -> None:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

        shards.save_with_shards(self._ranks, converted, path, make_shard=make_shard, write_file=write_file)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Runs in `fabric.load`, on every rank: restore `x̄` and the averaged optimizer state; then, if every
        rank finds its shard of the same save at the same world size, its own replica, optimizer, precision
        and RNG state (exact resume); else rank 0 warns once, saying why. `k` is restored too."""
        module_key, optimizer_key = self._keys(state) if isinstance(state, dict) else (None, None)
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if module_key is None:
            return remainder
        meta = remainder.pop(shards.META_KEY, None)
        self.step = int(remainder.pop(STEP_KEY, remainder.get("global_step", 0)))
        shard = shards.load_own_shard(self._ranks, path, meta, rank_zero_warn)
        if shard is None:
            return remainder
        changed = shards.rule_change_warning(path, shard, self.rule_record())
        if changed is not None:
            rank_zero_warn(changed)
        shards.resume_rank_state(shard, self.step)  # the shard's step must be the file's
        self._live(self._module).load_state_dict(shard["state_dict"], strict=strict)
        if optimizer_key is not None and "optimizer_states" in shard:
            self._live(self._optimizer).load_state_dict(shard["optimizer_states"][0])
        if shard.get("precision"):
            self.precision.load_state_dict(shard["precision"])
        return remainder

    def _keys(self, state: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
        """The keys under which `state` holds this strategy's module and optimizer."""
        found = lambda target: next((k for k, v in state.items() if target is not None and v is target), None)  # noqa: E731
        return found(self._module), found(self._optimizer)
