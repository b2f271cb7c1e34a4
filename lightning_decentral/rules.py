"""The update rules of docs/algorithms.md, one object per worker, apart from whoever runs them.

A rule touches only its worker's [`Replica`][lightning_decentral.replicas.Replica], the worker's
optimizer, and a [`Mixer`][lightning_decentral.mixing.Mixer]. An executor (the Trainer strategy,
a Fabric strategy, a single-process simulation) drives every rule through the same lifecycle, once
per optimizer step `k`, with the step's [`StepPlan`][lightning_decentral.schedule.StepPlan]:

```text
rule.begin_step(plan)                  before the forward pass      AWC posts x(k)
rule.before_backward()                 before each backward         DecentLaM: gradients into flat buffers
closure = rule.wrap_closure(closure)   forward + backward           AWC waits after it; DecentLaM posts z
rule.gradients_ready()                 after clipping               DecentLaM posts what backward did not
optimizer.step(closure)                x <- U(x, g)                 DecentLaM: g <- g̃ just before U
rule.end_step()                        after the step               AWC adds W x(k) − x(k); ATC posts U(x)
rule.finish_step()                     (may be later)               ATC, DecentLaM buffers: wait and combine
rule.drain()                           on an error, at the end      finish anything in flight
rule.teardown()                        once, when the run is over   release hooks (DecentLaM)
rule.state_dict(), load_state_dict()   a save, a resume             what the rule carries across steps
```

Backward passes of accumulated micro-batches run inside `rule.no_backward_sync()`.

An executor that runs many workers in one process runs each line for every worker before the
next line (every exchange is then started everywhere before anyone waits for it), as with the
[`DenseMixer`][lightning_decentral.mixing.DenseMixer] (see the example of
[`AdaptThenCombine`][lightning_decentral.rules.AdaptThenCombine]). Adding a rule means a subclass
of [`UpdateRule`][lightning_decentral.rules.UpdateRule] and an entry in `RULES` (docs/architecture.md,
"Adding a rule").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_decentral import algorithms
from lightning_decentral._compat import grad_scale, unscales_in_step
from lightning_decentral.mixing import Mixer, Pending, StartsCopies
from lightning_decentral.overlap import GradientBuckets
from lightning_decentral.replicas import Replica
from lightning_decentral.schedule import StepPlan

Closure = Callable[[], Any]


@dataclass
class RuleContext:
    """What only the executor knows and a rule needs, beyond its replica, mixer and optimizer (DecentLaM uses it).

    Attributes:
        bucket_bytes: the size of DecentLaM's gradient buckets, its unit of overlap with backward.
        grad_scaler: the enabled `torch.amp.GradScaler` of fp16 mixed precision, if any.
        any_worker: `flag -> flag set on any worker` (0-dim tensors; a collective on processes).
        overlap_backward: post DecentLaM's buckets from backward (no clipping or gradient-editing hook
            needs every gradient first, and optimization is automatic).
        warn: how to warn (the Trainer strategy warns on rank 0 only).
        before_wait: called once per step when this worker's gradients are final and it is about to wait
            for its neighbours' `z` (DecentLaM's optimizer pre-hook): a single-process executor readies the
            other workers there.
    """

    bucket_bytes: int = 4 * 2**20
    grad_scaler: torch.amp.GradScaler | None = None
    any_worker: Callable[[Tensor], Tensor] = field(default=lambda flag: flag)
    overlap_backward: bool = True
    warn: Callable[[str], None] = field(default=warnings.warn)
    before_wait: Callable[[], None] = field(default=lambda: None)


class UpdateRule:
    """One worker's side of an update rule; the base class is a local step, `x(k+1) = U(x(k), g)`.

    Args:
        replica: the worker's flat parameters and mixed buffers.
        mixer: the worker's mixer.
        optimizer: the worker's optimizer `U`.
        context: see [`RuleContext`][lightning_decentral.rules.RuleContext].
    """

    def __init__(
        self, replica: Replica, mixer: Mixer, optimizer: Optimizer, context: RuleContext | None = None
    ) -> None:
        self.replica = replica
        self.mixer = mixer
        self.optimizer = optimizer
        self.context = context or RuleContext()
        self.plan: StepPlan | None = None  # the step begun and not yet ended
        self._residual: tuple[int, Tensor] | None = None
        self._pending: Pending | None = None  # an exchange in flight
        self._begun = False  # a first step has begun

    def begin_step(self, plan: StepPlan) -> None:
        """Step `plan.step` begins (before its first forward pass). At the first, compressed gossip's public copies
        are told where the models start, which every worker passes alike
        ([`Choco.start_copies_at`][lightning_decentral.compression.Choco.start_copies_at])."""
        self.plan = plan
        if not self._begun and isinstance(self.mixer, StartsCopies):
            self.mixer.start_copies_at(self.replica.mixed)
        self._begun = True

    def before_backward(self) -> None:
        """A backward pass is about to run."""

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        """Backward passes of accumulated micro-batches run inside this."""
        yield

    def wrap_closure(self, closure: Closure) -> Closure:
        """The closure the optimizer runs (forward and backward), with the rule's work around it."""
        return closure

    def gradients_ready(self) -> None:
        """The gradients of this step are final (after clipping), and `U` comes next. An executor that
        runs the workers phase by phase calls it for every worker before any optimizer steps; the
        Trainer strategy need not (DecentLaM's optimizer pre-hook does the same)."""

    def end_step(self) -> None:
        """The optimizer has stepped."""

    def finish_step(self) -> None:
        """Wait for what `end_step` posted and combine; the step is over."""
        self._wait(len(self.replica.flat_parameters))
        self.plan = None

    def drain(self) -> None:
        """Finish any exchange in flight (an error, or a step that never reached the optimizer)."""
        self._wait()

    def teardown(self) -> None:
        """The run is over (also after an error: nothing is waited for here); release hooks."""

    def state_dict(self) -> dict[str, Any]:
        """What the rule carries from step to step besides the replica and the optimizer (copies, saved in the
        worker's shard; a tensor of one dimension holds one value per element of the flat parameters, which a
        stacked executor splits by worker): nothing, for the rules of this module."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, what `state_dict` returned (`{}`: start afresh from the replica as it is)."""

    def mix(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` for the parameters and the mixed buffers, now, between two steps (no exchange
        in flight): extra rounds on top of the step's own
        ([`ConsensusControl`][lightning_decentral.callbacks.ConsensusControl])."""
        self.mixer.start(self.replica.mixed, step, rounds).wait()

    def residual(self, step: int) -> Tensor | None:
        """`‖y_i − Σ_j w_ij(k) y_j‖²` over the trainable parameters, of the first round of step `step`'s
        exchange of `y` (AWC: `x(k)`; ATC: `U(x(k), g)`; DecentLaM: `z`), if the mixer measured it."""
        if self._residual is not None and self._residual[0] == step:
            return self._residual[1]
        return None

    def _post(self, tensors: list[Tensor], **kwargs: Any) -> None:
        assert self.plan is not None
        self._pending = self.mixer.start(tensors, self.plan.step, self.plan.rounds, **kwargs)

    def _wait(self, measured: int | None = None) -> None:
        """Wait for the exchange in flight; keep the sum of its first `measured` residuals as the step's."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.wait()
        if measured and pending.residuals and self.plan is not None:
            self._record(pending.residuals[:measured])

    def _record(self, residuals: list[Tensor]) -> None:
        if residuals and self.plan is not None:
            self._residual = (self.plan.step, torch.stack([r.double() for r in residuals]).sum())


class AdaptWithCombine(UpdateRule):
    """`x_i(k+1) = Σ_j w_ij x_j(k) + (U(x_i(k), g_i) − x_i(k))` (docs/algorithms.md, "D-PSGD, adapt-with-combine").

    The exchange of `x(k)` is posted before the forward pass and read only until the closure ends,
    so it travels during forward and backward; the mixer writes the correction `W x(k) − x(k)`,
    added after `U`. Module buffers are snapshotted first (the forward pass updates BatchNorm
    statistics in place).
    """

    def __init__(
        self, replica: Replica, mixer: Mixer, optimizer: Optimizer, context: RuleContext | None = None
    ) -> None:
        super().__init__(replica, mixer, optimizer, context)
        self._correction = [torch.empty_like(b) for b in replica.mixed]
        self._buffers_before = [torch.empty_like(b) for b in replica.flat_buffers]
        self._closure_ran = False

    def begin_step(self, plan: StepPlan) -> None:
        self.drain()  # posted for a step that never reached the optimizer (manual optimization)
        super().begin_step(plan)
        self._closure_ran = False
        if not plan.gossips:
            return
        for before, buffer in zip(self._buffers_before, self.replica.flat_buffers):
            before.copy_(buffer)
        # the parameters are only read until the wait (forward and backward do not write them): sent without a copy
        self._post(self.replica.flat_parameters + self._buffers_before, out=self._correction)

    def wrap_closure(self, closure: Closure) -> Closure:
        def closure_then_wait() -> Any:
            result = closure()
            if not self._closure_ran:  # an optimizer may call its closure more than once
                self._wait(len(self.replica.flat_parameters))
                self._closure_ran = True
            return result

        return closure_then_wait

    def end_step(self) -> None:
        assert self.plan is not None
        if not self._closure_ran:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}.step() did not call its closure, so the gossip of step "
                f"{self.plan.step} could not be combined. DecentralizedStrategy needs an optimizer that calls the "
                "closure."
            )
        if self.plan.gossips:
            algorithms.add_(self.replica.mixed, self._correction)


class AdaptThenCombine(UpdateRule):
    """`x_i(k+1) = Σ_j w_ij U(x_j(k), g_j)` (docs/algorithms.md, "D-PSGD, adapt-then-combine"): step, then
    mix what was stepped. `end_step` posts `U(x)`; `finish_step` waits and combines.

    Examples:
        Two workers in one process on a [`DenseMixer`][lightning_decentral.mixing.DenseMixer], one step
        on the complete graph (`W = 11ᵀ/2`): `x = (1, 3)`, `g = 1`, `γ = 0.5` give `U(x) = (0.5, 2.5)`,
        mixed to their mean.

        >>> from lightning_decentral.mixing import DenseMixer
        >>> from lightning_decentral.replicas import Replica
        >>> from lightning_decentral.schedule import StepPlan
        >>> from lightning_decentral.topology import Complete
        >>> mixer = DenseMixer(Complete(world_size=2))
        >>> models = [torch.nn.Linear(1, 1, bias=False) for _ in range(2)]
        >>> rules = []
        >>> for i, model in enumerate(models):
        ...     _ = torch.nn.init.constant_(model.weight, 2.0 * i + 1)
        ...     sgd = torch.optim.SGD(model.parameters(), lr=0.5)
        ...     rules.append(AdaptThenCombine(Replica(model, mix_buffers=False), mixer.worker(i), sgd))
        >>> for rule in rules:  # each phase for every worker before the next phase
        ...     rule.begin_step(StepPlan(step=0, rounds=1))
        >>> for rule, model in zip(rules, models):
        ...     _ = rule.optimizer.step(rule.wrap_closure(lambda m=model: m(torch.ones(1, 1)).sum().backward()))
        ...     rule.end_step()  # posts U(x)
        >>> for rule in rules:
        ...     rule.finish_step()  # waits: W U(x)
        >>> [model.weight.item() for model in models]
        [1.5, 1.5]
    """

    def end_step(self) -> None:
        assert self.plan is not None
        if self.plan.gossips:
            self._post(self.replica.mixed)


class DecentLaM(UpdateRule):
    """`z_j = x_j − γ g_j`, `g̃_i = (x_i − Σ_j w_ij z_j) / γ`, `x_i(k+1) = U(x_i(k), g̃_i)` (docs/algorithms.md,
    "DecentLaM").

    `z` is exchanged bucket by bucket as backward produces the gradients
    ([`GradientBuckets`][lightning_decentral.overlap.GradientBuckets]); an optimizer pre-hook runs the
    closure, waits for every bucket and writes `g̃` into the gradients right before `U`. Mixed module
    buffers are averaged after the step, `b <- W b`. Under a GradScaler, a step with an inf or NaN
    gradient on any worker is skipped on every worker.
    """

    def __init__(
        self, replica: Replica, mixer: Mixer, optimizer: Optimizer, context: RuleContext | None = None
    ) -> None:
        super().__init__(replica, mixer, optimizer, context)
        context = self.context
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("DecentLaM rewrites the gradient once per step; LBFGS re-evaluates it. Use momentum SGD.")
        if type(optimizer) is not torch.optim.SGD:
            context.warn(
                f"DecentLaM's bias correction is derived for momentum SGD; {type(optimizer).__name__} will step "
                "with the modified gradient, without that guarantee."
            )
        scaler = context.grad_scaler
        if scaler is not None and unscales_in_step(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__} unscales its gradients inside step() (fused=True), after DecentLaM has "
                "replaced them. Use the optimizer without fused=True, or bf16-mixed precision."
            )
        self.buckets = GradientBuckets(
            replica.flat_parameters,
            replica.parameters,
            optimizer,
            mixer,
            bucket_bytes=context.bucket_bytes,
            grad_scale=self._grad_scale,
            check_finite=scaler is None,
        )
        self._modify_at_step = False  # the optimizer's pre-hook writes g̃
        self._hooks = [p.register_post_accumulate_grad_hook(self.buckets.on_gradient) for p in replica.parameters]
        self._hooks.append(optimizer.register_step_pre_hook(self._before_update))

    def begin_step(self, plan: StepPlan) -> None:
        self.drain()  # posted for a step that never reached the optimizer (manual optimization)
        super().begin_step(plan)
        if plan.gossips:
            self.buckets.arm(plan.step, plan.rounds, listen=self.context.overlap_backward)
        else:
            self.buckets.listening = False  # W = I: g̃ = g, nothing to send

    def before_backward(self) -> None:
        self.buckets.attach_gradients()

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        listening, self.buckets.listening = self.buckets.listening, False
        try:
            yield
        finally:
            self.buckets.listening = listening

    def wrap_closure(self, closure: Closure) -> Closure:
        assert self.plan is not None
        if not self.plan.gossips:
            return closure

        def closure_then_post() -> Any:
            result = closure()
            if self.context.overlap_backward:  # else the pre-hook posts, after clipping
                self.buckets.post_all(self._grad_scale())
            if self.context.grad_scaler is not None:
                self.buckets.poison_gradients_if(self.context.any_worker(~self.buckets.gradients_finite()))
            return result

        self._modify_at_step = True
        return closure_then_post

    def gradients_ready(self) -> None:
        if self._modify_at_step:
            self.buckets.post_all()  # what backward did not post: unused parameters, or clipping came first

    def end_step(self) -> None:
        assert self.plan is not None
        self.drain()
        if not self.plan.gossips:
            return
        if self.buckets.late_gradient:
            raise RuntimeError(
                f"A gradient changed after its bucket was sent at step {self.plan.step} (a second backward?). "
                "DecentLaM needs one backward per optimizer step, or manual optimization."
            )
        if self.replica.flat_buffers:  # tags below belong to the buckets
            self._post(self.replica.flat_buffers, tag=self.buckets.num_buckets)

    def finish_step(self) -> None:
        self._wait()  # the buffers' exchange: the residual is z's, recorded before U
        self.plan = None

    def drain(self) -> None:
        self._modify_at_step = False
        self.buckets.drain()
        super().drain()

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _grad_scale(self) -> Any:
        scaler = self.context.grad_scaler
        return grad_scale(scaler) if scaler is not None else 1.0  # the scale tensor: get_scale() would sync the host

    def _before_update(self, optimizer: Optimizer, args: Any, kwargs: dict[str, Any]) -> Any:
        """Optimizer step pre-hook: run the closure (backward, unscale, clip), then `g <- g̃`."""
        if not self._modify_at_step:
            return None
        self._modify_at_step = False
        closure = kwargs.get("closure")
        with torch.enable_grad():
            result = closure() if closure is not None else None
        self.context.before_wait()
        self.buckets.modify_gradients()
        self._record(self.buckets.residuals)  # of z, bucket by bucket
        if closure is None:
            return None
        return args, {**kwargs, "closure": lambda: result}


RuleFactory = Callable[[Replica, Mixer, Optimizer, RuleContext | None], UpdateRule]
"""`(replica, mixer, optimizer, context) -> rule`: a class of `RULES`, or what the
[driver][lightning_decentral.driver.StepDriver.make_rule] builds from the options."""

RULES: dict[str, type[UpdateRule]] = {
    "awc": AdaptWithCombine,
    "atc": AdaptThenCombine,
    "decentlam": DecentLaM,
}
"""The update rules by name; [`rule_name`][lightning_decentral.options.rule_name] picks the entry of a
strategy's `momentum` and `combine`."""


def check_one_optimizer(optimizers: list[Any], source: str) -> None:
    """Raise unless there is exactly one optimizer (`source` says where they came from)."""
    if len(optimizers) != 1:
        raise ValueError(
            f"Decentralized training mixes the whole model once per optimizer step and needs exactly one optimizer, "
            f"but {source} {len(optimizers)}. Put the parameters into one optimizer with several parameter groups."
        )
