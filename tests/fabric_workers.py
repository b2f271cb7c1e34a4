"""Functions the spawned workers of tests/test_fabric.py run: hand-written Fabric loops."""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral.fabric import (
    DataOrder,
    DecentralizedStrategy,
    consensus_metrics,
    effective_lr_metrics,
    under_prefix,
)
from tests.models import Regression, flat, init_seed, initial_net, loader, make_optimizer, make_scheduler
from tests.reference import Config


def fabric_for(world_size: int, strategy: Any, **kwargs: Any) -> Fabric:
    """A launched Fabric on this worker's process group (`launch()` only joins: the launcher env is set)."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, **kwargs)
    fabric.launch()
    return fabric


class _Loop:
    """The usual Fabric loop over a config of tests/reference.py: accumulation, clipping, a scheduler."""

    def __init__(self, fabric: Fabric, config: Config, model: nn.Module, rank: int) -> None:
        optimizer = make_optimizer(model.parameters(), **config.optimizer)
        self.scheduler = make_scheduler(optimizer, config.scheduler)
        self.model, self.optimizer = fabric.setup(model, optimizer)
        data = loader(rank, config.samples, config.batch_size, config.dtype)
        self.batches = list(fabric.setup_dataloaders(data, use_distributed_sampler=False))
        self.fabric, self.config = fabric, config

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y) / self.config.accumulate

    def step(self, k: int, before_step: Any = None) -> None:
        config, fabric = self.config, self.fabric
        micro = self.batches[k * config.accumulate : (k + 1) * config.accumulate]
        for a, batch in enumerate(micro):
            with fabric.no_backward_sync(self.model, enabled=a < config.accumulate - 1):
                fabric.backward(self.loss(batch))
        if config.clip is not None:
            fabric.clip_gradients(self.model, self.optimizer, max_norm=config.clip)
        if before_step is not None:
            before_step(micro)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()


def fit_config(rank: int, world_size: int, config: Config) -> torch.Tensor:
    """Train ``config`` in a Fabric loop on this rank's data; this rank's parameters, then its buffers."""
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy, precision="64-true" if config.dtype == torch.float64 else "32-true")
    model = initial_net(init_seed(rank), config.batch_norm).to(config.dtype)
    loop = _Loop(fabric, config, model, rank)
    for k in range(config.steps):
        if config.steps_per_epoch:
            strategy.set_epoch(k // config.steps_per_epoch)  # the loop's epoch, for a gossip_steps schedule by epoch
        loop.step(k)
    assert strategy.step == config.steps
    fabric.strategy.teardown()
    buffers = [b.reshape(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat([flat(model), *buffers])


def schedule_by_epoch_without_set_epoch(rank: int, world_size: int) -> str:
    """The error of a training forward under a gossip_steps schedule by epoch when the loop never called set_epoch."""
    fabric = fabric_for(world_size, DecentralizedStrategy(gossip_steps={"epoch": {0: 2, 1: 1}}))
    net = initial_net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        model(torch.zeros(1, 5))
    except RuntimeError as error:
        return str(error)
    finally:
        fabric.strategy.teardown()
    return ""


def fit_configs(rank: int, world_size: int, configs: list[Config]) -> dict[str, torch.Tensor]:
    return {c.name: fit_config(rank, world_size, c) for c in configs}


def _run(
    rank: int,
    world_size: int,
    config: Config,
    steps: range,
    strategy: DecentralizedStrategy | None = None,
    path: str | None = None,
    load: str | None = None,
    model: nn.Module | None = None,
) -> nn.Module:
    """Steps ``steps`` of ``config``, after loading ``load``; saves to ``path`` at the end."""
    strategy = strategy or DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy)
    model = model if model is not None else initial_net(init_seed(rank) + 7, config.batch_norm)
    loop = _Loop(fabric, config, model, rank)
    if load is not None:
        fabric.load(load, {"model": loop.model, "optimizer": loop.optimizer})
        assert strategy.step == steps.start, (strategy.step, steps.start)
    for k in steps:
        loop.step(k)
    if path is not None:
        fabric.save(path, {"model": loop.model, "optimizer": loop.optimizer, "note": "fabric"})
    fabric.strategy.teardown()
    return model


def resume(rank: int, world_size: int, config: Config, root: str) -> dict[str, Any]:
    """``2K`` steps straight, against ``K`` steps, save, load into new objects, ``K`` more; x̄ in between."""
    k = config.steps // 2
    full = flat(_run(rank, world_size, config, range(config.steps)))
    half = _run(rank, world_size, config, range(k), path=f"{root}/half.ckpt")
    resumed = flat(_run(rank, world_size, config, range(k, config.steps), load=f"{root}/half.ckpt"))
    return {"full": full, "half": flat(half), "resumed": resumed}


def _shuffled_epochs(world_size: int, epochs: range, load: str | None, save: str | None, order: bool) -> torch.Tensor:
    """Epochs ``epochs`` of a loop over a shuffled loader (Fabric's distributed sampler), after loading ``load``, then
    saving to ``save``; the data order in the state when ``order``. This rank's replica."""
    fabric = fabric_for(world_size, DecentralizedStrategy())
    torch.manual_seed(3)
    data = TensorDataset(torch.randn(64, 5), torch.randn(64, 3))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    net = initial_net(init_seed(fabric.global_rank))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if order:
        state["data"] = DataOrder(loader)
    if load is not None:
        fabric.load(load, state)
        assert not order or state["data"].epoch == epochs.start, state["data"].epoch
    for _ in epochs:
        for x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    if save is not None:
        fabric.save(save, state)
    fabric.strategy.teardown()
    return flat(model)


def resume_shuffled(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    """4 epochs straight, against 2 + save + load into new objects + 2: with the data order in the state, and
    without."""
    out = {"full": _shuffled_epochs(world_size, range(4), None, None, order=False)}
    for order in (True, False):
        path = f"{root}/order-{order}.ckpt"
        _shuffled_epochs(world_size, range(2), None, path, order)
        out[f"order={order}"] = _shuffled_epochs(world_size, range(2, 4), path, None, order)
    return out


def resume_from_average(rank: int, world_size: int, config: Config, checkpoint: str) -> dict[str, Any]:
    """Load a checkpoint saved by 4 ranks on ``world_size`` ranks: every replica starts from x̄, one warning."""
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy)
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(checkpoint, {"model": loop.model, "optimizer": loop.optimizer})
    out = {
        "start": flat(loop.model),
        "step": strategy.step,
        "warnings": [str(w.message) for w in caught if "Resuming" in str(w.message)],
    }
    fabric.strategy.teardown()
    return out


def from_trainer(rank: int, world_size: int, checkpoint: str, inner: bool = False) -> dict[str, Any]:
    """Load a Trainer's checkpoint (its model and this rank's shard) into a Fabric loop's module: the LightningModule
    itself, or (``inner``) the ``nn.Sequential`` it held as ``self.net``, first as is (nothing matches), then
    ``under_prefix(net, "net.")``."""
    strategy = DecentralizedStrategy()
    fabric = fabric_for(world_size, strategy)
    model = initial_net(init_seed(rank) + 3) if inner else Regression(seed=init_seed(rank) + 3)
    model, _optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    out: dict[str, Any] = {}
    if inner:
        before = flat(model)
        try:
            fabric.load(checkpoint, {"state_dict": model}, strict=False)
            out["as_is"] = "no error"
        except KeyError as error:
            out["as_is"] = str(error)
        out["untouched"] = torch.equal(flat(model), before) and strategy.step == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remainder = fabric.load(
            checkpoint, {"state_dict": under_prefix(model, "net.") if inner else model}, strict=False
        )
    out.update(
        replica=flat(model),
        step=strategy.step,
        global_step=remainder.get("global_step"),
        warnings=[str(w.message) for w in caught if "Resuming" in str(w.message) or "left" in str(w.message)],
    )
    fabric.strategy.teardown()
    return out


def evaluate_and_monitor(rank: int, world_size: int, config: Config) -> dict[str, Any]:
    """Train; measure the monitors at the last step; evaluate on x̄ (and on the replica, eval_on="local")."""
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    strategy.measure_residuals()
    fabric = fabric_for(world_size, strategy)
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    out: dict[str, Any] = {}

    def measure(micro: list) -> None:
        out["before_step"] = flat(loop.model)
        out["grads"] = torch.cat([p.grad.reshape(-1) for p in loop.model.parameters()])
        out["batch"] = micro
        out["lr"] = effective_lr_metrics(strategy, config.optimizer["lr"], loop.loss, micro)
        out["after_measure"] = flat(loop.model)

    for k in range(config.steps):
        loop.step(k, before_step=measure if k == config.steps - 1 else None)
    out["consensus"] = consensus_metrics(strategy)
    out["replica"] = flat(loop.model)
    with strategy.averaged_model():
        out["averaged"] = flat(loop.model)
        out["averaged_input"] = loop.batches[0][0]
        out["averaged_output"] = loop.model(out["averaged_input"]).detach()
    out["after_average"] = flat(loop.model)
    fabric.strategy.teardown()
    return out


def bad_setups(rank: int, world_size: int) -> dict[str, str]:
    """The errors of two optimizers, a second model and a DDP-wrapped module."""
    errors = {}
    for name in ("two_optimizers", "ddp_wrapped", "second_model"):
        fabric = fabric_for(world_size, DecentralizedStrategy())
        net = initial_net(0)
        try:
            if name == "two_optimizers":
                fabric.setup(
                    net, torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[2].parameters(), lr=0.1)
                )
            elif name == "ddp_wrapped":
                fabric.setup(nn.parallel.DistributedDataParallel(net), torch.optim.SGD(net.parameters(), lr=0.1))
            else:
                fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
                fabric.setup(initial_net(1))
            errors[name] = "no error"
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def distributed_sampler(rank: int, world_size: int) -> list[int]:
    """The sample indices this rank's loader yields through `setup_dataloaders`' distributed sampler."""
    fabric = fabric_for(world_size, DecentralizedStrategy())
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16)), batch_size=2))
    return [int(i) for (batch,) in data for i in batch]


