"""The package's layers (docs/architecture.md): imports point down only, and the update rules
and everything beneath them import nothing from Lightning."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_decentral"

# top to bottom; a module may import only modules listed after it (or in the same row)
LAYERS = [
    ["cli"],
    ["plot"],
    ["callbacks"],
    ["simulation", "trainer", "fabric"],
    ["common"],
    ["driver"],
    ["rules", "outer"],
    ["overlap"],
    ["schedule", "options", "agreement"],
    ["replicas", "checkpoint", "measures", "data"],
    ["files"],
    ["gossip", "mixing"],
    ["membership"],
    ["algorithms"],
    ["topology"],
    ["failures", "rendezvous"],
]
WITHOUT_LIGHTNING = ["failures", "rendezvous", "data", "measures", "driver", "options", "agreement", "rules", "outer", "overlap", "schedule", "replicas", "gossip", "mixing", "membership", "algorithms", "topology"]


def _layer_of(module: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if module in row)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "lightning_decentral":  # `from lightning_decentral import checkpoint`
                names.update(f"lightning_decentral.{alias.name}" for alias in node.names)
    return names


def _modules() -> dict[str, list[Path]]:
    """Top-level module (or subpackage) name -> its source files."""
    found: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] != "__init__":
            found.setdefault(parts[0], []).append(path)
    return found


def test_every_module_has_a_layer() -> None:
    assert set(_modules()) == {m for row in LAYERS for m in row}


def test_imports_point_down() -> None:
    for module, paths in _modules().items():
        for path in paths:
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "lightning_decentral" or len(parts) == 1:
                    continue
                target = parts[1]
                if target != module:
                    assert _layer_of(target) > _layer_of(module) or target in LAYERS[_layer_of(module)], (
                        f"{path.name} imports {name}: a lower layer may not import a higher one"
                    )


EXECUTORS = {"trainer", "fabric", "simulation"}


def test_the_executors_are_siblings() -> None:
    """The Trainer's, Fabric's and the simulation's packages import nothing from each other: what two of them share
    lives below them (`common`, the driver)."""
    for executor in EXECUTORS:
        for path in _modules()[executor]:
            imported = {name.split(".")[1] for name in _imports(path) if name.startswith("lightning_decentral.")}
            assert not imported & (EXECUTORS - {executor}), f"{path.relative_to(PACKAGE)} imports {sorted(imported & EXECUTORS)}"


def test_update_rules_and_below_import_nothing_from_lightning() -> None:
    for module in WITHOUT_LIGHTNING:
        for path in _modules()[module]:
            lightning = {name for name in _imports(path) if name.split(".")[0] in ("lightning", "pytorch_lightning")}
            assert not lightning, f"{path.name} imports {sorted(lightning)}"


def test_every_executor_satisfies_the_monitoring_protocol() -> None:
    """The callbacks and the command line read executors through `Monitored` only (they import none of them)."""
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy, fabric
    from lightning_decentral.measures import Monitored

    trainer = Trainer(strategy=DecentralizedStrategy(), accelerator="cpu", devices=2, logger=False)
    simulated = Trainer(strategy=SimulatedDecentralizedStrategy(workers=3), accelerator="cpu", devices=1, logger=False)
    fabric_run = Fabric(strategy=fabric.DecentralizedStrategy(), accelerator="cpu", devices=2)
    for strategy in (trainer.strategy, simulated.strategy, fabric_run.strategy):
        assert isinstance(strategy, Monitored), type(strategy).__name__
    assert (trainer.strategy.num_workers, simulated.strategy.num_workers, fabric_run.strategy.num_workers) == (2, 3, 2)
    assert not isinstance(DDPStrategy(parallel_devices=[torch.device("cpu")]), Monitored)  # a device: root_device answers
    assert not hasattr(DecentralizedStrategy(), "topology")  # not bound before a Trainer gives it a world
    for module in [*PACKAGE.joinpath("callbacks").glob("*.py"), PACKAGE / "cli.py"]:
        imported = {name.split(".")[1] for name in _imports(module) if name.startswith("lightning_decentral.")}
        assert not imported & {"trainer", "simulation", "fabric"}, module.name
