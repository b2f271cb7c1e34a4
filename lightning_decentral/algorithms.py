"""The update rules of ALGORITHMS.md as small in-place functions on flat buffers.

The user's optimizer step ``U`` and the gossip ``W`` are done elsewhere (by the
optimizer and by :mod:`lightning_decentral.gossip`); these functions hold the
arithmetic that joins them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def gossip_correction_(mixed: Sequence[Tensor], before: Sequence[Tensor]) -> None:
    """``mixed <- W x(k) - x(k)``: turn the neighbour average into the correction AWC adds.

    Adapt-with-combine: ``x(k+1) = W x(k) + (U(x(k), g) - x(k)) = U(x(k), g) + correction``.
    """
    for m, x in zip(mixed, before):
        m.sub_(x)


def add_(target: Sequence[Tensor], correction: Sequence[Tensor]) -> None:
    """``target <- target + correction`` on matching flat buffers."""
    for t, c in zip(target, correction):
        t.add_(c)
