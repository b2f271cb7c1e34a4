"""What every rank must learn together: means, "every rank succeeded", "every rank runs the same configuration"
([`Ranks`][lightning_decentral.agreement.Ranks]), and what each rank is doing, so that ranks about to run different
collectives find out at once ([`Activities`][lightning_decentral.agreement.Activities]).

All of it goes through small collectives on the default process group (the activities: its key-value store), so
every rank takes the same decision from the same numbers (no pickled objects travel between ranks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_decentral._compat import default_store, use_count
from lightning_decentral.failures import Abandoned, PeerFailure, peers_answer
from lightning_decentral.membership.guard import Guard
from lightning_decentral.options import outer_optimizer_name
from lightning_decentral.rendezvous import GuardedStore
from lightning_decentral.replicas import MeanFn, averaged_optimizer_state, group_by_layout, local_tensor
from lightning_decentral.schedule import RoundsSchedule

_STRING_SLOTS = 64  # a configuration string travels as this many code points
_SAME_BUILD = (
    "Build the same DecentralizedStrategy and the same model on every rank (no argument may depend on the rank)."
)


class Ranks:
    """Collectives over the ranks of one job, run on this rank's device.

    Each goes through `guard` ([`Guard.run`][lightning_decentral.membership.guard.Guard.run]): a collective that cannot
    complete (a rank died, raised, or hangs past the process-group timeout) raises
    [`PeerFailure`][lightning_decentral.failures.PeerFailure], naming what the ranks were doing; with the survivors
    of a failure it runs again among them (these ranks then follow the default group: `rank`, `world_size`).

    Args:
        rank: this rank's global rank.
        world_size: the number of ranks.
        device: the device collectives run on (a CUDA device under NCCL).
        group: the process group they run on (default: the default group).
        guard: the path the collectives go through (default: one without survivors).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        guard: Guard | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        self.guard = guard if guard is not None else Guard()

    @classmethod
    def of_world(cls, device: torch.device, guard: Guard | None = None) -> Ranks:
        """The ranks of the default process group now (one rank before there is one): after a failure, the
        survivors' (or this rank alone, while they agree)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device, guard=guard)
        return cls(0, 1, device, guard=guard)

    def _collective(self, what: str, collective: Callable[[], Any], peers: str = "a peer") -> Any:
        """`collective()` through the guard, on the default group as it is at each try (after a failure survived, the
        survivors')."""

        def attempt() -> Any:
            if self.group is None and dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
                self.world_size = dist.get_world_size()
            return collective()

        return self.guard.run(what, attempt, peers)

    def gather(self, values: list[int], what: str = "An all-gather of the ranks' agreement") -> Tensor:
        """Every rank's `values`: a `[world_size, len(values)]` int64 CPU tensor (one all-gather); `what` names it
        in the error if a rank fails meanwhile."""
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        if not dist.is_initialized():
            return local[None].cpu()

        def all_gather() -> Tensor:
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=self.group)
            return torch.stack(gathered).cpu()

        return self._collective(what, all_gather)

    def mean(self, tensors: list[Tensor], what: str = "Averaging the replicas") -> list[Tensor]:
        """New tensors `(1/n) Σ_i t_i`, one all-reduce per (device, dtype), each on its tensor's device; `what`
        names it in the error if a rank fails meanwhile."""
        return self._collective(what, lambda: self._mean(tensors))

    def _mean(self, tensors: list[Tensor]) -> list[Tensor]:
        means: dict[int, Tensor] = {}
        for group in group_by_layout(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)  # a copy, on the device
            dist.all_reduce(flat, group=self.group)
            released_by_gloo(flat)
            flat.div_(self.world_size)
            offset = 0
            for t in group:
                means[id(t)] = flat[offset : offset + t.numel()].view_as(t).to(t.device)
                offset += t.numel()
        return [means[id(t)] for t in tensors]

    def broadcast_from_rank_zero(self, tensors: list[Tensor]) -> None:
        """Every rank's `tensors` take rank 0's values: one broadcast per (device, dtype)."""
        for group in group_by_layout(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._collective(
                "Starting every replica from rank 0's weights",
                lambda flat=flat: dist.broadcast(flat, group=self.group, group_src=0),
                "rank 0 or another rank",
            )
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def any(self, flag: Tensor) -> Tensor:
        """`flag` (0-dim) set where it is set on any rank: one all-reduce (max), no host sync."""

        def all_reduce() -> Tensor:
            maximum = flag.to(torch.float32, copy=True)
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=self.group)
            return maximum

        return self._collective("Agreeing whether any rank overflowed (a skipped step)", all_reduce) > 0

    def on_every_rank(self, action: Callable[[], Any], what: str, during: str = "A checkpoint save") -> None:
        """Run `action` here; then, one all-gather later, every rank knows whether every rank succeeded.

        Raises this rank's own error, else a [`PeerFailure`][lightning_decentral.failures.PeerFailure] if the
        all-gather itself failed (`during` names it: a rank died, so the others' outcome is unknown), else a
        `RuntimeError` naming the ranks that failed to do `what`.
        """
        error: BaseException | None = None
        try:
            action()
        except Exception as exc:
            error = exc
        try:
            table = self.gather([error is not None], f"{during}, agreeing that every rank could {what},")
        except PeerFailure:
            if error is not None:
                # this rank's own error comes first; its `__cause__` stays its own (callers read it) and the peer
                # failure stays its implicit context: `from` would make that the cause
                raise error  # noqa: B904
            raise
        failed = table[:, 0].nonzero().flatten().tolist()
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"Rank(s) {failed} could not {what} (their logs say why); no checkpoint was written.")

    def check_same_configuration(self, fields: dict[str, int | str], advice: str = _SAME_BUILD) -> None:
        """Stop every rank if a rank's `fields` differ from rank 0's.

        Each field travels as int64 values (a string as its first 64 code points; use
        [`digest`][lightning_decentral.agreement.digest] or [`fitted`][lightning_decentral.agreement.fitted]
        for longer data) in one all-gather; the error, raised on every rank, names each differing rank and
        field with both values, then `advice`. Every rank must pass fields of the same names and kinds.
        """
        table = self.gather([v for value in fields.values() for v in _encode(value)])
        rows = [_decode(row.tolist(), fields) for row in table]
        differences = [
            f"rank {rank} has {name}={row[name]!r} where rank 0 has {rows[0][name]!r}"
            for rank, row in enumerate(rows)
            for name in fields
            if row[name] != rows[0][name]
        ]
        if differences:
            raise ValueError("The ranks do not run the same configuration: " + "; ".join(differences) + ". " + advice)

    def check_same_checkpoint(self, ckpt_path: str | None) -> None:
        """Stop every rank, naming `ckpt_path` and each rank's value, unless every rank resumes from the same
        checkpoint (or none). One all-gather of a digest of the path and the path shortened to 64 characters."""
        tail = _STRING_SLOTS - 3  # the end of a long path names the checkpoint: keep it
        shown = (
            "None" if ckpt_path is None else repr(ckpt_path if len(ckpt_path) <= tail else "…" + ckpt_path[1 - tail :])
        )
        mine = digest(b"\0none") if ckpt_path is None else digest(ckpt_path.encode())
        table = self.gather([mine, *_encode(shown)])
        if len(set(table[:, 0].tolist())) > 1:
            values = [_decode(row[1:].tolist(), {"path": shown})["path"] for row in table]
            raise ValueError(
                "The ranks do not resume from the same checkpoint: "
                + ", ".join(f"rank {rank} has ckpt_path={value}" for rank, value in enumerate(values))
                + ". Lightning reads a checkpoint only on the ranks given one, and every rank must load the same "
                "save (each reads its own shard beside it): pass the same `trainer.fit(ckpt_path=...)` on every "
                "rank, or None on every rank."
            )

    def check_same_optimizers(self, optimizers: list[Any]) -> None:
        """Stop every rank unless every rank has the same number of optimizers, of the same classes, with the
        same number of parameter groups and the same `HYPERPARAMETERS` in each (compared exactly: a float
        travels as its `repr`, the shortest string that reads back as the same float). Three all-gathers of
        [`optimizer_configuration`][lightning_decentral.agreement.optimizer_configuration]'s stages, each of a
        shape every rank agrees on after the one before."""
        for stage in optimizer_configuration(optimizers):
            self.check_same_configuration(stage, OPTIMIZER_ADVICE)

    def check_same_public_copies(self, state: Mapping[str, Any] | None) -> None:
        """Stop every rank, naming the edges and the fix, unless both ends of every edge of compressed gossip hold the
        same public copies: rank `j`'s copy of rank `i`'s model `x̂_{i→j}` is rank `i`'s own, and every rank's copies
        start where the others' do. With one copy different (a shard altered, mixed from two saves) `x̄` is no longer
        kept and drifts away without bound, silently. One all-gather of digests
        ([`public_copy_digests`][lightning_decentral.agreement.public_copy_digests] of this rank's
        [`Choco.state_dict`][lightning_decentral.compression.Choco.state_dict], `state`), not of the copies; run at
        set-up and resume, never per step."""
        n = self.world_size
        table = self.gather(public_copy_digests(state, n), "Comparing the public copies of compressed gossip")
        origins = [rank for rank in range(n) if table[rank, 0] != table[0, 0]]
        edges = [
            (i, j) for i in range(n) for j in range(n) if i != j and table[i, 1 + j] != table[j, 1 + n + i]
        ]  # x̂_{i→j}: sent by i, received by j
        if not origins and not edges:
            return
        differences = [
            f"rank {j}'s copy of rank {i}'s model differs from rank {i}'s (edge {i} → {j})" for i, j in edges
        ]
        differences += [f"rank {rank}'s copies start elsewhere than rank 0's" for rank in origins]
        raise ValueError(
            "The two ends of an edge of compressed gossip do not hold the same public copies: "
            + "; ".join(differences)
            + ". x̄ would drift away without bound. Resume every rank from the shards of one save, as that save wrote "
            "them (the same ckpt_path on every rank, each rank's shard beside it, unaltered), or start without one."
        )


