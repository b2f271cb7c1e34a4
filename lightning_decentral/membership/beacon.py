"""Whether a member's process is gone, asked directly instead of inferred from silence: a
[`Beacon`][lightning_decentral.membership.beacon.Beacon] each rank keeps open, and
[`gone`][lightning_decentral.membership.beacon.gone].

A heartbeat tells a slow member from a dead one only after a silence long enough not to mistake load for death. A
listening socket tells it at once: while the process lives, the kernel accepts a connection to it (even while the
process is busy, or holds the GIL); once the process is gone, the kernel refuses it. A host that is down or cut off
refuses nothing: a probe then says nothing, and the heartbeat's silence decides, as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import weakref

PROBE_TIMEOUT = 0.2  # seconds a probe waits for a connection to be accepted or refused


class Beacon:
    """A listening socket that stays open as long as this process lives: `address` (`host:port`, the host this
    machine reaches `toward` from) is where the other members probe it.

    Connections are accepted and closed at once by a daemon thread. A child forked from this process closes its
    copy, so that a data-loader worker does not keep a dead rank's beacon open.

    Examples:
        >>> beacon = Beacon("127.0.0.1")
        >>> gone(beacon.address)
        False
        >>> beacon.close()
        >>> gone(beacon.address)
        True
    """

    def __init__(self, toward: str | None) -> None:
        host = _local_host(toward)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server(("", 0), family=family, backlog=socket.SOMAXCONN)
        self.address = (
            f"[{host}]:{self._socket.getsockname()[1]}"
            if family == socket.AF_INET6
            else (f"{host}:{self._socket.getsockname()[1]}")
        )
        threading.Thread(target=self._answer, daemon=True, name="lightning_decentral-beacon").start()
        os.register_at_fork(after_in_child=functools.partial(_forget, weakref.ref(self._socket)))

    def _answer(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            connection.close()

    def close(self) -> None:
        """Stop listening: from now on a probe finds this process gone."""
        with contextlib.suppress(OSError):  # already closed
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(), which holds the socket open
        self._socket.close()


def _forget(listening: weakref.ref) -> None:
    """In a forked child: close this process's copy of the listening socket (not shut it down: the parent's listens
    on)."""
    copy = listening()
    if copy is not None:
        copy.close()


def gone(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the process whose [`Beacon`][lightning_decentral.membership.beacon.Beacon] listened at `address` is
    gone: its host refuses the connection. An accepted connection, or no answer within `timeout`, says no."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # no answer: a host down or unreachable says nothing about the process
        return False


def _local_host(toward: str | None) -> str:
    """This machine's address on the route to `toward` (the job's store), which the other members can reach."""
    if toward:
        try:
            family, _, _, _, target = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(target)  # a datagram socket sends nothing when it connects: it only picks the route
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
