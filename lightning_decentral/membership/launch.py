"""`lightning-decentral-launch`: a launcher that lets the survivors live.

torchrun's agent stops every worker of its node when one of them fails (then restarts them all, or gives up);
Lightning's own launcher and `mp.spawn` end with their first failed child; and in all of them but torchrun, rank 0's
process hosts the job's store, which every survivor needs to agree. This launcher starts the workers of one node and
only watches them:

* it hosts the job's store itself, on the first node, outside every worker (and marks it with `LAUNCHER_KEY`, so
  that the workers know their store outlives them);
* a worker that dies or fails is reported, and the others go on;
* on the first node it stays up until the workers of every node are done (a node's launcher that falls silent for
  `NODE_SILENCE` seconds counts as done), since they all need the store;
* with `--max-restarts K`, a worker that dies or fails is started again, up to `K` times per worker, with the same
  command and environment: with `rejoin=True` it rejoins the run in progress
  ([Rejoining](../reliability/rejoining.md)); else it stops at once with `LeftOut`. Once a worker of the node has
  finished with 0, or every member of the run has left ([`run_over`][lightning_decentral.membership.rejoin.run_over]:
  the run is over), nobody is started again;
* it exits with 0 if some worker finished with 0 (the run survived), else with the first worker's failure code.

```bash
lightning-decentral-launch --nproc-per-node 4 train.py --max_steps 1000          # one machine
lightning-decentral-launch --nproc-per-node 4 --max-restarts 3 train.py         # a worker that dies is started again
lightning-decentral-launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 train.py
```

Each worker gets torchrun's environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_USE_AGENT_STORE=True`), so Lightning and
`torch.distributed` take it for a torchrun launch and connect to the launcher's store. The store's host is still the
run's single point of failure: the first node's launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_decentral.membership.rejoin import run_over
from lightning_decentral.membership.store import LAUNCHER_KEY

NODE_SILENCE = 30.0  # seconds without a beat after which the first node stops waiting for a node's launcher
_DONE = "lightning_decentral/launch/done"
_ALIVE = "lightning_decentral/launch/alive"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-decentral-launch",
        description="Start the workers of one node; host the job's store outside them; let the survivors live.",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job (one launcher on each)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (the first node hosts the store)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="the first node's address")
    parser.add_argument("--master-port", type=int, default=0, help="the store's port (0: a free one; one node only)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start a worker that died or failed again, at most this many times per worker (0: never)",
    )
    parser.add_argument("script", help="the training script every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be 1 or more (the workers on this node), got {args.nproc_per_node}.")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be 1 or more (the nodes of the job), got {args.nnodes}.")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}) for --nnodes {args.nnodes}, got {args.node_rank}.")
    if not 0 <= args.master_port <= 65535:
        parser.error(f"--master-port must be a port in [0, 65535] (0: a free one), got {args.master_port}.")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
    if args.nnodes > 1 and args.master_port == 0:
        parser.error("--master-port is needed with --nnodes > 1: every node's launcher must reach the same store.")
    return args


def _worker_env(args: argparse.Namespace, local: int, port: int, run: str) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(args.node_rank * args.nproc_per_node + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(args.nnodes * args.nproc_per_node),
        "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; its exit code."""
    args = parse(argv)
    first = args.node_rank == 0
    try:
        store = dist.TCPStore(
            args.master_addr, args.master_port, is_master=first, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
    except dist.DistNetworkError as error:
        if not first or "EADDRINUSE" not in str(error):
            raise
        print(
            f"lightning-decentral-launch: --master-port {args.master_port} is already in use on {args.master_addr} "
            "(another job's store?): choose another port, or --master-port 0 for a free one (one node only).",
            file=sys.stderr,
            flush=True,
        )
        return 1
    port = store.port
    if first:
        store.set(LAUNCHER_KEY, f"pid {os.getpid()} on {socket.gethostname()}")
    run = f"lightning-decentral-{port}"
    stop = threading.Event()
    threading.Thread(target=_beat, args=(args, port, stop), daemon=True).start()
    command = [sys.executable, args.script, *args.args]
    workers = [
        subprocess.Popen(command, env=_worker_env(args, local, port, run)) for local in range(args.nproc_per_node)
    ]
    restarts = [0] * len(workers)

    stopping = threading.Event()  # a signal was forwarded: a worker it ends is not started again

    def forward(signum: int, frame: Any) -> None:
        stopping.set()
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: dict[int, int] = {}
    while len(codes) < len(workers):
        for local, worker in enumerate(workers):
            if local not in codes and worker.poll() is not None:
                rank = args.node_rank * args.nproc_per_node + local
                print(
                    f"lightning-decentral-launch: worker {rank} (pid {worker.pid}) {_describe(worker.returncode)}",
                    flush=True,
                )
                over = 0 in codes.values() or run_over(
                    store
                )  # a worker finished, or every member left: nothing to rejoin
                if worker.returncode != 0 and restarts[local] < args.max_restarts and not (stopping.is_set() or over):
                    restarts[local] += 1
                    workers[local] = subprocess.Popen(command, env=_worker_env(args, local, port, run))
                    print(
                        f"lightning-decentral-launch: worker {rank} started again (pid {workers[local].pid}, restart "
                        f"{restarts[local]} of {args.max_restarts})",
                        flush=True,
                    )
                    continue
                codes[local] = worker.returncode
        time.sleep(0.05)
    store.add(_DONE, 1)
    if first:
        _wait_for_nodes(store, args.nnodes)
    stop.set()
    if 0 in codes.values():
        return 0
    first_failure = codes[0]
    return first_failure if first_failure > 0 else 128 - first_failure  # a signal: 128 + its number, as a shell says


def _beat(args: argparse.Namespace, port: int, stop: threading.Event) -> None:
    """Tell the first node this node's launcher is alive (its own client of the store)."""
    store = dist.TCPStore(args.master_addr, port, is_master=False, timeout=timedelta(seconds=300))
    while not stop.wait(1.0):
        store.add(f"{_ALIVE}/{args.node_rank}", 1)


def _wait_for_nodes(store: dist.TCPStore, nnodes: int) -> None:
    """Keep the store up until every node's launcher is done, or silent for `NODE_SILENCE` seconds."""
    heard = {node: (0, time.monotonic()) for node in range(1, nnodes)}  # beats, when they last changed
    while store.add(_DONE, 0) < nnodes:
        now = time.monotonic()
        for node, (beats, _) in heard.items():
            count = store.add(f"{_ALIVE}/{node}", 0)
            if count != beats:
                heard[node] = (count, now)
        if all(now - since > NODE_SILENCE for _, since in heard.values()):
            print("lightning-decentral-launch: the other nodes' launchers are silent; the store goes down", flush=True)
            return
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
