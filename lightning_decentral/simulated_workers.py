"""The `n` workers of a simulation: their modules, optimizers, replicas, update rules and random states, what
the monitors and checkpoints need of them, and their data (rank `i`'s share of a DataLoader).

[`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy] holds one
[`SimulatedWorkers`][lightning_decentral.simulated_workers.SimulatedWorkers] and drives it from Lightning's
hooks; worker 0's module is the LightningModule itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import checkpoint as shards
from lightning_decentral.mixing import DenseMixer
from lightning_decentral.replicas import Replica, averaged_optimizer_state, state_tensors
from lightning_decentral.rules import RULES, RuleOptions, UpdateRule
from lightning_decentral.schedule import StepPlan


class PerWorker(tuple):
    """One item per simulated worker (a batch, an output), worker 0 first."""


class SimulatedWorker:
    """One simulated worker: its module, optimizer, flat replica, update rule and torch random state."""

    def __init__(self, module: Module, optimizer: Optimizer, replica: Replica, rule: UpdateRule) -> None:
        self.module, self.optimizer, self.replica, self.rule = module, optimizer, replica, rule
        self.rng = torch.get_rng_state()  # the generator states it continues from when it runs next
        self.cuda_rng: Optional[Tensor] = None


class SimulatedWorkers:
    """`n` workers exchanging through one [`DenseMixer`][lightning_decentral.mixing.DenseMixer].

    Args:
        mixer: the mixer of all workers (bound to `n`).
        device: the device the workers' tensors live on (its generator is simulated per worker too).
    """

    def __init__(self, mixer: DenseMixer, device: torch.device) -> None:
        self.mixer, self.device = mixer, device
        self.workers: list[SimulatedWorker] = []

    def add(self, module: Module, optimizer: Optimizer, rule: str, mix_buffers: bool, options: RuleOptions) -> None:
        """Worker `len(self.workers)`: `module` packed into a replica, and its update rule `RULES[rule]`."""
        replica = Replica(module, mix_buffers)
        rank = len(self.workers)
        self.workers.append(SimulatedWorker(module, optimizer, replica, RULES[rule](replica, self.mixer.worker(rank), optimizer, options)))

    def begin_step(self, plan: StepPlan) -> None:
        """Every worker begins step `plan.step`, with worker 0's optimizer hyperparameters (its scheduler's)."""
        leader = self.workers[0].optimizer.param_groups
        for worker in self.workers:
            for group, lead in zip(worker.optimizer.param_groups, leader):
                group.update({k: v for k, v in lead.items() if k != "params"})
            worker.rule.begin_step(plan)

    @contextlib.contextmanager
    def as_worker(self, rank: int) -> Iterator[None]:
        """Worker `rank`'s torch random state inside the block (worker 0's is the process's own)."""
        if rank == 0 or not self.workers:
            yield
            return
        worker, cuda = self.workers[rank], self.device.type == "cuda"
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
        """Every worker continues from the process's random state now (as ranks seeded alike do)."""
        cuda = self.device.type == "cuda"
        for worker in self.workers[1:]:
            worker.rng = torch.get_rng_state()
            worker.cuda_rng = torch.cuda.get_rng_state(self.device) if cuda else None

    def random_states(self) -> list[tuple[Tensor, Optional[Tensor]]]:
        """Each worker's torch random state `(cpu, cuda or None)` now."""
        cuda = self.device.type == "cuda"
        own = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        return [own] + [(w.rng, w.cuda_rng) for w in self.workers[1:]]

    # -- what the monitors read ------------------------------------------------------------------

    def gossip_residual(self, step: int) -> Optional[Tensor]:
        """`Σ_i ‖y_i − Σ_j w_ij(k) y_j‖²` of step `step`'s first round; `None` if a worker has none."""
        residuals = [worker.rule.residual(step) for worker in self.workers]
        if not residuals or any(r is None for r in residuals):
            return None
        return torch.stack(residuals).sum()

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `Σ_i ‖p_i − p̄‖²` and `‖p̄‖²` (float64)."""
        named = [[(n, p) for n, p in worker.module.named_parameters() if p.requires_grad] for worker in self.workers]
        out = []
        for column in zip(*named):
            stacked = torch.stack([p.detach().to(torch.promote_types(p.dtype, torch.float32)) for _, p in column])
            mean = stacked.mean(0)
            deviation = torch.linalg.vector_norm(stacked - mean, dtype=torch.float64).square()
            out.append((column[0][0], deviation, torch.linalg.vector_norm(mean, dtype=torch.float64).square()))
        return out

    def extra_gossip(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` for every worker's parameters and mixed buffers, now."""
        if rounds > 0:
            pending = [self.mixer.worker(i).start(w.replica.mixed, step, rounds) for i, w in enumerate(self.workers)]
            for exchange in pending:
                exchange.wait()

    def gradient_sum(self) -> list[Tensor]:
        """`Σ_i g_i` for each trainable parameter: the workers' current gradients."""
        columns = zip(*[[p for p in w.module.parameters() if p.requires_grad] for w in self.workers])
        return [torch.stack([_grad(p) for p in column]).sum(0) for column in columns]

    def mean(self, tensors: list[Tensor]) -> list[Tensor]:
        """For floating tensors of worker 0's module, their means over the workers' matching tensors."""
        index = {id(t): j for j, t in enumerate(_floating_state(self.workers[0].module))}
        columns = [_floating_state(worker.module) for worker in self.workers]
        return [torch.stack([column[index[id(t)]].detach() for column in columns]).mean(0) for t in tensors]

    # -- checkpoints -----------------------------------------------------------------------------

    def optimizer_state(self) -> dict[str, Any]:
        """Worker 0's optimizer `state_dict` with every floating state tensor averaged over the workers."""
        states = [worker.optimizer.state_dict() for worker in self.workers]
        return averaged_optimizer_state(states, lambda tensors: _means_across(states, tensors))

    def shard(self, rank: int, save_id: int, state_dict: dict[str, Tensor], step: int, precision: Optional[dict]) -> dict[str, Any]:
        """Worker `rank`'s shard, as rank `rank` of `n` writes it (`precision=None`: a weights-only save)."""
        worker = self.workers[rank]
        rng = shards.rng_state()  # numpy's and Python's generators are the process's, shared by the workers
        if rank > 0:
            rng = {**rng, "torch": worker.rng, **({"cuda": [worker.cuda_rng]} if worker.cuda_rng is not None else {})}
        return shards.make_shard(
            save_id,
            rank,
            len(self.workers),
            state_dict=state_dict,
            step=step,
            optimizers=None if precision is None else [worker.optimizer],
            precision=precision,
            rng=rng,
        )

    def restore(self, resumed: list[dict[str, Any]], averaged_optimizer: dict[str, Any]) -> None:
        """Workers 1..n-1 from their shards (replica, optimizer, random state) if `resumed`, else from the
        averaged optimizer state (worker 0 is restored by Lightning)."""
        for i, worker in enumerate(self.workers[1:], start=1):
            if resumed:
                worker.module.load_state_dict(resumed[i]["state_dict"])
                worker.optimizer.load_state_dict(resumed[i]["optimizer_states"][0])
                worker.rng = resumed[i]["rng"]["torch"]
                worker.cuda_rng = resumed[i]["rng"]["cuda"][0] if "cuda" in resumed[i]["rng"] else None
            else:
                worker.optimizer.load_state_dict(averaged_optimizer)


