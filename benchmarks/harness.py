"""What every benchmark shares: start ranks, optionally on an emulated network, and read their results.

Standard library only, so that a script's ``--help`` and ``netns.py --cleanup`` stay fast; the
model every step-time benchmark trains lives in ``mlp.py``. The scripts import this module as
``import harness``: Python puts a script's own directory first on ``sys.path``.

* :func:`run_ranks` starts ``n`` ranks (forked by default, so they inherit the imported torch and
  lightning), each with the environment Lightning's launcher gives its children, optionally each
  in its own network namespace; it kills every rank on the first error or at the timeout, and
  returns each rank's result or re-raises a rank's error with its traceback.
* :class:`EmulatedNetwork`: hosts in network namespaces behind one shaped switch (root, Linux).
* The MLP's widths: :data:`FULL_WIDTHS`, :func:`parse_widths`, :func:`count_parameters`.
* Small helpers: :func:`interface_bytes`, :func:`quiet`, :func:`use_threads`, :func:`exit_on_sigterm`, :func:`quantile`,
  :func:`step_times`, :func:`command_line`, :func:`write_outputs`, :func:`import_example`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IP, TC = shutil.which("ip") or "/usr/sbin/ip", shutil.which("tc") or "/usr/sbin/tc"
PREFIX = "ldn"  # every namespace the benchmarks create is named ldn<pid>-...
SUBNET = "10.77.0"
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


# -- the emulated network ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One host's link to the switch: ``rate_mbit`` each way, ``delay_ms`` host-to-host one way."""

    name: str
    rate_mbit: float
    delay_ms: float


