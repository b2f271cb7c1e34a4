"""The CHOCO arithmetic of the built-in compressors as one small C kernel (`_kernels.c`), where it is built and the
buffers are contiguous float32 on the CPU: what [`fused`][lightning_decentral.compression.fused] calls first.

Per block of a dense compressor ([`Sign`][lightning_decentral.compression.Sign],
[`Quantize`][lightning_decentral.compression.Quantize]) the kernel reads `x` and `x̂` once for the scale (the block
is then in L1), and once more to write the codes and `x̂ += C(x − x̂)`, packing the codes behind the scales as it goes:
two passes over the block, one over memory, no scratch beyond a block's codes. The receiver's `x̂ += C` is one pass,
or, in `ChocoExchange`'s combine, part of the combine's pass (each tile of the received copy decoded just before it
is combined, while in cache: [`combine_`][lightning_decentral.compression.native.combine_] with `decode`).
The sparse compressors ([`TopK`][lightning_decentral.compression.TopK],
[`RandomK`][lightning_decentral.compression.RandomK]) gather `x[i] − x̂[i]` into the payload, pack `TopK`'s indices
and add the values into `x̂` in one loop over the `k` coordinates. `TopK`'s selection
([`top_k_indices`][lightning_decentral.compression.native.top_k_indices]) is linear in `n`: a sample of 4096
magnitudes spread over the buffer gives a guess at a lower bound of the `k`-th largest; one pass over `x` and `x̂`
collects the coordinates at or above it (about `1.8 k` at `k = n / 100`), in ascending order; the `k`-th largest is
selected among them exactly (a radix select on integer keys: the bits of `|v|`, every NaN one key above `+inf`), and
the kept coordinates are read off in order, ties by position, as
[`largest`][lightning_decentral.compression.largest] defines them. Where the guess fails (fewer than `k` reach it,
or many ties at it, as in a buffer of zeros) the radix select runs over `x` and `x̂` themselves (three more passes).
`RandomK.indices` stay torch's (its generator). The combine of `ChocoExchange`, `γ Σ_i w_i t_i` written to or
added into its target, is one pass over tiles of 1024 elements
([`combine_`][lightning_decentral.compression.native.combine_]).

Why C and not torch: the torch path (`fused._Dense`) is already chunked and in place, yet each of its ~10 operations
is a pass over the chunk with its own dispatch, and `torch.compile` was slower than eager and summed the blocks in
another order (docs/benchmarks.md, "Compressed exchange against the compute floor"). Why plain C and not a torch
extension: no torch headers, so it compiles in about a second with any C compiler and builds with `pip install`
(setup.py: optional, the package installs without it); it is called on `data_ptr()`s. No `-march=native`: GCC's
`target_clones` builds the loops for AVX2 and for the x86-64 baseline, the loader picking one. No OpenMP: the step
runs one thread per worker (the benchmarks' setting), and the exchange's thread runs beside forward and backward: the
kernel releases the GIL.

Equality with the torch path, bit for bit (tests/test_native_kernel.py): the kernel applies each element's float32
operations in the torch path's order, compiled without FMA contraction and fast-math. Two results depend on how
torch computes, and each is checked once against torch, the torch path running where it differs: `Sign`'s `Σ|v|` of
a block follows torch's CPU summation (a cascade of 4 × 4 accumulators of `lanes`-wide vectors,
aten/src/ATen/native/cpu/SumKernel.cpp; `lanes` found on a probe,
[`sum_lanes`][lightning_decentral.compression.native.sum_lanes]: 8 on this project's x86 machine under every
`ATEN_CPU_CAPABILITY`); and the combine's `add_(alpha=)`, a fused multiply-add in torch's vector kernels
([`combine_matches_torch`][lightning_decentral.compression.native.combine_matches_torch]). `Quantize`'s `max|v|`
needs no order, nor `TopK`'s selection (its rule fixes the coordinates and their order by the values and positions
alone). A NaN gives the code torch's conversion gives (0).

Off: `LIGHTNING_DECENTRAL_NATIVE=0` in the environment, or
[`enable(False)`][lightning_decentral.compression.native.enable] (the benchmark's A/B); without the built module
([`AVAILABLE`][lightning_decentral.compression.native.AVAILABLE] false) every call returns `False` and the torch path
runs.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from lightning_decentral.compression.bits import packed_bytes
from lightning_decentral.compression.compressors import Compressor, Quantize, Sign, _width

try:
    import lightning_decentral.compression._kernels as _kernels
except ImportError:  # not built (no compiler at install, or a source tree without `build_ext --inplace`)
    _kernels = None

AVAILABLE = _kernels is not None
"""Whether the C kernel is built and importable here."""

_state = {"enabled": AVAILABLE and os.environ.get("LIGHTNING_DECENTRAL_NATIVE", "1") != "0"}

LANES = (16, 8, 4, 1)
"""The vector widths (float32 lanes) of torch's CPU sum that `sum_lanes` tries."""


