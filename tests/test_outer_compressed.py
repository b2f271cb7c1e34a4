"""The outer optimizer with compressed gossip (`outer_optimizer=` and `compression=`, docs/algorithms.md, "Outer
steps"): the simulation is the float64 dense reference (tests/outer_reference.py over tests/choco_reference.py) and
equals the ranks on gloo processes; on the complete graph the workers keep one anchor; a checkpoint in the middle of
a round resumes bit for bit, its shards holding the anchor, the outer momentum, the public copies and where they
start (the same model on every worker); with `sign`
the bytes per optimizer step are under 1/(25 H) of D-PSGD's on the same graph."""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.checkpoint import read_shard, shard_path
from lightning_decentral.compression import Sign
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver
from tests import outer_reference
from tests import simulation_workers as sim
from tests.helpers import assert_resumed_as_straight, run_distributed
from tests.marks import slow_cases
from tests.reference import Config

WORLD = 4
F64 = torch.float64  # float64: the float32 round-off of a forward can flip a sign the compressor sends
SGD = {"lr": 0.05, "momentum": 0.9}
NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
OUTER = {"optimizer": SGD, "outer": NESTEROV, "dtype": F64}
CONFIGS = [
    Config("outer_ring_sign", compression="sign", gossip_every=3, steps=9, **OUTER),
    Config(  # a time-varying topology is refused with compression (issue 38): was one_peer_exponential
        "outer_exponential_top_k_batch_norm",
        topology="exponential",
        compression="top_k:0.2",
        gossip_every=3,
        steps=9,
        batch_norm=True,
        **OUTER,
    ),
    Config("diloco_sign", topology="complete", compression="sign", gossip_every=3, steps=9, **OUTER),
    Config("outer_ring_int4_overlap", compression="int4", outer_overlap=True, gossip_every=2, steps=9, **OUTER),
    Config(  # the round's exchange on the mixer's helper thread during the next round's inner steps (processes)
        "outer_ring_int4_overlap_helper_thread",
        compression="int4",
        outer_overlap=True,
        compression_overlap=True,
        gossip_every=2,
        steps=9,
        **OUTER,
    ),
]


@pytest.mark.parametrize(
    "config",
    slow_cases(CONFIGS, {"outer_exponential_top_k_batch_norm", "outer_ring_int4_overlap_helper_thread"}),
    ids=lambda c: c.name,
)
def test_the_simulation_is_the_dense_reference(config: Config) -> None:
    simulated = sim.fit_simulated_on_rank_data(config, WORLD)
    expected = outer_reference.decentralized(config, WORLD)
    torch.testing.assert_close(simulated, expected, atol=1e-9, rtol=0)
    if config.topology == "complete":  # γ = 1: every worker ends each round at Σ_j x̂_j / n, one anchor
        assert (expected - expected[0]).abs().max() < 1e-12
    else:
        assert (expected[0] - expected[1]).abs().max() > 1e-3
    uncompressed = outer_reference.decentralized(Config(**{**config.__dict__, "compression": None}), WORLD)
    assert (expected - uncompressed).abs().max() > 1e-3  # the compression changed the run: a real test of it


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_the_simulation_equals_the_processes(config: Config, on_processes: list[dict[str, Any]]) -> None:
    simulated = sim.fit_simulated(config, WORLD, vectorize="auto")
    ranks = torch.stack([r[config.name]["state"] for r in on_processes])
    torch.testing.assert_close(torch.stack(simulated["states"]), ranks, atol=1e-9, rtol=0)
    assert simulated["bytes_sent"] == sum(r[config.name]["bytes_sent"] for r in on_processes) > 0


# -- checkpoints in the middle of a round ---------------------------------------------------------------------

