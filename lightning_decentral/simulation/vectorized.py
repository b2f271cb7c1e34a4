"""The vectorized simulation: `n` workers' tensors stacked, every worker's step in a few batched calls.

Worker `i`'s parameter `p` is row `i` of a stacked parameter `P` of shape `[n, *p.shape]` (each worker's
module holds views of its rows, so evaluation, the monitors and the checkpoints read it as usual). One
`torch.vmap` of the LightningModule's `training_step` over `P` (`torch.func.functional_call`) runs every
worker's forward pass; one backward gives every worker's gradient; the LightningModule's own optimizer,
whose parameters become the stacked `P`, steps every worker at once; and one update rule runs over the
stacked flat buffers with a [`StackedMixer`][lightning_decentral.mixing.StackedMixer]. This equals `n`
separate workers when the optimizer is elementwise (each element's update reads only that element's
state: SGD, Adam, ...), the gradient is clipped per worker, and the step draws no random numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from lightning_decentral.mixing import DenseMixer, StackedMixer
from lightning_decentral.replicas import Replica
from lightning_decentral.rules import RuleContext, RuleFactory
from lightning_decentral.schedule import StepPlan
from lightning_decentral.simulation.data import StackedBatch
from lightning_decentral.simulation.isolation import loads_at_random, random_states_kept, scratch_copy
from lightning_decentral.simulation.workers import Logged, WorkerGroup, collect_logs

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)
"""The optimizers whose update of an element reads only that element's gradient and state: stepping them
over stacked parameters equals stepping one per worker."""


def vectorization_problem(module: Module, optimizer: Optimizer, outer: Optimizer | None = None) -> str | None:
    """Why `module` and `optimizer` (and the `outer` optimizer of an outer step) cannot run vectorized, or `None`.

    Examples:
        >>> vectorization_problem(torch.nn.Linear(2, 1), torch.optim.LBFGS(torch.nn.Linear(2, 1).parameters()))
        'LBFGS is not one of the elementwise optimizers (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad,
        Adadelta, Rprop)'
    """
    names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not one of the elementwise optimizers ({names})"
    if outer is not None and type(outer) not in ELEMENTWISE_OPTIMIZERS:
        return f"the outer optimizer {type(outer).__name__} is not one of the elementwise optimizers ({names})"
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if any(id(p) not in trainable for group in optimizer.param_groups for p in group["params"]):
        return "the optimizer holds tensors that are not trainable parameters of the LightningModule"
    return None


RANDOM_LAYERS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
"""Layers that draw random numbers in training (with `p > 0`); so do layers with a float `dropout` attribute above 0
(`nn.MultiheadAttention`)."""

HOOKS_OF_ONE_WORKER = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
)
"""LightningModule hooks that see one worker's batch, loss or gradients on processes (and on the per-worker path),
but every worker's at once when stacked."""


def stacking_problem(
    module: Module,
    optimizer: Optimizer,
    batch_size: int | None = 1,
    dataloader: DataLoader | None = None,
    outer: Optimizer | None = None,
) -> str | None:
    """Why `vectorize="auto"` keeps the workers apart, or `None` when stacking them gives the per-worker result:
    [`vectorization_problem`][lightning_decentral.simulation.vectorized.vectorization_problem], a layer that draws
    random numbers, a hook of `HOOKS_OF_ONE_WORKER`, a training DataLoader without a `batch_size`, or one whose samples
    load at random ([`loads_at_random`][lightning_decentral.simulation.isolation.loads_at_random]: stacked, the process
    would load every worker's samples from its own random state).

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        >>> stacking_problem(net, torch.optim.SGD(net.parameters(), lr=0.1))
        "its Dropout '1' draws random numbers (each worker needs its own random state)"
    """
    problem = vectorization_problem(module, optimizer, outer)
    if problem is not None:
        return problem
    for name, layer in module.named_modules():
        p = getattr(layer, "p", 0.0) if isinstance(layer, RANDOM_LAYERS) else getattr(layer, "dropout", 0.0)
        if isinstance(p, float) and p > 0:
            return f"its {type(layer).__name__} {name!r} draws random numbers (each worker needs its own random state)"
    hooks = [hook for hook in HOOKS_OF_ONE_WORKER if is_overridden(hook, module, parent=LightningModule)]
    if hooks:
        return f"it overrides {hooks[0]}, which sees one worker's batch, loss or gradients"
    if batch_size is None:
        return "the training DataLoader has no batch_size (a batch_sampler?)"
    if dataloader is not None and loads_at_random(dataloader):
        return "its training samples load at random (a random transform: each worker needs its own random state)"
    return None


