"""The compressors: what they send (exact byte counts, packed), what comes back, and their names."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_decentral.compression import (
    Compressor,
    Quantize,
    RandomK,
    Sign,
    TopK,
    kept,
    largest,
    pack_bits,
    packed_bytes,
    resolve_compression,
    unpack_bits,
)

COMPRESSORS = [
    Sign(),
    Sign(block=None),
    Sign(block=100),
    Quantize(8),
    Quantize(4),
    Quantize(3),
    Quantize(2, block=None),
    TopK(0.01),
    TopK(0.1),
    RandomK(0.01),
    RandomK(0.3, seed=5),
]
SIZES = [1, 7, 1000, 4099]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8, 12, 23, 32])
def test_bits_round_trip_and_pack_tightly(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits), dtype=torch.int64)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and len(packed) == packed_bytes(1001, bits) == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_bits(packed, 1001, bits), codes)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_payload_has_the_announced_size_and_decompresses_to_a_contraction(
    compressor: Compressor, numel: int, dtype: torch.dtype
) -> None:
    v = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.linspace(0.1, 3, numel)).to(dtype)
    payload = compressor.compress(v, seed=11)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert len(payload) == compressor.payload_bytes(numel, dtype)
    q = compressor.decompress(payload, numel, dtype, seed=11)
    assert q.dtype == dtype and q.shape == v.shape
    assert torch.equal(compressor.decompress(payload.clone(), numel, dtype, seed=11), q)  # the receiver's copy
    error, norm = float((q.double() - v.double()).norm()), float(v.double().norm())
    assert error < norm  # a contraction


def test_byte_counts_are_what_the_formats_say() -> None:
    n = 10_000
    assert Sign(block=None).payload_bytes(n, torch.float32) == n // 8 + 4  # 1 bit per element, one float32 scale
    assert Sign(block=1024).payload_bytes(n, torch.float32) == n // 8 + 4 * 10
    assert Quantize(4, block=None).payload_bytes(n, torch.float32) == n // 2 + 4  # half a byte per element
    assert Quantize(8, block=None).payload_bytes(n, torch.float32) == n + 4
    k, index_bits = 100, 14  # 2^13 < 10 000 <= 2^14
    assert TopK(0.01).payload_bytes(n, torch.float32) == k * 4 + math.ceil(
        k * index_bits / 8
    )  # values + packed indices
    assert TopK(0.01).payload_bytes(n, torch.bfloat16) == k * 2 + math.ceil(k * index_bits / 8)
    assert RandomK(0.01).payload_bytes(n, torch.float32) == k * 4  # values only
    # the goals against float32 messages (32 bits per element)
    assert 32 * n / 8 / Sign().payload_bytes(n, torch.float32) >= 25
    assert 32 * n / 8 / Quantize(4).payload_bytes(n, torch.float32) >= 7
    assert 32 * n / 8 / TopK(0.01).payload_bytes(n, torch.float32) >= 40


def test_what_each_compressor_keeps() -> None:
    v = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.25, 1.0])
    sign = Sign(block=3).decompress(Sign(block=3).compress(v, 0), 6, torch.float32, 0)
    assert sign.tolist() == pytest.approx([2.5 / 3, -2.5 / 3, 2.5 / 3, 4.25 / 3, -4.25 / 3, 4.25 / 3])
    int8 = Quantize(8).decompress(Quantize(8).compress(v, 0), 6, torch.float32, 0)
    assert (int8 - v).abs().max() <= 3.0 / 127 / 2 + 1e-7 and int8[3] == 3.0  # the largest is exact
    top = TopK(2 / 6).decompress(TopK(2 / 6).compress(v, 0), 6, torch.float32, 0)
    assert top.tolist() == [0.0, -2.0, 0.0, 3.0, 0.0, 0.0]


def _largest_by_sorting(v: torch.Tensor, k: int) -> list[int]:
    """`TopK`'s rule spelled out: the coordinates ordered by magnitude, largest first (a NaN above inf, NaNs and equal
    magnitudes by position), the first `k` taken, listed in ascending order."""
    magnitude = [math.inf if math.isnan(a) else abs(a) for a in v.double().tolist()]
    nan = [math.isnan(a) for a in v.double().tolist()]
    ranked = sorted(range(len(v)), key=lambda j: (not nan[j], -magnitude[j], j))
    return sorted(ranked[:k])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_top_k_keeps_the_largest_and_the_first_of_equal_magnitudes_in_ascending_order(dtype, device: str) -> None:
    """`largest` (what `TopK` keeps and how its payload lists them) against the rule spelled out, on ties of both
    signs, zeros of both signs, NaNs of both signs (one magnitude, above inf), ±inf and subnormals, for every `k`;
    and a payload's indices, packed behind the values, in ascending order."""
    generator = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).tiny
    pool = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, math.inf, -math.inf, math.nan, -math.nan, tiny / 4, -tiny / 4]
    v = torch.tensor(pool, dtype=torch.float64)[torch.randint(0, len(pool), (61,), generator=generator)].to(dtype)
    v = torch.cat([v, (torch.randn(40, generator=generator) * 3).to(dtype)]).to(device)
    for k in range(1, len(v) + 1):
        indices = largest(v, k)
        assert indices.dtype == torch.int64 and indices.tolist() == _largest_by_sorting(v.cpu(), k), k
    top = TopK(0.25)
    k, payload = kept(len(v), 0.25), top.compress(v, 0)
    packed = unpack_bits(payload[k * v.element_size() :], k, math.ceil(math.log2(len(v)))).long()
    assert packed.tolist() == _largest_by_sorting(v.cpu(), k)
    assert torch.equal(payload[: k * v.element_size()], v[packed.to(device)].view(torch.uint8))  # NaNs: bytes


