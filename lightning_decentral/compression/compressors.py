"""The compressors `C` of compressed gossip: a flat float tensor to a fixed-size byte payload and back.

Every compressor is a contraction, `‖C(v) − v‖ <= ‖v‖`, which is what CHOCO gossip needs of it
([`Choco`][lightning_decentral.compression.Choco]). What goes on the wire is the payload itself: packed bits,
packed integer codes, compact indices; its size is known before anything is compressed
(`payload_bytes`), so every message has a size both ends agree on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_decentral.compression.bits import pack_bits, packed_bytes, unpack_bits

SCALE = torch.float32  # the dtype of the scales on the wire
BLOCK = 1024  # elements per scale of Sign and Quantize by default


@runtime_checkable
class Compressor(Protocol):
    """What compressed gossip asks of a compressor `C`; implement it for a compressor of your own.

    `compress(v, seed)` returns a uint8 tensor of exactly `payload_bytes(v.numel(), v.dtype)` bytes on `v`'s device;
    `decompress(payload, numel, dtype, seed)` returns `C(v)` (dense, `numel` elements of `dtype`, on the payload's
    device). Both ends call `decompress` on the same payload, so their copies of `C(v)` are identical. `seed` is the
    same integer on both ends (the step, the round, the buffer and the sender): a random compressor draws from it
    instead of sending what it drew. `consensus_step` is the default step `γ` of the consensus.
    `C` must be a contraction, `‖C(v) − v‖ <= ‖v‖` (CHOCO's convergence needs `≤ (1 − δ)‖v‖²` with `δ > 0`).

    Examples:
        >>> class Half:  # keep the first half of the coordinates
        ...     consensus_step = 0.5
        ...     def payload_bytes(self, numel, dtype):
        ...         return (numel // 2) * dtype.itemsize
        ...     def compress(self, v, seed):
        ...         return v[: len(v) // 2].clone().view(torch.uint8)
        ...     def decompress(self, payload, numel, dtype, seed):
        ...         head = payload.view(dtype)
        ...         return torch.cat([head, head.new_zeros(numel - len(head))])
        >>> isinstance(Half(), Compressor)
        True
    """

    consensus_step: float

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int: ...

    def compress(self, v: Tensor, seed: int) -> Tensor: ...

    def decompress(self, payload: Tensor, numel: int, dtype: torch.dtype, seed: int) -> Tensor: ...


def as_dtype(payload: Tensor, dtype: torch.dtype) -> Tensor:
    """The bytes `payload` (uint8) read as `dtype`; copied first where they sit at an offset `dtype` cannot view."""
    if payload.storage_offset() % dtype.itemsize:
        payload = payload.clone()
    return payload.view(dtype)


def _blocks(numel: int, block: int | None) -> int:
    return 1 if block is None or numel <= block else math.ceil(numel / block)


def _width(numel: int, block: int | None) -> int:
    return max(1, numel if block is None or numel <= block else block)


def _per_block(v: Tensor, block: int | None, reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """`reduce(rows)` over the blocks of `v` as rows of `block` elements (the last one may be shorter), one value per
    block; no copy of `v`."""
    width = _width(len(v), block)
    full = len(v) // width * width
    parts = [reduce(v[:full].view(-1, width))] if full else []
    if full < len(v):
        parts.append(reduce(v[full:].view(1, -1)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _scale_blocks_(x: Tensor, scales: Tensor, block: int | None) -> Tensor:
    """`x *= scales[b]` on each block `b` of `x`, in place; returns `x`."""
    width = _width(len(x), block)
    full = len(x) // width * width
    if full:
        x[:full].view(-1, width).mul_(scales[: full // width, None])
    if full < len(x):
        x[full:].mul_(scales[-1])
    return x


def l1_mean(rows: Tensor, scratch: Tensor | None = None) -> Tensor:
    """`‖r‖₁ / len(r)` of each row of `rows` (into `scratch`, of `rows`' shape, on the way if given): `Sign`'s scales,
    as a sum of magnitudes (several times faster on the CPU than `torch.linalg.vector_norm(rows, 1, dim=1)`, which
    can differ from it in the last bit)."""
    return torch.abs(rows, out=scratch).sum(1).div_(rows.shape[1])


def _check_block(block: int | None) -> None:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"`block` must be a positive integer (elements per scale) or None (one scale), got {block!r}.")


@dataclass(frozen=True)
class Sign:
    """`C(v) = s_b · sign(v)` on each block `b` of `block` elements, `s_b = ‖v_b‖₁ / |b|` (the scaled sign):
    one bit per element and one float32 scale per block (`block=None`: one for the whole tensor).

    `‖C(v) − v‖² = ‖v‖² − Σ_b ‖v_b‖₁² / |b|`. A zero is sent as `+`.

    Examples:
        >>> sign = Sign(block=4)
        >>> v = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, 0.5])
        >>> payload = sign.compress(v, seed=0)
        >>> len(payload), sign.payload_bytes(6, torch.float32)   # 1 byte of bits + 2 scales
        (9, 9)
        >>> sign.decompress(payload, 6, torch.float32, seed=0).tolist()
        [2.0, -2.0, 2.0, -2.0, 0.5, 0.5]
    """

    block: int | None = BLOCK
    consensus_step: float = 1.0  # measured: docs/benchmarks.md, "Compressed gossip"

    def __post_init__(self) -> None:
        _check_block(self.block)

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _blocks(numel, self.block) * SCALE.itemsize + packed_bytes(numel, 1)

    def compress(self, v: Tensor, seed: int) -> Tensor:
        scales = _per_block(v, self.block, lambda rows: l1_mean(rows))
        return torch.cat([scales.to(SCALE).view(torch.uint8), pack_bits(v >= 0, 1)])

    def decompress(self, payload: Tensor, numel: int, dtype: torch.dtype, seed: int) -> Tensor:
        blocks = _blocks(numel, self.block)
        scales = as_dtype(payload[: blocks * SCALE.itemsize], SCALE).to(dtype)
        bits = unpack_bits(payload[blocks * SCALE.itemsize :], numel, 1)
        signs = torch.mul(bits, 2, out=torch.empty(numel, dtype=dtype, device=payload.device)).sub_(1)  # ±1
        return _scale_blocks_(signs, scales, self.block)


@dataclass(frozen=True)
class Quantize:
    """`C(v) = s_b · round(v / s_b)` on each block `b` of `block` elements, `s_b = max|v_b| / L`, `L = 2^(bits−1) − 1`:
    integer codes in `[−L, L]` sent as `bits` bits each (offset by `L`), one float32 scale per block.

    Rounding to the nearest level moves no element further than it is from zero and keeps each block's largest
    element exact, so `‖C(v) − v‖ < ‖v‖` for `v ≠ 0`. `"int8"` and `"int4"` are `Quantize(8)` and `Quantize(4)`.

    Examples:
        >>> int4 = Quantize(bits=4)                      # levels −7 … 7 times max|v| / 7
        >>> v = torch.tensor([0.7, -0.35, 0.1, 0.0])
        >>> payload = int4.compress(v, seed=0)
        >>> len(payload), int4.payload_bytes(4, torch.float32)   # 4 bytes of scale + 4 half-bytes
        (6, 6)
        >>> [round(x, 4) for x in int4.decompress(payload, 4, torch.float32, seed=0).tolist()]
        [0.7, -0.4, 0.1, 0.0]
    """

    bits: int = 8
    block: int | None = BLOCK
    consensus_step: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"Quantize takes 2 to 8 bits per element (1 bit is Sign()), got bits={self.bits!r}.")
        _check_block(self.block)
        if self.consensus_step is None:  # measured: docs/benchmarks.md, "Compressed gossip"
            object.__setattr__(self, "consensus_step", 1.0 if self.bits >= 4 else 0.3)

    @property
    def levels(self) -> int:
        """`L`: the largest code magnitude."""
        return 2 ** (self.bits - 1) - 1

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _blocks(numel, self.block) * SCALE.itemsize + packed_bytes(numel, self.bits)

    def compress(self, v: Tensor, seed: int) -> Tensor:
        scales = (_per_block(v, self.block, lambda rows: rows.abs().amax(1)) / self.levels).to(SCALE)
        inverse = scales.to(v.dtype)
        inverse = torch.where(inverse > 0, 1 / torch.where(inverse > 0, inverse, 1), 0)  # a zero block: codes 0
        codes = (
            _scale_blocks_(v.clone(), inverse, self.block).round_().clamp_(-self.levels, self.levels).add_(self.levels)
        )
        return torch.cat([scales.view(torch.uint8), pack_bits(codes, self.bits)])

    def decompress(self, payload: Tensor, numel: int, dtype: torch.dtype, seed: int) -> Tensor:
        blocks = _blocks(numel, self.block)
        scales = as_dtype(payload[: blocks * SCALE.itemsize], SCALE).to(dtype)
        codes = unpack_bits(payload[blocks * SCALE.itemsize :], numel, self.bits).to(dtype).sub_(self.levels)
        return _scale_blocks_(codes, scales, self.block)


def kept(numel: int, fraction: float) -> int:
    """`k`, the coordinates a sparsifier keeps of `numel`: `fraction · numel` rounded, at least 1.

    Examples:
        >>> kept(1000, 0.01), kept(10, 0.01), kept(7, 1.0)
        (10, 1, 7)
    """
    return min(numel, max(1, int(fraction * numel + 0.5)))


def _index_bits(numel: int) -> int:
    """Bits of an index below `numel`."""
    return max(1, (numel - 1).bit_length())


def _check_fraction(name: str, fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{name} keeps a fraction of the coordinates in (0, 1], got {fraction!r}.")


def _scatter(values: Tensor, indices: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    dense = torch.zeros(numel, dtype=dtype, device=values.device)
    return dense.index_copy_(0, indices, values.to(dtype))


_KEY_INTEGERS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits as an integer of its width


def magnitude_keys(v: Tensor) -> Tensor:
    """`key(v_j)`: the bits of `|v_j|` as an integer (of `v`'s width), which order as the magnitudes do, every NaN
    mapped to the one key above `+inf`'s. `−0.0` and `+0.0` share the key 0.

    Examples:
        >>> magnitude_keys(torch.tensor([1.0, -1.0, -0.0, float("inf"), float("nan")])).tolist()
        [1065353216, 1065353216, 0, 2139095040, 2139095041]
    """
    integer = _KEY_INTEGERS.get(v.element_size()) if v.is_floating_point() else None
    if integer is None:
        raise ValueError(f"TopK compresses float16, bfloat16, float32 or float64 tensors, got {v.dtype}.")
    nan = torch.tensor(math.inf, dtype=v.dtype).view(integer).item() + 1
    return v.view(integer).bitwise_and(torch.iinfo(integer).max).clamp_max_(nan)


def largest(v: Tensor, k: int) -> Tensor:
    """The `k` coordinates [`TopK`][lightning_decentral.compression.TopK] keeps of `v` (int64, ascending): with
    `key(v_j)` the bits of `|v_j|` as an integer, every NaN one key above `+inf` (`magnitude_keys`), and `t` the
    `k`-th largest key, every `j` with `key(v_j) > t`, then those with `key(v_j) = t` in ascending order until `k`
    are kept. Among equal magnitudes the positions alone decide, so every implementation (the torch operations here,
    on any device; the C kernel's linear-time selection) keeps the same coordinates.

    Examples:
        >>> largest(torch.tensor([0.5, -2.0, 2.0, float("nan"), 0.0, -0.5]), 3).tolist()
        [1, 2, 3]
        >>> largest(torch.tensor([0.5, -2.0, 2.0, 1.0, 0.0, -0.5]), 4).tolist()   # one of the two 0.5s: the first
        [0, 1, 2, 3]
    """
    keys = magnitude_keys(v)
    threshold = keys.kthvalue(len(keys) - k + 1).values
    keep = keys > threshold
    ties = torch.nonzero(keys == threshold).view(-1)[: k - int(keep.count_nonzero())]
    return torch.nonzero(keep.index_fill_(0, ties, True)).view(-1)


@dataclass(frozen=True)
class TopK:
    """`C(v)` keeps the `k` coordinates of largest magnitude (`k = fraction · numel`, at least 1; among equal
    magnitudes the first, a NaN above `inf`: [`largest`][lightning_decentral.compression.largest]):
    their values in `v`'s dtype, then their indices packed in `⌈log2 numel⌉` bits each, both in ascending index order.

    Examples:
        >>> top = TopK(0.5)
        >>> v = torch.tensor([0.1, -4.0, 3.0, 0.2])
        >>> payload = top.compress(v, seed=0)
        >>> len(payload), top.payload_bytes(4, torch.float32)   # 2 float32 values + 2 indices of 2 bits
        (9, 9)
        >>> top.decompress(payload, 4, torch.float32, seed=0).tolist()
        [0.0, -4.0, 3.0, 0.0]
    """

    fraction: float = 0.01
    consensus_step: float | None = None

    def __post_init__(self) -> None:
        _check_fraction("TopK", self.fraction)
        if self.consensus_step is None:  # measured: docs/benchmarks.md, "Compressed gossip"
            object.__setattr__(self, "consensus_step", float(f"{min(1.0, 3 * self.fraction):.12g}"))

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        k = kept(numel, self.fraction)
        return k * dtype.itemsize + packed_bytes(k, _index_bits(numel))

    def compress(self, v: Tensor, seed: int) -> Tensor:
        indices = largest(v, kept(len(v), self.fraction))
        return torch.cat([v[indices].view(torch.uint8), pack_bits(indices, _index_bits(len(v)))])

    def decompress(self, payload: Tensor, numel: int, dtype: torch.dtype, seed: int) -> Tensor:
        k = kept(numel, self.fraction)
        values = as_dtype(payload[: k * dtype.itemsize], dtype)
        return _scatter(values, unpack_bits(payload[k * dtype.itemsize :], k, _index_bits(numel)).long(), numel, dtype)


@dataclass(frozen=True)
class RandomK:
    """`C(v)` keeps `k` coordinates drawn from `seed` (`k = fraction · numel`, at least 1), one uniformly from each
    of `k` consecutive strata of (nearly) equal size: only their values travel, both ends draw the same
    coordinates. Every coordinate is kept with probability about `k / numel`, so `E‖C(v) − v‖² ≈ (1 − k/numel)‖v‖²`.
    The draw runs on the CPU (the same coordinates on any device) and costs `O(k)`.

    Examples:
        >>> rand = RandomK(0.5)
        >>> v = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> payload = rand.compress(v, seed=7)
        >>> len(payload), rand.payload_bytes(4, torch.float32)   # 2 float32 values, no index
        (8, 8)
        >>> q = rand.decompress(payload, 4, torch.float32, seed=7)
        >>> int((q != 0).sum()), bool(((q == v) | (q == 0)).all())
        (2, True)
    """

    fraction: float = 0.01
    seed: int = 0
    consensus_step: float | None = None

    def __post_init__(self) -> None:
        _check_fraction("RandomK", self.fraction)
        if self.consensus_step is None:  # measured: docs/benchmarks.md, "Compressed gossip"
            object.__setattr__(self, "consensus_step", self.fraction)

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return kept(numel, self.fraction) * dtype.itemsize

    def indices(self, numel: int, seed: int, device: torch.device) -> Tensor:
        """The coordinates kept at `seed`: `⌊j·numel/k⌋ + ⌊u_j · (⌊(j+1)·numel/k⌋ − ⌊j·numel/k⌋)⌋`, `u_j` uniform."""
        k = kept(numel, self.fraction)
        generator = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + seed) % 2**63)
        bounds = torch.arange(k + 1, dtype=torch.int64) * numel // k
        offsets = (torch.rand(k, generator=generator, dtype=torch.float64) * (bounds[1:] - bounds[:-1])).long()
        return (bounds[:-1] + offsets).to(device)

    def compress(self, v: Tensor, seed: int) -> Tensor:
        return v[self.indices(len(v), seed, v.device)].view(torch.uint8)

    def decompress(self, payload: Tensor, numel: int, dtype: torch.dtype, seed: int) -> Tensor:
        return _scatter(as_dtype(payload, dtype), self.indices(numel, seed, payload.device), numel, dtype)


NAMES = ("sign", "int8", "int4", "top_k:<fraction>", "random_k:<fraction>")
"""The compressors by name ([`resolve_compression`][lightning_decentral.compression.resolve_compression])."""

CompressionArgument = str | Compressor | None
"""What `compression=` takes: a name of `NAMES` (also `"int2"` … `"int8"`), a `Compressor`, or `None`."""


def resolve_compression(spec: CompressionArgument) -> Compressor | None:
    """The compressor `spec` names: `None` (no compression), a name of `NAMES`, or a `Compressor` as it is.

    Examples:
        >>> resolve_compression("top_k:0.01"), resolve_compression("int4")
        (TopK(fraction=0.01, consensus_step=0.03), Quantize(bits=4, block=1024, consensus_step=1.0))
        >>> resolve_compression("top-k")
        Traceback (most recent call last):
        ...
        ValueError: `compression` must be None, one of 'sign', 'int8', 'int4', 'top_k:<fraction>', ...
    """
    if spec is None or isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "sign":
            return Sign()
        match = re.fullmatch(r"int([2-8])|(top_k|random_k):([0-9.eE+-]+)", name)
        if match and match.group(1):
            return Quantize(bits=int(match.group(1)))
        if match:
            try:
                fraction = float(match.group(3))
            except ValueError:
                fraction = math.nan
            return (TopK if match.group(2) == "top_k" else RandomK)(fraction)
    raise ValueError(
        f"`compression` must be None, one of {', '.join(repr(n) for n in NAMES)} (also 'int2' to 'int8'; a fraction "
        f"in (0, 1], e.g. 'top_k:0.01'), or a Compressor such as Sign(), Quantize(bits=4), TopK(0.01), RandomK(0.01); "
        f"got {spec!r}."
    )
