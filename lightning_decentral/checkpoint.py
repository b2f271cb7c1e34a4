"""Per-rank checkpoint shards: every replica, its optimizer state, the strategy's state and random state.

A decentralized run is `n` models. The checkpoint file Lightning writes on rank 0 keeps the average `x̄` (a plain
LightningModule loads it); next to it, every rank writes its own shard, so that `trainer.fit(ckpt_path=...)`
continues every replica exactly:

```text
epoch=1-step=40.ckpt                                            rank 0: x̄, loops, callbacks, {save_id, world_size}
epoch=1-step=40.ckpt.shards/rank-00002-of-00004.<save_id>.pt    rank 2's shard, written by rank 2
```

Each rank writes and removes only its own shard, so nothing is gathered onto one rank and no filesystem needs to be
shared between nodes. Every file is written under a temporary name and renamed into place (atomic on a local or POSIX
filesystem); the strategy writes the checkpoint file only once every rank has reported its shard in place, so an
existing checkpoint file implies complete shards. The random `save_id` in the shard names is recorded in the
checkpoint file too: shards of another save (an overwritten `last.ckpt`, a crash between the shards and the file, a
foreign run) are never taken for this one's. A second save of the same step from the same replicas (`last.ckpt`
after the step's checkpoint) takes the first one's id and links its shards instead of writing them again. Shards hold
tensors and primitives only and are read with `torch.load(weights_only=True)`.

Besides the entries every shard has (the replica, the optimizer and precision state, the step, the rule it ran), a
shard holds what the parts of a run with state registered
([`StateRegistry`][lightning_decentral.checkpoint.StateRegistry], the driver's `state`): the rule's (`"rule_state"`:
an outer step's anchor and outer optimizer), compressed gossip's (`"gossip"`: CHOCO's public copies), the workers'
random state (`"rng"`: [`rng_state`][lightning_decentral.checkpoint.rng_state], what dropout and a shuffling sampler
draw from). The shard files, the rejoin handover and the simulation's shards are all made by
[`make_shard`][lightning_decentral.checkpoint.make_shard] from it, and restored by
[`StateRegistry.load`][lightning_decentral.checkpoint.StateRegistry.load]. A shard records
its layout under `"format"` ([`SHARD_FORMAT`][lightning_decentral.checkpoint.SHARD_FORMAT]; a shard without one is
format 1, written before the registry, with the same entries).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import random
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from torch import Tensor

from lightning_decentral.failures import PeerFailure
from lightning_decentral.files import (
    StrPath,
    adopt,
    atomic_link,
    atomic_write,
    disown,
    owned,
    removable_temporary,
    temporary_name,
)

META_KEY = "decentralized_shards"  # in the checkpoint file: {"save_id", "world_size"}
SHARD_FORMAT = 2
"""The layout of the shards this version writes, recorded in each under `"format"`. 1 (no `"format"` key): before
the state registry, with the same entries under the same keys; 2: the registered parts under their keys. A shard of a
later format is not read (every rank resumes from `x̄`, and the warning names the format)."""
CORE_KEYS = (
    "save_id",
    "rank",
    "world_size",
    "format",
    "state_dict",
    "strategy",
    "optimizer_states",
    "precision",
)
"""The entries of every shard: no registered part may take their keys."""


@dataclasses.dataclass(frozen=True)
class StatePart:
    """One registered piece of per-rank state
    ([`StateRegistry.register`][lightning_decentral.checkpoint.StateRegistry.register])."""

    key: str
    save: Callable[[int], Any]
    load: Callable[[list[Any]], None]
    full_only: bool


class StateRegistry:
    """The per-rank state a run keeps besides its replica and its optimizer, in one place: each part
    with state registers `(key, save, load)` once, and every shard, every rejoin handover and every simulated worker's
    shard holds `save(worker)` under `key` ([`make_shard`][lightning_decentral.checkpoint.make_shard]); a resume or a
    rank that rejoins calls `load` with every worker's value (`None` where a shard holds none). A new piece of state is
    one registration (its executors need no change).

    A process is worker 0; the simulation's workers are `0..n-1` in one registry.

    Examples:
        >>> registry = StateRegistry()
        >>> counts = [3, 5]
        >>> registry.register("count", save=lambda worker: {"n": counts[worker]}, load=print)
        >>> registry.save(worker=1)
        {'count': {'n': 5}}
        >>> registry.load([{"count": {"n": 4}}, {}])
        [{'n': 4}, None]
    """

    def __init__(self) -> None:
        self._parts: dict[str, StatePart] = {}

    def register(
        self, key: str, save: Callable[[int], Any], load: Callable[[list[Any]], None], full_only: bool = False
    ) -> None:
        """Keep `save(worker)` under `key` in every shard (a part that returns `None`, `{}` or `[]` has nothing to keep
        and leaves no entry) and restore it with `load(states)`, every worker's in order. `full_only`: only in a save
        with the optimizer state, and restored only from one (a weights-only checkpoint leaves the part out)."""
        if key in CORE_KEYS or key in self._parts:
            raise ValueError(f"The shard entry {key!r} is taken: register each piece of state under a key of its own.")
        self._parts[key] = StatePart(key, save, load, full_only)

    @property
    def keys(self) -> list[str]:
        """The registered keys, in the order they were registered (and are restored)."""
        return list(self._parts)

    def save(self, worker: int = 0, full: bool = True) -> dict[str, Any]:
        """Worker `worker`'s entries (`full=False`: a weights-only save): live, not copied."""
        saved = {}
        for part in self._parts.values():
            if full or not part.full_only:
                state = part.save(worker)
                if not _empty(state):
                    saved[part.key] = state
        return saved

    def load(self, shards: list[dict[str, Any]], full: bool = True) -> None:
        """Restore every part from `shards`, one per worker, in order of registration (`full=False`: a load without
        the optimizer state restores no `full_only` part)."""
        for part in self._parts.values():
            if full or not part.full_only:
                part.load([shard.get(part.key) for shard in shards])


