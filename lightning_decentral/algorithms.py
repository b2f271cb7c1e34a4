"""The update rules of the [algorithms page](../algorithms.md) as small in-place functions on flat buffers.

The user's optimizer step `U` and the gossip `W` are done elsewhere (by the optimizer and by
[`lightning_decentral.gossip`][lightning_decentral.gossip]); these functions hold the arithmetic
that joins them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def add_(target: Sequence[Tensor], correction: Sequence[Tensor]) -> None:
    """`target <- target + correction` on matching flat buffers.

    Adapt-with-combine ([D-PSGD, AWC](../algorithms.md#d-psgd-adapt-with-combine-strategydpsgd-default-combineawc)):
    `x(k+1) = U(x(k), g) + (W x(k) - x(k))`; the gossip engine forms the correction
    `W x(k) - x(k)` (`Gossip.start(..., out=)`).

    Examples:
        >>> import torch
        >>> x = [torch.tensor([1.0, 2.0])]  # U(x(k), g)
        >>> add_(x, [torch.tensor([0.5, -0.5])])  # + (W x(k) - x(k))
        >>> x[0].tolist()
        [1.5, 1.5]
    """
    for t, c in zip(target, correction):
        t.add_(c)


def decentlam_trial_point_(z: Tensor, x: Tensor, grad: Tensor, lr: float | None, scale: float | Tensor = 1.0) -> None:
    """`z <- x − γ g`, the [DecentLaM](../algorithms.md#decentlam-strategydecentlam-momentumdecentlam)
    trial step that is sent (not applied), with `g = grad / scale` and `γ = lr`.

    `lr=None` (a parameter the optimizer does not update) sends `z = x`; `γ = 0` (warm-up from
    zero) sends `z = g`, so that [`decentlam_gradient_`][lightning_decentral.algorithms.decentlam_gradient_]
    gives `g̃ = W g`.

    Examples:
        >>> import torch
        >>> x, grad, z = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -4.0]), torch.empty(2)
        >>> decentlam_trial_point_(z, x, grad, lr=0.25, scale=2.0)  # x − 0.25 · grad / 2
        >>> z.tolist()
        [0.5, 2.5]
        >>> decentlam_trial_point_(z, x, grad, lr=None)
        >>> z.tolist()
        [1.0, 2.0]
    """
    if lr is None:
        z.copy_(x)
    elif lr == 0:
        z.copy_(grad).div_(scale)
    else:
        z.copy_(grad).mul_(-lr).div_(scale).add_(x)


def decentlam_gradient_(grad: Tensor, x: Tensor, mixed: Tensor, lr: float) -> None:
    """`grad <- g̃ = (x − W z) / γ = W g + (I − W) x / γ` (`W g` when `γ = 0`), with `mixed = W z`
    and `γ = lr`.

    The user's optimizer then steps with `g̃`: `x(k+1) = U(x(k), g̃)`
    ([DecentLaM](../algorithms.md#decentlam-strategydecentlam-momentumdecentlam)).

    Examples:
        >>> import torch
        >>> x, mixed, grad = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5]), torch.empty(2)
        >>> decentlam_gradient_(grad, x, mixed, lr=0.5)  # (x − W z) / 0.5
        >>> grad.tolist()
        [1.0, -1.0]
    """
    if lr == 0:
        grad.copy_(mixed)
    else:
        torch.sub(x, mixed, out=grad).div_(lr)
