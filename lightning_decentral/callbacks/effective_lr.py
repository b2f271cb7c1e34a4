"""The effective learning rate of D-PSGD (Zhang et al., 2021), defined on the
[monitoring page](../monitoring.md#effective-learning-rate):

    ḡ_loc = (1/n) Σ_i ∇L(x_i; ξ_i)        what D-PSGD applies (gradients at the local replicas)
    g(x̄)  = (1/n) Σ_i ∇L(x̄; ξ_i)        what SSGD would apply (gradients at the average, same batches)
    α_e   = γ · ⟨ḡ_loc, g(x̄)⟩ / ‖g(x̄)‖²,    η_d = ḡ_loc − g(x̄)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor
from torch.optim import Optimizer

from lightning_decentral._compat.lightning import set_update_count
from lightning_decentral.callbacks._common import check_every, decentralized, due, warn_unless_written
from lightning_decentral.measures import effective_ratio, random_state, set_random_state


class EffectiveLearningRate(Callback):
    """Log D-PSGD's effective learning rate `α_e` and its landscape-dependent noise `η_d` (module docstring).

    Every `every_n_steps` optimizer steps it logs `lr/effective` (`α_e`), `lr/effective_ratio`
    (`α_e / γ`) and `noise/decentralized` (`‖η_d‖`), equal on every rank. `γ` is the learning rate of
    the optimizer's first param group; the ratio is over all trainable parameters. `α_e < γ` where the
    landscape is sharp: D-PSGD's self-adjusting learning rate.

    How, at a measured step `k`, in `on_before_optimizer_step` (the gradients of the step exist, the
    optimizer has not stepped; DecentLaM has not yet replaced them by `g̃`):

    * `g_i`: this rank's `p.grad` (unscaled, before clipping), the step's raw gradient at `x_i(k)`;
    * `∇L(x̄; ξ_i)`: `training_step` again on each of the step's own (micro-)batches, with the parameters
      and floating buffers replaced by their average (`strategy.averaged_model()`), under the precision
      plugin's forward context and the random state the batch's training forward started from (the same
      dropout masks), differentiated with `torch.autograd.grad`: no `p.grad` is touched and no
      gradient hook (DecentLaM's buckets) fires;
    * afterwards, parameters, every buffer (BatchNorm statistics, `num_batches_tracked`), the random
      state and the states of the module's torchmetrics are put back exactly, and `self.log` calls made
      by that second `training_step` are dropped: training continues bit for bit as without the callback.

    With sharded replicas (`shard_size > 1`: docs/sharded.md) the workers are the replicas: `g_g` is replica `g`'s
    gradient, which FSDP averaged over its ranks' batches, and `∇L(x̄; ξ_g)` comes from a plain backward at `x̄` (the
    shards of `x̄` swapped in; FSDP reduce-scatters it over the replica as in training), the step's own gradients set
    aside meanwhile and put back after; the means run over the replicas on each shard, the inner products are summed
    over the shards. The values equal the unsharded run's with each replica's batches as one.

    Cost at a measured step: one more forward and backward per micro-batch, and three model-sized
    all-reduces (`x̄`, then both gradients at once). Needs automatic optimization. Under any other
    strategy the replicas are one model, so `α_e = γ`, the ratio 1 and the noise 0 are logged with no
    extra work.

    Args:
        every_n_steps: measure at optimizer step `k` when `(k + 1) % every_n_steps == 0`; best a
            multiple of `Trainer(log_every_n_steps=...)`.

    Examples:
        >>> EffectiveLearningRate(every_n_steps=50).every_n_steps
        50

        In a job: `Trainer(strategy="dpsgd", devices=8, callbacks=[EffectiveLearningRate(every_n_steps=50)])`;
        the formula itself is [`ratio_and_noise`][lightning_decentral.measures.ratio_and_noise].
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = check_every(every_n_steps)
        self._step = -1
        self._batches: list[tuple[Any, int, dict[str, Any]]] = []  # the measured step's micro-batches

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization:
            raise ValueError(
                "EffectiveLearningRate re-runs `training_step` at the averaged weights, which needs automatic "
                "optimization; with `automatic_optimization = False`, remove the callback."
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        warn_unless_written(self.every_n_steps, trainer, type(self).__name__)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step != self._step:
            self._step = step
            self._batches = []
        strategy = decentralized(trainer)
        if due(step, self.every_n_steps) and strategy is not None:
            states = strategy.worker_random_states()
            self._batches += [(part, batch_idx, state) for part, state in zip(strategy.worker_batches(batch), states)]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        step = trainer.global_step
        if not due(step, self.every_n_steps):
            return
        lr = float(optimizer.param_groups[0]["lr"])
        ratio: Any = 1.0  # one model: ḡ_loc = g(x̄)
        noise: Any = 0.0
        if decentralized(trainer) is not None:
            batches, self._batches = self._batches, []
            ratio, noise = self._measure(trainer, pl_module, batches)
        pl_module.log_dict(
            {"lr/effective": ratio * lr, "lr/effective_ratio": ratio, "noise/decentralized": noise},
            on_step=True,
            on_epoch=False,
        )

    def _measure(
        self, trainer: Trainer, pl_module: LightningModule, batches: list[tuple[Any, int, dict[str, Any]]]
    ) -> tuple[Tensor, Tensor]:
        """`(⟨ḡ_loc, g(x̄)⟩ / ‖g(x̄)‖², ‖ḡ_loc − g(x̄)‖)`, equal on every rank."""
        strategy = decentralized(trainer)
        assert strategy is not None
        params = [p for p in pl_module.parameters() if p.requires_grad]
        local = strategy.gradient_sum()  # Σ_i g_i over this process's workers
        sharding = getattr(strategy, "sharding", None)
        if sharding is not None:  # sharded replicas: the replica's gradients, this rank's shards of them
            with _untouched(pl_module, strategy.root_device), strategy.averaged_model(), _gradients_set_aside(params):
                at_mean = _sharded_gradients(trainer, pl_module, params, batches)
            return sharding.effective_ratio(strategy.replica_ranks, local, at_mean)
        with _untouched(pl_module, strategy.root_device), strategy.averaged_model():
            at_mean = _gradients(trainer, pl_module, params, batches)
        return effective_ratio(strategy, local, at_mean)


def _gradients(
    trainer: Trainer, pl_module: LightningModule, params: list[Tensor], batches: list[tuple[Any, int, dict]]
) -> list[Tensor]:
    """`Σ_m ∇(L(x; ξ_m) / accumulate_grad_batches)` at the current parameters, over the step's micro-batches."""
    grads = [torch.zeros_like(p) for p in params]
    scale = _loss_scale(trainer)
    for loss in _scaled_losses(trainer, pl_module, batches, scale):
        parts = torch.autograd.grad(loss, params, allow_unused=True)
        for total, part in zip(grads, parts):
            if part is not None:
                total.add_(part, alpha=1.0 / scale)
    return grads


def _sharded_gradients(
    trainer: Trainer, pl_module: LightningModule, params: list[Tensor], batches: list[tuple[Any, int, dict]]
) -> list[Tensor]:
    """As [`_gradients`][lightning_decentral.callbacks.effective_lr._gradients] for a module FSDP sharded, whose
    forward runs on gathered copies that `torch.autograd.grad` cannot differentiate the parameters through: a plain
    backward of each micro-batch (every rank of the replica together), after which FSDP has reduce-scattered (averaged)
    them over the replica into `p.grad`, and this rank's shards of the replica's gradient are read from there (the
    caller set the step's own gradients aside: `p.grad` starts empty)."""
    scale = _loss_scale(trainer)
    for loss in _scaled_losses(trainer, pl_module, batches, scale):
        loss.backward()
    return [p.grad.detach() / scale if p.grad is not None else torch.zeros_like(p) for p in params]


def _loss_scale(trainer: Trainer) -> float:
    """The grad scaler's scale under fp16 mixed precision (the gradients are unscaled by it after), else 1."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


def _scaled_losses(
    trainer: Trainer, pl_module: LightningModule, batches: list[tuple[Any, int, dict]], scale: float
) -> Iterator[Tensor]:
    """`L(x; ξ_m) · scale / accumulate_grad_batches` of each of the step's micro-batches `ξ_m` with a loss, each
    from the random state its training forward started from."""
    pass_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    for batch, batch_idx, state in batches:
        set_random_state(state)
        with torch.enable_grad(), trainer.precision_plugin.train_step_context():
            output = pl_module.training_step(batch, batch_idx) if pass_index else pl_module.training_step(batch)
        loss = output["loss"] if isinstance(output, dict) else output
        if loss is None:  # the user skipped this batch: it did not contribute to g_i either
            continue
        yield loss * (scale / trainer.accumulate_grad_batches)


@contextlib.contextmanager
def _gradients_set_aside(params: list[Tensor]) -> Iterator[None]:
    """Inside: every parameter's `grad` is empty. After: each holds the very gradient tensor it held before."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


@contextlib.contextmanager
def _untouched(pl_module: LightningModule, device: torch.device) -> Iterator[None]:
    """Inside: `self.log` is silenced. After: every buffer, the random state and the torchmetrics states
    are what they were before (parameters are restored by `averaged_model`)."""
    from torchmetrics import Metric

    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    metrics = [(m, copy.deepcopy(m.metric_state), m.update_count) for m in pl_module.modules() if isinstance(m, Metric)]
    state = random_state(device)
    pl_module.log = pl_module.log_dict = _drop  # type: ignore[method-assign]  # instance attributes shadow them
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        set_random_state(state)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for metric, saved_state, count in metrics:
            for name, value in saved_state.items():
                setattr(metric, name, value)
            set_update_count(metric, count)


def _drop(*args: Any, **kwargs: Any) -> None:
    return None
