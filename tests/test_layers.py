"""The package's layers (docs/architecture.md): imports point down only, and the update rules
and everything beneath them import nothing from Lightning (nor Lightning's private names from `_compat.lightning`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_decentral"

# top to bottom; a module may import only modules listed after it (or in the same row). An entry is a module or
# subpackage of the package, or a module of a subpackage whose modules sit in different layers (`_compat.lightning`).
LAYERS = [
    ["cli"],
    ["plot"],
    ["callbacks"],
    ["simulation", "trainer", "fabric"],
    ["common"],
    ["driver", "sharding"],
    ["rules", "outer"],
    ["overlap"],
    ["schedule", "options", "agreement"],
    ["replicas", "checkpoint", "measures", "data"],
    ["files"],
    ["gossip", "mixing"],
    ["membership"],
    ["compression"],
    ["algorithms"],
    ["topology"],
    ["failures", "rendezvous", "timeouts"],
    ["_compat", "_compat.lightning"],  # the private names of torch, and of Lightning: every layer may use them
]
WITHOUT_LIGHTNING = [
    "_compat",
    "failures",
    "rendezvous",
    "timeouts",
    "data",
    "measures",
    "driver",
    "sharding",
    "options",
    "agreement",
    "rules",
    "outer",
    "overlap",
    "schedule",
    "replicas",
    "gossip",
    "mixing",
    "membership",
    "compression",
    "algorithms",
    "topology",
]


def _layer_of(module: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if module in row)


def _entry(name: str) -> str:
    """The entry of `LAYERS` that `name` (`topology.base`, `_compat.lightning`, without the package's) belongs to."""
    entries = [m for row in LAYERS for m in row if name == m or name.startswith(m + ".")]
    return max(entries, key=len) if entries else name.split(".")[0]


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
    """Entry of `LAYERS` (a top-level module or subpackage, or a module of one) -> its source files."""
    found: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            found.setdefault(_entry(".".join(parts)), []).append(path)
    return found


def _module_name(path: Path) -> str:
    """`lightning_decentral/gossip/engine.py` -> `lightning_decentral.gossip.engine` (a package: its `__init__`)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports anywhere: at the top, inside a function,
    under `TYPE_CHECKING` (`from package import name` is the package, unless `name` is a module of it)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    above = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(above + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (`[a, b, ..., a]`), or `[]`."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for target in sorted(graph[module]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module)
        if found:
            return found
    return []


def test_no_import_circles() -> None:
    """No module imports, however indirectly, one that imports it: at the top, in a function or for types only."""
    graph = _import_graph()
    assert "lightning_decentral.topology.base" in graph and "lightning_decentral.gossip" in graph
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    circle = _circle(graph)
    assert not circle, "an import circle: " + " -> ".join(circle)


def test_every_module_has_a_layer() -> None:
    assert set(_modules()) == {m for row in LAYERS for m in row}


def test_imports_point_down() -> None:
    for module, paths in _modules().items():
        for path in paths:
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "lightning_decentral" or len(parts) == 1:
                    continue
                target = _entry(".".join(parts[1:]))
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
            assert not imported & (EXECUTORS - {executor}), (
                f"{path.relative_to(PACKAGE)} imports {sorted(imported & EXECUTORS)}"
            )


def test_update_rules_and_below_import_nothing_from_lightning() -> None:
    for module in WITHOUT_LIGHTNING:
        for path in _modules()[module]:
            lightning = {
                name
                for name in _imports(path)
                if name.split(".")[0] in ("lightning", "pytorch_lightning")
                or name == "lightning_decentral._compat.lightning"
            }
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
    assert not isinstance(
        DDPStrategy(parallel_devices=[torch.device("cpu")]), Monitored
    )  # a device: root_device answers
    assert not hasattr(DecentralizedStrategy(), "topology")  # not bound before a Trainer gives it a world
    for module in [*PACKAGE.joinpath("callbacks").glob("*.py"), PACKAGE / "cli.py"]:
        imported = {name.split(".")[1] for name in _imports(module) if name.startswith("lightning_decentral.")}
        assert not imported & {"trainer", "simulation", "fabric"}, module.name
