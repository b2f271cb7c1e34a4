"""What the saves of one step share: `ModelCheckpoint(save_last=True)` saves the step's checkpoint, then `last.ckpt`,
from the same replicas, and the second save reuses the first's `x̄`, averaged optimizer state and (in the background)
host copies instead of averaging and copying again, and links each rank's shard of the first instead of writing it.

A tensor counts as unchanged while it is the same data (the same address, shape, strides, dtype and device; the record
keeps that memory alive, so no other tensor can take its address) and torch's version counter, which counts every
in-place write by a torch operation, has not moved. The strategy forgets everything at the next training batch, when
validation starts and at the end of fit: nothing is kept longer than one step, nor while validation runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_decentral._compat import version
from lightning_decentral.driver import RANDOM_STATE
from lightning_decentral.replicas import MeanFn


class MeanGroup(Protocol):
    """What [`ReusedMeans`][lightning_decentral.trainer.reuse.ReusedMeans] needs of
    [`Ranks`][lightning_decentral.agreement.Ranks]."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None

    def mean(self, tensors: list[Tensor], what: str = ...) -> list[Tensor]: ...

    def gather(self, values: list[int], what: str = ...) -> Tensor: ...


class _Record:
    """A tensor as it was: an alias of its data (which keeps the memory) and its version counter."""

    __slots__ = ("alias", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.alias = tensor.detach()
        self.version = version(tensor)

    def matches(self, tensor: Tensor) -> bool:
        """Whether `tensor` is the recorded data, not written in place since."""
        alias = self.alias
        return (
            tensor.data_ptr() == alias.data_ptr()
            and tensor.shape == alias.shape
            and tensor.stride() == alias.stride()
            and tensor.dtype == alias.dtype
            and tensor.device == alias.device
            and version(tensor) == self.version
        )


def _scope(ranks: MeanGroup) -> tuple[Any, ...]:
    """Which ranks a mean was over: a failure survived since changes it (the default group is rebuilt)."""
    world = dist.group.WORLD if ranks.group is None and dist.is_initialized() else None
    return ranks.rank, ranks.world_size, ranks.group, world


class ReusedMeans:
    """Means over the ranks, each remembered under a label until `clear`: asked again under the label for the same
    tensors, unchanged on every rank, it returns the same results without averaging again.

    Whether every rank may reuse is agreed with one all-gather of a flag (no rank skips a collective another runs);
    it is asked only when a mean is remembered under the label, which every rank running the same program remembers
    alike. A result written in place since is not reused, and a change of process group (a failure survived, before
    or during that all-gather) forgets everything.

    Examples:
        >>> import torch
        >>> class OneRank:  # a stand-in for Ranks, counting its averagings
        ...     rank, world_size, group, calls = 0, 1, None, 0
        ...     def mean(self, tensors, what): self.calls += 1; return [t.clone() for t in tensors]
        ...     def gather(self, values, what): return torch.tensor([values])
        >>> means, ranks, w = ReusedMeans(), OneRank(), torch.ones(3)
        >>> first = means.mean(ranks, "x̄", [w], "Averaging")
        >>> means.mean(ranks, "x̄", [w], "Averaging")[0].data_ptr() == first[0].data_ptr(), ranks.calls
        (True, 1)
        >>> _ = w.mul_(2)  # written in place: averaged again
        >>> means.mean(ranks, "x̄", [w], "Averaging")[0].tolist(), ranks.calls
        ([2.0, 2.0, 2.0], 2)
    """

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[list[_Record], list[_Record]]] = {}  # label -> (inputs, results)
        self._scope: tuple[Any, ...] | None = None

    def mean(
        self, ranks: MeanGroup, label: Hashable, tensors: list[Tensor], what: str, agreed: bool | None = None
    ) -> list[Tensor]:
        """`ranks.mean(tensors, what)`, or the results remembered under `label` for these tensors, unchanged. With
        `agreed`, the ranks have agreed already, in a collective of their own, whether to reuse (every rank's inputs
        are those of its means remembered, and they are `unchanged`): no all-gather here."""
        scope = _scope(ranks)
        if scope != self._scope:
            self._kept = {}
            self._scope = scope
        kept = self._kept.get(label)
        if kept is not None and agreed is None:
            inputs, results = kept
            same = len(inputs) == len(tensors) and all(r.matches(t) for r, t in zip(inputs, tensors))
            same = same and all(r.matches(r.alias) for r in results)
            agreed = ranks.gather([same], f"{what}, agreeing whether an earlier save of this step did it,")[:, 0].all()
            agreed = (
                bool(agreed) and _scope(ranks) == scope
            )  # the ranks that agreed are those that averaged (no failure)
        if kept is not None and agreed:
            return [r.alias for r in kept[1]]
        means = ranks.mean(tensors, what)
        self._kept[label] = ([_Record(t) for t in tensors], [_Record(m) for m in means])
        return means

    def unchanged(self, ranks: MeanGroup) -> bool:
        """Whether no mean remembered was written in place since, over the same ranks."""
        return _scope(ranks) == self._scope and all(
            r.matches(r.alias) for _, results in self._kept.values() for r in results
        )

    def bound(self, ranks: MeanGroup, label: Hashable, what: str, agreed: bool | None = None) -> MeanFn:
        """`mean` as a function of the tensors alone (`replicas.MeanFn`)."""
        return lambda tensors: self.mean(ranks, label, tensors, what, agreed)

    def clear(self) -> None:
        """Forget every mean (the replicas change, or fit ends)."""
        self._kept = {}


