"""Checkpoints saved in the background, so that saving every few steps does not stall training.

With Lightning's `AsyncCheckpointIO` plugin (`Trainer(plugins=[AsyncCheckpointIO()])`), a save blocks the
training thread only while it copies what the checkpoint holds of this rank (its replica, its optimizer state,
the loops and callbacks' state, its RNG state) to host memory. A thread of the strategy then does, on a gloo
group of its own (so that its collectives never interleave with training's), what a synchronous save does:
average the copies into `x̄` and the averaged optimizer state, and run the shard protocol of
[`save_with_shards`][lightning_decentral.checkpoint.save_with_shards] (every shard in place before rank 0
writes the file). Saves and removals run one at a time, in the order they were asked for: a checkpoint that
`ModelCheckpoint` drops is removed only after the save that replaces it is complete.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from lightning_decentral import checkpoint as shards
from lightning_decentral.agreement import Ranks, mean_optimizer_state
from lightning_decentral.files import StrPath
from lightning_decentral.replicas import averaged_state_dict
from lightning_decentral.trainer.reuse import StepSaves


class BackgroundWriter:
    """A thread that runs the jobs given to [`submit`][lightning_decentral.trainer.background.BackgroundWriter.submit]
    one at a time, in order.

    The first job that raises stops it: the jobs after it are dropped (a removal queued after a failed save must not
    run), and its error is raised on the training thread by the next `wait`, never by `submit`: every rank then
    raises it at the same point of training (a rank that raised as soon as it knew could leave another in a
    collective with it, which would end there with a `PeerFailure` instead of the save's error).

    Examples:
        >>> writer = BackgroundWriter()
        >>> done = []
        >>> writer.submit(lambda: done.append(1)); writer.submit(lambda: done.append(2)); writer.wait()
        >>> done
        [1, 2]
        >>> writer.submit(lambda: 1 / 0); writer.submit(lambda: done.append(3)); writer.wait()
        Traceback (most recent call last):
        ...
        ZeroDivisionError: division by zero
        >>> done
        [1, 2]
        >>> writer.close(wait=True)
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lightning_decentral checkpoints", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue `job` (dropped if a job failed before: `wait` raises that job's error)."""
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every job queued so far has run (or was dropped), then raise a job's error, if any."""
        self._jobs.join()
        if self._error is not None:
            raise self._error

    def close(self, wait: bool) -> None:
        """Let the thread end once the jobs queued so far have run; with `wait`, wait for it. Without, a job blocked
        on a dead peer does not keep the process alive (the thread is a daemon)."""
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job()
            except BaseException as exc:  # raised on the training thread by the next wait
                self._error = exc
            finally:
                job = None  # nothing of a finished job (its process group) outlives it here
                self._jobs.task_done()


def background_save(
    checkpoint: dict[str, Any],
    filepath: StrPath,
    own: dict[str, Any],
    ranks: Ranks,
    shared: StepSaves,
    write_file: Callable[[dict[str, Any]], None],
) -> Callable[[], None]:
    """Copy `checkpoint` (holding this rank's own replica and optimizer state) and `own` (this rank's shard but the
    save id: the arguments of [`make_shard`][lightning_decentral.checkpoint.make_shard]) to host memory, the only part
    that blocks training, and return the rest of the save for the writer thread: the shard protocol on `ranks` (the
    writer's own group), which averages the copies into `x̄` and the averaged optimizer state once the ranks agreed on
    the save id, and `write_file(checkpoint)` writing the file on rank 0. A later save of the same step reuses the
    copies of unchanged tensors and, if every rank's shard is unchanged, links it and reuses the means, agreed in the
    all-gather of the save id (`shared`)."""
    copied = shared.copies.copy(checkpoint)
    shard = shared.copies.copy(own)
    own_states = shard["optimizer_states"]
    means, earlier = shared.queued()

    def save() -> None:
        def average(reuse: bool) -> None:  # `reuse`: every rank's shard, so the means' inputs, is the earlier save's
            averaging = "Averaging the replicas into x̄ (to save)"
            copied["state_dict"] = averaged_state_dict(shard["state_dict"], means.bound(ranks, "x̄", averaging, reuse))
            if own_states is not None:
                averaging = "Averaging the optimizer state (to save)"
                copied["optimizer_states"] = [
                    mean_optimizer_state(ranks, state, means.bound(ranks, f"optimizer {i}", averaging, reuse))
                    for i, state in enumerate(own_states)
                ]

        if not means.unchanged(ranks):
            earlier.clear()  # a mean written in place (or another group): nothing of the earlier save is reused
        shards.save_with_shards(
            ranks,
            copied,
            filepath,
            make_shard=lambda save_id: shards.make_shard(save_id, ranks.rank, ranks.world_size, **shard),
            write_file=lambda: write_file(copied),
            earlier=earlier,
            agreed=average,
        )

    return save
