"""Heterogeneous data: each worker trains on its own label-skewed shard.

The convention of the decentralized and federated literature (Hsu et al., 2019): for every class
`c`, the indices of class `c` are split among the `n` workers in proportions
`p_c ~ Dirichlet(α·1_n)`. A small `α` gives each worker a few dominant classes; `α → ∞` is the IID
split. [`DirichletSampler`][lightning_decentral.data.DirichletSampler] is rank `i`'s share, on `n`
processes and for simulated worker `i` alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence, Sized
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

_ATTEMPTS = 100  # redraws of the proportions until no shard is empty


def dirichlet_shards(
    labels: Sequence[int] | np.ndarray | torch.Tensor, num_replicas: int, alpha: float | None, seed: int = 0
) -> list[np.ndarray]:
    """The `num_replicas` shards (sorted dataset indices) of a Dirichlet(`alpha`) label-skewed split.

    For each class in increasing order, its indices are shuffled and cut among the workers in the
    proportions `p ~ Dirichlet(alpha·1)` (cut points rounded to the nearest sample), all drawn from one
    `numpy.random.default_rng(seed)`. The draw is repeated (the generator continuing) while a shard is
    empty, at most 100 times. `alpha=None` or `inf`: the IID split, the shuffled indices dealt round-robin.
    The shards are disjoint and cover the dataset.

    Raises:
        ValueError: if `alpha` is not positive, or if every draw left a worker without data.

    Examples:
        >>> labels = [0, 0, 0, 0, 1, 1, 1, 1]
        >>> [len(s) for s in dirichlet_shards(labels, 3, alpha=None, seed=0)]  # IID: dealt round-robin
        [3, 3, 2]
        >>> shards = dirichlet_shards(labels, 2, alpha=0.1, seed=0)
        >>> sorted(i for s in shards for i in s.tolist()) == list(range(8))
        True
    """
    alpha = _check_alpha(alpha)
    labels = _as_array(labels)
    rng = np.random.default_rng(seed)
    if math.isinf(alpha):
        order = rng.permutation(len(labels))
        return [np.sort(order[rank::num_replicas]) for rank in range(num_replicas)]
    members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_replicas)]
        for indices in members:
            indices = rng.permutation(indices)
            proportions = rng.dirichlet(np.full(num_replicas, alpha))
            cuts = np.round(np.cumsum(proportions)[:-1] * len(indices)).astype(int)
            for rank, part in enumerate(np.split(indices, cuts)):
                parts[rank].append(part)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) > 0:
            return shards
    raise ValueError(
        f"Dirichlet(alpha={alpha}) left a worker without any sample in {_ATTEMPTS} draws of {num_replicas} shards "
        f"of {len(labels)} samples: raise `alpha`, or use fewer workers."
    )


class DirichletSampler(DistributedSampler):
    """Rank `rank`'s Dirichlet(`alpha`) label-skewed shard of `dataset`
    ([`dirichlet_shards`][lightning_decentral.data.dirichlet_shards]), `samples_per_worker` indices per epoch.

    The shards have different sizes, but every rank must take the same number of steps (a rank that ran
    out of batches would leave the others waiting in a collective). So every epoch yields
    `samples_per_worker = len(dataset) // num_replicas` indices on every rank: rank `i`'s shard, shuffled
    with the seed `seed + epoch` (`shuffle=True`; else in index order), cycled when it is shorter and cut
    when it is longer. A shard that is larger than that loses a different part of itself each epoch.

    A subclass of `DistributedSampler`, so a Trainer with `use_distributed_sampler=True` keeps it;
    `set_epoch` reshuffles. `num_replicas` and `rank` default to `torch.distributed`'s world size and rank
    (1 and 0 without a process group: build it in `train_dataloader()`, which runs once the processes have
    joined; iterating a sampler built before then raises an error naming this fix). In a
    [`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy], simulated worker `i` of `n`
    iterates [`for_rank(i, n)`][lightning_decentral.data.DirichletSampler.for_rank], the shard rank `i` of `n` processes
    gets.

    Args:
        dataset: the dataset to sample from.
        labels: the class of every sample of `dataset`, in order (e.g. `dataset.tensors[1]`).
        alpha: the Dirichlet concentration; `None` or `float("inf")`: the IID split.
        num_replicas: `n`, the workers.
        rank: this worker's rank.
        shuffle: reshuffle the shard every epoch.
        seed: seeds the partition and the shuffling; the same on every rank.

    Examples:
        >>> labels = torch.tensor([0] * 50 + [1] * 50)
        >>> sampler = DirichletSampler(range(100), labels, alpha=0.05, num_replicas=4, rank=1, seed=3)
        >>> len(sampler), len(list(sampler)), sampler.samples_per_worker
        (25, 25, 25)
        >>> set(sampler) <= set(sampler.shard.tolist())
        True
    """

    def __init__(
        self,
        dataset: Dataset | Sequence[Any],
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        alpha: float | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self._from_group = num_replicas is None and rank is None  # resolved from torch.distributed: checked at use
        num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if grouped else 1)
        rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
        samples = len(cast(Sized, dataset))  # DistributedSampler needs a dataset with a length, as this one does
        super().__init__(cast(Dataset, dataset), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.labels = _as_array(labels)
        if len(self.labels) != samples:
            raise ValueError(
                f"`labels` must give the class of each of the {samples} samples, got {len(self.labels)} labels."
            )
        self.alpha = _check_alpha(alpha)
        self.num_samples = len(self.labels) // num_replicas
        self.total_size = self.num_samples * num_replicas
        if self.num_samples == 0:
            raise ValueError(
                f"{len(self.labels)} samples cannot give each of {num_replicas} workers one: use fewer workers."
            )
        self.shard = dirichlet_shards(self.labels, num_replicas, self.alpha, seed)[rank]
        """This rank's shard: the sorted indices of its samples (before the common length is applied)."""

    @property
    def samples_per_worker(self) -> int:
        """The indices every rank takes per epoch: `len(dataset) // num_replicas`."""
        return self.num_samples

    def for_rank(self, rank: int, num_replicas: int) -> DirichletSampler:
        """The same sampler (dataset, labels, `alpha`, seed, shuffling, epoch) for rank `rank` of `num_replicas`."""
        sampler = DirichletSampler(self.dataset, self.labels, self.alpha, num_replicas, rank, self.shuffle, self.seed)
        sampler.set_epoch(self.epoch)
        return sampler

    def __iter__(self) -> Iterator[int]:
        self._check_group()
        shard = self.shard
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            shard = shard[torch.randperm(len(shard), generator=generator).numpy()]
        return iter(np.resize(shard, self.num_samples).tolist())  # cycled, or cut, to the common length

    def __len__(self) -> int:
        self._check_group()
        return self.num_samples

    def _check_group(self) -> None:
        """A sampler that took its rank from `torch.distributed` before the processes joined sees one worker."""
        joined = self._from_group and dist.is_available() and dist.is_initialized()
        if joined and (dist.get_world_size(), dist.get_rank()) != (self.num_replicas, self.rank):
            raise ValueError(
                f"This DirichletSampler was built as rank {self.rank} of {self.num_replicas} before the process "
                f"group of {dist.get_world_size()} ranks existed: build it in `train_dataloader()` (the "
                "LightningModule's or the LightningDataModule's), or pass `num_replicas` and `rank`."
            )


def _check_alpha(alpha: Any) -> float:
    """`alpha` as a float: a positive real number of any kind (Python's, a numpy scalar, a one-element tensor)."""
    if alpha is None:
        return math.inf
    if isinstance(alpha, torch.Tensor) and alpha.numel() == 1 and not alpha.is_complex():
        alpha = alpha.item()
    number = isinstance(alpha, (numbers.Real, np.floating, np.integer)) and not isinstance(alpha, (bool, np.bool_))
    if not number or not float(alpha) > 0:
        raise ValueError(f"`alpha` must be a positive number (or None / inf for the IID split), got {alpha!r}.")
    return float(alpha)


def _as_array(labels: Any) -> np.ndarray:
    """`labels` as int64 class indices; labels that are not whole numbers are an error (they would be cut)."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    values = np.asarray(labels).reshape(-1)
    if values.dtype.kind not in "iub":
        whole = (
            np.isfinite(values) & (values == np.round(values))
            if values.dtype.kind == "f"
            else np.zeros(len(values), bool)
        )
        if not whole.all():
            raise ValueError(
                f"`labels` must be whole class indices (integers, or floats holding whole numbers), got "
                f"{values[~whole][:3].tolist()} among the {values.dtype} labels: pass the class of each sample "
                "(e.g. `targets.long()`)."
            )
    return values.astype(np.int64)