def enable(flag: bool) -> bool:
    """Use the kernel (`True`, where `AVAILABLE`) or the torch path from now on; returns the previous setting.

    Examples:
        >>> previous = enable(False)
        >>> enabled()
        False
        >>> _ = enable(previous)
    """
    previous = _state["enabled"]
    _state["enabled"] = bool(flag) and AVAILABLE
    return previous


def enabled() -> bool:
    """Whether the kernel runs where it applies."""
    return _state["enabled"]


def runs_on(*tensors: Tensor) -> bool:
    """Whether the kernel takes `tensors` (the float buffers of one call): enabled, and each contiguous float32 on the
    CPU."""
    return enabled() and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


@functools.cache
def sum_lanes() -> int | None:
    """The vector width of torch's float32 sum on this CPU, as `Sign`'s scales show it: the first of `LANES` with which
    the kernel's scales equal `Sign.compress`'s on a probe of several block widths (`None`: none does; `Sign` stays
    on the torch path)."""
    if not AVAILABLE:
        return None
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(30001, generator=generator) * torch.rand(30001, generator=generator).pow(8) * 1e3
    with torch.inference_mode():  # widths below 32768: torch sums each block on one thread
        for lanes in LANES:
            if all(_probe_agrees(Sign(block=width), probe, lanes) for width in (30001, 4099, 1024, 999, 100, 13, 3)):
                return lanes
    return None


def _probe_agrees(sign: Sign, probe: Tensor, lanes: int) -> bool:
    numel = probe.numel()
    expected = sign.compress(probe, 0)
    copy, payload = torch.zeros_like(probe), torch.empty_like(expected)
    _kernels.dense_encode(
        probe.data_ptr(), copy.data_ptr(), payload.data_ptr(), numel, _width(numel, sign.block), 1, lanes
    )
    return torch.equal(payload, expected)


def _bits(compressor: Sign | Quantize) -> int:
    return 1 if isinstance(compressor, Sign) else compressor.bits


def _dense_applies(compressor: Sign | Quantize, numel: int, *tensors: Tensor) -> bool:
    return (
        runs_on(*tensors)
        and (compressor.block is not None or numel <= 1)
        and (isinstance(compressor, Quantize) or sum_lanes() is not None)
    )


def dense_encode_update_(compressor: Sign | Quantize, x: Tensor, copy: Tensor, payload: Tensor) -> bool:
    """`payload <- C(x − x̂)`, `x̂ += C(x − x̂)` for `Sign` or `Quantize` (flat `x` and `x̂ = copy`, a contiguous uint8
    `payload` of `payload_bytes` bytes at any offset), if the kernel applies; returns whether it ran."""
    numel = copy.numel()
    if not (_dense_applies(compressor, numel, x, copy) and _is_bytes(payload)):
        return False
    _check_sizes(compressor, x, copy, payload)
    lanes = sum_lanes() or 1
    width = _width(numel, compressor.block)
    _kernels.dense_encode(x.data_ptr(), copy.data_ptr(), payload.data_ptr(), numel, width, _bits(compressor), lanes)
    return True


def dense_decode_add_(compressor: Sign | Quantize, payload: Tensor, copy: Tensor) -> bool:
    """`x̂ += C` for the `C` of a `Sign` or `Quantize` payload, if the kernel applies; returns whether it ran."""
    numel = copy.numel()
    if not (_dense_applies(compressor, numel, copy) and _is_bytes(payload)):
        return False
    _check_sizes(compressor, copy, copy, payload)
    _kernels.dense_decode(
        payload.data_ptr(), copy.data_ptr(), numel, _width(numel, compressor.block), _bits(compressor)
    )
    return True


def top_k_indices(x: Tensor, copy: Tensor, k: int) -> Tensor | None:
    """[`largest`][lightning_decentral.compression.largest]`(x − x̂, k)`, `TopK`'s `k` indices in ascending order, in
    one pass over `x` and `x̂` (a sample's guess at the `k`-th largest magnitude, then an exact selection among the
    magnitudes above it), where `1 <= k <= numel < 2^31` and the kernel applies (`None` if not)."""
    numel = copy.numel()
    if not (runs_on(x, copy) and x.numel() == numel and 1 <= k <= numel < 2**31):
        return None
    indices = torch.empty(k, dtype=torch.int64)
    _kernels.top_k(x.data_ptr(), copy.data_ptr(), numel, k, indices.data_ptr())
    return indices


@functools.cache
def combine_matches_torch() -> bool:
    """Whether the kernel's `γ Σ_i w_i t_i` equals torch's `mul`, `add_(alpha=)`, `mul_` on a probe (torch's vector
    `add` with `alpha` is a fused multiply-add where the CPU has one, as the kernel's; else the torch path combines)."""
    if not AVAILABLE:
        return False
    generator = torch.Generator().manual_seed(0)
    terms = [torch.randn(4099, generator=generator) for _ in range(3)]
    weights, gamma = [0.3, -0.7, 0.1 / 3], 0.37
    expected = torch.mul(terms[0], weights[0])
    for term, weight in zip(terms[1:], weights[1:]):
        expected.add_(term, alpha=weight)
    expected.mul_(gamma)
    out = torch.empty_like(expected)
    _kernels.combine(out.data_ptr(), [t.data_ptr() for t in terms], weights, gamma, False, out.numel())
    return torch.equal(out, expected)


