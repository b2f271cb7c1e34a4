"""Sharded replicas: FSDP2 inside each replica, the update rules across replicas on the local shards (docs/sharded.md).

`n = r·s` ranks form `r` replicas of `s` consecutive ranks: rank `g·s + l` holds shard `l` of replica `g`. On the
2-D device mesh `("replica", "shard")`, FSDP2 (`fully_shard(module, mesh=mesh["shard"])`) shards each replica over
its row and reduce-scatters its gradients there. Every replica shards alike, so rank `(g, l)` holds the same slice of
every parameter as `(h, l)`: an update rule of docs/algorithms.md, elementwise in the replicas, runs unchanged on the
local shards, with the process group of mesh column `l` (`mesh["replica"]`) in place of the world:

```text
x_(g,l)(k+1) = Σ_h w_gh(k) x_(h,l)(k) + (U(x_(g,l)(k), ḡ_g) − x_(g,l)(k))      AWC, ḡ_g: replica g's mean gradient
```

Each rank holds `1/s` of the parameters, of the optimizer state and of the exchange buffers; the whole of a replica
exists only when FSDP gathers it for a forward or backward, and in a full state dict (a checkpoint).

Nothing here imports Lightning: the Trainer's strategy holds a [`Sharding`][lightning_decentral.sharding.Sharding]
and calls it at set-up, to pack the replica, to average, and to save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_decentral.agreement import Ranks, parameter_deviations
from lightning_decentral.membership.guard import Guard
from lightning_decentral.replicas import Replica, group_by_layout, local_tensor, pack_, shaped_like

MESH_DIMS = ("replica", "shard")
"""The names of the device mesh's dimensions: replicas across, the ranks of one replica along."""


@dataclass(frozen=True)
class ReplicaLayout:
    """Which rank holds which shard of which replica: rank `g·s + l` holds shard `l` of replica `g`.

    Examples:
        >>> layout = ReplicaLayout.of(world_size=8, shard_size=2)
        >>> layout.replicas, layout.replica_of(5), layout.shard_of(5), layout.row(2), layout.column(1)
        (4, 2, 1, [4, 5], [1, 3, 5, 7])
        >>> ReplicaLayout.of(world_size=6, shard_size=4)
        Traceback (most recent call last):
        ...
        ValueError: shard_size=4 makes replicas of 4 consecutive ranks, but the 6 ranks ...
    """

    world_size: int
    shard_size: int

    @classmethod
    def of(cls, world_size: int, shard_size: int) -> ReplicaLayout:
        """The layout of `world_size` ranks in replicas of `shard_size`; `ValueError` naming the fix if it does not
        divide."""
        if world_size % shard_size:
            raise ValueError(
                f"shard_size={shard_size} makes replicas of {shard_size} consecutive ranks, but the {world_size} ranks "
                f"(num_nodes × devices) are not a multiple of it: use a world size that is (e.g. "
                f"{(world_size // shard_size + 1) * shard_size}), or a shard_size that divides {world_size}."
            )
        return cls(world_size, shard_size)

    @property
    def replicas(self) -> int:
        """`r = n / s`, the replicas: the workers of the topology."""
        return self.world_size // self.shard_size

    def replica_of(self, rank: int) -> int:
        """`g`, the replica rank `rank` belongs to."""
        return rank // self.shard_size

    def shard_of(self, rank: int) -> int:
        """`l`, the shard rank `rank` holds."""
        return rank % self.shard_size

    def row(self, replica: int) -> list[int]:
        """The ranks of replica `replica`: the group FSDP shards it over."""
        return list(range(replica * self.shard_size, (replica + 1) * self.shard_size))

    def column(self, shard: int) -> list[int]:
        """The ranks holding shard `shard` of every replica, in replica order: the group the rule runs on."""
        return [g * self.shard_size + shard for g in range(self.replicas)]


