"""The C kernel of the compressed exchange (``lightning_decentral.compression.native``) against the torch path it
replaces: the same payload bytes and the same sent and received copies, bit for bit, for every built-in compressor
on buffers of many sizes (ragged last blocks, a block wider than the buffer, cascades of several levels in ``Sign``'s
sums), at odd payload offsets, and on the values that test the rules (zeros of both signs, zero blocks, NaN, inf,
subnormal differences). Skipped where the kernel is not built (``python setup.py build_ext --inplace``)."""

from __future__ import annotations

import itertools
import platform

import pytest
import torch

from lightning_decentral.compression import (
    Choco,
    ChocoExchange,
    Quantize,
    RandomK,
    Sign,
    TopK,
    exchange_in_process,
    largest,
    native,
)
from lightning_decentral.compression.fused import decode_add_, encode_update_
from lightning_decentral.topology import OnePeerExponential, Ring

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="the C kernel is not built (setup.py build_ext)")

COMPRESSORS = [
    Sign(),
    Sign(block=3),
    Sign(block=100),
    Sign(block=5000),  # several levels of torch's summation cascade in a block
    Sign(block=None),
    *(Quantize(bits) for bits in range(2, 9)),
    Quantize(4, block=7),
    Quantize(3, block=1000),
    TopK(0.01),
    TopK(0.3),
    RandomK(0.01),
    RandomK(0.3, seed=5),
]
SIZES = [1, 2, 7, 8, 9, 100, 1023, 1024, 1025, 4099, 20001]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes: equal floats compare as their bits (a NaN equals itself, `+0.0` differs from `−0.0`)."""
    return t.view(torch.uint8)


def _run(compressor, x: torch.Tensor, copy: torch.Tensor, kernel: bool):
    """One message encoded into a copy of `copy` and decoded into another, on the kernel or the torch path."""
    previous = native.enable(kernel)
    try:
        sent, received = copy.clone(), copy.clone()
        payload = torch.empty(compressor.payload_bytes(x.numel(), torch.float32) + 1, dtype=torch.uint8)[1:]
        encode_update_(compressor, x, sent, 11, payload, torch.empty_like(sent))
        decode_add_(compressor, payload.clone(), received, 11)
        return payload, sent, received
    finally:
        native.enable(previous)


def _assert_same(compressor, x: torch.Tensor, copy: torch.Tensor) -> None:
    kernel, torch_path = _run(compressor, x, copy, True), _run(compressor, x, copy, False)
    for name, a, b in zip(("payload", "sent copy", "received copy"), kernel, torch_path):
        assert torch.equal(_bits(a), _bits(b)), (compressor, x.numel(), name)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_kernel_sends_and_keeps_what_the_torch_path_does(compressor) -> None:
    for numel in SIZES:
        generator = torch.Generator().manual_seed(numel)
        scale = torch.rand(numel, generator=generator).pow(6) * 1e3  # magnitudes over nine decades: order shows
        x = torch.randn(numel, generator=generator) * scale
        copy = torch.randn(numel, generator=generator)
        if numel > 5:  # zeros of both signs where x − x̂ is zero
            x[3], x[4], copy[3], copy[4] = -0.0, 0.0, 0.0, 0.0
        if numel > 200:  # a block of zeros: a zero scale
            x[100:200], copy[100:200] = 1.0, 1.0
        _assert_same(compressor, x, copy)


@pytest.mark.parametrize("compressor", [Sign(block=4), Quantize(8, block=4), Quantize(3, block=4)], ids=repr)
def test_kernel_on_nan_inf_and_subnormal_differences(compressor) -> None:
    """Blocks of 4 with a NaN, an inf, and differences so small that `1 / s` overflows: the bytes of `compress`, and
    both copies `x̂ + decompress(payload)` (a NaN's code is 0, as torch's conversion gives). The torch path's sent copy
    differs here for `Quantize`: it adds the rounded floats, a NaN where the code is 0."""
    x = torch.tensor([float("nan"), 1.0, -2.0, 0.5, float("inf"), 3.0, -1.0, 0.0, 1e-40, 2e-40, 0.0, -1e-40, 1, 2, 3])
    payload, sent, received = _run(compressor, x, torch.zeros_like(x), True)
    expected = compressor.compress(x.clone(), 11)
    q = compressor.decompress(expected, x.numel(), torch.float32, 11)
    assert torch.equal(payload, expected)
    assert torch.equal(_bits(sent), _bits(torch.zeros_like(x) + q))
    assert torch.equal(_bits(received), _bits(torch.zeros_like(x) + q))


def test_kernel_runs_only_where_it_applies() -> None:
    """Contiguous float32 CPU buffers only: float64, bf16 and strided ones take the torch path (`runs_on`)."""
    flat = torch.zeros(8)
    assert native.runs_on(flat, flat)
    assert not native.runs_on(flat, flat.double())
    assert not native.runs_on(flat.bfloat16(), flat)
    assert not native.runs_on(torch.zeros(16)[::2], flat)
    previous = native.enable(False)
    assert not native.runs_on(flat, flat) and not native.dense_encode_update_(Sign(), flat, flat.clone(), flat.byte())
    native.enable(previous)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the probe's lanes are x86's")
def test_sign_runs_on_the_kernel_here() -> None:
    """The kernel reproduces torch's summation order on this CPU (else `Sign` would fall back to the torch path)."""
    assert native.sum_lanes() in native.LANES


