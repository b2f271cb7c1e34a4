"""Every file the package writes is written whole or not at all
([`atomic_write`][lightning_decentral.files.atomic_write]), and a cleanup deletes only what this process wrote or what a
dead process left.

On a local filesystem (local disk, scratch, NFS) a file `<name>` is written to a temporary file beside it,
`<name>.<machine>-<pid>.tmp`, flushed and synced to the disk, then renamed over `<name>` (atomic on POSIX), and the
directory is synced: a full disk or a kill leaves the previous `<name>` as it was, never a damaged or empty one.
(Lightning's own `TorchCheckpointIO` writes to the system temporary directory and moves the file, which is a copy
over the old one when the two are on different filesystems.) On an object store, where an upload appears whole or
not at all, fsspec writes the temporary name and moves it.

The temporary name says who writes it: a process id on a machine (a digest of the host name, the boot and the
process-id namespace). A writer is *provably gone* when it ran on this machine and no process has its id any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Callable
from typing import IO, Any, Union

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO


def _machine() -> str:
    """This machine as a temporary name records it: 12 hex digits of its host name, boot and process-id namespace
    (two containers on one host see different process ids)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as boot:
        parts.append(boot.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=6).hexdigest()


StrPath = Union[str, "os.PathLike[str]"]
"""A path the package reads or writes: a local one (a string, a `pathlib.Path`) or an fsspec URL (`"s3://..."`)."""

MACHINE = _machine()
_OWNED: set[str] = set()  # the files this process wrote or resumed from (absolute local paths, or URLs)


def temporary_name(path: str, pid: int | None = None) -> str:
    """Where [`atomic_write`][lightning_decentral.files.atomic_write] writes `path` before renaming it: beside it,
    naming this machine and process `pid` (default this one).

    Examples:
        >>> temporary_name("ckpts/last.ckpt", pid=123) == f"ckpts/last.ckpt.{MACHINE}-123.tmp"
        True
    """
    return f"{path}.{MACHINE}-{os.getpid() if pid is None else pid}.tmp"


def writer_of(temporary: str) -> tuple[str, int] | None:
    """`(machine, pid)` of the process that writes the temporary file `temporary`; `None` for another name (an
    older version's `<name>.tmp`, which says nothing of its writer).

    Examples:
        >>> writer_of("last.ckpt.0123456789ab-77.tmp"), writer_of("last.ckpt.tmp")
        (('0123456789ab', 77), None)
    """
    stem, _, suffix = temporary.rpartition(".")
    machine, _, pid = stem.rpartition(".")[2].partition("-")
    if suffix != "tmp" or len(machine) != 12 or not pid.isdigit():
        return None
    return machine, int(pid)


