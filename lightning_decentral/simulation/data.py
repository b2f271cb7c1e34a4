"""The data of `n` simulated workers: rank `i`'s share of a training DataLoader for worker `i`, one worker at a
time ([`PerWorker`][lightning_decentral.simulation.data.PerWorker] batches) or all at once
([`StackedBatch`][lightning_decentral.simulation.data.StackedBatch])."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_decentral._compat.lightning import distributed_sampler, update_dataloader


class PerWorker(tuple):
    """One item per simulated worker (a batch, an output), worker 0 first; `origins[i]` is the rank item `i` belongs
    to in the first numbering of the workers (they differ once workers are lost).

    Examples:
        >>> batch = PerWorker(["a", "b", "c"])
        >>> batch.origins, batch.of([0, 2])
        ((0, 1, 2), ('a', 'c'))
    """

    origins: tuple[int, ...]

    def __new__(cls, items: Any, origins: Sequence[int] | None = None) -> PerWorker:
        made = super().__new__(cls, items)
        made.origins = tuple(range(len(made))) if origins is None else tuple(origins)
        return made

    def of(self, origins: Sequence[int]) -> PerWorker:
        """The items of the workers `origins` (first numbering), in that order."""
        return PerWorker([self[self.origins.index(o)] for o in origins], origins)


class StackedBatch:
    """Every worker's batch as one collated batch: along the first dimension of each tensor, worker 0's `b`
    samples, then worker 1's, and so on (the vectorized simulation's batches).

    Examples:
        >>> batch = StackedBatch((torch.arange(6.0), torch.zeros(6, 2)), workers=3)
        >>> batch.parts()[1][0]
        tensor([2., 3.])
        >>> batch.stacked()[1].shape
        torch.Size([3, 2, 2])
    """

    def __init__(self, batch: Any, workers: int) -> None:
        self.batch, self.workers = batch, workers

    def stacked(self) -> Any:
        """The batch with each tensor viewed as `[n, b, ...]` (no copy)."""
        return apply_to_collection(self.batch, Tensor, lambda t: t.view(self.workers, -1, *t.shape[1:]))

    def parts(self) -> PerWorker:
        """Each worker's batch."""
        stacked = self.stacked()
        return PerWorker(apply_to_collection(stacked, Tensor, lambda t, i=i: t[i]) for i in range(self.workers))


class WorkerLoaders:
    """A training DataLoader as `n` workers see it, as the Trainer hands it to `n` processes: worker `i` iterates rank
    `i`'s `DistributedSampler` (Lightning's own, shuffled whatever the DataLoader's `shuffle` says, with its seed,
    padding and `drop_last`), or `sampler.for_rank(i, n)` for a sampler that has it
    ([`DirichletSampler`][lightning_decentral.data.DirichletSampler]); with `distributed=False` (the Trainer's
    `use_distributed_sampler=False`) every worker iterates the DataLoader as it is, its sampler drawing from the
    worker's random state.

    Each item is a [`PerWorker`][lightning_decentral.simulation.data.PerWorker] of batches of the workers
    `origins()` names (all of them until some are lost; a lost worker's shard is not visited), the batch of the
    worker at position `p` fetched inside `as_worker(p)` (its random state); or, `together=True`, a
    [`StackedBatch`][lightning_decentral.simulation.data.StackedBatch]: one fetch of every worker's samples
    of the step, collated at once (the same batches for a `collate_fn` that treats samples independently,
    as the default one does; the dataset draws from the process's random state).
    """

    def __init__(
        self,
        dataloader: torch.utils.data.DataLoader,
        workers: int,
        as_worker: Callable[[int], Any],
        together: bool = False,
        origins: Callable[[], Sequence[int]] | None = None,
        distributed: bool = True,
        overfit_batches: int | float = 0,
    ) -> None:
        self.dataloader, self.samplers = dataloader, rank_samplers(dataloader, workers, distributed, overfit_batches)
        self.sampler = _Samplers(self.samplers)
        self.workers = workers
        self._origins = origins or (lambda: range(workers))
        self.follow(as_worker, together)

    def follow(self, as_worker: Callable[[int], Any], together: bool) -> None:
        """From now on, iterate for workers reached by `as_worker`, together (stacked) or not: the workers a
        DataLoader loaded before they existed (during `configure_optimizers`) were decided on afterwards."""
        dataloader, samplers = self.dataloader, self.samplers
        self.together, self._as_worker = together, as_worker
        if together:
            self.loaders = [_together(dataloader, samplers)]
        elif samplers[0] is dataloader.sampler:  # every worker iterates the DataLoader as it is
            self.loaders = [dataloader] * self.workers
        else:
            self.loaders = [update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING) for sampler in samplers]

    def __len__(self) -> int:
        return len(self.loaders[0])

    def __iter__(self) -> Iterator[Any]:
        if self.together:
            for batch in self.loaders[0]:
                yield StackedBatch(batch, self.workers)
            return
        iterators = {}
        for position, origin in enumerate(self._origins()):
            with self._as_worker(position):
                iterators[origin] = iter(self.loaders[origin])
        while True:
            batches, origins = [], list(self._origins())
            for position, origin in enumerate(origins):
                with self._as_worker(position):
                    batch = next(iterators[origin], _END)
                if batch is _END:
                    return
                batches.append(batch)
            yield PerWorker(batches, origins)