def _empty(state: Any) -> bool:
    return state is None or (isinstance(state, (dict, list)) and not state)


class RankGroup(Protocol):
    """The collectives the shard protocol needs ([`Ranks`][lightning_decentral.agreement.Ranks])."""

    rank: int
    world_size: int

    def gather(self, values: list[int], what: str = ...) -> Any: ...

    def on_every_rank(self, action: Callable[[], Any], what: str, during: str = ...) -> None: ...


class ShardProblem(enum.IntEnum):
    """Why a rank cannot resume exactly from its shard (`NONE`: it can); an `IntEnum`, so that every rank's problem
    travels in one all-gather of integers ([`load_own_shard`][lightning_decentral.checkpoint.load_own_shard])."""

    NONE = 0
    NOT_SHARDED = 1
    OTHER_WORLD_SIZE = 2
    MISSING = 3
    OTHER_SAVE = 4
    UNREADABLE = 5
    NEWER_FORMAT = 6

    def describe(self, saved: int | None = None, now: int | None = None) -> str:
        """The problem in words (`saved`, `now`: the world sizes, for `OTHER_WORLD_SIZE`).

        Examples:
            >>> ShardProblem.OTHER_WORLD_SIZE.describe(saved=4, now=2)
            'it was saved by 4 ranks and this run has 2'
            >>> ShardProblem.MISSING.describe()
            'the shard is missing'
        """
        return {
            ShardProblem.NONE: "",
            ShardProblem.NOT_SHARDED: "the checkpoint records no shards (it was not saved by DecentralizedStrategy)",
            ShardProblem.OTHER_WORLD_SIZE: f"it was saved by {saved} ranks and this run has {now}",
            ShardProblem.MISSING: "the shard is missing",
            ShardProblem.OTHER_SAVE: "the shard belongs to another save (overwritten, or written by another run)",
            ShardProblem.UNREADABLE: "the shard cannot be read",
            ShardProblem.NEWER_FORMAT: f"the shard is of a later format than {SHARD_FORMAT}, the newest this version "
            "of lightning-decentral reads (it was written by a newer version: resume with that one)",
        }[self]


