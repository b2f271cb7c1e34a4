"""Run a function on several gloo processes, the way a launcher would, and collect the results.

The processes are forked from a server that has imported torch, Lightning and the workers once
(``multiprocessing``'s forkserver), so a group starts in about a second instead of importing
everything in every process; each gets the parent's current directory and environment, as a
spawned process would.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.multiprocessing as mp


def benchmarks_harness() -> ModuleType:
    """``benchmarks/harness.py`` (the benchmarks are not a package): its network namespaces serve some tests."""
    name = "benchmarks_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = [
    "torch",
    "lightning.pytorch",
    "lightning_decentral",
    "tests.workers",
    "tests.gossip_workers",
    "tests.monitor_workers",
    "tests.reliability_workers",
    "tests.simulation_workers",
    "tests.fabric_workers",
    "tests.straggler_workers",
    "tests.restart_workers",
    "tests.survival_workers",
    "tests.compression_workers",
    "tests.sharded_workers",
]


def _entry(rank: int, world_size: int, port: int, fn: Callable, kwargs: dict, out: str, cwd: str, env: dict) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        PL_DISABLE_FORK="1",
    )
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(rank, world_size, **kwargs))
    except BaseException as exc:  # the parent re-raises it with the worker's traceback
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    partial = Path(out) / f"{rank}.partial"
    with open(partial, "wb") as f:
        pickle.dump(result, f)
    os.replace(partial, Path(out) / f"{rank}.pkl")  # the parent never reads half a result


def _failed(out: str, rank: int) -> bool:
    path = Path(out) / f"{rank}.pkl"
    if not path.exists():
        return False
    with open(path, "rb") as f:
        return pickle.load(f)[0] == "error"


def start_processes(
    fn: Callable, world_size: int, out: str, port: int | None = None, **kwargs: Any
) -> list[mp.Process]:
    """Start ``fn(rank, world_size, **kwargs)`` for every rank, meeting at ``MASTER_PORT=port`` (default: a free
    one); each writes ``("ok", result)`` or ``("error", traceback)`` to ``out/<rank>.pkl``."""
    port = free_port() if port is None else port
    return [start_rank(fn, rank, world_size, port, out, **kwargs) for rank in range(world_size)]


def start_rank(fn: Callable, rank: int, world_size: int, port: int, out: str, **kwargs: Any) -> mp.Process:
    """Start ``fn(rank, world_size, **kwargs)`` as rank ``rank`` of the job at ``MASTER_PORT=port`` (one rank of
    ``start_processes``, or one started again, with the same command, after it died)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts, on the first call
    process = context.Process(
        target=_entry, args=(rank, world_size, port, fn, kwargs, out, os.getcwd(), dict(os.environ)), daemon=False
    )
    process.start()
    return process


def run_distributed(fn: Callable, world_size: int = 4, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
    """``[fn(rank, world_size, **kwargs) for rank]``, each rank in its own process.

    The environment is the one Lightning's launcher gives its children (``LOCAL_RANK``,
    ``MASTER_PORT``...), so a ``Trainer(devices=world_size)`` built inside ``fn`` joins the
    group instead of launching. ``fn`` must be importable (defined at module level).
    """
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(fn, world_size, out, **kwargs)
        deadline = time.monotonic() + timeout
        try:
            # Poll, so that one failed rank ends the others instead of leaving them blocked in a collective.
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) or _failed(out, rank) for rank, p in enumerate(procs)):
                    break
                time.sleep(0.05)
        finally:
            alive = [p for p in procs if p.is_alive()]
            for p in alive:
                p.kill()
                p.join()
        if alive and time.monotonic() >= deadline:
            raise TimeoutError(f"{len(alive)} of {world_size} workers still running after {timeout:.0f} s")
        results = []
        for rank in range(world_size):
            path = Path(out) / f"{rank}.pkl"
            if not path.exists():
                continue  # killed after another rank failed, or died: reported below

            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        if len(results) < world_size:
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"workers died without a result (exit codes {codes})")
        return results


def assert_resumed_as_straight(runs: dict) -> None:
    """A run resumed mid-round (`runs["resumed"]`) ends with every worker's model bit for bit that of the run without
    a stop (`runs["straight"]`), and the part after the stop moved the models (`runs["first"]`, where recorded)."""
    for worker, (a, b) in enumerate(zip(runs["resumed"], runs["straight"])):
        assert torch.equal(a, b), f"worker {worker}"
    if "first" in runs:
        assert (runs["first"][0] - runs["straight"][0]).abs().max() > 1e-3  # the second epoch moved