def clip_rows_by_norm_(parameters: Sequence[Tensor], max_norm: float) -> None:
    """Clip each worker's gradient to norm `max_norm`: row `i` of every `p.grad` (`[n, ...]`) is scaled by
    `min(1, max_norm / (‖g_i‖ + 1e-6))`, `‖g_i‖` the norm of worker `i`'s whole gradient, as
    `torch.nn.utils.clip_grad_norm_` clips one worker's.

    Examples:
        >>> p = torch.zeros(2, 2, requires_grad=True)
        >>> p.grad = torch.tensor([[3.0, 4.0], [0.3, 0.4]])  # worker 0's norm is 5, worker 1's 0.5
        >>> clip_rows_by_norm_([p], max_norm=1.0)
        >>> p.grad
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    n = grads[0].shape[0]
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1) for g in grads])
    coefficient = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coefficient.view(n, *[1] * (g.dim() - 1)).to(g.dtype))


@contextlib.contextmanager
def rows_clipped_apart(precision: Any, stacked: StackedWorkers | None) -> Iterator[None]:
    """Inside, Lightning's clipping by norm (the precision plugin's `clip_grad_by_norm`) clips each worker's row of
    the stacked gradients by its own norm
    ([`clip_rows_by_norm_`][lightning_decentral.simulation.vectorized.clip_rows_by_norm_]); nothing changes when the
    workers are not `stacked`."""
    if stacked is None:
        yield
        return
    precision.clip_grad_by_norm = lambda optimizer, clip_val: clip_rows_by_norm_(
        precision.main_params(optimizer), clip_val
    )
    try:
        yield
    finally:
        del precision.clip_grad_by_norm


class NormsInStatisticsDtype(TorchFunctionMode):
    """Inside, `F.batch_norm` and `F.instance_norm` given running statistics of another dtype than their input
    normalize the input cast to the statistics' dtype and return the result cast back to the input's: the dtypes a
    call outside `torch.vmap` takes and gives (a bf16 input under `bf16-mixed`, float32 statistics, a bf16 output,
    computed in float32 either way), where a vmapped call fails (`expected scalar type BFloat16 but found Float` on the
    CPU, `Expected running_mean to have type BFloat16 but got Float` on CUDA). Other calls run as they are.

    Examples:
        >>> x, mean, var = torch.randn(2, 4, 3, dtype=torch.bfloat16), torch.zeros(2, 3), torch.ones(2, 3)
        >>> def normalize(x, mean, var):
        ...     with NormsInStatisticsDtype():
        ...         return torch.nn.functional.batch_norm(x, mean, var, training=True)
        >>> torch.vmap(normalize)(x, mean, var).dtype, mean.dtype
        (torch.bfloat16, torch.float32)
    """

    NORMS = (torch.nn.functional.batch_norm, torch.nn.functional.instance_norm)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in self.NORMS:
            x = args[0]
            statistics = args[1] if len(args) > 1 else kwargs.get("running_mean")
            if statistics is not None and statistics.dtype != x.dtype:
                return func(x.to(statistics.dtype), *args[1:], **kwargs).to(x.dtype)
        return func(*args, **kwargs)


def vmapped_steps(
    module: Module, step: Callable[[Module, Any], Any], tensors: dict[str, Tensor], batch: StackedBatch
) -> tuple[list[Any], Logged]:
    """`step(module, part)` under one `torch.vmap` over the stacked `tensors` (`[n, ...]`, by their names in `module`,
    in place of its own) and the workers' parts of `batch`: each worker's output, and what each logged. A module with
    running statistics normalizes under
    [`NormsInStatisticsDtype`][lightning_decentral.simulation.vectorized.NormsInStatisticsDtype]."""
    call = _Call(module, step)
    options: dict[str, dict[str, Any]] = {}
    normalizes = any(name.endswith("running_mean") for name in tensors)  # BatchNorm, InstanceNorm
    norms = NormsInStatisticsDtype if normalizes else contextlib.nullcontext

    def one_worker(tensors: dict[str, Tensor], part: Any) -> tuple[Any, dict[str, Tensor]]:
        logged: Logged = {}
        with collect_logs(module, logged), norms():
            output = torch.func.functional_call(call, tensors, (part,))
        values = {}
        for name, entries in logged.items():
            value, options[name] = entries[-1]
            if not isinstance(value, (Tensor, int, float)):
                raise ValueError(
                    f"training_step logs {name!r} as a {type(value).__name__}: the vectorized simulation logs "
                    "numbers and tensors only. Log a tensor, or use vectorize=False."
                )
            values[name] = torch.as_tensor(value)
        return output, values

    named = {f"module.{name}": t for name, t in tensors.items()}
    try:
        outputs, values = torch.vmap(one_worker, randomness="error")(named, batch.stacked())
    except RuntimeError as error:
        if "random" not in str(error):
            raise
        raise ValueError(
            "training_step draws random numbers (dropout, a random augmentation on the device, ...): the "
            "vectorized simulation cannot give each worker its own random state. Use vectorize=False."
        ) from error
    rows = [apply_to_collection(outputs, Tensor, lambda t, i=i: t[i]) for i in range(batch.workers)]
    return rows, {name: [(v, options[name]) for v in value.unbind(0)] for name, value in values.items()}


def stacking_trial(modules: Sequence[Module], batch: StackedBatch, step: Callable[[Module, Any], Any]) -> str | None:
    """Why `step` cannot run stacked, or `None`: one
    [`vmapped_steps`][lightning_decentral.simulation.vectorized.vmapped_steps] of `batch` without gradients, over
    stacked copies of the workers' trainable parameters and buffers, on a scratch copy of worker 0's module, every
    random generator put back after it: the workers' parameters, buffers (BatchNorm's `num_batches_tracked` too),
    attributes, metric objects, optimizer and random states stay as they were.

    Examples:
        >>> nets = [torch.nn.BatchNorm1d(2) for _ in range(2)]
        >>> batch = StackedBatch(torch.randn(4, 2), workers=2)
        >>> stacking_trial(nets, batch, lambda net, x: net(x).sum()) is None, int(nets[1].num_batches_tracked)
        (True, 0)
        >>> print(stacking_trial(nets, batch, lambda net, x: net(x).sum().item()))
        training_step cannot run under torch.vmap (RuntimeError: vmap: It looks like you're calling .item() ...)
    """
    names = [name for name, p in modules[0].named_parameters() if p.requires_grad] + [
        n for n, _ in modules[0].named_buffers()
    ]
    tensors = [{**dict(m.named_parameters()), **dict(m.named_buffers())} for m in modules]
    try:
        with torch.no_grad(), random_states_kept():
            stacked = {name: torch.stack([own[name].detach() for own in tensors]) for name in names}
            vmapped_steps(scratch_copy(modules[0]), step, stacked, batch)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"training_step cannot run under torch.vmap ({type(error).__name__}: {first[:60]} ...)"
    return None


class StackedWorkers(WorkerGroup):
    """`n` workers as rows of stacked tensors (see the module docstring).

    Args:
        modules: the workers' modules, worker 0's (the LightningModule) first; their trainable parameters
            and buffers become views of rows of stacked tensors.
        optimizer: worker 0's optimizer: from now on it steps the stacked parameters (its param groups,
            hyperparameters and scheduler are kept).
        make_rule: builds the update rule (a class of `RULES`, or the driver's `make_rule`).
        mix_buffers: also mix the floating-point module buffers.
        context: the rule's context.
        mixer: the dense mixer of the `n` workers.
        device: the workers' device.
    """

    def __init__(
        self,
        modules: list[Module],
        optimizer: Optimizer,
        make_rule: RuleFactory,
        mix_buffers: bool,
        context: RuleContext,
        mixer: DenseMixer,
        device: torch.device,
    ) -> None:
        super().__init__(device)
        self.modules = list(modules)
        self.optimizer = optimizer
        self.names = [name for name, p in modules[0].named_parameters() if p.requires_grad]
        self.buffer_names = [name for name, _ in modules[0].named_buffers()]
        self.parameters = [
            Parameter(self._stack([dict(m.named_parameters())[name] for m in modules])) for name in self.names
        ]
        self.buffers = [self._stack([dict(m.named_buffers())[name] for m in modules]) for name in self.buffer_names]
        stacked_of = {
            id(p): s for p, s in zip((dict(modules[0].named_parameters())[n] for n in self.names), self.parameters)
        }
        for group in optimizer.param_groups:
            group["params"] = [stacked_of[id(p)] for p in group["params"]]
        optimizer.state.clear()
        buffers = [b for b in self.buffers if b.is_floating_point()] if mix_buffers else []
        self.replica = Replica.of_buffers(
            self.parameters, [p.data.view(-1) for p in self.parameters], [b.view(-1) for b in buffers], buffers
        )
        self.rules = [make_rule(self.replica, StackedMixer(mixer), optimizer, context)]

    @classmethod
    def from_workers(
        cls,
        workers: WorkerGroup,
        optimizer: Optimizer,
        make_rule: RuleFactory,
        mix_buffers: bool,
        context: RuleContext,
        mixer: DenseMixer,
    ) -> StackedWorkers:
        """The workers of `workers` (kept apart, not stepped yet), stacked, with their optimizer and rule states (a
        resume restored them); `workers` is torn down. `optimizer` is worker 0's."""
        ranks = range(len(workers.modules))
        states = [workers.optimizer_state_of(r) for r in ranks]
        rule_states = [workers.rule_state_of(r) for r in ranks]
        workers.teardown()
        stacked = cls(workers.modules, optimizer, make_rule, mix_buffers, context, mixer, workers.device)
        stacked.load_optimizer_states(states)
        stacked.load_rule_states(rule_states)
        return stacked

    @staticmethod
    def _stack(rows: list[Tensor]) -> Tensor:
        """Stack `rows` and make each one a view of its row."""
        stacked = torch.stack([row.detach() for row in rows])
        for i, row in enumerate(rows):
            row.data = stacked[i]
        return stacked

    # -- one step ----------------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        self.rules[0].begin_step(plan)

    def zero_grad_others(self) -> None:
        """Nothing: Lightning zeroes the stacked gradients with worker 0's optimizer."""

    def training_steps(self, batch: StackedBatch, step: Callable[[Module, Any], Any]) -> tuple[list[Any], Logged]:
        """One `torch.vmap` of `step` over the stacked parameters, buffers and batches (`step` of worker 0's module:
        the LightningModule)."""
        names = self.names + self.buffer_names
        return vmapped_steps(self.modules[0], step, dict(zip(names, self.parameters + self.buffers)), batch)

    def backward(self, losses: list[Tensor], backward: Callable[[Tensor, Module, Optimizer | None], Any]) -> None:
        """One backward of the workers' summed losses: row `i` of every gradient is worker `i`'s."""
        backward(torch.stack(losses).sum(), self.modules[0], self.optimizer)

    def ready_others(self, clip_val: float | None, clip_algorithm: str | None) -> None:
        """Every row was clipped with worker 0's (per row): the gradients are final."""
        self.rules[0].gradients_ready()

    def step_others(self, result: Any) -> None:
        """Nothing: worker 0's optimizer stepped every row."""

    # -- monitors and checkpoints ------------------------------------------------------------------

    def gradient_sum(self) -> list[Tensor]:
        return [p.grad.sum(0) if p.grad is not None else torch.zeros_like(p[0]) for p in self.parameters]

    def own_state(self, rank: int, state_dict: dict[str, Tensor], full: bool) -> dict[str, Any]:
        """Worker `rank`'s part of its shard with copies of its rows: a row is a view of every worker's storage,
        which `torch.save` would write whole (a shard `n` times too large)."""
        own = {name: t.clone() for name, t in state_dict.items()}
        return super().own_state(rank, own, full)

    def optimizer_state_of(self, rank: int) -> dict[str, Any]:
        """Row `rank` of every per-element state tensor (momentum, Adam's moments), copied; scalars such as `step`
        as they are."""
        return self._per_element_state(lambda rows: rows[rank].clone())

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer `state_dict` with every per-element state tensor averaged over its rows (the workers)."""
        return self._per_element_state(lambda rows: rows.mean(0))

    def _per_element_state(self, of_rows: Callable[[Tensor], Tensor]) -> dict[str, Any]:
        """The optimizer `state_dict` with `of_rows(v)` in place of every per-element state tensor `v` (a row a
        worker)."""
        state = self.optimizer.state_dict()
        shapes = self._parameter_shapes()
        mapped = {
            key: {name: of_rows(v) if _per_element(name, v, shapes[key]) else v for name, v in values.items()}
            for key, values in state["state"].items()
        }
        return {**state, "state": mapped}

    def restore(self, resumed: list[dict[str, Any]], averaged_optimizer: dict[str, Any]) -> None:
        """Workers 1..n-1's replicas from their shards; the stacked optimizer state from every worker's shard (or the
        averaged optimizer state on every row); the rule's state is the driver's registry's."""
        for module, shard in zip(self.modules[1:], resumed[1:]):
            module.load_state_dict(shard["state_dict"])
        self.load_optimizer_states(
            [shard["optimizer_states"][0] for shard in resumed] or [averaged_optimizer] * len(self.modules)
        )

    def rule_state_of(self, rank: int) -> dict[str, Any]:
        """Row `rank` of every one-dimensional tensor of the rule's state (one value per element of the stacked flat
        parameters); the rest as it is."""
        return _rows(self.rules[0].state_dict(), lambda t: t.view(len(self.modules), -1)[rank].clone())

    def load_rule_states(self, states: list[dict[str, Any]]) -> None:
        """The rule's state from every worker's (`rule_state_of`'s), its rows stacked."""
        self.rules[0].load_state_dict(_stacked_rows(states) if all(states) else {})

    def load_optimizer_states(self, states: list[dict[str, Any]]) -> None:
        """The stacked optimizer state from each worker's optimizer `state_dict` (per-element entries stacked as
        rows)."""
        shapes = self._parameter_shapes()
        stacked = {
            key: {
                name: torch.stack([s["state"][key][name] for s in states])
                if _per_element(name, v, shapes[key][1:])
                else v
                for name, v in values.items()
            }
            for key, values in states[0]["state"].items()
        }
        self.optimizer.load_state_dict({**states[0], "state": stacked})

    def _parameter_shapes(self) -> dict[int, tuple[int, ...]]:
        """The optimizer's `state_dict` keys (parameter indices) -> the stacked parameters' shapes."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {index: tuple(p.shape) for index, p in enumerate(params)}


def _rows(state: Any, row: Callable[[Tensor], Tensor]) -> Any:
    """`state` (nested dicts, lists and tuples) with `row(t)` in place of every one-dimensional tensor `t`."""
    if isinstance(state, Tensor):
        return row(state) if state.dim() == 1 else state
    if isinstance(state, dict):
        return {k: _rows(v, row) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_rows(v, row) for v in state)
    return state


def _stacked_rows(states: list[Any]) -> Any:
    """The inverse of taking rows with `_rows`: every one-dimensional tensor is the workers' rows, concatenated.

    Examples:
        >>> _stacked_rows([{"anchor": [torch.tensor([1.0, 2.0])], "step": 3},
        ...                {"anchor": [torch.tensor([3.0, 4.0])], "step": 3}])
        {'anchor': [tensor([1., 2., 3., 4.])], 'step': 3}
    """
    first = states[0]
    if isinstance(first, Tensor):
        return torch.cat(states) if first.dim() == 1 else first
    if isinstance(first, dict):
        return {k: _stacked_rows([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_stacked_rows(list(column)) for column in zip(*states))
    return first


def _per_element(name: str, value: Any, shape: tuple[int, ...]) -> bool:
    """Whether the optimizer state entry `name` holds one value per element of its parameter (`shape`): a tensor of
    that shape other than `step`, the step count every torch optimizer keeps as one shared scalar (a 0-dim
    parameter's moments are 0-dim too: the name tells them apart).

    Examples:
        >>> _per_element("exp_avg", torch.zeros(()), ()), _per_element("step", torch.zeros(()), ())
        (True, False)
    """
    return isinstance(value, Tensor) and name != "step" and tuple(value.shape) == tuple(shape)


class _Call(Module):
    """`call(batch) = step(module, batch)`: a module whose forward is the LightningModule's training step, for
    `torch.func.functional_call` (its tensors are named `module.<name>`)."""

    def __init__(self, module: Module, step: Callable[[Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self.step = step

    def forward(self, batch: Any) -> Any:
        return self.step(self.module, batch)
