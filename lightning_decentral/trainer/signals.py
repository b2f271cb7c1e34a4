"""SIGTERM under the Trainer without Lightning's broadcast at every batch: every rank stops at a step agreed through
the job's store ([`StopAgreement`][lightning_decentral.trainer.stop.StopAgreement]).

Lightning 2.6 runs `_broadcast_sigterm_tensor` (a broadcast from rank 0 on the default group) at the start of every
training batch, and its SIGTERM handler broadcasts again from inside the handler. Both are replaced for one fit
by [`stop_together`][lightning_decentral.trainer.signals.stop_together], which keeps what they mean: a SIGTERM on
any rank (forwarded by the launcher to its local ranks, as Lightning does) stops every rank at the same batch, by
raising `SIGTERMException` where Lightning raises it, so the `on_exception` callbacks write the checkpoint
Lightning would write (`OnExceptionCheckpoint`, `ModelCheckpoint(save_on_exception=True)`), at the same step on
every rank. A signal during validation takes effect at the next training batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_decentral._compat.lightning import mark_sigterm_received, replace_sigterm_handling
from lightning_decentral.trainer.stop import StopAgreement

log = logging.getLogger(__name__)


def stop_together(trainer: Trainer, agreement: StopAgreement, first_check: Callable[[], None] = lambda: None) -> None:
    """From now on, in this fit of `trainer`: a SIGTERM only requests a stop from `agreement`, and each training
    batch asks it whether to stop, in place of Lightning's broadcast; at the first batch of an epoch, `first_check`
    (a check of this rank alone, which may raise) runs before the store is asked, so that a rank that failed it and
    left, with the store it may host, cannot hide the same failure of another rank behind a lost store. Call it in the
    strategy's `setup`, which the Trainer runs before it registers its signal handlers and before the first batch."""
    loop = trainer.fit_loop.epoch_loop

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        launcher = trainer.strategy.launcher
        if not agreement.requested and launcher is not None:
            launcher.kill(signum)  # as Lightning: the launcher forwards the first signal to the ranks it started
        agreement.request()

    def stop_if_agreed() -> None:
        if loop.batch_progress.current.ready == 0:  # the epoch's first batch
            first_check()
        if agreement.should_stop(loop.batch_progress.total.ready):  # the batches started before this one
            mark_sigterm_received(trainer)
            raise SIGTERMException()

    replace_sigterm_handling(trainer, on_sigterm, stop_if_agreed)


def stop_line(step: int, last_save: tuple[int, str] | None) -> str:
    """The line a run stopped by a SIGTERM logs once: the step every rank stopped before, and the checkpoint to resume
    from (one saved at the stop: `OnExceptionCheckpoint`, or a `ModelCheckpoint` that saves on exceptions).

    Examples:
        >>> print(stop_line(12, (12, "ckpts/on_exception.ckpt")))
        Stopped by SIGTERM before step 12, every rank at the same step. Resume with trainer.fit(...,
        ckpt_path='ckpts/on_exception.ckpt').
        >>> print(stop_line(12, (10, "ckpts/last.ckpt")))
        Stopped by SIGTERM before step 12, ... No checkpoint was saved at the stop ...; the newest is
        'ckpts/last.ckpt', of step 10.
    """
    said = f"Stopped by SIGTERM before step {step}, every rank at the same step."
    if last_save is not None and last_save[0] == step:
        return f"{said} Resume with trainer.fit(..., ckpt_path={last_save[1]!r})."
    newest = f"the newest is {last_save[1]!r}, of step {last_save[0]}" if last_save else "none was saved in this fit"
    return f"{said} No checkpoint was saved at the stop (OnExceptionCheckpoint(dirpath) saves one); {newest}."