@pytest.mark.parametrize("values", ["normal", "ties", "zeros"])
@pytest.mark.parametrize(
    ("numel", "k"), [(64, 1), (1000, 15), (20001, 312), (300007, 3000), (300007, 100000), (70001, 70001)]
)
def test_top_k_selection_is_the_torch_paths(values: str, numel: int, k: int) -> None:
    """The kernel's `TopK` selection returns `largest(x − x̂, k)` (the torch path's, ascending), ties (integers drawn
    from 40 values, or all zeros: the guess fails and the selection runs over the buffer) and NaNs included, `k` from
    one to every coordinate."""
    generator = torch.Generator().manual_seed(numel + k)
    if values == "normal":
        x = torch.randn(numel, generator=generator)
        x[numel // 2] = float("nan")
    else:
        x = torch.randint(-20, 20, (numel,), generator=generator).float() * (values == "ties")
    copy = torch.randint(-3, 3, (numel,), generator=generator).float() * (values == "ties")
    indices = native.top_k_indices(x, copy, k)
    assert indices is not None and torch.equal(indices, largest(x - copy, k))


def _nans(count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` NaNs of both signs and many payloads (all one key, above `inf`'s)."""
    payloads = torch.randint(1, 2**22, (count,), generator=generator, dtype=torch.int32)
    signs = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int32) << 31
    return (signs | 0x7F800000 | payloads).view(torch.float32)


@pytest.mark.parametrize(
    "values", ["pm_pairs", "few_magnitudes", "zeros_and_ties", "nans", "inf_and_subnormal", "one_tie_at_the_edge"]
)
@pytest.mark.parametrize(
    ("numel", "k"),
    [(64, 1), (65, 1), (127, 1), (128, 2), (640, 10), (4099, 64), (70001, 1093), (70001, 20000), (65536, 65535)],
)
def test_top_k_selection_on_ties_nans_and_edges(values: str, numel: int, k: int) -> None:
    """The rule where magnitudes tie (the first ones kept): `±x` pairs (equal magnitudes, the copy at zero), a handful
    of magnitudes, zeros of both signs among ties, NaNs of many payloads and both signs (one key), ±inf and
    subnormals, and one tie across the k-th place; `k` small and large, sizes below and above the kernel's sampling
    (65,536) and ragged after its groups of eight."""
    generator = torch.Generator().manual_seed(numel * 7 + k)
    copy = torch.zeros(numel)
    if values == "pm_pairs":
        half = torch.randn(numel // 2 + 1, generator=generator)
        x = torch.cat([half, -half])[torch.randperm(2 * half.numel(), generator=generator)][:numel]
    elif values == "few_magnitudes":
        x = torch.randint(-3, 4, (numel,), generator=generator).float() * 0.5
        copy = torch.randint(-1, 2, (numel,), generator=generator).float() * 0.25
    elif values == "zeros_and_ties":
        x = (
            torch.randint(0, 2, (numel,), generator=generator).float()
            * torch.tensor([-0.0, 0.0, 1.0, -1.0])[torch.randint(0, 4, (numel,), generator=generator)]
        )
    elif values == "nans":
        x = torch.randn(numel, generator=generator)
        where = torch.randperm(numel, generator=generator)[: max(2, 2 * k)]
        x[where] = _nans(where.numel(), generator)
    elif values == "inf_and_subnormal":
        x = torch.randn(numel, generator=generator) * 1e-39
        x[torch.randperm(numel, generator=generator)[: k + 1]] = float("inf")
        x[0] = -float("inf")
    else:  # the k-th and (k+1)-th largest equal, the rest distinct
        x = torch.randn(numel, generator=generator)
        order = x.abs().argsort(descending=True)
        x[order[k]] = -x[order[k - 1]]
    indices = native.top_k_indices(x, copy, k)
    assert indices is not None and torch.equal(indices, largest(x - copy, k))


@pytest.mark.parametrize("compressor", [TopK(1 / 64), TopK(0.001)], ids=repr)
def test_top_k_payload_on_ties_is_the_torch_paths(compressor) -> None:
    """Whole `TopK` messages (values, packed indices, both copies) on many tied magnitudes and NaNs, bit for bit."""
    generator = torch.Generator().manual_seed(3)
    for numel in (64, 1000, 65536, 100003):
        x = torch.randint(-50, 50, (numel,), generator=generator).float() / 8
        x[torch.randperm(numel, generator=generator)[:3]] = _nans(3, generator)
        _assert_same(compressor, x, torch.randint(-2, 2, (numel,), generator=generator).float())


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_combine_is_torch_arithmetic(count: int, add: bool) -> None:
    """`γ Σ w_i t_i` written or added: torch's `mul`, `add_(alpha=)`, `mul_(γ)` and write or `add_`, bit for bit, on
    sizes around the kernel's tiles and torch's vectors, with `γ = 1` (no multiply) and another."""
    for numel, gamma in itertools.product([1, 7, 1023, 1025, 4099], [1.0, 0.37]):
        generator = torch.Generator().manual_seed(numel * count)
        terms = [(torch.randn(numel, generator=generator), w) for w in (0.5, -1 / 3, 0.25, -0.125, 1e-3)[:count]]
        target = torch.randn(numel, generator=generator)
        expected = torch.mul(terms[0][0], terms[0][1])
        for term, weight in terms[1:]:
            expected.add_(term, alpha=weight)
        if gamma != 1:
            expected.mul_(gamma)
        expected = target + expected if add else expected
        assert native.combine_(target, terms, gamma, add) and torch.equal(target, expected), (numel, gamma)


@pytest.mark.parametrize(
    "compressor", [Sign(), Sign(block=3), Sign(block=5000), Quantize(8), Quantize(4, block=7), Quantize(3, block=1000)]
)
def test_decoding_in_the_combine_is_decoding_then_combining(compressor) -> None:
    """`combine_` with `decode`: the received copies and the target equal `dense_decode_add_` of each payload and then
    `combine_`, bit for bit, for one and two received copies, on sizes around the tile (1024), blocks that straddle
    tiles, and a sent copy among the terms; a sparse compressor's payloads are refused (nothing runs)."""
    for numel, received in itertools.product([1, 9, 1023, 1025, 4099, 20001], [1, 2]):
        generator = torch.Generator().manual_seed(numel + received)
        copies = [torch.randn(numel, generator=generator) for _ in range(received + 1)]  # the last one: the sent copy
        payloads = []
        for copy in copies[:received]:
            payload = torch.empty(compressor.payload_bytes(numel, torch.float32), dtype=torch.uint8)
            native.dense_encode_update_(compressor, torch.randn(numel, generator=generator) * 3, copy.clone(), payload)
            payloads.append(payload)
        weights = [0.25, 0.5, -0.75][-(received + 1) :]
        runs = []
        for fused in (True, False):
            terms = [(copy.clone(), weight) for copy, weight in zip(copies, weights)]
            target = torch.ones(numel)
            pending = [(payload, term) for payload, (term, _) in zip(payloads, terms)]
            if fused:
                assert native.combine_(target, terms, 0.37, True, decode=(compressor, pending))
            else:
                assert all(native.dense_decode_add_(compressor, payload, copy) for payload, copy in pending)
                assert native.combine_(target, terms, 0.37, True)
            runs.append([target, *(term for term, _ in terms)])
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*runs)), (numel, received)
    copy = torch.zeros(100)
    assert not native.combine_(
        copy.clone(), [(copy, 1.0)], 1.0, True, decode=(TopK(0.1), [(torch.zeros(60, dtype=torch.uint8), copy)])
    )


@pytest.mark.parametrize("compression", [Sign(), Quantize(4), TopK(0.01), RandomK(0.05)], ids=repr)
@pytest.mark.parametrize("topology", [Ring(world_size=4), OnePeerExponential(world_size=4)], ids=repr)
@pytest.mark.parametrize(("rounds", "awc"), [(1, False), (1, True), (2, True)])
def test_exchanges_on_the_kernel_equal_the_torch_paths(compression, topology, rounds: int, awc: bool) -> None:
    """Four steps of whole exchanges between four workers, three buffers: the buffers, the corrections, every public
    copy and the bytes sent are the same bit for bit with the kernel and without."""
    runs = []
    for kernel in (True, False):
        previous = native.enable(kernel)
        workers = [Choco(compression, 0.7, rank) for rank in range(4)]
        generator = torch.Generator().manual_seed(0)
        x = [[torch.randn(size, generator=generator) for size in (7000, 37, 2051)] for _ in range(4)]
        out = [[torch.zeros_like(b) for b in buffers] for buffers in x]
        for step in range(4):
            exchange_in_process(
                [
                    ChocoExchange(w, topology, x[i], step, rounds, out=out[i] if awc else None)
                    for i, w in enumerate(workers)
                ]
            )
        native.enable(previous)
        copies = [w.state_dict()["copies"] for w in workers]
        flat = [c for worker in copies for key in sorted(worker) for c in worker[key]["sent"]]
        flat += [
            worker[key]["received"][p]
            for worker in copies
            for key in sorted(worker)
            for p in sorted(worker[key]["received"])
        ]
        runs.append(([b for buffers in x + out for b in buffers], flat, [w.wire_bytes for w in workers]))
    (buffers, copies, wire), (buffers_, copies_, wire_) = runs
    assert wire == wire_
    assert all(torch.equal(a, b) for a, b in zip(buffers, buffers_))
    assert len(copies) == len(copies_) and all(torch.equal(a, b) for a, b in zip(copies, copies_))


def test_buffers_of_other_sizes_are_refused() -> None:
    """The kernel never reads or writes past a buffer: a short payload or an `x` of another size is a ValueError."""
    sign, x, copy = Sign(), torch.zeros(100), torch.zeros(100)
    with pytest.raises(ValueError, match="a payload of 17 bytes, got 16"):
        native.dense_encode_update_(sign, x, copy, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="of 99 elements into a copy of 100"):
        native.dense_encode_update_(sign, x[:99], copy, torch.empty(17, dtype=torch.uint8))
    with pytest.raises(ValueError, match="got 16"):
        native.dense_decode_add_(sign, torch.zeros(16, dtype=torch.uint8), copy)
    with pytest.raises(ValueError, match="short of 3 values"):
        native.sparse_encode_update_(x, copy, torch.arange(3), torch.empty(11, dtype=torch.uint8))


def test_a_corrupt_sparse_payload_is_refused() -> None:
    """A `TopK` payload whose packed index is past the buffer: a ValueError, not a write out of bounds."""
    top, copy = TopK(0.5), torch.zeros(5)
    payload = top.compress(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]), 0)  # keeps 0, 1, 2: the last one 0b010
    payload[-1] = 0xFF  # the high bit of the last index (3 bits, bits 6–8 of the stream): 4 + its low bits
    with pytest.raises(ValueError, match=r"index [4-7] of a buffer of 5"):
        decode_add_(top, payload, copy, 0)
