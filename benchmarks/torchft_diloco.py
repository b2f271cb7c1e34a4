"""The outside anchor of ``outer_network.py``: torchft's ``DiLoCo`` on the same task and the same emulated network.

torchft is not a dependency of this project: run this script with a Python that has it (a throwaway virtual
environment, ``python -m venv /tmp/tftvenv --system-site-packages && /tmp/tftvenv/bin/pip install torchft``)
and this repository on ``PYTHONPATH``; as root on Linux.

    PYTHONPATH=$PWD:/work/main/.venv/lib/python3.11/site-packages /tmp/tftvenv/bin/python benchmarks/torchft_diloco.py
    ... benchmarks/torchft_diloco.py --profiles 100mbit --methods ddp,diloco,outer_one_peer --out t.md --out t.json
    ... benchmarks/torchft_diloco.py --smoke

The same worker processes first run ``outer_network.py``'s methods (``--methods``, by default ``ddp`` and this
library's ``diloco``), then torchft's DiLoCo, so that its figures are ratios against ``ddp`` in the same run. Each
host runs one replica group of one process (``torchft.Manager`` over ``ProcessGroupGloo``, its own TCPStore);
host 0 also runs the lighthouse (``LighthouseServer``, ``min_replicas`` = all hosts). The model, data, inner AdamW,
outer Nesterov SGD (lr 0.7, momentum 0.9), ``H`` and the measurements are ``outer_network.py``'s; the loop is a
plain PyTorch loop (torchft's ``DiLoCo`` wraps the optimizer, not a Lightning Trainer). The replicas start from
the same seeded weights with ``init_sync=False``: torchft's first-quorum healing would fetch the weights from
``socket.gethostname()``, which names the machine, not the emulated host. torchft counts no bytes: only eth0's.
Each process times from its own start (there is no group across the hosts before torchft's first quorum; they
arrive from the previous job together).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import harness
import outer
import outer_network
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LIGHTHOUSE_PORT, STORE_PORT, MANAGER_PORT = 29510, 29520, 29530


@contextlib.contextmanager
def managed(
    model: torch.nn.Module, addresses: list[str], host: int, group_rank: int, group_size: int, hosts: int
) -> Iterator[Any]:
    """A ``torchft.Manager`` for rank ``group_rank`` of the replica group of ``group_size`` ranks on host ``host`` (of
    ``hosts``), with what it needs up while it lives: the lighthouse on host 0's first rank, the group's ``TCPStore`` on
    its first rank; gloo across the groups, the replicas starting from the same seeded weights (``init_sync=False``),
    120 s for every wait. All three are shut down when the block ends."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    first = host == 0 and group_rank == 0
    lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=hosts) if first else None
    store = (
        torch.distributed.TCPStore(addresses[host], STORE_PORT, is_master=True, wait_for_workers=False)
        if group_rank == 0
        else None
    )
    wait = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        min_replica_size=hosts,
        use_async_quorum=False,
        init_sync=False,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"host{host}",
        store_addr=addresses[host],
        store_port=STORE_PORT,
        rank=group_rank,
        world_size=group_size,
        lighthouse_addr=f"http://{addresses[0]}:{LIGHTHOUSE_PORT}",
        hostname=addresses[host],
        port=MANAGER_PORT,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()
        del store  # kept until the manager is shut down


