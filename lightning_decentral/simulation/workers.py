"""The `n` workers of a simulation: their modules, optimizers, replicas, update rules and random states, and
what the monitors and checkpoints need of them (their data: [`simulation.data`][lightning_decentral.simulation.data]).

[`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy] holds one
[`WorkerGroup`][lightning_decentral.simulation.workers.WorkerGroup] (these
[`SimulatedWorkers`][lightning_decentral.simulation.workers.SimulatedWorkers], or the vectorized
[`StackedWorkers`][lightning_decentral.simulation.vectorized.StackedWorkers]) and drives it from Lightning's hooks;
worker 0's module is the LightningModule itself.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import checkpoint as shards
from lightning_decentral.mixing import DenseMixer
from lightning_decentral.replicas import Replica, averaged_optimizer_state, state_tensors
from lightning_decentral.rules import RuleContext, RuleFactory, UpdateRule
from lightning_decentral.schedule import StepPlan
from lightning_decentral.simulation.data import PerWorker


class WorkerGroup:
    """What every simulation of `n` workers provides, however it stores them: the executor drives one step
    through the methods below, phase by phase; the monitors and the checkpoints read the workers' modules
    (worker `i`'s module holds its replica) and optimizer states.

    [`SimulatedWorkers`][lightning_decentral.simulation.workers.SimulatedWorkers] keeps every worker apart;
    [`StackedWorkers`][lightning_decentral.simulation.vectorized.StackedWorkers] keeps worker `i`'s tensors as row `i`
    of stacked ones and runs them together.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.modules: list[Module] = []  # worker 0's first: the LightningModule
        self.rules: list[UpdateRule] = []

    @property
    def origins(self) -> list[int]:
        """Each worker's rank in the first numbering (they differ from the positions once workers are lost)."""
        return list(range(len(self.modules)))

    def remove(self, lost: Sequence[int]) -> None:
        """Drop the workers at positions `lost`; the others keep their order (the survivors of a failure)."""
        raise NotImplementedError

    # -- one step ----------------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        """Every worker begins step `plan.step`, with worker 0's optimizer hyperparameters (its scheduler's)."""
        raise NotImplementedError

    def zero_grad_others(self) -> None:
        """Zero workers `1..n-1`'s gradients (Lightning zeroes worker 0's)."""
        raise NotImplementedError

    def training_steps(self, batch: PerWorker, step: Callable[[Module, Any], Any]) -> tuple[list[Any], Logged]:
        """`step(module_i, batch_i)` for every worker (the module's `training_step`): the outputs, and what each
        logged (`name -> [(value, log kwargs)]`, one entry per worker that logged it)."""
        raise NotImplementedError

    def before_backward(self) -> None:
        """Every rule prepares its worker's backward (DecentLaM: gradients into flat buffers)."""
        for rule in self.rules:
            rule.before_backward()

    def backward(self, losses: list[Tensor], backward: Callable[[Tensor, Module, Optimizer | None], Any]) -> None:
        """`backward(loss, module, optimizer)` of every worker's loss (already divided for accumulation)."""
        raise NotImplementedError

    def ready_others(self, clip_val: float | None, clip_algorithm: str | None) -> None:
        """After worker 0's clipping: clip workers `1..n-1` and tell the rules their gradients are final."""
        raise NotImplementedError

    def step_others(self, result: Any) -> None:
        """Workers `1..n-1`'s optimizer steps (their closure returns `result`)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        """Around the backward of accumulated micro-batches, for every rule."""
        with contextlib.ExitStack() as stack:
            for rule in self.rules:
                stack.enter_context(rule.no_backward_sync())
            yield

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure with every rule's work around it."""
        for rule in self.rules:
            closure = rule.wrap_closure(closure)
        return closure

    def end_step(self) -> None:
        """Every rule ends the step (ATC posts `U(x)`)."""
        for rule in self.rules:
            rule.end_step()

    def finish_step(self) -> None:
        """Every rule finishes the step (waits and combines)."""
        for rule in self.rules:
            rule.finish_step()

    def drain(self) -> None:
        """Finish anything in flight."""
        for rule in self.rules:
            rule.drain()

    def teardown(self) -> None:
        """Release the rules' hooks."""
        for rule in self.rules:
            rule.teardown()

    # -- random states -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def as_worker(self, rank: int) -> Iterator[None]:
        """Worker `rank`'s torch random state inside the block (here: the process's, shared)."""
        yield

    def start_random_states(self) -> None:
        """Every worker continues from the process's random state now (as ranks seeded alike do)."""

    def random_states(self) -> list[tuple[Tensor, Tensor | None]]:
        """Each worker's torch random state `(cpu, cuda or None)` now (here: the process's, for every worker)."""
        own = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return [own] * len(self.modules)

    def random_state_of(self, rank: int) -> dict[str, Any]:
        """Worker `rank`'s random state as rank `rank` of `n` would save it
        ([`rng_state`][lightning_decentral.checkpoint.rng_state]'s entries): its torch generators, and the process's
        numpy and Python generators, which the workers share."""
        cpu, cuda = self.random_states()[rank]
        return {**shards.rng_state(), "torch": cpu, **({"cuda": [cuda]} if cuda is not None else {})}

    def load_random_states(self, states: list[dict[str, Any] | None]) -> None:
        """The process's generators from worker 0's state (here every worker draws from them); `None`: kept."""
        if states[0] is not None:
            shards.set_rng_state(states[0])

    # -- what the monitors read ------------------------------------------------------------------

    def residual(self, step: int) -> Tensor | None:
        """`Σ_i ‖y_i − Σ_j w_ij(k) y_j‖²` of step `step`'s first round; `None` if a worker has none."""
        residuals = [rule.residual(step) for rule in self.rules]
        if not residuals or any(r is None for r in residuals):
            return None
        return torch.stack(residuals).sum()

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `Σ_i ‖p_i − p̄‖²` and `‖p̄‖²` (float64)."""
        named = [[(n, p) for n, p in module.named_parameters() if p.requires_grad] for module in self.modules]
        out = []
        for column in zip(*named):
            stacked = torch.stack([p.detach().to(torch.promote_types(p.dtype, torch.float32)) for _, p in column])
            mean = stacked.mean(0)
            deviation = torch.linalg.vector_norm(stacked - mean, dtype=torch.float64).square()
            out.append((column[0][0], deviation, torch.linalg.vector_norm(mean, dtype=torch.float64).square()))
        return out

    def mix(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` for every worker's parameters and mixed buffers, now (every worker posts, then
        waits)."""
        pending = [rule.mixer.start(rule.replica.mixed, step, rounds) for rule in self.rules]
        for exchange in pending:
            exchange.wait()

    def gradient_sum(self) -> list[Tensor]:
        """`Σ_i g_i` for each trainable parameter: the workers' current gradients."""
        raise NotImplementedError

    def mean(self, tensors: list[Tensor]) -> list[Tensor]:
        """For floating tensors of worker 0's module, their means over the workers' matching tensors."""
        index = {id(t): j for j, t in enumerate(_floating_state(self.modules[0]))}
        columns = [_floating_state(module) for module in self.modules]
        return [torch.stack([column[index[id(t)]].detach() for column in columns]).mean(0) for t in tensors]

    # -- checkpoints -----------------------------------------------------------------------------

    def optimizer_state_of(self, rank: int) -> dict[str, Any]:
        """Worker `rank`'s optimizer `state_dict`, as rank `rank` of `n` would hold it."""
        raise NotImplementedError

    def rule_state_of(self, rank: int) -> dict[str, Any]:
        """What worker `rank`'s update rule carries across steps, as rank `rank` of `n` would save it."""
        return self.rules[rank].state_dict()

    def load_rule_states(self, states: list[dict[str, Any]]) -> None:
        """Every worker's update rule continues from its state (`rule_state_of`'s)."""
        for rule, state in zip(self.rules, states):
            rule.load_state_dict(state)

    def optimizer_state(self) -> dict[str, Any]:
        """Worker 0's optimizer `state_dict` with every floating state tensor averaged over the workers."""
        states = [self.optimizer_state_of(rank) for rank in range(len(self.modules))]
        return averaged_optimizer_state(states, lambda tensors: _means_across(states, tensors))

    def own_state(self, rank: int, state_dict: dict[str, Tensor], full: bool) -> dict[str, Any]:
        """Worker `rank`'s part of its shard as rank `rank` of `n` holds it: `state_dict` and its optimizer's state
        (`full=False`: a weights-only save, none): arguments of
        [`shard_contents`][lightning_decentral.driver.StepDriver.shard_contents]."""
        return dict(state_dict=state_dict, optimizer_states=[self.optimizer_state_of(rank)] if full else None)

    def restore(self, resumed: list[dict[str, Any]], averaged_optimizer: dict[str, Any]) -> None:
        """Workers 1..n-1 from their shards (replica, optimizer) if `resumed`, else from the averaged optimizer state
        (worker 0 is restored by Lightning); the rules' and the random states are the driver's registry's."""
        raise NotImplementedError


Logged = dict[str, list[tuple[Any, dict[str, Any]]]]


class SimulatedWorker:
    """One simulated worker: its module, optimizer, flat replica, update rule and torch random state."""

    def __init__(self, module: Module, optimizer: Optimizer, replica: Replica, rule: UpdateRule, origin: int) -> None:
        self.module = module
        self.optimizer = optimizer
        self.replica = replica
        self.rule = rule
        self.origin = origin  # its rank in the first numbering
        self.rng = torch.get_rng_state()  # the generator states it continues from when it runs next
        self.cuda_rng: Tensor | None = None


class SimulatedWorkers(WorkerGroup):
    """`n` workers kept apart, each with its own module, optimizer, replica, rule and torch random state,
    exchanging through one [`DenseMixer`][lightning_decentral.mixing.DenseMixer]: any module and
    optimizer, one worker at a time.

    Args:
        mixer: the mixer of all workers (bound to `n`).
        device: the device the workers' tensors live on (its generator is simulated per worker too).
    """

    def __init__(self, mixer: DenseMixer, device: torch.device) -> None:
        super().__init__(device)
        self.mixer = mixer
        self.workers: list[SimulatedWorker] = []

    def add(
        self, module: Module, optimizer: Optimizer, make_rule: RuleFactory, mix_buffers: bool, context: RuleContext
    ) -> None:
        """Worker `len(self.workers)`: `module` packed into a replica, and its update rule `make_rule(...)`."""
        replica = Replica(module, mix_buffers)
        rank = len(self.workers)
        rule_of_worker = make_rule(replica, self.mixer.worker(rank), optimizer, context)
        self.workers.append(SimulatedWorker(module, optimizer, replica, rule_of_worker, origin=rank))
        self.modules.append(module)
        self.rules.append(rule_of_worker)

    @property
    def origins(self) -> list[int]:
        return [worker.origin for worker in self.workers]

    def remove(self, lost: Sequence[int]) -> None:
        """Drop the workers at positions `lost`. Worker 0 is the LightningModule: if it is lost, the first survivor's
        replica, optimizer state and random state move into it, and it takes that worker's place."""
        keep = [i for i in range(len(self.workers)) if i not in set(lost)]
        dropped = [self.workers[i] for i in range(len(self.workers)) if i not in keep]
        if 0 in lost:
            head = self.workers[0]
            first = self.workers[keep[0]]
            head.module.load_state_dict(first.module.state_dict())
            head.optimizer.load_state_dict(first.optimizer.state_dict())
            head.rule.load_state_dict(first.rule.state_dict())
            torch.set_rng_state(first.rng)  # worker 0 draws from the process's own generators
            if first.cuda_rng is not None:
                torch.cuda.set_rng_state(first.cuda_rng, self.device)
            head.origin = first.origin
            dropped[0] = first
            keep[0] = 0
        for worker in dropped:
            worker.rule.teardown()
        self.workers = [self.workers[i] for i in keep]
        self.modules = [worker.module for worker in self.workers]
        self.rules = [worker.rule for worker in self.workers]
        for position, worker in enumerate(self.workers):
            worker.rule.mixer.rank = position  # its view of the dense mixer: the survivors' numbering

    def begin_step(self, plan: StepPlan) -> None:
        self._follow_worker_zero()
        for worker in self.workers:
            worker.rule.begin_step(plan)

    def _follow_worker_zero(self) -> None:
        """Every worker's optimizer takes worker 0's hyperparameters (its scheduler's, its `optimizer_step` hook's)."""
        leader = self.workers[0].optimizer.param_groups
        for worker in self.workers[1:]:
            for group, lead in zip(worker.optimizer.param_groups, leader):
                group.update({k: v for k, v in lead.items() if k != "params"})

    def zero_grad_others(self) -> None:
        for worker in self.workers[1:]:
            worker.optimizer.zero_grad()

    def training_steps(self, batch: PerWorker, step: Callable[[Module, Any], Any]) -> tuple[list[Any], Logged]:
        logged: Logged = {}
        outputs = []
        for i, (worker, part) in enumerate(zip(self.workers, batch.of(self.origins))):
            with self.as_worker(i), collect_logs(worker.module, logged):
                outputs.append(step(worker.module, part))
        return outputs, logged

    def backward(self, losses: list[Tensor], backward: Callable[[Tensor, Module, Optimizer | None], Any]) -> None:
        for i, (worker, loss) in enumerate(zip(self.workers, losses)):
            with self.as_worker(i):
                backward(loss, worker.module, worker.optimizer)

    def ready_others(self, clip_val: float | None, clip_algorithm: str | None) -> None:
        for worker in self.workers[1:]:
            worker.module.configure_gradient_clipping(worker.optimizer, clip_val, clip_algorithm)
            worker.rule.gradients_ready()

    def step_others(self, result: Any) -> None:
        self._follow_worker_zero()  # as worker 0 steps: a LightningModule's optimizer_step may have changed them
        for i, worker in enumerate(self.workers[1:], start=1):
            with self.as_worker(i):
                worker.optimizer.step(closure=lambda: result)

    @contextlib.contextmanager
    def as_worker(self, rank: int) -> Iterator[None]:
        """Worker `rank`'s torch random state inside the block (worker 0's is the process's own)."""
        if rank == 0 or rank >= len(self.workers):  # past the members: a worker away (rejoins=), its data only
            yield
            return
        worker = self.workers[rank]
        cuda = self.device.type == "cuda"
        own = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None
        torch.set_rng_state(worker.rng)
        if cuda:
            torch.cuda.set_rng_state(worker.cuda_rng, self.device)
        try:
            yield
        finally:
            worker.rng = torch.get_rng_state()
            torch.set_rng_state(own[0])
            if cuda:
                worker.cuda_rng = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(own[1], self.device)

    def start_random_states(self) -> None:
        cuda = self.device.type == "cuda"
        for worker in self.workers[1:]:
            worker.rng = torch.get_rng_state()
            worker.cuda_rng = torch.cuda.get_rng_state(self.device) if cuda else None

    def random_states(self) -> list[tuple[Tensor, Tensor | None]]:
        own = super().random_states()[0]
        return [own] + [(w.rng, w.cuda_rng) for w in self.workers[1:]]

    def load_random_states(self, states: list[dict[str, Any] | None]) -> None:
        """Worker 0's into the process's generators, every other worker's torch generators into the worker."""
        super().load_random_states(states)
        for worker, state in zip(self.workers[1:], states[1:]):
            if state is not None:
                worker.rng = state["torch"]
                worker.cuda_rng = state["cuda"][0] if "cuda" in state else None

    def gradient_sum(self) -> list[Tensor]:
        columns = zip(*[[p for p in module.parameters() if p.requires_grad] for module in self.modules])
        return [torch.stack([_grad(p) for p in column]).sum(0) for column in columns]

    def optimizer_state_of(self, rank: int) -> dict[str, Any]:
        return self.workers[rank].optimizer.state_dict()

    def restore(self, resumed: list[dict[str, Any]], averaged_optimizer: dict[str, Any]) -> None:
        for i, worker in enumerate(self.workers[1:], start=1):
            if resumed:
                worker.module.load_state_dict(resumed[i]["state_dict"])
                worker.optimizer.load_state_dict(resumed[i]["optimizer_states"][0])
            else:
                worker.optimizer.load_state_dict(averaged_optimizer)


@contextlib.contextmanager
def collect_logs(module: Module, logged: Logged) -> Iterator[None]:
    """Inside: `module.log(name, value, **kwargs)` appends `(value, kwargs)` to `logged[name]` instead of logging."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logged.setdefault(name, []).append((value, kwargs))

    module.log = record  # type: ignore[method-assign]  # an instance attribute shadows the method
    try:
        yield
    finally:
        del module.log


def optimizer_like(optimizer: Optimizer, parameter: Callable[[Tensor], Tensor]) -> Optimizer:
    """An optimizer of `optimizer`'s class and param groups over `parameter(p)` for each of its parameters `p`
    (a fresh state), built with the defaults its constructor takes (AdamW keeps `decoupled_weight_decay` in its
    defaults but does not take it)."""
    groups = [{**group, "params": [parameter(p) for p in group["params"]]} for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if any_keyword or k in accepted}
    try:
        return type(optimizer)(groups, **defaults)
    except Exception as error:
        raise ValueError(
            f"The simulation gives every worker its own {type(optimizer).__name__}, built as "
            f"{type(optimizer).__name__}(param_groups, **defaults), which failed: {error}. Use an optimizer that "
            "can be built that way (every torch.optim optimizer can), or DecentralizedStrategy on processes."
        ) from error


def _means_across(states: list[dict[str, Any]], tensors: list[Tensor]) -> list[Tensor]:
    """For tensors of `states[0]["state"]`, their means over the same entries of every state."""
    where = {id(v): (key, name) for key, values in states[0]["state"].items() for name, v in values.items()}
    return [torch.stack([s["state"][where[id(t)][0]][where[id(t)][1]] for s in states]).mean(0) for t in tensors]


def copy_of(module: Module, copied: Module) -> Callable[[Tensor], Tensor]:
    """`p -> ` the parameter of `copied` (a copy of `module`) that corresponds to `module`'s parameter `p`."""
    mapping = {id(p): q for p, q in zip(module.parameters(), copied.parameters())}
    return lambda p: mapping[id(p)]


def _grad(param: Tensor) -> Tensor:
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


def _floating_state(module: Module) -> list[Tensor]:
    return [t for t in state_tensors(module) if t.is_floating_point()]


def checked_failures(
    failures: dict[int, list[int]] | None, workers: int, vectorize: bool | str, staleness: int
) -> dict[int, list[int]]:
    """`failures` checked: steps `>= 0`, each worker at most once and in `[0, workers)`, one worker left."""
    if not failures:
        return {}
    if vectorize is True:
        raise ValueError(
            "SimulatedDecentralizedStrategy(failures=...) drops workers one by one, which the stacked rows of "
            "vectorize=True do not support yet: use vectorize=False or 'auto'."
        )
    if staleness:
        raise ValueError(
            f"SimulatedDecentralizedStrategy(failures=...) rebuilds the graph at one step, which staleness={staleness} "
            "(neighbours' replicas of earlier steps) does not support: use staleness=0 with failures."
        )
    lost = [w for step, dead in failures.items() for w in (dead if isinstance(dead, (list, tuple)) else [dead])]
    steps_ok = all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in failures)
    if not steps_ok or not all(isinstance(w, int) and 0 <= w < workers for w in lost) or len(set(lost)) != len(lost):
        raise ValueError(
            "`failures` maps an optimizer step (an integer >= 0) to the workers that die there (ranks in [0, "
            f"{workers}), each at most once), e.g. {{20: [2]}}; got {failures!r}."
        )
    if len(lost) >= workers:
        raise ValueError(f"`failures` loses all {workers} workers; at least one must survive.")
    return {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in failures.items()}
