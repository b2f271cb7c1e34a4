"""Compressed gossip end to end: the Trainer's strategy on 4 gloo processes, the simulation, Fabric loops and the
dense reference agree; `gossip/bytes_sent` is logged and counts every payload; a resume from a
checkpoint continues bit for bit (the shards hold the public copies); what cannot run is refused naming the fix."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.compression import Sign, resolve_compression
from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy
from lightning_decentral.topology import Hierarchical
from tests import fabric_workers
from tests import simulation_workers as sim
from tests.helpers import run_distributed
from tests.marks import slow_cases
from tests.models import make_net
from tests.reference import Config, assert_every_rank_matches, run

WORLD = 4
SGD = {"lr": 0.05, "momentum": 0.9}
F64 = torch.float64  # float64: the float32 round-off of a forward can flip a sign the compressor sends
CONFIGS = [
    Config("awc_ring_sign", optimizer=SGD, compression="sign", dtype=F64),
    Config(  # a time-varying topology is refused with compression (issue 38): was one_peer_exponential
        "atc_ring_top_k_batch_norm",
        combine="atc",
        optimizer=SGD,
        compression="top_k:0.2",
        batch_norm=True,
        dtype=F64,
    ),
    Config(
        "awc_exponential_random_k_rounds2",
        topology="exponential",
        optimizer=SGD,
        compression="random_k:0.3",
        gossip_steps=2,
        consensus_step=0.3,
        dtype=F64,
    ),
    # compression_overlap: the exchanges on each mixer's helper thread (processes; the simulation has one thread)
    Config("awc_ring_sign_helper_thread", optimizer=SGD, compression="sign", compression_overlap=True, dtype=F64),
    Config(
        "awc_exponential_random_k_rounds2_helper_thread",
        topology="exponential",
        optimizer=SGD,
        compression="random_k:0.3",
        gossip_steps=2,
        consensus_step=0.3,
        compression_overlap=True,
        dtype=F64,
    ),
]


def expected_bytes(config: Config, parameters: int, buffers: int) -> int:
    """What one worker sends over `config.steps` steps: one message per out-neighbour, round and step (every
    topology here sends each worker's the same number each step)."""
    compressor = resolve_compression(config.compression)
    message = compressor.payload_bytes(parameters, F64) + (compressor.payload_bytes(buffers, F64) if buffers else 0)
    out_degree = {"ring": 2, "one_peer_exponential": 1, "exponential": 2}[config.topology]
    return config.steps * config.gossip_steps * out_degree * message


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_the_simulation_equals_the_processes_and_counts_the_same_bytes(
    config: Config, on_processes: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """`vectorize="auto"` keeps the workers apart, saying why (each worker's flat buffers are compressed whole)."""
    logger = logging.getLogger("lightning.pytorch")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    try:
        simulated = sim.fit_simulated(config, WORLD, vectorize="auto")
    finally:
        logger.removeHandler(caplog.handler)
    assert "the per-worker path, one worker at a time, because compression=" in caplog.text
    ranks = torch.stack([r[config.name]["state"] for r in on_processes])
    assert (ranks[0] - ranks[1]).abs().max() > 1e-4
    torch.testing.assert_close(torch.stack(simulated["states"]), ranks, atol=1e-9, rtol=0)
    net = make_net(config.batch_norm)
    parameters, buffers = (
        sum(p.numel() for p in net.parameters()),
        sum(b.numel() for b in net.buffers() if b.is_floating_point()),
    )
    per_worker = expected_bytes(config, parameters, buffers)
    assert [r[config.name]["bytes_sent"] for r in on_processes] == [per_worker] * WORLD
    assert simulated["bytes_sent"] == WORLD * per_worker
    # logged in the last training_step: AWC has posted round one of that step's exchange, ATC posts it after the update
    rounds = (config.steps - 1) * config.gossip_steps + (config.combine == "awc")
    logged = per_worker * rounds // (config.steps * config.gossip_steps)
    assert simulated["logged_bytes"] == on_processes[0][config.name]["logged_bytes"] == logged


@pytest.mark.parametrize("config", slow_cases(CONFIGS, {"atc_ring_top_k_batch_norm"}), ids=lambda c: c.name)
def test_the_simulation_matches_the_dense_reference(config: Config) -> None:
    simulated = sim.fit_simulated_on_rank_data(config, WORLD)
    torch.testing.assert_close(simulated, run(config, WORLD), atol=1e-9, rtol=0)


@pytest.fixture(scope="module")
def in_fabric(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fabric loops on 4 processes: two configs against the dense reference, and a run saved and loaded halfway."""
    configs = CONFIGS[:2]
    root = tmp_path_factory.mktemp("compressed_fabric")
    resume = Config("fabric_resume", topology="exponential", optimizer=SGD, compression="int4", steps=6)
    return {
        "configs": configs,
        "trained": run_distributed(fabric_workers.fit_configs, WORLD, configs=configs),
        "resumed": run_distributed(fabric_workers.resume, WORLD, config=resume, root=str(root)),
    }


@pytest.mark.slow
def test_fabric_loops_match_the_dense_reference_and_resume_bit_for_bit(in_fabric: dict[str, Any]) -> None:
    for config in in_fabric["configs"]:
        assert_every_rank_matches(in_fabric["trained"], config, WORLD, atol=1e-6)
    for rank, result in enumerate(in_fabric["resumed"]):
        assert torch.equal(result["resumed"], result["full"]), f"rank {rank}"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Compressed runs of 2 epochs straight and 1 + 1 through a checkpoint, on processes and in the simulation."""
    root = tmp_path_factory.mktemp("compressed_resume")
    kwargs = {"compression": Sign(block=8), "topology": "ring"}  # issue 38: a time-varying one is refused
    proc_ckpt, sim_ckpt = str(root / "proc.ckpt"), str(root / "sim.ckpt")
    run_distributed(sim.resume_processes, WORLD, save=proc_ckpt, **kwargs)
    helper_ckpt, helper = str(root / "helper.ckpt"), {"compression_overlap": True}
    run_distributed(sim.resume_processes, WORLD, save=helper_ckpt, **kwargs, **helper)
    out: dict[str, Any] = {
        "proc_straight": run_distributed(sim.resume_processes, WORLD, **kwargs),
        "proc_resumed": run_distributed(sim.resume_processes, WORLD, load=proc_ckpt, **kwargs),
        # saved with the exchanges on the helper thread and resumed on the training thread, and the other way round
        "proc_saved_on_helper": run_distributed(sim.resume_processes, WORLD, load=helper_ckpt, **kwargs),
        "proc_resumed_on_helper": run_distributed(sim.resume_processes, WORLD, load=proc_ckpt, **kwargs, **helper),
        "sim_first": sim.resume_simulated(WORLD, save=sim_ckpt, **kwargs),
        "sim_straight": sim.resume_simulated(WORLD, **kwargs),
        "sim_resumed": sim.resume_simulated(WORLD, load=sim_ckpt, **kwargs),
        "shard": torch.load(next(Path(f"{sim_ckpt}.shards").glob("rank-00001-*")), weights_only=True),
    }
    return out


@pytest.mark.slow
def test_a_resume_continues_bit_for_bit_on_processes_and_in_the_simulation(resumed: dict[str, Any]) -> None:
    assert (resumed["sim_first"][0] - resumed["sim_straight"][0]).abs().max() > 1e-3  # the second epoch moved
    for straight, again in [("proc_straight", "proc_resumed"), ("sim_straight", "sim_resumed")]:
        for worker, (a, b) in enumerate(zip(resumed[again], resumed[straight])):
            assert torch.equal(a, b), f"{again}, worker {worker}"


@pytest.mark.slow
def test_a_resume_is_bit_for_bit_across_compression_overlap(resumed: dict[str, Any]) -> None:
    """A checkpoint saved with the exchanges on the mixer's helper thread resumes on the training thread, and the other
    way round, to the replicas of the straight run, bit for bit."""
    for again in ("proc_saved_on_helper", "proc_resumed_on_helper"):
        for worker, (a, b) in enumerate(zip(resumed[again], resumed["proc_straight"])):
            assert torch.equal(a, b), f"{again}, worker {worker}"


@pytest.mark.slow
def test_a_shard_holds_the_workers_public_copies(resumed: dict[str, Any]) -> None:
    gossip = resumed["shard"]["gossip"]
    copies = gossip["copies"][0]  # the flat parameters
    assert gossip["wire_bytes"] > 0
    # a ring of 4 (was one-peer on 4, in from 2, 3 and out to 0, 3, until issue 38 refused compression on it): rank 1
    # hears from 0 and 2 and sends to both, from one copy
    assert set(copies["received"]) == {0, 2} and set(copies["slot_of"]) == {0, 2} and len(copies["sent"]) == 1
    assert all(
        c.dtype == torch.float32 and c.abs().sum() > 0 for c in copies["sent"] + list(copies["received"].values())
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compression": "sign", "momentum": "decentlam"}, "momentum='decentlam'.*use momentum='local'"),
        ({"compression": "int8", "staleness": 1}, "staleness=1.*use staleness=0"),
        ({"compression": "int4", "gossip_dtype": "bfloat16"}, "gossip_dtype.*use gossip_dtype=None"),
        ({"compression": "top_k:0.1", "on_peer_failure": "continue"}, "use on_peer_failure='stop'"),
        ({"consensus_step": 0.5}, "pass compression= too"),
        ({"compression": "sign", "consensus_step": 1.5}, r"must be in \(0, 1\]"),
        ({"compression": "top-k"}, "'top_k:<fraction>'"),
        (
            {
                "compression": "sign",
                "outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7),
                "gossip_every": 4,
                "on_peer_failure": "continue",
            },
            "use on_peer_failure='stop'",
        ),  # an outer step with compression composes
        ({"compression": "sign", "topology": "hierarchical"}, "a Hierarchical topology.*use a flat topology"),
        (
            {"compression": "int8", "topology": Hierarchical("complete", "ring", ranks_per_node=2)},
            "a Hierarchical topology.*use a flat topology such as topology='ring'",
        ),
    ],
)
def test_what_cannot_run_is_refused_naming_the_fix(kwargs: dict, match: str) -> None:
    for strategy in (DecentralizedStrategy, FabricStrategy, SimulatedDecentralizedStrategy):
        if strategy is SimulatedDecentralizedStrategy and kwargs.get("on_peer_failure") == "continue":
            continue  # the simulation refuses on_peer_failure itself
        with pytest.raises(ValueError, match=match):
            strategy(**kwargs)
    with pytest.raises(ValueError, match="drop failures= or compression="):
        SimulatedDecentralizedStrategy(workers=4, compression="sign", failures={2: [1]}, vectorize=False)
    with pytest.raises(ValueError, match=r"vectorize=True cannot run compression=.*Use vectorize=False or 'auto'"):
        SimulatedDecentralizedStrategy(workers=4, compression="sign", vectorize=True)


def test_every_executor_takes_compression_and_keeps_the_step_it_uses() -> None:
    for strategy in (DecentralizedStrategy, FabricStrategy, SimulatedDecentralizedStrategy):
        built = strategy(compression="top_k:0.1")
        assert built.compression == resolve_compression("top_k:0.1") and built.consensus_step == pytest.approx(0.3)
        assert strategy(compression=Sign(), consensus_step=0.5).consensus_step == 0.5
        plain = strategy()
        assert plain.compression is None and plain.consensus_step is None and plain.bytes_sent == 0
