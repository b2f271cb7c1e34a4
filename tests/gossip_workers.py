"""Worker functions that drive :class:`~lightning_decentral.gossip.Gossip` directly (no Lightning)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_decentral.gossip import Gossip
from lightning_decentral.topology import resolve_topology


def exchange(rank: int, world_size: int, topology: str, step: int, rounds: int) -> dict:
    """Gossip two float64 buffers, measuring the residual; also once without measuring."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        gossip = Gossip(resolve_topology(topology, world_size))
        generator = torch.Generator().manual_seed(rank)
        before = [torch.randn(10, generator=generator, dtype=torch.float64), torch.randn(3, generator=generator, dtype=torch.float64)]
        measured = [b.clone() for b in before]
        gossip.measure_residual = True
        pending = gossip.start(measured, step, rounds)
        pending.wait()
        gossip.measure_residual = False
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
    finally:
        dist.destroy_process_group()
