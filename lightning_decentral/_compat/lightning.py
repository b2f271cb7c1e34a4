"""The private names of Lightning and torchmetrics the package needs (`lightning_decentral._compat` holds torch's,
and says the rules): in `PRIVATE_NAMES` those reached through this module, in `INHERITED_NAMES` the members a subclass
of a Lightning class overrides or uses on itself, which stay in its code."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import lightning.fabric.wrappers as fabric_wrappers
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops.progress import _OptimizationProgress as OptimizationProgress
from lightning.pytorch.loops.progress import _Progress as Progress
from lightning.pytorch.loops.progress import _ReadyCompletedTracker as ReadyCompletedTracker
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler as distributed_sampler
from lightning.pytorch.utilities.data import _update_dataloader as update_dataloader
from torchmetrics import Metric

__all__ = [
    "BATCHES_THAT_STEPPED",
    "BackwardSyncControl",
    "MultiProcessingLauncher",
    "OptimizationProgress",
    "Progress",
    "ReadyCompletedTracker",
    "SubprocessScriptLauncher",
    "as_fabric_backward",
    "callback_states",
    "distributed_sampler",
    "epochs_begun",
    "load_callback_states",
    "mark_sigterm_received",
    "replace_sigterm_handling",
    "resume_from_state",
    "set_device_mesh",
    "set_epochs_begun",
    "set_update_count",
    "update_dataloader",
    "uses_distributed_sampler",
]

_LOOP_STATE = "a Fabric checkpoint converted to a Trainer's needs the loop state the Trainer restores: no public writer"
_SETUP = "setup_distributed, rewritten to make the default group on the job's store, sets what Lightning's sets"

PRIVATE_NAMES: list[tuple[str, str, str]] = [
    (
        "lightning.fabric.strategies.strategy",
        "_BackwardSyncControl",
        "the base of what fabric.no_backward_sync runs, which a Fabric strategy holds: no public base",
    ),
    (
        "lightning.pytorch.strategies.launchers",
        "_MultiProcessingLauncher",
        "DDPStrategy's spawn/fork launcher, subclassed to hand back x̄: Lightning exports no public launcher",
    ),
    (
        "lightning.pytorch.strategies.launchers",
        "_SubprocessScriptLauncher",
        "DDPStrategy's popen launcher, subclassed to hand Lightning a dangling last.ckpt: no public launcher",
    ),
    ("lightning.pytorch.loops.progress", "_OptimizationProgress", _LOOP_STATE),
    ("lightning.pytorch.loops.progress", "_Progress", _LOOP_STATE),
    ("lightning.pytorch.loops.progress", "_ReadyCompletedTracker", _LOOP_STATE),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_batches_that_stepped", _LOOP_STATE),
    (
        "lightning.pytorch.trainer.connectors.data_connector",
        "_get_distributed_sampler",
        "the sampler the Trainer gives rank i (its seed, a custom sampler wrapped): a simulated worker i gets the same",
    ),
    (
        "lightning.pytorch.core.module.LightningModule",
        "_device_mesh",
        "what a module's device_mesh property reads; it has no setter, and Lightning's ModelParallelStrategy sets "
        "this field itself before configure_model (sharded replicas give the module their mesh the same way)",
    ),
    (
        "lightning.pytorch.trainer.trainer.Trainer",
        "_accelerator_connector",
        "holds the Trainer's use_distributed_sampler (no public reader): the simulated workers get the data as "
        "processes would under it",
    ),
    (
        "lightning.pytorch.utilities.data",
        "_update_dataloader",
        "a DataLoader made again with another sampler as the Trainer makes it (a subclass's arguments kept)",
    ),
    (
        "lightning.pytorch.trainer.trainer.Trainer",
        "_signal_connector",
        "the Trainer's signal handlers, whose SIGTERM an agreed stop replaces: no public hook",
    ),
    (
        "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector",
        "_sigterm_notifier_fn",
        "what the SIGTERM handler the Trainer registers runs",
    ),
    (
        "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
        "the broadcast from rank 0 at every training batch that spreads a SIGTERM; an agreement on the store "
        "replaces it",
    ),
    (
        "lightning.fabric.wrappers",
        "_in_fabric_backward",
        "Fabric's mark of a backward inside fabric.backward, without which its module wrapper refuses "
        "torch.autograd.grad",
    ),
    (
        "lightning.fabric.wrappers._FabricDataLoader",
        "_num_iter_calls",
        "the epochs a loader of fabric.setup_dataloaders has begun, its sampler's epoch at the next iter: restored "
        "with a checkpoint; no public reader or setter",
    ),
    (
        "lightning.pytorch.trainer.trainer.Trainer",
        "_checkpoint_connector",
        "what the Trainer restores after the strategy's setup: a rank that rejoins resumes from a state received over "
        "the network, not from a file (fit's ckpt_path takes a path only)",
    ),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
        "_loaded_checkpoint",
        "the checkpoint restore_training_state restores from (loops, optimizers, schedulers, precision)",
    ),
    (
        "lightning.pytorch.trainer.call",
        "_call_callbacks_state_dict",
        "every callback's state as a checkpoint holds it: a rank that rejoins takes its callbacks' over from a member",
    ),
    (
        "lightning.pytorch.trainer.call",
        "_call_callbacks_load_state_dict",
        "the callbacks' states loaded as on resume, from a state received over the network (no checkpoint file)",
    ),
    (
        "torchmetrics.Metric",
        "_update_count",
        "restored with a metric's states after an evaluation that must leave no trace: update_count has no setter",
    ),
]

INHERITED_NAMES: list[tuple[str, str, str]] = [
    (
        "lightning.pytorch.strategies.DDPStrategy",
        "_configure_launcher",
        "runs when the Trainer is built, before any process: the topology is bound there; no public hook that early",
    ),
    (
        "lightning.pytorch.strategies.DDPStrategy",
        "_launcher",
        "the launcher _configure_launcher chose, replaced for spawn/fork",
    ),
    ("lightning.pytorch.strategies.DDPStrategy", "_start_method", "the start method given: no public property"),
    ("lightning.pytorch.strategies.DDPStrategy", "_timeout", "the timeout given: no public property"),
    ("lightning.pytorch.strategies.DDPStrategy", "_get_process_group_backend", _SETUP),
    ("lightning.pytorch.strategies.DDPStrategy", "_process_group_backend", _SETUP),
    ("lightning.pytorch.strategies.SingleDeviceStrategy", "_root_device", "the device, chosen after the constructor"),
    (
        "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
        "_collect_rank_zero_results",
        "what a spawned rank 0 hands back to the main process: x̄ in place of its replica",
    ),
    (
        "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
        "_strategy",
        "the launcher's strategy",
    ),
    (
        "lightning.fabric.strategies.DDPStrategy",
        "_configure_launcher",
        "runs when Fabric is built, before any process: the topology is bound there; no public hook that early",
    ),
    (
        "lightning.fabric.strategies.DDPStrategy",
        "_setup_distributed",
        "where fabric.launch() makes the default process group",
    ),
    ("lightning.fabric.strategies.DDPStrategy", "_set_world_ranks", _SETUP),
    ("lightning.fabric.strategies.DDPStrategy", "_get_process_group_backend", _SETUP),
    ("lightning.fabric.strategies.DDPStrategy", "_process_group_backend", _SETUP),
    ("lightning.fabric.strategies.DDPStrategy", "_timeout", "the timeout given: no public property"),
    (
        "lightning.fabric.strategies.DDPStrategy",
        "_backward_sync_control",
        "what fabric.no_backward_sync runs: the strategy's own, set in its constructor",
    ),
    (
        "lightning.fabric.strategies.Strategy",
        "_convert_stateful_objects_in_state",
        "what fabric.save writes of a state (modules and optimizers as state dicts): no public converter",
    ),
    (
        "lightning.pytorch.cli.LightningCLI",
        "_parser",
        "the parser of the running subcommand, whose error() exits as a parse error: no public accessor",
    ),
]

BATCHES_THAT_STEPPED = "_batches_that_stepped"
"""The key of a Trainer checkpoint's training epoch loop state that counts the batches that stepped (its logging
step)."""


def replace_sigterm_handling(
    trainer: Trainer, on_sigterm: Callable[[int, FrameType | None], None], at_batch_start: Callable[[], None]
) -> None:
    """In `trainer`'s current fit: the SIGTERM handler the Trainer registers runs `on_sigterm`, and every training batch
    starts with `at_batch_start()` in place of Lightning's broadcast of a SIGTERM from rank 0. Call it before the
    Trainer registers its handlers (in the strategy's `setup`)."""
    # instance attributes shadowing Lightning's methods: read by register_signal_handlers and by every batch
    trainer._signal_connector._sigterm_notifier_fn = on_sigterm
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = at_batch_start


def resume_from_state(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Make `trainer` restore the training state (loops, optimizers, schedulers, precision plugin) from `checkpoint`
    after the strategy's `setup`, as it does for `fit(ckpt_path=...)`: call it in the strategy's `setup`."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def callback_states(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """Every callback's `state_dict` by its `state_key`, as a checkpoint holds them (`checkpoint["callbacks"]`)."""
    return call._call_callbacks_state_dict(trainer)


def load_callback_states(trainer: Trainer, states: dict[str, dict[str, Any]]) -> None:
    """Load `states` ([`callback_states`][lightning_decentral._compat.lightning.callback_states]) into `trainer`'s
    callbacks, as Lightning does on resume."""
    call._call_callbacks_load_state_dict(trainer, {"callbacks": states})


def uses_distributed_sampler(trainer: Trainer) -> bool:
    """The Trainer's `use_distributed_sampler` argument: whether its processes get a `DistributedSampler` each.

    Examples:
        >>> uses_distributed_sampler(Trainer(use_distributed_sampler=False, logger=False, enable_progress_bar=False))
        False
    """
    return trainer._accelerator_connector.use_distributed_sampler


def set_device_mesh(module: LightningModule, mesh: Any) -> None:
    """Give `module` its `device_mesh` (read in `configure_model`), as Lightning's `ModelParallelStrategy` does."""
    module._device_mesh = mesh


def mark_sigterm_received(trainer: Trainer) -> None:
    """Mark `trainer`'s run as stopped by a SIGTERM, as Lightning's handler does before it raises `SIGTERMException`."""
    trainer._signal_connector.received_sigterm = True


@contextlib.contextmanager
def as_fabric_backward() -> Iterator[None]:
    """Inside: Fabric's module wrapper takes a backward (`torch.autograd.grad`) for one `fabric.backward` runs, and
    does not refuse it."""
    before = fabric_wrappers._in_fabric_backward
    fabric_wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        fabric_wrappers._in_fabric_backward = before


def epochs_begun(loader: Any) -> int | None:
    """The epochs a loader `fabric.setup_dataloaders` returned has begun (the epoch it sets on its sampler at the next
    `iter`); `None` for another object."""
    return getattr(loader, "_num_iter_calls", None)


def set_epochs_begun(loader: Any, epochs: int) -> None:
    """Make the next `iter(loader)` of a loader `fabric.setup_dataloaders` returned begin epoch `epochs`."""
    loader._num_iter_calls = epochs


def set_update_count(metric: Metric, count: int) -> None:
    """Set how many times `metric.update` ran (`metric.update_count` reads it), restoring a metric's state.

    Examples:
        >>> from torchmetrics.aggregation import SumMetric
        >>> metric = SumMetric()
        >>> metric.update(2.0)
        >>> set_update_count(metric, 0)
        >>> metric.update_count
        0
    """
    metric._update_count = count
