"""Neighbour exchange on flat buffers over ``torch.distributed``.

The one operation here is in-place gossip, ``x_i <- sum_j W(k)_ij x_j``, applied
``rounds`` times (``W(k)^r``). It is split into ``start`` (post the messages)
and ``wait`` (finish them and combine), so the caller can compute while the
bytes travel::

    gossip = Gossip(topology)
    pending = gossip.start(buffers, step=k)   # non-blocking
    ...                                       # forward / backward
    pending.wait()                            # buffers now hold W(k) x

Each rank derives its sends and receives from the same ``W(k)``, a pure
function of ``k``: every send has its matching receive on the peer, so the
schedule cannot deadlock. One message per neighbour per flat buffer; when
``W(k) = 11ᵀ/n`` a single all-reduce replaces the point-to-point exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral.topology import Topology


def pack_(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Move ``tensors`` into contiguous flat buffers, one per (device, dtype).

    Each tensor's ``.data`` becomes a view into its buffer, so the buffers can
    be sent as they are and writing into a buffer updates the tensors. The
    tensors' identity (and so any optimizer state keyed by them) is kept.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    buffers = []
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        offset = 0
        for t in members:
            t.data = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        buffers.append(flat)
    return buffers


class PendingGossip:
    """An exchange in flight; ``wait()`` completes it and combines in place.

    After ``wait()``, ``residuals`` holds, when the engine measures them, one 0-dim tensor per
    buffer: ``‖x_i − Σ_j w_ij x_j‖²`` of the first round, on this rank (no host sync); ``None``
    when nothing was exchanged or nothing was measured.
    """

    def __init__(self, gossip: "Gossip", buffers: Sequence[Tensor], step: int, rounds: int, tag: int) -> None:
        self._gossip = gossip
        self._buffers = buffers
        self._step = step
        self._rounds_left = rounds
        self._tag = tag
        self.residuals: Optional[list[Tensor]] = None
        if rounds and gossip.measure_residual and gossip.topology.is_average(step):
            self._before = [b.clone() for b in buffers]  # the all-reduce overwrites x_i
        self._works = gossip._post(buffers, step, tag) if rounds else None

    def wait(self) -> None:
        """Block until ``buffers = W(step)^rounds buffers`` on this rank."""
        while self._works is not None:
            for work in self._works:
                work.wait()
            measure = self._gossip.measure_residual and self.residuals is None
            residuals = self._gossip._combine(self._buffers, self._step, self._tag, measure)
            if measure:
                if self._gossip.topology.is_average(self._step):
                    residuals = [(b - x).square().sum() for b, x in zip(self._buffers, self._before)]
                    del self._before
                self.residuals = residuals
            self._rounds_left -= 1
            self._works = self._gossip._post(self._buffers, self._step, self._tag) if self._rounds_left else None


class Gossip:
    """In-place ``x <- W(k)^r x`` over a process group, for a bound topology.

    Args:
        topology: a topology bound to the group's size.
        group: the process group to talk on (default: the world). Peers are
            global ranks, so the group must span every rank of the topology.
    """

    def __init__(self, topology: Topology, group: Optional[dist.ProcessGroup] = None) -> None:
        self.topology = topology
        self.group = group
        self.rank = dist.get_rank()
        if dist.get_world_size(group) != topology.world_size:
            raise ValueError(
                f"The topology is bound to {topology.world_size} ranks but the process group has "
                f"{dist.get_world_size(group)}; bind it to the group's size."
            )
        self._receive: dict[tuple[int, int], Tensor] = {}
        self._scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.measure_residual = False  # also compute ‖x_i − Σ_j w_ij x_j‖² per buffer (see PendingGossip)

    def start(self, buffers: Sequence[Tensor], step: int, rounds: int = 1, tag: int = 0) -> PendingGossip:
        """Post round one of ``rounds`` exchanges of ``buffers`` with ``W(step)``.

        The buffers must not be written until ``wait()`` returns. Exchanges in flight at the
        same time need distinct tags: buffer ``b`` travels with tag ``tag + b``.
        """
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if self.topology.is_identity(step):
            rounds = 0
        elif self.topology.is_average(step):
            rounds = 1  # W is a projection: W^r = W
        return PendingGossip(self, buffers, step, rounds, tag)

    def bytes_sent(self, buffers: Sequence[Tensor], step: int) -> int:
        """Bytes this rank sends for one round of ``start(buffers, step)`` (all-reduce: the ring figure)."""
        size = sum(b.numel() * b.element_size() for b in buffers)
        if self.topology.is_identity(step):
            return 0
        if self.topology.is_average(step):  # a ring all-reduce sends 2(n-1)/n of the buffer
            return size * 2 * (self.topology.world_size - 1) // self.topology.world_size
        return size * len(self.topology.out_neighbors(self.rank, step))

    # -- transport -----------------------------------------------------------------

    def _post(self, buffers: Sequence[Tensor], step: int, tag: int) -> list[dist.Work]:
        if self.topology.is_average(step):
            return [dist.all_reduce(b, group=self.group, async_op=True) for b in buffers]
        ops = []
        for index, buffer in enumerate(buffers):
            for peer, _ in self.topology.out_neighbors(self.rank, step):
                ops.append(dist.P2POp(dist.isend, buffer, peer, self.group, tag=tag + index))
            for slot, (peer, _) in enumerate(self.topology.in_neighbors(self.rank, step)):
                receive = self._receive_buffer(tag + index, slot, buffer)
                ops.append(dist.P2POp(dist.irecv, receive, peer, self.group, tag=tag + index))
        return dist.batch_isend_irecv(ops) if ops else []  # a rank alone at this step (custom W)

    def _combine(self, buffers: Sequence[Tensor], step: int, tag: int, measure: bool = False) -> list[Tensor]:
        """``x <- W x`` in place. ``measure``: form ``delta = W x − x`` in a scratch buffer and add it
        instead, returning ``‖delta‖²`` per buffer (the all-reduce path leaves that to the caller)."""
        if self.topology.is_average(step):
            for buffer in buffers:
                buffer.div_(self.topology.world_size)
            return []
        self_weight = self.topology.self_weight(self.rank, step)
        neighbors = self.topology.in_neighbors(self.rank, step)
        residuals = []
        for index, buffer in enumerate(buffers):
            target = self._scratch_like(buffer) if measure else buffer
            torch.mul(buffer, self_weight - 1 if measure else self_weight, out=target)
            for slot, (_, weight) in enumerate(neighbors):
                target.add_(self._receive[(tag + index, slot)], alpha=weight)
            if measure:
                residuals.append(torch.dot(target, target))
                buffer.add_(target)
        return residuals

    def _scratch_like(self, like: Tensor) -> Tensor:
        """A temporary of ``like``'s size: a view into one growing buffer per (device, dtype)."""
        key = (like.device, like.dtype)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < like.numel():
            scratch = self._scratch[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return scratch[: like.numel()]

    def _receive_buffer(self, tag: int, slot: int, like: Tensor) -> Tensor:
        buffer = self._receive.get((tag, slot))
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._receive[(tag, slot)] = torch.empty_like(like)
        return buffer
