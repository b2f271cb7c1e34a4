"""Fabric checkpoints of this package's strategy: `x̄` and the averaged optimizer state in the file, one shard per
rank beside it ([`checkpoint`][lightning_decentral.checkpoint]), the optimizer step `k` under `STEP_KEY`; and a model
as a LightningModule holds it ([`under_prefix`][lightning_decentral.fabric.under_prefix]), to load a Trainer's
checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import checkpoint as shards
from lightning_decentral.agreement import Ranks, mean_optimizer_state
from lightning_decentral.driver import StepDriver
from lightning_decentral.files import StrPath, with_atomic_writes
from lightning_decentral.membership import Survivors, form_for_save
from lightning_decentral.membership.guard import Guard

STEP_KEY = "decentralized_step"  # in a checkpoint file Fabric saved: the strategy's optimizer step k


class PrefixedModule:
    """`module` as a LightningModule holds it, under an attribute: every name of its state dict starts with `prefix`
    (`"net."` for `self.net`). Built by [`under_prefix`][lightning_decentral.fabric.under_prefix]."""

    def __init__(self, module: Module, prefix: str) -> None:
        self.module = module
        self.prefix = prefix

    def state_dict(self) -> dict[str, Any]:
        """The module's state dict, each name prefixed."""
        return {self.prefix + name: value for name, value in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load the entries of `state_dict` whose names start with the prefix into the module (others are the
        LightningModule's other attributes: left); every weight of the module must be there (`strict`)."""
        own = {name[len(self.prefix) :]: value for name, value in state_dict.items() if name.startswith(self.prefix)}
        load_every_weight(self.module, own, strict, found=list(state_dict))


def under_prefix(module: Module, prefix: str) -> PrefixedModule:
    """`module`'s state under the names a LightningModule that holds it as an attribute gives it, for
    `fabric.load` of a Trainer checkpoint (whose `state_dict` is the LightningModule's):

    ```python
    fabric.load("trainer.ckpt", {"state_dict": under_prefix(model, "net.")})  # the LightningModule had self.net = model
    ```

    Every weight of `model` is loaded from `net.<name>` (`x̄`, then this rank's own replica from its shard), or
    the load fails naming the weights it misses; `fabric.strategy.step` becomes the checkpoint's `global_step`.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> sorted(under_prefix(net, "net.").state_dict())
        ['net.bias', 'net.weight']
    """
    return PrefixedModule(module.module if is_wrapped(module) else module, prefix)  # the module fabric.setup wrapped


def load_every_weight(module: Module, state_dict: dict[str, Any], strict: bool, found: list[str] | None = None) -> None:
    """`module.load_state_dict(state_dict, strict)`, but an error naming the keys when not one of the module's
    names is in `state_dict` (nothing would load; `found`: the names the file holds, default `state_dict`'s), and a
    warning naming the weights a non-strict load leaves as they were."""
    expected = list(module.state_dict())
    found = list(state_dict) if found is None else found
    missing = [name for name in expected if name not in state_dict]
    if expected and len(missing) == len(expected):
        raise KeyError(_nothing_matches(expected, found))
    result = module.load_state_dict(state_dict, strict=strict)
    if result is not None and result.missing_keys:
        rank_zero_warn(
            f"fabric.load(strict=False) left {len(result.missing_keys)} of the model's {len(expected)} entries as they "
            f"were (not in the checkpoint): {result.missing_keys[:5]}{' ...' if len(result.missing_keys) > 5 else ''}"
        )


def _nothing_matches(expected: list[str], found: list[str]) -> str:
    """The error of a load that would restore none of the model's weights, with the prefix that fits, if one does."""
    prefixes = {name[: -len(expected[0])] for name in found if name.endswith("." + expected[0])}
    fits = sorted(p for p in prefixes if all(p + name in found for name in expected))
    advice = (
        f"The checkpoint holds them under the prefix {fits[0]!r} (a LightningModule that held this model as "
        f"`self.{fits[0][:-1]}`): load with `fabric.load(path, {{'state_dict': under_prefix(model, {fits[0]!r})}})` "
        "(`from lightning_decentral.fabric import under_prefix`)."
        if fits
        else "Load the entry that holds this model's state dict, or map its names with `under_prefix(model, prefix)`."
    )
    return (
        f"The checkpoint holds none of the model's weights, so nothing would load: the model has {expected[:3]}"
        f"{' ...' if len(expected) > 3 else ''} and the checkpoint {found[:3]}{' ...' if len(found) > 3 else ''}. "
        + advice
    )


class ShardedCheckpoints:
    """`fabric.save` and `fabric.load` of Fabric's
    [`DecentralizedStrategy`][lightning_decentral.fabric.DecentralizedStrategy] (the strategy's own checkpoint hooks,
    kept apart from its step)."""

    step: int  # and Fabric's DDPStrategy's: global_rank, world_size, precision, checkpoint_io, load/save_checkpoint
    driver: StepDriver
    guard: Guard
    _module: Module | None
    _optimizer: Optimizer | None
    _ranks: Ranks
    averaged_model: Callable[..., AbstractContextManager]
    check_outside_the_graph: Callable[[str], None]
    agree: Callable[[str], None]
    survivors: Survivors | None
    rule_record: Callable[[], dict[str, str]]
    rule_state: Callable[[], dict[str, Any]]
    load_rule_state: Callable[[dict[str, Any]], None]

    def save_checkpoint(
        self,
        path: StrPath,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Runs in `fabric.save`, on every rank: the file holds `x̄` and the averaged optimizer state; each
        rank writes its shard beside it, then rank 0 the file
        ([`save_with_shards`][lightning_decentral.checkpoint.save_with_shards]). In the steps the survivors of a failure
        take alone, they make their process group first
        ([`form_for_save`][lightning_decentral.membership.form_for_save])."""
        module_key, optimizer_key = self._keys(state)
        if module_key is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        self.check_outside_the_graph("fabric.save")
        self.guard.operation(
            lambda: self._save_sharded(path, state, storage_options, filter, module_key, optimizer_key)
        )
        return None

    def _save_sharded(
        self,
        path: StrPath,
        state: dict[str, Any],
        storage_options: Any,
        filter: Any,
        module_key: str,
        optimizer_key: str | None,
    ) -> None:
        """`save_checkpoint` with the module at `state[module_key]`: one operation of the guard (a failure survived
        during it starts it again: every survivor is in this save, and they make their group first)."""
        form_for_save(self.survivors)  # in the steps the survivors of a failure take alone: their group first
        self.agree(f"fabric.save({str(path)!r})")
        with self.averaged_model(
            agree=False
        ):  # agreed above: the averaging's all-reduce is the save's first collective
            converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
            converted[module_key] = {
                k: v.clone() if isinstance(v, Tensor) else v for k, v in converted[module_key].items()
            }
        if optimizer_key is not None:
            converted[optimizer_key] = mean_optimizer_state(self._ranks, converted[optimizer_key])
        converted[STEP_KEY] = self.step

        def make_shard(save_id: int) -> dict[str, Any]:
            contents = self.driver.shard_contents(
                0,
                state_dict=state[module_key].state_dict(),
                step=self.step,
                optimizer_states=[self._optimizer.state_dict()] if optimizer_key is not None else None,
                precision=self.precision.state_dict(),
            )
            return shards.make_shard(save_id, self.global_rank, self.world_size, **contents)

        def write_file() -> None:
            if self.is_global_zero:
                io = with_atomic_writes(self.checkpoint_io)  # unless a CheckpointIO of your own writes it
                io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

        shards.save_with_shards(self._ranks, converted, path, make_shard=make_shard, write_file=write_file)

    def load_checkpoint(
        self,
        path: StrPath,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Runs in `fabric.load`, on every rank: restore `x̄` and the averaged optimizer state; then, if every
        rank finds its shard of the same save at the same world size, its own replica, optimizer, precision
        and RNG state (exact resume); else rank 0 warns once, saying why. `k` is restored too.

        The model is found in `state` by identity, or as
        [`under_prefix(model, ...)`][lightning_decentral.fabric.under_prefix]; a checkpoint that holds none of its
        weights is an error naming the keys, before anything is restored."""
        module_key, optimizer_key = self._keys(state) if isinstance(state, dict) else (None, None)
        if module_key is not None:
            self.check_outside_the_graph("fabric.load")
            self.agree(f"fabric.load({str(path)!r})")
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
        target = state[module_key]
        if isinstance(target, PrefixedModule):
            target.load_state_dict(shard["state_dict"], strict=strict)
        else:
            self.load_module_state_dict(target, shard["state_dict"], strict=strict)
        if optimizer_key is not None and "optimizer_states" in shard:
            set_up_first(self._optimizer).load_state_dict(shard["optimizer_states"][0])
        if shard.get("precision"):
            self.precision.load_state_dict(shard["precision"])
        self.driver.state.load([shard], full=optimizer_key is not None)
        if self.driver.options.compression is not None:  # both ends of every edge resume with the same public copies
            self._ranks.check_same_public_copies(self.driver.copies.state() or shard.get("gossip"))
        return remainder

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Runs in `fabric.load` for a module: its state, or an error naming the keys when the checkpoint holds none
        of its weights ([`load_every_weight`][lightning_decentral.fabric.checkpoints.load_every_weight])."""
        load_every_weight(module, state_dict, strict)

    def _keys(self, state: dict[str, Any]) -> tuple[str | None, str | None]:
        """The keys under which `state` holds this strategy's module (itself, or under a prefix) and optimizer."""

        def found(target: Any) -> str | None:
            for key, value in state.items():
                if target is not None and (
                    value is target or (isinstance(value, PrefixedModule) and value.module is target)
                ):
                    return key
            return None

        return found(self._module), found(self._optimizer)


def set_up_first(value: Any | None) -> Any:
    """`value` (the model or optimizer the strategy set up), or an error saying to set them up first."""
    if value is None:
        raise RuntimeError(
            "Set up the model and its optimizer first: `model, optimizer = fabric.setup(model, optimizer)`."
        )
    return value
