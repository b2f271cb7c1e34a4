"""Compressed gossip: CHOCO gossip (Koloskova, Stich and Jaggi, 2019) with a public copy per edge, and its compressors.

`DecentralizedStrategy(compression="sign")` (or `"int8"`, `"int4"`, `"top_k:0.01"`, `"random_k:0.01"`, or a
[`Compressor`][lightning_decentral.compression.Compressor] object) sends each neighbour `C(x − x̂)` instead of `x`,
where `x̂` is the public copy both ends of an edge keep, and moves every worker by `γ` (`consensus_step`) towards its
neighbours' copies (docs/algorithms.md, "Compressed gossip (CHOCO)"). The package:

* `compressors`: the [`Compressor`][lightning_decentral.compression.Compressor] protocol and
  [`Sign`][lightning_decentral.compression.Sign], [`Quantize`][lightning_decentral.compression.Quantize],
  [`TopK`][lightning_decentral.compression.TopK], [`RandomK`][lightning_decentral.compression.RandomK];
  [`resolve_compression`][lightning_decentral.compression.resolve_compression] turns a name into one;
* `bits`: integer codes packed into bytes;
* `choco`: the rule, one worker's side, apart from the transport ([`Choco`][lightning_decentral.compression.Choco],
  [`ChocoExchange`][lightning_decentral.compression.ChocoExchange]); the mixers move its messages
  ([`CompressedGossip`][lightning_decentral.gossip.CompressedGossip] between processes, the
  [`DenseMixer`][lightning_decentral.mixing.DenseMixer] in one process).

Examples:
    Four workers on a ring, gossip only, `sign` at its default step: the disagreement shrinks, the mean stays.

    >>> import torch
    >>> from lightning_decentral.topology import Ring
    >>> ring, sign = Ring(world_size=4), Sign()
    >>> workers = [Choco(sign, sign.consensus_step, rank) for rank in range(4)]
    >>> x = [torch.randn(256, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    >>> mean, spread = torch.stack(x).mean(0), torch.stack(x).std(0).norm()
    >>> for step in range(60):
    ...     exchange_in_process([ChocoExchange(w, ring, [x[i]], step, rounds=1) for i, w in enumerate(workers)])
    >>> bool(torch.stack(x).std(0).norm() < spread / 100), bool(torch.allclose(torch.stack(x).mean(0), mean, atol=1e-5))
    (True, True)
    >>> workers[0].wire_bytes == 60 * 2 * sign.payload_bytes(256, torch.float32)   # 2 neighbours, 60 steps
    True
"""

from lightning_decentral.compression.bits import pack_bits, packed_bytes, unpack_bits
from lightning_decentral.compression.choco import (
    Choco,
    ChocoExchange,
    ChocoStates,
    Compressing,
    EdgeCopies,
    check_compressible,
    exchange_in_process,
    exchange_seed,
    state_dtype,
)
from lightning_decentral.compression.compressors import (
    NAMES,
    CompressionArgument,
    Compressor,
    Quantize,
    RandomK,
    Sign,
    TopK,
    kept,
    largest,
    resolve_compression,
)

__all__ = [
    "NAMES",
    "Choco",
    "ChocoExchange",
    "ChocoStates",
    "Compressing",
    "CompressionArgument",
    "Compressor",
    "EdgeCopies",
    "Quantize",
    "RandomK",
    "Sign",
    "TopK",
    "check_compressible",
    "exchange_in_process",
    "exchange_seed",
    "kept",
    "largest",
    "pack_bits",
    "packed_bytes",
    "resolve_compression",
    "state_dtype",
    "unpack_bits",
]
