"""The process groups of a generation of members: closing the old ones for good, a world of this rank alone while the
survivors agree and go on alone, making the survivors' one."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_POISON_TAG = 2**30 - 7  # a tag no exchange uses


def poison(group: dist.ProcessGroup | None = None) -> bool:
    """Close every connection of `group` (default: the world) on this rank, so that nothing waits on it any more: the
    operations pending on it here fail at once, and so do the peers' operations with this rank.

    Nothing else does both on gloo (torch 2.14): `destroy_process_group`, `abort` and `shutdown` leave pending
    operations pending, here and at the peers. What does is a receive waited with an expired timeout: gloo then
    closes every pair of the group on this rank. Returns whether it was closed that way (`False`: every connection
    was already broken, or the group has one rank).
    """
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    for hop in range(1, size):
        peer = (me + hop) % size
        source = dist.get_global_rank(group, peer) if group is not None else peer
        try:
            dist.irecv(torch.empty(1), src=source, group=group, tag=_POISON_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError as error:
            if "Timed out" in str(error):
                return True
            # this pair is broken already (a dead peer): try the next one
    return False


def rebuild_world(store: Any, prefix: str, rank: int, world_size: int, timeout: timedelta, backend: str) -> None:
    """Replace the default process group by one of `world_size` ranks, this one `rank`, that meet through `prefix` of
    `store` (a prefix never used before: a generation's own). Every member calls it together; it returns once all
    have joined (or raises after `timeout`)."""
    if dist.is_initialized():
        dist.destroy_process_group()  # and every subgroup of it
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timeout
    )


def alone(backend: str, timeout: timedelta) -> None:
    """Replace the default process group by one of this rank alone, on a store of its own: what Lightning or the loop
    runs on the default group (a broadcast, `sync_dist` metrics) then completes on this rank, whatever the others do."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
