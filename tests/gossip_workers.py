"""Worker functions that drive :class:`~lightning_decentral.gossip.Gossip` directly (no Lightning)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_decentral.gossip import Gossip
from lightning_decentral.topology import resolve_topology


def exchanges(rank: int, world_size: int, cases: list[tuple[str, int]], rounds: int) -> dict:
    """:func:`exchange` for each ``(topology, step)`` in ``cases``, in one process group."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        return {case: exchange(rank, world_size, *case, rounds) for case in cases}
    finally:
        dist.destroy_process_group()


def exchange(rank: int, world_size: int, topology: str, step: int, rounds: int) -> dict:
    """Gossip two float64 buffers, measuring the residual; also once without measuring."""
    gossip = Gossip(resolve_topology(topology, world_size))
    generator = torch.Generator().manual_seed(rank)
    before = [
        torch.randn(10, generator=generator, dtype=torch.float64),
        torch.randn(3, generator=generator, dtype=torch.float64),
    ]
    measured = [b.clone() for b in before]
    gossip.measure_residuals = True
    pending = gossip.start(measured, step, rounds)
    pending.wait()
    gossip.measure_residuals = False
    plain = [b.clone() for b in before]
    unmeasured = gossip.start(plain, step, rounds)
    unmeasured.wait()
    return {
        "before": before,
        "measured": measured,
        "plain": plain,
        "residuals": [float(r) for r in pending.residuals],
        "unmeasured_residuals": unmeasured.residuals,
    }