def removable_temporary(temporary: str) -> bool:
    """Whether this process may delete the temporary file `temporary`: it wrote it, or its writer is provably gone
    (it ran on this machine and no process has its id now). Another machine's, a live process's, or one of an
    unknown writer: no."""
    writer = writer_of(os.path.basename(temporary))
    if writer is None or writer[0] != MACHINE:
        return False
    return writer[1] == os.getpid() or not _alive(writer[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def owned(path: str) -> bool:
    """Whether this process wrote `path` with [`atomic_write`][lightning_decentral.files.atomic_write] or resumed
    from it ([`adopt`][lightning_decentral.files.adopt]), so that a cleanup of this process may delete it."""
    return _key(path) in _OWNED


def adopt(path: str) -> None:
    """Count `path` as this process's: it resumed from it, so a later save of its own supersedes it."""
    _OWNED.add(_key(path))


def disown(path: str) -> None:
    """Forget `path` (deleted)."""
    _OWNED.discard(_key(path))


def _key(path: str) -> str:
    fs, local = fsspec.core.url_to_fs(str(path))
    return os.path.abspath(local) if isinstance(fs, LocalFileSystem) else str(path)


def atomic_write(path: StrPath, write: Callable[[IO[bytes]], Any]) -> None:
    """`write(f)` into `path`, all of it or nothing: into the temporary file `temporary_name(path)` beside it, flushed
    and synced, then renamed over `path`, and the directory synced (locally); an error deletes the temporary file and
    leaves `path` as it was. The directory is created if needed. `path` counts as this process's from then on.

    Examples:
        >>> import tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "sub", "state.pt")
        >>> atomic_write(target, lambda f: torch.save({"step": 3}, f))
        >>> torch.load(target)["step"], os.listdir(os.path.dirname(target)), owned(target)
        (3, ['state.pt'], True)
    """
    fs, local = fsspec.core.url_to_fs(str(path))
    partial = temporary_name(local)
    directory = os.path.dirname(local)
    recorded = None
    try:
        if isinstance(fs, LocalFileSystem):
            os.makedirs(directory or ".", exist_ok=True)
            with open(partial, "wb") as f:
                recorded = _Recorded(f)
                write(recorded)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, local)
            _sync_directory(directory or ".")
        else:
            fs.makedirs(directory, exist_ok=True)
            with fs.open(partial, "wb") as f:
                recorded = _Recorded(f)
                write(recorded)
            fs.mv(partial, local)
    except BaseException as error:
        with contextlib.suppress(Exception):
            fs.rm(partial)
        if recorded is not None and recorded.error is not None and recorded.error is not error:
            raise recorded.error from error  # the disk's own error (ENOSPC), not what torch.save made of it
        raise
    adopt(str(path))


def atomic_link(source: str, path: str) -> bool:
    """Make the local file `path` a hard link of `source` (the same content, no copy), all of it or nothing: the
    link is made under `temporary_name(path)` and renamed over `path`, like
    [`atomic_write`][lightning_decentral.files.atomic_write]. `False`, and nothing left behind, where `path` cannot
    be a link of `source` (an object store; another filesystem; no hard links; `source` gone): write it instead.

    Examples:
        >>> import tempfile
        >>> source = os.path.join(tempfile.mkdtemp(), "a.pt"); atomic_write(source, lambda f: f.write(b"x"))
        >>> target = os.path.join(os.path.dirname(source), "sub", "b.pt")
        >>> atomic_link(source, target), os.path.samefile(source, target), owned(target)
        (True, True, True)
        >>> atomic_link("memory://a.pt", "memory://b.pt")  # no links on this filesystem: write it
        False
    """
    if not all(isinstance(fsspec.core.url_to_fs(str(p))[0], LocalFileSystem) for p in (source, path)):
        return False
    local = fsspec.core.url_to_fs(str(path))[1]
    partial = temporary_name(local)
    directory = os.path.dirname(local) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        os.link(fsspec.core.url_to_fs(str(source))[1], partial)
        os.replace(partial, local)  # does nothing if `path` already is a link of `source` (POSIX)
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.remove(partial)  # left by a failure, or by a rename that did nothing
    _sync_directory(directory)
    adopt(str(path))
    return True


class _Recorded:
    """A file for `torch.save` that keeps the first `OSError` of a write (torch reports a failed write as a
    `RuntimeError` of its zip writer)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.error = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def _sync_directory(directory: str) -> None:
    """Make a rename in `directory` durable (where the filesystem lets a directory be opened)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO` that writes a local checkpoint file with
    [`atomic_write`][lightning_decentral.files.atomic_write] (a temporary file beside it, synced, renamed): on a full
    disk or a kill the previous file stays whole. Other filesystems (object stores) are written as Lightning writes
    them. The strategies of this package write their checkpoint files through it unless given a `CheckpointIO` of
    your own; it also serves any Lightning strategy: `Trainer(plugins=[AtomicCheckpointIO()])`.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: StrPath, storage_options: Any | None = None) -> None:
        """Write `checkpoint` to `path` with `torch.save`, atomically where `path` is local."""
        if storage_options is not None or not isinstance(fsspec.core.url_to_fs(str(path))[0], LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write(path, lambda f: torch.save(checkpoint, f))


def with_atomic_writes(checkpoint_io: CheckpointIO) -> CheckpointIO:
    """`checkpoint_io`, or an [`AtomicCheckpointIO`][lightning_decentral.files.AtomicCheckpointIO] in place of
    Lightning's plain `TorchCheckpointIO` (the default when none was given). A `CheckpointIO` of your own writes as
    it writes."""
    return AtomicCheckpointIO() if type(checkpoint_io) is TorchCheckpointIO else checkpoint_io
