"""The update-rule arguments every executor takes, checked once, before anything runs."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from lightning_decentral.schedule import RoundsSchedule
from lightning_decentral.topology import TOPOLOGIES, topology_class

TopologyName = Literal[tuple(TOPOLOGIES)]  # type: ignore[valid-type]  # a config names one of these, checked when parsed

COMBINE = ("awc", "atc")
EVAL_ON = ("average", "local")
MOMENTUM = ("local", "decentlam")
GOSSIP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GossipDtypeName = Literal[tuple(str(d).removeprefix("torch.") for d in GOSSIP_DTYPES)]  # type: ignore[valid-type]
"""`gossip_dtype` by name (`"bfloat16"`, `"float16"`, `"float32"`): what a YAML config or the command line gives."""


def check_options(
    topology: Any,
    combine: Any,
    momentum: Any,
    gossip_every: Any,
    gossip_steps: Any,
    eval_on: Any,
    bucket_cap_mb: Any,
    gossip_dtype: Any,
) -> Optional[torch.dtype]:
    """Raise `ValueError` naming the fix for any bad argument; return `gossip_dtype` resolved.

    Examples:
        >>> check_options("ring", "awc", "local", 1, 1, "average", 4.0, "bfloat16")
        torch.bfloat16
        >>> check_options("ring", "awc", "local", 1, {"epoch": {0: 4, 5: 1}}, "average", 4.0, None) is None
        True
        >>> check_options("ring", "acw", "local", 1, 1, "average", 4.0, None)
        Traceback (most recent call last):
        ...
        ValueError: `combine` must be one of ['awc', 'atc'], got 'acw'.
    """
    _check_choice("combine", combine, COMBINE)
    _check_choice("eval_on", eval_on, EVAL_ON)
    _check_choice("momentum", momentum, MOMENTUM)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"`bucket_cap_mb` must be positive, got {bucket_cap_mb!r}.")
    _check_positive_int("gossip_every", gossip_every)
    RoundsSchedule.of(gossip_steps)  # an integer, or rounds by epoch or step
    if isinstance(topology, str):
        topology_class(topology)  # raises naming the choices
    return _check_gossip_dtype(gossip_dtype)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def _check_gossip_dtype(dtype: Any) -> Optional[torch.dtype]:
    """`None`, or one of `GOSSIP_DTYPES` (also given by name: `"bfloat16"`, `"torch.bfloat16"`, `"float16"`)."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if resolved not in GOSSIP_DTYPES:
        names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in GOSSIP_DTYPES)
        raise ValueError(
            f"`gossip_dtype` must be None or a floating-point type messages can travel in ({names}), got {dtype!r}. "
            "Use gossip_dtype=torch.bfloat16 to halve the bytes of a float32 model."
        )
    return resolved


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer (1 = every step), got {value!r}.")


REGISTERED = (
    ("dpsgd", "local", "popen"),
    ("dpsgd_spawn", "local", "spawn"),
    ("dpsgd_fork", "local", "fork"),
    ("decentlam", "decentlam", "popen"),
    ("decentlam_spawn", "decentlam", "spawn"),
    ("decentlam_fork", "decentlam", "fork"),
)
"""The strategy names `import lightning_decentral` registers: `(name, momentum, start_method)`."""


def register_strategies(registry: Any, strategy: type) -> None:
    """Register `strategy` in `registry` (the Trainer's or Fabric's) under each name of `REGISTERED`."""
    for name, momentum, start_method in REGISTERED:
        registry.register(
            name,
            strategy,
            description=f"Decentralized training (gossip), momentum={momentum!r}, start_method {start_method!r}",
            override=True,
            momentum=momentum,
            start_method=start_method,
        )
