"""A worker's replica as flat buffers, and the averaged model `x̄` swapped in and out of it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module, Parameter

MeanFn = Callable[[list[Tensor]], list[Tensor]]  # tensors -> their means over the workers, new tensors


def pack_(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Move `tensors` into contiguous flat buffers, one per (device, dtype); return the buffers.

    Each tensor's `.data` becomes a view into its buffer, so the buffers can be sent as they
    are and writing into a buffer updates the tensors. The tensors' identity (and so any
    optimizer state keyed by them) is kept.

    Examples:
        >>> a, b = torch.ones(2), torch.zeros(3)
        >>> (flat,) = pack_([a, b])
        >>> flat.mul_(2)
        tensor([2., 2., 0., 0., 0.])
        >>> a
        tensor([2., 2.])
    """
    buffers = []
    for members in group_by_layout(list(tensors)):
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        offset = 0
        for t in members:
            t.data = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        buffers.append(flat)
    return buffers


def local_tensor(tensor: Tensor) -> Tensor:
    """What this process holds of `tensor`: its local shard, detached, if it is a `DTensor` (a parameter FSDP sharded,
    or its gradient), else `tensor` itself. Writing into it (under `torch.no_grad()`) writes into `tensor`.

    Examples:
        >>> local_tensor(torch.ones(2))
        tensor([1., 1.])
    """
    return tensor.detach().to_local() if isinstance(tensor, DTensor) else tensor


