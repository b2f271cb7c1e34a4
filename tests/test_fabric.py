"""Fabric(strategy="dpsgd" / "decentlam") in a hand-written loop: the dense reference on 4 gloo processes,
evaluation on x̄, checkpoints (exact resume, x̄ fallback, Trainer -> Fabric, Fabric -> plain module, Fabric -> Trainer),
the monitors, bad input and a killed rank."""

from __future__ import annotations

import pickle
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import lightning_decentral
from lightning_decentral import fabric
from lightning_decentral.checkpoint import META_KEY, shard_directory
from lightning_decentral.mixing import RandomDelays
from tests import fabric_workers, reference, workers
from tests.helpers import run_distributed, start_processes
from tests.models import flat, initial_net
from tests.reference import Config

WORLD = 4
SGD = {"lr": 0.1}
MOMENTUM = {"lr": 0.05, "momentum": 0.9}


def decentlam(name: str, **kwargs: Any) -> Config:
    return Config(name, momentum="decentlam", **kwargs)


CONFIGS = [
    Config("ring-awc-momentum", optimizer=MOMENTUM),
    Config("one_peer-atc-sgd", topology="one_peer_exponential", combine="atc", optimizer=SGD),
    Config("exponential-awc-every2-rounds2", topology="exponential", gossip_every=2, gossip_steps=2),
    Config("ring-awc-accumulate-clip", optimizer=MOMENTUM, accumulate=2, clip=0.05),
    Config(
        "one_peer-atc-batchnorm-scheduler",
        topology="one_peer_exponential",
        combine="atc",
        batch_norm=True,
        scheduler="step",
    ),
    Config("ring-awc-adam-float64", optimizer={"name": "adam", "lr": 0.01}, dtype=torch.float64),
    Config(
        "exponential-atc-every2-rounds-by-epoch",
        topology="exponential",
        combine="atc",
        optimizer=MOMENTUM,
        gossip_every=2,
        gossip_steps={"epoch": {0: 1, 1: 3}},
        steps_per_epoch=2,
        steps=8,
    ),
    decentlam(
        "ring-decentlam-nesterov-wd", optimizer={"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ),
    decentlam("ring-decentlam-small-buckets-batchnorm", optimizer=MOMENTUM, bucket_cap_mb=1e-4, batch_norm=True),
    decentlam("ring-decentlam-clip-accumulate", optimizer=MOMENTUM, clip=0.05, accumulate=2),
    Config("ring-awc-stale2-random-delays", optimizer=MOMENTUM, staleness=2, delays=RandomDelays(seed=5), steps=8),
]


def test_registered_in_fabric_and_trainer_registries() -> None:
    for name, momentum, start_method in (("dpsgd", "local", "popen"), ("decentlam_spawn", "decentlam", "spawn")):
        strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(strategy, fabric.DecentralizedStrategy)
        assert (strategy.momentum, strategy.start_method) == (momentum, start_method)
        assert isinstance(StrategyRegistry.get(name), lightning_decentral.DecentralizedStrategy)


def test_bad_arguments_fail_when_built() -> None:
    with pytest.raises(ValueError, match="`combine` must be one of"):
        fabric.DecentralizedStrategy(combine="acw")


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    return run_distributed(fabric_workers.fit_configs, WORLD, configs=CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_rank_matches_the_dense_reference(trained: list[dict[str, torch.Tensor]], config: Config) -> None:
    expected = reference.assert_every_rank_matches(trained, config, WORLD)
    assert (expected[0] - expected[1]).abs().max() > 1e-4  # decentralized: the replicas really differ


RESUME = {
    "awc": Config("awc", optimizer=MOMENTUM),
    "atc": Config("atc", combine="atc", topology="one_peer_exponential", optimizer={"name": "adam", "lr": 0.01}),
    "decentlam": decentlam("decentlam", optimizer=MOMENTUM),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, Any]], Path]]:
    out = {}
    for name, config in RESUME.items():
        root = tmp_path_factory.mktemp(name)
        out[name] = run_distributed(fabric_workers.resume, WORLD, config=config, root=str(root)), root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUME))
def test_load_resumes_every_replica_bit_for_bit(resumed: dict, name: str) -> None:
    results, _ = resumed[name]
    assert (results[0]["full"] - results[1]["full"]).abs().max() > 1e-4
    for rank, result in enumerate(results):
        assert torch.equal(result["resumed"], result["full"]), f"rank {rank}"


