"""Where the public copies of compressed outer steps start: the common initial model `x(0)` (what the package does)
against zero (plain compressed gossip's start), on the float64 reference of the tests (`tests/outer_reference.py` over
`tests/choco_reference.py`; the package's simulation equals it to 1e-9, `tests/test_outer_compressed.py`).

    PYTHONPATH=. python benchmarks/outer_copies.py          # about 1 minute

The task: the tests' regression (`tests.models`: a 75-parameter MLP, each of 4 workers its own data), 100 inner steps
of SGD (lr 0.02, batch 16), `H = 5` (20 rounds), DiLoCo's outer step `SGD(lr=0.7, momentum=0.9, nesterov=True)`.
Reported: the training loss of `x̄` after the last step on 2,048 samples of each worker's data (mean over the workers).
"""

from __future__ import annotations

import torch

from tests import outer_reference
from tests.choco_reference import ChocoReference
from tests.models import init_seed, initial_net, rank_data
from tests.reference import Config

WORKERS = 4


class FromZero(ChocoReference):
    """The reference with every copy starting at zero."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.origins = {}


def loss(state: torch.Tensor) -> float:
    """The mean squared error of `x̄` (the mean of the rows' parameters) on each worker's data, averaged."""
    net = initial_net(init_seed(0)).double()
    offset, mean = 0, state.mean(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    data = [rank_data(i, 2048, torch.float64) for i in range(WORKERS)]
    return sum(torch.nn.functional.mse_loss(net(x), y).item() for x, y in data) / WORKERS


def main() -> None:
    print(
        "| topology | no compression | sign, copies from x(0) | sign, from 0 | top_k:0.2, from x(0) | top_k:0.2, from "
        "0 |"
    )
    print("|---|---|---|---|---|---|")
    for topology in ("complete", "one_peer_exponential"):
        cells = []
        for compression, start in [
            (None, None),
            ("sign", "x0"),
            ("sign", "0"),
            ("top_k:0.2", "x0"),
            ("top_k:0.2", "0"),
        ]:
            config = Config(
                "copies",
                topology=topology,
                optimizer={"lr": 0.02},
                outer={"lr": 0.7, "momentum": 0.9, "nesterov": True},
                gossip_every=5,
                steps=100,
                batch_size=16,
                compression=compression,
                dtype=torch.float64,
            )
            original = outer_reference.ChocoReference
            outer_reference.ChocoReference = FromZero if start == "0" else ChocoReference
            try:
                cells.append(f"{loss(outer_reference.decentralized(config, WORKERS)):.4f}")
            finally:
                outer_reference.ChocoReference = original
        print(f"| {topology} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