OPTIMIZER_ADVICE = (
    "Build the same optimizer with the same hyperparameters on every rank (`configure_optimizers` may not "
    "depend on the rank): the replicas would otherwise drift apart under different updates."
)
"""The fix an optimizer that differs between ranks is refused with."""


def optimizer_configuration(optimizers: list[Any]) -> list[dict[str, int | str]]:
    """What every rank's optimizers must agree on, in three stages, each of a shape fixed by the one before: their
    number; each one's class and number of parameter groups; the `HYPERPARAMETERS` of each group.

    Examples:
        >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> count, structure, values = optimizer_configuration([sgd])
        >>> count, structure["optimizer class"], values["lr"], values["betas"]
        ({'optimizers': 1}, 'torch.optim.sgd.SGD', '0.1', 'absent')
    """
    where = [f" (optimizer {i})" if len(optimizers) > 1 else "" for i in range(len(optimizers))]
    structure: dict[str, int | str] = {}
    for optimizer, at in zip(optimizers, where):
        structure[f"optimizer class{at}"] = fitted(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        structure[f"param groups{at}"] = len(optimizer.param_groups)
    values: dict[str, int | str] = {}
    for i, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        for g, group in enumerate(groups):
            parts = [f"optimizer {i}"] * (len(optimizers) > 1) + [f"param group {g}"] * (len(groups) > 1)
            suffix = f" ({', '.join(parts)})" if parts else ""
            for name in HYPERPARAMETERS:
                values[f"{name}{suffix}"] = _exact(group[name]) if name in group else "absent"
    return [{"optimizers": len(optimizers)}, structure, values]


def public_copy_digests(state: Mapping[str, Any] | None, world_size: int) -> list[int]:
    """A rank's row of [`check_same_public_copies`][lightning_decentral.agreement.Ranks.check_same_public_copies] from
    its compressed gossip `state` ([`Choco.state_dict`][lightning_decentral.compression.Choco.state_dict]; `None`:
    plain gossip): the digest of where its copies start, then for each rank `j` that of its copies `x̂_{i→j}` (sent to
    `j`), then that of `x̂_{j→i}` (received from `j`), every buffer's in key order; a copy not made yet adds nothing.

    Examples:
        >>> copies = {0: {"sent": [torch.ones(2)], "slot_of": {1: 0}, "received": {1: torch.zeros(2)}}}
        >>> mine = public_copy_digests({"copies": copies, "origins": {}}, 2)
        >>> theirs = {0: {"sent": [torch.zeros(2)], "slot_of": {0: 0}, "received": {0: torch.ones(2)}}}
        >>> other = public_copy_digests({"copies": theirs, "origins": {}}, 2)
        >>> mine[1 + 1] == other[1 + 2 + 0], other[1 + 0] == mine[1 + 2 + 1]  # 0 → 1 and 1 → 0 agree
        (True, True)
    """
    state = state or {"copies": {}, "origins": {}}
    copies = {int(key): value for key, value in state["copies"].items()}
    origins = {int(key): value for key, value in state.get("origins", {}).items()}

    def of(tensors: list[tuple[int, Tensor]]) -> int:
        return digest(*(part for key, t in tensors for part in (str(key).encode(), _bytes(t))))

    slots = {key: {int(j): int(slot) for j, slot in c["slot_of"].items()} for key, c in copies.items()}
    got = {key: {int(j): copy for j, copy in c["received"].items()} for key, c in copies.items()}
    sent = [
        of([(key, copies[key]["sent"][slots[key][j]]) for key in sorted(copies) if j in slots[key]])
        for j in range(world_size)
    ]
    received = [of([(key, got[key][j]) for key in sorted(copies) if j in got[key]]) for j in range(world_size)]
    return [of(sorted(origins.items())), *sent, *received]


def _bytes(tensor: Tensor) -> bytes:
    """A tensor's values as bytes (on the CPU), for a digest."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


HYPERPARAMETERS = ("lr", "momentum", "betas", "weight_decay", "nesterov", "eps")
"""The optimizer hyperparameters every rank must agree on (those a parameter group holds)."""


def fitted(text: str) -> str:
    """`text` if it fits the 64 characters a configuration string travels as; else its start and a digest.

    Examples:
        >>> fitted("ring")
        'ring'
        >>> len(fitted("x" * 100))
        64
    """
    if len(text) <= _STRING_SLOTS:
        return text
    tag = f"…#{digest(text.encode()) & (2**64 - 1):016x}"
    return text[: _STRING_SLOTS - len(tag)] + tag


def _exact(value: Any) -> str:
    """A hyperparameter as a string equal for equal values only (`repr` of a float reads back exactly)."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, (tuple, list)):
        return fitted("(" + ", ".join(_exact(v) for v in value) + ")")
    return fitted(repr(value))


def run_configuration(strategy: Any, module: torch.nn.Module, precision: str) -> dict[str, int | str]:
    """What every rank must agree on before the first exchange: the strategy's update-rule arguments (its
    [`options`][lightning_decentral.options.GossipOptions]), its bound topology, the precision and the model's
    trainable layout. Strings up to 64 characters, digests of what does not fit.

    Every field of `GossipOptions` but `compression_overlap` changes what travels between the ranks, how it is
    combined, or which collectives run, so each is compared (a rank that differs would meet another message size,
    another exchange or another collective: a gloo abort, a hang, or replicas that drift apart in silence):

    - `topology`: who exchanges with whom and with which weights (its `repr` and the digest of `W(0..period-1)`).
    - `combine`, `momentum`: the update rule (which tensors travel, and when: AWC posts `x(k)`, DecentLaM `z`).
    - `gossip_every`, `gossip_steps` (and its schedule): at which steps and how many rounds travel.
    - `gossip_buffers`: whether the buffers travel beside the parameters (the message's size).
    - `eval_on`: `"average"` all-reduces the replicas for every evaluation, `"local"` does not.
    - `bucket_cap_mb` (as bytes): DecentLaM's buckets, the unit each message carries.
    - `gossip_dtype`: the precision on the wire (the message's size).
    - `staleness`, `delays`: which step of each neighbour is mixed (and a gloo group of its own).
    - `on_peer_failure`, `min_workers`: whether the survivors' membership runs, and when it stops the run.
    - `outer_optimizer` (class and defaults), `outer_overlap`: the outer step and when its exchange travels.
    - `compression` (the compressor with its parameters: `Sign(block=1024, ...)`, `TopK(fraction=0.01, ...)`): the
      message's size and what each end adds to its public copies.
    - `consensus_step`: CHOCO's `γ`, how far each rank moves towards its neighbours' copies (`x̄` drifts if it
      differs).
    - `compression_overlap`: which thread runs the compressed exchange; the only field that changes no message (the
      same bytes in the same order either way), compared all the same so that a run has one setting to report.

    Of the executors' own arguments, the Trainer's strategy adds `rejoin` (a member without it never admits a rank
    that asks) with `max_steps` and `max_epochs`; `timeout`, `resume` and the start method change neither what travels
    nor how it is combined, and are not compared.
    """
    options = strategy.options
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = [b for b in module.buffers() if b.is_floating_point()] if options.gossip_buffers else []
    topology = strategy.topology
    return {
        "world size": strategy.world_size,
        "topology": repr(topology),
        "mixing matrices W(0..period-1)": digest(
            *(topology.mixing(k).round(12).tobytes() for k in range(topology.period))
        ),
        "momentum": options.momentum,
        "combine": options.combine,
        "gossip_every": options.gossip_every,
        "gossip_steps": options.gossip_steps.milestones[0],
        "gossip_steps schedule": _schedule_text(options.gossip_steps),
        "gossip_buffers": int(options.gossip_buffers),
        "eval_on": options.eval_on,
        "bucket bytes": options.bucket_bytes,
        "gossip_dtype": str(options.gossip_dtype),
        "staleness": options.staleness,
        "delays": schedule_name(options.delays),
        "on_peer_failure": options.on_peer_failure,
        "min_workers": options.min_workers_for(strategy.world_size),
        "outer_optimizer": ""
        if options.outer_optimizer is None
        else fitted(outer_optimizer_name(options.outer_optimizer)),
        "outer_overlap": int(options.outer_overlap),
        "compression": schedule_name(options.compression),
        "consensus_step": "" if options.consensus_step is None else _exact(options.consensus_step),
        "compression_overlap": int(options.compression_overlap),
        "shard_size": options.shard_size,
        "precision": precision,
        "trainable parameters (elements)": sum(p.numel() for p in params),
        "trainable parameter shapes and dtypes": digest(*(f"{tuple(p.shape)}{p.dtype}".encode() for p in params)),
        "mixed buffers (elements)": sum(b.numel() for b in buffers),
    }


def schedule_name(delays: Any) -> str:
    """A delay schedule or a compressor as the ranks compare it: its `repr` if that names its values (a dataclass
    such as `RandomDelays(seed=0)` or `Sign(block=1024, consensus_step=1.0)`), else its qualified name (a function's
    `repr` holds its address).

    Examples:
        >>> from lightning_decentral.compression import TopK
        >>> from lightning_decentral.mixing import RandomDelays
        >>> schedule_name(RandomDelays(seed=3)), schedule_name(None), schedule_name(fitted)
        ('RandomDelays(seed=3)', '', 'lightning_decentral.agreement.fitted')
        >>> schedule_name(TopK(0.01))
        'TopK(fraction=0.01, consensus_step=0.03)'
    """
    if delays is None:
        return ""
    if dataclasses.is_dataclass(delays):
        return fitted(repr(delays))
    named = delays if hasattr(delays, "__qualname__") else type(delays)
    return fitted(f"{named.__module__}.{named.__qualname__}")


def parameter_deviations(ranks: Ranks, module: torch.nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    """For each trainable parameter `p` of `module`: its name, `‖p_i − p̄‖²` on this rank and `‖p̄‖²`.

    0-dim float64 tensors, `p̄ = (1/n) Σ_i p_i` averaged in at least float32. Costs one all-reduce
    of the parameters; every rank must call it together.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    wide = [local_tensor(p).detach().to(torch.promote_types(p.dtype, torch.float32)) for _, p in named]
    means = ranks.mean(wide)
    return [(name, _squared_norm(w - m), _squared_norm(m)) for (name, _), w, m in zip(named, wide, means)]


def _schedule_text(schedule: RoundsSchedule) -> str:
    """A `gossip_steps` schedule as the ranks compare it (`""` for rounds that never change)."""
    return fitted(str(schedule)) if len(schedule.milestones) > 1 else ""


def mean_optimizer_state(ranks: Ranks, state: dict[str, Any], mean: MeanFn | None = None) -> dict[str, Any]:
    """An optimizer `state_dict` with every floating-point state tensor (momentum, Adam's moments) replaced
    by its mean over the ranks, one all-reduce per (device, dtype) (`mean`, default `ranks.mean`); the live state is
    never touched.

    For DecentLaM this also cancels each rank's consensus term: `1ᵀ (I − W) = 0`.
    """
    if ranks.world_size == 1 or not state:
        return state
    return averaged_optimizer_state([state], mean or ranks.mean)


def _squared_norm(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def digest(*parts: bytes) -> int:
    """A 64-bit signed digest of `parts`, to compare data too long to gather.

    Examples:
        >>> digest(b"ring") == digest(b"ring") != digest(b"torus")
        True
    """
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little", signed=True)


def released_by_gloo(tensor: Tensor, limit: float = 1.0) -> None:
    """Wait (at most `limit` seconds) until gloo's worker thread has dropped its reference to `tensor`.

    A blocking gloo collective returns before the worker thread frees the work that holds the tensor.
    If the worker frees it after Python has dropped the tensor, it needs the GIL to free the Python
    object, and if the interpreter is exiting by then the process aborts (`terminate called without
    an active exception`). The average handed back by the spawn launcher is a spawned rank's last
    collective, so it waits here, at most a few milliseconds. CUDA tensors (NCCL) are left alone.
    """
    if tensor.device.type != "cpu":
        return
    deadline = time.monotonic() + limit
    while use_count(tensor) > 1 and time.monotonic() < deadline:
        time.sleep(1e-4)


def _encode(value: int | str) -> list[int]:
    if isinstance(value, str):
        codes = [ord(c) for c in value[:_STRING_SLOTS]]
        return codes + [0] * (_STRING_SLOTS - len(codes))
    return [int(value)]


def _decode(row: list[int], like: dict[str, int | str]) -> dict[str, int | str]:
    decoded = {}
    offset = 0
    for name, value in like.items():
        if isinstance(value, str):
            decoded[name] = "".join(chr(c) for c in row[offset : offset + _STRING_SLOTS] if c)
            offset += _STRING_SLOTS
        else:
            decoded[name] = row[offset]
            offset += 1
    return decoded


class Disagreement(RuntimeError):
    """The ranks were about to run different collectives (a checkpoint load on one, an optimizer step on another):
    raised at once, naming what each rank does ([`Activities`][lightning_decentral.agreement.Activities])."""


class Activities:
    """What each rank is doing, published out of band in the process group's key-value store, so that ranks about to
    run different collectives find out at once instead of waiting for each other until the timeout.

    Every rank publishes the same sequence of activities when it runs the same program: `start(what)` when it begins
    something that needs no agreement (an optimizer step), `agree(what)` before a collective every rank must enter
    together (a checkpoint save or load, `x̄`). `agree` waits until every rank has published the same activity as its
    activity number `c`; a rank whose activity `c` is another, or that is past `c` without having passed this
    agreement, is doing something else: every rank that waits raises
    [`Disagreement`][lightning_decentral.agreement.Disagreement] naming what each does. A rank that passed it (it saw
    every rank at `c`) says so under a key of its own, so a slower rank still waiting lets it be past `c`: it may have
    gone on when no collective follows the agreement, an error raised before the collective, say. A rank
    that publishes nothing new (it is busy, or blocked in a collective it started earlier) is named after `timeout`
    seconds with its last activity ([`PeerFailure`][lightning_decentral.failures.PeerFailure]); after `warn_after`
    seconds `warn` says who it waits for. Its calls to the store run under a
    [`GuardedStore`][lightning_decentral.rendezvous.GuardedStore] of the same timeout (`start` runs at every step). With
    a [`Guard`][lightning_decentral.membership.guard.Guard], the wait is one of its operations, ended by a failure it
    polls; a rank alone agrees with nobody.

    Examples:
        Two ranks in one process, over an in-memory store: rank 1 loads while rank 0 trains.

        >>> store = dist.HashStore()
        >>> ranks = [Activities(store, rank, 2, timeout=1.0) for rank in range(2)]
        >>> ranks[0].start("optimizer step 0")
        >>> ranks[1].agree("fabric.load('last.ckpt')")
        Traceback (most recent call last):
        ...
        lightning_decentral.agreement.Disagreement: The ranks are not doing the same thing: rank 1 is in
        fabric.load('last.ckpt') while rank 0 is in optimizer step 0. ...
    """

    def __init__(
        self,
        store: dist.Store | None,
        rank: int,
        world_size: int,
        timeout: float,
        warn_after: float = 30.0,
        warn: Callable[[str], None] = lambda message: warnings.warn(message, stacklevel=3),
        guard: Guard | None = None,
    ) -> None:
        self.store = None if store is None else GuardedStore.around(store, timedelta(seconds=timeout))
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.warn_after = warn_after
        self.warn = warn
        self.guard = guard
        self.count = 0  # activities this rank has published
        self.current = ""

    @classmethod
    def of_group(cls, ranks: Ranks, timeout: timedelta | None) -> Activities:
        """Activities of the ranks of the default process group (`ranks`, a
        [`Ranks`][lightning_decentral.agreement.Ranks], whose guard they share), under keys of their own (one all-gather
        agrees on them) of the default group's store; published nowhere without a process group, or with one rank."""
        seconds = (timeout or timedelta(minutes=30)).total_seconds()
        if not dist.is_initialized() or ranks.world_size == 1:
            return cls(None, ranks.rank, ranks.world_size, seconds, guard=ranks.guard)
        tag = int(ranks.gather([secrets.randbits(62)], "Agreeing on where the ranks publish their activities")[0, 0])
        prefixed = dist.PrefixStore(f"lightning_decentral/activities/{tag}/", default_store())
        return cls(prefixed, ranks.rank, ranks.world_size, seconds, guard=ranks.guard)

    def start(self, what: str) -> None:
        """This rank begins `what` (its activity number `count + 1`), which needs no agreement."""
        self.count += 1
        self.current = what
        if self.store is not None:
            self.store.set(str(self.rank), f"{self.count}|{what}")

    def agree(self, what: str) -> None:
        """Begin `what`, a collective, once every rank has begun it as the same activity (see the class docstring).

        Call it right before the collective's first exchange, and begin or agree on nothing else until then: a rank
        that passed may publish its next activity only once every rank has passed (entered that collective)."""
        self.start(what)
        if self.guard is None:
            return self._wait_for_every_rank(what)
        self.guard.operation(lambda: self._wait_for_every_rank(what))

    def _wait_for_every_rank(self, what: str) -> None:
        if self.store is None or (self.guard is not None and self.guard.alone):
            return
        started = time.monotonic()
        pause = 0.005
        warned = False
        while True:
            reason = self.guard.poll() if self.guard is not None else None
            if reason is not None:
                raise Abandoned(f"{what} was given up on rank {self.rank}: {reason}.")
            with peers_answer(f"{what}, reading what the other ranks do,"):
                seen = self._published()
            ahead = [r for r, (c, _) in seen.items() if c > self.count]
            if ahead and any(self._passed(r) == self.count for r in ahead):
                return self._pass()  # a rank passed this agreement: every rank had begun it
            elsewhere = {r: w for r, (c, w) in seen.items() if c > self.count or (c == self.count and w != what)}
            if elsewhere:
                raise Disagreement(
                    f"The ranks are not doing the same thing: rank {self.rank} is in {what} while "
                    + ", ".join(f"rank {r} is in {w}" for r, w in sorted(elsewhere.items()))
                    + ". It is a collective every rank must run at the same point: call it on every rank (not under "
                    "`if global_rank == 0`), with the same arguments."
                )
            behind = {r: w for r, (c, w) in seen.items() if c < self.count}
            if not behind:
                return self._pass()
            waited = time.monotonic() - started
            named = ", ".join(f"rank {r} ({w or 'nothing yet'})" for r, w in sorted(behind.items()))
            if waited > self.timeout:
                raise PeerFailure(
                    f"{what} waited {waited:.1f} s (the timeout) on rank {self.rank} for {named} to begin it: those "
                    "ranks are still busy, blocked in something else, or gone."
                )
            if waited > self.warn_after and not warned:
                warned = True
                self.warn(
                    f"Rank {self.rank} has waited {waited:.1f} s in {what} for {named}; it gives up after "
                    f"{self.timeout:.1f} s."
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _pass(self) -> None:
        """This rank saw every rank begin its activity `count`: say so before it goes on (see `agree`)."""
        assert self.store is not None
        with peers_answer(f"{self.current}, saying it agreed,"):
            self.store.set(f"{self.rank}/passed", str(self.count))

    def _passed(self, rank: int) -> int:
        """The activity number of the last agreement `rank` passed (0: none)."""
        assert self.store is not None
        key = f"{rank}/passed"
        with peers_answer(f"{self.current}, reading what the other ranks agreed,"):
            return int(self.store.get(key)) if self.store.check([key]) else 0

    def _published(self) -> dict[int, tuple[int, str]]:
        """Every other rank's last activity: `rank -> (number, what)` (`(0, "")` before its first)."""
        assert self.store is not None
        seen = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                key = str(rank)
                number, _, what = (
                    self.store.get(key).decode().partition("|") if self.store.check([key]) else ("0", "", "")
                )
                seen[rank] = (int(number), what)
        return seen
