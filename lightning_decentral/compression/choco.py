"""CHOCO gossip with a public copy per edge, one worker's side, apart from any transport:
[`Choco`][lightning_decentral.compression.Choco].

For each edge `j → i` of the graph both ends keep the same copy `x̂_{j→i}` of `x_j`. A round of `W(k)` on worker `i`:

```text
for each out-neighbour j of W(k):   q = C(x_i − x̂_{i→j}),  send q to j,  x̂_{i→j} += q
for each in-neighbour j of W(k):    receive q from j,       x̂_{j→i} += q
x_i += γ (Σ_j w_ij x̂_{j→i} − Σ_j w_ji x̂_{i→j})
```

The update sums to zero over the workers for any `W(k)`, so `x̄` is kept; with exact copies it is `γ (W x − x)_i`
when `W(k)` is doubly stochastic. Out-edges whose copies are equal (active at the same steps) share one copy and one
compression: on a static graph a worker compresses once per round and keeps one copy for all its out-neighbours.
A transport moves the messages (`ChocoExchange.outgoing` to `incoming`):
[`CompressedGossip`][lightning_decentral.gossip.CompressedGossip] between processes,
[`exchange_in_process`][lightning_decentral.compression.exchange_in_process] between workers of one process; the
arithmetic is this module's in both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_decentral.compression import native
from lightning_decentral.compression.compressors import Compressor, RandomK, TopK
from lightning_decentral.compression.fused import chunk_size, decode_add_, encode_update_
from lightning_decentral.topology import Topology


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the public copies of a buffer of `dtype`: at least float32 (a bf16 copy could not absorb small
    `q`)."""
    return torch.promote_types(dtype, torch.float32)