@pytest.mark.slow
def test_data_order_in_the_state_resumes_a_shuffled_loop_bit_for_bit(tmp_path: Path) -> None:
    results = run_distributed(fabric_workers.resume_shuffled, 2, root=str(tmp_path))
    for rank, result in enumerate(results):
        assert torch.equal(result["order=True"], result["full"]), f"rank {rank}"
        assert (result["order=False"] - result["full"]).abs().max() > 1e-4  # without it: epoch 0's order again


@pytest.mark.slow
def test_saved_file_holds_the_average_and_loads_into_a_plain_module(resumed: dict) -> None:
    results, root = resumed["awc"]
    checkpoint = torch.load(root / "half.ckpt", weights_only=True)
    plain = initial_net(0)  # no Fabric, no strategy
    plain.load_state_dict(checkpoint["model"])
    torch.testing.assert_close(flat(plain), torch.stack([r["half"] for r in results]).mean(0), atol=1e-6, rtol=0)
    assert checkpoint["note"] == "fabric" and checkpoint[fabric.STEP_KEY] == RESUME["awc"].steps // 2
    shards = sorted(p.name.rsplit(".", 2)[0] for p in Path(shard_directory(root / "half.ckpt")).iterdir())
    assert shards == [f"rank-{r:05d}-of-{WORLD:05d}" for r in range(WORLD)]
    assert checkpoint[META_KEY]["world_size"] == WORLD


@pytest.mark.slow
def test_other_world_size_resumes_from_the_average_with_one_warning(resumed: dict) -> None:
    results, root = resumed["awc"]
    mean = torch.stack([r["half"] for r in results]).mean(0)
    loaded = run_distributed(
        fabric_workers.resume_from_average, 2, config=RESUME["awc"], checkpoint=str(root / "half.ckpt")
    )
    for rank, result in enumerate(loaded):
        torch.testing.assert_close(result["start"], mean, atol=1e-6, rtol=0)
        assert result["step"] == RESUME["awc"].steps // 2
        assert len(result["warnings"]) == (1 if rank == 0 else 0)
    assert "saved by 4 ranks and this run has 2" in loaded[0]["warnings"][0]


@pytest.mark.slow
def test_a_trainer_checkpoint_loads_into_fabric_with_its_shards(tmp_path: Path) -> None:
    """The LightningModule itself, and the ``nn.Sequential`` it held as ``self.net``: as is, no key matches and the
    load fails naming them and the prefix, restoring nothing (before, it loaded nothing and set the step to 6);
    ``under_prefix(net, "net.")`` loads every rank's own replica."""
    path = str(tmp_path / "trainer.ckpt")
    trained = run_distributed(workers.evaluate_and_checkpoint, WORLD, path=path, eval_on="average")
    for inner in (False, True):
        loaded = run_distributed(fabric_workers.from_trainer, WORLD, checkpoint=path, inner=inner)
        for rank, result in enumerate(loaded):
            assert torch.equal(result["replica"], trained[rank]["replica"]), f"rank {rank}"  # its own replica, not x̄
            assert result["step"] == result["global_step"] == 6
            assert not result["warnings"]
            if inner:
                assert "The checkpoint holds none of the model's weights" in result["as_is"], result["as_is"]
                assert "['0.weight', '0.bias', '2.weight'] ..." in result["as_is"]
                assert "under_prefix(model, 'net.')" in result["as_is"]
                assert result["untouched"]


@pytest.fixture(scope="module")
def monitored() -> list[dict[str, Any]]:
    return run_distributed(fabric_workers.evaluate_and_monitor, WORLD, config=Config("monitor", optimizer=MOMENTUM))


@pytest.mark.slow
def test_averaged_model_swaps_in_the_average_and_restores_every_replica(monitored: list[dict[str, Any]]) -> None:
    replicas = torch.stack([r["replica"] for r in monitored])
    for result in monitored:
        torch.testing.assert_close(result["averaged"], replicas.mean(0), atol=1e-6, rtol=0)
        assert torch.equal(result["after_average"], result["replica"])
        plain = initial_net(0)
        torch.nn.utils.vector_to_parameters(replicas.mean(0), plain.parameters())
        torch.testing.assert_close(
            result["averaged_output"], plain(result["averaged_input"]).detach(), atol=1e-5, rtol=0
        )


