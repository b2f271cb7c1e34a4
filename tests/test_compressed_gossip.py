"""Compressed gossip (CHOCO, a public copy per edge) in one process: the rules over a compressing ``DenseMixer``
against the float64 dense reference (``tests/choco_reference.py``), the consensus it reaches (and what compressing
the models themselves reaches), a resume from its state, and a peer's failure on the mixer's helper thread raised on
the training thread."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_decentral.compression import Sign, resolve_compression
from lightning_decentral.failures import PeerFailure
from lightning_decentral.gossip import CompressedGossip
from lightning_decentral.mixing import DenseMixer, ExchangeEvent, ExchangeObserver, Watch
from lightning_decentral.topology import resolve_topology
from tests import reference
from tests.dense_executor import DenseExecutor
from tests.marks import slow_cases
from tests.reference import Config

N = 4
F64 = torch.float64
MOMENTUM = {"lr": 0.05, "momentum": 0.9}
CONFIGS = [
    Config("awc-ring-sign", optimizer=MOMENTUM, compression="sign", dtype=F64),
    Config(
        "atc-ring-int4-batchnorm", combine="atc", optimizer=MOMENTUM, compression="int4", batch_norm=True, dtype=F64
    ),
    Config(
        "awc-one_peer-sign-batchnorm",
        topology="one_peer_exponential",
        compression=Sign(block=16),
        batch_norm=True,
        dtype=F64,
    ),
    Config(
        "atc-one_peer-top_k-gamma",
        topology="one_peer_exponential",
        combine="atc",
        compression="top_k:0.2",
        consensus_step=0.5,
        dtype=F64,
    ),
    Config(
        "awc-exponential-random_k-rounds2",
        topology="exponential",
        optimizer=MOMENTUM,
        compression="random_k:0.3",
        gossip_steps=2,
        dtype=F64,
    ),
    Config(
        "atc-ring-int8-every2-rounds2", combine="atc", compression="int8", gossip_every=2, gossip_steps=2, dtype=F64
    ),
    Config("awc-complete-int2", topology="complete", compression="int2", dtype=F64),
]


@pytest.mark.parametrize(
    "config", slow_cases(CONFIGS, {"awc-one_peer-sign-batchnorm", "atc-ring-int4-batchnorm"}), ids=lambda c: c.name
)
def test_rules_over_a_compressing_dense_mixer_match_the_reference(config: Config) -> None:
    got = DenseExecutor(config, N).run()
    expected = reference.run(config, N)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    uncompressed = reference.run(Config(**{**config.__dict__, "compression": None}), N)
    assert (expected - uncompressed).abs().max() > 1e-4  # the messages really were compressed


def _random_rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def consensus(x: torch.Tensor, mean: torch.Tensor) -> float:
    """`sqrt(mean_i ‖x_i − x̄‖²)`, `x̄` the workers' mean at the start (gossip keeps it)."""
    return float((x - mean).square().sum(1).mean().sqrt())