def killed_peer(rank: int, world_size: int, stamp: str, timeout: float) -> dict[str, Any]:
    """Rank 1 kills itself when step 2 starts; the others must end with an error within ``timeout``."""
    config = Config("killed", optimizer={"lr": 0.05, "momentum": 0.9})
    fabric = fabric_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=timeout)))
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    try:
        for k in range(config.steps):
            if rank == 1 and k == 2:
                Path(stamp).write_text(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            loop.step(k)
        failure = "no error"
    except RuntimeError as exc:
        failure = str(exc)
    return {"failure": failure, "stopped_at": time.monotonic()}


def example_gpt(rank: int, world_size: int, argv: list[str]) -> dict[str, float]:
    """examples/fabric_gpt.py as `python examples/fabric_gpt.py ARGV` runs on each worker."""
    from examples import fabric_gpt

    return fabric_gpt.main(fabric_gpt.parse(argv))


def docs_loop(rank: int, world_size: int, code: str, root: str) -> list[str]:
    """The loop of docs/fabric.md, run as `python train.py` runs it in `root`; what it printed."""
    import contextlib
    import io

    os.chdir(root)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "train.py", "exec"), {"__name__": "__main__"})
    return printed.getvalue().splitlines()


def dropout_net(seed: int) -> nn.Module:
    """The MLP of tests/models.py with dropout after its hidden layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3))


def monitor_with_dropout(rank: int, world_size: int, config: Config) -> dict[str, Any]:
    """Train a model with dropout; at the last step record this rank's replica, gradients, micro-batches and
    the random states its training forwards started from, then measure `effective_lr_metrics`."""
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy)
    torch.manual_seed(50 + rank)  # every rank draws other dropout masks
    loop = _Loop(fabric, config, dropout_net(init_seed(rank)), rank)
    out: dict[str, Any] = {}

    def measure(micro: list) -> None:
        out["before_step"] = flat(loop.model)
        out["grads"] = torch.cat([p.grad.reshape(-1) for p in loop.model.parameters()])
        out["batches"] = micro
        out["states"] = [state["cpu"].clone() for state in strategy.forward_random_states]
        try:
            effective_lr_metrics(strategy, config.optimizer["lr"], loop.loss, micro[:-1])
            out["too_few"] = "no error"
        except ValueError as exc:
            out["too_few"] = str(exc)
        rng = torch.get_rng_state()
        out["lr"] = effective_lr_metrics(strategy, config.optimizer["lr"], loop.loss, micro)
        out["rng_restored"] = torch.equal(torch.get_rng_state(), rng)
        out["after_measure"] = flat(loop.model)

    for k in range(config.steps):
        loop.step(k, before_step=measure if k == config.steps - 1 else None)
    fabric.strategy.teardown()
    return out


def _momentum(optimizer: torch.optim.Optimizer, params: Any) -> torch.Tensor:
    return torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in params])


def train_and_save_for_trainer(rank: int, world_size: int, config: Config, path: str) -> dict[str, Any]:
    """``config.steps`` Fabric steps, then `fabric.save`; this rank's replica and momentum as saved."""
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy)
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    for k in range(config.steps):
        loop.step(k)
    fabric.save(path, {"model": loop.model, "optimizer": loop.optimizer, "note": "fabric"})
    out = {"replica": flat(loop.model), "momentum": _momentum(loop.optimizer, loop.model.parameters())}
    fabric.strategy.teardown()
    return out