def optimizer_like(optimizer: Optimizer, module: Module, copied: Module) -> Optimizer:
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


def _means_across(states: list[dict[str, Any]], tensors: list[Tensor]) -> list[Tensor]:
    """For tensors of `states[0]["state"]`, their means over the same entries of every state."""
    where = {id(v): (key, name) for key, values in states[0]["state"].items() for name, v in values.items()}
    return [torch.stack([s["state"][where[id(t)][0]][where[id(t)][1]] for s in states]).mean(0) for t in tensors]


def _grad(param: Tensor) -> Tensor:
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


def _floating_state(module: Module) -> list[Tensor]:
    return [t for t in state_tensors(module) if t.is_floating_point()]


class WorkerLoaders:
    """A training DataLoader as `n` workers see it: worker `i` iterates rank `i`'s `DistributedSampler`
    (Lightning's own, with its shuffling seed, padding and `drop_last`), or `sampler.for_rank(i, n)` for a
    sampler that has it ([`DirichletSampler`][lightning_decentral.data.DirichletSampler]); each item is a
    [`PerWorker`][lightning_decentral.simulated_workers.PerWorker] of batches. `as_worker(i)` is the context in
    which worker `i` iterates (its random state)."""

    def __init__(self, dataloader: torch.utils.data.DataLoader, workers: int, as_worker: Callable[[int], Any]) -> None:
        shuffle = _is_dataloader_shuffled(dataloader)
        self.loaders = [
            _update_dataloader(dataloader, _rank_sampler(dataloader, shuffle, workers, rank), mode=RunningStage.TRAINING)
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


def _rank_sampler(dataloader: torch.utils.data.DataLoader, shuffle: bool, workers: int, rank: int) -> Any:
    """Rank `rank`'s sampler: `sampler.for_rank(rank, workers)` if the DataLoader's sampler has one (a
    [`DirichletSampler`][lightning_decentral.data.DirichletSampler]), else Lightning's `DistributedSampler`."""
    if hasattr(dataloader.sampler, "for_rank"):
        return dataloader.sampler.for_rank(rank, workers)
    return _get_distributed_sampler(dataloader, shuffle, overfit_batches=0, num_replicas=workers, rank=rank)


class _Samplers:
    """Lightning calls `sampler.set_epoch(epoch)` every epoch: for every worker's sampler."""

    def __init__(self, samplers: list[Any]) -> None:
        self.samplers = samplers

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)


_END = object()
