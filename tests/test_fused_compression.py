"""The fused CHOCO arithmetic (``lightning_decentral.compression.fused``) against ``compress`` and ``decompress``: the
same payload bytes, the same sent and received copies, bit for bit, for every built-in compressor, chunk size, dtype
and alignment; whole exchanges of several steps and rounds equal to the same exchanges through a compressor the fused
path does not know; the bit packing against a bit-by-bit packing."""

from __future__ import annotations

import itertools

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
    pack_bits,
    unpack_bits,
)
from lightning_decentral.compression.fused import decode_add_, encode_update_, fused
from lightning_decentral.topology import OnePeerExponential, Ring

COMPRESSORS = [
    Sign(),
    Sign(block=None),
    Sign(block=100),
    Sign(block=3),
    Quantize(8),
    Quantize(4),
    Quantize(3),
    Quantize(2),
    Quantize(2, block=None),
    Quantize(5, block=7),
    TopK(0.01),
    TopK(0.1),
    RandomK(0.01),
    RandomK(0.3, seed=5),
]
SIZES = [1, 9, 100, 4099, 20001]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bit_by_bit(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Each code's bits, least significant first, then eight bits to a byte: the stream `pack_bits` writes."""
    stream = [(int(code) >> b) & 1 for code in codes for b in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return torch.tensor([sum(bit << i for i, bit in enumerate(stream[j : j + 8])) for j in range(0, len(stream), 8)])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 63, 64, 65, 1001])
def test_pack_bits_writes_the_bit_stream(bits: int, count: int) -> None:
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(count), dtype=torch.int64)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == _bit_by_bit(codes, bits).tolist()
    assert torch.equal(unpack_bits(packed, count, bits).long(), codes)
    assert torch.equal(pack_bits(codes.to(torch.uint8) if bits <= 8 else codes, bits), packed)  # any integer dtype


def _case(numel: int, dtype: torch.dtype, x_dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator) * torch.linspace(0.1, 3, numel)
    copy = torch.randn(numel, generator=generator, dtype=dtype)
    if numel > 5:  # zeros of both signs where x - x̂ is zero
        x[3], x[4], copy[3], copy[4] = -0.0, 0.0, 0.0, 0.0
    if numel > 200:  # a block of zeros: a zero scale
        x[100:200], copy[100:200] = 1.0, 1.0
    return x.to(x_dtype).to(device), copy.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
@pytest.mark.parametrize("chunk", [8, 2048, None])
def test_fused_sends_and_keeps_what_compress_and_decompress_do(compressor, chunk: int | None, device: str) -> None:
    for numel, dtype, x_dtype in itertools.product(SIZES, [torch.float32, torch.float64], [None, torch.bfloat16]):
        x, copy = _case(numel, dtype, x_dtype or dtype, device)
        size = compressor.payload_bytes(numel, dtype)
        expected_copy = copy.clone()
        expected = compressor.compress(x - expected_copy, seed=11)
        q = compressor.decompress(expected, numel, dtype, seed=11)
        expected_copy.add_(q)
        sent = copy.clone()
        payload = torch.empty(size + 1, dtype=torch.uint8, device=device)[1:]  # at an odd offset, as in a message
        encode_update_(compressor, x, sent, 11, payload, torch.empty_like(sent), chunk=chunk)
        assert torch.equal(payload, expected), (numel, dtype, x_dtype)
        assert torch.equal(sent, expected_copy), (numel, dtype, x_dtype)
        received = decode_add_(compressor, payload.clone(), copy.clone(), 11, chunk=chunk)
        assert torch.equal(received, copy + q), (numel, dtype, x_dtype)


class Unknown:
    """A built-in compressor behind a type the fused path does not know: `compress` and `decompress` run."""

    def __init__(self, inner) -> None:
        self.inner, self.consensus_step = inner, inner.consensus_step

    def payload_bytes(self, numel, dtype):
        return self.inner.payload_bytes(numel, dtype)

    def compress(self, v, seed):
        return self.inner.compress(v, seed)

    def decompress(self, payload, numel, dtype, seed):
        return self.inner.decompress(payload, numel, dtype, seed)


@pytest.mark.parametrize("compression", [Sign(), Quantize(4), Quantize(3), TopK(0.05), RandomK(0.05)], ids=repr)
@pytest.mark.parametrize("topology", [Ring(world_size=4), OnePeerExponential(world_size=4)], ids=repr)
@pytest.mark.parametrize("awc", [False, True])
def test_exchanges_equal_those_through_compress_and_decompress(compression, topology, awc: bool) -> None:
    """Five steps of two rounds, three buffers (payloads at unaligned offsets in a message), with and without `out`:
    the buffers, the corrections, every public copy and the bytes sent are the same bit for bit."""
    assert fused(compression, 1000) and not fused(Unknown(compression), 1000)
    sizes, runs = [1000, 37, 2051], []
    for compressor in (compression, Unknown(compression)):
        workers = [Choco(compressor, 0.7, rank) for rank in range(4)]
        generator = torch.Generator().manual_seed(0)
        x = [[torch.randn(size, generator=generator) for size in sizes] for _ in range(4)]
        out = [[torch.zeros(size) for size in sizes] for _ in range(4)]
        for step in range(5):
            exchange_in_process(
                [
                    ChocoExchange(w, topology, x[i], step, rounds=2, out=out[i] if awc else None)
                    for i, w in enumerate(workers)
                ]
            )
        copies = [w.state_dict()["copies"] for w in workers]
        runs.append((x, out, copies, [w.wire_bytes for w in workers]))
    (x, out, copies, wire), (x_, out_, copies_, wire_) = runs
    assert wire == wire_
    assert all(torch.equal(a, b) for i in range(4) for a, b in zip(x[i] + out[i], x_[i] + out_[i]))
    for mine, theirs in zip(copies, copies_):
        for key in mine:
            assert all(torch.equal(a, b) for a, b in zip(mine[key]["sent"], theirs[key]["sent"]))
            assert mine[key]["received"].keys() == theirs[key]["received"].keys()
            assert all(torch.equal(mine[key]["received"][p], theirs[key]["received"][p]) for p in mine[key]["received"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compression", [Sign(), Quantize(8), Quantize(4), TopK(0.05), RandomK(0.05)], ids=repr)
def test_cuda_exchange_matches_the_cpu_one(compression) -> None:
    """The same exchange on CUDA and on the CPU: the same bytes on the wire and, for the elementwise compressors,
    copies equal up to the last bit of the block reductions."""
    topology, results = Ring(world_size=4), []
    for device in ("cpu", "cuda"):
        workers = [Choco(compression, compression.consensus_step, rank) for rank in range(4)]
        generator = torch.Generator().manual_seed(0)
        x = [[torch.randn(5000, generator=generator).to(device)] for _ in range(4)]
        for step in range(3):
            exchange_in_process([ChocoExchange(w, topology, x[i], step, rounds=1) for i, w in enumerate(workers)])
        results.append(([b[0].cpu() for b in x], [w.wire_bytes for w in workers]))
    (cpu, wire), (cuda, wire_cuda) = results
    assert wire == wire_cuda
    torch.testing.assert_close(torch.stack(cuda), torch.stack(cpu), atol=1e-4, rtol=1e-4)
