"""The architecture's promises that no other test states (docs/architecture.md): the update-rule arguments are
ordinary members of the executors' shared surface, one per field of `GossipOptions`; per-rank state is registered
in one place, and shards written before the registry still resume."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_decentral.checkpoint import (
    META_KEY,
    SHARD_FORMAT,
    make_shard,
    read_shard,
    rng_state,
    shard_path,
    write_shard,
)
from lightning_decentral.driver import RANDOM_STATE, RECORDED_OPTIONS, Driven, StepDriver
from lightning_decentral.membership.rejoin import flatten, unflatten
from lightning_decentral.options import GossipOptions
from lightning_decentral.trainer.rejoin import taken_over
from tests import simulation_workers as sim
from tests.helpers import assert_resumed_as_straight

WORLD = 4


class _Executor(Driven):
    def __init__(self, options: GossipOptions) -> None:
        self.driver = StepDriver(options)


def test_every_option_is_a_property_of_driven_with_the_options_value() -> None:
    options = GossipOptions(combine="atc", gossip_every=3, compression="sign")
    executor = _Executor(options)
    for field in fields(GossipOptions):
        if field.name == "topology":  # Driven.topology is the bound one
            continue
        assert isinstance(vars(Driven).get(field.name), property), field.name
        assert getattr(executor, field.name) == getattr(options, field.name), field.name
    assert executor.bytes_sent == 0


# -- shards written before the state registry (format 1) still resume ------------------------------------------------

OUTER = {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), "gossip_every": 3}
FORMAT_1_KEYS = {"save_id", "rank", "world_size", "state_dict", "strategy", "rng", "optimizer_states", "precision"}


def _format_1(shard: dict[str, Any]) -> dict[str, Any]:
    """`shard` as `make_shard` wrote it before the registry (main at 941b4d9): no `"format"`; the rule's state under
    `"rule_state"` when not empty, compressed gossip's under `"gossip"` when there is compressed gossip."""
    old = {key: shard[key] for key in FORMAT_1_KEYS}
    for key in ("rule_state", "gossip"):
        if key in shard:
            old[key] = shard[key]
    return old


def _rewrite_shards(path: str, workers: int, rewrite: Any) -> None:
    meta = torch.load(path, weights_only=True)[META_KEY]
    for worker in range(workers):
        shard_file = shard_path(path, worker, workers, meta["save_id"])
        write_shard(rewrite(read_shard(shard_file)), shard_file)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [OUTER, {"compression": "sign"}], ids=["outer", "compressed"])