class EarlierShards(Protocol):
    """This rank's shard of an earlier save of the step ([`StepShards`][lightning_decentral.trainer.reuse.StepShards]):
    `same_as(shard)` is its `(save_id, path)` if it holds what `shard` holds but the id, else `None`."""

    def same_as(self, shard: dict[str, Any]) -> tuple[int, str] | None: ...

    def remember(self, shard: dict[str, Any], save_id: int, path: str) -> None: ...


def save_with_shards(
    ranks: RankGroup,
    checkpoint: dict[str, Any],
    filepath: StrPath,
    make_shard: Callable[[int], dict[str, Any]],
    write_file: Callable[[], None],
    earlier: EarlierShards | None = None,
    agreed: Callable[[bool], None] = lambda linked: None,
) -> None:
    """Every rank writes its shard, then `write_file` writes the checkpoint file (on rank 0).

    In order (each "agree" is one all-gather):

    1. build this rank's shard `make_shard(save_id)` (the id set once agreed); agree on a random save id (rank 0's
       draw, recorded in `checkpoint`), that every replica and optimizer state is finite, so `x̄` too (else every rank
       raises `FloatingPointError` naming the ranks and the step, before anything is written or removed), and whether
       every rank's shard holds what its shard of the `earlier` save does (then this save takes that save's id);
       `agreed(linked)` runs, told whether it does (the same on every rank: it may run collectives);
    2. each rank writes its shard under a temporary name and renames it, or, taking an earlier save's id, links it to
       its earlier shard (or writes it where it cannot: [`atomic_link`][lightning_decentral.files.atomic_link]); agree
       that every shard is in place (if a rank could not put its own, every rank deletes its shard of this save and
       raises);
    3. `write_file` runs; agree that it succeeded;
    4. each rank deletes its other shards of this path (earlier saves, saves whose file was never written).

    From step 2's agreement on, no rank deletes its shard of this save, whatever fails (a rank dying while rank 0
    writes the file): the path then holds the previous file with its shards, or this one with all of its own, and
    the next save to the path removes the shards no file names. A rank whose agreement itself fails (a peer died
    during it) keeps its shard too: another rank may have completed it.
    """
    content = make_shard(0)
    step = content["strategy"]["step"]
    same = None if earlier is None else earlier.same_as(content)
    finite = holds_finite([content["state_dict"], content.get("optimizer_states"), content.get("rule_state")])
    agreeing = f"Saving {filepath} at step {step}, agreeing on a save id and checking its values,"
    table = ranks.gather([secrets.randbits(62), finite, -1 if same is None else same[0]], agreeing)
    bad = [rank for rank, finite in enumerate(table[:, 1].tolist()) if not finite]
    if bad:
        raise not_finite_error(bad, step, filepath)
    source = same[1] if same is not None and set(table[:, 2].tolist()) == {same[0]} else None  # every rank links
    agreed(source is not None)
    content["save_id"] = save_id = int(table[0, 0]) if source is None else same[0]
    checkpoint[META_KEY] = {"save_id": save_id, "world_size": ranks.world_size}
    during = f"Saving {filepath} at step {step}"
    shard = shard_path(filepath, ranks.rank, ranks.world_size, save_id)

    def put_shard() -> None:
        if source is None or not atomic_link(source, shard):
            write_shard(content, shard)

    try:
        ranks.on_every_rank(put_shard, "write its shard", during)
    except PeerFailure:
        raise  # whether every shard is in place is unknown here: another rank may go on to write the file
    except BaseException:
        if shard != source:  # not every shard was written; the earlier saves' stay: their checkpoint file names them
            discard(shard)
        raise
    ranks.on_every_rank(write_file, "write the checkpoint file", during)
    remove_shards(filepath, ranks.rank, keep=shard)
    if earlier is not None:
        earlier.remember(content, save_id, shard)


def not_finite_error(ranks: list[int], step: int, filepath: StrPath, who: str = "Rank(s)") -> FloatingPointError:
    """The error of a save refused because `ranks` (`who`: `"Worker(s)"` in a simulation) hold a NaN or an Inf."""
    return FloatingPointError(
        f"{who} {ranks} hold a NaN or an Inf in the replica or the optimizer state at step {step}: the checkpoint "
        f"{filepath} is not written, and the checkpoints written before are left as they are. Training stops "
        "here. Lower the learning rate, clip the gradients (Trainer(gradient_clip_val=...), or "
        "fabric.clip_gradients in a Fabric loop) or look for the source with torch.autograd.detect_anomaly."
    )


