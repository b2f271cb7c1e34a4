"""`SimulatedDecentralizedStrategy`: `n` decentralized workers in one process, the same run as `n` processes.

Worker `i` is a copy of the LightningModule (worker 0 is the module itself) with its own optimizer,
gradients, BatchNorm statistics and torch random state; it sees the batches Lightning's
`DistributedSampler` gives rank `i` of `n`. The update rules are the objects of
[`lightning_decentral.rules`][lightning_decentral.rules], one per worker, over one
[`DenseMixer`][lightning_decentral.mixing.DenseMixer]. One optimizer step runs phase by phase:

```text
on_train_batch_start   every worker: rule.begin_step(plan)                  AWC posts x(k)
closure                every worker: training_step on its batch, backward   DecentLaM posts z per bucket
                       every rule's closure wrapper; every worker: clip; rule.gradients_ready()
                       every worker: optimizer.step()                       (waits, U)
                       every worker: rule.end_step(); then rule.finish_step()
```
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral import checkpoint as shards
from lightning_decentral.mixing import DenseMixer, ExchangeObserver
from lightning_decentral.options import TopologyName, check_options
from lightning_decentral.replicated import EvaluatesOnAverage
from lightning_decentral.replicas import AveragedModel, Replica, averaged_optimizer_state, state_tensors
from lightning_decentral.rules import RULES, RuleOptions, UpdateRule, rule_name
from lightning_decentral.schedule import GossipSchedule, StepPlan
from lightning_decentral.topology import Topology, resolve_topology

if TYPE_CHECKING:  # annotations only; a LightningCLI config is parsed against them
    import networkx
    import numpy as np


class PerWorker(tuple):
    """One item per simulated worker (a batch, an output), worker 0 first."""


class _Worker:
    """One simulated worker: its module, optimizer, flat replica, update rule and random state."""

    def __init__(self, module: Module, optimizer: Optimizer, replica: Replica, rule: UpdateRule) -> None:
        self.module, self.optimizer, self.replica, self.rule = module, optimizer, replica, rule
        self.rng = torch.get_rng_state()  # torch's generator states while another worker runs
        self.cuda_rng: Optional[Tensor] = None


class SimulatedDecentralizedStrategy(EvaluatesOnAverage, SingleDeviceStrategy):
    """`workers` decentralized workers in one process, on one CPU or GPU: the run `DecentralizedStrategy`
    makes on `workers` processes, replica for replica (docs/simulation.md).

    The update-rule arguments are [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy]'s.
    Use it with `devices=1`; the DataLoader's `batch_size` is the per-worker batch, as on processes.

    Args:
        workers: the number of simulated workers `n`.

    Example:
        ```python
        trainer = Trainer(strategy=SimulatedDecentralizedStrategy(workers=64, topology="ring"), devices=1)
        trainer = Trainer(strategy="dpsgd_sim", devices=1)  # 8 workers
        ```
    """

    strategy_name = "dpsgd_sim"

    def __init__(
        self,
        workers: int = 8,
        topology: Union[
            TopologyName, Topology, list[list[float]], list[list[list[float]]], np.ndarray, Tensor, networkx.Graph
        ] = "ring",
        combine: Literal["awc", "atc"] = "awc",
        momentum: Literal["local", "decentlam"] = "local",
        gossip_every: int = 1,
        gossip_steps: int = 1,
        gossip_buffers: bool = True,
        eval_on: Literal["average", "local"] = "average",
        bucket_cap_mb: float = 4.0,
        gossip_dtype: Optional[torch.dtype] = None,
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"`workers` must be a positive integer (the simulated workers), got {workers!r}.")
        dtype = check_options(topology, combine, momentum, gossip_every, gossip_steps, eval_on, bucket_cap_mb, gossip_dtype)
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.workers, self.combine, self.momentum, self.eval_on = workers, combine, momentum, eval_on
        self.gossip_every, self.gossip_steps, self.gossip_buffers = gossip_every, gossip_steps, gossip_buffers
        self.bucket_cap_mb, self.gossip_dtype = bucket_cap_mb, dtype
        self._devices: list[torch.device] = []
        self._schedule = GossipSchedule(resolve_topology(topology, workers), gossip_every, gossip_steps)
        self._mixer = DenseMixer(self._schedule.topology, dtype=dtype)
        self._workers: list[_Worker] = []
        self._plan: Optional[StepPlan] = None
        self._others_ready = False  # workers 1..n-1 clipped and ready at this step
        self._losses: list[Tensor] = []
        self._averaged = AveragedModel()
        self._eval_context = contextlib.ExitStack()
        self._resume_shards: list[dict[str, Any]] = []  # fit(ckpt_path=...): every worker's shard, until restored
        self._rng_restored = False

    # -- the devices Lightning hands over --------------------------------------------------------

    @property
    def parallel_devices(self) -> list[torch.device]:
        """The devices of the Trainer's `devices=`; exactly one."""
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
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

    # -- public surface, as DecentralizedStrategy's --------------------------------------------

    @property
    def topology(self) -> Topology:
        """The topology, bound to `workers`."""
        return self._schedule.topology

    def gossip_rounds(self, step: int) -> int:
        """Rounds of exchange at optimizer step `step` (0: a local step)."""
        return self._schedule.rounds(step)

    def observe(self, observer: ExchangeObserver) -> None:
        """Tell `observer` of every exchange of every worker from now on."""
        self._mixer.observers.append(observer)

    @property
    def num_workers(self) -> int:
        """`n`, the simulated workers."""
        return self.workers

    def measure_residuals(self) -> None:
        """From now on, every exchange of the parameters also measures its gossip residual."""
        self._mixer.measure_residual = True

    def gossip_residual(self, step: int) -> Optional[Tensor]:
        """`Σ_i ‖y_i − Σ_j w_ij(k) y_j‖²` over the workers' trainable parameters, for the first round of step
        `step` (see `DecentralizedStrategy.gossip_residual`, which gives one rank's term); `None` if a
        worker has none."""
        residuals = [worker.rule.residual(step) for worker in self._workers]
        if not residuals or any(r is None for r in residuals):
            return None
        return torch.stack(residuals).sum()

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `Σ_i ‖p_i − p̄‖²` over the workers and `‖p̄‖²`
        (float64; `DecentralizedStrategy.parameter_deviations` gives one rank's term of the sum)."""
        named = [[(n, p) for n, p in worker.module.named_parameters() if p.requires_grad] for worker in self._workers]
        out = []
        for column in zip(*named):
            stacked = torch.stack([p.detach().to(torch.promote_types(p.dtype, torch.float32)) for _, p in column])
            mean = stacked.mean(0)
            deviation = torch.linalg.vector_norm(stacked - mean, dtype=torch.float64).square()
            out.append((column[0][0], deviation, torch.linalg.vector_norm(mean, dtype=torch.float64).square()))
        return out

    def extra_gossip(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` for every worker's parameters and mixed buffers, now (between steps)."""
        if rounds > 0:
            pending = [self._mixer.worker(i).start(w.replica.mixed, step, rounds) for i, w in enumerate(self._workers)]
            for exchange in pending:
                exchange.wait()

    def gradient_sum(self) -> list[Tensor]:
        """`Σ_i g_i` for each trainable parameter of the LightningModule: the workers' current gradients."""
        columns = zip(*[[p for p in w.module.parameters() if p.requires_grad] for w in self._workers])
        return [torch.stack([_grad(p) for p in column]).sum(0) for column in columns]

    def random_states(self) -> list[tuple[Tensor, Optional[Tensor]]]:
        """Each worker's torch random state `(cpu, cuda or None)` now; worker 0's is the process's own."""
        cuda = self.root_device.type == "cuda"
        own = (torch.get_rng_state(), torch.cuda.get_rng_state(self.root_device) if cuda else None)
        return [own] + [(w.rng, w.cuda_rng) for w in self._workers[1:]]

    def worker_modules(self) -> list[Module]:
        """Each worker's module, worker 0 (the LightningModule itself) first; empty before fit."""
        return [worker.module for worker in self._workers]

    @contextlib.contextmanager
    def averaged_model(self) -> Iterator[None]:
        """Replace the LightningModule's state by `x̄`, the mean of every worker's, inside the block."""
        mean = self._mean_over_workers if len(self._workers) > 1 else None
        with self._averaged.swapped_in(self.lightning_module, mean):
            yield

    def _mean_over_workers(self, tensors: list[Tensor]) -> list[Tensor]:
        """For the LightningModule's floating tensors, their means over the workers' matching tensors."""
        index = {id(t): j for j, t in enumerate(_floating_state(self.lightning_module))}
        columns = [_floating_state(worker.module) for worker in self._workers]
        return [torch.stack([column[index[id(t)]].detach() for column in columns]).mean(0) for t in tensors]

    # -- set-up -----------------------------------------------------------------------------------

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
    def setup(self, trainer: Trainer) -> None:
        """Before each stage; before fit, also the workers: module copies, optimizers, replicas, rules."""
        super().setup(trainer)
        self._rng_restored = False
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("SimulatedDecentralizedStrategy needs automatic optimization; use DecentralizedStrategy.")
        if len(self.optimizers) != 1:
            raise ValueError(
                f"Decentralized training needs exactly one optimizer, but `configure_optimizers` returned "
                f"{len(self.optimizers)}. Put the parameters into one optimizer with several parameter groups."
            )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ValueError("The simulation does not run under a GradScaler (16-mixed): use precision='bf16-mixed' or '32-true'.")
        self._workers = [self._build_worker(0, module, self.optimizers[0])]
        for i in range(1, self.workers):
            copied = copy.deepcopy(module)  # a LightningModule leaves its Trainer out of copies: attach it
            copied.trainer = trainer
            self._workers.append(self._build_worker(i, copied, _optimizer_like(self.optimizers[0], module, copied)))

    def _build_worker(self, rank: int, module: Module, optimizer: Optimizer) -> _Worker:
        replica = Replica(module, self.gossip_buffers)
        trainer = self.lightning_module.trainer
        overlap = not trainer.gradient_clip_val and not any(
            is_overridden(hook, self.lightning_module)
            for hook in ("configure_gradient_clipping", "on_after_backward", "on_before_optimizer_step")
        )
        options = RuleOptions(
            bucket_bytes=int(self.bucket_cap_mb * 2**20),
            overlap_backward=overlap,
            warn=_warn_once(rank),
            before_wait=self._ready_other_workers if rank == 0 else (lambda: None),
        )
        rule = RULES[rule_name(self.momentum, self.combine)](replica, self._mixer.worker(rank), optimizer, options)
        return _Worker(module, optimizer, replica, rule)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader becomes one per worker, each with rank `i`'s `DistributedSampler`."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        return WorkerLoaders(dataloader, self.workers, self._as_worker)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Each worker's batch to the device, through the LightningModule's transfer hooks."""
        if isinstance(batch, PerWorker):
            return PerWorker(super(SimulatedDecentralizedStrategy, self).batch_to_device(b, device, dataloader_idx) for b in batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- one optimizer step, every worker ---------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        """Before the first epoch: every worker starts from the random state the run has now, as every rank
        does (each re-seeded from `seed_everything`'s seed at set-up, then doing the same work)."""
        super().on_train_start()
        if self._rng_restored:  # resumed from shards: each worker's own
            return
        cuda = self.root_device.type == "cuda"
        for worker in self._workers[1:]:
            worker.rng = torch.get_rng_state()
            worker.cuda_rng = torch.cuda.get_rng_state(self.root_device) if cuda else None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each training batch: every worker begins the optimizer step (AWC posts `x(k)`)."""
        super().on_train_batch_start(batch, batch_idx)
        self._begin_if_needed()

    @override
    def training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Each worker's `training_step` on its batch; what they log is logged once, as the mean over workers.

        Returns worker 0's output with the loss replaced by the mean loss over the workers.
        """
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
            for worker in self._workers[1:]:  # Lightning zeroes worker 0's gradients, as on every rank
                worker.optimizer.zero_grad()
        logged: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
        outputs = []
        for i, (worker, part) in enumerate(zip(self._workers, batch)):
            with self._as_worker(i), _collect_logs(worker.module, logged), self.precision_plugin.train_step_context():
                outputs.append(worker.module.training_step(part, *args, **kwargs))
        for name, values in logged.items():
            if len(values) == len(self._workers) and all(_is_number(v) for v, _ in values):
                mean = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.root_device) for v, _ in values]).mean()
                self.lightning_module.log(name, mean, **values[0][1])
            else:  # a Metric object, or logged by some workers only: worker 0's
                self.lightning_module.log(name, values[0][0], **values[0][1])
        self._losses = [_loss_of(output) for output in outputs]
        if any(loss is None for loss in self._losses):
            raise ValueError("A worker's training_step returned no loss: every simulated worker must step together.")
        mean_loss = torch.stack([loss.detach() for loss in self._losses]).mean()  # backward is per worker
        first = outputs[0]
        return {**first, "loss": mean_loss} if isinstance(first, dict) else mean_loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Each worker's backward of its own loss (scaled as Lightning scales the returned one)."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        for i, (worker, loss) in enumerate(zip(self._workers, self._losses)):
            worker.rule.before_backward()
            with self._as_worker(i):
                self.precision_plugin.backward(loss / accumulate, worker.module, worker.optimizer, *args, **kwargs)
        self._losses = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Around the backward of accumulated micro-batches (DecentLaM posts no bucket there)."""
        with contextlib.ExitStack() as stack:
            for worker in self._workers:
                stack.enter_context(worker.rule.no_backward_sync())
            yield

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """One step of every worker, phase by phase (see the module docstring).

        Worker 0 steps through Lightning's own path (closure, `on_before_optimizer_step`, clipping,
        precision); its closure runs every worker's forward and backward. The other workers are clipped and
        told their gradients are final before worker 0 waits for an exchange (DecentLaM) or steps, then step.
        """
        self._begin_if_needed()
        for worker in self._workers:
            closure = worker.rule.wrap_closure(closure)
        results: list[Any] = []
        self._others_ready = False

        def every_worker(closure: Callable[[], Any] = closure) -> Any:
            results.append(closure())  # every worker's forward and backward, then every rule's wrapper
            return results[0]

        try:
            output = super().optimizer_step(optimizer, every_worker, model, **kwargs)
            self._ready_other_workers()
            for i, worker in enumerate(self._workers[1:], start=1):
                with self._as_worker(i):
                    worker.optimizer.step(closure=lambda: results[0])
        finally:
            self._plan = None
        for worker in self._workers:
            worker.rule.end_step()
        for worker in self._workers:
            worker.rule.finish_step()
        return output

    def _ready_other_workers(self) -> None:
        """Once per step, after worker 0's `on_before_optimizer_step` and clipping: clip workers 1..n-1 (their
        LightningModule hook) and tell their rules the gradients are final (DecentLaM posts what is left)."""
        if self._others_ready:
            return
        self._others_ready = True
        trainer = self.lightning_module.trainer
        for worker in self._workers[1:]:
            worker.module.configure_gradient_clipping(worker.optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            worker.rule.gradients_ready()

    def _begin_if_needed(self) -> None:
        """Begin the current optimizer step on every worker, once. Lightning's schedulers step worker 0's
        optimizer: every worker takes its hyperparameters (learning rate, momentum...) first."""
        step = self.lightning_module.trainer.global_step
        if self._plan is None or self._plan.step != step:
            self._plan = self._schedule.plan(step)
            leader = self._workers[0].optimizer.param_groups
            for worker in self._workers:
                for group, lead in zip(worker.optimizer.param_groups, leader):
                    group.update({k: v for k, v in lead.items() if k != "params"})
                worker.rule.begin_step(self._plan)

    @contextlib.contextmanager
    def _as_worker(self, rank: int) -> Iterator[None]:
        """Worker `rank`'s torch random state inside the block (worker 0's is the process's own)."""
        if rank == 0 or not self._workers:
            yield
            return
        worker, cuda = self._workers[rank], self.root_device.type == "cuda"
        own = torch.get_rng_state(), torch.cuda.get_rng_state(self.root_device) if cuda else None
        torch.set_rng_state(worker.rng)
        if cuda:
            torch.cuda.set_rng_state(worker.cuda_rng, self.root_device)
        try:
            yield
        finally:
            worker.rng = torch.get_rng_state()
            torch.set_rng_state(own[0])
            if cuda:
                worker.cuda_rng = torch.cuda.get_rng_state(self.root_device)
                torch.cuda.set_rng_state(own[1], self.root_device)

    @override
    def on_train_end(self) -> None:
        """After the last training batch: finish anything still in flight."""
        for worker in self._workers:
            worker.rule.drain()
        self._plan = None
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """After the stage: release the rules' hooks."""
        for worker in self._workers:
            worker.rule.teardown()
        super().teardown()

    # -- checkpoints: x̄ and one shard per worker, as DecentralizedStrategy writes them ------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """`x̄`'s state dict: the checkpoint loads into a plain module."""
        with self.averaged_model():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state averaged over the workers (a resume that cannot use the shards starts there)."""
        states = [worker.optimizer.state_dict() for worker in self._workers] or [super().optimizer_state(optimizer)]
        return averaged_optimizer_state(states, lambda tensors: _means_across(states, tensors))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every worker's shard as rank `i` of `n` writes it, then the checkpoint file (`x̄`), then the
        workers' shards of earlier saves to this path go: the layout `DecentralizedStrategy` reads."""
        if not self._workers:  # not fitting: a plain checkpoint
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_id = secrets.randbits(62)
        checkpoint[shards.META_KEY] = {"save_id": save_id, "world_size": self.workers}
        paths = [shards.shard_path(filepath, i, self.workers, save_id) for i in range(self.workers)]
        try:
            for i, (worker, path) in enumerate(zip(self._workers, paths)):
                shards.write_shard(self._shard(i, save_id, weights_only="optimizer_states" not in checkpoint), path)
            super().save_checkpoint(checkpoint, filepath, storage_options)
        except BaseException:
            for path in paths:
                shards.discard(path)
            raise
        for i, path in enumerate(paths):
            shards.remove_shards(filepath, i, keep=path)

    def _shard(self, rank: int, save_id: int, weights_only: bool) -> dict[str, Any]:
        worker = self._workers[rank]
        rng = shards.rng_state()  # numpy's and Python's generators are the process's, shared by the workers
        if rank > 0:
            rng = {**rng, "torch": worker.rng, **({"cuda": [worker.cuda_rng]} if worker.cuda_rng is not None else {})}
        return shards.make_shard(
            save_id,
            rank,
            self.workers,
            state_dict={k: v.detach() for k, v in self._averaged.own_state_dict(worker.module).items()},
            step=self.lightning_module.trainer.global_step,
            optimizers=None if weights_only else [worker.optimizer],
            precision=None if weights_only else self.precision_plugin.state_dict(),
            rng=rng,
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """The checkpoint file and every worker's shards of it."""
        super().remove_checkpoint(filepath)
        for i in range(self.workers):
            shards.remove_shards(filepath, i)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint file and, when fitting, every worker's shard: if all are there (a save of `workers`
        ranks, by either strategy), worker `i` continues exactly from shard `i`; else every worker starts from
        `x̄` and the averaged optimizer state, with one warning saying why."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)
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
        return shards.with_shard(checkpoint, self._resume_shards[0], precision_key=type(self.precision_plugin).__qualname__)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning restores worker 0's optimizer; then every other worker's replica, optimizer and random
        state from its shard (or the averaged optimizer state), and worker 0's step and random state."""
        super().load_optimizer_state_dict(checkpoint)
        resumed, self._resume_shards = self._resume_shards, []
        for i, worker in enumerate(self._workers[1:], start=1):
            if resumed:
                worker.module.load_state_dict(resumed[i]["state_dict"])
                worker.optimizer.load_state_dict(resumed[i]["optimizer_states"][0])
            else:
                worker.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        if resumed:
            shards.resume_rank_state(resumed[0], self.lightning_module.trainer.global_step)
            for worker, shard in zip(self._workers[1:], resumed[1:]):
                worker.rng = shard["rng"]["torch"]
                worker.cuda_rng = shard["rng"]["cuda"][0] if "cuda" in shard["rng"] else None
        self._rng_restored = bool(resumed)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A run stopped with an error: put worker 0's own state back."""
        self._eval_context.close()
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `"dpsgd_sim"` and `"decentlam_sim"` (8 workers)."""
        for name, momentum in (("dpsgd_sim", "local"), ("decentlam_sim", "decentlam")):
            strategy_registry.register(
                name, cls, description=f"Decentralized training simulated in one process, momentum={momentum!r}",
                override=True, momentum=momentum,
            )


class WorkerLoaders:
    """A training DataLoader as `n` workers see it: worker `i` iterates rank `i`'s `DistributedSampler`
    (Lightning's own, with its shuffling seed, padding and `drop_last`); each item is a
    [`PerWorker`][lightning_decentral.simulation.PerWorker] of batches. `as_worker(i)` is the context in
    which worker `i` iterates (its random state)."""

    def __init__(self, dataloader: torch.utils.data.DataLoader, workers: int, as_worker: Callable[[int], Any]) -> None:
        shuffle = _is_dataloader_shuffled(dataloader)
        self.loaders = [
            _update_dataloader(
                dataloader,
                _get_distributed_sampler(dataloader, shuffle, overfit_batches=0, num_replicas=workers, rank=rank),
                mode=RunningStage.TRAINING,
            )
            for rank in range(workers)
        ]
        self.sampler = _Samplers([loader.sampler for loader in self.loaders])
        self._as_worker = as_worker

    def __len__(self) -> int:
        return len(self.loaders[0])

    def __iter__(self) -> Iterator[PerWorker]:
        iterators = []
        for rank, loader in enumerate(self.loaders):
            with self._as_worker(rank):
                iterators.append(iter(loader))
        while True:
            batches = []
            for rank, iterator in enumerate(iterators):
                with self._as_worker(rank):
                    batch = next(iterator, _END)
                if batch is _END:
                    return
                batches.append(batch)
            yield PerWorker(batches)


class _Samplers:
    """Lightning calls `sampler.set_epoch(epoch)` every epoch: for every worker's sampler."""

    def __init__(self, samplers: list[Any]) -> None:
        self.samplers = samplers

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)


_END = object()


def _means_across(states: list[dict[str, Any]], tensors: list[Tensor]) -> list[Tensor]:
    """For tensors of `states[0]["state"]`, their means over the same entries of every state."""
    where = {id(v): (key, name) for key, values in states[0]["state"].items() for name, v in values.items()}
    return [torch.stack([s["state"][where[id(t)][0]][where[id(t)][1]] for s in states]).mean(0) for t in tensors]


def _grad(param: Tensor) -> Tensor:
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


def _loss_of(output: Any) -> Optional[Tensor]:
    return output["loss"] if isinstance(output, dict) else output


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1)


def _floating_state(module: Module) -> list[Tensor]:
    return [t for t in state_tensors(module) if t.is_floating_point()]


@contextlib.contextmanager
def _collect_logs(module: Module, logged: dict[str, list[tuple[Any, dict[str, Any]]]]) -> Iterator[None]:
    """Inside: `module.log(name, value, **kwargs)` records into `logged` instead of logging."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logged.setdefault(name, []).append((value, kwargs))

    module.log = record  # type: ignore[method-assign]  # an instance attribute shadows the method
    try:
        yield
    finally:
        del module.log


def _optimizer_like(optimizer: Optimizer, module: Module, copied: Module) -> Optimizer:
    """An optimizer of `optimizer`'s class and param groups over `copied`'s parameters (a fresh state)."""
    mapping = {id(p): q for p, q in zip(module.parameters(), copied.parameters())}
    groups = [{**group, "params": [mapping[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except Exception as error:
        raise ValueError(
            f"The simulation gives every worker its own {type(optimizer).__name__}, built as "
            f"{type(optimizer).__name__}(param_groups, **defaults), which failed: {error}. Use an optimizer that "
            "can be built that way (every torch.optim optimizer can), or DecentralizedStrategy on processes."
        ) from error


def _warn_once(rank: int) -> Callable[[str], None]:
    return rank_zero_warn if rank == 0 else (lambda message: None)