def combine_(
    target: Tensor,
    terms: list[tuple[Tensor, float]],
    gamma: float,
    add: bool,
    decode: tuple[Compressor, list[tuple[Tensor, Tensor]]] | None = None,
) -> bool:
    """`target = γ Σ_i w_i t_i` (`add`: `target += …`) over the flat `(t_i, w_i)` of `terms`, in one pass, bit for
    bit `torch.mul(t_0, w_0)`, `.add_(t_i, alpha=w_i)`, `.mul_(γ)` (unless `γ = 1`) and the write or `add_`, where
    the kernel applies; returns whether it ran. `decode = (compressor, [(payload, copy), …])`: each `copy` (a term)
    first takes `x̂ += C` of its `Sign` or `Quantize` payload, as `dense_decode_add_` would, tile by tile in the same
    pass (each copy read and written once instead of twice); where that does not apply nothing runs (`False`)."""
    tensors = [target, *(t for t, _ in terms)]
    if not (runs_on(*tensors) and all(t.numel() == target.numel() for t in tensors) and combine_matches_torch()):
        return False
    numel, pointers, weights = target.numel(), [t.data_ptr() for t, _ in terms], [float(w) for _, w in terms]
    if decode is None:
        _kernels.combine(target.data_ptr(), pointers, weights, float(gamma), add, numel)
        return True
    compressor, received = decode
    if not (
        isinstance(compressor, (Sign, Quantize))
        and all(_dense_applies(compressor, numel, copy) and _is_bytes(payload) for payload, copy in received)
    ):
        return False
    for payload, copy in received:
        _check_sizes(compressor, copy, copy, payload)
    payloads, copies = [p.data_ptr() for p, _ in received], [c.data_ptr() for _, c in received]
    width, bits = _width(numel, compressor.block), _bits(compressor)
    _kernels.combine(target.data_ptr(), pointers, weights, float(gamma), add, numel, payloads, copies, width, bits)
    return True


def sparse_encode_update_(x: Tensor, copy: Tensor, indices: Tensor, payload: Tensor, index_bits: int = 0) -> bool:
    """`v = x[i] − x̂[i]` at `indices` (distinct int64) written as float32 to the start of `payload`, `x̂[i] += v`,
    and (`index_bits > 0`) the indices packed behind the values; if the kernel applies, returns whether it ran."""
    if not (runs_on(x, copy) and _is_bytes(payload) and indices.dtype == torch.int64 and indices.is_contiguous()):
        return False
    k = indices.numel()
    if x.numel() != copy.numel():
        raise ValueError(f"x has {x.numel()} elements, its public copy {copy.numel()}.")
    _check_size(payload, k, index_bits)
    packed = payload[4 * k :].data_ptr() if index_bits else 0
    _kernels.sparse_encode(x.data_ptr(), copy.data_ptr(), indices.data_ptr(), k, payload.data_ptr(), packed, index_bits)
    return True


def sparse_decode_add_(
    payload: Tensor, copy: Tensor, k: int, indices: Tensor | None = None, index_bits: int = 0
) -> bool:
    """`x̂[i] += v` for the `k` float32 values at the start of `payload`, at `indices` (int64) or else at the `k`
    indices packed behind them in `index_bits` bits each, if the kernel applies; returns whether it ran."""
    if not (runs_on(copy) and _is_bytes(payload)):
        return False
    if indices is not None and not (indices.dtype == torch.int64 and indices.is_contiguous()):
        return False
    _check_size(payload, k, 0 if indices is not None else index_bits)
    index_pointer = indices.data_ptr() if indices is not None else 0
    packed = payload[4 * k :].data_ptr() if indices is None else 0
    _kernels.sparse_decode(payload.data_ptr(), copy.data_ptr(), copy.numel(), k, index_pointer, packed, index_bits)
    return True


def _check_sizes(compressor: Sign | Quantize, x: Tensor, copy: Tensor, payload: Tensor) -> None:
    """Refuse buffers the kernel would read or write past: `x` and `x̂` of one size, a payload of the message's."""
    numel, size = copy.numel(), compressor.payload_bytes(copy.numel(), copy.dtype)
    if x.numel() != numel or payload.numel() < size:
        raise ValueError(
            f"{compressor!r} of {x.numel()} elements into a copy of {numel}: a payload of {size} bytes, "
            f"got {payload.numel()}."
        )


def _check_size(payload: Tensor, k: int, index_bits: int) -> None:
    if payload.numel() < 4 * k + packed_bytes(k, index_bits):
        raise ValueError(f"A payload of {payload.numel()} bytes is short of {k} values and {index_bits}-bit indices.")


def _is_bytes(payload: Tensor) -> bool:
    return payload.device.type == "cpu" and payload.dtype == torch.uint8 and payload.is_contiguous()
