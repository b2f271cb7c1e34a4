"""[`Links`][lightning_decentral.gossip.links.Links]: one rank's messages to and from its neighbours, none of which
waits for the other side's training loop.

A gloo send completes only once the receiver has posted its receive, so a rank that posts its receives only
when it reaches step `k` holds its neighbours back until then. Here one thread per in-neighbour always has a
receive posted and files each message under its step, and one thread per out-neighbour sends, so neither
side's training loop ever waits inside gloo: the loop waits on a condition variable, with a deadline.

Every message has the same size (a receive is posted before its message exists):

```text
bytes [0, 32)    int64[4] header: step, kind (0 DATA, 1 FINAL), 0, 0
bytes [32, ...)  payload: the exchange's buffers, each starting on an 8-byte boundary
```

A run ends on each edge with FINAL, the sender's last message: [`close`][lightning_decentral.gossip.links.Links.close]
sends it to every out-neighbour and returns once every in-neighbour's FINAL has arrived, so no thread is left
inside gloo when the group is destroyed (a thread blocked in a gloo receive at interpreter exit aborts the
process). After a failure, [`abort`][lightning_decentral.gossip.links.Links.abort] closes every connection of the
links' group, which ends the threads at once and tells the neighbours.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

DATA = 0
FINAL = 1
HEADER_BYTES = 32
IDLE = timedelta(days=7)
"""The op timeout of the links' own group: a link may stay idle this long (validation, checkpoints); the training
loop's waits are bounded by the strategy's `timeout` instead."""


def payload_layout(buffers: Sequence[Tensor]) -> list[tuple[int, int]]:
    """`(offset, bytes)` of each buffer in a message: after the header, each on an 8-byte boundary.

    Examples:
        >>> payload_layout([torch.zeros(3), torch.zeros(2, dtype=torch.float64)])
        [(32, 12), (48, 16)]
    """
    layout = []
    offset = HEADER_BYTES
    for buffer in buffers:
        size = buffer.numel() * buffer.element_size()
        layout.append((offset, size))
        offset += -(-size // 8) * 8
    return layout


def message_bytes(buffers: Sequence[Tensor]) -> int:
    """The size of a message carrying `buffers`: the header, then each buffer on an 8-byte boundary.

    Examples:
        >>> message_bytes([torch.zeros(3), torch.zeros(2, dtype=torch.float64)])
        64
    """
    offset, size = payload_layout(buffers)[-1]
    return offset + -(-size // 8) * 8


class Links:
    """Messages of `message_bytes` bytes from `sources` and to `destinations` (ranks of `group`), on threads.

    Args:
        group: the process group (gloo) the messages travel on; `None`: the default one.
        sources: the ranks this rank receives from (its in-neighbours).
        destinations: the ranks it sends to (its out-neighbours).
        message_bytes: the size of every message, header included.
        tag: the gloo tag of the messages.

    The training loop calls [`new_message`][lightning_decentral.gossip.links.Links.new_message], fills its payload,
    [`send`][lightning_decentral.gossip.links.Links.send]s it, and reads what arrived with
    [`wait_until`][lightning_decentral.gossip.links.Links.wait_until],
    [`held`][lightning_decentral.gossip.links.Links.held] and
    [`release`][lightning_decentral.gossip.links.Links.release].
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        sources: Sequence[int],
        destinations: Sequence[int],
        message_bytes: int,
        tag: int = 0,
    ) -> None:
        self.group = group
        self.tag = tag
        self.message_bytes = message_bytes
        world = group if group is not None else dist.group.WORLD
        self._global = {r: dist.get_global_rank(world, r) for r in set(sources) | set(destinations)}
        self.sources = list(sources)
        self.destinations = list(destinations)
        self.final: dict[int, int] = {}  # source -> the step of its FINAL (its last step)
        self.errors: dict[int, BaseException] = {}  # peer -> what its thread raised
        self._held: dict[int, dict[int, Tensor]] = {j: {} for j in self.sources}  # source -> step -> message
        self._changed = threading.Condition()
        self._free: list[Tensor] = []  # received messages to reuse
        self._spare: list[Tensor] = []  # sent messages to reuse
        self._senders_left: dict[int, int] = {}  # id(message) -> sends not yet done
        self._queues: dict[int, queue.SimpleQueue] = {j: queue.SimpleQueue() for j in self.destinations}
        self._closing = False
        self._threads = [
            threading.Thread(target=self._receive, args=(j,), daemon=True, name=f"gossip-from-{j}")
            for j in self.sources
        ]
        self._threads += [
            threading.Thread(target=self._send, args=(j,), daemon=True, name=f"gossip-to-{j}")
            for j in self.destinations
        ]
        for thread in self._threads:
            thread.start()

    # -- the training loop's side ------------------------------------------------------------------

    def new_message(self) -> Tensor:
        """An unused message (`uint8`, `message_bytes`), to fill and send."""
        with self._changed:
            return self._spare.pop() if self._spare else torch.empty(self.message_bytes, dtype=torch.uint8)

    def send(self, message: Tensor, step: int, kind: int = DATA) -> None:
        """Send `message` as this rank's message of `step` to every destination; returns at once (it is reused
        once every destination has it)."""
        message[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([step, kind, 0, 0]))
        with self._changed:
            self._senders_left[id(message)] = len(self.destinations)
        for j in self.destinations:
            self._queues[j].put((message, kind))
        if not self.destinations:
            self._recycle(message)

    def held(self, source: int) -> dict[int, Tensor]:
        """The messages held from `source`, by step (read it inside `wait_until`'s condition or after it)."""
        return self._held[source]

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Block until `ready()` (called with the messages locked), a thread's error, or `time.monotonic()` passes
        `deadline`; whether `ready()` held. Raise a thread's error first."""
        with self._changed:
            while True:
                if self.errors:
                    peer, error = next(iter(self.errors.items()))
                    raise RuntimeError(f"rank {self._global[peer]}: {error}") from error
                if ready():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def release(self, source: int, below: int) -> None:
        """Reuse the messages from `source` of steps below `below`."""
        with self._changed:
            held = self._held[source]
            for step in [t for t in held if t < below]:
                self._free.append(held.pop(step))

    def global_rank(self, peer: int) -> int:
        """The global rank of `peer`, a rank of the links' group."""
        return self._global[peer]

    # -- the end -------------------------------------------------------------------------------------

    def close(self, step: int, timeout: float) -> list[int]:
        """Send FINAL (this rank's last step `step`) on every out-edge and wait, at most `timeout` seconds, for
        every in-neighbour's FINAL and every send to finish; return the global ranks that did not (none: clean).
        Raise a thread's error."""
        self.send(self.new_message(), step, kind=FINAL)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            self.wait_until(lambda: False, deadline=0.0)  # raises it
        return sorted(self._global[int(t.name.rsplit("-", 1)[1])] for t in self._threads if t.is_alive())

    def abort(self, limit: float = 5.0) -> None:
        """After a failure: close the connection to every neighbour whose thread still runs (a gloo wait that
        times out closes its connection), which ends those threads and tells the neighbours; wait `limit` seconds
        at most for them to end."""
        self._closing = True
        for j in self._queues:
            self._queues[j].put(None)
        peers = {int(t.name.rsplit("-", 1)[1]) for t in self._threads if t.is_alive()}
        for peer in sorted(peers):
            try:
                dist.irecv(torch.empty(1), src=self._global[peer], group=self.group, tag=self.tag + 1).wait(
                    timedelta(milliseconds=1)
                )
            except RuntimeError:
                pass  # the timeout closed the connection, or it was closed already
        deadline = time.monotonic() + limit
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the threads -----------------------------------------------------------------------------------

    def _receive(self, source: int) -> None:
        try:
            while True:
                with self._changed:
                    message = self._free.pop() if self._free else torch.empty(self.message_bytes, dtype=torch.uint8)
                dist.recv(message, src=self._global[source], group=self.group, tag=self.tag)  # gloo lets go of the GIL
                step, kind = message[:HEADER_BYTES].view(torch.int64)[:2].tolist()
                with self._changed:
                    if kind == FINAL:
                        self.final[source] = step
                        self._free.append(message)
                    else:
                        self._held[source][step] = message
                    self._changed.notify_all()
                if kind == FINAL:
                    return
        except RuntimeError as error:  # the peer died, or abort closed the connection
            self._fail(source, error)

    def _send(self, destination: int) -> None:
        try:
            while True:
                item = self._queues[destination].get()
                if item is None:
                    return
                message, kind = item
                dist.send(message, dst=self._global[destination], group=self.group, tag=self.tag)
                self._recycle(message)
                if kind == FINAL:
                    return
        except RuntimeError as error:
            self._fail(destination, error)

    def _recycle(self, message: Tensor) -> None:
        with self._changed:
            self._senders_left[id(message)] -= 1
            if self._senders_left[id(message)] <= 0:
                del self._senders_left[id(message)]
                self._spare.append(message)

    def _fail(self, peer: int, error: BaseException) -> None:
        with self._changed:
            if not self._closing:
                self.errors.setdefault(peer, error)
            self._changed.notify_all()
