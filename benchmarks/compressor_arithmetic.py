"""The arithmetic of one step of compressed gossip, per compressor, against a memcpy of the flat buffer.

    python benchmarks/compressor_arithmetic.py                         # 5.26M elements (step_time.py's MLP), CPU
    python benchmarks/compressor_arithmetic.py --numel 10000000,100000000 --device cuda --out arith.json
    python benchmarks/compressor_arithmetic.py --smoke                 # 4099 elements, 2 repeats (the test)
    python benchmarks/compressor_arithmetic.py --paths torch,native    # A/B: the torch path against the C kernel

One worker of one-peer gossip (one out-neighbour, one in-neighbour, a step of ``one_peer_exponential``) under
adapt-with-combine, what [`CompressedGossip`][lightning_decentral.gossip.CompressedGossip] computes in a training step
apart from the transport: ``ChocoExchange.outgoing`` (the message ``C(x − x̂)`` and the sent copy's update) and
``ChocoExchange.incoming`` of the neighbour's message (its copy's update and the correction ``γ Δ`` into ``out``).
The baseline is ``dst.copy_(src)`` of a buffer of the same size and dtype on the same device, timed in the same loop:
one compressor at a time, each of its steps after a copy; the table gives each median and its ratio to the copy's
(over all the copies of the run). Beside it, ``encode + decode alone``: the compressor's part of that step
(``fused.encode_update_`` of the message and ``fused.decode_add_`` of one, without the combine ``γ Δ``, which is the
same torch arithmetic for every compressor).
``--paths``: ``default`` (the package as installed: the C kernel of ``compression/native.py`` where it is built and
applies), or ``torch`` and ``native`` (the kernel) alternated step by step in one run.
On the CPU the clock is the process's CPU time (``time.process_time``: on a machine others load too, the cycles the
work takes rather than its waits for a core); on CUDA the wall time, bracketed by ``torch.cuda.synchronize()``.
Threads: ``--threads`` (default 1, as each worker of the step-time benchmarks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import harness
import torch

from lightning_decentral.compression import Choco, ChocoExchange, native, resolve_compression
from lightning_decentral.compression.fused import decode_add_, encode_update_
from lightning_decentral.topology import OnePeerExponential

COMPRESSORS = "sign,int8,int4,top_k:0.01,random_k:0.01"
PATHS = ("default", "torch", "native")
STEP_TIME_NUMEL = harness.count_parameters(harness.FULL_WIDTHS)  # the parameters of step_time.py's MLP


class Exchange:
    """Worker 0's side of one-peer CHOCO gossip of a `numel`-element buffer, with its neighbour's message ready."""

    def __init__(self, compression: str, numel: int, device: torch.device) -> None:
        compressor = resolve_compression(compression)
        self.topology = OnePeerExponential(world_size=2)
        generator = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(numel, generator=generator, device=device)
        self.out = torch.empty_like(self.x)
        self.choco = Choco(compressor, compressor.consensus_step, rank=0)
        peer = Choco(compressor, compressor.consensus_step, rank=1)
        other = torch.randn(numel, generator=generator, device=device)
        self.message = ChocoExchange(peer, self.topology, [other], 0, 1, out=[torch.empty_like(other)]).outgoing(0)[0]
        self.step = 0

    def __call__(self) -> None:
        exchange = ChocoExchange(self.choco, self.topology, [self.x], self.step, 1, out=[self.out])
        exchange.outgoing(0)
        exchange.incoming(0, {1: self.message})
        self.step += 2  # an even step: the same edge 0 ↔ 1


class Codec:
    """The compressor's part of `Exchange`'s step alone: `encode_update_` of worker 0's message (its sent copy
    updated) and `decode_add_` of a message of the same size into a received copy."""

    def __init__(self, compression: str, numel: int, device: torch.device) -> None:
        self.compressor = resolve_compression(compression)
        generator = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(numel, generator=generator, device=device)
        self.sent, self.received, self.work = (torch.zeros_like(self.x) for _ in range(3))
        size = self.compressor.payload_bytes(numel, self.x.dtype)
        self.payload = torch.empty(size, dtype=torch.uint8, device=device)
        self.step = 0

    def __call__(self) -> None:
        encode_update_(self.compressor, self.x, self.sent, self.step, self.payload, self.work)
        decode_add_(self.compressor, self.payload, self.received, self.step)
        self.step += 1


def on_path(path: str, work: Callable[[], Any]) -> Callable[[], Any]:
    """`work` on `path`: as the package runs it (`default`), or with the C kernel switched on (`native`) or off
    (`torch`) for its duration."""
    if path == "default":
        return work

    def switched() -> Any:
        previous = native.enable(path == "native")
        try:
            return work()
        finally:
            native.enable(previous)

    return switched


def timed(work: Callable[[], Any], device: torch.device) -> float:
    """Seconds `work()` takes: on the CPU the CPU time of this process (all its threads: what the work costs, not
    the waits of a loaded machine), on CUDA the wall time with the device synchronized before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.process_time()
    work()
    return time.process_time() - start