class _AtTrainStart(Callback):
    """Records, when training starts (after the checkpoint is restored), the step and the optimizer state."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.global_step = trainer.global_step
        self.momentum = _momentum(trainer.optimizers[0], pl_module.parameters())


def trainer_resumes_from_fabric(rank: int, world_size: int, config: Config, path: str, extra: int) -> dict[str, Any]:
    """`trainer.fit(ckpt_path=path)` (a converted Fabric checkpoint) on a module holding the same net as `self.net`."""
    from lightning_decentral import DecentralizedStrategy as TrainerStrategy
    from tests.models import Regression
    from tests.workers import trainer_for

    model = Regression(seed=init_seed(rank) + 11, **config.optimizer)
    at_start = _AtTrainStart()
    trainer = trainer_for(
        world_size, TrainerStrategy(**config.strategy_kwargs()), max_steps=config.steps + extra, callbacks=[at_start]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader(rank, config.samples, config.batch_size), ckpt_path=path)
    return {
        "start": model.train_start_params,
        "start_step": at_start.global_step,
        "momentum": at_start.momentum,
        "end_step": trainer.global_step,
        "warnings": [str(w.message) for w in caught if "Resuming" in str(w.message)],
    }


def fit_mixed_precision(rank: int, world_size: int, momentum: str) -> dict[str, Any]:
    """A few steps of the usual loop under ``precision="bf16-mixed"``: this rank's replica and step count."""
    config = Config(
        "bf16", momentum=momentum, optimizer={"lr": 0.05, "momentum": 0.9}, gossip_every=2
    )  # 2 ranks: W = 11ᵀ/2
    strategy = DecentralizedStrategy(**config.strategy_kwargs())
    fabric = fabric_for(world_size, strategy, precision="bf16-mixed")
    model = initial_net(init_seed(rank))
    loop = _Loop(fabric, config, model, rank)
    for k in range(config.steps):
        loop.step(k)
    fabric.strategy.teardown()
    return {"replica": flat(model), "step": strategy.step, "dtype": str(next(model.parameters()).dtype)}


