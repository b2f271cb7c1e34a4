"""The monitors' formulas, shared by the Trainer callbacks ([`callbacks`][lightning_decentral.callbacks]) and
the Fabric functions ([`fabric`][lightning_decentral.fabric]); defined on the
[monitoring page](../monitoring.md).

Each takes a strategy only through its monitoring surface, [`Monitored`][lightning_decentral.measures.Monitored],
which the Trainer's and Fabric's `DecentralizedStrategy` and the `SimulatedDecentralizedStrategy` provide: each
reports its process's sums over its workers, so a sum over the ranks divided by `num_workers` is the mean over
every worker. Every rank must call them together.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor


@runtime_checkable
class Monitored(Protocol):
    """What the monitors ([callbacks][lightning_decentral.callbacks], [Fabric functions][lightning_decentral.fabric])
    and the command line read of a decentralized executor; each of the three executors provides it. Values are this
    process's: its own worker's on a rank, the sum over its workers in a simulation."""

    @property
    def num_workers(self) -> int:
        """`n`, every worker of the run."""

    @property
    def root_device(self) -> torch.device:
        """The device this process's workers live on."""

    @property
    def topology(self) -> Any:
        """The topology, bound to `n`."""

    @property
    def gossip_steps(self) -> Any:
        """The rounds per gossip step, a [`RoundsSchedule`][lightning_decentral.schedule.RoundsSchedule]."""

    @property
    def rule(self) -> str:
        """The update rule: `"awc"`, `"atc"` or `"decentlam"`."""

    @property
    def eval_on(self) -> str:
        """What evaluation sees: `"average"` (`x̄`) or `"local"`."""

    def gossip_rounds(self, step: int) -> int:
        """Rounds of `W(step)` at step `step` (0: a local step)."""

    def measure_residuals(self) -> None:
        """From now on, measure each exchange's gossip residual."""

    def gossip_residual(self, step: int) -> Tensor | None:
        """`Σ ‖y_i − Σ_j w_ij y_j‖²` over this process's workers, of step `step`'s first round (`None`: not
        measured)."""

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """Per trainable parameter: its name, `Σ ‖p_i − p̄‖²` over this process's workers, `‖p̄‖²` (a collective)."""

    def extra_gossip(self, step: int, rounds: int) -> None:
        """`x <- W(step)^rounds x` now, between steps (a collective)."""

    def averaged_model(self) -> AbstractContextManager:
        """`x̄` swapped into the module inside the block (a collective)."""

    def gradient_sum(self) -> list[Tensor]:
        """`Σ g_i` over this process's workers, per trainable parameter."""

    def worker_batches(self, batch: Any) -> list[Any]:
        """The batch of each of this process's workers, from the batch the loop holds."""

    def worker_random_states(self) -> list[dict[str, Any]]:
        """The random state each of this process's workers draws its training forward from
        ([`random_state`][lightning_decentral.measures.random_state])."""


def sum_over_ranks(tensor: Tensor) -> Tensor:
    """`sum_i tensor_i`, in place: one all-reduce on the default group, no barrier and no host sync."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def gossip_residual(strategy: Any, step: int) -> Tensor | None:
    """`R(step) = sqrt( (1/n) Σ_i r_i )` from each rank's `r_i = ‖y_i − Σ_j w_ij y_j‖²`
    (`strategy.gossip_residual(step)`).

    Equal on every rank (one scalar all-reduce); `None` where step `step` did not gossip.
    """
    if not strategy.gossip_rounds(step):  # the same on every rank, so the collectives always match
        return None
    local = strategy.gossip_residual(step)
    if local is None:  # cannot happen once measure_residuals() ran; NaN shows it without a hang
        local = torch.tensor(math.nan, dtype=torch.float64, device=strategy.root_device)
    return sum_over_ranks(local.clone()).div_(strategy.num_workers).sqrt_()


def consensus_distance(strategy: Any, per_layer: bool = False) -> dict[str, Tensor]:
    """Exact `Ξ = sqrt( (1/n) Σ_i ‖x_i − x̄‖² )` (`"distance"`), `‖x̄‖` (`"mean_norm"`) and, with
    `per_layer`, `Ξ` of each top-level submodule (`"distance/<name>"`).

    Cost: one all-reduce of the parameters (in `strategy.parameter_deviations()`) and one of a few scalars.
    """
    deviations = strategy.parameter_deviations()
    device = strategy.root_device
    layers: dict[str, list[Tensor]] = {}
    if per_layer:
        for name, deviation, _ in deviations:
            layers.setdefault(name.split(".", 1)[0], []).append(deviation)
    local = torch.stack(
        [torch.stack([d for _, d, _ in deviations]).sum()] + [torch.stack(d).sum() for d in layers.values()]
    ).to(device)
    distances = sum_over_ranks(local).div_(strategy.num_workers).sqrt_()
    out = {"distance": distances[0], "mean_norm": torch.stack([m for _, _, m in deviations]).sum().sqrt().to(device)}
    out.update({f"distance/{name}": d for name, d in zip(layers, distances[1:])})
    return out


def effective_ratio(strategy: Any, local: list[Tensor], at_mean: list[Tensor]) -> tuple[Tensor, Tensor]:
    """`(α_e / γ, ‖η_d‖)` from this rank's gradients at its replica (`local`) and at `x̄` (`at_mean`), one
    all-reduce of both; equal on every rank."""
    dtype = torch.promote_types(local[0].dtype, torch.float32)
    both = torch.cat([g.detach().reshape(-1).to(strategy.root_device, dtype) for g in local + at_mean])
    sum_over_ranks(both).div_(strategy.num_workers)
    local_mean, mean_grad = both.double().split(both.numel() // 2)
    return ratio_and_noise(local_mean, mean_grad)


def ratio_and_noise(local_mean: Tensor, mean_grad: Tensor) -> tuple[Tensor, Tensor]:
    """`(α_e / γ, ‖η_d‖) = (⟨ḡ_loc, g(x̄)⟩ / ‖g(x̄)‖², ‖ḡ_loc − g(x̄)‖)` from the flat, rank-averaged
    gradients `ḡ_loc` (`local_mean`, at the replicas) and `g(x̄)` (`mean_grad`, at their average).

    Examples:
        >>> import torch
        >>> ratio, noise = ratio_and_noise(torch.tensor([1.0, 0.75]), torch.tensor([2.0, 0.0]))
        >>> float(ratio), float(noise)  # ⟨ḡ_loc, g⟩ / ‖g‖² = 2 / 4, ‖(−1, 0.75)‖
        (0.5, 1.25)
    """
    ratio = torch.dot(local_mean, mean_grad) / torch.dot(mean_grad, mean_grad)
    return ratio, torch.linalg.vector_norm(local_mean - mean_grad)


def own_gradients(module: torch.nn.Module) -> list[Tensor]:
    """The gradient of each trainable parameter of `module` (zeros where it has none): one worker's `g_i`."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters() if p.requires_grad]


def random_state(device: torch.device) -> dict[str, Any]:
    """The generators a training forward draws from: the CPU's and, on a GPU, `device`'s."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = (device, torch.cuda.get_rng_state(device))
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Restore what [`random_state`][lightning_decentral.measures.random_state] saved."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        device, cuda_state = state["cuda"]
        torch.cuda.set_rng_state(cuda_state, device)
