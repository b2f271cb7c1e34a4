"""DirichletSampler: label-skewed shards, disjoint and covering, skewed as alpha says, the same for rank i
of n processes and simulated worker i."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_decentral import DirichletSampler
from lightning_decentral.data import dirichlet_shards
from tests import data_workers
from tests.helpers import run_distributed

LABELS = np.repeat(np.arange(10), 60)  # 10 classes of 60 samples, in class order


def _max_class_fraction(shards: list[np.ndarray]) -> float:
    """The mean over workers of the share of a worker's samples from its most frequent class."""
    return float(np.mean([np.bincount(LABELS[s], minlength=10).max() / len(s) for s in shards]))


@pytest.mark.parametrize("alpha", [0.05, 0.5, 10.0, None])
@pytest.mark.parametrize("workers", [3, 8])
def test_shards_are_disjoint_and_cover_the_dataset(alpha, workers: int) -> None:
    shards = dirichlet_shards(LABELS, workers, alpha, seed=1)
    assert len(shards) == workers and all(len(s) > 0 for s in shards)
    every = np.concatenate(shards)
    assert len(every) == len(LABELS) and set(every.tolist()) == set(range(len(LABELS)))


def test_small_alpha_skews_each_worker_to_few_classes_and_large_alpha_is_near_uniform() -> None:
    fractions = {
        alpha: np.mean([_max_class_fraction(dirichlet_shards(LABELS, 8, alpha, seed)) for seed in range(5)])
        for alpha in (0.05, 1.0, 1000.0, None)
    }
    assert fractions[0.05] > 0.6  # most of a worker's data is one class (uniform: 0.1)
    assert fractions[0.05] > fractions[1.0] > fractions[1000.0]
    assert fractions[1000.0] < 0.2 and fractions[None] < 0.2  # uniform is 0.1, plus sampling noise


def test_infinite_alpha_is_the_shuffled_round_robin_split() -> None:
    order = np.random.default_rng(4).permutation(len(LABELS))
    for alpha in (None, float("inf")):
        shards = dirichlet_shards(LABELS, 5, alpha, seed=4)
        assert [s.tolist() for s in shards] == [sorted(order[i::5].tolist()) for i in range(5)]


def test_shards_are_deterministic_by_seed() -> None:
    first, again, other = (dirichlet_shards(LABELS, 6, 0.3, seed) for seed in (2, 2, 3))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_every_rank_takes_the_same_number_of_samples_from_its_own_shard_reshuffled_each_epoch() -> None:
    samplers = [DirichletSampler(range(600), LABELS, 0.1, num_replicas=6, rank=r, seed=0) for r in range(6)]
    sizes = [len(s.shard) for s in samplers]
    assert min(sizes) < 100 < max(sizes)  # unequal shards: some are cycled, some cut
    for sampler in samplers:
        first = list(sampler)
        assert len(sampler) == len(first) == sampler.samples_per_worker == 100
        assert set(first) <= set(sampler.shard.tolist())
        if len(sampler.shard) <= 100:  # a short shard is cycled: all of it, every epoch
            assert set(first) == set(sampler.shard.tolist())
        sampler.set_epoch(1)
        second = list(sampler)
        assert len(second) == 100 and second != first and set(second) <= set(sampler.shard.tolist())
    unshuffled = DirichletSampler(range(600), LABELS, 0.1, num_replicas=6, rank=0, shuffle=False, seed=0)
    assert list(unshuffled)[: len(unshuffled.shard)] == unshuffled.shard.tolist()[:100]


def test_for_rank_is_the_sampler_built_for_that_rank() -> None:
    sampler = DirichletSampler(range(600), LABELS, 0.5, seed=9)  # no process group: rank 0 of 1
    assert sampler.num_replicas == 1 and sorted(sampler) == list(range(600))
    sampler.set_epoch(3)
    moved = sampler.for_rank(2, 4)
    built = DirichletSampler(range(600), LABELS, 0.5, num_replicas=4, rank=2, seed=9)
    built.set_epoch(3)
    assert list(moved) == list(built)


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="`alpha` must be a positive number"):
        DirichletSampler(range(600), LABELS, 0.0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="class of each of the 10 samples"):
        DirichletSampler(range(10), LABELS, 1.0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="raise `alpha`, or use fewer workers"):
        dirichlet_shards(np.zeros(20, dtype=int), 15, alpha=0.01)


def test_alpha_of_any_real_kind_is_taken_and_labels_that_are_not_whole_are_refused() -> None:
    """Before, `np.float32(0.5)` and `torch.tensor(0.5)` were "not a positive number", and float labels were cut."""
    expected = dirichlet_shards(LABELS, 4, 0.5, seed=1)
    for alpha in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5])):
        assert all(np.array_equal(a, b) for a, b in zip(dirichlet_shards(LABELS, 4, alpha, seed=1), expected)), alpha
    assert DirichletSampler(range(600), LABELS, np.float32(0.5), num_replicas=4, rank=1, seed=1).alpha == 0.5
    for alpha in (np.float32(0.0), torch.tensor(-1.0), torch.tensor([0.5, 1.0]), np.bool_(True), "0.5"):
        with pytest.raises(ValueError, match="`alpha` must be a positive number"):
            dirichlet_shards(LABELS, 4, alpha)
    whole = [float(c) for c in LABELS]  # floats that hold class indices: the same split
    assert all(np.array_equal(a, b) for a, b in zip(dirichlet_shards(whole, 4, 0.5, seed=1), expected))
    for labels in ([0.0, 1.5, 2.0, 0.0], torch.tensor([0.2, 0.7]), ["cat", "dog"]):
        with pytest.raises(ValueError, match="`labels` must be whole class indices"):
            dirichlet_shards(labels, 2, 1.0)


@pytest.mark.slow
def test_simulated_worker_i_and_rank_i_train_on_the_same_samples(monkeypatch) -> None:
    """4 gloo processes, each building its sampler in train_dataloader; 4 simulated workers; 2 epochs."""
    world = 4
    ranks = run_distributed(data_workers.fit_processes, world)
    simulated = data_workers.fit_simulated(world)
    expected = [data_workers.expected(rank, world) for rank in range(world)]
    assert [r["seen"] for r in ranks] == expected  # Lightning kept the sampler on every rank
    assert simulated == expected
    assert len({tuple(seen) for seen in expected}) == world
    assert "build it in `train_dataloader()`" in ranks[0]["error"]