class HostCopies:
    """Copies of tensors in host memory (a background save's copy of a checkpoint), each handed out again for the same
    tensor, unchanged, until `clear`.

    Examples:
        >>> import torch
        >>> copies, live = HostCopies(), {"w": torch.zeros(2), "step": 3}
        >>> first, second = copies.copy(live), copies.copy(live)
        >>> second["w"] is first["w"], first["w"] is live["w"], second["step"]
        (True, False, 3)
        >>> _ = live["w"].add_(1)
        >>> copies.copy(live)["w"]
        tensor([1., 1.])
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], tuple[_Record, Tensor]] = {}

    def copy(self, state: Any) -> Any:
        """`state` with every tensor copied to host memory (new containers, the same non-tensor values)."""
        return apply_to_collection(state, Tensor, self._copy)

    def _copy(self, tensor: Tensor) -> Tensor:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        kept = self._kept.get(key)
        if kept is not None and kept[0].matches(tensor):
            return kept[1]
        copy = tensor.detach().to("cpu", copy=True)
        self._kept[key] = (_Record(tensor), copy)
        return copy

    def clear(self) -> None:
        """Forget every copy."""
        self._kept = {}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a shard (equal only to another `_Slot` with the same index)."""

    index: int


def _split(shard: dict[str, Any]) -> tuple[list[Tensor], Any]:
    """The tensors of `shard` but its RNG state, and the rest of it but its save id, each tensor a `_Slot`."""
    tensors: list[Tensor] = []

    def slot(tensor: Tensor) -> _Slot:
        tensors.append(tensor)
        return _Slot(len(tensors) - 1)

    rest = {key: value for key, value in shard.items() if key not in ("save_id", RANDOM_STATE)}
    return tensors, apply_to_collection(rest, Tensor, slot)


def _equal(a: Any, b: Any) -> bool:
    """Whether `a` and `b` hold equal values (tensors compared element by element).

    Examples:
        >>> import torch
        >>> _equal({"torch": torch.ones(2), "python": (3, [1, 2])}, {"torch": torch.ones(2), "python": (3, [1, 2])})
        True
        >>> _equal([torch.ones(2)], [torch.zeros(2)])
        False
    """
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class StepShards:
    """This rank's shard of the last save of a step, until `clear`; a later save of the step whose shard holds the
    same links it instead of writing it again (`earlier` of
    [`save_with_shards`][lightning_decentral.checkpoint.save_with_shards]). The same: every tensor the same data, not
    written in place since (as in `ReusedMeans`), the RNG state (a new copy at each save) equal in value, every other
    value equal.

    Examples:
        >>> import torch
        >>> shards, w = StepShards(), torch.zeros(2)
        >>> shard = {"save_id": 7, "state_dict": {"w": w}, "strategy": {"step": 3}, "rng": {"torch": torch.ones(2)}}
        >>> shards.remember(shard, 7, "a.ckpt.shards/rank-00000-of-00001.7.pt")
        >>> shards.same_as({**shard, "save_id": 0, "rng": {"torch": torch.ones(2)}})
        (7, 'a.ckpt.shards/rank-00000-of-00001.7.pt')
        >>> (shards.same_as({**shard, "rng": {"torch": torch.zeros(2)}}),
        ...  shards.same_as({**shard, "strategy": {"step": 4}}))
        (None, None)
        >>> _ = w.add_(1); shards.same_as(shard) is None
        True
    """

    def __init__(self) -> None:
        self._kept: tuple[int, str, list[_Record], Any, Any] | None = None  # id, path, tensors, the rest, RNG

    def same_as(self, shard: dict[str, Any]) -> tuple[int, str] | None:
        """`(save_id, path)` of the shard kept, if `shard` holds the same but its save id; else `None`."""
        if self._kept is None:
            return None
        save_id, path, records, rest, rng = self._kept
        tensors, now = _split(shard)
        same = now == rest and len(tensors) == len(records) and all(r.matches(t) for r, t in zip(records, tensors))
        return (save_id, path) if same and _equal(shard[RANDOM_STATE], rng) else None

    def remember(self, shard: dict[str, Any], save_id: int, path: str) -> None:
        """Keep `shard`, saved to `path` under `save_id` (in place of the shard kept before)."""
        tensors, rest = _split(shard)
        self._kept = (save_id, path, [_Record(t) for t in tensors], rest, shard[RANDOM_STATE])

    def clear(self) -> None:
        """Forget the shard."""
        self._kept = None


class StepSaves:
    """What the saves of one step share, `means`, `copies` and `shards`, until `forget`. With
    `submit` (a [`BackgroundWriter`][lightning_decentral.trainer.background.BackgroundWriter]'s), the means and the
    shards are the writer thread's: forgotten there, after the saves queued before."""

    def __init__(self, submit: Callable[[Callable[[], None]], None] | None = None) -> None:
        self.means = ReusedMeans()
        self.copies = HostCopies()
        self.shards = StepShards()
        self._submit = submit
        self._queued = False  # a save was given to the writer since the last `forget`

    def queued(self) -> tuple[ReusedMeans, StepShards]:
        """A save is given to the writer: the means and the shard it may share."""
        self._queued = True
        return self.means, self.shards

    def forget(self) -> None:
        """Forget the copies now, and the means and the shard (with `submit`, once the saves queued so far are done)."""
        self.copies.clear()
        if self._submit is None:
            self._clear_shared()
        elif self._queued:
            self._submit(self._clear_shared)
            self._queued = False

    def _clear_shared(self) -> None:
        self.means.clear()
        self.shards.clear()
