"""The CHOCO arithmetic of the built-in compressors, fused and in chunks: what
[`ChocoExchange`][lightning_decentral.compression.ChocoExchange] runs instead of `compress` and `decompress`.

A round of CHOCO gossip asks of a compressor, per out-edge copy and per in-edge copy (docs/algorithms.md, "Compressed
gossip (CHOCO)"):

```text
encode_update_(C, x, x̂, seed, payload)    payload <- C(x − x̂),  x̂ += C(x − x̂)       (the sender)
decode_add_(C, payload, x̂, seed)          x̂ += C(payload)                           (the receiver)
```

Done with `compress` and `decompress` that is about ten passes over model-sized memory (the difference, the scales,
the signs or codes, the packing, a dense `C(v)`, its sum into `x̂`), most of them through fresh model-sized
temporaries whose pages the kernel must first zero. Here the dense compressors
([`Sign`][lightning_decentral.compression.Sign], [`Quantize`][lightning_decentral.compression.Quantize]) run every
step on one chunk of `CHUNK` elements (whole blocks, so a chunk's scales are its own) before the next chunk: the
chunk's difference, scale, codes and update stay in a core's cache and the scratch is allocated once per call; the
sparse ones ([`TopK`][lightning_decentral.compression.TopK], [`RandomK`][lightning_decentral.compression.RandomK])
add their `k` values into `x̂` where they belong instead of adding a dense `C(v)` that is zero elsewhere, and
`RandomK` reads only its `k` coordinates of `x − x̂`. On a GPU chunks are large (each operation is one
kernel launch: chunks of `DEVICE_CHUNK` elements, 64M).

Every element goes through the operations `compress` then `decompress` apply to it, in the same order and dtype,
so the payload bytes and the copies are the same (the sparse compressors leave `x̂` untouched where `C(v)` is zero;
the dense sum would turn a `−0.0` there into `+0.0`, which compares equal). One caveat: with several torch threads a
`Sign` block sum over a chunk of few rows may be split across threads where the whole buffer's is not (blocks of
tens of thousands of elements), so a scale can differ from `compress`'s in the last bit, as `compress`'s own already
differs from one thread count to another; both ends read the scale from the payload, so they always agree.

A compressor of another type (a [`Compressor`][lightning_decentral.compression.Compressor] of your own, or a
`block=None` one, whose single scale needs the whole buffer first) goes through its `compress` and `decompress`.

The fusing is done with chunked torch operations writing into preallocated scratch (`out=`, in-place), not
`torch.compile`: compiling the sign path took ~20 s per buffer size on this project's CPU machine, ran slower than
the eager operations, and reduced the block norms in another order (scales that differ in the last bit: not the
reference's bytes). Where the C kernel is built and the buffers are contiguous float32 on the CPU, each call here
first hands its work to it ([`native`][lightning_decentral.compression.native]: one pass over memory per block, the
same bytes and copies bit for bit); these torch operations run everywhere else (CUDA, float64 copies, bf16 models,
no kernel) and are what the kernel is tested against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_decentral.compression import native
from lightning_decentral.compression.bits import FOLDED, fold_bytes_, pack_bits, spread_bytes, unpack_bits
from lightning_decentral.compression.compressors import (
    SCALE,
    Compressor,
    Quantize,
    RandomK,
    Sign,
    TopK,
    _blocks,
    _index_bits,
    _width,
    as_dtype,
    kept,
    l1_mean,
    largest,
)

CHUNK = 1 << 18
"""Elements per chunk on the CPU (rounded to whole blocks): 1 MB a buffer in float32, a chunk's few buffers within a
core's L2 cache or near it. Measured with benchmarks/compressor_arithmetic.py at 5.26M elements: 2^16 to 2^20 alike,
2^14 slower (the per-operation overhead), the whole buffer in one chunk slower still (`sign` 1.8×)."""


DEVICE_CHUNK = 1 << 26
"""Elements per chunk on a GPU: each operation is one kernel launch over a chunk, so chunks are large (a buffer of up
to 64M elements is one chunk); the limit only bounds the scratch (256 MB a buffer in float32)."""


def chunk_size(numel: int, device: torch.device, align: int, chunk: int | None = None) -> int:
    """The elements of one chunk of a `numel`-element buffer on `device`: a multiple of `align` near `chunk`
    (`CHUNK` on the CPU, `DEVICE_CHUNK` elsewhere, by default)."""
    chunk = chunk or (CHUNK if device.type == "cpu" else DEVICE_CHUNK)
    return max(align, chunk // align * align)


def fused(compressor: Compressor, numel: int) -> bool:
    """Whether `compressor` has fused arithmetic here for a buffer of `numel` elements."""
    if isinstance(compressor, (Sign, Quantize)):
        return compressor.block is not None or numel <= 1
    return isinstance(compressor, (TopK, RandomK))


def encode_update_(
    compressor: Compressor,
    x: Tensor,
    copy: Tensor,
    seed: int,
    payload: Tensor,
    work: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """`payload <- C(x − x̂)` (uint8, `payload_bytes(numel, x̂.dtype)` bytes) and `x̂ += C(x − x̂)`, in place;
    returns `payload`. `x` and `x̂` are flat; `work` (a flat buffer of `x̂`'s size and dtype) is scratch for the
    compressors that need a whole difference (`TopK`, and any other compressor's `compress`); `chunk`: elements per
    chunk on the CPU (default `CHUNK`).

    Examples:
        >>> sign, x, copy = Sign(block=4), torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, 0.5]), torch.zeros(6)
        >>> payload = encode_update_(sign, x, copy, 0, torch.empty(9, dtype=torch.uint8))
        >>> torch.equal(payload, sign.compress(x, 0)), copy.tolist()
        (True, [2.0, -2.0, 2.0, -2.0, 0.5, 0.5])
    """
    numel = copy.numel()
    if not fused(compressor, numel):
        difference = torch.sub(x, copy, out=work if work is not None else torch.empty_like(copy))
        payload.copy_(compressor.compress(difference, seed))
        copy.add_(compressor.decompress(payload, numel, copy.dtype, seed))
    elif isinstance(compressor, (Sign, Quantize)):
        if not native.dense_encode_update_(compressor, x, copy, payload):
            _Dense(compressor, numel, copy, chunk).encode(x, payload)
    elif isinstance(compressor, TopK):
        k = kept(numel, compressor.fraction)
        itemsize = copy.dtype.itemsize
        indices = native.top_k_indices(x, copy, k)
        if indices is None:
            indices = largest(torch.sub(x, copy, out=work if work is not None else torch.empty_like(copy)), k)
        if native.sparse_encode_update_(x, copy, indices, payload, _index_bits(numel)):
            return payload
        aligned = payload.storage_offset() % itemsize == 0  # the values can be written into the payload directly
        values = torch.sub(x[indices], copy[indices], out=payload[: k * itemsize].view(copy.dtype) if aligned else None)
        if not aligned:
            payload[: k * itemsize].copy_(values.view(torch.uint8))
        pack_bits(indices, _index_bits(numel), out=payload[k * itemsize :])
        copy.index_add_(0, indices, values)
    else:
        assert isinstance(compressor, RandomK)
        indices = compressor.indices(numel, seed, copy.device)
        if not native.sparse_encode_update_(x, copy, indices, payload):
            values = torch.sub(x[indices], copy[indices])
            payload.copy_(values.view(torch.uint8))
            copy.index_add_(0, indices, values)
    return payload


def decode_add_(compressor: Compressor, payload: Tensor, copy: Tensor, seed: int, chunk: int | None = None) -> Tensor:
    """`x̂ += C` for the `C` of `payload` (what `decompress` returns), in place; returns `x̂` (`chunk` as in
    [`encode_update_`][lightning_decentral.compression.fused.encode_update_]).

    Examples:
        >>> sign, copy = Sign(block=4), torch.ones(6)
        >>> payload = sign.compress(torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, 0.5]), seed=0)
        >>> decode_add_(sign, payload, copy, seed=0).tolist()
        [3.0, -1.0, 3.0, -1.0, 1.5, 1.5]
    """
    numel = copy.numel()
    if not fused(compressor, numel):
        return copy.add_(compressor.decompress(payload, numel, copy.dtype, seed))
    if isinstance(compressor, (Sign, Quantize)):
        if not native.dense_decode_add_(compressor, payload, copy):
            _Dense(compressor, numel, copy, chunk).decode_add(payload)
        return copy
    k = kept(numel, compressor.fraction)
    itemsize = copy.dtype.itemsize
    if isinstance(compressor, TopK):
        if native.sparse_decode_add_(payload, copy, k, index_bits=_index_bits(numel)):
            return copy
        indices = unpack_bits(payload[k * itemsize :], k, _index_bits(numel)).long()
    else:
        assert isinstance(compressor, RandomK)
        indices = compressor.indices(numel, seed, copy.device)
        if native.sparse_decode_add_(payload, copy, k, indices):
            return copy
    return copy.index_add_(0, indices, as_dtype(payload[: k * itemsize], copy.dtype))


class _Dense:
    """One call's chunked arithmetic of `Sign` or `Quantize` on a buffer of `numel` elements whose copy is `copy`:
    the payload's layout (`blocks` float32 scales, then the packed codes) and the scratch of one chunk."""

    def __init__(self, compressor: Sign | Quantize, numel: int, copy: Tensor, chunk: int | None = None) -> None:
        self.compressor = compressor
        self.numel = numel
        self.copy = copy
        self.dtype = copy.dtype
        self.bits = 1 if isinstance(compressor, Sign) else compressor.bits
        self.width = _width(numel, compressor.block)
        self.blocks = _blocks(numel, compressor.block)
        self.chunk = chunk_size(numel, copy.device, math.lcm(self.width, 8), chunk)
        size = min(self.chunk, numel)
        self.values = copy.new_empty(size)  # x − x̂, then the codes, then C(v), of one chunk
        self.scratch = copy.new_empty(size)  # |x − x̂| of one chunk
        self.codes = torch.empty(size + 8, dtype=torch.uint8, device=copy.device)  # one byte per code (whole words)

    def ranges(self):
        for start in range(0, self.numel, self.chunk):
            stop = min(start + self.chunk, self.numel)
            yield start, stop, start // self.width, -(-stop // self.width)

    def rows(self, chunk: Tensor) -> tuple[Tensor, Tensor | None]:
        """`chunk` as rows of one block each, and the shorter last block (`None` when there is none)."""
        full = len(chunk) // self.width * self.width
        return chunk[:full].view(-1, self.width), (chunk[full:] if full < len(chunk) else None)

    def scale_rows_(self, chunk: Tensor, scales: Tensor) -> None:
        """`chunk *= scales[b]` on each block `b` of the chunk (what `_scale_blocks_` does to the whole buffer)."""
        rows, tail = self.rows(chunk)
        rows.mul_(scales[: len(rows), None])
        if tail is not None:
            tail.mul_(scales[-1])

    def encode(self, x: Tensor, payload: Tensor) -> None:
        compressor = self.compressor
        scale_bytes = self.blocks * SCALE.itemsize
        for start, stop, first, last in self.ranges():
            values = torch.sub(x[start:stop], self.copy[start:stop], out=self.values[: stop - start])
            rows, tail = self.rows(values)
            parts = [p for p in (rows, None if tail is None else tail[None]) if p is not None and p.numel()]
            scratch = self.scratch[: stop - start]
            if isinstance(compressor, Sign):  # s_b = ‖v_b‖₁ / |b|
                reduced = [l1_mean(p, scratch[: p.numel()].view_as(p)) for p in parts]
            else:  # s_b = max|v_b| / L
                reduced = [torch.abs(p, out=scratch[: p.numel()].view_as(p)).amax(1) for p in parts]
            scales = torch.cat(reduced) if len(reduced) > 1 else reduced[0]
            if isinstance(compressor, Quantize):
                scales = scales / compressor.levels
            scales = scales.to(SCALE)
            payload[first * SCALE.itemsize : last * SCALE.itemsize].copy_(scales.view(torch.uint8))
            decoded = scales.to(self.dtype)  # what the receiver reads
            codes = self.codes[: stop - start + (-(stop - start) % 8)]
            if isinstance(compressor, Sign):
                torch.ge(values, 0, out=codes[: stop - start].view(torch.bool))
                codes[stop - start :].zero_()
                signs = torch.mul(codes[: stop - start], 2, out=values).sub_(1)  # ±1, as decompress reads them
                self.scale_rows_(signs, decoded)
            else:
                levels = compressor.levels
                inverse = torch.where(decoded > 0, 1 / torch.where(decoded > 0, decoded, 1), 0)
                self.scale_rows_(values, inverse)
                values.round_().clamp_(-levels, levels).add_(levels)  # the codes, as floats
                codes[: stop - start].copy_(values)
                codes[stop - start :].zero_()
                self.scale_rows_(values.sub_(levels), decoded)
            self._pack(codes, payload[scale_bytes + start * self.bits // 8 :], stop - start)
            self.copy[start:stop].add_(values)

    def _pack(self, codes: Tensor, out: Tensor, count: int) -> None:
        size = -(-count * self.bits // 8)
        if self.bits == 8:
            out[:size].copy_(codes[:count])
        elif self.bits in FOLDED:
            fold_bytes_(codes, self.bits, out[:size])
        else:
            pack_bits(codes[:count], self.bits, out=out[:size])

    def decode_add(self, payload: Tensor) -> None:
        compressor = self.compressor
        scale_bytes = self.blocks * SCALE.itemsize
        scales = as_dtype(payload[:scale_bytes], SCALE).to(self.dtype)
        for start, stop, first, last in self.ranges():
            count = stop - start
            packed = payload[scale_bytes + start * self.bits // 8 : scale_bytes + -(-stop * self.bits // 8)]
            if self.bits in FOLDED:
                codes = spread_bytes(packed, self.bits, out=self.codes[: len(packed) * 8 // self.bits])[:count]
            else:
                codes = unpack_bits(packed, count, self.bits)
            values = self.values[:count]
            if isinstance(compressor, Sign):
                torch.mul(codes, 2, out=values).sub_(1)
            else:
                values.copy_(codes).sub_(compressor.levels)
            self.scale_rows_(values, scales[first:last])
            self.copy[start:stop].add_(values)