PROFILES = {
    p.name: p
    for p in (
        Link("1gbit", 1000.0, 1.0),
        Link("10gbit", 10000.0, 0.1),
        Link("100mbit", 100.0, 1.0),
    )
}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def netns_permitted() -> tuple[bool, str]:
    """Whether this process may create network namespaces (root on Linux, with ``ip``); else why not."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None and not Path(IP).exists():
        return False, "the `ip` command (iproute2) is not installed"
    if shutil.which("tc") is None and not Path(TC).exists():
        return False, "the `tc` command (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}-probe"
    done = _ip("netns", "add", name, check=False)
    if done.returncode:
        return False, f"`ip netns add` is not permitted here ({done.stderr.strip()}); run as root"
    _ip("netns", "del", name, check=False)
    return True, ""


def remove_stale_namespaces() -> list[str]:
    """Delete ``ldn<pid>-*`` namespaces whose creating process is gone (a run killed with SIGKILL)."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        pid = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class EmulatedNetwork:
    """``hosts`` namespaces on one emulated switch, links shaped by ``link``; a context manager.

    ``namespaces[i]`` is host ``i``, ``addresses[i]`` its address on interface ``eth0``.
    ``delay_applied`` says whether ``sch_netem`` was there to add the delay.
    """

    interface = "eth0"

    def __init__(self, hosts: int, link: Link) -> None:
        self.link = link
        self.hub = f"{PREFIX}{os.getpid()}-hub"
        self.namespaces = [f"{PREFIX}{os.getpid()}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.delay_applied = False
        self.shaping = ""

    def __enter__(self) -> EmulatedNetwork:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "add", self.interface, "type", "veth", "peer", "name", f"p{i}", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", self.interface)
            _ip("-n", ns, "link", "set", self.interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        sides = [(ns, self.interface) for ns in self.namespaces] + [
            (self.hub, f"p{i}") for i in range(len(self.namespaces))
        ]
        for ns, device in sides:
            self.delay_applied = self._shape(ns, device)
        rate, delay = self.link.rate_mbit, self.link.delay_ms
        self.shaping = (
            f"netem delay {delay / 2:g}ms rate {rate:g}mbit on both egress sides of each link"
            if self.delay_applied
            else f"tbf rate {rate:g}mbit on both egress sides of each link; NO delay (the kernel has no sch_netem, "
            f"so the requested {delay:g} ms is not applied)"
        )

    def _shape(self, ns: str, device: str) -> bool:
        """netem (delay/2 and rate) on ``device``'s egress; tbf (rate only) without sch_netem. True: netem."""
        rate, half_delay = f"{self.link.rate_mbit:g}mbit", f"{self.link.delay_ms / 2:g}ms"
        tc = [IP, "netns", "exec", ns, TC, "qdisc", "replace", "dev", device, "root"]
        netem = subprocess.run(
            [*tc, "netem", "delay", half_delay, "rate", rate, "limit", "100000"], capture_output=True, text=True
        )
        if netem.returncode == 0:
            return True
        # the bucket holds 1 ms at the rate (at least two 64 kB GSO packets): the average rate stays R
        burst = max(131072, int(self.link.rate_mbit * 1e6 / 8 * 1e-3))
        tbf = subprocess.run(
            [*tc, "tbf", "rate", rate, "burst", str(burst), "latency", "200ms"], capture_output=True, text=True
        )
        if tbf.returncode:
            raise RuntimeError(
                f"cannot shape {device} in {ns}: netem: {netem.stderr.strip()}; tbf: {tbf.stderr.strip()}. "
                "This kernel needs sch_netem or sch_tbf (CONFIG_NET_SCH_NETEM / CONFIG_NET_SCH_TBF)."
            )
        return False

    def close(self) -> None:
        """Kill what still runs in the namespaces, then delete them (their links and bridge go with them)."""
        for ns in [*self.namespaces, self.hub]:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)

    def exec_prefix(self, host: int) -> list[str]:
        return [IP, "netns", "exec", self.namespaces[host]]

    def throughput_gbit(self, seconds: float = 1.0) -> float:
        """TCP goodput from host 0 to host 1 over ``seconds`` (what the link really delivers here)."""
        code = (
            "import socket,sys,time\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind((sys.argv[1],5999));s.listen(1)\n"
            "c,_=s.accept()\n"
            "while c.recv(1<<20): pass\n"
            "c.sendall(b'k')\n"
        )
        server = subprocess.Popen([*self.exec_prefix(1), sys.executable, "-c", code, self.addresses[1]])
        client = (
            "import socket,sys,time\n"
            "for _ in range(100):\n"
            "  try: s=socket.create_connection((sys.argv[1],5999));break\n"
            "  except OSError: time.sleep(0.05)\n"
            "b=bytes(1<<20);n=0;t=time.perf_counter()\n"
            f"while time.perf_counter()-t<{seconds}: s.sendall(b);n+=len(b)\n"
            "s.shutdown(socket.SHUT_WR);s.recv(1);print(n*8/(time.perf_counter()-t)/1e9)\n"
        )
        try:
            done = subprocess.run(
                [*self.exec_prefix(0), sys.executable, "-c", client, self.addresses[1]],
                capture_output=True,
                text=True,
                timeout=30 + seconds,
            )
            return float(done.stdout.strip())
        finally:
            server.kill()
            server.wait()


@contextlib.contextmanager
def private_loopback() -> Iterator[str]:
    """A fresh network namespace whose only interface is its own loopback, up: its name, deleted on leaving. Processes
    that enter it (``enter_namespace``) talk over a loopback no other process uses."""
    name = f"{PREFIX}{os.getpid()}-lo"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        _ip("netns", "del", name, check=False)


def network_or_loopback(link: Link | None, hosts: int) -> Any:
    """``EmulatedNetwork(hosts, link)``, or a do-nothing context giving ``None`` (loopback) when ``link`` is None."""
    return EmulatedNetwork(hosts, link) if link is not None else contextlib.nullcontext(None)


def enter_namespace(name: str) -> None:
    """Move this (single-threaded, just forked) process into network namespace ``name``, as
    ``ip netns exec`` does; every socket and thread it creates afterwards lives there."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


def interface_bytes(name: str) -> tuple[int, int]:
    """``(received, sent)`` bytes of interface ``name`` in this process's network namespace (``/proc/net/dev``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            interface, _, counters = line.partition(":")
            if interface.strip() == name:
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no interface {name!r} in /proc/net/dev")


# -- ranks -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(work: Callable[[int], Any], rank: int, env: dict[str, str], namespace: str | None, out: str) -> None:
    """One rank: enter its namespace, take its environment, run ``work(rank)``, write the result atomically."""
    try:
        if namespace is not None:
            enter_namespace(namespace)
        os.environ.update(env)
        if "GLOO_SOCKET_IFNAME" not in env:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        status: tuple[str, Any] = ("ok", work(rank))
    except BaseException as exc:  # the parent raises it with this traceback
        status = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    partial = Path(out) / f"{rank}.partial"
    partial.write_text(json.dumps(status))
    os.replace(partial, Path(out) / f"{rank}.json")  # the parent never reads half of it
    if status[0] != "ok":
        sys.exit(1)


def run_ranks(
    work: Callable[[int], Any],
    n: int,
    *,
    timeout: float,
    network: EmulatedNetwork | None = None,
    one_node: bool = False,
    start_method: str = START_METHOD,
    ranks_per_host: int = 1,
) -> list[Any]:
    """Run ``work(rank)`` on ``n`` ranks, one process each, and return each rank's (JSON) result.

    Forked where the platform can (the ranks inherit the imported torch and lightning).

    Each rank gets the environment Lightning's launcher gives its children: ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``, and ``NODE_RANK`` = rank with ``LOCAL_RANK=0``
    (``Trainer(num_nodes=n, devices=1)``), or with ``one_node`` ``NODE_RANK=0`` and
    ``LOCAL_RANK`` = rank (``Trainer(devices=n)``). With ``network``, rank ``i`` first enters host
    ``i``'s namespace and meets the others at host 0's address on ``eth0``; without, on 127.0.0.1. With
    ``ranks_per_host`` = `p`, ranks `h·p … h·p+p−1` share host `h`'s namespace (they talk over its own address, which
    the kernel routes locally: only traffic between hosts crosses the shaped links) as node `h` of
    ``Trainer(num_nodes=n/p, devices=p)``.
    When a rank fails, or ``timeout`` seconds pass, every rank is killed (a rank left alone would
    wait forever in a collective), also on Ctrl-C and SIGTERM (see :func:`exit_on_sigterm`).
    """
    context = multiprocessing.get_context(start_method)
    out = tempfile.mkdtemp(prefix="benchmark_ranks_")
    port = free_port() if network is None else 29500  # a fresh namespace has every port free
    procs = []
    try:
        for rank in range(n):
            env = dict(
                MASTER_ADDR="127.0.0.1" if network is None else network.addresses[0],
                MASTER_PORT=str(port),
                WORLD_SIZE=str(n),
                NODE_RANK="0" if one_node else str(rank // ranks_per_host),
                LOCAL_RANK=str(rank) if one_node else str(rank % ranks_per_host),
            )
            if network is not None:
                env["GLOO_SOCKET_IFNAME"] = network.interface
            namespace = None if network is None else network.namespaces[rank // ranks_per_host]
            procs.append(context.Process(target=_rank, args=(work, rank, env, namespace, out)))
            procs[-1].start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        results, errors = [], []
        for rank in range(n):
            path = Path(out) / f"{rank}.json"
            if path.exists():
                status, value = json.loads(path.read_text())
                (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(errors[0])
        if len(results) < n:
            codes = [p.exitcode for p in procs]
            why = f"still running after {timeout:.0f} s" if None in codes else "died without a result"
            raise RuntimeError(f"{n - len(results)} of {n} ranks {why} (exit codes {codes})")
        return results
    finally:  # also on Ctrl-C / SIGTERM: leave no rank behind
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        shutil.rmtree(out, ignore_errors=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit``, so that every ``finally`` runs: ranks killed, namespaces deleted."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# -- inside a rank -----------------------------------------------------------------------------------


def quiet() -> None:
    """No warnings, and only Lightning's errors."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def use_threads(count: int) -> None:
    """``count`` torch threads in this process, kept by Lightning: its launcher otherwise sets
    ``cpu_count // devices`` threads when ``OMP_NUM_THREADS`` is unset (2 per process with
    ``devices=1`` on this machine, twice the cores with 4 such processes)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(count)
    torch.set_num_threads(count)


def import_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as module ``name`` (the examples are not a package on ``sys.path``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses and pickles look it up
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- the MLP of the step-time benchmarks (the module itself: mlp.py) ----------------------------------

FULL_WIDTHS = (1024, 2048, 1024, 1024, 10)  # 5,257,226 parameters
SMOKE_WIDTHS = (64, 64, 10)


def parse_widths(text: str | None, smoke: bool) -> tuple[int, ...]:
    """``--widths`` as given (``"64,64,10"``), else the smoke or the full default."""
    if text:
        return tuple(int(w) for w in text.split(","))
    return SMOKE_WIDTHS if smoke else FULL_WIDTHS


def count_parameters(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


# -- figures and output ------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated linearly between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_times(records: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per measured step, the slowest rank's gap between the ends of steps k-1 and k."""
    per_rank = [[r["ends"][k] - r["ends"][k - 1] for k in range(warmup, len(r["ends"]))] for r in records]
    return [max(column) for column in zip(*per_rank)]


def command_line(script: str, argv: list[str] | None) -> str:
    """``python benchmarks/<script> <arguments>``: how this run was started (``argv`` as given to ``main``)."""
    return " ".join(["python", f"benchmarks/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])


def write_outputs(paths: list[str], body: Any, table: str, indent: int | None = None) -> None:
    """Write ``body`` as JSON to every ``.json`` path, ``table`` (Markdown) to every other one."""
    for out in paths:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=indent) + "\n" if path.suffix == ".json" else table + "\n")
        print(f"wrote {path}")
