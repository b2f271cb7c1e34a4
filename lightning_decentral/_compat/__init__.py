"""The private names of torch, Lightning and torchmetrics the package needs, in one place, each with the reason no
public API serves: an upgrade that renames one fails one test (`tests/test_compat.py`), not a run.

This module holds torch's and imports nothing from Lightning, so the layers below the update rules may use it;
`_compat.lightning` beside it holds Lightning's and torchmetrics'. Every other module reaches those names only
through these two (`tests/test_compat.py` scans the package), except the members a subclass inherits from a
Lightning class (a private method it overrides, an attribute it reads on itself): those stay in the subclass and are
declared in `_compat.lightning.INHERITED_NAMES`, checked the same way.

Each table row is `(owner, name, why)`: `owner` a module or a class, by its dotted path, `name` the private name in it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d
from torch.optim import Optimizer

PRIVATE_NAMES: list[tuple[str, str, str]] = [
    (
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "the store the default process group was made with: torch has no public accessor",
    ),
    (
        "torch.Tensor",
        "_use_count",
        "how many owners hold a tensor (a gloo work among them): sys.getrefcount counts Python's references only",
    ),
    (
        "torch.Tensor",
        "_version",
        "how many times a tensor was written in place (autograd's version counter): torch has no public accessor",
    ),
    (
        "torch.amp.GradScaler",
        "_scale",
        "the loss scale as a tensor on the device: get_scale() returns a float, a host sync at every step",
    ),
    (
        "torch.optim.Adam",
        "_step_supports_amp_scaling",
        "a fused optimizer's mark that its step() unscales the gradients itself (torch's GradScaler reads it): no "
        "public flag",
    ),
]


def default_store() -> dist.Store:
    """The store the default process group was made with (the group must exist)."""
    return distributed_c10d._get_default_store()


def use_count(tensor: Tensor) -> int:
    """How many owners hold `tensor`'s implementation: Python's references and the C++ ones (a collective in flight).

    Examples:
        >>> import torch
        >>> use_count(torch.zeros(2))
        1
    """
    return tensor._use_count()


def version(tensor: Tensor) -> int:
    """How many times `tensor`'s data was written in place by a torch operation (autograd's version counter, which a
    view shares with its base); a collective writing into it (`dist.all_reduce`) does not count.

    Examples:
        >>> import torch
        >>> flat = torch.zeros(4)
        >>> view, before = flat[:2], version(flat)
        >>> _ = flat.add_(1)
        >>> version(view) - before
        1
    """
    return tensor._version


def grad_scale(scaler: Any) -> Tensor | None:
    """A `GradScaler`'s scale as a device tensor, read without a host sync (`None` before its first `scale`).

    Examples:
        >>> import torch
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> grad_scale(scaler) is None, scaler.scale(torch.ones(())).item(), grad_scale(scaler)
        (True, 65536.0, tensor(65536.))
    """
    return scaler._scale


def unscales_in_step(optimizer: Optimizer) -> bool:
    """Whether `optimizer.step()` unscales the gradients itself under a `GradScaler` (a fused optimizer).

    Examples:
        >>> import torch
        >>> weights = [torch.zeros(1, requires_grad=True)]
        >>> unscales_in_step(torch.optim.Adam(weights, fused=True)), unscales_in_step(torch.optim.Adam(weights))
        (True, False)
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
