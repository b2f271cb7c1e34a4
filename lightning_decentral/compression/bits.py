"""Unsigned integer codes packed into bytes, `bits` per code, vectorized (no loop over the codes), any device.

Widths that divide 8 (1, 2, 4) gather the `8 / bits` codes of a byte, one byte each, in a wider integer and fold them
into its low byte with shifts and ors (`log2(8 / bits)` rounds): a few passes over `count / 8` words instead of one
per code position. Both ends are little-endian (x86, ARM, CUDA), which the word views rely on.
"""

from __future__ import annotations

import torch
from torch import Tensor

# bits -> (the word holding 8 / bits one-byte codes, the shifts that fold them into its low byte, the masks that
# spread them back, in the order unpacking applies them)
_WORDS: dict[int, tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = {
    1: (torch.int64, (7, 14, 28), (0x0000000F0000000F, 0x0003000300030003, 0x0101010101010101)),
    2: (torch.int32, (6, 12), (0x000F000F, 0x03030303)),
    4: (torch.int16, (4,), (0x0F0F,)),
}
FOLDED = tuple(_WORDS)
"""The widths [`fold_bytes_`][lightning_decentral.compression.bits.fold_bytes_] and
[`spread_bytes`][lightning_decentral.compression.bits.spread_bytes] take: 1, 2 and 4 bits."""


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits take once packed: `⌈count · bits / 8⌉`.

    Examples:
        >>> packed_bytes(10, 1), packed_bytes(10, 4), packed_bytes(10, 23)
        (2, 5, 29)
    """
    return (count * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """`codes` (non-negative integers below `2^bits`, `1 <= bits <= 32`) as `packed_bytes(len(codes), bits)` bytes
    (uint8, into `out` if given), little-endian: code `c` occupies bits `c·bits … c·bits + bits − 1` of the stream.

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
    size = packed_bytes(len(codes), bits)
    out = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    if bits == 8:
        return out.copy_(codes)
    if bits in _WORDS:
        small = torch.zeros(size * 8 // bits + 8, dtype=torch.uint8, device=device)  # whole words, zero-padded
        small[: len(codes)] = codes
        return fold_bytes_(small[: size * 8 // bits + (-size * 8 // bits) % 8], bits, out)
    stream = ((codes.to(torch.int64)[:, None] >> torch.arange(bits, device=device)) & 1).to(torch.uint8).view(-1)
    stream = torch.nn.functional.pad(stream, (0, -len(stream) % 8)).view(-1, 8)
    return torch.sum(stream << torch.arange(8, dtype=torch.uint8, device=device), 1, dtype=torch.uint8, out=out)


def fold_bytes_(codes: Tensor, bits: int, out: Tensor) -> Tensor:
    """Pack one-byte codes `codes` (uint8 or bool, `bits` in 1, 2, 4; a length that fills whole 8-byte words, at an
    offset that is a multiple of 8) into `out`'s `⌈len(out)⌉` bytes, overwriting `codes` on the way; returns `out`.
    What [`pack_bits`][lightning_decentral.compression.bits.pack_bits] does for those widths, without a copy of
    `codes`."""
    word, shifts, _ = _WORDS[bits]
    words = codes.view(torch.uint8).view(word)
    shifted = torch.empty_like(words)
    for shift in shifts:
        words.bitwise_or_(torch.bitwise_right_shift(words, shift, out=shifted))
    low = words.view(torch.uint8)[:: word.itemsize]  # the low byte of each word (little-endian)
    return out.copy_(low[: len(out)])


def unpack_bits(packed: Tensor, count: int, bits: int) -> Tensor:
    """The `count` codes of [`pack_bits`][lightning_decentral.compression.bits.pack_bits]: uint8 up to 8 bits per
    code, else int64."""
    device = packed.device
    if bits == 8:
        return packed[:count]
    if bits in _WORDS:
        return spread_bytes(packed, bits)[:count]
    stream = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1).view(-1)[: count * bits]
    weights = torch.ones(bits, dtype=torch.int64, device=device) << torch.arange(bits, device=device)
    return (stream.view(count, bits).to(torch.int64) * weights).sum(1)


def spread_bytes(packed: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """The `8 / bits` codes of each byte of `packed` (`bits` in 1, 2, 4), one byte each: `len(packed) · 8 / bits`
    uint8 (into `out`, a word-aligned uint8 tensor of that length, if given)."""
    word, shifts, masks = _WORDS[bits]
    words = packed.to(word) if out is None else out.view(word).copy_(packed)  # each byte in its own word
    shifted = torch.empty_like(words)
    for shift, mask in zip(reversed(shifts), masks):
        words.bitwise_or_(torch.bitwise_left_shift(words, shift, out=shifted)).bitwise_and_(mask)
    return words.view(torch.uint8)
