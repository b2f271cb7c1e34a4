"""Low-precision gossip: ``x_i <- x_i + Σ_j w_ij q_j − q_i``, ``q = bf16(x)`` (or fp16).

Checked on 4 gloo processes (the engine alone, and the strategy against the dense reference's
quantized mode), and in a long single-process run of the same rule.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.gossip import Gossip
from lightning_decentral.topology import resolve_topology
from tests import reference, workers
from tests.helpers import run_distributed
from tests.reference import Config

WORLD = 4
MOMENTUM = {"lr": 0.05, "momentum": 0.9}
BF16 = torch.bfloat16
CONFIGS = [
    Config("ring-awc-momentum-bf16", optimizer=MOMENTUM, gossip_dtype=BF16),
    Config("ring-awc-momentum-fp16", optimizer=MOMENTUM, gossip_dtype=torch.float16),
    Config(
        "one_peer-atc-bf16-rounds2", topology="one_peer_exponential", combine="atc", gossip_steps=2, gossip_dtype=BF16
    ),
    Config(
        "exponential-awc-batchnorm-bf16", topology="exponential", optimizer=MOMENTUM, batch_norm=True, gossip_dtype=BF16
    ),
    Config(
        "ring-decentlam-warmup-bf16",
        momentum="decentlam",
        optimizer={"lr": 0.1, "momentum": 0.9},
        scheduler="warmup",
        gossip_dtype=BF16,
    ),
    Config("complete-awc-bf16", topology="complete", optimizer=MOMENTUM, gossip_dtype=BF16),
]
# The reference and the strategy round the same float32 values to bf16; they differ by float32
# round-off (~1e-7) unless a value sits within that of a rounding boundary, which these runs avoid.
ATOL = 1e-5
TRANSPORTED = [("ring", "p2p"), ("ring", "broadcast"), ("one_peer_exponential", "broadcast"), ("complete", None)]
# Quantized against full precision after 6 steps: a few bf16 rounding errors (2^-9 relative) of
# weights of size ~0.5, carried by the mixing.
DRIFT_TOL = 1e-2


def engine_checks(rank: int, world_size: int) -> dict[str, Any]:
    """The engine alone: one round against the dense rule, bytes on the wire, ``out=``, a long run."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        sent_bytes: list[int] = []
        batch, broadcast = dist.batch_isend_irecv, dist.broadcast

        def counting_batch(ops: list) -> Any:  # count what really goes to the transport
            sent_bytes.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
            return batch(ops)

        def counting_broadcast(tensor: torch.Tensor, src: int, **kwargs: Any) -> Any:
            sent_bytes.append(tensor.numel() * tensor.element_size() if src == rank else 0)
            return broadcast(tensor, src=src, **kwargs)

        dist.batch_isend_irecv, dist.broadcast = counting_batch, counting_broadcast
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(1000, generator=generator)
        out: dict[str, Any] = {"x": x.clone()}
        for name, transport in TRANSPORTED:
            topology = resolve_topology(name, world_size)
            gossip = Gossip(topology, dtype=BF16, transport=transport)
            gossip.measure_residuals = True
            mixed = x.clone()
            sent_bytes.clear()
            pending = gossip.start([mixed], step=0)
            pending.wait()
            wire_bytes = sum(sent_bytes)
            delta = torch.empty_like(x)
            gossip.start([x], step=0, out=[delta]).wait()
            out[f"{name}-{transport}"] = {
                "mixed": mixed,
                "delta": delta,
                "residual": float(pending.residuals[0]),
                "wire_bytes": wire_bytes,
                "bytes_sent": gossip.bytes_sent([x], 0),
                "bytes_sent_full": Gossip(topology, transport="p2p").bytes_sent([x], 0),
            }
        dist.batch_isend_irecv, dist.broadcast = batch, broadcast
        # a long run of gossip alone: the mean stays put, the disagreement falls to a floor and stays there
        gossip = Gossip(resolve_topology("ring", world_size), dtype=BF16)
        y = x.clone()
        distances = []
        for step in range(300):
            gossip.start([y], step).wait()
            if step % 10:
                continue
            mean = y.clone()
            dist.all_reduce(mean)
            mean /= world_size
            squared = (y - mean).square().sum()
            dist.all_reduce(squared)
            distances.append(math.sqrt(float(squared) / world_size))
        out["long"] = {"final": y, "mean": mean, "distances": distances}
        return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    return run_distributed(workers.fit_configs, WORLD, configs=CONFIGS)


@pytest.fixture(scope="module")
def engine() -> list[dict[str, Any]]:
    return run_distributed(engine_checks, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "transport"), TRANSPORTED)