def test_random_k_draws_the_same_coordinates_from_the_seed_on_both_ends() -> None:
    rand = RandomK(0.1)
    v = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q = rand.decompress(rand.compress(v, seed=3), 1000, torch.float32, seed=3)
    kept_at = torch.nonzero(q).view(-1)
    assert len(kept_at) == kept(1000, 0.1) == 100
    assert torch.equal(q[kept_at], v[kept_at])
    assert torch.equal(kept_at, rand.indices(1000, 3, torch.device("cpu")).sort().values)  # distinct, one per stratum
    assert not torch.equal(rand.indices(1000, 4, torch.device("cpu")), rand.indices(1000, 3, torch.device("cpu")))
    assert not torch.equal(
        RandomK(0.1, seed=1).indices(1000, 3, torch.device("cpu")), rand.indices(1000, 3, torch.device("cpu"))
    )


def test_names_resolve_and_bad_ones_name_the_choices() -> None:
    assert resolve_compression(None) is None
    assert resolve_compression("sign") == Sign()
    assert resolve_compression("int8") == Quantize(8) and resolve_compression("INT4") == Quantize(4)
    assert resolve_compression("top_k:0.01") == TopK(0.01) and resolve_compression("random_k:0.05") == RandomK(0.05)
    custom = TopK(0.2, consensus_step=0.1)
    assert resolve_compression(custom) is custom
    for bad in ("top-k", "int1", "int16", "random_k:x", 3):
        with pytest.raises(
            ValueError, match=r"'sign', 'int8', 'int4', 'top_k:<fraction>', 'random_k:<fraction>'.*Sign\(\)"
        ):
            resolve_compression(bad)
    for bad in ("top_k:0", "top_k:2", "random_k:-0.1"):
        with pytest.raises(ValueError, match=r"fraction of the coordinates in \(0, 1\]"):
            resolve_compression(bad)
    with pytest.raises(ValueError, match="2 to 8 bits"):
        Quantize(bits=1)
    with pytest.raises(ValueError, match="block"):
        Sign(block=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_on_the_gpu_a_payload_means_the_same_on_either_device(compressor: Compressor) -> None:
    v = torch.randn(4099, generator=torch.Generator().manual_seed(0)).cuda()
    payload = compressor.compress(v, seed=2)
    assert payload.is_cuda and len(payload) == compressor.payload_bytes(4099, torch.float32)
    q = compressor.decompress(payload, 4099, torch.float32, seed=2)
    assert q.is_cuda and float((q - v).norm()) < float(v.norm())
    assert torch.equal(q.cpu(), compressor.decompress(payload.cpu(), 4099, torch.float32, seed=2))
