"""Worker functions that drive :class:`~lightning_decentral.gossip.CompressedGossip` directly (no Lightning), and the
driving loop the single-process side of the tests runs on a compressing ``DenseMixer``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_decentral.compression import resolve_compression
from lightning_decentral.gossip import CompressedGossip, Gossip
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver, Mixer
from lightning_decentral.topology import resolve_topology
from tests.helpers import benchmarks_harness

SIZES = (300, 17)  # the flat buffers of a worker: parameters, module buffers


def worker_buffers(rank: int) -> list[torch.Tensor]:
    """Worker `rank`'s buffers at the start (different on every worker)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(size, generator=generator) for size in SIZES]


def drive(mixers: Sequence[Mixer], buffers: Sequence[list[torch.Tensor]], steps: range, rounds: int) -> None:
    """Steps `steps` of gossip alone for the workers of `mixers` (all posted before any waits): even steps mix the
    buffers in place (adapt-then-combine), odd steps ask for the correction with `out=` and add it
    (adapt-with-combine)."""
    for step in steps:
        outs = [[torch.empty_like(t) for t in b] if step % 2 else None for b in buffers]
        pending = [m.start(b, step, rounds, out=o) for m, b, o in zip(mixers, buffers, outs)]
        for p in pending:
            p.wait()
        for b, o in zip(buffers, outs):
            for t, correction in zip(b, o or []):
                t.add_(correction)


class Bytes(ExchangeObserver):
    """The bytes the exchanges' events announce."""

    def __init__(self) -> None:
        self.sent = 0

    def on_post(self, event: ExchangeEvent) -> None:
        self.sent += event.bytes_sent


def _mixer(topology: str, compression: str, world_size: int, overlap: bool) -> CompressedGossip:
    engine = Gossip(resolve_topology(topology, world_size))
    return CompressedGossip(engine, resolve_compression(compression), overlap=overlap)


def compressed_runs(
    rank: int, world_size: int, cases: list[tuple[str, str, int, int]], overlaps: Sequence[bool] = (True,)
) -> dict[tuple, Any]:
    """For each `(topology, compression, steps, rounds)` and each `overlap` of `overlaps` (the exchanges on the mixer's
    helper thread, or on this one), under the key `case + (overlap,)`: `drive` this rank's buffers, and the same run
    saved halfway and resumed on a new mixer from its `state_dict`."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for case in cases:
            topology, compression, steps, rounds = case
            for overlap in overlaps:
                mixer = _mixer(topology, compression, world_size, overlap)
                count = Bytes()
                mixer.observers.append(count)
                buffers = worker_buffers(rank)
                drive([mixer], [buffers], range(steps), rounds)
                halfway = _mixer(topology, compression, world_size, overlap)
                resumed = worker_buffers(rank)
                drive([halfway], [resumed], range(steps // 2), rounds)
                again = _mixer(topology, compression, world_size, overlap)
                again.load_state_dict(halfway.state_dict())
                drive([again], [resumed], range(steps // 2, steps), rounds)
                for used in (mixer, halfway, again):
                    used.close()  # the helper thread ends (joined)
                results[(*case, overlap)] = {
                    "buffers": buffers,
                    "resumed": resumed,
                    "wire_bytes": mixer.wire_bytes,
                    "resumed_wire_bytes": again.wire_bytes,
                    "announced": count.sent,
                }
        return results
    finally:
        dist.destroy_process_group()


def wire_bytes(
    rank: int, world_size: int, sizes: dict[Any, int], repeats: int, steps: int, namespace: str | None = None
) -> dict[Any, list]:
    """For each compression of `sizes` (`None`: plain gossip) on a ring: `repeats` times, `(counted, measured)`, the
    bytes every rank counted for `steps` exchanges of a buffer of `sizes[compression]` elements, and the loopback
    counter's growth meanwhile (read on rank 0, before the others start and after they all finished). `namespace`:
    first enter that network namespace (every rank the same), whose loopback the job then has to itself."""
    harness = benchmarks_harness()
    if namespace is not None:
        harness.enter_namespace(namespace)
    loopback_bytes = lambda: harness.interface_bytes("lo")[0]  # noqa: E731  (received: on lo, every byte sent)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        topology = resolve_topology("ring", world_size)
        out: dict[Any, list] = {}
        for compression, numel in sizes.items():
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            gossip = Gossip(topology)
            mixer = gossip if compression is None else CompressedGossip(gossip, resolve_compression(compression))
            out[compression] = []
            for _ in range(repeats):
                dist.barrier()
                before = loopback_bytes()
                dist.barrier()  # read before any rank sends
                counted = 0 if compression is None else -mixer.wire_bytes
                for step in range(steps):
                    counted += mixer.bytes_sent([x], step) if compression is None else 0
                    mixer.start([x.clone()], step).wait()
                counted += 0 if compression is None else mixer.wire_bytes
                dist.barrier()
                measured = loopback_bytes() - before
                total = torch.tensor([counted])
                dist.all_reduce(total)
                out[compression].append((int(total), measured))
        return out
    finally:
        dist.destroy_process_group()