def disagreeing_setup(rank: int, world_size: int) -> str:
    """Rank 1 builds another `combine` than rank 0: the error `fabric.setup` raises on this rank."""
    fabric = fabric_for(world_size, DecentralizedStrategy(combine="atc" if rank == 1 else "awc"))
    net = initial_net(init_seed(rank))
    try:
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    except ValueError as exc:
        return str(exc)
    return "no error"


def nan_on_one_rank(rank: int, world_size: int) -> str:
    """Rank 1's loss turns NaN at step 2 (AWC): the error on this rank."""
    config = Config("nan", optimizer={"lr": 0.05})
    fabric = fabric_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=30)))
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    original = loop.loss
    loop.loss = lambda batch: original(batch) * (float("nan") if rank == 1 and fabric.strategy.step == 2 else 1.0)
    try:
        for k in range(config.steps):
            loop.step(k)
    except (FloatingPointError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_under(rank: int, world_size: int, config: Config, checkpoint: str, **strategy_kwargs: Any) -> dict[str, Any]:
    """``fabric.load`` of ``checkpoint`` by a strategy of ``config`` with ``strategy_kwargs`` changed: the warnings it
    gave, or the error it raised."""
    strategy = DecentralizedStrategy(**{**config.strategy_kwargs(), **strategy_kwargs})
    fabric = fabric_for(world_size, strategy)
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fabric.load(checkpoint, {"model": loop.model, "optimizer": loop.optimizer})
        except RuntimeError as exc:
            error = str(exc)
    fabric.strategy.teardown()
    return {"warnings": [str(w.message) for w in caught if "Resuming" in str(w.message)], "error": error}


def save_between_forward_and_backward(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """`fabric.save`, `averaged_model()` and `fabric.load` between a training forward and its `fabric.backward`:
    the error each raises; then the step goes on, and a save after `optimizer.step()` works."""
    config = Config("mid-step", optimizer={"lr": 0.05, "momentum": 0.9})
    strategy = DecentralizedStrategy()
    fabric = fabric_for(world_size, strategy)
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    state = {"model": loop.model, "optimizer": loop.optimizer}
    fabric.save(f"{root}/before.ckpt", state)
    loss = loop.loss(loop.batches[0])
    out: dict[str, Any] = {}
    for name, action in (
        ("save", lambda: fabric.save(f"{root}/mid.ckpt", state)),
        ("averaged_model", lambda: strategy.averaged_model().__enter__()),
        ("load", lambda: fabric.load(f"{root}/before.ckpt", state)),
    ):
        try:
            action()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
    fabric.backward(loss)
    loop.optimizer.step()
    fabric.save(f"{root}/after.ckpt", state)
    out["step"] = strategy.step
    fabric.strategy.teardown()
    return out


def load_on_rank_zero_only(rank: int, world_size: int, root: str, pg_timeout: float) -> dict[str, Any]:
    """Rank 0 was launched with the flag that makes it resume (`fabric.load`), rank 1 without: rank 1 trains."""
    config = Config("skip-load", optimizer={"lr": 0.05, "momentum": 0.9})
    fabric = fabric_for(world_size, DecentralizedStrategy(timeout=timedelta(seconds=pg_timeout)))
    loop = _Loop(fabric, config, initial_net(init_seed(rank)), rank)
    state = {"model": loop.model, "optimizer": loop.optimizer}
    fabric.save(f"{root}/first.ckpt", state)
    start = time.monotonic()
    try:
        if rank == 0:
            fabric.load(f"{root}/first.ckpt", state)
        for k in range(3):
            loop.step(k)
        error = "no error"
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}
