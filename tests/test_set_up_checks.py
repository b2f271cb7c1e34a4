"""Validation on what will run, before training (issue 38): the outer optimizer stepped once on copies of the model,
the compressor tried on the parameters' dtypes and sizes, a run shorter than `gossip_every` warned, the launcher's
counts and port checked; and what is counted and sent from the first step: every exchange's bytes, exactly, and
`random_k`'s public copies starting at the models."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.membership import launch
from lightning_decentral.mixing import ExchangeEvent
from tests.models import Regression, flat, rank_data


def _fit(strategy: SimulatedDecentralizedStrategy, module: pl.LightningModule | None = None, steps: int = 3) -> Any:
    """Fit `module` (a small regression) for `steps` steps; the Trainer."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(*rank_data(0, 64)), batch_size=4)
    trainer.fit(module or Regression(lr=0.1), train_dataloaders=data)
    return trainer


@pytest.mark.parametrize(
    "outer, reason",
    [(torch.optim.LBFGS, "LBFGS.*closure"), (torch.optim.SparseAdam, "SparseAdam.*(sparse|dense)")],
    ids=["lbfgs", "sparse_adam"],
)
def test_an_outer_optimizer_that_cannot_take_the_outer_step_is_refused_before_training(outer: Any, reason: str) -> None:
    """Before, the optimizer was built on a probe tensor and never stepped: both failed at the first round's end with
    torch's own error."""
    model = Regression(lr=0.1)
    strategy = SimulatedDecentralizedStrategy(workers=2, outer_optimizer=functools.partial(outer), gossip_every=2)
    with pytest.raises(ValueError, match=rf"outer_optimizer builds a {reason}.*torch\.optim\.SGD"):
        _fit(strategy, model)
    assert model.trainer.global_step == 0


class ComplexParameter(pl.LightningModule):
    """A complex parameter fitted to a complex target."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5, dtype=torch.complex64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return (self.weight - x.mean(0).to(torch.complex64)).abs().square().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_compressor_that_cannot_compress_the_parameters_dtype_is_refused_before_training() -> None:
    """Before: a raw `NotImplementedError: "ge_cpu" not implemented for 'ComplexFloat'` at step 0."""
    model = ComplexParameter()
    with pytest.raises(ValueError, match=r"cannot compress the model's torch.complex64 values.*compression=None"):
        _fit(SimulatedDecentralizedStrategy(workers=2, compression="sign"), model)
    assert model.trainer.global_step == 0


@pytest.mark.parametrize("compression", ["top_k:1e-14", "top_k:1e-9", "random_k:1e-9"])
def test_a_fraction_too_small_to_send_anything_is_refused_as_such(compression: str) -> None:
    """Before: `top_k:1e-14` was refused as "`consensus_step` ... got 0.0", a value never passed; `1e-9` ran and never
    mixed (γ = 3e-9)."""
    model = Regression(lr=0.1)
    strategy = SimulatedDecentralizedStrategy(workers=2, compression=compression)  # the fraction alone is a fraction
    with pytest.raises(ValueError, match=r"keeps a fraction 1e-(14|09) of the coordinates.*rounds to none.*at least"):
        _fit(strategy, model)
    assert model.trainer.global_step == 0


def test_a_run_that_ends_before_its_first_gossip_step_is_warned() -> None:
    with pytest.warns(UserWarning, match=r"gossip_every=5 is more than the run's max_steps=3.*never mix"):
        _fit(SimulatedDecentralizedStrategy(workers=2, gossip_every=5), steps=3)
    outer = functools.partial(torch.optim.SGD, lr=0.7)
    with pytest.warns(UserWarning, match=r"the outer optimizer never steps"):
        _fit(SimulatedDecentralizedStrategy(workers=2, gossip_every=5, outer_optimizer=outer), steps=3)


class BytesLogged(pl.Callback):
    """`gossip/bytes_sent` as logged after each step."""

    def __init__(self) -> None:
        self.logged: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.logged.append(trainer.callback_metrics["gossip/bytes_sent"])


@pytest.mark.parametrize(
    "options, logged, total",
    [
        ({}, [1, 2, 3, 4], 4),
        ({"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7), "gossip_every": 2}, [0, 0, 1, 1], 2),
    ],
    ids=["plain", "outer"],
)
def test_every_exchange_logs_its_bytes_exactly(options: dict[str, Any], logged: list[int], total: int) -> None:
    """Before, `gossip/bytes_sent` came with compression only, through a float32 tensor (37,947,735 bytes logged as
    37,947,736). A ring of 4: each worker sends its model (float32) to 2 neighbours per exchange; AWC posts a step's
    exchange before its training_step logs, the outer step after it, at the end of its round."""
    recorder = BytesLogged()
    model = Regression(lr=0.1)
    trainer = pl.Trainer(
        strategy=SimulatedDecentralizedStrategy(workers=4, topology="ring", vectorize=False, **options),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(*rank_data(0, 64)), batch_size=4))
    message = 4 * sum(p.numel() for p in model.parameters()) * 2
    assert all(value.dtype == torch.float64 for value in recorder.logged)
    assert [int(value) for value in recorder.logged] == [message * n for n in logged]
    assert trainer.strategy.bytes_sent == 4 * message * total  # every worker's


def test_the_logged_byte_count_is_exact_beyond_float32() -> None:
    strategy = SimulatedDecentralizedStrategy(workers=2)
    strategy.driver.sent.on_post(ExchangeEvent(step=0, tag=0, rounds=1, bytes_sent=37_947_735, post_started=0.0))
    assert float(strategy.driver.bytes_metrics()["gossip/bytes_sent"]) == 37_947_735


def test_random_k_keeps_replicas_that_start_equal_equal() -> None:
    """At lr 0 nothing moves the models but the gossip, and equal models have nothing to mix. Before, `random_k`'s
    copies started at zero; each sender draws other coordinates, so the copies differed and pushed the replicas
    apart by up to 0.67 (larger than the weights)."""
    model = Regression(lr=0.0)
    strategy = SimulatedDecentralizedStrategy(workers=4, compression="random_k:0.3", vectorize=False)
    start = flat(model).clone()
    _fit(strategy, model, steps=6)
    for worker in strategy.worker_modules():
        torch.testing.assert_close(flat(worker), start, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be 1 or more"),
        (["--nproc-per-node", "-2"], "--nproc-per-node must be 1 or more"),
        (["--nnodes", "0"], "--nnodes must be 1 or more"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank must be in [0, 2)"),
        (["--master-port", "70000"], "--master-port must be a port in [0, 65535]"),
    ],
)
def test_the_launchers_counts_are_range_checked(argv: list[str], message: str, capsys) -> None:
    """Before: `--nproc-per-node 0` or `-2` gave `KeyError: 0`, `--nnodes 0` started a worker with `WORLD_SIZE=0`."""
    with pytest.raises(SystemExit) as exit:
        launch.parse([*argv, "train.py"])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_a_busy_master_port_is_one_clear_line(capsys) -> None:
    """Before: a raw `DistNetworkError` and its C++ trace."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launch.main(["--master-port", str(port), "never_started.py"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--master-port {port} is already in use" in err and "--master-port 0" in err