def epochs(train: torch.Tensor, batch: int, replicas: int, rank: int) -> Iterator[Any]:
    """Batches of ``train`` for ``rank`` of ``replicas``, epoch after epoch, reshuffled as Lightning's sampler is."""
    dataset = TensorDataset(train)
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch, drop_last=True, sampler=sampler)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def _torchft(config: dict[str, Any], data: dict[str, Any], addresses: list[str], rank: int) -> dict[str, Any]:
    """One replica group (one process) on host ``rank``: DiLoCo's loop, a curve point every ``H`` steps."""
    from torchft.local_sgd import DiLoCo

    n, every = len(addresses), config["every"]
    torch.manual_seed(0)
    model = outer.ByteGPT(config["context"], config["width"], config["layers"])
    inner = model.configure_optimizers()  # outer.py's AdamW
    batches = epochs(data["train"], config["batch"], n, rank)
    total = round(config["extend"] * config["steps"])

    points, paused = [], 0.0
    received0, sent0 = harness.interface_bytes(harness.EmulatedNetwork.interface)
    start = time.monotonic()
    with (
        managed(model, addresses, host=rank, group_rank=0, group_size=1, hosts=n) as manager,
        DiLoCo(
            manager,
            [model],
            inner,
            outer.NESTEROV(model.parameters()),
            sync_every=every,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ),
    ):
        for step, batch in enumerate(batches, start=1):
            loss = model.loss(batch)
            inner.zero_grad()
            loss.backward()
            inner.step()  # DiLoCo's hook: every H steps, the pseudo-gradients all-reduced and the outer step
            if step % every == 0 or step in (config["steps"], total):
                now = time.monotonic()
                received, sent = harness.interface_bytes(harness.EmulatedNetwork.interface)
                with torch.no_grad():
                    val = float(model.loss((data["val"],)))
                points.append(
                    {
                        "step": step,
                        "seconds": now - start - paused,
                        "loss": val,
                        "counted": None,
                        "eth0_sent": sent - sent0,
                        "eth0_received": received - received0,
                    }
                )
                paused += time.monotonic() - now
            if step == total:
                break
    return {"points": points, "load": [os.getloadavg()[0]]}


def _work(spec: dict[str, Any], data: dict[str, Any], addresses: list[str], rank: int) -> list[dict[str, Any]]:
    """One worker: ``outer_network.py``'s methods (Lightning), then torchft's DiLoCo, in the same processes."""
    ours = outer_network.work(spec, data, rank)
    return [*ours, {"method": "torchft_diloco", **_torchft(spec["config"], data, addresses, rank)}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="1gbit,100mbit")
    parser.add_argument("--methods", default="ddp,diloco", help="outer_network.py's methods run first (ddp always)")
    parser.add_argument("--steps", type=int, default=None, help="default: outer_network.py's")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", action="append", default=[], help="write results: .md or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="outer_network.py's smoke task (2 hosts, 4 steps, H = 2)")
    args = parser.parse_args(argv)
    task = outer_network.parse(
        ["--methods", args.methods]
        + (["--smoke"] if args.smoke else [])
        + ([] if args.steps is None else ["--steps", str(args.steps)])
    )
    if args.smoke:
        args.profiles = "1gbit"
    ok, why = harness.netns_permitted()
    if not ok:
        print(f"torchft_diloco.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    harness.exit_on_sigterm()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum otherwise
    config = {
        k: getattr(task, k) for k in ("steps", "extend", "every", "batch", "context", "width", "layers", "threads")
    }
    windows = outer.sequences(outer.stdlib_bytes(task.bytes), task.context)
    split = int(0.9 * len(windows))
    data = {"train": windows[:split], "val": windows[split:][: task.val_windows]}
    command = harness.command_line(__file__, argv)
    same_topology = {**outer_network.SAME_TOPOLOGY_EVERY_STEP, "torchft_diloco": "ddp"}
    results: dict[str, Any] = {"meta": {"command": command, "config": config, "workers": task.workers}, "profiles": []}
    tables = []
    for name in args.profiles.split(","):
        load = os.getloadavg()[0]
        with harness.EmulatedNetwork(task.workers, harness.PROFILES[name]) as network:
            goodput = network.throughput_gbit(0.5 if args.smoke else 1.0)
            spec = {"config": config, "methods": task.methods}
            work = functools.partial(_work, spec, data, network.addresses)
            records = harness.run_ranks(work, task.workers, timeout=args.timeout, network=network)
        names = [job["method"] for job in records[0]]
        curves = {m: outer_network.combine([r[i] for r in records]) for i, m in enumerate(names)}
        profile = {
            "link": asdict(network.link),
            "shaping": network.shaping,
            "goodput_gbit": goodput,
            "load": [load, os.getloadavg()[0]],
            "skipped": {},
            "curves": curves,
            "rows": outer_network.summarize(curves, task.steps, same_topology),
        }
        results["profiles"].append(profile)
        tables.append(outer_network.render(profile, task.every, command))
        print("\n" + tables[-1] + "\n", flush=True)
    harness.write_outputs(args.out, results, "\n\n".join(tables), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