@pytest.mark.slow
def test_consensus_distance_is_that_of_the_replicas(monitored: list[dict[str, Any]]) -> None:
    replicas = torch.stack([r["replica"] for r in monitored]).double()
    distance = (replicas - replicas.mean(0)).square().sum(1).mean().sqrt()
    for result in monitored:
        consensus = result["consensus"]
        torch.testing.assert_close(consensus["consensus/distance"].double(), distance, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(
            consensus["consensus/relative"].double(), distance / replicas.mean(0).norm(), atol=1e-6, rtol=1e-4
        )
        assert float(consensus["consensus/residual"]) > 0


@pytest.mark.slow
def test_effective_learning_rate_is_the_callbacks_formula(monitored: list[dict[str, Any]]) -> None:
    """α_e / γ = ⟨ḡ_loc, g(x̄)⟩ / ‖g(x̄)‖², recomputed densely from every rank's replica and batch."""
    mean = torch.stack([r["before_step"] for r in monitored]).mean(0)
    at_mean = []
    for result in monitored:
        net = initial_net(0)
        torch.nn.utils.vector_to_parameters(mean, net.parameters())
        ((x, y),) = result["batch"]
        torch.nn.functional.mse_loss(net(x), y).backward()
        at_mean.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        assert torch.equal(result["after_measure"], result["before_step"])  # the replica is untouched
    local = torch.stack([r["grads"] for r in monitored]).double().mean(0)
    g = torch.stack(at_mean).double().mean(0)
    ratio = torch.dot(local, g) / torch.dot(g, g)
    for result in monitored:
        torch.testing.assert_close(result["lr"]["lr/effective_ratio"], ratio, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["lr"]["lr/effective"], ratio * MOMENTUM["lr"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["lr"]["noise/decentralized"], (local - g).norm(), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_schedule_by_epoch_asks_the_loop_for_set_epoch() -> None:
    (error,) = run_distributed(fabric_workers.schedule_by_epoch_without_set_epoch, 1)
    assert "call `fabric.strategy.set_epoch(epoch)` at the start of every epoch" in error


@pytest.mark.slow
def test_bad_setups_name_the_fix() -> None:
    errors = run_distributed(fabric_workers.bad_setups, 2)[0]
    assert "exactly one optimizer" in errors["two_optimizers"]
    assert "not a DistributedDataParallel wrapper" in errors["ddp_wrapped"]
    assert "one module per Fabric" in errors["second_model"]


@pytest.mark.slow
def test_setup_dataloaders_shards_the_data_over_the_ranks() -> None:
    indices = run_distributed(fabric_workers.distributed_sampler, 2)
    assert sorted(indices[0] + indices[1]) == list(range(16)) and not set(indices[0]) & set(indices[1])


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_within_the_timeout(tmp_path: Path) -> None:
    stamp, timeout = tmp_path / "killed_at", 15.0
    with tempfile.TemporaryDirectory() as out:
        procs = start_processes(fabric_workers.killed_peer, 2, out, stamp=str(stamp), timeout=timeout)
        deadline = time.monotonic() + 180
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
        status, result = pickle.loads((Path(out) / "0.pkl").read_bytes())
    assert status == "ok", result
    assert "step 2" in result["failure"], result["failure"]
    assert result["stopped_at"] - float(stamp.read_text()) < timeout + 10


@pytest.mark.slow
def test_the_gpt_example_trains_evaluates_on_the_average_saves_and_resumes(tmp_path: Path) -> None:
    from examples.fabric_gpt import GPT

    tiny = [
        "--sentences",
        "200",
        "--block_size",
        "16",
        "--batch_size",
        "4",
        "--n_layer",
        "1",
        "--n_embd",
        "16",
        "--n_head",
        "2",
        "--eval_every",
        "2",
        "--out_dir",
        str(tmp_path),
    ]
    first = run_distributed(fabric_workers.example_gpt, WORLD, argv=["--steps", "3", *tiny])
    assert [r["step"] for r in first] == [3] * WORLD and first[0]["val_loss"] == first[1]["val_loss"]
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    model = GPT(vocab_size=checkpoint["model"]["tokens.weight"].shape[0], block_size=16, n_layer=1, n_head=2, n_embd=16)
    model.load_state_dict(checkpoint["model"])  # x̄, into the plain module
    resumed = run_distributed(fabric_workers.example_gpt, WORLD, argv=["--steps", "5", "--resume", *tiny])
    assert [(r["resumed_from"], r["step"]) for r in resumed] == [(3, 5)] * WORLD
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").is_file()


@pytest.mark.slow
def test_the_loop_of_the_fabric_docs_runs_as_written(tmp_path: Path) -> None:
    """The first code block of docs/fabric.md is a complete program: it trains, evaluates x̄ and saves."""
    page = (Path(__file__).parents[1] / "docs" / "fabric.md").read_text()
    code = page.split("```python\n", 1)[1].split("```\n", 1)[0]
    printed = run_distributed(fabric_workers.docs_loop, 2, code=code, root=str(tmp_path))[0]
    losses = [float(line.split("loss of x̄ ")[1].split(",")[0]) for line in printed if line.startswith("epoch")]
    assert len(losses) == 3 and losses[-1] < losses[0], printed
    saved = torch.load(tmp_path / "dpsgd.ckpt", weights_only=True)["model"]
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).load_state_dict(saved)


@pytest.mark.slow
def test_effective_learning_rate_replays_the_dropout_masks_of_the_training_forwards() -> None:
    """With dropout and 2 micro-batches per step: `effective_lr_metrics` equals g(x̄) computed densely here with
    each micro-batch's forward run from the random state its training forward started from (the callback's
    definition); the masks matter (other masks give another ratio); too few batches is an error."""
    config = Config("dropout", optimizer=MOMENTUM, accumulate=2)
    results = run_distributed(fabric_workers.monitor_with_dropout, 2, config=config)
    mean = torch.stack([r["before_step"] for r in results]).mean(0)

    def gradients_at_mean(replay: bool) -> torch.Tensor:
        total = []
        for result in results:
            net = fabric_workers.dropout_net(0)
            torch.nn.utils.vector_to_parameters(mean, net.parameters())
            assert len(result["states"]) == len(result["batches"]) == config.accumulate
            for (x, y), state in zip(result["batches"], result["states"]):
                if replay:
                    torch.set_rng_state(state)
                (torch.nn.functional.mse_loss(net(x), y) / config.accumulate).backward()
            total.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        return torch.stack(total).double().mean(0)

    local = torch.stack([r["grads"] for r in results]).double().mean(0)
    g = gradients_at_mean(replay=True)
    ratio, noise = torch.dot(local, g) / torch.dot(g, g), (local - g).norm()
    torch.manual_seed(12345)
    other = gradients_at_mean(replay=False)  # other dropout masks
    assert abs(float(torch.dot(local, other) / torch.dot(other, other) - ratio)) > 1e-3
    for result in results:
        torch.testing.assert_close(result["lr"]["lr/effective_ratio"].double(), ratio, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["lr"]["lr/effective"].double(), ratio * MOMENTUM["lr"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["lr"]["noise/decentralized"].double(), noise, atol=1e-6, rtol=1e-5)
        assert torch.equal(result["after_measure"], result["before_step"]) and result["rng_restored"]
        assert "got 1 batches but the step ran 2 training forwards" in result["too_few"]
        assert "micro-batches, in order" in result["too_few"]


@pytest.mark.slow
def test_a_fabric_checkpoint_converted_by_to_trainer_checkpoint_resumes_every_replica_under_the_trainer(
    tmp_path: Path,
) -> None:
    """Fabric trains K steps and saves on 2 ranks; `to_trainer_checkpoint` converts it (shards too); the Trainer's
    `fit(ckpt_path=...)` starts every rank from its own Fabric replica and momentum bit for bit, at global_step K,
    with no fallback warning, and trains on from there."""
    config = Config("to-trainer", optimizer={"lr": 0.05, "momentum": 0.9})
    fabric_path, trainer_path = str(tmp_path / "fabric.ckpt"), str(tmp_path / "trainer.ckpt")
    saved = run_distributed(fabric_workers.train_and_save_for_trainer, 2, config=config, path=fabric_path)
    assert (saved[0]["replica"] - saved[1]["replica"]).abs().max() > 1e-4  # the replicas really differ
    with pytest.warns(UserWarning, match=rf"global_step {config.steps}.*epoch 0.*scheduler.*\['note'\]"):
        fabric.to_trainer_checkpoint(fabric_path, trainer_path, prefix="net.")
    converted = torch.load(trainer_path, weights_only=True)
    assert converted[META_KEY] == torch.load(fabric_path, weights_only=True)[META_KEY]
    assert sorted(converted["state_dict"]) == sorted(f"net.{k}" for k in initial_net(0).state_dict())
    resumed = run_distributed(fabric_workers.trainer_resumes_from_fabric, 2, config=config, path=trainer_path, extra=2)
    for rank, (before, after) in enumerate(zip(saved, resumed)):
        assert torch.equal(after["start"], before["replica"]), f"rank {rank}"  # its own replica, not x̄
        assert torch.equal(after["momentum"], before["momentum"]), f"rank {rank}"
        assert (after["start_step"], after["end_step"]) == (config.steps, config.steps + 2)
        assert not after["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("momentum", ["local", "decentlam"])
def test_trains_under_bf16_mixed_precision(momentum: str) -> None:
    """Autocast forward, float32 replicas and optimizer state: the loop trains and the replicas differ."""
    results = run_distributed(fabric_workers.fit_mixed_precision, 2, momentum=momentum)
    replicas = torch.stack([r["replica"] for r in results])
    assert torch.isfinite(replicas).all()
    assert (replicas[0] - replicas[1]).abs().max() > 1e-4
    assert all(r["step"] == 6 and r["dtype"] == "torch.float32" for r in results)


@pytest.mark.slow
def test_ranks_with_another_configuration_stop_at_setup() -> None:
    messages = run_distributed(fabric_workers.disagreeing_setup, 2)
    for message in messages:
        assert "do not run the same configuration" in message and "combine" in message, message


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_before_it_reaches_a_neighbour() -> None:
    """The rank holding the NaN raises before sending (naming itself and the step); its neighbour then
    stops with the gossip error instead of mixing the NaN in."""
    start = time.monotonic()
    messages = run_distributed(fabric_workers.nan_on_one_rank, 2, timeout=120)
    assert messages[1].startswith("FloatingPointError") and "Rank 1" in messages[1] and "step 3" in messages[1], (
        messages[1]
    )
    assert "fabric.clip_gradients(model, optimizer, max_norm=...)" in messages[1] and "Trainer(" not in messages[1]
    assert messages[0] != "no error"
    # two ranks: the exchange is an all-reduce (W = 11ᵀ/2); before, the error named "a neighbour (every rank)"
    assert "another rank (this exchange is an all-reduce of every rank)" in messages[0], messages[0]
    assert time.monotonic() - start < 100


def test_a_misspelled_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="gossip_step"):
        fabric.DecentralizedStrategy(gossip_step=4)


@pytest.mark.slow
def test_resuming_under_another_update_rule_warns_once(resumed: dict) -> None:
    _, root = resumed["awc"]
    loaded = run_distributed(
        fabric_workers.load_under, WORLD, config=RESUME["awc"], checkpoint=str(root / "half.ckpt"), combine="atc"
    )
    assert [len(result["warnings"]) for result in loaded] == [1] + [0] * (WORLD - 1)
    assert "another update rule" in loaded[0]["warnings"][0] and "'awc' -> 'atc'" in loaded[0]["warnings"][0]
    assert not any(result["error"] for result in loaded)


@pytest.mark.slow
def test_a_shard_of_another_step_than_its_file_is_refused(resumed: dict, tmp_path: Path) -> None:
    """The file says step k + 1, every shard k: no rank resumes a replica from another step than the loop's."""
    import shutil

    _, root = resumed["awc"]
    tampered = tmp_path / "half.ckpt"
    shutil.copytree(shard_directory(root / "half.ckpt"), shard_directory(tampered))
    checkpoint = torch.load(root / "half.ckpt", weights_only=True)
    checkpoint[fabric.STEP_KEY] += 1
    torch.save(checkpoint, tampered)
    loaded = run_distributed(fabric_workers.load_under, WORLD, config=RESUME["awc"], checkpoint=str(tampered))
    saved = RESUME["awc"].steps // 2
    for result in loaded:
        assert f"saved at step {saved} but the checkpoint's loops are at {saved + 1}" in result["error"], result


@pytest.mark.slow
def test_save_average_and_load_between_forward_and_backward_raise_naming_where_to_call_them(tmp_path: Path) -> None:
    """Before, `fabric.save` there swapped x̄ into the parameters the backward needed: both ranks died with autograd's
    "modified by an inplace operation"."""
    for result in run_distributed(fabric_workers.save_between_forward_and_backward, 2, timeout=120, root=str(tmp_path)):
        for name, call in (("save", "fabric.save"), ("averaged_model", "averaged_model()"), ("load", "fabric.load")):
            assert result[name].startswith(
                f"{call} ran at step 0 between the training forward and `fabric.backward`"
            ), result
            assert "after `fabric.backward` or `optimizer.step()`" in result[name]
        assert result["step"] == 1
    assert not (tmp_path / "mid.ckpt").exists() and (tmp_path / "after.ckpt").exists()


def _fabric_checkpoint(path: Path, world_size: int = 3) -> None:
    """A checkpoint as `fabric.save` writes it on `world_size` ranks: the file, and rank `r`'s shard holding net `r`."""
    from lightning_decentral import checkpoint

    optimizer = torch.optim.SGD(initial_net(0).parameters(), lr=0.1).state_dict()
    meta = {"save_id": 5, "world_size": world_size}
    torch.save({"model": initial_net(0).state_dict(), "optimizer": optimizer, fabric.STEP_KEY: 3, META_KEY: meta}, path)
    for rank in range(world_size):
        shard = checkpoint.make_shard(5, rank, world_size, initial_net(rank).state_dict(), 3, [optimizer], {})
        checkpoint.write_shard(shard, checkpoint.shard_path(str(path), rank, world_size, 5))


def test_to_trainer_checkpoint_with_a_shard_missing_falls_back_to_the_average_or_converts_a_nodes_own_ranks(
    tmp_path: Path,
) -> None:
    """Before, a missing shard raised a raw FileNotFoundError after the shards before it were written (orphans)."""
    from lightning_decentral.checkpoint import read_shard, shard_path

    source, target = tmp_path / "fabric.ckpt", tmp_path / "trainer.ckpt"
    _fabric_checkpoint(source)
    Path(shard_path(str(source), 1, 3, 5)).unlink()  # on another node, or lost
    with pytest.warns(UserWarning, match=r"rank 1: the shard is missing.*resumes from the average x̄.*`ranks=`"):
        fabric.to_trainer_checkpoint(source, target, prefix="net.")
    converted = torch.load(target, weights_only=True)
    assert META_KEY not in converted and not Path(shard_directory(target)).exists()  # no orphan shard
    assert torch.equal(converted["state_dict"]["net.0.weight"], initial_net(0)[0].weight)

    with pytest.raises(FileNotFoundError, match=r"ranks \[1, 2\].*rank 1: the shard is missing. Nothing was written"):
        fabric.to_trainer_checkpoint(source, tmp_path / "node1.ckpt", ranks=[1, 2])
    assert not list(tmp_path.glob("node1.ckpt*"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the conversion does not carry over
        fabric.to_trainer_checkpoint(source, tmp_path / "node0.ckpt", prefix="net.", ranks=[0, 2])  # this node's ranks
    assert torch.load(tmp_path / "node0.ckpt", weights_only=True)[META_KEY] == {"save_id": 5, "world_size": 3}
    for rank in (0, 2):
        shard = read_shard(shard_path(str(tmp_path / "node0.ckpt"), rank, 3, 5))
        assert torch.equal(shard["state_dict"]["net.0.weight"], initial_net(rank)[0].weight)
    assert not Path(shard_path(str(tmp_path / "node0.ckpt"), 1, 3, 5)).exists()


@pytest.mark.slow
def test_a_rank_that_skips_a_load_stops_every_rank_at_once_naming_what_each_does(tmp_path: Path) -> None:
    """Before, rank 0 waited in the load's all-gather and rank 1 in its exchange until the timeout (30 minutes)."""
    timeout = 60.0
    loader, trainer = run_distributed(
        fabric_workers.load_on_rank_zero_only, 2, timeout=120, root=str(tmp_path), pg_timeout=timeout
    )
    assert loader["error"].startswith(
        f"Disagreement: The ranks are not doing the same thing: rank 0 is in fabric.load('{tmp_path}/first.ckpt') "
        "while rank 1 is in optimizer step 0."
    ), loader["error"]
    assert "call it on every rank (not under `if global_rank == 0`)" in loader["error"]
    assert trainer["error"].startswith("PeerFailure: The gossip exchange of step 0 failed"), trainer["error"]
    assert loader["seconds"] < timeout and trainer["seconds"] < timeout  # neither waited for the timeout