@pytest.mark.parametrize("topology", ["one_peer_exponential", "random_matching"])
def test_compression_on_a_time_varying_topology_is_refused_naming_a_static_one(topology: str) -> None:
    """Before, `sign` on `one_peer_exponential` ran and stalled at 4.5-9 % of the start's consensus distance (each
    edge's public copy a period old); only the docs said so."""
    match = r"time-varying topology.*Use a static topology: topology='one_peer_ring'.*'exponential'"
    with pytest.raises(ValueError, match=match):
        pl.Trainer(strategy=DecentralizedStrategy(topology=topology, compression="sign"), accelerator="cpu", devices=4)
    with pytest.raises(ValueError, match=match):
        SimulatedDecentralizedStrategy(workers=4, topology=topology, compression="sign")
    SimulatedDecentralizedStrategy(workers=4, topology="exponential", compression="sign")
    SimulatedDecentralizedStrategy(workers=4, topology="one_peer_ring", compression="sign")


def test_compression_over_a_w_that_is_not_symmetric_is_warned_naming_a_symmetric_topology() -> None:
    """`sign` on the directed `one_peer_ring` diverged on sharded.py's language model (sharded, and in the simulation:
    at `γ = 1` after 150 steps, at `γ = 1/2` after 300) where the undirected `ring` trained."""
    match = r"compression=Sign\(.*\) on OnePeerRing\(world_size=4\), whose W is not symmetric.*topology='ring'"
    with pytest.warns(UserWarning, match=match):
        pl.Trainer(
            strategy=DecentralizedStrategy(topology="one_peer_ring", compression="sign"), accelerator="cpu", devices=4
        )
    with pytest.warns(UserWarning, match=match):
        SimulatedDecentralizedStrategy(workers=4, topology="one_peer_ring", compression="sign", consensus_step=0.5)
    with pytest.warns(UserWarning, match=r"compression=Quantize\(.*\) on Exponential"):
        SimulatedDecentralizedStrategy(workers=4, topology="exponential", compression="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SimulatedDecentralizedStrategy(workers=4, topology="ring", compression="sign")
        SimulatedDecentralizedStrategy(workers=4, topology="one_peer_ring")


NOISY_RUN = """
import os, sys, tempfile
if sys.argv[1] == "with":
    import lightning_decentral
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from tests.models import Regression, rank_data
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regression(lr=0.1), DataLoader(TensorDataset(*rank_data(0, 16)), batch_size=4))
trainer.save_checkpoint(os.path.join(tempfile.mkdtemp(), "stopped.ckpt"))  # as OnExceptionCheckpoint saves
"""


@pytest.mark.slow
def test_third_party_messages_that_say_nothing_are_dropped_where_they_arise() -> None:
    """Before: torch's `LeafSpec` FutureWarning (Lightning's own code, once per rank) and Lightning's "`weights_only`
    was not set" (once per rank at each save that does not say, four times on a SIGTERM stop of 4 ranks)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    printed = {
        how: subprocess.run(
            [sys.executable, "-c", NOISY_RUN, how], capture_output=True, text=True, env=env, cwd=root, timeout=240
        )
        for how in ("without", "with")
    }
    assert all(run.returncode == 0 for run in printed.values()), printed
    noise = ("isinstance(treespec, LeafSpec)", "`weights_only` was not set")
    assert all(text in printed["without"].stderr for text in noise)  # what Lightning alone prints
    assert not any(text in printed["with"].stderr + printed["with"].stdout for text in noise)