def gossip_only(mixer: DenseMixer, x: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` steps of gossip alone (learning rate 0) on the rows of `x`, in place."""
    rows = list(x)
    for step in range(steps):
        for pending in [mixer.worker(i).start([row], step) for i, row in enumerate(rows)]:
            pending.wait()
    return x


@pytest.mark.parametrize(("compression", "stalls"), [("sign", True), ("int8", False), ("top_k:0.1", True)])
def test_consensus_at_the_default_step_and_not_without_error_feedback(compression: str, stalls: bool) -> None:
    """8 workers on a ring, different replicas, 200 steps of gossip alone: CHOCO at the compressor's default `γ`
    brings the consensus distance to 1 % of its start. Exchanging the compressed models themselves,
    `x_i <- x_i + γ Σ_j w_ij (C(x_j) − C(x_i))` (no public copies: no error feedback), stalls above 1 % with `sign`
    and `top_k:0.1`, and at int8's rounding floor, a hundred times above CHOCO's distance."""
    n, d, steps = 8, 1000, 200
    topology, compressor = resolve_topology("ring", n), resolve_compression(compression)
    start = _random_rows(n, d)
    mean = start.mean(0)
    x = gossip_only(DenseMixer(topology, compression=compressor), start.clone(), steps)
    assert consensus(x, mean) <= 0.01 * consensus(start, mean)
    w, gamma = reference.mixing("ring", n, 0).float(), compressor.consensus_step
    naive = start.clone()
    for step in range(steps):
        compressed = torch.stack(
            [compressor.decompress(compressor.compress(row, step), d, row.dtype, step) for row in naive]
        )
        naive += gamma * (w @ compressed - compressed)
    assert (consensus(naive, mean) > 0.01 * consensus(start, mean)) == stalls
    assert consensus(naive, mean) > 100 * consensus(x, mean)


class Bytes(ExchangeObserver):
    def __init__(self) -> None:
        self.sent = 0

    def on_post(self, event: ExchangeEvent) -> None:
        self.sent += event.bytes_sent


def test_a_resumed_mixer_continues_bit_for_bit_and_counts_its_bytes() -> None:
    n, topology, compressor = 4, resolve_topology("one_peer_exponential", 4), resolve_compression("random_k:0.25")
    start = _random_rows(n, 100)
    through = DenseMixer(topology, compression=compressor)
    count = Bytes()
    through.observers.append(count)
    straight = gossip_only(through, start.clone(), 7)
    first = DenseMixer(topology, compression=compressor)
    halfway = gossip_only(first, start.clone(), 3)
    resumed = DenseMixer(topology, compression=compressor)
    for choco, saved in zip(resumed.chocos, [c.state_dict() for c in first.chocos]):
        choco.load_state_dict(saved)
    rows = list(halfway)
    for step in range(3, 7):
        for pending in [resumed.worker(i).start([row], step) for i, row in enumerate(rows)]:
            pending.wait()
    assert torch.equal(halfway, straight)
    per_message = compressor.payload_bytes(100, torch.float32)
    assert [c.wire_bytes for c in resumed.chocos] == [c.wire_bytes for c in through.chocos] == [7 * per_message] * n
    assert count.sent == n * 7 * per_message  # one out-neighbour per step


class _FailedWork:
    """A receive whose peer is gone: gloo's `wait()` raises."""

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")


class _BrokenEngine:
    """What `CompressedGossip` asks of its `Gossip` engine (rank 0 of a ring of 4), with a transport that fails as gloo
    does when a peer is gone, when the messages are posted (`at="post"`) or waited for (`at="wait"`); it records the
    thread of each post."""

    def __init__(self, at: str) -> None:
        self.topology = resolve_topology("ring", N)
        self.rank = 0
        self.watch = Watch()
        self.at = at
        self.threads: list[str] = []

    def neighbour_names(self, step: int) -> list[str]:
        return ["rank 1", "rank 3"]

    def post_messages(self, sends: dict, receives: dict, tag: int = 0) -> tuple[list, list]:
        self.threads.append(threading.current_thread().name)
        if self.at == "post":
            raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
        return [_FailedWork()], [1]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("at", ["post", "wait"])
def test_a_failure_on_the_helper_thread_is_raised_by_wait_on_the_training_thread(at: str) -> None:
    """With `compression_overlap` the exchange runs on the mixer's helper thread: a peer's failure there is raised by
    `wait()` on the training thread, the same `PeerFailure` (message and cause) the training thread raises without it
    (there, from `start` when the post fails); the helper thread ends when the mixer closes."""
    x, out = torch.randn(100), torch.empty(100)
    serial_engine, threaded_engine = _BrokenEngine(at), _BrokenEngine(at)
    serial = CompressedGossip(serial_engine, Sign(), overlap=False)
    with pytest.raises(PeerFailure) as expected:
        serial.start([x], step=3, out=[out]).wait()
    threaded = CompressedGossip(threaded_engine, Sign(), overlap=True)
    pending = threaded.start([x], step=3, out=[out])  # nothing raised here: the exchange runs on the helper thread
    with pytest.raises(PeerFailure) as raised:
        pending.wait()
    assert str(raised.value) == str(expected.value)
    assert str(raised.value).startswith("The compressed gossip exchange of step 3 failed on this rank: a neighbour")
    assert str(raised.value.__cause__) == str(expected.value.__cause__) == "Connection closed by peer [127.0.0.1]:4242"
    assert serial_engine.threads == [threading.current_thread().name]
    assert threaded_engine.threads == ["lightning_decentral-compressed-0"]
    threaded.close()
    assert "lightning_decentral-compressed-0" not in [t.name for t in threading.enumerate()]
