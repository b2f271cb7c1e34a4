"""[`Gossip`][lightning_decentral.gossip.Gossip], the mixer of one rank over `torch.distributed` (the package docstring
says how it exchanges; [`PendingGossip`][lightning_decentral.gossip.PendingGossip], in `exchange.py`, is one exchange
in flight)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral.failures import PeerFailure, peers_answer, wait_works
from lightning_decentral.gossip.exchange import PendingGossip
from lightning_decentral.mixing import ExchangeEvent, Watch, Watched, raise_if_not_finite
from lightning_decentral.topology import Hierarchical, Topology

_TRANSPORTS = (None, "p2p", "broadcast")


class Gossip(Watched):
    """`x <- W(k)^r x` over a process group, for a bound topology: the
    [`Mixer`][lightning_decentral.mixing.Mixer] of rank `i` when every worker is a process.

    Args:
        topology: a topology bound to the group's size; rank `i` of the topology is rank `i`
            of the group.
        group: the process group to talk on (default: the world).
        dtype: the floating-point type point-to-point messages travel in (`torch.bfloat16`,
            `torch.float16`); `None` sends the buffers' own. See the module docstring.
        transport: neighbour messages as `"p2p"` (`None`, the default) or `"broadcast"`
            (a 2-rank subgroup per edge, gloo only; see the module docstring).
        timeout: the timeout of the subgroups the engine creates (hierarchical levels, edges);
            `None`: torch's default. The strategy passes its own `timeout`.
        watch: the observers, residual measurement, error phrasing and survival its owner (the driver) shares with
            it ([`Watch`][lightning_decentral.mixing.Watch]); `None`: a new one (no observers, a failure stops the run).

    Examples:
        Inside a process group (every rank runs this, with the same `k`):

        ```python
        from lightning_decentral.topology import resolve_topology

        gossip = Gossip(resolve_topology("ring", dist.get_world_size()), dtype=torch.bfloat16)
        gossip.start([flat], step=k).wait()          # flat <- flat + W q - q, q = bf16(flat)
        ```

        Without processes, the [`DenseMixer`][lightning_decentral.mixing.DenseMixer] runs the same
        exchange for all ranks at once.
    """

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        transport: str | None = None,
        timeout: timedelta | None = None,
        watch: Watch | None = None,
    ) -> None:
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {list(_TRANSPORTS)}, got {transport!r}.")
        self.topology = topology
        self.group = group
        self.dtype = dtype
        size = dist.get_world_size(group)
        if size != topology.world_size:
            raise ValueError(
                f"The topology is bound to {topology.world_size} ranks but the process group has "
                f"{size}; bind it to the group's size."
            )
        world = self._on(group)
        self._receive: dict[tuple[int, int], Tensor] = {}
        self._wire: dict[int, Tensor] = {}  # low precision: q per buffer index (tag + b)
        self._scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._timeout = timeout
        self.watch = watch if watch is not None else Watch()
        self.generation = 0  # how many times the engine was rebound to the survivors of a failure
        self.transport = transport
        self._subgroups(world)

    def _subgroups(self, world: dist.ProcessGroup) -> None:
        """The subgroups the topology and transport need (every rank creates every one, in order)."""
        self._stages = self._hierarchical_stages(world) if isinstance(self.topology, Hierarchical) else []
        self._edge_groups: dict[int, dist.ProcessGroup] = {}  # peer -> the 2-rank subgroup of that edge
        if self.transport == "broadcast":
            self._edge_groups = _pair_groups(self.topology, self._global, self.rank, self.group, self._timeout)

    def _on(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        """Talk on `group` (`None`: the default group): this rank's rank in it and the global rank of each of its
        ranks (P2P ops take global ranks); returns the group."""
        world = group if group is not None else dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(world)
        self._global = [dist.get_global_rank(world, r) for r in range(dist.get_world_size(world))]
        return world

    def rebind(self, topology: Topology, group: dist.ProcessGroup | None = None) -> None:
        """Mix with `topology` from now on, on `group` of the survivors' default process group (`None`: that group
        itself): the survivors of a failure, after they replaced the default group by theirs (every survivor calls it
        together; sharded replicas pass the survivors' group of this rank's mesh column). The subgroups of the old
        group are gone with it; exchanges of the old generation still in flight are discarded when waited for."""
        size = dist.get_world_size(group)
        if size != topology.world_size:
            raise ValueError(f"The survivors' topology has {topology.world_size} ranks, their process group {size}.")
        self.topology = topology
        self.generation += 1
        self._subgroups(self._on(group))

    def groups(self) -> list[dist.ProcessGroup]:
        """The process groups the engine talks on besides the default one (its own, and its subgroups)."""
        own = [self.group] if self.group is not None else []
        return own + [g for stage in self._stages for g in stage.groups()] + list(self._edge_groups.values())

    def _hierarchical_stages(self, world: dist.ProcessGroup) -> list[Gossip]:
        """One engine per level the rank takes part in: on its node, then on its group across nodes
        ([`Hierarchical.levels`][lightning_decentral.topology.Hierarchical.levels]).

        Every rank creates every subgroup, in the same order (`new_group` is collective).
        """
        topology = self.topology
        assert isinstance(topology, Hierarchical)
        backend = dist.get_backend(world)
        stages = []
        for level in topology.levels():
            mine = None
            for group, part in zip(*level):
                subgroup = dist.new_group([self._global[r] for r in group], backend=backend, timeout=self._timeout)
                if self.rank in group:
                    mine = subgroup, part
            if mine is not None:  # point-to-point: edge subgroups would need every rank of the world
                stages.append(Gossip(mine[1], group=mine[0], dtype=self.dtype, transport="p2p", timeout=self._timeout))
        return stages

    def start(
        self,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int = 1,
        tag: int = 0,
        out: Sequence[Tensor] | None = None,
        check_finite: bool = True,
    ) -> PendingGossip:
        """Post round one of `rounds` exchanges of `buffers` with `W(step)`.

        The buffers must not be written until `wait()` returns. Without `out` they end as
        `W^r x`; with `out` (tensors like the buffers) they are only read and `out` ends as
        `W^r x − x`. Exchanges in flight at the same time need distinct tags: buffer `b`
        travels with tag `tag + b`. `check_finite`: raise `FloatingPointError` before
        anything is sent if a buffer holds a NaN or an Inf
        ([`raise_if_not_finite`][lightning_decentral.mixing.raise_if_not_finite]). A step whose
        `W` is the identity sends nothing; one whose `W` is the exact average runs once (`W^r = W`).
        """
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        event = None
        if self.observers:
            event = ExchangeEvent(step, tag, rounds, rounds * self.bytes_sent(buffers, step), time.perf_counter())
        if self.topology.is_identity(step):
            rounds = 0
            for o in out or []:
                o.zero_()
        elif self.topology.is_average(step):
            rounds = 1  # W is a projection: W^r = W
        if rounds and check_finite:
            raise_if_not_finite(buffers, self.rank, step, self.phrasing)
        return PendingGossip(self, buffers, step, rounds, tag, out, event)

    @classmethod
    def on_new_group(
        cls,
        topology: Topology,
        device: torch.device,
        backend: str | None = None,
        timeout: timedelta | None = None,
        dtype: torch.dtype | None = None,
        watch: Watch | None = None,
    ) -> Gossip:
        """An engine on a new process group of every rank, with `timeout` (else torch's 30 minutes): a
        dead peer ends every rank's exchange within it. Every rank calls it together."""
        group = dist.new_group(backend=backend, timeout=timeout)
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # NCCL: every rank joins first
        return cls(topology, group=group, dtype=dtype, timeout=timeout, watch=watch)

    def leave(self, step: int = 0) -> None:
        """Every rank leaves the engine's group together, then destroys it (with its subgroups), so that
        repeated runs in one process do not accumulate groups (threads, sockets). The barrier comes first:
        a rank destroying the group closes its connections, which must not happen while a slower peer is
        still receiving its last message. Call it only after a clean run (the other ranks may be gone
        after an error, and those still waiting end through the timeout). With a survival, a failure in the
        barrier has the survivors agree (this rank at `step`, its steps done) and the barrier runs again among them."""
        what = "Finishing training together (a barrier of every rank after the last step)"
        peers = "a rank still training (do all ranks run the same number of steps and batches?) or a rank that"
        while True:
            survival = self.survival
            if survival is not None:
                survival.form()  # the survivors of a failure that came after their last exchange
            try:
                with peers_answer(what, peers):
                    barrier = dist.barrier(group=self.group, async_op=True)
                wait_works([barrier], survival and survival.poll, what, peers)
                break
            except PeerFailure as failure:
                if survival is None:
                    raise
                survival.survive(step, failure)
        self.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)

    def abort(self) -> None:
        """After a failure: nothing to end (an exchange runs on the caller's thread, which the error has left)."""

    def close(self) -> None:
        """Destroy the subgroups this engine created (edges, hierarchical levels); not `group` itself."""
        for stage in self._stages:  # each stage runs on a subgroup of this rank's (see _hierarchical_stages)
            stage.close()
            dist.destroy_process_group(stage.group)
        for subgroup in self._edge_groups.values():
            dist.destroy_process_group(subgroup)
        self._stages = []
        self._edge_groups = {}

    def neighbour_names(self, step: int) -> list[str]:
        """The global ranks this rank exchanges with at step `step`, as `"rank j"` (`"every rank"` for an all-reduce).

        Examples:
            Rank 0 of a ring of 4 exchanges with `["rank 1", "rank 3"]`.
        """
        names: list[str] = []
        for leg in self.legs(step):
            if leg.topology.is_average(step):
                return ["every rank"]
            peers = {p for p, _ in leg.topology.in_neighbors(leg.rank, step)} | {
                p for p, _ in leg.topology.out_neighbors(leg.rank, step)
            }
            names += [f"rank {leg._global[p]}" for p in sorted(peers)]
        return names

    def bytes_sent(self, buffers: Sequence[Tensor], step: int) -> int:
        """Bytes this rank sends for one round of `start(buffers, step)` (all-reduce: the ring figure)."""
        return sum(leg._leg_bytes(buffers, step) for leg in self.legs(step))

    # -- transport -----------------------------------------------------------------

    def legs(self, step: int) -> list[Gossip]:
        """The engines one round runs in order: this one, or a hierarchical topology's levels."""
        if self.topology.is_identity(step):
            return []
        if self._stages and not self.topology.is_average(step):
            return [stage for stage in self._stages if not stage.topology.is_identity(step)]
        return [self]

    def _leg_bytes(self, buffers: Sequence[Tensor], step: int) -> int:
        if self.topology.is_average(step):  # a ring all-reduce sends 2(n-1)/n of the buffer, full precision
            n = self.topology.world_size
            return sum(b.numel() * b.element_size() for b in buffers) * 2 * (n - 1) // n
        size = sum(b.numel() * self._wire_dtype(b).itemsize for b in buffers)
        return size * len(self.topology.out_neighbors(self.rank, step))

    def _wire_dtype(self, buffer: Tensor) -> torch.dtype:
        return buffer.dtype if self.dtype is None else self.dtype

    def post(self, buffers: Sequence[Tensor], step: int, tag: int) -> tuple[list[dist.Work], list[int | None]]:
        """Post one exchange of this engine's own group (a leg of a round, for
        [`PendingGossip`][lightning_decentral.gossip.PendingGossip]): the works, and the peer (global rank) of each,
        `None` where a work has several."""
        if self.topology.is_average(step):
            return [dist.all_reduce(b, group=self.group, async_op=True) for b in buffers], []
        ops = []
        works = []
        peers = []
        for index, buffer in enumerate(buffers):
            sent = self._sent(buffer, tag + index)
            if self._edge_groups:
                posted = self._post_broadcasts(sent, step, tag + index)
                works += [work for work, _ in posted]
                peers += [peer for _, peer in posted]
                continue
            # Receives are posted before sends: with sends first, two ranks exchanging over one gloo
            # connection moved one direction after the other (twice the time on the emulated 1 Gbit/s
            # link, docs/benchmarks.md "Transport per backend").
            for slot, (peer, _) in enumerate(self.topology.in_neighbors(self.rank, step)):
                receive = self._receive_buffer(tag + index, slot, sent)
                ops.append(dist.P2POp(dist.irecv, receive, self._global[peer], self.group, tag=tag + index))
            for peer, _ in self.topology.out_neighbors(self.rank, step):
                ops.append(dist.P2POp(dist.isend, sent, self._global[peer], self.group, tag=tag + index))
        p2p = dist.batch_isend_irecv(ops) if ops else []  # none: a rank alone at this step (custom W)
        if len(p2p) == len(ops):  # one work per operation (gloo; NCCL coalesces them into one)
            peers += [op.peer for op in ops]
        return works + p2p, peers if len(peers) == len(works) + len(p2p) else []

    def post_messages(
        self, sends: Mapping[int, Tensor], receives: Mapping[int, Tensor], tag: int = 0
    ) -> tuple[list[dist.Work], list[int | None]]:
        """Post one message to each peer of `sends` and one receive into each tensor of `receives` (peers are ranks of
        this engine's topology; any dtype, of sizes both ends agree on), point-to-point, receives first as in `post`:
        the works and the peer (global rank) of each, `[]` where the backend coalesces them (NCCL)."""
        ops = [dist.P2POp(dist.irecv, t, self._global[p], self.group, tag=tag) for p, t in receives.items()]
        ops += [dist.P2POp(dist.isend, t, self._global[p], self.group, tag=tag) for p, t in sends.items()]
        works = dist.batch_isend_irecv(ops) if ops else []
        return works, [op.peer for op in ops] if len(works) == len(ops) else []

    def _post_broadcasts(self, sent: Tensor, step: int, key: int) -> list[tuple[dist.Work, int]]:
        """Each edge's subgroup carries its messages as broadcasts, the lower rank's first, on both ends."""
        sends_to = {peer for peer, _ in self.topology.out_neighbors(self.rank, step)}
        slots = {peer: slot for slot, (peer, _) in enumerate(self.topology.in_neighbors(self.rank, step))}
        works = []
        for peer in sorted(sends_to | slots.keys()):
            for source in sorted(r for r, sends in ((self.rank, peer in sends_to), (peer, peer in slots)) if sends):
                tensor = sent if source == self.rank else self._receive_buffer(key, slots[peer], sent)
                works.append(
                    (
                        dist.broadcast(tensor, src=self._global[source], group=self._edge_groups[peer], async_op=True),
                        self._global[peer],
                    )
                )
        return works

    def _sent(self, buffer: Tensor, key: int) -> Tensor:
        """What goes on the wire for `buffer`: itself, or `q` = it rounded to `dtype`."""
        if self._wire_dtype(buffer) == buffer.dtype:
            return buffer
        wire = self._wire.get(key)
        if wire is None or wire.shape != buffer.shape or wire.device != buffer.device or wire.dtype != self.dtype:
            wire = self._wire[key] = torch.empty_like(buffer, dtype=self.dtype)
        return wire.copy_(buffer)

    def combine(
        self,
        buffers: Sequence[Tensor],
        step: int,
        tag: int,
        measure: bool = False,
        into: Sequence[Tensor] | None = None,
    ) -> list[Tensor]:
        """Finish one exchange of this engine's group (after its works of `post`): `x <- x + delta`,
        `delta = Σ_j w_ij s_j − s_i` (`s` = what was sent: `x`, or `q` in low precision). With `into` the buffers stay
        as they are and `into` gets `delta`. `measure`: return `‖delta‖²` per buffer (the all-reduce path leaves that
        to the caller)."""
        if self.topology.is_average(step):
            for buffer in buffers:
                buffer.div_(self.topology.world_size)
            return []
        self_weight = self.topology.self_weight(self.rank, step)
        neighbors = self.topology.in_neighbors(self.rank, step)
        residuals = []
        for index, buffer in enumerate(buffers):
            sent = self._sent_buffer(buffer, tag + index)
            if into is None and not measure and sent is buffer:  # the plain x <- W x, one pass fewer
                buffer.mul_(self_weight)
                for slot, (_, weight) in enumerate(neighbors):
                    buffer.add_(self._receive[(tag + index, slot)], alpha=weight)
                continue
            delta = into[index] if into is not None else self._scratch_like(buffer)
            if sent.dtype == delta.dtype:
                torch.mul(sent, self_weight - 1, out=delta)
            else:  # widen q exactly first, then scale in the buffer's precision
                delta.copy_(sent).mul_(self_weight - 1)
            for slot, (_, weight) in enumerate(neighbors):
                delta.add_(self._receive[(tag + index, slot)], alpha=weight)
            if measure:
                residuals.append(torch.dot(delta.reshape(-1), delta.reshape(-1)))
            if into is None:
                buffer.add_(delta)
        return residuals

    def _sent_buffer(self, buffer: Tensor, key: int) -> Tensor:
        return buffer if self._wire_dtype(buffer) == buffer.dtype else self._wire[key]

    def _scratch_like(self, like: Tensor) -> Tensor:
        """A temporary of `like`'s size: a view into one growing buffer per (device, dtype)."""
        key = (like.device, like.dtype)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < like.numel():
            scratch = self._scratch[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return scratch[: like.numel()].view_as(like)

    def _receive_buffer(self, tag: int, slot: int, like: Tensor) -> Tensor:
        buffer = self._receive.get((tag, slot))
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._receive[(tag, slot)] = torch.empty_like(like)
        return buffer


def _pair_groups(
    topology: Topology,
    global_ranks: list[int],
    rank: int,
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
) -> dict[int, dist.ProcessGroup]:
    """A 2-rank subgroup per pair of neighbours over one period, by this rank's neighbour (`transport="broadcast"`);
    every rank creates every one, in order."""
    n = topology.world_size
    pairs = sorted(
        {
            (min(i, j), max(i, j))
            for k in range(topology.period)
            if not topology.is_average(k)
            for i in range(n)
            for j, _ in topology.in_neighbors(i, k)
        }
    )
    if len(pairs) > 4 * n or dist.get_backend(group or dist.group.WORLD) != "gloo":
        raise ValueError(
            f"transport='broadcast' needs the gloo backend and at most 4 edges per rank ({len(pairs)} "
            f"edges for {n} ranks here); use transport=None or 'p2p'."
        )
    groups = {}
    for pair in pairs:
        subgroup = dist.new_group([global_ranks[r] for r in pair], timeout=timeout)
        if rank in pair:
            groups[pair[1] if pair[0] == rank else pair[0]] = subgroup
    return groups
