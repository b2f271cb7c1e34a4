"""Unsigned integer codes packed into bytes, `bits` per code, vectorized (no loop over the codes), any device."""

from __future__ import annotations

import torch
from torch import Tensor


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits take once packed: `⌈count · bits / 8⌉`.

    Examples:
        >>> packed_bytes(10, 1), packed_bytes(10, 4), packed_bytes(10, 23)
        (2, 5, 29)
    """
    return (count * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """`codes` (non-negative integers below `2^bits`, `1 <= bits <= 32`) as `packed_bytes(len(codes), bits)` bytes
    (uint8), little-endian: code `c` occupies bits `c·bits … c·bits + bits − 1` of the stream.

    Widths that divide 8 pack `8 / bits` codes per byte directly; other widths go through one byte per bit.

    Examples:
        >>> pack_bits(torch.tensor([1, 0, 1, 1]), 1).tolist()        # 0b1101
        [13]
        >>> pack_bits(torch.tensor([3, 10, 7]), 4).tolist()          # 0xA3, 0x07
        [163, 7]
        >>> unpack_bits(pack_bits(torch.tensor([5, 0, 6, 7, 1]), 3), 5, 3).tolist()
        [5, 0, 6, 7, 1]
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in [1, 32], got {bits}.")
    device = codes.device
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        per_byte = 8 // bits
        small = codes.to(torch.uint8)
        padded = torch.nn.functional.pad(small, (0, -len(small) % per_byte)).view(-1, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return (padded << shifts).sum(1, dtype=torch.uint8)  # the codes' bits do not overlap: no carry
    stream = ((codes.to(torch.int64)[:, None] >> torch.arange(bits, device=device)) & 1).to(torch.uint8).view(-1)
    stream = torch.nn.functional.pad(stream, (0, -len(stream) % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.uint8, device=device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, count: int, bits: int) -> Tensor:
    """The `count` codes of [`pack_bits`][lightning_decentral.compression.bits.pack_bits]: uint8 up to 8 bits per
    code, else int64."""
    device = packed.device
    if bits == 8:
        return packed[:count]
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]
    stream = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1).view(-1)[: count * bits]
    weights = torch.ones(bits, dtype=torch.int64, device=device) << torch.arange(bits, device=device)
    return (stream.view(count, bits).to(torch.int64) * weights).sum(1)
