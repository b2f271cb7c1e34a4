"""A lost rank started again rejoins the run in progress, while the members train (`rejoin=True`).

```text
joiner (the lost rank, same command)            members (each at the start of every step k)
reads the run in progress (current)
asks: ask/g/<rank>, asks/g += 1     ------>     one look at asks/g every LOOK_EVERY steps; the first to see it
                                                proposes the join step J >= k + margin, a multiple of LOOK_EVERY
                                                (compare-and-set: every member learns it)
                                                ... the steps before J, as before ...
waits for decide/g                  <------     at the start of J: admit (the agreement of a failure, the
                                                members grown by the askers), a new generation
form_group (generation g + 1)                   form_group, W of the grown members (from J), rebind the mixers
take_over(source)                   <------     the source (source_for) hands over its replica, optimizer and
                                                rule state and the loop's position (hand_over)
trains from step J                              train from step J
```

`margin` is the stop margin ([`stop_margin`][lightning_decentral.trainer.stop.stop_margin]): more steps than two
members can be apart, so that none has begun `J` when it is proposed. The members look every `LOOK_EVERY` steps
only (a store round trip each), and `J` leaves room for that ([`Joins`][lightning_decentral.membership.rejoin.Joins]).
The members pause for the agreement and one handover (the source alone sends). A rank that cannot rejoin (the run does
not take rejoins, it is over, the grown graph is not connected, no decision admits it within the timeout) stops at once
with [`CannotRejoin`][lightning_decentral.membership.rejoin.CannotRejoin]. A rank that is not one of the ranks the run
started with is refused ([`refuse_new_rank`][lightning_decentral.membership.rejoin.refuse_new_rank]), and so is a
rank started again after its run is over
([`refuse_after_the_run`][lightning_decentral.membership.rejoin.refuse_after_the_run]).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral.membership.protocol import POLL, Decision, Excluded, Membership
from lightning_decentral.rendezvous import GuardedStore, LeftOut
from lightning_decentral.topology import Topology

CURRENT = "lightning_decentral/current"  # the run in progress, as its lowest-ranked member last published it
LOOK_EVERY = 5  # the members look for ranks asking at the steps that are multiples of it (one store round trip)


class CannotRejoin(LeftOut):
    """A lost rank started again cannot rejoin the run in progress (the reason says why and what to do)."""


def publish(store: Any, membership: Membership, **extra: Any) -> None:
    """Say what a rank that rejoins needs: the run's prefix, generation, members and size at the start, and `extra`
    (the job's token, whether rejoins are taken, the margin). The lowest-ranked member writes it."""
    if membership.members[0] == membership.first_rank:
        info = dict(
            run=membership.run,
            generation=membership.generation,
            members=membership.members,
            start_size=membership.start_size,
            **extra,
        )
        store.set(CURRENT, json.dumps(info))


def current(store: Any) -> dict[str, Any] | None:
    """The run in progress as its members last published it (`run`, `generation`, `members` by their first ranks,
    `start_size`, `rejoin`, ...), or `None`: what a rank that rejoins reads first, and what a test or a soak can watch
    (`current(dist.TCPStore(host, port, is_master=False))["members"]`)."""
    return json.loads(store.get(CURRENT)) if store.check([CURRENT]) else None


def asking(store: Any) -> list[int]:
    """The ranks asking to rejoin the run in progress now (its current generation), for a test or a soak to watch."""
    info = current(store)
    if info is None:
        return []
    if not store.check([_key(info, "asks", info["generation"])]):  # what the members look at: written last
        return []
    left_out = [r for r in range(info["start_size"]) if r not in info["members"]]
    return [r for r in left_out if store.check([_key(info, "ask", info["generation"], r)])]


def _key(info: dict[str, Any], *parts: Any) -> str:
    """The key of `parts` under the run `info` describes (as
    [`Membership.key`][lightning_decentral.membership.Membership.key])."""
    return "/".join(["lightning_decentral", info["run"], *map(str, parts)])


def source_for(joiner: int, members: Sequence[int], joined: Sequence[int], topology: Topology) -> int:
    """The member that hands its state to `joiner`: the lowest-ranked member (by first rank) adjacent to it in the
    grown topology `topology` (bound to `len(members)`, member `members[i]` its rank `i`; an edge of any `W(k)` of a
    period), not itself rejoining; else (no such neighbour) the lowest-ranked member not rejoining. A neighbour,
    because its replica is the nearest the joiner's would have been: it mixed with the joiner's place in the graph
    before the loss; the lowest rank, so that every member and the simulation name the same one without a word.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> source_for(3, [0, 1, 2, 3, 4], [3], Ring(world_size=5))  # ring 0-1-2-3-4-0: 3's neighbours are 2 and 4
        2
    """
    me = list(members).index(joiner)
    joining = set(joined)
    touches = [
        members[j]
        for j in range(len(members))
        if members[j] not in joining
        and any(topology.mixing(k)[me, j] != 0 or topology.mixing(k)[j, me] != 0 for k in range(topology.period))
    ]
    return min(touches) if touches else min(m for m in members if m not in joining)


def refuse_new_rank(store: Any, rank: int, world_size: int) -> None:
    """Raise `CannotRejoin` if a run in progress on this store started with another number of ranks (a new rank,
    growing 4 -> 5): only a lost rank started again with its own `RANK` and `WORLD_SIZE` rejoins."""
    info = current(store)
    if (
        info is not None
        and info["start_size"] != world_size
        and _beating(store, _key(info, "heartbeat", info["members"][0]))
    ):
        raise CannotRejoin(
            f"Rank {rank} of {world_size} found a run of {info['start_size']} ranks in progress on this store: a new "
            "rank cannot join a running job (its data shard, its place in the graph and every rank's share of the data "
            "are fixed at the start). Only a lost rank started again with its own RANK and WORLD_SIZE rejoins "
            "(rejoin=True); to grow, save a checkpoint and start the job again with more processes."
        )


def refuse_after_the_run(store: Any, rank: int) -> None:
    """Raise `CannotRejoin` if the run this store last published took rejoins, had lost `rank`, and is over: every
    member said it leaves (a clean end, or an error). Without it a rank started again after that run would wait the
    timeout for a new generation, its lost rank's mark standing still
    ([`agree_generation`][lightning_decentral.rendezvous.agree_generation])."""
    info = current(store)
    if info is None or not info.get("rejoin") or rank in info["members"]:
        return
    if _left(store, info):
        raise CannotRejoin(
            f"Rank {rank} cannot rejoin: the run it was lost by is over (its members {info['members']}, ranks of the "
            "start, have all left). Resume from that run's last checkpoint with a new job to train further."
        )


def run_over(store: Any) -> bool:
    """Whether the run this store last published is over (every member said it leaves): nobody can rejoin it, and
    `lightning-decentral-launch` starts nobody again. `False` before a run published itself."""
    info = current(store)
    return info is not None and _left(store, info)


def _left(store: Any, info: dict[str, Any]) -> bool:
    return all(store.check([_key(info, "left", member)]) for member in info["members"])


def _beating(store: Any, heartbeat: str, look: float = 1.0) -> bool:
    """Whether the counter `heartbeat` moves within `look` seconds (its member is alive)."""
    if not store.check([heartbeat]):
        return False
    first = store.get(heartbeat)
    time.sleep(look)
    return store.get(heartbeat) != first


class Joins:
    """The members' side: at the start of every `LOOK_EVERY`-th step (`k % LOOK_EVERY == 0`), one look at the store
    for ranks asking to rejoin; the first member to see one proposes the join step `J`, the first multiple of
    `LOOK_EVERY` at least `k + margin`. No member has begun `J` then (members are fewer than `margin` steps apart),
    and every member looks at the start of `J` at the latest (a multiple of `LOOK_EVERY`) before it decides whether
    `J` is the join step, so none passes `J` unaware.

    Examples:
        >>> import torch.distributed as dist
        >>> from datetime import timedelta
        >>> from lightning_decentral.rendezvous import GuardedStore
        >>> store = GuardedStore.around(dist.HashStore(), timedelta(seconds=5))
        >>> members = [Membership(store, lambda: store, "run", r, 3, silence=5.0, min_workers=1) for r in (0, 1, 2)]
        >>> joins = [Joins(m, margin=lambda: 3) for m in members]
        >>> store.add(members[0].key("asks", 0), 1)  # a rank asks
        1
        >>> [joins[0].due(k) for k in (9, 10)], joins[0].step  # looks at 10: J = 15, the first multiple of 5 >= 13
        ([False, False], 15)
        >>> [joins[1].due(k) for k in (12, 15)], joins[1].step  # 2 steps ahead, it looks at 15, finds J: it is J
        ([False, True], 15)

    Args:
        membership: this member's membership.
        margin: the join step is at least `k + margin()` for a request first seen at step `k` (the executor's stop
            margin of the current graph).
    """

    def __init__(self, membership: Membership, margin: Callable[[], int]) -> None:
        self.membership = membership
        self.margin = margin
        self.step: int | None = None  # the agreed join step of this generation
        self._generation = membership.generation
        self._looked = -1

    def due(self, step: int) -> bool:
        """Whether the members admit the ranks asking before step `step` (at most one store round trip per step)."""
        m = self.membership
        if self._generation != m.generation:
            self.step = None
            self._generation = m.generation
        if self.step is None and step != self._looked and step % LOOK_EVERY == 0:
            self._looked = step
            if m.store.check([m.key("asks", m.generation)]):
                join = -(-(step + self.margin()) // LOOK_EVERY) * LOOK_EVERY
                self.step = int(m.store.compare_set(m.key("grow", m.generation), "", str(join)))
        if self.step is not None and step > self.step:
            raise RuntimeError(
                f"Step {step} is past the join step {self.step} the members agreed on: they were more than "
                f"{self.margin()} steps apart. This is a bug of lightning_decentral's margin; please report it."
            )
        return step == self.step

    def asking(self) -> list[int]:
        """The ranks of the start, not members, that ask to rejoin this generation."""
        m = self.membership
        return [r for r in m.left_out if m.store.check([m.key("ask", m.generation, r)])]


def ask(
    membership: Membership, topology: Topology, timeout: float, configuration: dict[str, int | str] | None = None
) -> Decision:
    """The joiner's side: ask to rejoin the run in progress and wait until the members admit this rank (a failure
    decided meanwhile: ask the next generation); returns the decision, adopted. `membership` is this rank's, started
    (its heartbeat beats), its prefix the run's; `topology` the run's at the start; `configuration`, what this rank
    runs, compared with what the members published before it asks
    ([`refuse_other_configuration`][lightning_decentral.membership.rejoin.refuse_other_configuration]). Raises
    `CannotRejoin`."""
    store = membership.store
    rank = membership.first_rank
    deadline = time.monotonic() + timeout
    while True:
        info = _joinable(store, rank, topology)
        if info is None:  # its loss is not decided yet: the members still count it
            _wait_a_little(deadline, rank, "the members to decide it was lost")
            continue
        if configuration is not None:
            if "configuration" not in info:  # the members publish it once their set-up is over
                _wait_a_little(deadline, rank, "the members to publish their configuration")
                continue
            refuse_other_configuration(info, rank, configuration)
        membership.enter(info["generation"], info["members"])
        g = membership.generation
        store.set(membership.key("ask", g, rank), "1")
        store.add(membership.key("asks", g), 1)
        decided = membership.key("decide", g)
        while not store.check([decided]):
            if all(membership.left(m) for m in membership.members):
                raise CannotRejoin(f"Rank {rank} cannot rejoin: the run it was lost by is over (every member left).")
            _wait_a_little(deadline, rank, f"the members to admit it (generation {g})")
        try:
            return membership.adopt(json.loads(store.get(decided)))
        except Excluded:  # a failure was decided first: ask the next generation
            continue


def refuse_other_configuration(info: dict[str, Any], rank: int, configuration: dict[str, int | str]) -> None:
    """Raise `CannotRejoin` naming each field (and both values) in which `configuration`, what rank `rank` runs,
    differs from the `configuration` the members of the run `info` describes published at their set-up (the fields
    of their check that every rank runs the same configuration and optimizers,
    [`check_same_configuration`][lightning_decentral.agreement.Ranks.check_same_configuration]): the members never
    see a rank that would meet other messages, other collectives or another update.

    Examples:
        >>> info = {"configuration": {"gossip_every": 1, "lr": "0.05"}}
        >>> refuse_other_configuration(info, 2, {"gossip_every": 1, "lr": "0.05"})
        >>> refuse_other_configuration(info, 2, {"gossip_every": 2, "lr": "0.05"})
        Traceback (most recent call last):
        ...
        lightning_decentral.membership.rejoin.CannotRejoin: Rank 2 cannot rejoin: ... it has gossip_every=2 where the
        members have 1. ...
    """
    theirs = info["configuration"]
    names = list(theirs) + [name for name in configuration if name not in theirs]
    differences = [
        f"it has {name}={configuration.get(name, 'absent')!r} where the members have {theirs.get(name, 'absent')!r}"
        for name in names
        if configuration.get(name, "absent") != theirs.get(name, "absent")
    ]
    if differences:
        raise CannotRejoin(
            f"Rank {rank} cannot rejoin: it does not run the members' configuration: {'; '.join(differences)}. The "
            "members go on without it. Start it again with the command, arguments and model the run started with "
            "(no strategy argument, optimizer or Trainer limit may depend on the rank or on the restart)."
        )


def run_in_progress(store: Any, rank: int) -> dict[str, Any]:
    """The run in progress that `rank` was lost by ([`current`][lightning_decentral.membership.rejoin.current]), if it
    takes rejoins; else `CannotRejoin`."""
    info = current(store)
    if info is None or not info.get("rejoin"):
        raise CannotRejoin(
            f"Rank {rank} cannot rejoin the run in progress: it does not take rejoins. Pass rejoin=True (with "
            "on_peer_failure='continue') to every rank's DecentralizedStrategy, or let the survivors finish and resume "
            "from their checkpoint."
        )
    return info


def _joinable(store: GuardedStore, rank: int, topology: Topology) -> dict[str, Any] | None:
    info = run_in_progress(store, rank)
    if rank in info["members"]:
        return None
    grown = sorted([*info["members"], rank])
    try:
        topology.for_members(grown)
    except ValueError as error:
        raise CannotRejoin(
            f"Rank {rank} cannot rejoin: the graph of ranks {grown} would not be connected ({error})."
        ) from None
    return info


def _wait_a_little(deadline: float, rank: int, what: str) -> None:
    if time.monotonic() > deadline:
        raise CannotRejoin(f"Rank {rank} cannot rejoin: it waited for {what} for longer than the timeout.")
    time.sleep(POLL * 5)


def hand_over(state: Any, to: int) -> None:
    """The source: send `state` (tensors and plain data: see [`flatten`][lightning_decentral.membership.rejoin.flatten])
    to rank `to` of the current default group: its description as JSON, then every tensor's bytes in one buffer. No
    pickle travels: the rank that rejoins runs no code a peer sent."""
    description, payload = flatten(state)
    text = torch.frombuffer(bytearray(json.dumps(description).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([text.numel(), payload.numel()], dtype=torch.int64), dst=to)
    dist.send(text, dst=to)
    dist.send(payload, dst=to)


def take_over(source: int) -> Any:
    """The joiner: what rank `source` of the current default group sends with `hand_over`, rebuilt."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src=source)
    text = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(text, src=source)
    payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
    dist.recv(payload, src=source)
    return unflatten(json.loads(bytes(text.numpy()).decode()), payload)


def flatten(state: Any) -> tuple[Any, Tensor]:
    """`state` as a JSON-able description and one byte buffer of its tensors (on the CPU): what a handover sends.

    Plain data (`None`, `bool`, `int`, `float`, `str`) stays as it is; a list, a tuple and a dict (of any plain keys)
    become `{"list": [...]}`, `{"tuple": [...]}`, `{"dict": [[key, value], ...]}`; a tensor `{"tensor": [dtype, shape,
    offset, bytes]}`, its bytes at `offset` of the buffer. Anything else is a `TypeError`.

    Examples:
        >>> description, payload = flatten({"step": 3, 0: (torch.tensor([1.5, 2.0]), None)})
        >>> payload.numel(), description["dict"][0]
        (8, ['step', 3])
        >>> unflatten(description, payload)
        {'step': 3, 0: (tensor([1.5000, 2.0000]), None)}
    """
    parts: list[Tensor] = []
    offset = 0

    def describe(value: Any) -> Any:
        nonlocal offset
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Tensor):
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            parts.append(raw)
            offset += raw.numel()
            return {"tensor": [str(value.dtype).removeprefix("torch."), list(value.shape), offset - raw.numel()]}
        if isinstance(value, dict):
            return {"dict": [[describe(key), describe(item)] for key, item in value.items()]}
        if isinstance(value, tuple):
            return {"tuple": [describe(item) for item in value]}
        if isinstance(value, list):
            return {"list": [describe(item) for item in value]}
        raise TypeError(
            f"A rejoin handover carries tensors and plain data only (no pickle travels between ranks), got a "
            f"{type(value).__name__}: {value!r:.80}"
        )

    description = describe(state)
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return description, payload


def unflatten(description: Any, payload: Tensor) -> Any:
    """The state [`flatten`][lightning_decentral.membership.rejoin.flatten] described, its tensors copied out of
    `payload` (each owns its memory)."""
    if not isinstance(description, dict):
        return description
    ((kind, content),) = description.items()
    if kind == "tensor":
        dtype_name, shape, offset = content
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        return payload[offset : offset + size].clone().view(dtype).reshape(shape)
    if kind == "dict":
        return {unflatten(key, payload): unflatten(item, payload) for key, item in content}
    items = [unflatten(item, payload) for item in content]
    return tuple(items) if kind == "tuple" else items