def test_a_shard_written_before_the_state_registry_resumes_exactly(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    """A mid-round checkpoint (the outer anchor and momentum, or CHOCO's public copies, in every shard), its shards
    rewritten in the format before the registry: the resume ends bit for bit where the run without a stop does."""
    path = str(tmp_path / "old.ckpt")
    first = sim.resume_simulated(WORLD, save=path, topology="ring", **kwargs)
    meta = torch.load(path, weights_only=True)[META_KEY]
    new = read_shard(shard_path(path, 0, WORLD, meta["save_id"]))
    assert new["format"] == SHARD_FORMAT
    assert ("rule_state" in new) == ("outer_optimizer" in kwargs) and ("gossip" in new) == ("compression" in kwargs)
    _rewrite_shards(path, WORLD, _format_1)
    runs = {
        "first": first,
        "straight": sim.resume_simulated(WORLD, topology="ring", **kwargs),
        "resumed": sim.resume_simulated(WORLD, load=path, topology="ring", **kwargs),
    }
    assert_resumed_as_straight(runs)


@pytest.mark.slow
def test_a_shard_of_a_later_format_is_not_read_and_the_warning_names_the_format(tmp_path: Path) -> None:
    path = str(tmp_path / "later.ckpt")
    sim.resume_simulated(WORLD, save=path, topology="ring")
    _rewrite_shards(path, WORLD, lambda shard: {**shard, "format": SHARD_FORMAT + 1})
    with pytest.warns(UserWarning, match=f"a later format than {SHARD_FORMAT}.*written by a newer version"):
        sim.resume_simulated(WORLD, load=path, topology="ring")


def test_a_piece_of_state_is_one_registration_and_keys_are_not_shared() -> None:
    driver = StepDriver(GossipOptions(topology="complete"))
    driver.bind(world_size=2)
    assert driver.state.keys == ["rule_state", "gossip", "rng"]
    seen: list[Any] = []
    driver.state.register("mine", save=lambda worker: {"worker": worker}, load=seen.append)
    contents = driver.shard_contents(1, state_dict={}, step=3, optimizer_states=[{}], precision={})
    shard = make_shard(7, 1, 2, **contents)
    assert shard["mine"] == {"worker": 1} and shard["format"] == SHARD_FORMAT
    driver.state.load([shard])
    assert seen == [[{"worker": 1}]]
    for taken in ("mine", "state_dict", "rng"):
        with pytest.raises(ValueError, match=f"{taken!r} is taken"):
            driver.state.register(taken, save=lambda worker: None, load=print)


def _draws() -> list[float]:
    """What dropout and a shuffling sampler would draw next: torch's, numpy's and Python's generators."""
    return [*torch.rand(3).tolist(), *np.random.rand(2).tolist(), random.random()]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _saved(driver: StepDriver, optimizer_states: list[Any] | None = None, worker: int = 0) -> dict[str, Any]:
    return make_shard(7, worker, 2, **driver.shard_contents(worker, {}, step=3, optimizer_states=optimizer_states))


@pytest.mark.parametrize("full", [True, False], ids=["full", "weights_only"])
def test_the_data_order_is_a_registered_part_and_a_resume_draws_what_the_save_would_have(full: bool) -> None:
    """The random state is the driver's `"rng"` part: in every shard (also weights-only) under the key shards always
    used, and loading it makes the generators draw, bit for bit, what they drew after the save; a format-1 shard (no
    `"format"`, the same entry) restores it alike."""
    driver = StepDriver(GossipOptions(topology="complete"))
    driver.bind(world_size=2)
    shard = _saved(driver, [{}] if full else None)
    assert shard[RANDOM_STATE].keys() >= {"torch", "numpy", "python"}
    after_save = _draws()
    for saved in (shard, _format_1({**shard, "optimizer_states": None, "precision": None})):
        _draws()  # the run goes on, or another run started
        driver.state.load([saved], full)
        assert _draws() == after_save


def test_the_handover_carries_every_registered_part_and_the_rank_that_rejoins_keeps_its_own_random_state() -> None:
    """The source's shard, through the handover's wire format, holds every registered part (a part of its own, the
    random state); the rank that rejoins restores the parts but keeps its own random state (`taken_over`)."""
    drivers, seen = [], []
    for _ in range(2):
        driver = StepDriver(GossipOptions(topology="ring"))
        driver.bind(world_size=4)
        driver.state.register("mine", save=lambda worker: {"t": torch.arange(3.0)}, load=seen.append)
        drivers.append(driver)
    source, joining = drivers
    _seed(1)
    shard = _saved(source, [{}])
    description, payload = flatten({"shard": shard})
    received = unflatten(json.loads(json.dumps(description)), payload)["shard"]
    _assert_same(received[RANDOM_STATE], shard[RANDOM_STATE])
    assert {"mine", RANDOM_STATE} <= set(received)  # the parts with nothing to keep (no rule, no copies) leave none
    _seed(2)  # the rank that rejoins: a random state of its own
    own = _draws()
    _seed(2)
    joining.state.load([taken_over(received)])
    assert _draws() == own
    assert len(seen) == 1 and torch.equal(seen[0][0]["t"], torch.arange(3.0))


def test_a_shard_records_the_declared_options_only_where_the_run_changes_them() -> None:
    """`RECORDED_OPTIONS` (`shard_size`) beside the rule and the topology: left at its default, the record is the one
    shards held before (so `check_same_sharding` reads a shard without it as `shard_size=1`)."""
    assert RECORDED_OPTIONS == ("shard_size",)
    records = []
    for options in (GossipOptions(topology="ring"), GossipOptions(topology="ring", shard_size=2)):
        driver = StepDriver(options)
        driver.bind(world_size=4)
        records.append(driver.rule_record())
    assert records == [
        {"rule": "awc", "topology": "Ring(world_size=4)"},
        {"rule": "awc", "topology": "Ring(world_size=4)", "shard_size": "2"},
    ]


# -- the rejoin handover: tensors and plain data, no pickle --------------------------------------------------------


def test_the_handover_carries_a_shard_and_the_loops_as_tensors_and_plain_data() -> None:
    """What a member hands to a rank that rejoins (a shard with its optimizer's int keys, the random state's tuples, a
    bool tensor, a 0-dim tensor, an infinite float) comes back equal, with its types; anything else is refused."""
    optimizer = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), betas=(0.8, 0.9))
    optimizer.zero_grad()
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {
        "shard": make_shard(
            0,
            1,
            4,
            {"w": torch.arange(6.0).view(2, 3)},
            step=7,
            optimizer_states=[optimizer.state_dict()],
            parts={RANDOM_STATE: rng_state()},
        ),
        "loops": {
            "fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}, "mask": torch.tensor([True])}
        },
        "global_step": 7,
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": -1, "scale": float("inf"), "t": torch.tensor(2.5)}],
    }
    description, payload = flatten(state)
    json.dumps(description)  # plain JSON: nothing pickled
    assert payload.dtype == torch.uint8
    _assert_same(unflatten(json.loads(json.dumps(description)), payload), state)
    with pytest.raises(TypeError, match=r"tensors and plain data only .* got a object"):
        flatten({"callback": object()})


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b