def first_batch_together(
    dataloader: torch.utils.data.DataLoader, workers: int, distributed: bool = True, overfit_batches: int | float = 0
) -> StackedBatch:
    """Every worker's first batch (worker `i`'s from rank `i`'s sampler), loaded in this process and collated at once:
    what the first stacked step would see, without starting the DataLoader's worker processes."""
    samplers = rank_samplers(dataloader, workers, distributed, overfit_batches)
    indices = next(iter(_StepBatches(samplers, dataloader.batch_size, dataloader.drop_last)))
    return StackedBatch(dataloader.collate_fn([dataloader.dataset[i] for i in indices]), workers)


def _together(dataloader: torch.utils.data.DataLoader, samplers: list[Any]) -> torch.utils.data.DataLoader:
    """A DataLoader over `dataloader`'s dataset whose batch at step `t` is every worker's batch `t`, in worker order."""
    if dataloader.batch_size is None:
        raise ValueError(
            "SimulatedDecentralizedStrategy(vectorize=True) fetches every worker's batch_size samples at once, but "
            "the training DataLoader has no batch_size (a batch_sampler?). Give it a batch_size, or use "
            "vectorize=False."
        )
    return torch.utils.data.DataLoader(
        dataloader.dataset,
        batch_sampler=_StepBatches(samplers, dataloader.batch_size, dataloader.drop_last),
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
    )


class _StepBatches:
    """Batch sampler: at each step, worker 0's next `batch_size` indices from its sampler, then worker 1's, ..."""

    def __init__(self, samplers: list[Any], batch_size: int, drop_last: bool) -> None:
        self.samplers, self.batch_size, self.drop_last = samplers, batch_size, drop_last

    def __len__(self) -> int:
        per_worker = len(self.samplers[0])
        return per_worker // self.batch_size if self.drop_last else -(-per_worker // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        drawn: dict[int, list[int]] = {}  # one sampler for every worker (not distributed): one draw, as on ranks alike
        for sampler in self.samplers:
            if id(sampler) not in drawn:
                drawn[id(sampler)] = list(sampler)
        orders = [drawn[id(sampler)] for sampler in self.samplers]
        for step in range(len(self)):
            window = slice(step * self.batch_size, (step + 1) * self.batch_size)
            yield [index for order in orders for index in order[window]]


def rank_samplers(
    dataloader: torch.utils.data.DataLoader, workers: int, distributed: bool = True, overfit_batches: int | float = 0
) -> list[Any]:
    """The sampler the Trainer gives each of `workers` ranks for the training `dataloader`: `sampler.for_rank(i, n)`
    if the DataLoader's sampler has one (a [`DirichletSampler`][lightning_decentral.data.DirichletSampler]); else, with
    `distributed` (`use_distributed_sampler=True`), Lightning's `DistributedSampler` for rank `i`, which shuffles a
    training DataLoader whatever its own `shuffle` says (but with `overfit_batches`); else the DataLoader's own
    sampler, for every rank.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> samplers = rank_samplers(DataLoader(range(8), shuffle=False), workers=2)
        >>> sorted([*samplers[0], *samplers[1]]) == list(range(8)), list(samplers[0]) == [0, 2, 4, 6]  # shuffled
        (True, False)
        >>> loader = DataLoader(range(8))
        >>> rank_samplers(loader, workers=2, distributed=False) == [loader.sampler] * 2
        True
    """
    if hasattr(dataloader.sampler, "for_rank"):
        return [dataloader.sampler.for_rank(rank, workers) for rank in range(workers)]
    if not distributed:
        return [dataloader.sampler] * workers
    return [
        distributed_sampler(dataloader, True, overfit_batches=overfit_batches, num_replicas=workers, rank=rank)
        for rank in range(workers)
    ]


class _Samplers:
    """Lightning calls `sampler.set_epoch(epoch)` every epoch: for every worker's sampler."""

    def __init__(self, samplers: list[Any]) -> None:
        self.samplers = samplers

    def set_epoch(self, epoch: int) -> None:
        for sampler in {id(s): s for s in self.samplers}.values():
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)


_END = object()