RESUME = {
    "outer_optimizer": functools.partial(torch.optim.SGD, **NESTEROV),
    "gossip_every": 3,
    "compression": Sign(block=8),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 epochs straight and 1 + 1 through a checkpoint at step 4 (4 steps per epoch), one step into the second
    round: in the simulation (ring, with and without overlap) and on 2 gloo processes."""
    root = tmp_path_factory.mktemp("outer_compressed_resume")
    out: dict[str, Any] = {"root": root}
    for name, kwargs in {"ring": {"topology": "ring"}, "overlap": {"topology": "ring", "outer_overlap": True}}.items():
        path = str(root / f"{name}.ckpt")
        out[name] = {
            "first": sim.resume_simulated(WORLD, save=path, **RESUME, **kwargs),
            "straight": sim.resume_simulated(WORLD, **RESUME, **kwargs),
            "resumed": sim.resume_simulated(WORLD, load=path, **RESUME, **kwargs),
        }
    path = str(root / "processes.ckpt")
    run_distributed(sim.resume_processes, 2, save=path, **RESUME, topology="complete")
    out["processes"] = {
        "straight": run_distributed(sim.resume_processes, 2, **RESUME, topology="complete"),
        "resumed": run_distributed(sim.resume_processes, 2, load=path, **RESUME, topology="complete"),
    }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring", "overlap", "processes"])
def test_a_resume_in_the_middle_of_a_round_is_bit_for_bit(resumed: dict[str, Any], name: str) -> None:
    assert_resumed_as_straight(resumed[name])


@pytest.mark.slow
def test_the_shards_hold_the_rule_and_the_compressor_state(resumed: dict[str, Any]) -> None:
    path = str(resumed["root"] / "ring.ckpt")
    meta = torch.load(path, weights_only=True)["decentralized_shards"]
    for worker in range(WORLD):
        shard = read_shard(shard_path(path, worker, WORLD, meta["save_id"]))
        rule, gossip = shard["rule_state"], shard["gossip"]
        assert [a.numel() for a in rule["anchor"]] == [40, 8, 24, 3]
        assert [set(rule["outer_optimizer"]["state"][k]) for k in range(4)] == [{"momentum_buffer"}] * 4
        copies = gossip["copies"][0]  # the flat parameters' public copies, one round old (step 2's)
        assert gossip["wire_bytes"] > 0 and set(copies["received"]) == {(worker - 1) % WORLD, (worker + 1) % WORLD}
        assert all(c.abs().sum() > 0 for c in copies["sent"] + list(copies["received"].values()))
        assert torch.equal(
            gossip["origins"][0], read_shard(shard_path(path, 0, WORLD, meta["save_id"]))["gossip"]["origins"][0]
        )


# -- bytes --------------------------------------------------------------------------------------------------------


class _Wide(pl.LightningModule):
    """A regression with 1,153 parameters (a float32 message of 4,612 bytes; `sign`'s is 153)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _Bytes(ExchangeObserver):
    def __init__(self) -> None:
        self.sent = 0

    def on_post(self, event: ExchangeEvent) -> None:
        self.sent += event.bytes_sent


DIRECTED_RING = [[0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5], [0.5, 0, 0, 0.5]]
"""One peer per step, static (compression refuses a time-varying topology such as one_peer_exponential: issue 38)."""


def _bytes_per_step(steps: int, **options: Any) -> float:
    """Bytes one worker sends per optimizer step in a simulated run of `steps` steps on 4 workers: what compressed
    gossip put on the wire (`bytes_sent`), else what the exchanges announced (an `ExchangeObserver`)."""
    strategy, count = (
        SimulatedDecentralizedStrategy(workers=WORLD, topology=DIRECTED_RING, **options),
        _Bytes(),
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    strategy.observe(count)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(WORLD * steps * 4, 16, generator=generator), torch.randn(WORLD * steps * 4, 1, generator=generator)
    )
    trainer.fit(_Wide(), train_dataloaders=DataLoader(data, batch_size=4))
    sent = strategy.bytes_sent if options.get("compression") else count.sent
    return sent / WORLD / steps


def test_sign_sends_under_1_over_25h_of_dpsgd_per_optimizer_step() -> None:
    every, steps = 5, 10
    dpsgd = _bytes_per_step(steps)
    outer = _bytes_per_step(
        steps, outer_optimizer=functools.partial(torch.optim.SGD, **NESTEROV), gossip_every=every, compression="sign"
    )
    assert dpsgd == 1153 * 4  # one float32 model to one peer at every step
    assert outer == (1153 // 8 + 1 + 2 * 4) / every  # one sign message per round: bits and 2 scales, every H steps
    assert outer <= dpsgd / (25 * every)


# -- what composes and what is refused ------------------------------------------------------------------------


def test_compression_with_an_outer_optimizer_is_refused_only_where_it_cannot_run() -> None:
    outer = {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7), "gossip_every": 4, "compression": "sign"}
    assert DecentralizedStrategy(**outer).compression == Sign()
    with pytest.raises(ValueError, match=r"on_peer_failure='continue'.*use on_peer_failure='stop'"):
        DecentralizedStrategy(**outer, on_peer_failure="continue")
    with pytest.raises(ValueError, match="vectorize=True cannot run compression="):
        SimulatedDecentralizedStrategy(workers=4, vectorize=True, **outer)