def measure(
    numel: int, compressors: list[str], repeats: int, device: torch.device, paths: tuple[str, ...] = ("default",)
) -> list[dict[str, Any]]:
    """One row per compressor and path and one for the copy: median seconds per step and the ratio to the copy's
    median, and the same of encode + decode alone (`codec_`). One compressor's buffers at a time (a billion elements
    fit a GPU once), its steps alternating with copies, and the paths alternating step by step."""
    source = torch.randn(numel, device=device)
    target = torch.empty_like(source)

    def copy() -> None:
        target.copy_(source)

    copy()  # first-touch pages
    times: dict[tuple[str, str], list[float]] = {("copy", ""): []}
    codec_times: dict[tuple[str, str], list[float]] = {}
    for name in compressors:
        runs = {
            path: (on_path(path, Exchange(name, numel, device)), on_path(path, Codec(name, numel, device)))
            for path in paths
        }
        for exchange, codec in runs.values():  # warm-up: the copies made, allocator and lazy initialisation
            exchange()
            codec()
        for path in paths:
            times[name, path], codec_times[name, path] = [], []
        for _ in range(repeats):
            times["copy", ""].append(timed(copy, device))
            for path, (exchange, codec) in runs.items():
                times[name, path].append(timed(exchange, device))
                codec_times[name, path].append(timed(codec, device))
        del runs
    baseline = max(statistics.median(times["copy", ""]), 1e-9)  # a clock tick at the least
    rows = []
    for (name, path), seconds in times.items():
        row = {
            "numel": numel,
            "compressor": name,
            "path": path,
            "median_s": statistics.median(seconds),
            "quartiles_s": [harness.quantile(seconds, 0.25), harness.quantile(seconds, 0.75)],
            "ratio_to_copy": statistics.median(seconds) / baseline,
        }
        if (name, path) in codec_times:
            codec = statistics.median(codec_times[name, path])
            row.update(codec_median_s=codec, codec_ratio_to_copy=codec / baseline)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['device']}, {meta['threads']} thread(s), {meta['repeats']} repeats; load average at start "
        f"{meta['load']:.1f}; C kernel built: {meta['native']}. Command: `{meta['command']}`",
        "",
        f"| elements | arithmetic of one step | path | median {meta['clock']} (ms) | quartiles (ms) | / copy_ of the "
        "buffer | encode + decode alone (ms) | / copy_ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = "copy_ (memcpy baseline)" if r["compressor"] == "copy" else r["compressor"]
        low, high = r["quartiles_s"]
        codec = f"{r['codec_median_s'] * 1e3:.2f} | {r['codec_ratio_to_copy']:.2f}" if "codec_median_s" in r else "|"
        lines.append(
            f"| {r['numel']:,} | {label} | {r['path']} | {r['median_s'] * 1e3:.2f} | {low * 1e3:.2f}–{high * 1e3:.2f} "
            f"| {r['ratio_to_copy']:.2f} | {codec} |"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default=None, help=f"comma-separated buffer sizes (default {STEP_TIME_NUMEL})")
    parser.add_argument("--compressors", default=COMPRESSORS, help=f"comma-separated (default {COMPRESSORS})")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per compressor (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--paths", default="default", help=f"comma-separated of {', '.join(PATHS)} (default: default)")
    parser.add_argument("--smoke", action="store_true", help="4099 elements, 2 repeats")
    args = parser.parse_args(argv)
    args.numel = [int(n) for n in (args.numel or ("4099" if args.smoke else str(STEP_TIME_NUMEL))).split(",")]
    args.repeats = args.repeats or (2 if args.smoke else 20)
    args.compressors = args.compressors.split(",")
    for name in args.compressors:
        try:
            resolve_compression(name)
        except ValueError as error:
            parser.error(str(error))
    args.paths = tuple(args.paths.split(","))
    if any(path not in PATHS for path in args.paths):
        parser.error(f"--paths takes {', '.join(PATHS)}, got {','.join(args.paths)}")
    if "native" in args.paths and not native.AVAILABLE:
        parser.error("--paths native needs the C kernel: `pip install -e .` or `python setup.py build_ext --inplace`")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA build of torch and a GPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    harness.use_threads(args.threads)
    device = torch.device(args.device)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "clock": "wall time" if device.type == "cuda" else "CPU time",
        "repeats": args.repeats,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
        "command": harness.command_line(__file__, argv),
        "native": native.AVAILABLE,
    }
    rows = [row for numel in args.numel for row in measure(numel, args.compressors, args.repeats, device, args.paths)]
    table = render(rows, meta)
    print(table)
    harness.write_outputs(args.out, {"meta": meta, "rows": rows}, table, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
