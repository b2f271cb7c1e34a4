"""CHOCO gossip with a public copy per edge, dense and in float64, written from docs/algorithms.md ("Compressed gossip
(CHOCO)") independently of ``lightning_decentral.compression.choco``: every edge ``j → i`` of ``W(k)`` has its copy
``hat[j, i]``, compressed for separately (no copies shared), and ``W(k)`` comes from ``tests.reference.mixing``.

Only the compressors and the seed convention (``exchange_seed``: the same integer on both ends) come from the
package; they are tested on their own in ``tests/test_compression.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_decentral.compression import exchange_seed, resolve_compression


class ChocoReference:
    """``n`` workers' public copies, by buffer key; ``mix(x, step, rounds, key)`` is ``rounds`` rounds of

    ``q = C(x_j − hat[j, i])``, ``hat[j, i] += q`` for every edge ``j → i``, then
    ``x_i += γ (Σ_j w_ij hat[j, i] − Σ_j w_ji hat[i, j])``; with ``from_copy`` (the outer step's mixing) the round
    ends from worker ``i``'s own copy instead, ``x_i <- own_i + γ (...)``, ``own_i = Σ_j w_ji hat[i, j] / Σ_j w_ji``;
    every copy of buffer ``key`` starts at ``origins[key]`` (zero without).
    """

    def __init__(
        self,
        compression: Any,
        consensus_step: float | None,
        mixing: Callable[[int], torch.Tensor],
        from_copy: bool = False,
        origins: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.compressor = resolve_compression(compression)
        self.gamma = self.compressor.consensus_step if consensus_step is None else consensus_step
        self.mixing, self.from_copy = mixing, from_copy
        self.origins = origins or {}  # key -> where every copy of that buffer starts (zero without)
        self.hat: dict[tuple[int, int, int], torch.Tensor] = {}  # (key, j, i) -> x̂_{j→i}

    def mix(self, x: torch.Tensor, step: int, rounds: int, key: int) -> torch.Tensor:
        n, d = x.shape
        w = self.mixing(step)
        if d == 0 or torch.equal(w, torch.eye(n, dtype=w.dtype)):
            return x
        c = self.compressor
        for r in range(rounds):
            edges = [(j, i) for i in range(n) for j in range(n) if i != j and w[i, j] > 0]
            for j, i in edges:
                hat = self.hat.get((key, j, i), self.origins.get(key, torch.zeros(d, dtype=torch.float64)))
                seed = exchange_seed(step, r, key, j)
                self.hat[key, j, i] = hat + c.decompress(c.compress(x[j] - hat, seed), d, torch.float64, seed)
            change, own, out_weight = torch.zeros_like(x), torch.zeros_like(x), torch.zeros(n, 1, dtype=torch.float64)
            for j, i in edges:
                change[i] += w[i, j] * self.hat[key, j, i]
                change[j] -= w[i, j] * self.hat[key, j, i]
                own[j] += w[i, j] * self.hat[key, j, i]
                out_weight[j] += w[i, j]
            start = torch.where(out_weight > 0, own / out_weight.clamp(min=1e-300), x) if self.from_copy else x
            x = start + self.gamma * change
        return x