def test_engine_round_is_the_error_feedback_rule(engine: list[dict[str, Any]], name: str, transport: str) -> None:
    key = f"{name}-{transport}"
    x = torch.stack([o["x"] for o in engine]).double()
    w = reference.mixing(name, WORLD, 0)
    if name == "complete":  # an all-reduce stays in full precision: x <- W x
        expected = w @ x
    else:
        q = x.float().to(BF16).double()
        expected = x + w @ q - q
    mixed = torch.stack([o[key]["mixed"] for o in engine]).double()
    torch.testing.assert_close(mixed, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed.mean(0), x.mean(0), atol=1e-6, rtol=0)  # x̄ kept exactly
    torch.testing.assert_close(torch.stack([o[key]["delta"] for o in engine]).double(), expected - x, atol=1e-6, rtol=0)
    residuals = torch.tensor([o[key]["residual"] for o in engine], dtype=torch.float64)
    torch.testing.assert_close(residuals, ((expected - x) ** 2).sum(1), rtol=1e-4, atol=0)
    for o in engine:
        if name == "complete":
            assert o[key]["bytes_sent"] == o[key]["bytes_sent_full"] > 0
            assert o[key]["wire_bytes"] == 0  # no neighbour message at all
        else:
            assert o[key]["bytes_sent"] * 2 == o[key]["bytes_sent_full"]
            assert o[key]["wire_bytes"] == o[key]["bytes_sent"] == 2 * 1000 * (2 if name == "ring" else 1)


@pytest.mark.slow
def test_engine_long_run_keeps_the_mean_and_a_bounded_disagreement(engine: list[dict[str, Any]]) -> None:
    x = torch.stack([o["x"] for o in engine]).double()
    final = torch.stack([o["long"]["final"] for o in engine]).double()
    # x̄ moves only by float32 round-off: at most 300 rounds x a few float32 ulps of |x| (bf16 rounding is 2^16 x larger)
    torch.testing.assert_close(final.mean(0), x.mean(0), atol=300 * 4 * 2**-24 * float(x.abs().max()), rtol=0)
    distances = engine[0]["long"]["distances"]
    start = math.sqrt(((x - x.mean(0)) ** 2).sum(1).mean())
    floor = 2**-8 * float(x.abs().max()) * math.sqrt(x.shape[1])  # one bf16 rounding step per element
    assert max(distances[10:]) < floor < start / 10  # every 10th round from round 100 on
    assert max(distances[20:]) <= max(distances[10:20]) * 1.01 + 1e-12  # it does not grow back


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_trajectory_matches_the_quantized_reference(trained: list[dict[str, torch.Tensor]], config: Config) -> None:
    expected = reference.assert_every_rank_matches(trained, config, WORLD, atol=ATOL)
    full = reference.run(Config(**{**config.__dict__, "gossip_dtype": None}), WORLD)
    drift = (expected - full).abs().max()
    assert drift < DRIFT_TOL
    if config.topology == "complete":
        assert drift == 0  # all-reduce: full precision
    else:
        assert drift > 1e-6  # the messages really were rounded


def test_dense_long_run_mean_exact_and_consensus_bounded() -> None:
    """500 steps of AWC D-SGD on heterogeneous quadratics ``f_i = ½‖x − b_i‖²``, ring of 8.

    The low-precision rule moves ``x̄`` exactly as full precision does, and its consensus distance
    stays within a bf16 rounding step of full precision's; rounding without error feedback
    (``x <- W q``) makes ``x̄`` drift.
    """
    n, d, lr, steps = 8, 64, 0.05, 500
    generator = torch.Generator().manual_seed(0)
    b = torch.randn(n, d, generator=generator, dtype=torch.float64)
    w = reference.mixing("ring", n, 0)

    def run(rule: str) -> tuple[torch.Tensor, list[float]]:
        x = torch.zeros(n, d, dtype=torch.float64) + torch.randn(d, generator=torch.Generator().manual_seed(1)).double()
        distances = []
        for _ in range(steps):
            q = x.float().to(BF16).double()
            mixed = {"full": w @ x, "feedback": x + w @ q - q, "naive": w @ q}[rule]
            x = (mixed - lr * (x - b)).float().double()  # float32 replicas
            distances.append(float(((x - x.mean(0)) ** 2).sum(1).mean().sqrt()))
        return x, distances

    full, full_distances = run("full")
    feedback, feedback_distances = run("feedback")
    naive, _ = run("naive")
    floor = 2**-8 * float(full.abs().max()) * math.sqrt(d)
    assert float((feedback.mean(0) - full.mean(0)).abs().max()) < 1e-5
    assert float((naive.mean(0) - full.mean(0)).abs().max()) > 10 * float((feedback.mean(0) - full.mean(0)).abs().max())
    assert all(f <= g + floor for f, g in zip(feedback_distances[100:], full_distances[100:]))
    assert max(feedback_distances[400:]) <= max(feedback_distances[100:200]) + floor


def test_gossip_dtype_is_validated() -> None:
    assert DecentralizedStrategy(gossip_dtype="bfloat16").gossip_dtype is torch.bfloat16
    assert DecentralizedStrategy(gossip_dtype=torch.float16).gossip_dtype is torch.float16
    for bad in (torch.int8, torch.float64, "bf17", 16):
        with pytest.raises(ValueError, match=r"gossip_dtype.*torch\.bfloat16"):
            DecentralizedStrategy(gossip_dtype=bad)