def exchange_seed(step: int, round: int, key: int, sender: int) -> int:
    """The seed of sender `sender`'s message of buffer `key` in round `round` of step `step`, the same on both ends
    (what a random compressor draws from): a 63-bit mix of the four."""
    value = 0
    for part in (step, round, key, sender):
        value = ((value ^ part) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64
        value ^= value >> 29
    return value % 2**63


class EdgeCopies:
    """One worker's public copies of one flat buffer: `sent[s]`, shared by the out-neighbours `j` with
    `slot_of[j] == s` (`x̂_{i→j}`), and `received[j]` (`x̂_{j→i}`); a new copy starts at `origin` (zero without)."""

    def __init__(self, like: Tensor, origin: Tensor | None = None) -> None:
        self.like = torch.empty(0, dtype=state_dtype(like.dtype), device=like.device)
        self.numel = like.numel()
        self.origin = None if origin is None else origin.to(self.like)
        self.sent: list[Tensor] = []
        self.slot_of: dict[int, int] = {}
        self.received: dict[int, Tensor] = {}
        self._work: Tensor | None = None

    def fresh(self) -> Tensor:
        """A new edge's copy: `origin`, or zero."""
        return self.origin.clone() if self.origin is not None else self.like.new_zeros(self.numel)

    @property
    def work(self) -> Tensor:
        """Space for one buffer's worth of arithmetic (`x − x̂`, then `Δ`), kept from round to round."""
        if self._work is None:
            self._work = self.like.new_empty(self.numel)
        return self._work

    def slots_for(self, peers: Sequence[int]) -> dict[int, list[int]]:
        """The slots of `peers` (out-neighbours this round), `{slot: peers}`, split first where a slot is shared with an
        out-neighbour not among them (its copy will differ from now on); a first-time neighbour's copy is `fresh()`."""
        new = [p for p in peers if p not in self.slot_of]
        if new:
            self.sent.append(self.fresh())
            self.slot_of.update((p, len(self.sent) - 1) for p in new)
        active: dict[int, list[int]] = {}
        for peer in peers:
            active.setdefault(self.slot_of[peer], []).append(peer)
        for slot, members in list(active.items()):
            if sum(1 for s in self.slot_of.values() if s == slot) > len(members):
                self.sent.append(self.sent[slot].clone())
                self.slot_of.update((p, len(self.sent) - 1) for p in members)
                active[len(self.sent) - 1] = active.pop(slot)
        return active

    def state_dict(self) -> dict[str, Any]:
        return {"sent": list(self.sent), "slot_of": dict(self.slot_of), "received": dict(self.received)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for copy in list(state["sent"]) + list(state["received"].values()):
            if copy.numel() != self.numel:
                raise ValueError(f"A saved public copy has {copy.numel()} elements; this buffer has {self.numel}.")
        self.sent = [c.to(self.like) for c in state["sent"]]
        self.slot_of = {int(p): int(s) for p, s in state["slot_of"].items()}
        self.received = {int(p): c.to(self.like) for p, c in state["received"].items()}


class Choco:
    """One worker's CHOCO gossip: its compressor `C`, consensus step `γ` and the public copies of each flat buffer
    it exchanges (by key: `tag + index`, as [`Gossip`][lightning_decentral.gossip.Gossip] numbers them).

    `wire_bytes` counts every byte of the messages this worker has handed to its transport.

    Args:
        compressor: `C`.
        consensus_step: `γ`.
        rank: this worker in the topology.
        from_copy: a round ends at `x̂_i + γ Δ` instead of `x_i + γ Δ`, where `x̂_i = Σ_j w_ji x̂_{i→j} / Σ_j w_ji`
            is the worker's own public copy: with `γ = 1` and a static `W`, `Σ_j w_ij x̂_j`, the mixed model every
            neighbour can compute, the residual `x_i − x̂_i` left to the next round's message (what the outer step
            mixes: docs/algorithms.md, "Outer steps").
    """

    def __init__(self, compressor: Compressor, consensus_step: float, rank: int, from_copy: bool = False) -> None:
        self.compressor = compressor
        self.consensus_step = consensus_step
        self.rank = rank
        self.from_copy = from_copy
        self.copies: dict[int, EdgeCopies] = {}
        self._loaded: dict[int, Any] = {}  # saved copies of buffers not exchanged since the load
        self.origins: dict[int, Tensor] = {}  # where new copies of a buffer start (start_copies_at)
        self.wire_bytes = 0

    def message_bytes(self, buffers: Sequence[Tensor]) -> int:
        """Bytes of one message (to one out-neighbour, one round) of `buffers`."""
        return sum(self.compressor.payload_bytes(b.numel(), state_dtype(b.dtype)) for b in buffers)

    def bytes_sent(self, buffers: Sequence[Tensor], topology: Topology, step: int) -> int:
        """Bytes this worker sends for one round of `buffers` at `step`."""
        if topology.is_identity(step):
            return 0
        return self.message_bytes(buffers) * len(topology.out_neighbors(self.rank, step))

    def start_copies_at(self, buffers: Sequence[Tensor], tag: int = 0) -> None:
        """New copies of buffer `tag + index` start at `buffers[index]` instead of zero (a value every worker passes
        alike: the models they all start from), so that a first message sends `C(x − x(0))`, not `C(x)`: with
        `from_copy` (the outer step), and for a compressor that draws its coordinates at random (`RandomK`: each
        sender draws others, so copies started at zero would differ between equal models and push them apart);
        other compressors' copies start at zero, as CHOCO's. The first origin of a buffer stays (a later fit, or a
        resume, keeps the one both ends of every edge know)."""
        if not (self.from_copy or isinstance(self.compressor, RandomK)):
            return
        for index, buffer in enumerate(buffers):
            if tag + index not in self.origins:
                self.origins[tag + index] = buffer.detach().reshape(-1).to(state_dtype(buffer.dtype), copy=True)

    def copies_of(self, key: int, buffer: Tensor) -> EdgeCopies:
        """The public copies of buffer `key` (made, or restored from a loaded state, at its first exchange)."""
        copies = self.copies.get(key)
        if copies is None:
            copies = self.copies[key] = EdgeCopies(buffer, self.origins.get(key))
            saved = self._loaded.pop(key, None)
            if saved is not None:
                copies.load_state_dict(saved)
        elif copies.numel != buffer.numel() or copies.like.dtype != state_dtype(buffer.dtype):
            raise ValueError(
                f"Buffer {key} of compressed gossip has {buffer.numel()} elements of {buffer.dtype}; its public copies "
                f"were made for {copies.numel} of {copies.like.dtype}. Exchange the same buffers at every step."
            )
        return copies

    def rebind(self, rank: int) -> None:
        """Be worker `rank` of a new topology, from empty copies (every worker does it together)."""
        self.rank = rank
        self.copies = {}
        self._loaded = {}
        self.origins = {}

    def state_dict(self) -> dict[str, Any]:
        """The public copies by buffer key, where new ones start, and `wire_bytes` (tensors and integers: a
        checkpoint shard holds them)."""
        copies = {key: copies.state_dict() for key, copies in self.copies.items()}
        return {"copies": {**self._loaded, **copies}, "wire_bytes": self.wire_bytes, "origins": dict(self.origins)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` ([`state_dict`][lightning_decentral.compression.Choco.state_dict]); each buffer's
        copies are restored, on its device, at its first exchange."""
        self.copies = {}
        self._loaded = {int(key): saved for key, saved in state["copies"].items()}
        self.origins = {int(key): origin for key, origin in state.get("origins", {}).items()}
        self.wire_bytes = int(state["wire_bytes"])


class ChocoExchange:
    """One worker's exchange of `buffers` at `step`, all `rounds` of it; a transport moves the messages of each
    round from `outgoing(r)` (`{out-neighbour: uint8 message}`) to the receivers'
    `incoming(r, {in-neighbour: message})`, and rounds run in order.

    Without `out` the buffers end as `x + Σ_r γ Δ_r`; with `out` they are only read and `out` ends as that minus `x`
    (adapt-with-combine's correction). `residuals` (with `measure`): `‖Δ_0‖²` per buffer, `Δ` the update before `γ`.
    """

    def __init__(
        self,
        choco: Choco,
        topology: Topology,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int,
        tag: int = 0,
        out: Sequence[Tensor] | None = None,
        measure: bool = False,
    ) -> None:
        self.choco = choco
        self.topology = topology
        self.step = step
        self.rounds = rounds
        self.tag = tag
        self.buffers = list(buffers)
        self.out = None if out is None else list(out)
        self.measure = measure
        self.copies = [choco.copies_of(tag + index, b) for index, b in enumerate(self.buffers)]
        sizes = [choco.compressor.payload_bytes(c.numel, c.like.dtype) for c in self.copies]
        self._parts = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]  # (offset, size) in a message
        self.residuals: list[Tensor] | None = None
        if self.out is not None and rounds > 1:  # later rounds compress x + the corrections so far
            for o, b in zip(self.out, self.buffers):
                o.copy_(b)

    @property
    def current(self) -> list[Tensor]:
        """What this round compresses: the buffers, or (with `out`, several rounds) the copy in `out`."""
        return self.out if self.out is not None and self.rounds > 1 else self.buffers

    @property
    def round_bytes(self) -> int:
        """The bytes of one round's messages, every out-neighbour's."""
        return self.choco.bytes_sent(self.buffers, self.topology, self.step)

    def outgoing(self, round: int, count: bool = True) -> dict[int, Tensor]:
        """Compress for every out-neighbour of `W(step)` (once per shared copy), update the sent copies, and return
        each out-neighbour's message: the payloads of the buffers, concatenated (written in place: no copy of them).
        `count`: add the messages' bytes to `choco.wire_bytes` (`False`: the transport counts them, `round_bytes`, on
        a thread of its choosing; the rest touches only this exchange's copies)."""
        choco = self.choco
        peers = [j for j, _ in self.topology.out_neighbors(choco.rank, self.step)]
        device = self.copies[0].like.device if self.copies else torch.device("cpu")
        size = sum(size for _, size in self._parts)
        messages = {j: torch.empty(size, dtype=torch.uint8, device=device) for j in peers}
        for index, (x, copies) in enumerate(zip(self.current, self.copies)):
            seed = exchange_seed(self.step, round, self.tag + index, choco.rank)
            (offset, size) = self._parts[index]
            for slot, members in copies.slots_for(peers).items():
                payload = messages[members[0]][offset : offset + size]
                encode_update_(choco.compressor, x.reshape(-1), copies.sent[slot], seed, payload, copies.work)
                for peer in members[1:]:
                    messages[peer][offset : offset + size].copy_(payload)
        if count:
            choco.wire_bytes += sum(m.numel() for m in messages.values())
        return messages

    def incoming(self, round: int, messages: Mapping[int, Tensor]) -> None:
        """Add each in-neighbour's `q` to its copy, then apply `x += γ Δ` (or accumulate it in `out`)."""
        choco = self.choco
        by_chunk = not self.measure and not choco.from_copy
        for index, (copies, (offset, size)) in enumerate(zip(self.copies, self._parts)):
            received = []
            for peer, message in messages.items():
                seed = exchange_seed(self.step, round, self.tag + index, peer)
                if peer not in copies.received:  # a first-time in-neighbour: its copy starts at zero (or the origin)
                    copies.received[peer] = copies.fresh()
                received.append((message[offset : offset + size], copies.received[peer], seed))
            if by_chunk:
                self._combine(index, copies, received)
            else:
                for payload, copy, seed in received:
                    decode_add_(choco.compressor, payload, copy, seed)
        if not by_chunk:
            self._combine_whole(round)
        if self.out is not None and self.rounds > 1 and round == self.rounds - 1:
            for o, b in zip(self.out, self.buffers):
                o.sub_(b)

    def _combine(self, index: int, copies: EdgeCopies, received: list[tuple[Tensor, Tensor, int]]) -> None:
        """Decode the `received` `(payload, copy, seed)` of buffer `index`, then `x += γ Δ` for it (or its share of
        `out`), chunk by chunk: `Δ`, its step and its sum into the target while the chunk is in cache (the same
        operations per element as `_combine_whole`); on the C kernel the decoding of a dense compressor too, tile by
        tile in the same pass."""
        compressor, terms = self.choco.compressor, self._terms(copies)
        gamma = self.choco.consensus_step
        x = self.buffers[index].view(-1)
        direct = self.out is not None and self.rounds == 1 and self.out[index].dtype == copies.like.dtype
        target = self.out[index].view(-1) if self.out is not None else x
        add = not (self.out is not None and self.rounds == 1)
        if native.combine_(target, terms, gamma, add, decode=(compressor, [(p, c) for p, c, _ in received])):
            return
        for payload, copy, seed in received:
            decode_add_(compressor, payload, copy, seed)
        if native.combine_(target, terms, gamma, add):
            return
        step = chunk_size(copies.numel, copies.like.device, 1)
        for start in range(0, copies.numel, step):
            stop = min(start + step, copies.numel)
            change = target[start:stop] if direct else copies.work[start:stop]
            torch.mul(terms[0][0][start:stop], terms[0][1], out=change)
            for copy, weight in terms[1:]:
                change.add_(copy[start:stop], alpha=weight)
            if gamma != 1:  # × 1.0 changes nothing: a pass saved at the default steps of sign and int8/int4
                change.mul_(gamma)
            if direct:
                continue
            if self.out is not None and self.rounds == 1:
                target[start:stop].copy_(change)
            else:
                target[start:stop].add_(change.to(x.dtype))

    def _combine_whole(self, round: int) -> None:
        """`x += γ Δ` over whole buffers: with residuals to measure (`‖Δ‖²` of each whole buffer) or from the
        worker's own copy."""
        choco = self.choco
        changes = [self._change(copies) for copies in self.copies]
        if self.measure and round == 0:
            self.residuals = [torch.dot(d, d) for d in changes]
        for index, (x, change) in enumerate(zip(self.buffers, changes)):
            change.mul_(choco.consensus_step)
            own = self._own(self.copies[index]) if choco.from_copy else None
            if own is not None:  # x̂_i + γ Δ − x: the change that ends the round at the worker's own copy
                change.add_(own).sub_(self.current[index].reshape(-1))
            if self.out is None:
                x.add_(change.view_as(x).to(x.dtype))
            elif self.rounds == 1:
                self.out[index].copy_(change.view_as(x))
            else:
                self.out[index].add_(change.view_as(x).to(x.dtype))

    def _own(self, copies: EdgeCopies) -> Tensor | None:
        """The worker's own public copy at this round, `Σ_j w_ji x̂_{i→j} / Σ_j w_ji` over its out-edges of `W(step)`
        (`None` without any: its model is all it has)."""
        out_edges = self.topology.out_neighbors(self.choco.rank, self.step)
        edges = [(copies.sent[copies.slot_of[peer]], weight) for peer, weight in out_edges]
        total = sum(weight for _, weight in edges)
        if not edges:
            return None
        own = torch.mul(edges[0][0], edges[0][1] / total)
        for copy, weight in edges[1:]:
            own.add_(copy, alpha=weight / total)
        return own

    def _terms(self, copies: EdgeCopies) -> list[tuple[Tensor, float]]:
        """The copies and weights of `Δ = Σ_j w_ij x̂_{j→i} − Σ_j w_ji x̂_{i→j}` over the edges of `W(step)` (the
        out-edges of one copy together)."""
        rank = self.choco.rank
        terms = [(copies.received[peer], weight) for peer, weight in self.topology.in_neighbors(rank, self.step)]
        by_slot: dict[int, float] = {}
        for peer, weight in self.topology.out_neighbors(rank, self.step):
            slot = copies.slot_of[peer]
            by_slot[slot] = by_slot.get(slot, 0.0) - weight
        return terms + [(copies.sent[slot], weight) for slot, weight in by_slot.items()]

    def _change(self, copies: EdgeCopies) -> Tensor:
        """`Δ` ([`_terms`][lightning_decentral.compression.ChocoExchange._terms]) in the work space."""
        terms = self._terms(copies)
        change = torch.mul(terms[0][0], terms[0][1], out=copies.work)
        for copy, weight in terms[1:]:
            change.add_(copy, alpha=weight)
        return change


@runtime_checkable
class Compressing(Protocol):
    """A mixer of compressed gossip: `chocos`, the side of the rule of each worker it serves, in order."""

    @property
    def chocos(self) -> list[Choco]: ...


class ChocoStates:
    """The public copies of a process's workers as their executor keeps them from run to run: the compressing mixer
    attached last (a later fit's goes on from the copies the earlier one left), the bytes sent, each worker's state
    for its checkpoint shard, and a state loaded from a shard before the mixer exists."""

    def __init__(self) -> None:
        self._mixer: Compressing | None = None
        self._loaded: dict[int, Mapping[str, Any]] = {}

    @property
    def chocos(self) -> list[Choco]:
        """Each worker's side of the rule (none before a compressing mixer is attached)."""
        return list(self._mixer.chocos) if self._mixer is not None else []

    def attach(self, mixer: Any) -> None:
        """Serve `mixer`'s workers from now on, if it compresses (a
        [`Compressing`][lightning_decentral.compression.Compressing] mixer with sides of the rule); they continue from
        the copies of the mixer attached before."""
        if not isinstance(mixer, Compressing) or not mixer.chocos:
            return
        earlier = self.chocos
        self._mixer = mixer
        for choco, before in zip(self.chocos, earlier):
            choco.load_state_dict(before.state_dict())
        self._restore()

    @property
    def bytes_sent(self) -> int:
        """Bytes of every worker's messages so far."""
        return sum(choco.wire_bytes for choco in self.chocos)

    def state(self, worker: int = 0) -> dict[str, Any] | None:
        """Worker `worker`'s [`state_dict`][lightning_decentral.compression.Choco.state_dict]; `None` without a
        mixer."""
        chocos = self.chocos
        return chocos[worker].state_dict() if chocos else None

    def load(self, state: Mapping[str, Any] | None, worker: int = 0) -> None:
        """Continue worker `worker` from `state` (`None`: nothing to load), now or when a mixer is attached."""
        if state is not None:
            self._loaded[worker] = state
            self._restore()

    def _restore(self) -> None:
        chocos = self.chocos
        if chocos:
            for worker, state in self._loaded.items():
                chocos[worker].load_state_dict(state)
            self._loaded = {}


def exchange_in_process(
    exchanges: Sequence[ChocoExchange], first: Sequence[Mapping[int, Tensor]] | None = None
) -> None:
    """Run the exchanges of every worker of one process (`exchanges[i]` is worker `i`'s, all of one step), round by
    round: every worker's messages (round one's may be given: `first[i]`, worker `i`'s `outgoing(0)`), then every
    worker's receipt of its in-neighbours' messages."""
    if not exchanges:
        return
    for round in range(exchanges[0].rounds):
        messages = first if round == 0 and first is not None else [e.outgoing(round) for e in exchanges]
        for rank, exchange in enumerate(exchanges):
            senders = exchange.topology.in_neighbors(rank, exchange.step)
            exchange.incoming(round, {j: messages[j][rank] for j, _ in senders})


def check_compressible(compressor: Compressor, buffers: Sequence[Tensor]) -> None:
    """Refuse, naming the fix, a `compressor` that cannot run on the flat `buffers` a worker exchanges (its parameters,
    then its mixed buffers): one `compress` and `decompress` of a few of each buffer's values, in the dtype of its
    public copies, must run (a complex parameter does not compare with zero, as `Sign` asks); and a sparsifier's
    `fraction` of the largest buffer must round to at least one coordinate (`kept` would send one regardless, and
    the default `consensus_step`, proportional to the fraction, would never mix).

    Examples:
        >>> from lightning_decentral.compression import Sign
        >>> check_compressible(Sign(), [torch.zeros(10)])
        >>> check_compressible(Sign(), [torch.zeros(10, dtype=torch.complex64)])
        Traceback (most recent call last):
        ...
        ValueError: compression=Sign(...) cannot compress the model's torch.complex64 values ...
        >>> check_compressible(TopK(1e-9), [torch.zeros(1000)])
        Traceback (most recent call last):
        ...
        ValueError: compression=TopK(...) keeps a fraction 1e-09 of the coordinates: 1e-06 of the model's 1000, ...
    """
    for dtype in {buffer.dtype for buffer in buffers}:
        sample = next(b for b in buffers if b.dtype == dtype).detach().reshape(-1)[:8].to(state_dtype(dtype))
        try:
            compressor.decompress(compressor.compress(sample.clone(), 0), sample.numel(), sample.dtype, 0)
        except Exception as error:
            raise ValueError(
                f"compression={compressor!r} cannot compress the model's {dtype} values (one message of "
                f"{sample.numel()} of them failed: {type(error).__name__}: {error}). Compressed gossip runs on real "
                f"floating-point parameters and buffers (float16, bfloat16, float32, float64): keep {dtype} tensors "
                "out of the trainable parameters, use compression=None, or pass a Compressor of your own that takes "
                "them."
            ) from error
    fraction = compressor.fraction if isinstance(compressor, (TopK, RandomK)) else None
    largest = max((buffer.numel() for buffer in buffers), default=0)
    if fraction is not None and largest and int(fraction * largest + 0.5) == 0:
        raise ValueError(
            f"compression={compressor!r} keeps a fraction {fraction:g} of the coordinates: {fraction * largest:.3g} of "
            f"the model's {largest}, which rounds to none, so the fraction sends nothing of what it names (and "
            f"consensus_step={compressor.consensus_step:g}, in proportion to it, would never mix). Use a fraction of "
            f"at least {1 / largest:.3g} (one coordinate of {largest})."
        )
