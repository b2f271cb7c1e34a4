"""What every executor does around an update rule, written once: [`StepDriver`][lightning_decentral.driver.StepDriver].

The three executors (the Trainer's [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy],
Fabric's [`DecentralizedStrategy`][lightning_decentral.fabric.DecentralizedStrategy] and the
[`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy]) each hold one driver
and tell it only what they alone know: the world size, the epoch, the optimizer step, the rule's context
(grad scaler, whether backward may overlap, how to warn, how to reach every worker). The driver binds the
topology, holds the one gossip schedule, plans each step once, builds the rule, runs the step's lifecycle,
and keeps the monitoring surface ([`Driven`][lightning_decentral.driver.Driven]):

```text
driver.bind(world_size, num_nodes)                  topology and schedule, checked
driver.process_mixer(...), dense_mixer()            the exchange the options select (plain, stale, compressed),
                                                    by constructor
driver.build_rule(replica, mixer, optimizers, ...)  make_rule: RULES[options.rule](...) or OuterStep
                                                    (or driver.run(workers))
driver.begin(k)                                     plan = schedule.plan(k, epoch); runner.begin_step(plan)
driver.optimizer_step(k, run, closure)              run(runner.wrap_closure(closure)); end_step; finish_step
driver.state.register(key, save, load)              a piece of per-rank state, kept in every shard and handover
driver.shard_contents(worker, ...)                  a save, a handover: the shard (checkpoint.make_shard's arguments)
driver.state.load(shards)                           a resume, a rank that rejoins: every registered part restored
driver.drain(); driver.teardown()                   at the end of training; when the run is over
driver.keep(members, first_step, of)                after a failure, a join: W of the members (then rebind_mixers)
driver.guard.run(what, collective)                  every collective besides the exchange (survived like it)
```

Lightning-free: a single process drives the same lifecycle over a
[`DenseMixer`][lightning_decentral.mixing.DenseMixer] (see `tests/dense_executor.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import torch
from torch import Tensor

from lightning_decentral import checkpoint as shards
from lightning_decentral.checkpoint import StateRegistry
from lightning_decentral.compression import ChocoStates, Compressor, check_compressible
from lightning_decentral.failures import Survival
from lightning_decentral.gossip import CompressedGossip, Gossip, StaleGossip
from lightning_decentral.measures import random_state
from lightning_decentral.membership.guard import Guard
from lightning_decentral.mixing import (
    TRAINER,
    BytesSent,
    DelayedMixing,
    DelaySchedule,
    DenseMixer,
    ExchangeObserver,
    Mixer,
    Phrasing,
    Watch,
    check_stale_topology,
)
from lightning_decentral.options import GossipOptions, OptimizerFactory
from lightning_decentral.outer import OuterStep
from lightning_decentral.replicas import Replica
from lightning_decentral.rules import RULES, Closure, RuleContext, UpdateRule, check_one_optimizer
from lightning_decentral.schedule import GossipSchedule, RoundsSchedule, StepPlan
from lightning_decentral.topology import Topology, resolve_topology


def check_compressed_topology(topology: Topology, compression: Any) -> None:
    """Refuse compressed gossip on a time-varying topology, naming the fix: its public copies are kept per edge, and an
    edge a time-varying graph uses once per period finds its copy a period old, so consensus stalls (`sign` on
    `one_peer_exponential`, 4 workers: at 4.5–9 % of the start, and +48 % loss with an outer optimizer).

    Examples:
        >>> from lightning_decentral.topology import OnePeerExponential, Ring
        >>> check_compressed_topology(Ring(world_size=4), "sign")
        >>> check_compressed_topology(OnePeerExponential(world_size=4), "sign")
        Traceback (most recent call last):
        ...
        ValueError: compression='sign' keeps a public copy per edge, ... Use a static topology: ...
    """
    if compression is None or topology.period == 1:
        return
    raise ValueError(
        f"compression={compression!r} keeps a public copy per edge, which the time-varying topology {topology!r} uses "
        f"once in {topology.period} matrices: each copy is that many exchanges old when its edge comes back, and "
        "consensus stalls (sign on one_peer_exponential with 4 workers: at 4.5-9 % of its start). Use a static "
        "topology: topology='one_peer_ring' (one peer a step, as one_peer_exponential), 'exponential' (its edges at "
        "every step) or 'ring', the one of these whose W is symmetric, as CHOCO's convergence needs (the others "
        "warn); or compression=None."
    )


def check_compressed_symmetry(topology: Topology, compression: Any, warn: Callable[[str], None]) -> None:
    """Warn if compressed gossip runs over a `W` that is not symmetric: CHOCO's convergence is proven for a symmetric
    `W`, and on the directed `one_peer_ring` `sign` diverged on a language model at `γ = 1` and, later, at `γ = 1/2`,
    where the undirected `ring` trained (docs/benchmarks.md, "Sharded replicas on the emulated network").

    Examples:
        >>> from lightning_decentral.topology import OnePeerRing, Ring
        >>> check_compressed_symmetry(Ring(world_size=4), "sign", print)
        >>> check_compressed_symmetry(OnePeerRing(world_size=4), None, print)
        >>> check_compressed_symmetry(OnePeerRing(world_size=4), "sign", print)
        compression='sign' on OnePeerRing(world_size=4), whose W is not symmetric: ... topology='ring' ...
    """
    if compression is None:
        return
    matrix = topology.mixing(0)
    if np.allclose(matrix, matrix.T):
        return
    warn(
        f"compression={compression!r} on {topology!r}, whose W is not symmetric: CHOCO's convergence is proven for a "
        "symmetric W, and sign on the directed one_peer_ring diverged on a language model in docs/benchmarks.md "
        "(at consensus_step=1 after 150 steps, at 0.5 after 300) where the undirected ring trained. Use a symmetric "
        "topology: topology='ring' (two peers a step, each message 1/32 of the model with sign), 'torus' or "
        "'hierarchical'; or compression=None."
    )


class StepRunner(Protocol):
    """What the driver runs at each step: one worker's [`UpdateRule`][lightning_decentral.rules.UpdateRule] (a
    process), or every simulated worker at once (a [`WorkerGroup`][lightning_decentral.simulation.WorkerGroup])."""

    def begin_step(self, plan: StepPlan) -> None: ...

    def before_backward(self) -> None: ...

    def no_backward_sync(self) -> AbstractContextManager: ...

    def wrap_closure(self, closure: Closure) -> Closure: ...

    def end_step(self) -> None: ...

    def finish_step(self) -> None: ...

    def drain(self) -> None: ...

    def teardown(self) -> None: ...

    def residual(self, step: int) -> Tensor | None: ...

    def mix(self, step: int, rounds: int) -> None: ...


class RuleStates(Protocol):
    """Where the driver reads and restores what its workers' rules carry across steps (the `"rule_state"` part of the
    [`StateRegistry`][lightning_decentral.checkpoint.StateRegistry]): a process's one rule
    ([`OneRule`][lightning_decentral.driver.OneRule]), or the simulation's
    [`WorkerGroup`][lightning_decentral.simulation.WorkerGroup]."""

    def rule_state_of(self, rank: int) -> dict[str, Any]: ...

    def load_rule_states(self, states: list[dict[str, Any]]) -> None: ...


RECORDED_OPTIONS = ("shard_size",)
"""The options a shard records beside the rule and the topology (in its `"strategy"` entry,
[`StepDriver.rule_record`][lightning_decentral.driver.StepDriver.rule_record]), each only where the run does not leave
it at its default: a run that leaves them all writes the shards it wrote before they were recorded, and a shard without
one was saved under its default. `shard_size`: sharded replicas resume only under the one they were saved with
([`check_same_sharding`][lightning_decentral.sharding.check_same_sharding]). An option a resume must match is recorded
by adding its name here."""

RANDOM_STATE = "rng"
"""The key of the workers' random state in the driver's [`StateRegistry`][lightning_decentral.checkpoint.StateRegistry]
(and so in every shard, as before the registry)."""


class RandomStates(Protocol):
    """Where the driver reads and restores its workers' random states (the `"rng"` part of the
    [`StateRegistry`][lightning_decentral.checkpoint.StateRegistry]: what dropout and a shuffling sampler draw from, so
    the data order): a process's ([`ProcessRandomState`][lightning_decentral.driver.ProcessRandomState]), or the
    simulation's [`WorkerGroup`][lightning_decentral.simulation.WorkerGroup]. `load_random_states` gets `None` for a
    worker whose shard holds none (it keeps its own)."""

    def random_state_of(self, worker: int) -> dict[str, Any]: ...

    def load_random_states(self, states: list[dict[str, Any] | None]) -> None: ...


class ProcessRandomState:
    """A process's random state as [`RandomStates`][lightning_decentral.driver.RandomStates]: its global generators
    (torch, CUDA, numpy, Python: [`rng_state`][lightning_decentral.checkpoint.rng_state]) are worker 0's.

    Examples:
        >>> process = ProcessRandomState()
        >>> saved = process.random_state_of(0)
        >>> drawn = torch.rand(2)
        >>> process.load_random_states([saved])
        >>> torch.equal(torch.rand(2), drawn)
        True
    """

    def random_state_of(self, worker: int) -> dict[str, Any]:
        """The process's random state (a process has one worker)."""
        return shards.rng_state()

    def load_random_states(self, states: list[dict[str, Any] | None]) -> None:
        """The process continues from `states[0]`; `None`: it keeps its own."""
        if states[0] is not None:
            shards.set_rng_state(states[0])


