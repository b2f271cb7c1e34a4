"""Mixers: what the update rules call to apply `W(k)^r` to a replica's flat buffers.

A mixer has one operation, split in two so that computation can run while bytes travel:

```python
pending = mixer.start(buffers, step, rounds)   # post round one of W(step)^rounds
...                                            # forward, backward
pending.wait()                                 # buffers now hold W(step)^rounds x
```

With `out=` the buffers are only read and `out` receives `W^r x − x` (adapt-with-combine's
correction). Two mixers implement it:

* [`Gossip`][lightning_decentral.gossip.Gossip]: rank `i` of `n` processes, over `torch.distributed`;
* [`DenseMixer`][lightning_decentral.mixing.DenseMixer]: all `n` workers in one process, `W` applied
  to their stacked buffers. The rules are tested against the dense reference with it.

Every exchange is published to the mixer's `observers` as an
[`ExchangeEvent`][lightning_decentral.mixing.ExchangeEvent]: the one public way to watch the bytes
and the timing of the communication (the monitors, the tests and the benchmarks use it).

The package: `protocol` (`Mixer`, `Pending`, the observer and its event), `dense` (`DenseMixer`, one view per
worker), `stacked` (`StackedMixer`, every worker in one call, for the vectorized simulation), `delays` (bounded
staleness: which step of each neighbour a worker mixes with, `RandomDelays`, and `DelayedMixing`, the dense mixers'
`W` with delays).
"""

from lightning_decentral.mixing.delays import (
    DelayedMixing,
    DelaySchedule,
    RandomDelays,
    check_stale_topology,
    imposed_step,
)
from lightning_decentral.mixing.dense import DenseMixer, DenseView, stages
from lightning_decentral.mixing.protocol import (
    FABRIC,
    SIMULATION,
    TRAINER,
    BytesSent,
    ExchangeEvent,
    ExchangeObserver,
    Mixer,
    Pending,
    Phrasing,
    StartsCopies,
    Watch,
    Watched,
    notify_post,
    notify_wait,
    raise_if_not_finite,
)
from lightning_decentral.mixing.stacked import StackedMixer

__all__ = [
    "FABRIC",
    "SIMULATION",
    "TRAINER",
    "BytesSent",
    "DelaySchedule",
    "DelayedMixing",
    "DenseMixer",
    "DenseView",
    "ExchangeEvent",
    "ExchangeObserver",
    "Mixer",
    "Pending",
    "Phrasing",
    "RandomDelays",
    "StackedMixer",
    "StartsCopies",
    "Watch",
    "Watched",
    "check_stale_topology",
    "imposed_step",
    "notify_post",
    "notify_wait",
    "raise_if_not_finite",
    "stages",
]
