"""The update rules of ALGORITHMS.md as small in-place functions on flat buffers.

The user's optimizer step ``U`` and the gossip ``W`` are done elsewhere (by the
optimizer and by :mod:`lightning_decentral.gossip`); these functions hold the
arithmetic that joins them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor


def add_(target: Sequence[Tensor], correction: Sequence[Tensor]) -> None:
    """``target <- target + correction`` on matching flat buffers.

    Adapt-with-combine: ``x(k+1) = U(x(k), g) + (W x(k) - x(k))``; the gossip engine forms the
    correction (``Gossip.start(..., out=)``).
    """
    for t, c in zip(target, correction):
        t.add_(c)


def decentlam_trial_point_(
    z: Tensor, x: Tensor, grad: Tensor, lr: Optional[float], scale: Union[float, Tensor] = 1.0
) -> None:
    """``z <- x − γ g``, the DecentLaM trial step that is sent (not applied); ``g = grad / scale``.

    ``lr=None`` (a parameter the optimizer does not update) sends ``z = x``; ``γ = 0`` (warm-up
    from zero) sends ``z = g``, so that :func:`decentlam_gradient_` gives ``g̃ = W g``.
    """
    if lr is None:
        z.copy_(x)
    elif lr == 0:
        z.copy_(grad).div_(scale)
    else:
        z.copy_(grad).mul_(-lr).div_(scale).add_(x)


def decentlam_gradient_(grad: Tensor, x: Tensor, mixed: Tensor, lr: float) -> None:
    """``grad <- g̃ = (x − W z) / γ = W g + (I − W) x / γ`` (``W g`` when ``γ = 0``).

    The user's optimizer then steps with ``g̃``: ``x(k+1) = U(x(k), g̃)``.
    """
    if lr == 0:
        grad.copy_(mixed)
    else:
        torch.sub(x, mixed, out=grad).div_(lr)
