"""Running something once without a trace, for `vectorize="auto"`'s decision: a scratch copy of a module, every random
generator put back, and whether a DataLoader's samples load at random (a random transform)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.nn import Module
from torch.utils.data import DataLoader

from lightning_decentral import checkpoint


def scratch_copy(module: Module) -> Module:
    """A copy of `module` to run once and drop: it shares `module`'s parameters and buffers (a `functional_call` puts
    other tensors in their place) and its Trainer; the rest (attributes, submodules' flags, metric objects) is its own.

    Examples:
        >>> net = torch.nn.BatchNorm1d(2)
        >>> copied = scratch_copy(net)
        >>> copied.eval().training, net.training, copied.running_mean is net.running_mean
        (False, True, True)
    """
    trainer = module.trainer if isinstance(module, LightningModule) else None
    shared = {id(t): t for t in (*module.parameters(), *module.buffers(), trainer)}  # the Trainer: a hook may hold it
    copied = copy.deepcopy(module, shared)
    if trainer is not None:  # a LightningModule leaves its Trainer out of copies
        copied.trainer = trainer
    return copied


@contextlib.contextmanager
def random_states_kept() -> Iterator[None]:
    """Every random generator (torch's CPU and CUDA ones, numpy's, Python's) after the block as it was before it.

    Examples:
        >>> before = torch.get_rng_state()
        >>> with random_states_kept():
        ...     _ = torch.rand(3)
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    states = checkpoint.rng_state()
    try:
        yield
    finally:
        checkpoint.set_rng_state(states)


def loads_at_random(dataloader: DataLoader) -> bool:
    """Whether loading the first samples of `dataloader` (its dataset's `[0]` and `[1]`, collated) draws from torch's,
    numpy's or Python's global random generator; every generator is put back after. An iterable dataset, or one those
    indices do not load, counts as not random.

    Examples:
        >>> from torch.utils.data import TensorDataset
        >>> class Jittered(TensorDataset):
        ...     def __getitem__(self, i):
        ...         return self.tensors[0][i] + 0.1 * torch.randn(2)
        >>> x = torch.zeros(4, 2)
        >>> (loads_at_random(DataLoader(TensorDataset(x), batch_size=2)),
        ...  loads_at_random(DataLoader(Jittered(x), batch_size=2)))
        (False, True)
    """
    dataset = dataloader.dataset
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return False
    with random_states_kept():
        before = checkpoint.rng_state()
        try:
            dataloader.collate_fn([dataset[i] for i in range(min(2, len(dataset)))])
        except Exception:  # not loaded by these indices: the training run loads it its own way
            return False
        return not _equal(before, checkpoint.rng_state())


def _equal(a: Any, b: Any) -> bool:
    """`a == b` for nested dicts, lists and tuples of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
