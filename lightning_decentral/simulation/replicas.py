"""`SimulatedReplicaStrategy`: one process holding `n` replicas, as Lightning needs them.

What a simulation of decentralized training needs of Lightning besides its update rule: one device (and a
clear error for more), the re-seed every rank does at set-up, worker random states from the start of
training, evaluation on `x̄`, and checkpoints that hold `x̄` with one shard per worker in
`DecentralizedStrategy`'s layout ([`checkpoint`][lightning_decentral.checkpoint]), so that a run moves
between the simulation and `n` processes. The workers themselves are a
[`SimulatedWorkers`][lightning_decentral.simulation.workers.SimulatedWorkers].
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral import checkpoint as shards
from lightning_decentral.common import EvaluationOnAverage
from lightning_decentral.common.evaluation import restore_replicas, swap_in_average
from lightning_decentral.driver import StepDriver
from lightning_decentral.files import with_atomic_writes
from lightning_decentral.replicas import AveragedModel
from lightning_decentral.simulation.data import PerWorker, StackedBatch
from lightning_decentral.simulation.workers import Logged, SimulatedWorkers


class SimulatedReplicaStrategy(SingleDeviceStrategy):
    """`SingleDeviceStrategy` holding `workers` replicas (see the module docstring); subclasses fill
    `self._group` at set-up and define the update.

    Args:
        driver: the update rule's driver, bound to the `n` workers: their mixer, the rule the shards record and the
            state they hold ([`StateRegistry`][lightning_decentral.checkpoint.StateRegistry]), `eval_on`
            (`"average"`: evaluate `x̄`; `"local"`: worker 0's replica).
        **kwargs: `SingleDeviceStrategy`'s `accelerator`, `checkpoint_io`, `precision_plugin`.
    """

    def __init__(self, driver: StepDriver, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self.driver = driver
        self.workers = driver.num_workers
        self._mixer = driver.dense_mixer()
        self._group = SimulatedWorkers(self._mixer, torch.device("cpu"))  # rebuilt on the device at fit
        self._devices: list[torch.device] = []
        self._averaged = AveragedModel()
        self.evaluation = EvaluationOnAverage(driver.options.eval_on, self.averaged_model)
        self._resume_shards: list[dict[str, Any]] = []  # fit(ckpt_path=...): every worker's shard, until restored
        self._rng_restored = False

    # -- the monitoring surface of the workers (with the subclass's Driven's) --------------------

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `Σ_i ‖p_i − p̄‖²` over the workers and `‖p̄‖²`
        (float64; `DecentralizedStrategy.parameter_deviations` gives one rank's term of the sum)."""
        return self._group.parameter_deviations()

    def gradient_sum(self) -> list[Tensor]:
        """`Σ_i g_i` for each trainable parameter of the LightningModule: the workers' current gradients."""
        return self._group.gradient_sum()

    def worker_batches(self, batch: Any) -> list[Any]:
        """Each worker's batch of the batch the training loop holds."""
        if isinstance(batch, StackedBatch):
            return list(batch.parts())
        return list(batch.of(self._group.origins)) if isinstance(batch, PerWorker) else [batch]

    def worker_random_states(self) -> list[dict[str, Any]]:
        """The torch random state each worker draws from now (worker 0's is the process's own), as
        [`random_state`][lightning_decentral.measures.random_state] gives it."""
        device = self.root_device
        return [
            {"cpu": cpu, **({"cuda": (device, cuda)} if cuda is not None else {})}
            for cpu, cuda in self._group.random_states()
        ]

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Each worker's batch to the device, through the LightningModule's transfer hooks (a stacked batch at once)."""
        if isinstance(batch, PerWorker):
            moved = [super(SimulatedReplicaStrategy, self).batch_to_device(b, device, dataloader_idx) for b in batch]
            return PerWorker(moved, batch.origins)
        if isinstance(batch, StackedBatch):
            return StackedBatch(super().batch_to_device(batch.batch, device, dataloader_idx), batch.workers)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- the devices Lightning hands over --------------------------------------------------------

    @property
    def parallel_devices(self) -> list[torch.device]:
        """The devices of the Trainer's `devices=`; exactly one."""
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        devices = list(devices or [])
        if len(devices) != 1:
            raise ValueError(
                f"SimulatedDecentralizedStrategy runs every worker in one process on one device, but the Trainer "
                f"was given {len(devices)} devices: use devices=1 (and workers=n for n simulated workers), or "
                "DecentralizedStrategy for one process per device."
            )
        self._devices = devices
        self._root_device = devices[0]

    @property
    def num_nodes(self) -> int:
        """Always 1."""
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ValueError(f"SimulatedDecentralizedStrategy runs in one process: use num_nodes=1, not {num_nodes}.")

    def worker_modules(self) -> list[Module]:
        """Each worker's module, worker 0 (the LightningModule itself) first; empty before fit."""
        return list(self._group.modules)

    @contextlib.contextmanager
    def averaged_model(self) -> Iterator[None]:
        """Replace the LightningModule's state by `x̄`, the mean of every worker's, inside the block."""
        mean = self._group.mean if len(self._group.modules) > 1 else None
        with self._averaged.swapped_in(self.lightning_module, mean):
            yield

    @override
    def setup_environment(self) -> None:
        """Before the module's `setup`: refuse a job of several processes; re-seed as every rank does."""
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if processes > 1:
            raise ValueError(
                f"SimulatedDecentralizedStrategy runs in one process, but this job has {processes} (WORLD_SIZE): "
                "launch one process, or use DecentralizedStrategy."
            )
        super().setup_environment()
        reset_seed()  # DDPStrategy re-seeds each rank from seed_everything's seed here: so does every worker

    @override
    def on_train_start(self) -> None:
        """Before the first epoch: every worker starts from the random state the run has now, as every rank
        does (each re-seeded from `seed_everything`'s seed at set-up, then doing the same work)."""
        super().on_train_start()
        if not self._rng_restored:  # resumed from shards: each worker continues its own
            self._group.start_random_states()

    # -- validation, test and predict on x̄ (eval_on="average"), every replica restored afterwards ------------------

    on_validation_start = on_test_start = on_predict_start = swap_in_average
    on_validation_end = on_test_end = on_predict_end = restore_replicas

    # -- checkpoints: x̄ and one shard per worker, as DecentralizedStrategy writes them ------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """`x̄`'s state dict: the checkpoint loads into a plain module."""
        with self.averaged_model():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state averaged over the workers (a resume that cannot use the shards starts there)."""
        return self._group.optimizer_state() if self._group.modules else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every worker's shard as rank `i` of `n` writes it, then the checkpoint file (`x̄`), then the
        workers' shards of earlier saves to this path go: the layout `DecentralizedStrategy` reads. A worker
        holding a NaN or an Inf stops the save before anything is written or removed."""
        if not self._group.modules:  # not fitting: a plain checkpoint
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_id = secrets.randbits(62)
        workers = len(self._group.modules)  # fewer than `self.workers` once some are lost
        checkpoint[shards.META_KEY] = {"save_id": save_id, "world_size": workers}
        paths = [shards.shard_path(filepath, i, workers, save_id) for i in range(workers)]
        try:
            full = "optimizer_states" in checkpoint
            precision = self.precision_plugin.state_dict() if full else None
            step = self.lightning_module.trainer.global_step
            built = []
            for rank, module in enumerate(self._group.modules):
                own = {k: v.detach() for k, v in self._averaged.own_state_dict(module).items()}
                contents = self.driver.shard_contents(
                    rank, step=step, precision=precision, **self._group.own_state(rank, own, full)
                )
                built.append(shards.make_shard(save_id, rank, workers, **contents))
            bad = [
                rank
                for rank, shard in enumerate(built)
                if not shards.holds_finite(
                    [shard["state_dict"], shard.get("optimizer_states"), shard.get("rule_state")]
                )
            ]
            if bad:  # before anything is written or removed
                raise shards.not_finite_error(bad, step, filepath, who="Worker(s)")
            for shard, path in zip(built, paths):
                shards.write_shard(shard, path)
            with_atomic_writes(self.checkpoint_io).save_checkpoint(
                checkpoint, filepath, storage_options=storage_options
            )
        except BaseException:
            for path in paths:
                shards.discard(path)
            raise
        for i in range(self.workers):  # the lost workers' shards of this path too
            shards.remove_shards(filepath, i, keep=paths[i] if i < workers else None)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """The checkpoint file and every worker's shards of it."""
        super().remove_checkpoint(filepath)
        for i in range(self.workers):
            shards.remove_shards(filepath, i)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint file and, when fitting, every worker's shard: if all are there (a save of `workers`
        ranks, by either strategy), worker `i` continues exactly from shard `i`; else every worker starts from
        `x̄` and the averaged optimizer state, with one warning saying why."""
        checkpoint = super().load_checkpoint(
            checkpoint_path, weights_only=True if weights_only is None else weights_only
        )
        self._resume_shards = []
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        meta = checkpoint.get(shards.META_KEY)
        found = [shards.read_own_shard(checkpoint_path, meta, i, self.workers) for i in range(self.workers)]
        problems = [problem for _, problem in found]
        if any(problems):
            rank_zero_warn(shards.resume_warning(checkpoint_path, problems, meta, self.workers))
            return checkpoint
        self._resume_shards = [shard for shard, _ in found]
        changed = shards.rule_change_warning(checkpoint_path, self._resume_shards[0], self.driver.rule_record())
        if changed is not None:
            rank_zero_warn(changed)
        return shards.with_shard(
            checkpoint, self._resume_shards[0], precision_key=type(self.precision_plugin).__qualname__
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning restores worker 0's optimizer; then every other worker's replica and optimizer from its shard
        (or the averaged optimizer state) and, resuming from shards, the step (checked) and every part the driver
        registered, each worker's from its shard: the random states among them."""
        super().load_optimizer_state_dict(checkpoint)
        resumed, self._resume_shards = self._resume_shards, []
        self._group.restore(resumed, checkpoint["optimizer_states"][0])
        if resumed:
            shards.check_saved_step(resumed[0], self.lightning_module.trainer.global_step)
            self.driver.state.load(resumed)
        self._rng_restored = bool(resumed)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A run stopped with an error: put worker 0's own state back."""
        self.evaluation.end()
        super().on_exception(exception)


def log_over_workers(module: LightningModule, logged: Logged, workers: int) -> None:
    """Log what the workers' `training_step`s logged: a number every worker logged as the mean over the workers (what
    `sync_dist=True` gives on `n` ranks); anything else (a Metric object, a value some workers log) as worker 0's."""
    for name, values in logged.items():
        if len(values) == workers and all(_is_number(v) for v, _ in values):
            mean = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(module.device) for v, _ in values]).mean()
            module.log(name, mean, **values[0][1])
        else:
            module.log(name, values[0][0], **values[0][1])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1)
