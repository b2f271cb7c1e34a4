"""The update-rule arguments every executor takes, checked once, before anything runs:
[`GossipOptions`][lightning_decentral.options.GossipOptions]."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar, get_type_hints

import torch
from torch.optim import Optimizer

from lightning_decentral.compression import Compressor, resolve_compression
from lightning_decentral.mixing import DelaySchedule
from lightning_decentral.schedule import RoundsSchedule
from lightning_decentral.topology import TOPOLOGIES, Hierarchical, Topology, topology_class

TopologyName = Literal[tuple(TOPOLOGIES)]  # type: ignore[valid-type]  # built from the registry at import: no static list
"""A built-in topology by name."""

TopologyArgument = TopologyName | Topology | list[list[float]] | list[list[list[float]]] | str
"""What a strategy's `topology` takes in a config: a name, a `Topology` (by `class_path`), a mixing matrix, or a list of
them for a time-varying topology (another string is checked when the strategy is built: an unknown name is refused
naming the choices). Python code may also pass a numpy array, a tensor or a `networkx` graph."""

COMBINE = ("awc", "atc")
EVAL_ON = ("average", "local")
MOMENTUM = ("local", "decentlam")
ON_PEER_FAILURE = ("stop", "continue")
GOSSIP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GossipDtypeName = Literal[tuple(str(d).removeprefix("torch.") for d in GOSSIP_DTYPES)]  # type: ignore[valid-type]  # from GOSSIP_DTYPES: one list
"""`gossip_dtype` by name (`"bfloat16"`, `"float16"`, `"float32"`): what a YAML config or the command line gives."""

OptimizerFactory = Callable[[Iterable], Optimizer]
"""`parameters -> optimizer`, what `outer_optimizer` takes: `functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9,
nesterov=True)` in Python; in a YAML config `class_path: torch.optim.SGD` with `init_args: {lr: 0.7, ...}` (Lightning's
`OptimizerCallable`)."""


def rule_name(momentum: str, combine: str) -> str:
    """The update rule (an entry of [`RULES`][lightning_decentral.rules.RULES]) that `momentum` and `combine` select;
    DecentLaM ignores `combine`.

    Examples:
        >>> rule_name("local", "atc"), rule_name("decentlam", "awc")
        ('atc', 'decentlam')
    """
    return "decentlam" if momentum == "decentlam" else combine


@dataclass(frozen=True)
class GossipOptions:
    """The update-rule arguments of every executor, checked when built: a bad one raises `ValueError` naming the fix.

    This is the one list of them: the Trainer's and Fabric's
    [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy] and the
    [`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy] take these fields as
    keyword arguments (their signatures and LightningCLI's help list them; an unknown name is a `TypeError`).
    `gossip_steps` is kept as a [`RoundsSchedule`][lightning_decentral.schedule.RoundsSchedule] and `gossip_dtype` as a
    `torch.dtype` (or `None`). The topology stays as given: it is bound to the world size by the
    [driver][lightning_decentral.driver.StepDriver], which also checks `min_workers` against it.

    Args:
        topology: a name from `TOPOLOGIES` (`"ring"`, `"torus"`, `"exponential"`, `"one_peer_exponential"`,
            `"complete"`, `"random_matching"`, `"hierarchical"`), a [`Topology`][lightning_decentral.topology.Topology]
            (in a config by `class_path`, e.g. `lightning_decentral.Torus` with `init_args: {rows: 2}`) or a mixing
            matrix (a list of them: one per step of a period); in Python also a numpy array, a tensor or a `networkx`
            graph.
        combine: `"awc"` (adapt-with-combine: `x_i(k+1) = Σ_j w_ij x_j(k) + U(x_i(k), g_i) − x_i(k)`, the exchange
            of `x(k)` overlaps forward and backward) or `"atc"` (adapt-then-combine:
            `x_i(k+1) = Σ_j w_ij U(x_j(k), g_j)`); ignored by DecentLaM.
        momentum: `"local"` (the optimizer's own momentum, the first two rules) or `"decentlam"`
            (`z_j = x_j − γ g_j`, `g̃_i = (x_i − Σ_j w_ij z_j) / γ`, `x_i(k+1) = U(x_i(k), g̃_i)`; each bucket of `z` is
            exchanged as soon as its gradients exist).
        gossip_every: gossip on steps with `(k + 1) % gossip_every == 0`; local steps otherwise.
        gossip_steps: rounds of `W(k)` per gossip step (`W(k)^gossip_steps`); or rounds that change over
            training: a [`RoundsSchedule`][lightning_decentral.schedule.RoundsSchedule], or
            `{"epoch": {0: 4, 5: 2, 10: 1}}` (4 rounds in epochs 0–4, 2 in 5–9, then 1) or `{"step": {...}}`.
        gossip_buffers: also mix floating-point buffers (BatchNorm statistics); else each worker keeps its own.
        eval_on: `"average"` validates, tests and predicts on `x̄` (each replica is restored afterwards); `"local"` on
            each worker's own replica (the simulation: worker 0's).
        bucket_cap_mb: DecentLaM's bucket size in MB: the unit of communication overlapped with backward.
        gossip_dtype: send point-to-point messages in this precision (`torch.bfloat16` or `torch.float16`, or their
            names; `None`: the parameters' own). Replicas and optimizer state stay in full precision; the exchange
            keeps `x̄` exactly and feeds the rounding error back (`x_i <- x_i + Σ_j w_ij q_j − q_i`). All-reduces
            (`complete`) stay in full precision.
        staleness: bounded staleness `s` (AWC and ATC, one round per step, a static point-to-point topology): worker
            `i` mixes with the newest replica received from each neighbour, at most `s` steps old, and waits only for
            a neighbour more than `s` steps behind (docs/algorithms.md, "Bounded staleness"). 0: wait for every
            neighbour's step `k`.
        delays: impose which step of each neighbour is mixed, `τ = k − delays(i, j, k, s)` (a
            [`DelaySchedule`][lightning_decentral.mixing.DelaySchedule] such as
            [`RandomDelays`][lightning_decentral.mixing.RandomDelays]): a deterministic run, the same in the simulation
            and on processes. `None`: the newest received (processes), `τ = k` (simulation).
        on_peer_failure: `"stop"`: a rank that dies, hangs past `timeout` or fails stops every rank with
            [`PeerFailure`][lightning_decentral.failures.PeerFailure]. `"continue"` (processes): the survivors agree on
            who is left and go on among themselves, each with its own replica, optimizer state and data, with the
            topology of the survivors (docs/reliability.md, "Surviving a failure"); the simulation's `failures=`
            runs the same rule in one process.
        min_workers: with `"continue"`, the run stops when fewer workers survive; `None`: half of them, rounded up
            ([`min_workers_for`][lightning_decentral.options.GossipOptions.min_workers_for]).
        outer_optimizer: local steps with an outer optimizer over gossip (docs/algorithms.md, "Outer steps"): a
            factory `parameters -> torch optimizer`, e.g. `functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9,
            nesterov=True)` (YAML: `class_path: torch.optim.SGD`, `init_args: {lr: 0.7, momentum: 0.9, nesterov:
            true}`). Every `gossip_every = H` steps of the user's optimizer, worker `i` sends its model `x_i`, takes
            the pseudo-gradient `Δ̃_i = θ_i − Σ_j w_ij x_j` from its anchor `θ_i`, steps the anchor with this
            optimizer, `θ_i <- OuterOpt(θ_i, Δ̃_i)`, and starts the next round from it, `x_i <- θ_i`. With
            `topology="complete"` it is DiLoCo. `combine` is ignored; `momentum="decentlam"` and `staleness` are
            refused. `None`: `gossip_every` mixes the models, as ATC or AWC.
        outer_overlap: with `outer_optimizer`, the round's exchange travels during the next round's inner steps and
            its outer step is applied one round late, the local progress made meanwhile kept on top of it
            (docs/algorithms.md, "Overlapping the exchange").
        compression: compressed gossip (CHOCO, docs/algorithms.md, "Compressed gossip (CHOCO)"): each worker sends
            each neighbour `C(x_i − x̂)`, `x̂` the public copy both ends of the edge keep, and moves by `γ` towards its
            neighbours' copies. `"sign"` (1 bit per element and a scale per 1024), `"int8"`, `"int4"` (also `"int2"` …
            `"int8"`: codes and a scale per 1024), `"top_k:0.01"` (the largest 1 % with packed indices),
            `"random_k:0.01"` (1 % of the coordinates drawn from a seed both ends share, values only), or a
            [`Compressor`][lightning_decentral.compression.Compressor] (`Sign()`, `Quantize(bits=4)`, `TopK(0.01)`,
            `RandomK(0.01)`, or your own). Kept as the compressor object. `None`: plain gossip. Runs with AWC and ATC
            (any flat topology, rounds, `gossip_every`) and with an `outer_optimizer` (the round's models are sent
            compressed: docs/algorithms.md, "Outer steps"); not with DecentLaM, staleness, `gossip_dtype`,
            `on_peer_failure="continue"` or a `Hierarchical` topology.
        consensus_step: `γ` of compressed gossip, in `(0, 1]`; `None`: the compressor's `consensus_step` (sign, int8,
            int4: 1; int2, int3: 0.3; `top_k:f`: `3f`; `random_k:f`: `f`; measured in docs/benchmarks.md,
            "Compressed gossip"). Kept as the value used.
        compression_overlap: with `compression`, on processes and CPU buffers, run each exchange's CHOCO arithmetic
            (encode, messages, decode, correction) on a helper thread of the mixer between its start and its wait:
            under AWC the exchange of `x(k)` then overlaps forward and backward as the uncompressed one does, where
            a core is free (docs/algorithms.md, "Compressed gossip (CHOCO)"). The same bytes and results either way;
            `False` (the default) runs it on the training thread (the encode before the forward pass, the decode after
            backward): on the 2 shared CPU cores it was measured on, the helper thread did not shorten a step
            (docs/benchmarks.md, "Overlap: what runs where"). Ignored without compression, in the simulation and on
            CUDA (the current stream, the training thread).
        shard_size: `s`, the ranks of one replica (the Trainer's strategy only): `n = r·s` ranks form `r` replicas of
            `s` consecutive ranks, FSDP2 shards each replica over its ranks and the rule runs across the `r` replicas
            on the local shards (docs/sharded.md). 1: every rank is a replica. Not with `staleness` or a
            `Hierarchical` topology; with `on_peer_failure="continue"` a replica that loses a rank leaves whole.

    Examples:
        >>> options = GossipOptions(combine="atc", gossip_steps={"epoch": {0: 4, 5: 1}}, gossip_dtype="bfloat16")
        >>> options.rule, options.gossip_steps.most, options.gossip_dtype, options.bucket_bytes
        ('atc', 4, torch.bfloat16, 4194304)
        >>> GossipOptions(combine="acw")
        Traceback (most recent call last):
        ...
        ValueError: `combine` must be one of ['awc', 'atc'], got 'acw'.
        >>> GossipOptions(staleness=2, gossip_steps=2)
        Traceback (most recent call last):
        ...
        ValueError: staleness=2 mixes one round of W per step with the neighbours' newest replicas,
        but gossip_steps=2 ...
        >>> GossipOptions(compression="top_k:0.05").consensus_step
        0.15
        >>> GossipOptions(compression="sign", momentum="decentlam")
        Traceback (most recent call last):
        ...
        ValueError: compression=Sign(block=1024, consensus_step=1.0) runs with combine='awc' or 'atc', ...
        momentum='local' ...
    """

    topology: TopologyArgument = "ring"
    combine: Literal["awc", "atc"] = "awc"
    momentum: Literal["local", "decentlam"] = "local"
    gossip_every: int = 1
    gossip_steps: int | RoundsSchedule | dict[str, dict[int, int]] = 1
    gossip_buffers: bool = True
    eval_on: Literal["average", "local"] = "average"
    bucket_cap_mb: float = 4.0
    gossip_dtype: torch.dtype | GossipDtypeName | None = None
    staleness: int = 0
    delays: DelaySchedule | None = None
    on_peer_failure: Literal["stop", "continue"] = "stop"
    min_workers: int | None = None
    outer_optimizer: OptimizerFactory | None = None
    outer_overlap: bool = False
    compression: str | Compressor | None = None
    consensus_step: float | None = None
    compression_overlap: bool = False
    shard_size: int = 1

    def __post_init__(self) -> None:
        _check_choice("combine", self.combine, COMBINE)
        _check_choice("on_peer_failure", self.on_peer_failure, ON_PEER_FAILURE)
        if self.min_workers is not None:
            _check_positive_int("min_workers", self.min_workers, "the fewest workers a run goes on with")
        _check_choice("eval_on", self.eval_on, EVAL_ON)
        _check_choice("momentum", self.momentum, MOMENTUM)
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"`bucket_cap_mb` must be positive and finite (the MB of one bucket), got {cap!r}.")
        _check_positive_int("gossip_every", self.gossip_every)
        if isinstance(self.topology, str):
            topology_class(self.topology)  # raises naming the choices
        object.__setattr__(self, "gossip_steps", RoundsSchedule.of(self.gossip_steps))
        object.__setattr__(self, "gossip_dtype", _check_gossip_dtype(self.gossip_dtype))
        self._check_staleness()
        self._check_outer()
        self._check_compression()
        self._check_sharding()

    def _check_sharding(self) -> None:
        """`shard_size` is an integer ≥ 1; above 1 the rule runs across replicas of `shard_size` ranks, which every rank
        of a replica must reach at the same step and which fail together (with `on_peer_failure="continue"` a replica
        that loses a rank leaves whole)."""
        _check_positive_int("shard_size", self.shard_size, "1 = every rank is a replica")
        if self.shard_size == 1:
            return
        unsupported = [
            (
                self.staleness > 0,
                f"staleness={self.staleness} (FSDP's collectives inside a replica keep its ranks at one step, and the "
                "stale exchange's own group spans every rank)",
                "use staleness=0",
            ),
            (
                isinstance(t := self.topology, Hierarchical) or (isinstance(t, str) and TOPOLOGIES[t] is Hierarchical),
                "a Hierarchical topology (the ranks of a node already form one replica: FSDP inside it replaces the "
                "average on the node)",
                "use a flat topology over the replicas such as topology='ring' or 'one_peer_exponential'",
            ),
        ]
        for bad, what, fix in unsupported:
            if bad:
                raise ValueError(
                    f"shard_size={self.shard_size} shards every replica over {self.shard_size} ranks, but {what} is "
                    f"not supported with it: {fix}, or shard_size=1."
                )

    def _check_staleness(self) -> None:
        """`staleness` is an integer ≥ 0; above 0 it takes AWC or ATC, one round every step, full precision;
        `delays` (a schedule) needs it above 0."""
        s = self.staleness
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"`staleness` must be an integer ≥ 0 (0: wait for every neighbour's step k), got {s!r}.")
        if self.delays is not None and not callable(self.delays):
            raise ValueError(
                "`delays` must be a schedule, delays(worker, neighbour, step, staleness) -> d (e.g. "
                f"RandomDelays(seed=0)), got {self.delays!r}."
            )
        if s == 0:
            if self.delays is not None:
                raise ValueError("`delays` say how stale each neighbour's replica is: they need staleness ≥ 1.")
            return
        unsupported = [
            (
                self.rule == "decentlam",
                "momentum='decentlam' (its correction needs every neighbour's z of the same step)",
                "use combine='awc' or 'atc'",
            ),
            (self.gossip_every != 1, f"gossip_every={self.gossip_every}", "use gossip_every=1"),
            (self.gossip_steps != RoundsSchedule.of(1), f"gossip_steps={self.gossip_steps}", "use gossip_steps=1"),
            (self.gossip_dtype is not None, f"gossip_dtype={self.gossip_dtype}", "use gossip_dtype=None"),
            (
                self.on_peer_failure != "stop",
                f"on_peer_failure={self.on_peer_failure!r} (the survivors rebuild the "
                "graph at one agreed step, which ranks steps apart cannot name)",
                "use on_peer_failure='stop'",
            ),
        ]
        for bad, what, fix in unsupported:
            if bad:
                raise ValueError(
                    f"staleness={s} mixes one round of W per step with the neighbours' newest replicas, but {what} is "
                    f"not supported with it: {fix}, or staleness=0."
                )

    def _check_outer(self) -> None:
        """`outer_optimizer` builds a torch optimizer; it takes `momentum="local"`, `staleness=0`; `outer_overlap` needs
        it and `on_peer_failure="stop"`."""
        if not isinstance(self.outer_overlap, bool):
            raise ValueError(f"`outer_overlap` must be True or False, got {self.outer_overlap!r}.")
        if self.outer_optimizer is None:
            if self.outer_overlap:
                raise ValueError(
                    "outer_overlap=True overlaps the exchange of an outer step: it needs an outer_optimizer."
                )
            return
        probe_outer_optimizer(self.outer_optimizer)  # raises naming the fix
        unsupported = [
            (
                self.momentum == "decentlam",
                "momentum='decentlam' (its correction needs an exchange at every step)",
                "use momentum='local'",
            ),
            (
                self.staleness > 0,
                f"staleness={self.staleness} (an outer step waits for its round's exchange)",
                "use staleness=0",
            ),
            (
                self.outer_overlap and self.on_peer_failure != "stop",
                "outer_overlap=True with on_peer_failure='continue' "
                "(an exchange in flight across steps cannot be discarded at one agreed step)",
                "use outer_overlap=False",
            ),
        ]
        for bad, what, fix in unsupported:
            if bad:
                raise ValueError(
                    f"outer_optimizer runs local steps and one outer step per gossip round, but {what} is "
                    f"not supported with it: {fix}, or outer_optimizer=None."
                )

    def _check_compression(self) -> None:
        """`compression` resolves to a compressor (or `None`); `consensus_step` is in `(0, 1]`, and only with one; they
        run with AWC and ATC, synchronous, in the compressor's own format, while every rank lives;
        `compression_overlap` is a bool."""
        if not isinstance(self.compression_overlap, bool):
            raise ValueError(f"`compression_overlap` must be True or False, got {self.compression_overlap!r}.")
        compressor = resolve_compression(self.compression)  # raises naming the choices
        object.__setattr__(self, "compression", compressor)
        step = self.consensus_step
        if compressor is None:
            if step is not None:
                raise ValueError(
                    f"`consensus_step={step!r}` is the step γ of compressed gossip: pass compression= too (e.g. "
                    "compression='sign'), or leave consensus_step=None."
                )
            return
        step = compressor.consensus_step if step is None else step
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 1:
            raise ValueError(f"`consensus_step` (CHOCO's γ) must be in (0, 1], got {step!r}.")
        object.__setattr__(self, "consensus_step", float(step))
        unsupported = [
            (
                self.rule == "decentlam",
                "momentum='decentlam' (its correction needs Σ_j w_ij z_j exactly)",
                "use momentum='local' with combine='awc' or 'atc'",
            ),
            (self.staleness > 0, f"staleness={self.staleness}", "use staleness=0"),
            (
                self.gossip_dtype is not None,
                f"gossip_dtype={self.gossip_dtype} (the compressor decides what travels)",
                "use gossip_dtype=None",
            ),
            (
                self.on_peer_failure != "stop",
                f"on_peer_failure={self.on_peer_failure!r} (the survivors' graph would need "
                "new public copies on both ends of every edge)",
                "use on_peer_failure='stop'",
            ),
            (
                isinstance(t := self.topology, Hierarchical) or (isinstance(t, str) and TOPOLOGIES[t] is Hierarchical),
                "a Hierarchical topology (one compressed exchange would replace its two levels)",
                "use a flat topology such as topology='ring' or 'one_peer_exponential'",
            ),
        ]
        for bad, what, fix in unsupported:
            if bad:
                raise ValueError(
                    f"compression={compressor!r} runs with combine='awc' or 'atc', staleness=0, full-precision buffers "
                    f"and on_peer_failure='stop'; {what} is not supported with it: {fix}, or compression=None."
                )

    @property
    def rule(self) -> str:
        """The update rule: `"outer"` with an `outer_optimizer`, else what `momentum` and `combine` select
        ([`rule_name`][lightning_decentral.options.rule_name])."""
        return "outer" if self.outer_optimizer is not None else rule_name(self.momentum, self.combine)

    def min_workers_for(self, world_size: int) -> int:
        """The fewest survivors a run of `world_size` workers goes on with: `min_workers`, or half the workers
        rounded up (below that, more than half the data shards are no longer visited: a different experiment
        rather than a degraded one). Raises `ValueError` if `min_workers` exceeds `world_size`.

        Examples:
            >>> (GossipOptions(on_peer_failure="continue").min_workers_for(5),
            ...  GossipOptions(min_workers=2).min_workers_for(8))
            (3, 2)
        """
        if self.min_workers is None:
            return (world_size + 1) // 2
        if self.min_workers > world_size:
            raise ValueError(
                f"min_workers={self.min_workers} is more than the {world_size} workers of the run: pass at most "
                f"{world_size}."
            )
        return self.min_workers

    def check_backend(self, backend: str) -> None:
        """Refuse `on_peer_failure="continue"` on a process-group backend other than gloo (NCCL: a GPU run), before
        training: the survivors close the broken group by a behaviour of gloo's (a receive waited past its timeout
        closes every connection of the group, here and at the peers), which the package has no counterpart of on NCCL.

        Examples:
            >>> GossipOptions(on_peer_failure="continue").check_backend("gloo")
            >>> GossipOptions(on_peer_failure="stop").check_backend("nccl")
            >>> GossipOptions(on_peer_failure="continue").check_backend("nccl")
            Traceback (most recent call last):
            ...
            ValueError: on_peer_failure='continue' is supported on the gloo backend only (CPU training), not nccl: ...
        """
        if self.on_peer_failure == "continue" and backend != "gloo":
            raise ValueError(
                f"on_peer_failure='continue' is supported on the gloo backend only (CPU training), not {backend}: the "
                "survivors regroup by closing the broken process group the way gloo allows, which is not built for "
                f"{backend}. Train on CPU (accelerator='cpu') to survive a failure, or use on_peer_failure='stop' "
                "(a restart resumes from the newest complete checkpoint)."
            )

    @property
    def bucket_bytes(self) -> int:
        """DecentLaM's bucket size in bytes."""
        return int(self.bucket_cap_mb * 2**20)


def gossip_options(owner: str, **arguments: Any) -> GossipOptions:
    """`GossipOptions(**arguments)` for the executor `owner`: a name that is no option is a `TypeError` naming the
    closest one.

    Examples:
        >>> gossip_options("DecentralizedStrategy", gossip_step=4)
        Traceback (most recent call last):
        ...
        TypeError: DecentralizedStrategy got an unexpected argument 'gossip_step': did you mean 'gossip_steps'? ...
    """
    names = [field.name for field in fields(GossipOptions)]
    for name in arguments:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"{owner} got an unexpected argument {name!r}: {hint}The update-rule arguments are {names}."
            )
    return GossipOptions(**arguments)


def refuse_sharding(options: GossipOptions, owner: str, why: str) -> None:
    """Raise `ValueError` if `options.shard_size` is above 1 on an executor that does not shard (`owner`, `why`).

    Examples:
        >>> refuse_sharding(GossipOptions(shard_size=2), "SimulatedDecentralizedStrategy", "its workers are rows")
        Traceback (most recent call last):
        ...
        ValueError: SimulatedDecentralizedStrategy does not shard replicas (its workers are rows): ...
    """
    if options.shard_size != 1:
        raise ValueError(
            f"{owner} does not shard replicas ({why}): drop shard_size={options.shard_size}, or train with the "
            "Trainer's DecentralizedStrategy(shard_size=...) (docs/sharded.md)."
        )


Executor = TypeVar("Executor", bound=type)


def takes_gossip_options(executor: Executor) -> Executor:
    """Class decorator for an executor whose `__init__(self, <its own arguments>, **options)` hands `options` to
    [`gossip_options`][lightning_decentral.options.gossip_options]: its signature (what `inspect.signature`, an IDE
    and LightningCLI's help show) becomes its positional arguments, the fields of `GossipOptions`, then its
    keyword-only arguments, so the list of update-rule arguments is written once."""
    own = [
        p
        for name, p in inspect.signature(executor.__init__).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    hints = get_type_hints(GossipOptions)
    shared = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(GossipOptions)
    ]
    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    executor.__signature__ = inspect.Signature(positional + shared + keyword)
    return executor


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def _check_gossip_dtype(dtype: Any) -> torch.dtype | None:
    """`None`, or one of `GOSSIP_DTYPES` (also given by name: `"bfloat16"`, `"torch.bfloat16"`, `"float16"`)."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if resolved not in GOSSIP_DTYPES:
        names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in GOSSIP_DTYPES)
        raise ValueError(
            f"`gossip_dtype` must be None or a floating-point type messages can travel in ({names}), got {dtype!r}. "
            "Use gossip_dtype=torch.bfloat16 to halve the bytes of a float32 model."
        )
    return resolved


def outer_optimizer_name(factory: Any) -> str:
    """What `factory` builds, as the ranks compare it: the optimizer's class and its defaults.

    Examples:
        >>> import functools
        >>> nesterov = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        >>> outer_optimizer_name(nesterov).split(", weight")[0]
        'SGD(lr=0.7, momentum=0.9, dampening=0'
    """
    built = probe_outer_optimizer(factory)
    defaults = ", ".join(f"{k}={v}" for k, v in built.defaults.items())
    return f"{type(built).__name__}({defaults})"


def probe_outer_optimizer(factory: Any) -> Optimizer:
    """What `factory` builds, on a probe tensor; `ValueError` naming the fix if it does not build a torch optimizer.

    Examples:
        >>> import functools
        >>> type(probe_outer_optimizer(functools.partial(torch.optim.Adam, lr=0.1))).__name__
        'Adam'
        >>> probe_outer_optimizer(functools.partial(torch.optim.SGD, lr=-1.0))
        Traceback (most recent call last):
        ...
        ValueError: `outer_optimizer` must be a factory, ...; building it failed:
        ValueError: Invalid learning rate: -1.0
    """
    fix = (
        "`outer_optimizer` must be a factory, parameters -> optimizer, such as functools.partial(torch.optim.SGD, "
        "lr=0.7, momentum=0.9, nesterov=True) (YAML: class_path: torch.optim.SGD, init_args: {lr: 0.7, ...})"
    )
    if not callable(factory) or isinstance(factory, Optimizer):
        raise ValueError(f"{fix}, got a {type(factory).__name__}.")
    try:
        built = factory([torch.zeros(1, requires_grad=True)])
    except Exception as error:
        raise ValueError(f"{fix}; building it failed: {type(error).__name__}: {error}") from error
    if not isinstance(built, Optimizer):
        raise ValueError(f"{fix}; it built a {type(built).__name__}.")
    return built


def _check_positive_int(name: str, value: Any, meaning: str = "1 = every step") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer ({meaning}), got {value!r}.")


REGISTERED = (
    ("dpsgd", "local", "popen"),
    ("dpsgd_spawn", "local", "spawn"),
    ("dpsgd_fork", "local", "fork"),
    ("decentlam", "decentlam", "popen"),
    ("decentlam_spawn", "decentlam", "spawn"),
    ("decentlam_fork", "decentlam", "fork"),
)
"""The strategy names `import lightning_decentral` registers: `(name, momentum, start_method)`."""


def register_strategies(registry: Any, strategy: type) -> None:
    """Register `strategy` in `registry` (the Trainer's or Fabric's) under each name of `REGISTERED`."""
    for name, momentum, start_method in REGISTERED:
        registry.register(
            name,
            strategy,
            description=f"Decentralized training (gossip), momentum={momentum!r}, start_method {start_method!r}",
            override=True,
            momentum=momentum,
            start_method=start_method,
        )