def shaped_like(tensor: Tensor, local: Tensor) -> Tensor:
    """A tensor laid out as `tensor` whose local part is `local` (its elements, viewed in `tensor`'s local shape):
    a `DTensor` sharded as `tensor` when `tensor` is one (the gradient of a sharded parameter), else a view of `local`.

    Examples:
        >>> shaped_like(torch.zeros(2, 2), torch.arange(4.0))
        tensor([[0., 1.],
                [2., 3.]])
    """
    if isinstance(tensor, DTensor):
        shaped = local.view(tensor.to_local().shape)
        return DTensor.from_local(
            shaped, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return local.view_as(tensor)


def group_by_layout(tensors: list[Tensor]) -> list[list[Tensor]]:
    """`tensors` grouped by (device, dtype), in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def state_tensors(module: Module) -> Iterator[Tensor]:
    """The module's parameters, then its buffers."""
    yield from module.parameters()
    yield from module.buffers()


class Replica:
    """One worker's model: its trainable parameters and (optionally) its floating-point buffers,
    packed into flat buffers that the parameters are views of.

    Args:
        module: the worker's module; packing it rewrites where its tensors' data lives.
        mix_buffers: also pack the floating-point module buffers (BatchNorm statistics), which the
            update rules then mix like the parameters.

    Examples:
        >>> replica = Replica(torch.nn.Linear(3, 2), mix_buffers=True)
        >>> [b.numel() for b in replica.flat_parameters], replica.flat_buffers
        ([8], [])
    """

    def __init__(self, module: Module, mix_buffers: bool) -> None:
        self.parameters: list[Parameter] = [p for p in module.parameters() if p.requires_grad]
        self.buffers: list[Tensor] = [b for b in module.buffers() if b.is_floating_point()] if mix_buffers else []
        self.flat_parameters = pack_(self.parameters)
        self.flat_buffers = pack_(self.buffers)

    @classmethod
    def of_buffers(
        cls,
        parameters: list[Parameter],
        flat_parameters: list[Tensor],
        flat_buffers: list[Tensor],
        buffers: list[Tensor],
    ) -> Replica:
        """A replica over flat buffers that already hold the tensors (`parameters` are views of `flat_parameters`,
        the mixed module `buffers` of `flat_buffers`): nothing is packed or moved."""
        replica = cls.__new__(cls)
        replica.parameters = parameters
        replica.flat_parameters = flat_parameters
        replica.flat_buffers = flat_buffers
        replica.buffers = buffers
        return replica

    @property
    def mixed(self) -> list[Tensor]:
        """What gossip mixes: the flat parameters, then the flat buffers."""
        return self.flat_parameters + self.flat_buffers

    def split(self, flats: list[Tensor]) -> list[Tensor]:
        """Tensors laid out as the first `len(flats)` buffers of `mixed` (say the flat parameters), cut into one
        flat view per tensor they hold (parameters, then mixed buffers): a layout that does not depend on how the
        tensors were packed (one buffer per dtype, or one per stacked tensor).

        Examples:
            >>> replica = Replica(torch.nn.Linear(2, 1), mix_buffers=False)
            >>> replica.split([torch.arange(3.0)])  # the weight's two elements, then the bias
            [tensor([0., 1.]), tensor([2.])]
            >>> replica.join(replica.split([torch.arange(3.0)]))
            [tensor([0., 1., 2.])]
        """
        return [flats[i].view(-1)[offset : offset + size] for i, offset, size in self.layout() if i < len(flats)]

    def join(self, pieces: list[Tensor]) -> list[Tensor]:
        """The inverse of `split`: new flat tensors laid out as `mixed` (its first buffers, for fewer pieces)."""
        layout = self.layout()[: len(pieces)]
        return [
            torch.cat([p.reshape(-1) for p, (j, _, _) in zip(pieces, layout) if j == i])
            for i in sorted({j for j, _, _ in layout})
        ]

    def layout(self) -> list[tuple[int, int, int]]:
        """For each tensor held (parameters, then mixed buffers), in order: its buffer in `mixed`, offset and size."""
        out = []
        for tensor in [local_tensor(p) for p in self.parameters] + self.buffers:
            i = next(
                i
                for i, flat in enumerate(self.mixed)
                if flat.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            )
            out.append((i, tensor.storage_offset() - self.mixed[i].storage_offset(), tensor.numel()))
        return out

    def check_trainable_unchanged(self, module: Module) -> None:
        """Raise if the module's trainable parameters are no longer the packed ones ((un)freezing during fit)."""
        packed = sum(b.numel() for b in self.flat_parameters)
        trainable = sum(local_tensor(p).numel() for p in module.parameters() if p.requires_grad)
        if trainable != packed:
            raise RuntimeError(
                f"The trainable parameters changed during fit ({packed} elements at setup, {trainable} now), e.g. "
                "by BackboneFinetuning. DecentralizedStrategy mixes the parameters trainable when fit starts: "
                "freeze or unfreeze before fit, or run one fit per phase."
            )


class AveragedModel:
    """Swaps `x̄` into a module and back, keeping track of the module's own values meanwhile."""

    def __init__(self) -> None:
        self._depth = 0
        self._own: dict[int, Tensor] = {}  # while averaged: id(tensor) -> this worker's own value

    @contextlib.contextmanager
    def swapped_in(self, module: Module, mean: MeanFn | None) -> Iterator[None]:
        """Replace every floating-point parameter and buffer of `module` by its mean over the workers
        inside the block, then restore each exactly. A nested use is free.

        `mean` returns the means over the workers of the tensors it is given (new tensors; a
        collective every worker enters together); `None`: one worker, nothing to do.
        """
        tensors: list[Tensor] = []
        if not self._depth and mean is not None:
            tensors = [t for t in state_tensors(module) if t.is_floating_point()]
        originals = [t.detach().clone() for t in tensors]
        locals_ = [local_tensor(t) for t in tensors]  # of a sharded parameter, this rank's shard: mean averages those
        with torch.no_grad():
            for local, average in zip(locals_, mean(locals_) if tensors else []):
                local.copy_(average)
        if tensors:
            self._own = {id(t): original for t, original in zip(tensors, originals)}
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            with torch.no_grad():
                for local, original in zip(locals_, originals):
                    local.copy_(local_tensor(original))
            if tensors:
                self._own = {}

    def own_state_dict(self, module: Module) -> dict[str, Tensor]:
        """The module's state dict with this worker's own values, also while `x̄` is swapped in."""
        state = module.state_dict(keep_vars=True)
        return {name: self._own.get(id(value), value).detach() for name, value in state.items()}

    def state_dict(self, module: Module, mean: MeanFn | None) -> dict[str, Tensor]:
        """`x̄`'s state dict, in new tensors where floating-point: this worker's own state dict averaged by `mean` (one
        call, a collective every worker enters together; the module is not touched), or a copy of the module's while
        `x̄` is swapped in or `mean` is `None` (one worker).

        Examples:
            >>> module, twice = torch.nn.Linear(1, 1, bias=False), lambda tensors: [2 * t for t in tensors]
            >>> with torch.no_grad():
            ...     _ = module.weight.fill_(1.0)
            >>> averaged = AveragedModel()
            >>> averaged.state_dict(module, twice)
            {'weight': tensor([[2.]])}
            >>> with averaged.swapped_in(module, twice):
            ...     averaged.state_dict(module, twice)  # x̄ is in: copied, not averaged again
            {'weight': tensor([[2.]])}
        """
        if self._depth or mean is None:
            return {name: value.clone() for name, value in module.state_dict().items()}
        return averaged_state_dict(self.own_state_dict(module), mean)


def averaged_optimizer_state(states: list[dict[str, Any]], mean: MeanFn) -> dict[str, Any]:
    """`states[0]` (an optimizer `state_dict()`) with each floating per-parameter tensor (momentum, Adam's
    moments; not scalars such as `step`) replaced by its mean, `mean(tensors of states[0])`; the live
    state is not touched.

    Examples:
        >>> a = {"state": {0: {"momentum_buffer": torch.tensor([1.0, 3.0])}}, "param_groups": []}
        >>> b = {"state": {0: {"momentum_buffer": torch.tensor([3.0, 5.0])}}, "param_groups": []}
        >>> over_workers = lambda tensors: [torch.stack([a["state"][0]["momentum_buffer"],
        ...                                             b["state"][0]["momentum_buffer"]]).mean(0)]
        >>> averaged_optimizer_state([a, b], over_workers)["state"][0]["momentum_buffer"]
        tensor([2., 4.])
    """
    state = states[0]
    per_param = {key: dict(values) for key, values in state["state"].items()}
    entries = [
        (values, name)
        for values in per_param.values()
        for name, value in values.items()
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
    ]
    for (values, name), average in zip(entries, mean([local_tensor(values[name]) for values, name in entries])):
        values[name] = shaped_like(values[name], average)
    return {**state, "state": per_param}


def averaged_state_dict(state_dict: dict[str, Tensor], mean: MeanFn) -> dict[str, Tensor]:
    """`state_dict` with each floating-point tensor replaced by its mean over the workers, `mean(tensors)` (one call);
    the others (integer buffers such as BatchNorm's `num_batches_tracked`) as they are.

    Examples:
        >>> twice = lambda tensors: [2 * t for t in tensors]
        >>> averaged_state_dict({"w": torch.ones(2), "n": torch.tensor(3)}, twice)
        {'w': tensor([2., 2.]), 'n': tensor(3)}
    """
    names = [name for name, value in state_dict.items() if value.is_floating_point()]
    means = dict(zip(names, mean([local_tensor(state_dict[name]) for name in names]))) if names else {}
    return {name: shaped_like(value, means[name]) if name in means else value for name, value in state_dict.items()}
