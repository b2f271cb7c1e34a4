"""The data order of a Fabric loop, saved and restored with its checkpoint:
[`DataOrder`][lightning_decentral.fabric.DataOrder]."""

from __future__ import annotations

from typing import Any

from lightning.fabric.wrappers import is_wrapped

from lightning_decentral._compat.lightning import epochs_begun, set_epochs_begun


class DataOrder:
    """The epoch of a loader that `fabric.setup_dataloaders` returned, for `fabric.save` and `fabric.load`.

    At every `for batch in loader`, Fabric sets the sampler's epoch to the number of epochs the loader has begun
    (a shuffled `DistributedSampler` draws its order from `seed + epoch`). A new process counts from 0 again, so
    a resumed loop would repeat the first epochs' orders. Put a `DataOrder` in the state; `fabric.load` restores
    the count, and the next epoch draws the order the saved run would have drawn:

    ```python
    order = DataOrder(loader)
    state = {"model": model, "optimizer": optimizer, "data": order}
    fabric.load("last.ckpt", state)             # on resume
    for epoch in range(order.epoch, epochs):    # the epoch the next `for batch in loader` draws the order of
        for batch in loader: ...
        fabric.save("last.ckpt", state)         # between epochs
    ```

    The position inside an epoch is not saved: a checkpoint saved during epoch `e` resumes at epoch `e + 1`.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> DataOrder(DataLoader(range(4)))
        Traceback (most recent call last):
            ...
        TypeError: DataOrder takes the loader `fabric.setup_dataloaders(loader)` returned (it counts the epochs),
        not a DataLoader.
    """

    def __init__(self, loader: Any) -> None:
        if not (is_wrapped(loader) and epochs_begun(loader) is not None):
            raise TypeError(
                "DataOrder takes the loader `fabric.setup_dataloaders(loader)` returned (it counts the epochs), not a "
                f"{type(loader).__name__}."
            )
        self.loader = loader

    @property
    def epoch(self) -> int:
        """The epochs the loader has begun: the epoch whose order the next `for batch in loader` draws."""
        return int(epochs_begun(self.loader) or 0)

    def state_dict(self) -> dict[str, int]:
        """What `fabric.save` writes: `{"epoch": epoch}`."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Run by `fabric.load`: the loader's next epoch is `state_dict["epoch"]`."""
        set_epochs_begun(self.loader, int(state_dict["epoch"]))
