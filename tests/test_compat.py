"""Every private name of torch, Lightning and torchmetrics the package uses is declared in `lightning_decentral._compat`
(torch's) or `lightning_decentral._compat.lightning` (Lightning's and torchmetrics'), still exists in the installed
versions, and is reached nowhere else (a subclass's inherited members excepted, declared in `INHERITED_NAMES`)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import lightning_decentral
from lightning_decentral import _compat
from lightning_decentral._compat import lightning as lightning_compat

PACKAGE = Path(lightning_decentral.__file__).parent
COMPAT = {PACKAGE / "_compat" / "__init__.py": _compat, PACKAGE / "_compat" / "lightning.py": lightning_compat}
FOREIGN = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")
ROWS = [*_compat.PRIVATE_NAMES, *lightning_compat.PRIVATE_NAMES, *lightning_compat.INHERITED_NAMES]
INHERITED = {name for _, name, _ in lightning_compat.INHERITED_NAMES}


def _private(name: str) -> bool:
    """`_name` (a dunder is not private)."""
    return name.isidentifier() and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(owner: str) -> Any:
    """The module or class at the dotted path `owner`."""
    parts = owner.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            found = getattr(found, part)
        return found
    raise ImportError(owner)


def _stored_on_self(cls: type) -> set[str]:
    """The attributes the methods of `cls` set on `self` (its source's `self.x = ...`, `self.x: T = ...`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a class without Python source
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


@cache
def _names_of(owner: Any) -> frozenset[str]:
    """Every name `owner` (a module, or a class with its bases) defines, the attributes its methods set included."""
    if not inspect.isclass(owner):
        return frozenset(dir(owner))
    return frozenset(n for cls in owner.__mro__ for n in [*vars(cls), *_stored_on_self(cls)])


def _foreign_privates(cls: type) -> set[str]:
    """The private names the torch, Lightning and torchmetrics classes among `cls`'s bases define."""
    return {
        n for base in cls.__mro__ if base.__module__.split(".")[0] in FOREIGN for n in _names_of(base) if _private(n)
    }


def _own_privates(cls: type) -> set[str]:
    """The private names the package's classes among `cls`'s bases (itself included) define."""
    return {
        n
        for base in cls.__mro__
        if base.__module__.startswith("lightning_decentral.")
        for n in _names_of(base)
        if _private(n)
    }


@pytest.mark.parametrize(("owner", "name", "why"), ROWS, ids=[f"{owner}.{name}" for owner, name, _ in ROWS])
def test_every_private_name_compat_declares_still_exists(owner: str, name: str, why: str) -> None:
    """A torch, Lightning or torchmetrics upgrade that renames or removes one of them fails here, by name."""
    assert _private(name) and why.strip(), "a row is (owner, private name, why no public API serves)"
    assert name in _names_of(_resolve(owner)), f"{owner} has no {name} any more: {why}. Find what replaces it."


def test_the_tables_declare_each_name_once() -> None:
    rows = [(owner, name) for owner, name, _ in ROWS]
    assert len(rows) == len(set(rows))


# -- who reaches private names ---------------------------------------------------------------------------------------


def _is_self(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: an object's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _attribute_named(node: ast.AST) -> str:
    """`"_name"` of `getattr(x, "_name")` (or `setattr`, `hasattr`, `delattr`); `""` for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
        name = node.args[1]
        if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and isinstance(name, ast.Constant):
            return name.value if isinstance(name.value, str) else ""
    return ""


def _private_references(tree: ast.Module) -> list[tuple[int, str, str, str, str | None, bool]]:
    """`(line, name, kind, text, class, on_itself)` for every private name `tree` reaches, of `kind` `"import"` (of a
    torch, Lightning or torchmetrics module), `"attribute"` (`x._name`, `getattr(x, "_name")`), `"def"` (a method of a
    class: it may override a base's) or `"string"` (a string that is a private name). `class` is the dotted name of the
    class it is written in (`None` outside one, `"<local>"` in one made by a function); `on_itself` whether it is
    reached on `self`, `cls` or `super()`."""
    found: list[tuple[int, str, str, str, str | None, bool]] = []

    def visit(node: ast.AST, where: str | None, in_function: bool) -> None:
        if isinstance(node, ast.ClassDef):
            where = "<local>" if in_function else node.name if where is None else f"{where}.{node.name}"
            in_function = False
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    found.append((item.lineno, item.name, "def", f"def {item.name}", where, True))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            for part in [*node.module.split("."), *(alias.name for alias in node.names)]:
                if _private(part):
                    found.append((node.lineno, part, "import", f"from {node.module} import {part}", where, False))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in FOREIGN:
                    found.extend(
                        (node.lineno, p, "import", f"import {alias.name}", where, False) for p in parts if _private(p)
                    )
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            text = f"{ast.unparse(node.value)}.{node.attr}"
            found.append((node.lineno, node.attr, "attribute", text, where, _is_self(node.value)))
        elif _private(_attribute_named(node)):
            assert isinstance(node, ast.Call)
            name, obj = _attribute_named(node), node.args[0]
            text = f"{ast.unparse(node.func)}({ast.unparse(obj)}, {name!r})"
            found.append((node.lineno, name, "attribute", text, where, _is_self(obj)))
            return  # the string is the attribute's name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
            found.append((node.lineno, node.value, "string", repr(node.value), where, False))
        for child in ast.iter_child_nodes(node):
            visit(child, where, in_function)

    visit(tree, None, False)
    return found


def _defined(tree: ast.Module) -> set[str]:
    """The private names `tree` defines: functions, classes, variables, arguments, attributes set on `self`/`cls`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _modules() -> dict[Path, ModuleType]:
    found = {}
    for info in pkgutil.walk_packages(lightning_decentral.__path__, "lightning_decentral."):
        module = importlib.import_module(info.name)
        if module.__file__.endswith(".py"):  # not the compiled kernel (compression/_kernels.c: no Python names)
            found[Path(module.__file__)] = module
    return found


def _class(module: ModuleType, dotted: str | None) -> type | None:
    """The class `dotted` (`Outer.Inner`) of `module`; `None` for one made inside a function."""
    if dotted is None or "<local>" in dotted:
        return None
    found: Any = module
    for part in dotted.split("."):
        found = getattr(found, part, None)
    return found if inspect.isclass(found) else None


@pytest.mark.slow
def test_no_module_reaches_a_private_name_of_torch_or_lightning_outside_compat() -> None:
    """Outside `_compat`, a private name is the package's own; or a member a class inherits from a torch, Lightning
    or torchmetrics base (one it overrides, or uses on itself), declared in `_compat.lightning.INHERITED_NAMES`."""
    modules = _modules()
    trees = {path: ast.parse(path.read_text()) for path in modules}
    own = set().union(*(_defined(tree) for path, tree in trees.items() if path not in COMPAT))
    declared = {name for _, name, _ in ROWS}
    classes = [
        c for m in modules.values() for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__
    ]
    inherited = set().union(*(_foreign_privates(c) for c in classes))  # by some class of the package
    problems = []
    for path, tree in trees.items():
        if path in COMPAT:
            continue
        for line, name, kind, text, where, on_itself in _private_references(tree):
            cls = _class(modules[path], where)
            if kind == "import":
                ok = False
            elif on_itself and cls is not None and name in _foreign_privates(cls):
                ok = name in INHERITED  # a base's member
            elif on_itself and cls is not None and name in _own_privates(cls):
                ok = True
            elif on_itself:  # a mixin's use of its host's member: the package's own, or a declared inherited one
                ok = name in INHERITED or (name in own and name not in inherited)
            else:  # another object's (or a string naming one): the package's own, never one _compat declares
                ok = name in own and name not in declared
            if not ok:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text}")
    assert not problems, (
        "private names of torch, Lightning or torchmetrics reached outside lightning_decentral._compat (add a function "
        "or name there, or a row of INHERITED_NAMES for a member a subclass inherits):\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("path", list(COMPAT), ids=lambda path: path.name)
def test_compat_declares_every_private_name_it_reaches(path: Path) -> None:
    """What `_compat`'s own code reaches is in its tables, so the existence test above covers it."""
    module = COMPAT[path]
    tree = ast.parse(path.read_text())
    declared = {name for _, name, _ in [*module.PRIVATE_NAMES, *getattr(module, "INHERITED_NAMES", [])]}
    reached = {name for _, name, kind, _, _, _ in _private_references(tree) if kind != "def"} - _defined(tree)
    assert reached and reached <= declared, sorted(reached - declared)
