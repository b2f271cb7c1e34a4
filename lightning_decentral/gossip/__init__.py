"""Neighbour exchange on flat buffers over `torch.distributed`.

The one operation here is in-place gossip, `x_i <- sum_j W(k)_ij x_j`, applied
`rounds` times (`W(k)^r`). It is split into `start` (post the messages)
and `wait` (finish them and combine), so the caller can compute while the
bytes travel:

```python
gossip = Gossip(topology)
pending = gossip.start(buffers, step=k)   # non-blocking
...                                       # forward / backward
pending.wait()                            # buffers now hold W(k) x
```

With `out=` the buffers are only read, never written: they travel as they
are (no copy) and `out` receives `W(k)^r x − x` (adapt-with-combine's
correction, which [`AdaptWithCombine`][lightning_decentral.rules.AdaptWithCombine] adds after the
optimizer step).

Each rank derives its sends and receives from the same `W(k)`, a pure
function of `k`: every send has its matching receive on the peer, so the
schedule cannot deadlock. Transport, per exchange:

* `W(k) = 11ᵀ/n`: one all-reduce per buffer, always in the buffers' precision.
* otherwise one message per neighbour per flat buffer, point-to-point (`batch_isend_irecv`,
  which NCCL coalesces into one group call). On gloo it was the fastest neighbour exchange
  measured from 4 KB to 1 MB (20–40 % ahead of a broadcast on a 2-rank subgroup per edge) and
  tied with it (±5 %) at 16 and 64 MB (`benchmarks/transport.py`, `docs/benchmarks.md`);
  `transport="broadcast"` selects the per-edge broadcast. NCCL is not measured here.
* [`Hierarchical`][lightning_decentral.topology.Hierarchical]: two exchanges per round,
  `I ⊗ W_in` on one subgroup per node (an all-reduce when the inner topology is
  `complete`), then `W_out ⊗ I` on one subgroup per local rank. The subgroups
  are created when the engine is built, in the same order on every rank.

Low precision (`dtype=torch.bfloat16` or `float16`): neighbour messages carry
`q_i = x_i` rounded to `dtype` and the combine is `x_i <- x_i + Σ_j w_ij q_j − q_i`.
The column sums of `W` make `Σ_i` of the update zero, so `x̄` is kept exactly, and the
rounding error `x_i − q_i` stays in `x_i` and goes out in later rounds (error feedback).

Under bounded staleness (`DecentralizedStrategy(staleness=s)`) the mixer is
[`StaleGossip`][lightning_decentral.gossip.StaleGossip] (`stale.py`): it mixes with the newest replica received
from each neighbour, at most `s` steps old, over [`Links`][lightning_decentral.gossip.links.Links] (`links.py`),
threads that keep a receive posted so that no send waits for the receiver's training loop.

Compressed gossip (`compression=`) runs over [`CompressedGossip`][lightning_decentral.gossip.CompressedGossip]
(`compressed.py`): CHOCO's messages, one fixed-size uint8 tensor per out-neighbour and round, point-to-point through
the engine's [`post_messages`][lightning_decentral.gossip.Gossip.post_messages].
"""

from lightning_decentral.gossip.compressed import CompressedGossip, PendingCompressed
from lightning_decentral.gossip.engine import Gossip
from lightning_decentral.gossip.exchange import PendingGossip
from lightning_decentral.gossip.links import Links
from lightning_decentral.gossip.stale import PendingStale, StaleGossip

__all__ = ["CompressedGossip", "Gossip", "Links", "PendingCompressed", "PendingGossip", "PendingStale", "StaleGossip"]