def holds_finite(state: Any) -> bool:
    """Whether every floating-point tensor in `state` (nested in dicts, lists and tuples) is finite.

    A NaN or an Inf makes a tensor's sum non-finite, so a finite sum proves the tensor finite: one reduction, 30 times
    faster on a CPU than testing every element, done only when the sum is not finite (finite values may overflow it).

    Examples:
        >>> holds_finite({"w": torch.ones(2), "opt": [{"m": torch.tensor([0.0, float("inf")])}], "step": 3})
        False
        >>> holds_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the values are finite
        True
    """
    if isinstance(state, Tensor):
        if not state.is_floating_point():
            return True
        return bool(torch.isfinite(state.sum())) or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(holds_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(holds_finite(v) for v in state)
    return True


def make_shard(
    save_id: int,
    rank: int,
    world_size: int,
    state_dict: dict[str, Any],
    step: int,
    optimizer_states: list[dict[str, Any]] | None = None,
    precision: dict[str, Any] | None = None,
    rule: dict[str, str] | None = None,
    parts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A rank's shard: its own `state_dict`, the optimizer step and the update rule it ran (`rule`, e.g.
    `{"rule": "awc", "topology": "Ring(world_size=4)"}`), what the parts with state registered (`parts`:
    [`StateRegistry.save`][lightning_decentral.checkpoint.StateRegistry.save], taken at the save: the random state
    among them), and (unless the
    checkpoint is weights-only: `optimizer_states=None`) its optimizers' `state_dict()`s and its precision plugin's
    state. The one function every shard is made by (the files, the rejoin handover, the simulation's)."""
    shard = {
        "format": SHARD_FORMAT,
        "save_id": save_id,
        "rank": rank,
        "world_size": world_size,
        "state_dict": state_dict,
        "strategy": {"step": step, **(rule or {})},
        **(parts or {}),
    }
    if optimizer_states is not None:
        shard["optimizer_states"] = optimizer_states
        shard["precision"] = precision
    return shard


def with_shard(checkpoint: dict[str, Any], shard: dict[str, Any], precision_key: str) -> dict[str, Any]:
    """`checkpoint` with this rank's replica, optimizer and precision state (under `precision_key`) from its shard."""
    restored = {**checkpoint, "state_dict": shard["state_dict"]}
    if "optimizer_states" in shard:
        restored["optimizer_states"] = shard["optimizer_states"]
    if shard.get("precision"):
        restored[precision_key] = shard["precision"]
    return restored


def rule_record(rule: str, topology: Any) -> dict[str, str]:
    """What a shard records of the update rule it was saved under: the entry of `RULES` and the topology's `repr`.

    Examples:
        >>> from lightning_decentral.topology import Ring
        >>> rule_record("awc", Ring(world_size=4))
        {'rule': 'awc', 'topology': 'Ring(world_size=4)'}
    """
    return {"rule": rule, "topology": repr(topology)}


def rule_change_warning(checkpoint_path: StrPath, shard: dict[str, Any], rule: dict[str, str]) -> str | None:
    """The warning of an exact resume under another update rule or topology than `shard` was saved with
    (`rule`: this run's, as [`make_shard`][lightning_decentral.checkpoint.make_shard] records it); `None` if
    nothing recorded changed. A key the shard lacks (an older shard) is unknown, not a change."""
    saved = shard.get("strategy", {})
    changes = [
        f"{key} {saved[key]!r} -> {value!r}" for key, value in rule.items() if key in saved and saved[key] != value
    ]
    if not changes:
        return None
    return (
        f"Resuming from {checkpoint_path} with another update rule than it was saved with: {'; '.join(changes)} "
        "(the rule is what `combine` and `momentum` select: 'awc', 'atc' or 'decentlam'). Every replica continues "
        "from its own shard, with the optimizer state the old rule left."
    )


def check_saved_step(shard: dict[str, Any], step: int) -> None:
    """Check that `shard` was saved at optimizer step `step` (the loops' step a resume restored).

    Examples:
        >>> check_saved_step({"strategy": {"step": 3}}, 4)
        Traceback (most recent call last):
        ...
        RuntimeError: The shard was saved at step 3 but the checkpoint's loops are at 4.
    """
    saved = shard["strategy"]["step"]
    if saved != step:
        raise RuntimeError(f"The shard was saved at step {saved} but the checkpoint's loops are at {step}.")


def load_own_shard(
    ranks: RankGroup, checkpoint_path: StrPath, meta: dict[str, int] | None, warn: Callable[[str], None]
) -> dict[str, Any] | None:
    """This rank's shard of the save `meta` names, if every rank has its own; else `None` on every rank, and `warn`
    (rank 0's) says why each rank could not."""
    shard, problem = read_own_shard(checkpoint_path, meta, ranks.rank, ranks.world_size)
    problems = [ShardProblem(p) for p in ranks.gather([problem])[:, 0].tolist()]
    if any(problems):
        warn(resume_warning(checkpoint_path, problems, meta, ranks.world_size))
        return None
    return shard


def read_own_shard(
    checkpoint_path: StrPath, meta: dict[str, int] | None, rank: int, world_size: int
) -> tuple[dict[str, Any] | None, ShardProblem]:
    """`(shard, ShardProblem.NONE)`, or `(None, problem)`."""
    if meta is None:
        return None, ShardProblem.NOT_SHARDED
    if meta["world_size"] != world_size:
        return None, ShardProblem.OTHER_WORLD_SIZE
    source = resolve(checkpoint_path)
    path = shard_path(source, rank, world_size, meta["save_id"])
    try:
        shard = read_shard(path)
    except FileNotFoundError:
        return None, ShardProblem.OTHER_SAVE if shards_of_rank(source, rank) else ShardProblem.MISSING
    except Exception:  # truncated or foreign content
        return None, ShardProblem.UNREADABLE
    if (shard.get("save_id"), shard.get("rank")) != (meta["save_id"], rank):
        return None, ShardProblem.OTHER_SAVE
    if shard.get("format", 1) > SHARD_FORMAT:
        return None, ShardProblem.NEWER_FORMAT
    adopt(path)  # resumed from: the next save of this process supersedes it
    return shard, ShardProblem.NONE


def resume_warning(path: StrPath, problems: list[ShardProblem], meta: dict[str, int] | None, world_size: int) -> str:
    """The one warning of a resume from `x̄`: why each rank could not resume from its shard."""
    if problems[0] in (ShardProblem.NOT_SHARDED, ShardProblem.OTHER_WORLD_SIZE):  # the same file everywhere
        reason = problems[0].describe(saved=meta and meta["world_size"], now=world_size)
    else:
        reason = "; ".join(
            f"rank(s) {[r for r, p in enumerate(problems) if p == problem]}: {problem.describe()}"
            for problem in sorted(set(problems) - {ShardProblem.NONE})
        )
        reason += f" (in {shard_directory(resolve(path))})"
    return (
        f"Resuming from {path} with every replica restarted from the averaged model and the averaged optimizer "
        f"state, not from its own: {reason}. An exact resume needs every rank's shard of that save and the same "
        "world size."
    )


def resolve(checkpoint_path: StrPath) -> str:
    """The file a local `checkpoint_path` links to (`ModelCheckpoint(save_last="link")`): its shards sit there."""
    fs = get_filesystem(checkpoint_path)
    return os.path.realpath(checkpoint_path) if isinstance(fs, LocalFileSystem) else str(checkpoint_path)


def comparable(checkpoint_path: StrPath) -> str:
    """`checkpoint_path` as the ranks compare it: absolute if local (a relative path and its absolute form
    name the same file; a link is not followed), else as given."""
    fs = get_filesystem(checkpoint_path)
    return os.path.abspath(checkpoint_path) if isinstance(fs, LocalFileSystem) else str(checkpoint_path)


def shard_directory(checkpoint_path: StrPath) -> str:
    """The directory beside `checkpoint_path` that holds its shards: `<checkpoint_path>.shards`."""
    return f"{checkpoint_path}.shards"


def shard_path(checkpoint_path: StrPath, rank: int, world_size: int, save_id: int) -> str:
    """Where rank `rank` of `world_size` writes its shard of the save `save_id` of `checkpoint_path`.

    Examples:
        >>> shard_path("ckpts/last.ckpt", rank=2, world_size=4, save_id=123)
        'ckpts/last.ckpt.shards/rank-00002-of-00004.123.pt'
    """
    return f"{shard_directory(checkpoint_path)}/{_prefix(rank)}-of-{world_size:05d}.{save_id}.pt"


def _prefix(rank: int) -> str:
    return f"rank-{rank:05d}"


def write_shard(shard: dict[str, Any], path: str) -> None:
    """`torch.save` to `path` atomically ([`atomic_write`][lightning_decentral.files.atomic_write]): a reader sees
    all of it or nothing, and a full disk or a kill leaves no damaged shard."""
    atomic_write(path, lambda f: torch.save(shard, f))


def discard(path: str) -> None:
    """Remove the shard `path` and this process's temporary file of it, where they exist (a save that failed)."""
    fs = get_filesystem(path)
    for leftover in (path, temporary_name(path)):
        _remove(fs, leftover)


def read_shard(path: str) -> dict[str, Any]:
    """A shard, on the CPU, unpickled with `weights_only=True` (tensors and primitives only)."""
    with get_filesystem(path).open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def shards_of_rank(checkpoint_path: StrPath, rank: int) -> list[str]:
    """This rank's shard files for `checkpoint_path`, of any save and world size."""
    return _files_of_rank(checkpoint_path, rank, "-of-*.pt")


def temporary_files_of_rank(checkpoint_path: StrPath, rank: int) -> list[str]:
    """This rank's temporary shard files for `checkpoint_path` (writes in progress or never done), of any writer."""
    return _files_of_rank(checkpoint_path, rank, "-of-*.pt*.tmp")


def _files_of_rank(checkpoint_path: StrPath, rank: int, pattern: str) -> list[str]:
    """This rank's files matching `pattern` in the shard directory; none when another rank removes the directory
    (emptied of its own files) while this one lists it."""
    try:
        return sorted(
            get_filesystem(checkpoint_path).glob(f"{shard_directory(checkpoint_path)}/{_prefix(rank)}{pattern}")
        )
    except FileNotFoundError:
        return []


def remove_shards(checkpoint_path: StrPath, rank: int, keep: str | None = None) -> None:
    """Delete this rank's shards of `checkpoint_path` that this process wrote or resumed from, but the file `keep`,
    and the temporary files this process or a dead one left; the directory too once empty.

    After a save, `keep` is its shard: the other shards this process wrote there belong to no checkpoint (an
    earlier save, a save whose checkpoint file was never written). A file of another process stays, unless it is a
    temporary file whose writer is provably gone
    ([`removable_temporary`][lightning_decentral.files.removable_temporary]): another job saving to the same path keeps
    its shards, also those it is writing. Safe to repeat or to race: a file or directory already gone is no error.
    """
    fs = get_filesystem(checkpoint_path)
    kept = None if keep is None else os.path.basename(keep)
    for path in shards_of_rank(checkpoint_path, rank):
        if os.path.basename(path) != kept and owned(path):
            _remove(fs, path)
    for path in temporary_files_of_rank(checkpoint_path, rank):
        if removable_temporary(path):
            _remove(fs, path)
    directory = shard_directory(checkpoint_path)
    try:
        if fs.exists(directory) and not fs.ls(directory):
            fs.rmdir(directory)
    except OSError:  # not empty, or already gone: another rank or job wrote or removed it meanwhile
        pass


def _remove(fs: Any, path: str) -> None:
    """Delete the file `path`; one already gone is no error."""
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    disown(path)


def rng_state() -> dict[str, Any]:
    """The global RNG states of torch (and CUDA when in use), numpy and Python, as `weights_only` types."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    version, python_state, python_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
        "python": (version, list(python_state), python_gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of [`rng_state`][lightning_decentral.checkpoint.rng_state]."""
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, python_state, python_gauss = state["python"]
    random.setstate((version, tuple(python_state), python_gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
