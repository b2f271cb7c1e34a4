"""How long a rank waits for a silent peer: the strategies' `timeout` argument, its default
([`DEFAULT_TIMEOUT`][lightning_decentral.timeouts.DEFAULT_TIMEOUT]) and its check
([`checked_timeout`][lightning_decentral.timeouts.checked_timeout])."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed.constants import default_pg_timeout

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""The strategies' default `timeout`: how long a rank waits for a silent peer (a collective, an exchange, the
rendezvous) before it stops with an error naming it. Lightning's is 30 minutes, long enough to pass for a hang; ranks
that run different collectives stop at once ([`Activities`][lightning_decentral.agreement.Activities])."""


def checked_timeout(timeout: Any) -> timedelta:
    """The strategies' `timeout` argument, checked when they are built (the Trainer's and Fabric's
    `DecentralizedStrategy` call it): a positive `datetime.timedelta`. A bare number is refused rather than taken as
    seconds, as Lightning's and torch's `timeout` are (a `timedelta` says its unit); `None` is torch's default, 30
    minutes. Without the check, a zero, negative or numeric timeout fails only when the ranks meet, with torch's
    error.

    Examples:
        >>> checked_timeout(timedelta(seconds=30)), checked_timeout(None)
        (datetime.timedelta(seconds=30), datetime.timedelta(seconds=1800))
        >>> checked_timeout(30)
        Traceback (most recent call last):
        ...
        TypeError: timeout=30 is a number: pass a datetime.timedelta, e.g. timeout=timedelta(seconds=30) ...
        >>> checked_timeout(timedelta(0))
        Traceback (most recent call last):
        ...
        ValueError: timeout=timedelta(0) is not positive: ...
    """
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        raise TypeError(
            f"timeout={timeout!r} is a number: pass a datetime.timedelta, e.g. timeout=timedelta(seconds={timeout!r}) "
            "(how long a rank waits for a silent peer; a number is refused, its unit would be a guess)."
        )
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=5), got {type(timeout).__name__} "
            f"{timeout!r}."
        )
    if timeout <= timedelta(0):
        shown = "timedelta(0)" if not timeout else f"timedelta(seconds={timeout.total_seconds():g})"
        raise ValueError(
            f"timeout={shown} is not positive: it is how long a rank waits for a silent peer before it stops with an "
            f"error; pass a positive datetime.timedelta (the default is {DEFAULT_TIMEOUT})."
        )
    return timeout