def sharded_parameters(module: Module) -> list[tuple[str, Parameter]]:
    """`module`'s trainable parameters, by name."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def check_sharded(module: Module, mesh: DeviceMesh, shard_root: Callable[[Module], None]) -> None:
    """Make sure every trainable parameter of `module` is sharded on `mesh["shard"]`, evenly along dimension 0.

    A module that `configure_model` left unsharded is sharded by `shard_root(module)`; one sharded in part, on another
    mesh, or unevenly raises `ValueError` naming the fix.
    """
    named = sharded_parameters(module)
    if named and not any(isinstance(p, DTensor) for _, p in named):
        shard_root(module)
        named = sharded_parameters(module)
    shard_mesh = mesh["shard"]
    for name, p in named:
        if not isinstance(p, DTensor):
            raise ValueError(
                f"Parameter {name!r} is not sharded while others are: with shard_size > 1 every trainable parameter is "
                "sharded by FSDP. In configure_model, end with fully_shard(self, mesh=self.device_mesh['shard']) so "
                "that the root shards what the layers you sharded left."
            )
        if p.device_mesh != shard_mesh:
            raise ValueError(
                f"Parameter {name!r} is sharded on {p.device_mesh}, not on the strategy's mesh {shard_mesh}: shard "
                "with fully_shard(module, mesh=self.device_mesh['shard']) in configure_model (the strategy sets "
                "self.device_mesh before configure_model runs)."
            )
        if p.placements != (Shard(0),) or p.shape[0] % mesh.size(1):
            raise ValueError(
                f"Parameter {name!r} of shape {tuple(p.shape)} is sharded as {p.placements} over {mesh.size(1)} ranks: "
                "the gossip buffers view FSDP's shards in place, which needs dimension 0 sharded evenly (FSDP pads an "
                f"uneven one into a copy). Make dimension 0 of every parameter a multiple of shard_size={mesh.size(1)} "
                "(e.g. pad a vocabulary), or use a shard_size that divides them."
            )


def pack_shards_(module: Module, names: Iterable[str]) -> tuple[list[Parameter], list[Tensor]]:
    """Move the local shards of `module`'s sharded parameters `names` into flat buffers, one per (device, dtype), and
    return the parameters and the buffers; each parameter's local shard is then a view into its buffer.

    The parameters are replaced through `load_state_dict(..., assign=True)`, FSDP2's way of being given new sharded
    parameters: it re-reads each one's local shard, so that its all-gathers read the buffers. Run it before the
    optimizer is built (the parameters are new objects).
    """
    names = list(names)
    params = [module.get_parameter(name) for name in names]
    locals_ = [local_tensor(p) for p in params]
    views: dict[int, Tensor] = {}
    buffers = []
    for group in group_by_layout(locals_):
        flat = torch.cat([t.reshape(-1) for t in group])
        offset = 0
        for t in group:
            views[id(t)] = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        buffers.append(flat)
    state = {
        name: DTensor.from_local(
            views[id(t)], p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        for name, p, t in zip(names, params, locals_)
    }
    module.load_state_dict(state, strict=False, assign=True)
    return [module.get_parameter(name) for name in names], buffers


class ShardedReplica(Replica):
    """One rank's part of a sharded replica: the local shards of its trainable parameters (views into flat buffers, as
    a [`Replica`][lightning_decentral.replicas.Replica]'s parameters) and, with `mix_buffers`, its floating-point module
    buffers (FSDP does not shard them).

    Args:
        module: the module, every trainable parameter sharded by FSDP2
            ([`check_sharded`][lightning_decentral.sharding.check_sharded]).
        mix_buffers: also pack the floating-point buffers, which the rules then mix across replicas.
    """

    def __init__(self, module: Module, mix_buffers: bool) -> None:
        names = [name for name, _ in sharded_parameters(module)]
        self.parameters, self.flat_parameters = pack_shards_(module, names)
        self.buffers = [b for b in module.buffers() if b.is_floating_point()] if mix_buffers else []
        self.flat_buffers = pack_(self.buffers)


class Sharding:
    """The sharded replicas of one run on processes: its layout, device mesh and the collectives across replicas.

    Args:
        shard_size: `s`, the ranks of one replica.

    The strategy calls, in order: [`bind`][lightning_decentral.sharding.Sharding.bind] when it knows the world size
    (before any process starts), [`make_mesh`][lightning_decentral.sharding.Sharding.make_mesh] once the default group
    exists (before `configure_model`), [`replica`][lightning_decentral.sharding.Sharding.replica] when fit starts.
    """

    def __init__(self, shard_size: int) -> None:
        self.shard_size = shard_size
        self.layout: ReplicaLayout | None = None
        self.mesh: DeviceMesh | None = None
        self.row: dist.ProcessGroup | None = None  # this rank's replica: FSDP shards it over this group
        self.column: dist.ProcessGroup | None = None  # this rank's column: the means over the replicas

    def bind(self, world_size: int) -> int:
        """The replicas of `world_size` ranks (the topology's workers); `ValueError` naming the fix if `shard_size`
        does not divide it."""
        self.layout = ReplicaLayout.of(world_size, self.shard_size)
        return self.layout.replicas

    def make_mesh(self, device_type: str, world_size: int, timeout: timedelta) -> DeviceMesh:
        """The 2-D mesh `("replica", "shard")` over the default group (every rank together), its groups (FSDP's inside
        each replica, the columns across) made with `timeout`: a rank whose peer died stops within it."""
        layout = self.layout = ReplicaLayout.of(world_size, self.shard_size)
        rank = dist.get_rank()
        columns = [dist.new_group(layout.column(shard), timeout=timeout) for shard in range(layout.shard_size)]
        rows = [dist.new_group(layout.row(g), timeout=timeout) for g in range(layout.replicas)]
        self.column, self.row = columns[layout.shard_of(rank)], rows[layout.replica_of(rank)]
        ranks = torch.arange(world_size).view(layout.replicas, layout.shard_size)
        self.mesh = DeviceMesh.from_group([self.column, self.row], device_type, mesh=ranks, mesh_dim_names=MESH_DIMS)
        return self.mesh

    def new_replica_group(self, timeout: timedelta) -> dist.ProcessGroup:
        """A new process group of this rank's column, with `timeout` (every rank creates every column's, in order):
        the exchange's own, which it destroys when the run ends (the mesh's groups stay for the next run)."""
        layout = self._layout()
        groups = [dist.new_group(layout.column(shard), timeout=timeout) for shard in range(layout.shard_size)]
        return groups[layout.shard_of(dist.get_rank())]

    def regroup(self, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
        """After a failure, once the survivors made their default group of `world_size` ranks (every survivor
        together; whole replicas survive, in order, so rank `g·s + l` of it holds shard `l` of the `g`-th surviving
        replica): the layout over them, a new group of this rank's column for the means over the replicas, and
        another for the exchange (returned). The replica's own group, FSDP's, stays: none of its ranks was lost.

        The device mesh keeps the groups of the start, gone with the old default group: after a failure, what
        resolves its groups by name (`DeviceMesh.get_group`, DTensor's own collectives such as `full_tensor` or
        `clip_grad_norm_` on sharded gradients) must not run; this object's collectives use `row` and `column`."""
        layout = self.layout = ReplicaLayout.of(world_size, self.shard_size)
        columns = [dist.new_group(layout.column(shard), timeout=timeout) for shard in range(layout.shard_size)]
        self.column = columns[layout.shard_of(dist.get_rank())]
        return self.new_replica_group(timeout)

    def replica_ranks(self, device: torch.device, guard: Guard | None = None) -> Ranks:
        """[`Ranks`][lightning_decentral.agreement.Ranks] over this rank's column: a mean there is the mean over the
        replicas of this rank's shards. In the steps the survivors of a failure take alone (`guard.alone`), this
        rank's replica alone, on the default group of this rank alone."""
        if guard is not None and guard.alone:
            return Ranks(0, 1, device, None, guard)
        column = self._group(self.column)
        return Ranks(dist.get_rank(column), dist.get_world_size(column), device, column, guard)

    def shard_root(self, module: Module, info: Callable[[str], None]) -> None:
        """Shard `module` on the mesh's `"shard"` dimension for a `configure_model` that did not: each of its direct
        submodules holding parameters (a LightningModule's `training_step` may call them rather than `forward`, which
        FSDP's gathering hooks), saying so with `info`; parameters of `module` itself raise `ValueError`."""
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"shard_size={self.shard_size}: configure_model left the module unsharded and it holds parameters of "
                f"its own ({own}), which no submodule's forward gathers. Shard it in configure_model: "
                "fully_shard(submodule, mesh=self.device_mesh['shard']) for each block, then fully_shard(self, "
                "mesh=self.device_mesh['shard']) if training_step calls self(...)."
            )
        children = [child for child in module.children() if any(True for _ in child.parameters())]
        for child in children:
            fully_shard(child, mesh=self._mesh()[MESH_DIMS[1]])
        names = [name for name, child in module.named_children() if any(child is c for c in children)]
        info(
            f"shard_size={self.shard_size}: configure_model left the module unsharded, so the strategy sharded its "
            f"submodules {names} (fully_shard(submodule, mesh=self.device_mesh['shard'])). Shard its blocks in "
            "configure_model to gather one block at a time."
        )

    def replica(self, module: Module, mix_buffers: bool, info: Callable[[str], None]) -> ShardedReplica:
        """This rank's [`ShardedReplica`][lightning_decentral.sharding.ShardedReplica] of `module`, sharded first
        ([`shard_root`][lightning_decentral.sharding.Sharding.shard_root]) if `configure_model` did not shard it;
        `ValueError` naming the fix if it cannot be packed."""
        check_sharded(module, self._mesh(), lambda m: self.shard_root(m, info))
        return ShardedReplica(module, mix_buffers)

    def full_tensors(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with every `DTensor` whole ([`full_tensors`][lightning_decentral.sharding.full_tensors] over this
        rank's replica)."""
        return full_tensors(state, self._group(self.row))

    def sharded_state(self, module: Module, state: dict[str, Any], info: Callable[[str], None]) -> dict[str, Any]:
        """A shard's `state` dict (local tensors) as `module`'s state dict: each entry of a sharded parameter a
        `DTensor` laid out as it (the module sharded first if `configure_model` left it whole)."""
        check_sharded(module, self._mesh(), lambda m: self.shard_root(m, info))
        current = module.state_dict()
        return {name: shaped_like(current[name], value) if name in current else value for name, value in state.items()}

    def parameter_deviations(self, ranks: Ranks, module: Module) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, this rank's part of `‖p_g − p̄‖²` (its shard's: a sum over every
        rank is the sum over the replicas) and `‖p̄‖²` whole, summed over the replica's shards
        ([`parameter_deviations`][lightning_decentral.agreement.parameter_deviations] over `ranks`, this rank's
        column, then one all-reduce of the norms in the replica)."""
        deviations = parameter_deviations(ranks, module)
        if not deviations:
            return deviations
        norms = self.sum_over_shards(ranks, torch.stack([m for _, _, m in deviations]), "the norm of x̄")
        return [(name, d, norm) for (name, d, _), norm in zip(deviations, norms)]

    def effective_ratio(self, ranks: Ranks, local: list[Tensor], at_mean: list[Tensor]) -> tuple[Tensor, Tensor]:
        """`(α_e / γ, ‖η_d‖)` over the replicas (docs/monitoring.md) from this rank's shards of its replica's gradients
        at `x_g` (`local`) and at `x̄` (`at_mean`): the mean over the replicas on this rank's column (`ranks`), then
        the inner products `⟨ḡ_loc, g(x̄)⟩`, `‖g(x̄)‖²`, `‖ḡ_loc − g(x̄)‖²` summed over the replica's shards; equal on
        every rank, and to the unsharded run's."""
        dtype = torch.promote_types(local[0].dtype, torch.float32)
        both = torch.cat([local_tensor(g).reshape(-1).to(ranks.device, dtype) for g in local + at_mean])
        (mean,) = ranks.mean([both], "Averaging the gradients over the replicas (effective learning rate)")
        local_mean, mean_grad = mean.double().split(both.numel() // 2)
        difference = local_mean - mean_grad
        products = torch.stack([local_mean @ mean_grad, mean_grad @ mean_grad, difference @ difference])
        products = self.sum_over_shards(ranks, products, "the gradients' inner products")
        return products[0] / products[1], products[2].sqrt()

    def sum_over_shards(self, ranks: Ranks, tensor: Tensor, what: str) -> Tensor:
        """`tensor` summed over this rank's replica (its row of the mesh: the sum over its shards), in place, through
        `ranks`' guard (`what` names it if a rank fails meanwhile)."""
        ranks.guard.run(
            f"Summing {what} over a replica's shards",
            lambda: dist.all_reduce(tensor, group=self._group(self.row)),
        )
        return tensor

    def _layout(self) -> ReplicaLayout:
        if self.layout is None:
            raise RuntimeError("The layout is bound to the world size when the Trainer is created.")
        return self.layout

    def _group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        if group is None:
            raise RuntimeError("The replicas' groups are made with the device mesh, before configure_model.")
        return group

    def _mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("The device mesh is made when the ranks have joined, before configure_model.")
        return self.mesh


def local_tensors(state: Any) -> Any:
    """`state` (a state dict, an optimizer's, a shard's parts: nested dicts and lists) with every `DTensor` replaced by
    this rank's local shard: what its shard file holds.

    Examples:
        >>> local_tensors({"state_dict": {"w": torch.ones(1)}, "step": 2})
        {'state_dict': {'w': tensor([1.])}, 'step': 2}
    """
    if isinstance(state, DTensor):
        return local_tensor(state)
    if isinstance(state, dict):
        return {key: local_tensors(value) for key, value in state.items()}
    if isinstance(state, list):
        return [local_tensors(value) for value in state]
    return state


def sharded_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A shard's optimizer `state` (local tensors) as `optimizer`'s: each per-parameter tensor of a sharded parameter a
    `DTensor` laid out as it (what `optimizer.load_state_dict` takes).

    Examples:
        >>> sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
        >>> state = {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": []}
        >>> sharded_optimizer_state(sgd, state)["state"]
        {0: {'momentum_buffer': tensor([1., 1.])}}
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {
        index: {
            name: shaped_like(params[index], value)
            if isinstance(value, Tensor) and value.numel() == local_tensor(params[index]).numel()
            else value
            for name, value in values.items()
        }
        for index, values in state["state"].items()
    }
    return {**state, "state": per_param}


def check_same_sharding(shard_size: int, shard: dict[str, Any] | None, checkpoint_path: Any) -> None:
    """Refuse, naming the fix, a resume that cannot be exact across a change of sharding: a run with `shard_size > 1`
    without its own shards (another world size), or shards saved under another `shard_size` than this run's.

    Examples:
        >>> check_same_sharding(1, None, "a.ckpt")
        >>> check_same_sharding(2, {"strategy": {"shard_size": "2"}}, "a.ckpt")
        >>> check_same_sharding(2, {"strategy": {}}, "a.ckpt")
        Traceback (most recent call last):
        ...
        ValueError: The shards of a.ckpt were saved with shard_size=1, this run has shard_size=2: ...
    """
    fix = (
        "resume with the shard_size and number of ranks it was saved with, or start a new fit from its x̄ (the "
        "checkpoint's state_dict, whole: load it into the module before sharding it in configure_model)."
    )
    if shard is None:
        if shard_size > 1:
            raise ValueError(
                f"shard_size={shard_size} resumes exactly from its own shards only, and {checkpoint_path} has none for "
                f"this rank at this world size: {fix}"
            )
        return
    saved = int(shard.get("strategy", {}).get("shard_size", 1))
    if saved != shard_size:
        raise ValueError(
            f"The shards of {checkpoint_path} were saved with shard_size={saved}, this run has "
            f"shard_size={shard_size}: {fix}"
        )


def full_tensors(state: dict[str, Any], row: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """`state` (a state dict) with every `DTensor` gathered whole (a collective in each replica), plain tensors that
    load into the unsharded module: what a checkpoint file holds. The optimizer states' per-parameter tensors too.
    With `row` (the replica's group, [`Sharding.row`][lightning_decentral.sharding.Sharding]), a `DTensor` sharded on
    dimension 0 is the concatenation of its ranks' local shards, all-gathered there (it needs no group the device mesh
    names: the survivors of a failure gather so); else, and for any other placement, `DTensor.full_tensor()`.

    Examples:
        >>> full_tensors({"w": torch.ones(2), "step": 3})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    return {name: _full(value, row) for name, value in state.items()}


def _full(value: Any, row: dist.ProcessGroup | None) -> Any:
    if isinstance(value, DTensor):
        if row is None or value.placements != (Shard(0),):
            return value.full_tensor()
        local = value.to_local().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(row))]
        dist.all_gather(parts, local, group=row)
        return torch.cat(parts)
    if isinstance(value, dict):
        return {key: _full(v, row) for key, v in value.items()}
    if isinstance(value, list):
        return [_full(v, row) for v in value]
    return value
