"""Per-rank checkpoint shards: every replica, its optimizer state, the strategy's state and RNG state.

A decentralized run is ``n`` models. The checkpoint file Lightning writes on rank 0 keeps the
average ``x̄`` (a plain LightningModule loads it); next to it, every rank writes its own shard,
so that ``trainer.fit(ckpt_path=...)`` continues every replica exactly::

    epoch=1-step=40.ckpt                                      rank 0: x̄, loops, callbacks, {save_id, world_size}
    epoch=1-step=40.ckpt.shards/rank-00002-of-00004.<save_id>.pt   rank 2's shard, written by rank 2

Each rank writes and removes only its own shard, so nothing is gathered onto one rank and no
filesystem needs to be shared between nodes. Every file is written under a temporary name and
renamed into place (atomic on a local or POSIX filesystem); the strategy writes the checkpoint
file only once every rank has reported its shard in place, so an existing checkpoint file
implies complete shards. The random ``save_id`` in the shard names is recorded in the
checkpoint file too: shards of another save (an overwritten ``last.ckpt``, a crash between the
shards and the file, a foreign run) are never taken for this one's. Shards hold tensors and
primitives only and are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
from typing import Any, Optional

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

META_KEY = "decentralized_shards"  # in the checkpoint file: {"save_id", "world_size"}


def resolve(checkpoint_path: _PATH) -> str:
    """The file a local ``checkpoint_path`` links to (``ModelCheckpoint(save_last="link")``): its shards sit there."""
    fs = get_filesystem(checkpoint_path)
    return os.path.realpath(checkpoint_path) if isinstance(fs, LocalFileSystem) else str(checkpoint_path)


def shard_directory(checkpoint_path: _PATH) -> str:
    return f"{checkpoint_path}.shards"


def shard_path(checkpoint_path: _PATH, rank: int, world_size: int, save_id: int) -> str:
    return f"{shard_directory(checkpoint_path)}/{_prefix(rank)}-of-{world_size:05d}.{save_id}.pt"


def _prefix(rank: int) -> str:
    return f"rank-{rank:05d}"


def write_shard(shard: dict[str, Any], path: str) -> None:
    """``torch.save`` to ``path + ".tmp"``, then rename to ``path``: a reader sees all of it or nothing."""
    fs = get_filesystem(path)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    partial = path + ".tmp"
    with fs.open(partial, "wb") as f:
        torch.save(shard, f)
    fs.mv(partial, path)


def discard(path: str) -> None:
    """Remove the shard ``path`` and its temporary file, where they exist (a save that failed)."""
    fs = get_filesystem(path)
    for leftover in (path, path + ".tmp"):
        if fs.exists(leftover):
            fs.rm(leftover)


def read_shard(path: str) -> dict[str, Any]:
    """A shard, on the CPU, unpickled with ``weights_only=True`` (tensors and primitives only)."""
    with get_filesystem(path).open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def shards_of_rank(checkpoint_path: _PATH, rank: int) -> list[str]:
    """This rank's shard files for ``checkpoint_path``, of any save and world size."""
    fs = get_filesystem(checkpoint_path)
    return sorted(fs.glob(f"{shard_directory(checkpoint_path)}/{_prefix(rank)}-of-*.pt"))


def remove_shards(checkpoint_path: _PATH, rank: int, keep: Optional[str] = None) -> None:
    """Delete this rank's shards of ``checkpoint_path`` but the file ``keep``; the directory too once empty."""
    fs = get_filesystem(checkpoint_path)
    for path in shards_of_rank(checkpoint_path, rank):
        if keep is None or os.path.basename(path) != os.path.basename(keep):
            fs.rm(path)
    directory = shard_directory(checkpoint_path)
    try:
        if fs.exists(directory) and not fs.ls(directory):
            fs.rmdir(directory)
    except OSError:  # another rank wrote or removed it meanwhile (shared filesystem)
        pass


def rng_state() -> dict[str, Any]:
    """The global RNG states of torch (and CUDA when in use), numpy and Python, as ``weights_only`` types."""
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
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, python_state, python_gauss = state["python"]
    random.setstate((version, tuple(python_state), python_gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
