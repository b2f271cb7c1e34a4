"""The LightningModule's training hooks on every simulated worker:
[`WorkerHooks`][lightning_decentral.simulation.hooks.WorkerHooks].

Lightning calls a module hook once, on the LightningModule: on worker 0. On `n` processes every rank calls it on
its own replica, so a hook that changes the module (freezes BatchNorm in `on_train_batch_start`, keeps an average
of the weights in `on_train_batch_end`) changes every replica. The per-worker simulation makes each hook of
`PER_WORKER_HOOKS` that the module overrides call the same hook on every worker, in worker order, each with its own
arguments: its batch, its loss, its optimizer, its `training_step` output. (The vectorized simulation needs none
of this: worker 0's module runs every worker's rows.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_decentral.simulation.data import PerWorker
from lightning_decentral.simulation.workers import SimulatedWorkers, collect_logs

PER_WORKER_HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
)
"""The LightningModule hooks of a training run that the per-worker simulation runs on every worker."""


class WorkerHooks:
    """Each hook of `PER_WORKER_HOOKS` that worker 0's module overrides, called on every worker (see the module
    docstring): [`install`][lightning_decentral.simulation.hooks.WorkerHooks.install] shadows worker 0's hook by a
    function that calls the hook of each worker `i` inside its random state, with worker `i`'s batch (of a
    [`PerWorker`][lightning_decentral.simulation.data.PerWorker]), optimizer, loss (`losses()[i]`, as backward
    receives it) or output (`outputs()[i]`). What workers `1..n-1` log in a hook is dropped (worker 0's is logged);
    what the hook returns is worker 0's.

    Args:
        workers: the workers, worker 0 (the LightningModule) first.
        losses: each worker's loss of the current backward.
        outputs: each worker's `training_step` output of the current batch.
    """

    def __init__(
        self, workers: SimulatedWorkers, losses: Callable[[], list[Tensor]], outputs: Callable[[], list[Any]]
    ) -> None:
        self.workers = workers
        self.losses = losses
        self.outputs = outputs
        self.installed: list[str] = []

    def install(self) -> list[str]:
        """Make worker 0's overridden hooks run on every worker; the names of those hooks."""
        module = self.workers.modules[0]
        self.installed = [name for name in PER_WORKER_HOOKS if is_overridden(name, module)]
        for name in self.installed:
            setattr(module, name, self._on_every_worker(name))  # an instance attribute shadows the method
        return self.installed

    def remove(self) -> None:
        """Give worker 0 its own hooks back."""
        module = self.workers.modules[0]
        for name in self.installed:
            delattr(module, name)
        self.installed = []

    def _on_every_worker(self, name: str) -> Callable[..., Any]:
        def every_worker(*args: Any, **kwargs: Any) -> Any:
            results = []
            for rank, worker in enumerate(self.workers.workers):
                hook = getattr(type(worker.module), name).__get__(worker.module)
                own_args = [self._own(name, rank, arg) for arg in args]
                own_kwargs = {key: self._own(name, rank, value) for key, value in kwargs.items()}
                quiet = collect_logs(worker.module, {}) if rank else contextlib.nullcontext()
                with self.workers.as_worker(rank), quiet:
                    results.append(hook(*own_args, **own_kwargs))
            return results[0]

        return every_worker

    def _own(self, hook: str, rank: int, value: Any) -> Any:
        """Worker `rank`'s counterpart of the argument `value` that Lightning passed to worker 0's `hook`."""
        if isinstance(value, PerWorker):
            return value[rank]
        if hook == "on_before_backward" and isinstance(value, Tensor):
            return self.losses()[rank]
        if hook == "on_train_batch_end" and isinstance(value, dict) and "loss" in value:
            return _as_lightning_output(self.outputs()[rank])
        worker0 = self.workers.workers[0].optimizer
        if value is worker0 or getattr(value, "optimizer", None) is worker0:  # Lightning's wrapper of worker 0's
            return self.workers.workers[rank].optimizer
        return value


def _as_lightning_output(output: Any) -> dict[str, Any]:
    """A `training_step` output as Lightning hands it to `on_train_batch_end`: a dict with the loss, detached."""
    as_dict = dict(output) if isinstance(output, dict) else {"loss": output}
    return apply_to_collection(as_dict, Tensor, lambda t: t.detach())