class OneRule:
    """A process's rule as [`RuleStates`][lightning_decentral.driver.RuleStates]: worker 0's."""

    def __init__(self, rule: UpdateRule) -> None:
        self.rule = rule

    def rule_state_of(self, rank: int) -> dict[str, Any]:
        """The rule's `state_dict` (a process has one worker)."""
        return self.rule.state_dict()

    def load_rule_states(self, states: list[dict[str, Any]]) -> None:
        """The rule continues from `states[0]`."""
        self.rule.load_state_dict(states[0])


AnyMixer = TypeVar("AnyMixer", bound=Mixer)


class StepDriver:
    """One executor's update rule and everything around it (see the module docstring).

    Args:
        options: the checked update-rule arguments.
        epoch: the executor's current epoch (what a `gossip_steps` schedule by epoch reads).
        phrasing: how the mixers' errors speak of the executor (`TRAINER`, `FABRIC`, `SIMULATION`).

    Examples:
        Two workers in one process, each driven as a rank would be (the simulation runs them together):

        >>> import torch
        >>> from lightning_decentral.mixing import DenseMixer
        >>> driver = StepDriver(GossipOptions(topology="complete", combine="atc"))
        >>> driver.bind(world_size=2)
        >>> mixer = driver.dense_mixer()
        >>> models = [torch.nn.Linear(1, 1, bias=False) for _ in range(2)]
        >>> rules = [
        ...     driver.build_rule(Replica(m, False), mixer.worker(i), [torch.optim.SGD(m.parameters(), lr=0.5)])
        ...     for i, m in enumerate(models)
        ... ]
        >>> driver.plan(0), driver.rule_record()
        (StepPlan(step=0, rounds=1), {'rule': 'atc', 'topology': 'Complete(world_size=2)'})
    """

    def __init__(
        self, options: GossipOptions, epoch: Callable[[], int] | None = None, phrasing: Phrasing = TRAINER
    ) -> None:
        self.options = options
        self.schedule: GossipSchedule | None = None
        self.runner: StepRunner | None = None
        self.watch = Watch(phrasing=phrasing)  # shared with every mixer the driver builds
        self.sent = BytesSent()  # every exchange's bytes, told by the mixers
        self.watch.observers.append(self.sent)
        self.survival: Survival | None = None  # on_peer_failure="continue" on processes
        self.guard = (
            Guard()
        )  # every collective besides the exchange goes through it; its step: the step begun, or the next
        self.failed = False  # an error left a step: no collective when the run ends (the others may be gone)
        self._epoch = epoch
        self._mixers: list[Mixer] = []
        self.copies = ChocoStates()  # compressed gossip: the workers' public copies, their bytes, from run to run
        self._plan: StepPlan | None = None  # the step begun and not yet stepped
        self._rules: RuleStates | None = None  # the rules run() drives, whose state a save keeps (stays after teardown)
        self._random: RandomStates = ProcessRandomState()  # whose random states a save keeps: run() may change it
        self.state = StateRegistry()  # the per-rank state of every shard and handover besides replica and optimizer
        self.state.register("rule_state", self._rule_state_of, self._load_rule_states, full_only=True)
        self.state.register("gossip", self.copies.state, self._load_copies)
        self.state.register(RANDOM_STATE, self._random_state_of, self._load_random_states)

    # -- binding ------------------------------------------------------------------------------

    def bind(self, world_size: int, num_nodes: int = 1, warn: Callable[[str], None] = warnings.warn) -> None:
        """Bind the topology to `world_size` workers on `num_nodes` nodes and build the schedule (a topology that
        does not fit raises here, before any process starts; one that may not converge `warn`s)."""
        topology = resolve_topology(self.options.topology, world_size, num_nodes)
        check_stale_topology(topology, self.options.staleness)
        check_compressed_topology(topology, self.options.compression)
        check_compressed_symmetry(topology, self.options.compression, warn)
        self.schedule = GossipSchedule(topology, self.options.gossip_every, self.options.gossip_steps)
        self.options.min_workers_for(world_size)  # more than the world raises here

    def check_length(self, max_steps: int, warn: Callable[[str], None]) -> None:
        """Warn if a run of `max_steps` optimizer steps (`-1` or `None`: no limit) ends before its first gossip step,
        `gossip_every − 1`: the workers would only train alone (and an outer optimizer never step).

        Examples:
            >>> driver = StepDriver(GossipOptions(gossip_every=50))
            >>> driver.check_length(30, print)
            gossip_every=50 is more than the run's max_steps=30: no step gossips, ... Lower gossip_every to ...
        """
        every = self.options.gossip_every
        if max_steps is not None and 0 <= max_steps < every:
            after = "the outer optimizer never steps" if self.options.rule == "outer" else "the replicas never mix"
            warn(
                f"gossip_every={every} is more than the run's max_steps={max_steps}: no step gossips, every worker "
                f"trains alone and {after}. Lower gossip_every to at most {max(max_steps, 1)}, or raise max_steps."
            )

    def keep(self, members: Sequence[int], first_step: int, of: Topology | None = None) -> None:
        """Go on with the workers `members` of the topology `of` (default: the current one; a join's members are ranks
        of the one at the start) alone, in order, member `members[i]` becoming worker `i`: `W` for them
        ([`for_members`][lightning_decentral.topology.Topology.for_members]) and the steps before `first_step` local.
        The mixers follow with [`rebind_mixers`][lightning_decentral.driver.StepDriver.rebind_mixers] (processes: once
        the new group exists)."""
        schedule = self._schedule()
        topology = (of or schedule.topology).for_members(members)
        self.schedule = GossipSchedule(topology, schedule.gossip_every, schedule.rounds_per_gossip, first_step)

    def rebind_mixers(self, group: Any | None = None) -> None:
        """Every mixer the driver built mixes with the current topology from now on (on processes: on `group`, a
        sharded replica's column, else on the default group)."""
        for mixer in self._mixers:
            if group is None:
                mixer.rebind(self.topology)
            else:
                mixer.rebind(self.topology, group)

    @property
    def mixers(self) -> list[Mixer]:
        """The mixers the driver built for this run (what a failure rebinds)."""
        return list(self._mixers)

    @property
    def topology(self) -> Topology:
        """The topology, bound to the world size."""
        return self._schedule().topology

    @property
    def num_workers(self) -> int:
        """`n`, the workers the topology is bound to."""
        return self.topology.world_size

    def epoch(self) -> int:
        """The executor's current epoch (0 if it has none)."""
        return self._epoch() if self._epoch is not None else 0

    def rounds(self, step: int) -> int:
        """Rounds of `W(step)` at optimizer step `step` of the current epoch (0: a local step)."""
        return self._schedule().rounds(step, self.epoch())

    def plan(self, step: int) -> StepPlan:
        """The plan of optimizer step `step` in the current epoch."""
        return self._schedule().plan(step, self.epoch())

    # -- building: the one place that chooses the exchange --------------------------------------

    def process_mixer(
        self,
        device: torch.device,
        backend: str | None,
        timeout: timedelta,
        on_default_group: bool,
        survival: Survival | None = None,
        group: Any | None = None,
    ) -> Mixer:
        """This rank's mixer when every worker is a process (every rank calls it together): bounded staleness over
        [`StaleGossip`][lightning_decentral.gossip.StaleGossip] (its own gloo group), else
        [`Gossip`][lightning_decentral.gossip.Gossip] on the default group when this run made it with `timeout`
        (`on_default_group`: after a collective of Lightning's times out, the exchange on the same group fails at
        once instead of waiting a second timeout), or on a new group of every rank with `timeout`; with
        `compression`, CHOCO's over it ([`CompressedGossip`][lightning_decentral.gossip.CompressedGossip],
        `from_copy` with an outer step). With `survival`, a failed exchange or collective (`guard`) asks it, and each
        step begins with it. With `group` (sharded replicas: the ranks holding this rank's shard of every replica), on
        that group."""
        options = self.options
        topology = self.topology
        self.survival = self.watch.survival = self.guard.survival = survival
        if options.staleness:  # refused with compression
            return self._built(
                StaleGossip.on_new_group(topology, options.staleness, options.delays, timeout, self.watch)
            )
        if group is not None:  # staleness and survival are refused with sharded replicas (GossipOptions)
            engine = Gossip(topology, group=group, dtype=options.gossip_dtype, timeout=timeout, watch=self.watch)
        elif on_default_group:
            engine = Gossip(topology, dtype=options.gossip_dtype, timeout=timeout, watch=self.watch)
        else:
            engine = Gossip.on_new_group(topology, device, backend, timeout, options.gossip_dtype, self.watch)
        if options.compression is None:
            return self._built(engine)
        compressor = cast(Compressor, options.compression)  # GossipOptions keeps the object a name resolves to
        return self._built(
            CompressedGossip(
                engine, compressor, options.consensus_step, options.rule == "outer", options.compression_overlap
            )
        )

    def dense_mixer(self) -> DenseMixer:
        """The mixer of every worker in one process: a [`DenseMixer`][lightning_decentral.mixing.DenseMixer], with
        bounded staleness through [`DelayedMixing`][lightning_decentral.mixing.DelayedMixing]; `mixer.worker(i)` is
        worker `i`'s."""
        options = self.options
        topology = self.topology
        delayed = DelayedMixing(topology, options.staleness, options.delays) if options.staleness else None
        mixer = DenseMixer(
            topology,
            options.gossip_dtype,
            delayed,
            self.watch,
            options.compression,
            options.consensus_step,
            options.rule == "outer",
        )
        return self._built(mixer)

    def _built(self, mixer: AnyMixer) -> AnyMixer:
        self._mixers.append(mixer)
        self.copies.attach(mixer)  # compressed gossip: a later fit goes on from the public copies the last one left
        return mixer

    def build_rule(
        self,
        replica: Replica,
        mixer: Mixer,
        optimizers: list[Any],
        context: RuleContext | None = None,
        source: str = "`configure_optimizers` returned",
    ) -> UpdateRule:
        """The rule the options select, over `replica`, `mixer` and the one optimizer; from now on the runner."""
        check_one_optimizer(optimizers, source)
        rule = self.make_rule(replica, mixer, optimizers[0], context)
        self.run(rule, OneRule(rule))
        return rule

    def make_rule(
        self, replica: Replica, mixer: Mixer, optimizer: Any, context: RuleContext | None = None
    ) -> UpdateRule:
        """One worker's rule (a [`RuleFactory`][lightning_decentral.rules.RuleFactory], for the simulation's workers):
        [`OuterStep`][lightning_decentral.outer.OuterStep] with an `outer_optimizer`, else `RULES[options.rule]`."""
        if self.options.compression is not None:
            check_compressible(self.options.compression, replica.mixed)  # what will be sent, before training
        outer = self.options.outer_optimizer
        every = self.options.gossip_every
        overlap = self.options.outer_overlap
        if outer is not None:
            return OuterStep(replica, mixer, optimizer, context, outer_optimizer=outer, every=every, overlap=overlap)
        return RULES[self.options.rule](replica, mixer, optimizer, context)

    def run(self, runner: StepRunner, rules: RuleStates, random_states: RandomStates | None = None) -> None:
        """Drive `runner` from now on, whose rules' state is `rules` and whose workers draw from `random_states`
        (default: this process's generators; the simulation's worker group is all three; `build_rule` calls it for a
        rule)."""
        self.runner = runner
        self._plan = None
        self._rules = rules
        self._random = random_states if random_states is not None else ProcessRandomState()

    # -- per-rank state: what every shard and handover holds besides the replica and the optimizer --------------

    def shard_contents(
        self,
        worker: int,
        state_dict: dict[str, Any],
        step: int,
        optimizer_states: list[dict[str, Any]] | None = None,
        precision: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Worker `worker`'s shard but its save id: the arguments of
        [`make_shard`][lightning_decentral.checkpoint.make_shard], with the rule the shard records and every registered
        part (`state.save`: the rule's state, CHOCO's public copies, the random state; live, not copied). A save
        without `optimizer_states` is weights-only."""
        return dict(
            state_dict=state_dict,
            step=step,
            optimizer_states=optimizer_states,
            precision=precision,
            rule=self.rule_record(),
            parts=self.state.save(worker, full=optimizer_states is not None),
        )

    def rule_state(self) -> dict[str, Any]:
        """For this rank's shard: what the rule `build_rule` built carries across steps (`{}` before)."""
        return self._rule_state_of(0)

    def load_rule_state(self, state: dict[str, Any]) -> None:
        """An exact resume: the rule `build_rule` built continues from its shard's `state`."""
        self._load_rule_states([state])

    def _rule_state_of(self, worker: int) -> dict[str, Any]:
        return self._rules.rule_state_of(worker) if self._rules is not None else {}

    def _load_rule_states(self, states: list[dict[str, Any] | None]) -> None:
        if self._rules is not None:
            self._rules.load_rule_states([state or {} for state in states])

    def _load_copies(self, states: list[dict[str, Any] | None]) -> None:
        for worker, state in enumerate(states):
            self.copies.load(state, worker)

    def _random_state_of(self, worker: int) -> dict[str, Any]:
        return self._random.random_state_of(worker)

    def _load_random_states(self, states: list[dict[str, Any] | None]) -> None:
        self._random.load_random_states(states)

    # -- one step -----------------------------------------------------------------------------

    @property
    def alone(self) -> bool:
        """Between the survivors' agreement after a failure and their process group: this rank runs alone."""
        return self.survival is not None and self.survival.alone

    @property
    def begun(self) -> bool:
        """Whether a step is begun and not yet stepped."""
        return self._plan is not None

    def begin(self, step: int) -> StepRunner:
        """The runner, with optimizer step `step` begun: planned once, whoever calls first (AWC posts `x(k)` here)."""
        runner = self._live()
        self.guard.step = step
        with self._failing():
            if self.survival is not None:
                self.survival.begin(step)  # the survivors of a failure mix again from here: their group first
            if self._plan is None or self._plan.step != step:
                self._plan = self.plan(step)
                runner.begin_step(self._plan)
        return runner

    def optimizer_step(self, step: int, run: Callable[[Closure], Any], closure: Closure) -> Any:
        """Step `step`: `run(wrapped)` with the closure the rule wraps (the executor's `optimizer.step(...)`,
        which runs it: forward and backward), then the rule's `end_step` and `finish_step`. Returns `run`'s output."""
        runner = self.begin(step)
        with self._failing():
            try:
                output = run(runner.wrap_closure(closure))
            finally:
                self._plan = None
            runner.end_step()
            runner.finish_step()
        self.guard.step = step + 1
        return output

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Remember an error leaving the block (`failed`)."""
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def drain(self) -> None:
        """Finish anything in flight (the end of training, or a step that never reached the optimizer)."""
        if self.runner is not None:
            self.runner.drain()
        self._plan = None

    def teardown(self) -> None:
        """The run is over: release the rule's hooks, forget its mixers and survival (`rule_state` stays for a save)."""
        if self.runner is not None:
            self.runner.teardown()
        self.runner = None
        self._plan = None
        self._mixers = []
        self.survival = self.watch.survival = self.guard.survival = None
        self.failed = False

    # -- the monitoring surface ---------------------------------------------------------------

    def observe(self, observer: ExchangeObserver) -> None:
        """Tell `observer` of every exchange from now on."""
        self.watch.observers.append(observer)

    def measure_residuals(self) -> None:
        """From now on every exchange of the parameters also measures its gossip residual."""
        self.watch.measure_residuals = True

    @property
    def residuals_measured(self) -> bool:
        """Whether [`measure_residuals`][lightning_decentral.driver.StepDriver.measure_residuals] was called."""
        return self.watch.measure_residuals

    def residual(self, step: int) -> Tensor | None:
        """The runner's gossip residual of step `step`, if measured."""
        return self.runner.residual(step) if self.runner is not None else None

    def extra_gossip(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` now, between steps (nothing when `rounds == 0` or before fit); synchronous only."""
        if rounds > 0 and self.options.staleness:
            raise ValueError(
                f"Extra gossip between steps (ConsensusControl) waits for every neighbour, which staleness="
                f"{self.options.staleness} does not: use staleness=0 with it."
            )
        if rounds > 0 and self.runner is not None:
            self.runner.mix(step, rounds)

    @property
    def bytes_sent(self) -> int:
        """Bytes this process's workers have sent: with compression, the payloads of every message (the count
        continues across a resume: the shards keep it); else every exchange's, since this process started."""
        return self.copies.bytes_sent if self.options.compression is not None else self.sent.total

    def bytes_metrics(self, workers: int = 1) -> dict[str, Tensor]:
        """`{"gossip/bytes_sent": bytes_sent / workers}` (the mean over this process's `workers`), in float64: a
        byte count stays exact up to 2⁵³ (float32 rounds 37,947,735 to 37,947,736). What the executors log."""
        return {"gossip/bytes_sent": torch.tensor(self.bytes_sent / workers, dtype=torch.float64)}

    def rule_record(self) -> dict[str, str]:
        """What a shard records of the rule ([`rule_record`][lightning_decentral.checkpoint.rule_record]), and each
        option of [`RECORDED_OPTIONS`][lightning_decentral.driver.RECORDED_OPTIONS] this run does not leave at its
        default, as a string."""
        record = shards.rule_record(self.options.rule, self.topology)
        defaults = {field.name: field.default for field in dataclasses.fields(GossipOptions)}
        for name in RECORDED_OPTIONS:
            value = getattr(self.options, name)
            if value != defaults[name]:
                record[name] = str(value)
        return record

    def _schedule(self) -> GossipSchedule:
        if self.schedule is None:  # an AttributeError: there is no topology yet (so hasattr and Protocol checks say no)
            raise AttributeError("The topology is bound to the world size when the Trainer (or Fabric) is created.")
        return self.schedule

    def _live(self) -> StepRunner:
        if self.runner is None:
            raise RuntimeError("The update rule is built when training starts (fit, or fabric.setup).")
        return self.runner


class Driven:
    """The monitoring surface and the update-rule arguments every executor shares, read from its `driver`
    ([`Monitored`][lightning_decentral.measures.Monitored] is what the monitors read)."""

    driver: StepDriver
    root_device: Any

    @property
    def options(self) -> GossipOptions:
        """The checked update-rule arguments; each is also an attribute of its own (`combine`, `momentum`,
        `gossip_every`, `gossip_steps`, ...: every field of `GossipOptions` but `topology`, which is bound here)."""
        return self.driver.options

    @property
    def rule(self) -> str:
        """The update rule: `"awc"`, `"atc"`, `"decentlam"` or `"outer"` (with an `outer_optimizer`)."""
        return self.driver.options.rule

    @property
    def topology(self) -> Topology:
        """The topology, bound to the world size (available once the Trainer or Fabric is built)."""
        return self.driver.topology

    @property
    def num_workers(self) -> int:
        """`n`, the workers (ranks, or simulated workers)."""
        return self.driver.num_workers

    def gossip_rounds(self, step: int) -> int:
        """Rounds of exchange at optimizer step `step` of the current epoch (0: a local step, `W = I`)."""
        return self.driver.rounds(step)

    def observe(self, observer: ExchangeObserver) -> None:
        """Tell `observer` of every exchange of this process from now on (bytes, post and wait times)."""
        self.driver.observe(observer)

    def measure_residuals(self) -> None:
        """From now on, every exchange of the parameters also measures its gossip residual
        ([`gossip_residual`][lightning_decentral.driver.Driven.gossip_residual])."""
        self.driver.measure_residuals()

    def gossip_residual(self, step: int) -> Tensor | None:
        """`Σ_i ‖y_i − Σ_j w_ij(k) y_j‖²` over this process's workers (a rank: its own term) and trainable
        parameters, for the first round of the exchange of step `k = step`: `y = x(k)` (AWC), `U(x(k), g)` (ATC),
        `z = x(k) − γ g` (DecentLaM). A 0-dim float64 tensor, not synchronized; `None` if step `step` exchanged
        nothing or [`measure_residuals`][lightning_decentral.driver.Driven.measure_residuals] was not called."""
        return self.driver.residual(step)

    def extra_gossip(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` for the parameters and the mixed buffers, now, on top of the step's own gossip.
        Call it between optimizer steps (no exchange in flight), on every rank with the same arguments."""
        self.driver.extra_gossip(step, rounds)

    def rule_record(self) -> dict[str, str]:
        """The update rule and topology the shards record; a resume under another one warns."""
        return self.driver.rule_record()

    def rule_state(self) -> dict[str, Any]:
        """What this rank's update rule carries across steps, which its shard keeps (an outer step's anchor)."""
        return self.driver.rule_state()

    def load_rule_state(self, state: dict[str, Any]) -> None:
        """This rank's update rule continues from `state` (its shard's `rule_state`)."""
        self.driver.load_rule_state(state)

    def worker_batches(self, batch: Any) -> list[Any]:
        """The batch of each of this process's workers: a rank's own."""
        return [batch]

    def worker_random_states(self) -> list[dict[str, Any]]:
        """The random state this rank's training forward draws from."""
        return [random_state(self.root_device)]

    # -- the update-rule arguments, one attribute each (GossipOptions describes each) ---------------------------

    @property
    def combine(self) -> str:
        """`"awc"` or `"atc"`: whether the exchange of `x(k)` overlaps the step (AWC) or mixes `U(x)` (ATC)."""
        return self.driver.options.combine

    @property
    def momentum(self) -> str:
        """`"local"` (the optimizer's own momentum) or `"decentlam"`."""
        return self.driver.options.momentum

    @property
    def gossip_every(self) -> int:
        """Gossip on the steps with `(k + 1) % gossip_every == 0`; local steps otherwise."""
        return self.driver.options.gossip_every

    @property
    def gossip_steps(self) -> RoundsSchedule:
        """The rounds of `W(k)` per gossip step (a fixed number or a schedule over training)."""
        return self.driver.options.gossip_steps

    @property
    def gossip_buffers(self) -> bool:
        """Whether floating-point buffers (BatchNorm statistics) are mixed too."""
        return self.driver.options.gossip_buffers

    @property
    def eval_on(self) -> str:
        """`"average"`: validate, test and predict on `x̄`; `"local"`: on each worker's own replica."""
        return self.driver.options.eval_on

    @property
    def bucket_cap_mb(self) -> float:
        """DecentLaM's bucket size in MB."""
        return self.driver.options.bucket_cap_mb

    @property
    def gossip_dtype(self) -> torch.dtype | None:
        """The precision point-to-point messages travel in (`None`: the parameters' own)."""
        return self.driver.options.gossip_dtype

    @property
    def staleness(self) -> int:
        """Bounded staleness `s` (0: wait for every neighbour's step `k`)."""
        return self.driver.options.staleness

    @property
    def delays(self) -> DelaySchedule | None:
        """The imposed delays of bounded staleness (`None`: the newest received)."""
        return self.driver.options.delays

    @property
    def on_peer_failure(self) -> str:
        """`"stop"` or `"continue"` (the survivors go on) when a peer fails."""
        return self.driver.options.on_peer_failure

    @property
    def min_workers(self) -> int | None:
        """With `"continue"`, the fewest workers a run goes on with (`None`: half, rounded up)."""
        return self.driver.options.min_workers

    @property
    def outer_optimizer(self) -> OptimizerFactory | None:
        """The outer optimizer of local steps (DiLoCo on `complete`), or `None`."""
        return self.driver.options.outer_optimizer

    @property
    def outer_overlap(self) -> bool:
        """Whether the outer round's exchange travels during the next round's inner steps."""
        return self.driver.options.outer_overlap

    @property
    def compression(self) -> Compressor | None:
        """The compressor of compressed gossip (CHOCO), or `None`: plain gossip."""
        return self.driver.options.compression

    @property
    def consensus_step(self) -> float | None:
        """`γ` of compressed gossip (the value used), `None` without compression."""
        return self.driver.options.consensus_step

    @property
    def compression_overlap(self) -> bool:
        """Whether a compressed exchange runs on the mixer's helper thread between its start and its wait."""
        return self.driver.options.compression_overlap

    @property
    def shard_size(self) -> int:
        """`s`, the ranks of one replica (sharded replicas; 1: every rank is a replica)."""
        return self.driver.options.shard_size

    @property
    def bytes_sent(self) -> int:
        """Bytes this process's workers have sent
        ([`StepDriver.bytes_sent`][lightning_decentral.driver.StepDriver.bytes_sent])."""
        return self.driver.bytes_sent
