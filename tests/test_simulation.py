"""SimulatedDecentralizedStrategy: n workers in one process reproduce DecentralizedStrategy on n gloo processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_decentral.mixing import RandomDelays
from tests import simulation_workers as sim
from tests.helpers import run_distributed
from tests.marks import slow_cases
from tests.reference import Config

WORLD = 4
SGD = {"lr": 0.05, "momentum": 0.9}
CONFIGS = [
    Config("awc_ring", optimizer=SGD),
    Config("atc_ring", combine="atc", optimizer=SGD),
    Config("decentlam_ring", momentum="decentlam", optimizer=SGD),
    Config("awc_one_peer_adam", topology="one_peer_exponential", optimizer={"name": "adam", "lr": 0.01}),
    Config("atc_exponential_scheduler", topology="exponential", combine="atc", optimizer=SGD, scheduler="step"),
    Config(
        "decentlam_one_peer_clip_accumulate",
        topology="one_peer_exponential",
        momentum="decentlam",
        optimizer=SGD,
        accumulate=2,
        clip=0.5,
    ),
    Config("awc_clip_accumulate_batch_norm", optimizer=SGD, accumulate=2, clip=0.5, batch_norm=True),
    Config(
        "decentlam_exponential_batch_norm", topology="exponential", momentum="decentlam", optimizer=SGD, batch_norm=True
    ),
    Config("awc_bf16_gossip", optimizer=SGD, gossip_dtype=torch.bfloat16),
    Config("atc_gossip_every_2_steps_2", combine="atc", optimizer=SGD, gossip_every=2, gossip_steps=2),
    # bounded staleness: the processes under the schedule the simulation computes
    Config("awc_stale_2_random_delays", optimizer=SGD, staleness=2, delays=RandomDelays(seed=5), steps=8),
    Config(
        "atc_stale_1_random_delays_batch_norm",
        combine="atc",
        optimizer=SGD,
        staleness=1,
        delays=RandomDelays(seed=6),
        batch_norm=True,
        steps=8,
    ),
]


@pytest.fixture(scope="module")
def on_processes() -> list[dict[str, Any]]:
    return run_distributed(sim.fit_processes, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_simulated_workers_equal_the_ranks(config: Config, vectorize: bool, on_processes: list[dict[str, Any]]) -> None:
    simulated = sim.fit_simulated(config, WORLD, vectorize=vectorize)
    ranks = torch.stack([r[config.name]["state"] for r in on_processes]).double()
    workers = torch.stack(simulated["states"]).double()
    assert (ranks[0] - ranks[1]).abs().max() > 1e-4  # the replicas differ: a real test of every worker
    torch.testing.assert_close(workers, ranks, atol=1e-5, rtol=0)
    # what training_step logs is the mean over the workers, as sync_dist=True gives on n ranks
    assert simulated["train_loss"] == pytest.approx(on_processes[0][config.name]["train_loss"], abs=1e-5)


DATA_ORDER = Config("awc_ring_data_order", optimizer=SGD)


@pytest.fixture(scope="module")
def per_loader_on_processes() -> list[dict[tuple[bool, bool], torch.Tensor]]:
    return run_distributed(sim.fit_processes_per_loader, WORLD, config=DATA_ORDER)


@pytest.mark.slow
@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
@pytest.mark.parametrize("shuffle, distributed", sim.LOADER_CASES, ids=lambda v: str(v))
def test_the_simulation_takes_the_data_in_the_processes_order_whatever_the_loader_says(
    shuffle: bool, distributed: bool, vectorize: bool, per_loader_on_processes: list[Any]
) -> None:
    """Lightning's processes shuffle a training DataLoader with their DistributedSampler even when it says
    `shuffle=False`; with `use_distributed_sampler=False` each rank iterates the DataLoader as it is. Before, the
    simulation asked the DataLoader whether it shuffles, and a `shuffle=False` run differed from 4 processes."""
    workers = torch.stack(sim.fit_simulated_with_loader(DATA_ORDER, WORLD, shuffle, distributed, vectorize)).double()
    ranks = torch.stack([r[(shuffle, distributed)] for r in per_loader_on_processes]).double()
    if distributed:
        assert (ranks[0] - ranks[1]).abs().max() > 1e-4  # each rank its own data: the replicas differ
    torch.testing.assert_close(workers, ranks, atol=1e-5, rtol=0)


REFERENCE_CONFIGS = [
    Config("awc_sgd", optimizer={"lr": 0.1}),
    Config("awc_momentum_one_peer", topology="one_peer_exponential", optimizer=SGD),
    Config("atc_adam_exponential", topology="exponential", combine="atc", optimizer={"name": "adam", "lr": 0.01}),
    Config("decentlam_ring_warmup", momentum="decentlam", optimizer=SGD, scheduler="warmup"),
    Config("decentlam_complete", topology="complete", momentum="decentlam", optimizer=SGD),
    Config("atc_batch_norm_clip_accumulate", combine="atc", optimizer=SGD, batch_norm=True, clip=0.5, accumulate=2),
    Config("awc_bf16_gossip_batch_norm", optimizer=SGD, gossip_dtype=torch.bfloat16, batch_norm=True),
]


@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
@pytest.mark.parametrize(
    "config", slow_cases(REFERENCE_CONFIGS, {"atc_batch_norm_clip_accumulate"}), ids=lambda c: c.name
)
def test_every_rule_matches_the_dense_reference(config: Config, vectorize: bool) -> None:
    from tests.reference import run

    simulated = sim.fit_simulated_on_rank_data(config, WORLD, vectorize=vectorize)
    torch.testing.assert_close(simulated.double(), run(config, WORLD).double(), atol=1e-5, rtol=0)


FAILURE_CONFIGS = [
    Config("awc_ring_loses_2", optimizer=SGD, failures={3: [2]}),
    Config(
        "atc_one_peer_loses_0_then_5",
        topology="one_peer_exponential",
        combine="atc",
        optimizer=SGD,
        failures={2: [0], 4: [5]},
    ),
    Config(
        "decentlam_exponential_loses_1_and_4",
        topology="exponential",
        momentum="decentlam",
        optimizer=SGD,
        failures={2: [1, 4]},
        batch_norm=True,
    ),
]


@pytest.mark.parametrize(
    "config", slow_cases(FAILURE_CONFIGS, {"decentlam_exponential_loses_1_and_4"}), ids=lambda c: c.name
)
def test_workers_lost_on_the_way_match_the_dense_reference(config: Config) -> None:
    """6 workers; the lost ones leave at their step (a local step for the others), the survivors go on with the
    named topology at their number, each with its own replica, optimizer state and data (worker 0, the
    LightningModule, may be lost too: the next survivor moves into it)."""
    from tests.reference import run

    simulated = sim.fit_simulated_on_rank_data(config, 6)
    expected = run(config, 6)
    assert simulated.shape == expected.shape == (6 - sum(len(v) for v in config.failures.values()), expected.shape[1])
    torch.testing.assert_close(simulated.double(), expected.double(), atol=1e-5, rtol=0)


def test_failures_that_cannot_run_are_refused() -> None:
    from lightning_decentral import SimulatedDecentralizedStrategy

    for failures, match in [
        ({3: [4]}, r"ranks in \[0, 4\)"),
        ({3: [1], 5: [1]}, "each at most once"),
        ({-1: [1]}, "an integer >= 0"),
        ({1: [0, 1], 2: [2, 3]}, "loses all 4 workers"),
    ]:
        with pytest.raises(ValueError, match=match):
            SimulatedDecentralizedStrategy(workers=4, failures=failures)
    with pytest.raises(ValueError, match="use vectorize=False"):
        SimulatedDecentralizedStrategy(workers=4, failures={1: [2]}, vectorize=True)
    with pytest.raises(ValueError, match="use staleness=0 with failures"):
        SimulatedDecentralizedStrategy(workers=4, failures={1: [2]}, staleness=1)


def test_with_failures_vectorize_auto_keeps_the_workers_apart(lightning_info) -> None:
    """failures= needs the workers apart: the default vectorize='auto' keeps them apart, says why, and the run is the
    dense reference's."""
    from tests.reference import run

    config = FAILURE_CONFIGS[0]
    simulated = sim.fit_simulated_on_rank_data(config, 6, vectorize="auto")
    (line,) = set(lightning_info())
    assert "the per-worker path, one worker at a time, because failures= drops workers" in line, line
    torch.testing.assert_close(simulated.double(), run(config, 6).double(), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_each_worker_draws_from_its_own_random_state(monkeypatch) -> None:
    """Dropout masks: worker i draws what rank i draws (every rank starts from the same seed)."""
    config = Config("awc_dropout", optimizer=SGD)
    ranks = run_distributed(sim.fit_processes, WORLD, configs=[config], dropout=0.3)
    simulated = sim.fit_simulated(config, WORLD, dropout=0.3)
    without = sim.fit_simulated(config, WORLD)
    expected = torch.stack([r[config.name]["state"] for r in ranks])
    assert (torch.stack(without["states"]) - expected).abs().max() > 1e-3  # dropout changed the run
    torch.testing.assert_close(torch.stack(simulated["states"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("devices, num_nodes", [(2, 1), (1, 2)])
def test_more_than_one_device_or_node_is_refused(devices: int, num_nodes: int) -> None:
    import lightning.pytorch as pl

    from lightning_decentral import SimulatedDecentralizedStrategy

    with pytest.raises(ValueError, match=r"devices=1|num_nodes=1"):
        pl.Trainer(
            strategy=SimulatedDecentralizedStrategy(workers=4), accelerator="cpu", devices=devices, num_nodes=num_nodes
        )


def test_string_names_and_bad_arguments() -> None:
    import lightning.pytorch as pl

    import lightning_decentral  # noqa: F401
    from lightning_decentral import SimulatedDecentralizedStrategy

    trainer = pl.Trainer(strategy="decentlam_sim", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, SimulatedDecentralizedStrategy)
    assert trainer.strategy.workers == 8 and trainer.strategy.momentum == "decentlam"
    with pytest.raises(ValueError, match="positive integer"):
        SimulatedDecentralizedStrategy(workers=0)
    with pytest.raises(ValueError, match="combine"):
        SimulatedDecentralizedStrategy(workers=4, combine="acw")


def test_evaluation_runs_on_the_average_or_on_worker_zero() -> None:
    for eval_on in ("average", "local"):
        seen = sim.validate_simulated(Config("eval", optimizer=SGD), WORLD, eval_on)
        workers = torch.stack(seen["workers"])
        expected = workers.mean(0) if eval_on == "average" else workers[0]
        torch.testing.assert_close(seen["validated"], expected, atol=1e-6, rtol=0)
        assert torch.equal(seen["after"], workers[0])  # worker 0's replica is back, bit for bit


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, dropout, vectorize",
    [
        (Config("awc", optimizer=SGD), 0.2, False),
        (Config("decentlam", momentum="decentlam", optimizer=SGD), 0.2, False),
        (Config("awc", optimizer=SGD), 0.0, True),
    ],
    ids=["awc", "decentlam", "awc_vectorized"],
)
def test_monitors_log_what_they_log_on_processes(config: Config, dropout: float, vectorize: bool) -> None:
    """ConsensusDistance (per layer), EffectiveLearningRate (with dropout: the forward at x̄ replays each
    worker's random state) and ConsensusControl log, step by step, the values of the 4-process run."""
    ranks = run_distributed(sim.fit_processes_monitored, WORLD, config=config, dropout=dropout)
    simulated = sim.fit_simulated_monitored(config, WORLD, dropout=dropout, vectorize=vectorize)
    expected = ranks[0]["metrics"]
    assert len(simulated["metrics"]) == len(expected) == config.steps
    assert {"consensus/distance", "consensus/residual", "lr/effective_ratio", "consensus/gossip_steps"} <= set(
        expected[-1]
    )
    assert max(m["consensus/gossip_steps"] for m in expected) > 1 or config.momentum == "decentlam"  # control acted
    for step, (seen, want) in enumerate(zip(simulated["metrics"], expected)):
        assert seen.keys() == want.keys(), step
        for key in want:
            assert seen[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    torch.testing.assert_close(
        torch.stack(simulated["states"]), torch.stack([r["state"] for r in ranks]), atol=1e-5, rtol=0
    )


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Straight 2-epoch runs and 1 + 1-epoch runs through a checkpoint, in every direction."""
    root = tmp_path_factory.mktemp("sim_resume")
    sim_ckpt, proc_ckpt = str(root / "sim.ckpt"), str(root / "proc.ckpt")
    out: dict[str, Any] = {"sim_first": sim.resume_simulated(WORLD, save=sim_ckpt)}
    out["sim_straight"] = sim.resume_simulated(WORLD)
    out["sim_from_sim"] = sim.resume_simulated(WORLD, load=sim_ckpt)
    run_distributed(sim.resume_processes, WORLD, save=proc_ckpt)
    out["proc_straight"] = run_distributed(sim.resume_processes, WORLD)
    out["proc_from_sim"] = run_distributed(sim.resume_processes, WORLD, load=sim_ckpt)
    out["sim_from_proc"] = sim.resume_simulated(WORLD, load=proc_ckpt)
    out["sim_ckpt"] = sim_ckpt
    vec_ckpt = str(root / "vectorized.ckpt")
    vectorized = {"vectorize": True, "dropout": 0.0}  # the vectorized simulation draws no random numbers
    out["vec_first"] = sim.resume_simulated(WORLD, save=vec_ckpt, **vectorized)
    out["vec_straight"] = sim.resume_simulated(WORLD, **vectorized)
    out["vec_from_vec"] = sim.resume_simulated(WORLD, load=vec_ckpt, **vectorized)
    out["per_worker_from_vec"] = sim.resume_simulated(WORLD, load=vec_ckpt, dropout=0.0)
    return out


@pytest.mark.slow
def test_simulation_resumes_its_own_checkpoint_bit_for_bit(resumed: dict[str, Any]) -> None:
    assert (resumed["sim_first"][0] - resumed["sim_straight"][0]).abs().max() > 1e-3  # the second epoch moved
    for worker, (a, b) in enumerate(zip(resumed["sim_from_sim"], resumed["sim_straight"])):
        assert torch.equal(a, b), f"worker {worker}"


@pytest.mark.slow
def test_the_vectorized_simulation_resumes_bit_for_bit_and_one_worker_at_a_time(resumed: dict[str, Any]) -> None:
    """Its shards are the per-worker simulation's (and so the processes'): either continues from them."""
    assert (resumed["vec_first"][0] - resumed["vec_straight"][0]).abs().max() > 1e-3
    for worker, (a, b) in enumerate(zip(resumed["vec_from_vec"], resumed["vec_straight"])):
        assert torch.equal(a, b), f"worker {worker}"
    torch.testing.assert_close(
        torch.stack(resumed["per_worker_from_vec"]), torch.stack(resumed["vec_straight"]), atol=1e-5, rtol=0
    )


@pytest.mark.slow
def test_a_simulated_checkpoint_resumes_on_processes_and_back(resumed: dict[str, Any]) -> None:
    """Float tolerance, not bits: the dense mixer sums in another order than the ranks' gossip."""
    torch.testing.assert_close(
        torch.stack(resumed["proc_from_sim"]), torch.stack(resumed["proc_straight"]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        torch.stack(resumed["sim_from_proc"]), torch.stack(resumed["sim_straight"]), atol=1e-5, rtol=0
    )


@pytest.mark.slow
def test_the_simulated_checkpoint_holds_the_average_and_a_shard_per_worker(resumed: dict[str, Any]) -> None:
    from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path
    from tests.models import Regression

    checkpoint = torch.load(resumed["sim_ckpt"], weights_only=True)
    meta = checkpoint[META_KEY]
    assert meta["world_size"] == WORLD
    shard_states = [
        read_shard(shard_path(resumed["sim_ckpt"], i, WORLD, meta["save_id"]))["state_dict"] for i in range(WORLD)
    ]
    plain = torch.nn.Module()
    plain.net = Regression().net
    plain.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")})
    mean = {k: torch.stack([s[k] for s in shard_states]).mean(0) for k in plain.state_dict()}
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, mean[name], atol=1e-6, rtol=0)


def test_adamw_is_built_per_worker_and_equals_the_stacked_workers() -> None:
    """AdamW's defaults hold `decoupled_weight_decay`, which its constructor does not take."""
    apart = sim.fit_with_optimizer(torch.optim.AdamW, WORLD, lr=0.01, weight_decay=0.1)
    stacked = sim.fit_with_optimizer(torch.optim.AdamW, WORLD, vectorize=True, lr=0.01, weight_decay=0.1)
    torch.testing.assert_close(torch.stack(apart), torch.stack(stacked), atol=1e-5, rtol=0)


def test_an_optimizer_that_cannot_be_built_per_worker_is_refused() -> None:
    with pytest.raises(ValueError, match=r"its own NeedsAName.*param_groups, \*\*defaults"):
        sim.fit_with_optimizer(sim.NeedsAName, WORLD, name="mine")


def test_what_cannot_run_vectorized_is_refused_naming_the_fix() -> None:
    from lightning_decentral import SimulatedDecentralizedStrategy

    with pytest.raises(ValueError, match=r"LBFGS is not one of the elementwise optimizers.*vectorize=False"):
        sim.fit_with_optimizer(torch.optim.LBFGS, WORLD, vectorize=True)
    with pytest.raises(ValueError, match=r"draws random numbers.*vectorize=False"):
        sim.fit_with_optimizer(torch.optim.SGD, WORLD, vectorize=True, dropout=0.3, lr=0.1)
    with pytest.raises(ValueError, match=r"True, False or .auto."):
        SimulatedDecentralizedStrategy(workers=4, vectorize="yes")


@pytest.mark.parametrize("vectorize", [False, True], ids=["per_worker", "vectorized"])
def test_a_nan_in_a_worker_never_reaches_a_checkpoint(vectorize: bool, tmp_path) -> None:
    from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path

    with pytest.raises(FloatingPointError, match=r"^Worker\(s\) \[2\] hold a NaN.*at step 6.*not written"):
        sim.fit_simulated_into_nan(str(tmp_path), WORLD, vectorize)
    last = str(tmp_path / "last.ckpt")
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 4  # the save of step 4 is still the last one, whole and finite
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values())
    for rank in range(WORLD):
        shard = read_shard(shard_path(last, rank, WORLD, checkpoint[META_KEY]["save_id"]))
        assert all(torch.isfinite(v).all() for v in shard["state_dict"].values() if v.is_floating_point())


def test_resuming_a_simulation_under_another_update_rule_warns_once(tmp_path) -> None:
    """Its shards record the rule as DecentralizedStrategy's do: dpsgd (AWC) into decentlam is named."""
    checkpoint = str(tmp_path / "awc.ckpt")
    sim.resume_simulated(WORLD, save=checkpoint, dropout=0.0)
    with pytest.warns(UserWarning, match=r"another update rule.*rule 'awc' -> 'decentlam'") as seen:
        sim.resume_simulated(WORLD, load=checkpoint, dropout=0.0, momentum="decentlam")
    assert sum("another update rule" in str(w.message) for w in seen) == 1


def test_the_vectorized_simulation_resumes_a_zero_dim_parameter_bit_for_bit(tmp_path) -> None:
    """A learnable temperature under Adam: its moments and its step are all 0-dim, and only the moments are per
    worker."""
    checkpoint = str(tmp_path / "temperature.ckpt")
    first = sim.resume_with_temperature(WORLD, save=checkpoint)
    straight = sim.resume_with_temperature(WORLD)
    resumed = sim.resume_with_temperature(WORLD, load=checkpoint)
    assert (first[0] - straight[0]).abs().max() > 1e-4
    for worker, (a, b) in enumerate(zip(resumed, straight)):
        assert torch.equal(a, b), f"worker {worker}"


def test_a_vectorized_shard_holds_only_its_own_worker(tmp_path) -> None:
    """Each worker's tensors are rows of stacked ones; its shard must not carry every worker's storage."""
    from lightning_decentral.checkpoint import shard_directory

    workers = 16
    sizes = {}
    for vectorize in (False, True):
        path = str(tmp_path / f"vectorize_{vectorize}.ckpt")
        sim.resume_simulated(workers, save=path, vectorize=vectorize, dropout=0.0)
        shards = sorted(Path(shard_directory(path)).iterdir())
        assert len(shards) == workers
        sizes[vectorize] = sum(f.stat().st_size for f in shards)
    assert sizes[True] == pytest.approx(sizes[False], rel=0.05), sizes


@pytest.mark.slow
def test_the_modules_hooks_run_on_every_worker_as_on_every_rank(monkeypatch) -> None:
    """A module that freezes its BatchNorm in `on_train_batch_start` and lowers its learning rate in `optimizer_step`:
    before, the per-worker path froze worker 0 only (and workers 1..n-1 took the new rate a step late)."""
    config = Config("hooks", optimizer=SGD, batch_norm=True, steps=6)
    ranks = torch.stack(run_distributed(sim.fit_processes_with_hooks, WORLD, config=config))
    for vectorize in (False, True):
        workers = torch.stack(sim.fit_simulated_with_hooks(config, WORLD, vectorize))
        torch.testing.assert_close(workers, ranks, atol=1e-5, rtol=0, msg=f"vectorize={vectorize}")


def test_a_nan_stops_the_simulation_naming_the_worker_without_speaking_of_ranks_or_timeouts() -> None:
    """Before, the simulation said "Rank 2 ... the other ranks stop within the process-group timeout"."""
    from lightning_decentral.mixing import DenseMixer, StackedMixer
    from lightning_decentral.topology import Ring

    mixer = DenseMixer(Ring(world_size=4))
    rows = torch.zeros(4, 3)
    rows[2, 1] = float("nan")
    for start in (
        lambda: mixer.worker(2).start([rows[2]], step=5),
        lambda: StackedMixer(mixer).start([rows.view(-1)], step=5),
    ):
        with pytest.raises(FloatingPointError) as raised:
            start()
        message = str(raised.value)
        assert message.startswith(
            "Worker 2 holds a NaN or an Inf in what it was about to send to its neighbours at step 5"
        )
        assert "the simulation stops with it" in message and "rank" not in message.lower() and "timeout" not in message


@pytest.fixture
def lightning_info(caplog: pytest.LogCaptureFixture):
    """The messages Lightning's logger gives at INFO (it does not propagate to the root logger)."""
    import logging

    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    yield lambda: [r.getMessage() for r in caplog.records if "vectorize='auto'" in r.getMessage()]
    logger.removeHandler(caplog.handler)


def test_vectorize_auto_is_the_default_and_stacks_what_stacking_runs_exactly(lightning_info) -> None:
    from lightning_decentral import SimulatedDecentralizedStrategy

    assert SimulatedDecentralizedStrategy(workers=4).vectorize == "auto"
    config = Config("auto", optimizer=SGD, scheduler="step")
    auto = sim.fit_simulated(config, WORLD, vectorize="auto")
    (line,) = set(lightning_info())  # one line (Lightning's logger may hand it to the capture twice)
    assert "the stacked path" in line and "SGD is elementwise" in line
    stacked = sim.fit_simulated(config, WORLD, vectorize=True)
    assert all(torch.equal(a, s) for a, s in zip(auto["states"], stacked["states"]))  # the same path: bit for bit


@pytest.mark.slow
def test_vectorize_auto_decides_when_configure_optimizers_loads_the_data(lightning_info) -> None:
    """Before: a schedule over `trainer.estimated_stepping_batches` with `max_epochs` (the digits example's cosine)
    made Lightning load the training data inside `configure_optimizers`, before the workers existed: no info line,
    and the per-worker path without a word."""
    config = Config("cosine", optimizer=SGD)
    auto = sim.fit_cosine_for_an_epoch(config, WORLD, vectorize="auto")
    (line,) = set(lightning_info())
    assert "the stacked path" in line
    apart = sim.fit_cosine_for_an_epoch(config, WORLD, vectorize=False)
    assert (apart[0] - apart[1]).abs().max() > 1e-4
    torch.testing.assert_close(torch.stack(auto), torch.stack(apart), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["dropout", "hook", "optimizer", "item"])
def test_vectorize_auto_keeps_the_workers_apart_naming_why(case: str, lightning_info) -> None:
    config = Config("apart", optimizer=SGD, batch_norm=case == "hook", steps=4)
    if case == "dropout":
        auto, apart = (sim.fit_simulated(config, WORLD, dropout=0.2, vectorize=v)["states"] for v in ("auto", False))
        reason = "its Dropout 'dropout' draws random numbers"
    elif case == "hook":
        auto, apart = (sim.fit_simulated_with_hooks(config, WORLD, vectorize=v) for v in ("auto", False))
        reason = "it overrides on_train_batch_start, which sees one worker's batch"
    elif case == "optimizer":
        auto, apart = (sim.fit_with_optimizer(sim.SubclassedSGD, WORLD, vectorize=v, lr=0.1) for v in ("auto", False))
        reason = "SubclassedSGD is not one of the elementwise optimizers"
    else:  # found by trying the first batch under torch.vmap: the workers are taken apart again before it steps
        auto, apart = (
            sim.fit_simulated(config, WORLD, vectorize=v, module=sim.ReadsItsLoss)["states"] for v in ("auto", False)
        )
        reason = "training_step cannot run under torch.vmap (RuntimeError: vmap: It looks like you're calling .item()"
    (line,) = set(lightning_info())
    assert (
        line.startswith("SimulatedDecentralizedStrategy(vectorize='auto'): the per-worker path") and reason in line
    ), line
    assert len(auto) == WORLD and all(torch.equal(a, b) for a, b in zip(auto, apart))


def test_stacking_needs_a_dataloader_with_a_batch_size() -> None:
    from lightning_decentral.simulation.vectorized import stacking_problem

    net = torch.nn.Linear(2, 1)
    assert stacking_problem(net, torch.optim.SGD(net.parameters(), lr=0.1), batch_size=None) == (
        "the training DataLoader has no batch_size (a batch_sampler?)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.batch_norm], ids=lambda c: c.name)
def test_the_default_path_equals_the_ranks_batch_norm_counts_included(
    config: Config, on_processes: list[dict[str, Any]], lightning_info
) -> None:
    """vectorize="auto" stacks this module after a first-batch trial under torch.vmap. Before, the trial ran on the
    stacked buffers: every worker's BatchNorm counted one batch more (num_batches_tracked = K + 1) and its running
    statistics moved, so the default path equalled neither vectorize=False nor the processes."""
    auto, stacked, apart = (sim.fit_simulated(config, WORLD, vectorize=v) for v in ("auto", True, False))
    (line,) = set(lightning_info())
    assert "the stacked path" in line, line
    assert all(torch.equal(a, s) for a, s in zip(auto["states"], stacked["states"]))  # the same path: bit for bit
    ranks = torch.stack([r[config.name]["state"] for r in on_processes]).double()
    torch.testing.assert_close(torch.stack(auto["states"]).double(), ranks, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(auto["states"]), torch.stack(apart["states"]), atol=1e-5, rtol=0)
    batches = [[config.steps * config.accumulate]] * WORLD
    assert auto["counts"] == apart["counts"] == [r[config.name]["counts"] for r in on_processes] == batches


def test_the_trial_leaves_every_random_generator_and_attribute_as_the_per_worker_path_has_them(lightning_info) -> None:
    """A module that draws from torch's generator when an epoch starts, from Python's and torch's in training_step (its
    noise stops the trial under torch.vmap) and counts its steps. Before, the trial drew from Python's generator and
    counted a step on the last worker, and the workers taken apart started from the random state of the first batch,
    not of the start of training: vectorize="auto" gave another run than vectorize=False."""
    config = Config("draws", optimizer=SGD, steps=3)
    auto, apart = (sim.fit_simulated(config, WORLD, vectorize=v, module=sim.DrawsAtRandom) for v in ("auto", False))
    (line,) = set(lightning_info())
    assert "the per-worker path" in line and "training_step draws random numbers" in line, line
    assert all(torch.equal(a, b) for a, b in zip(auto["states"], apart["states"]))
    assert [m.steps_seen for m in auto["modules"]] == [m.steps_seen for m in apart["modules"]] == [3] * WORLD
    assert (auto["states"][1] - auto["states"][2]).abs().max() > 1e-4  # the workers' noise differs


def test_samples_that_load_at_random_keep_the_workers_apart(lightning_info) -> None:
    """Stacked, the process would load every worker's samples from its own random state (one fetch for all): a
    dataset's random transform would differ from the processes' and the per-worker path's. Before, "auto" stacked."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_decentral.simulation.vectorized import stacking_problem

    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = (torch.zeros(4, 2), torch.zeros(4, 1))
    before = torch.get_rng_state()
    assert stacking_problem(net, optimizer, 2, DataLoader(sim.Jittered(*data), batch_size=2)) == (
        "its training samples load at random (a random transform: each worker needs its own random state)"
    )
    assert torch.equal(torch.get_rng_state(), before)  # the look at the samples draws nothing
    assert stacking_problem(net, optimizer, 2, DataLoader(TensorDataset(*data), batch_size=2)) is None
    config = Config("jittered", optimizer=SGD, steps=3)
    auto, apart = (
        sim.fit_simulated(config, WORLD, vectorize=v, dataset_class=sim.Jittered)["states"] for v in ("auto", False)
    )
    (line,) = set(lightning_info())
    assert "the per-worker path" in line and "samples load at random" in line, line
    assert all(torch.equal(a, b) for a, b in zip(auto, apart))


def test_bf16_mixed_batch_norm_runs_stacked(lightning_info) -> None:
    """bf16 activations into a BatchNorm with float32 running statistics: under torch.vmap `F.batch_norm` refused them
    (`RuntimeError: expected scalar type BFloat16 but found Float`, on CUDA `Expected running_mean to have type
    BFloat16 but got Float`) at the first step, on vectorize=True and on the default path alike."""
    config = Config("bf16_batch_norm", optimizer=SGD, batch_norm=True, steps=3)
    runs = {
        v: sim.fit_simulated(config, WORLD, vectorize=v, module=sim.BiasFreeBatchNorm, precision="bf16-mixed")
        for v in ("auto", True, False)
    }
    (line,) = set(lightning_info())
    assert "the stacked path" in line, line
    assert all(torch.equal(a, s) for a, s in zip(runs["auto"]["states"], runs[True]["states"]))
    # bf16 activations, summed in another order: 2e-4 apart here (bf16-mixed is 3e-4 from 32-true)
    torch.testing.assert_close(
        torch.stack(runs["auto"]["states"]), torch.stack(runs[False]["states"]), atol=1e-3, rtol=0
    )
    assert runs["auto"]["counts"] == runs[False]["counts"] == [[3]] * WORLD


def test_the_trial_runs_in_the_runs_precision(lightning_info) -> None:
    """A training_step that cannot run under torch.vmap only under autocast: the trial ran in full precision and passed,
    and the first stacked step stopped with the vmap error; now the workers are taken apart, as vectorize=False."""
    config = Config("autocast_item", optimizer=SGD, steps=2)
    auto, apart = (
        sim.fit_simulated(config, WORLD, vectorize=v, module=sim.ChecksItsRangeUnderAutocast, precision="bf16-mixed")
        for v in ("auto", False)
    )
    (line,) = set(lightning_info())
    assert "the per-worker path" in line and ".item()" in line, line
    assert all(torch.equal(a, b) for a, b in zip(auto["states"], apart["states"]))
