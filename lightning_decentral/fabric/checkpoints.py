"""What Fabric checkpoints of this package's strategy add to Fabric's: the optimizer step `k` under `STEP_KEY`, and a
model as a LightningModule holds it ([`under_prefix`][lightning_decentral.fabric.under_prefix]), to load a Trainer's
checkpoint. `x̄` and the averaged optimizer state go in the file, one shard per rank beside it
([`checkpoint`][lightning_decentral.checkpoint]): the strategy's `save_checkpoint` and `load_checkpoint`, over its
[`ShardedCheckpoints`][lightning_decentral.common.ShardedCheckpoints]."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.wrappers import is_wrapped
from torch.nn import Module

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


def set_up_first(value: Any | None) -> Any:
    """`value` (the model or optimizer the strategy set up), or an error saying to set them up first."""
    if value is None:
        raise RuntimeError(
            "Set up the model and its optimizer first: `model, optimizer = fabric.setup(model, optimizer)`."
        )
    return value
