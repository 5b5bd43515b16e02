"""A token payload's row parts (moe_ep.kernels.row_parts) and what the world-1 launch path builds on them: rows
moved part by part are the payload's rows, for every format; the bridge's one-allocation routes, [..., H] rows and
0-d valid counts give what their plain forms give."""

import pytest
import torch

from moe_ep.errors import MoEEpInputError
from moe_ep.kernels import dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
from moe_ep.kernels.bridge import _pieces, _route, _scatter, route_experts, scatter_rows, unpermute_reduce
from moe_ep.kernels.nvfp4 import nvfp4_global_scale, quantize_nvfp4_tokens
from moe_ep.kernels.row_parts import (from_row_parts, payload_type, reshape_rows, row_part_specs, row_parts,
                                      with_row_parts)
from moe_ep.layout_contract import HighThroughputExpertMajor

H = 128


def _payload(fmt: str, x: torch.Tensor):
    return {"bf16": lambda: x, "nvfp4_per_row": lambda: quantize_nvfp4_tokens(x),
            "nvfp4_shared": lambda: quantize_nvfp4(x, nvfp4_global_scale(x)),
            "fp8": lambda: quantize_fp8(x, 1)}[fmt]()


def _values(p) -> torch.Tensor:
    """A payload's values, as the GEMM reads them."""
    if isinstance(p, torch.Tensor):
        return p.float()
    return (dequantize_fp8 if p.__class__.__name__ == "Fp8Tensor" else dequantize_nvfp4)(p, torch.float32)


FORMATS = ["bf16", "nvfp4_per_row", "nvfp4_shared", "fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("M", [1, 5])  # one row: its one global scale is still a row's (a transport's batch of 1)
def test_rows_moved_part_by_part_are_the_payloads_rows(dev, fmt, broadcast, M):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(M, H, generator=g) * torch.logspace(-2, 2, M)[:, None]).bfloat16().to(dev)
    q = _payload(fmt, x)
    pick = torch.tensor([4, 0, 0, 2, 3, 1, 4], device=dev) % M
    moved = [p[pick] for p in row_parts(q, broadcast_shared=broadcast)]
    out = with_row_parts(q, moved)
    assert type(out) is type(q) and tuple(out.shape) == (len(pick), H)
    assert torch.equal(_values(out), _values(q)[pick])
    one_scale = fmt == "nvfp4_shared" or (fmt == "nvfp4_per_row" and M == 1)  # a global scale of one value
    if broadcast or not one_scale:  # every part per row: the receive buffers' layout
        kind = payload_type(fmt.startswith("nvfp4"), fmt == "fp8")
        specs = row_part_specs(kind, H)
        assert [(p.shape[-1], p.dtype) for p in moved] == list(specs)
        assert torch.equal(_values(from_row_parts(kind, moved)), _values(q)[pick])
    else:  # the shared global scale is no part: it stays with the payload, not gathered
        assert len(moved) == 2 and torch.equal(out.global_scale.reshape(-1), q.global_scale.reshape(-1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reshape_rows_keeps_values(dev, fmt):
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4)).bfloat16().to(dev)
    q = _payload(fmt, x)
    r = reshape_rows(q, (2, 3))
    assert tuple(r.shape) == (2, 3, H)
    assert torch.equal(_values(reshape_rows(r, (6,))), _values(q))


def test_row_parts_refuse_tensors_whose_scales_are_not_per_row(dev):
    x = torch.randn(4, H).bfloat16().to(dev)
    with pytest.raises(MoEEpInputError, match="swizzled"):
        quantize_nvfp4(x, swizzle=True).row_parts()
    with pytest.raises(MoEEpInputError, match="block_rows"):
        quantize_fp8(x, 128).row_parts()


@pytest.mark.parametrize("sizes", [(5, 6, 16, 16, 0), (3, 4, 7, 0, 12), (0, 1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pieces_are_disjoint_and_16_byte_aligned(sizes, dtype):
    pieces = _pieces(sizes, dtype, "cpu")
    assert [p.numel() for p in pieces] == list(sizes) and all(p.dtype == dtype for p in pieces)
    assert all(p.data_ptr() % 16 == 0 for p in pieces)
    for i, p in enumerate(pieces):
        p.fill_(i)
    assert all(bool((p == i).all()) for i, p in enumerate(pieces))  # no piece overlaps another


@pytest.mark.parametrize("M,K,L", [(6, 2, 4), (700, 8, 5)])  # one launch; chunked (histograms in the allocation)
def test_route_of_nd_ids_and_0d_valid_rows_is_the_plain_route(dev, M, K, L):
    g = torch.Generator().manual_seed(M)
    idx = torch.randint(-1, L + 1, (M, K), generator=g).to(dev)
    n = torch.tensor(M - 3, device=dev)
    plain = route_experts(idx, L, valid_rows=n.reshape(1), rows_per_group=M)
    nd = _route(idx.reshape(2, M // 2, K).contiguous(), L, n, M)  # [..., K] ids, a 0-d count
    for part in ("counts", "offsets", "slot", "row_of_slot"):
        assert torch.equal(getattr(nd, part), getattr(plain, part)), part


def test_row_kernels_take_nd_rows(dev):
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 3, (4, 2), generator=g).to(dev)
    r = route_experts(idx, 3, padded_rows=4)
    x = torch.randn(4, 24, generator=g).bfloat16().to(dev)
    flat = scatter_rows(x, r, torch.zeros(12, 24, dtype=torch.bfloat16, device=dev))
    nd = torch.zeros(12, 24, dtype=torch.bfloat16, device=dev)
    _scatter(x.reshape(2, 2, 24), r.slot, nd)  # [..., H] rows, flattened
    y = torch.randn(3, 4, 24, generator=g).to(dev)
    w = torch.rand(4, 2, generator=g).to(dev)
    want = unpermute_reduce(y.reshape(12, 24), r, w)
    assert torch.equal(flat, nd)
    assert torch.equal(unpermute_reduce(y, r, w), want)  # contiguous [3, 4, 24]: no reshape
    assert torch.equal(unpermute_reduce(y.transpose(0, 1).contiguous().transpose(0, 1), r, w), want)  # strided


def _ht_expert_major(offsets_and_end: torch.Tensor, counts: torch.Tensor, split: bool):
    L = counts.shape[0]
    eo, end = (offsets_and_end[:L].clone(), offsets_and_end[L].clone()) if split else \
        (offsets_and_end[:L], offsets_and_end[L])
    S = int(end)
    return HighThroughputExpertMajor(torch.zeros(S, H, dtype=torch.bfloat16), expert_offsets=eo,
                                     expert_counts=counts, topk_weights=torch.ones(S), num_recv=end)


@pytest.mark.parametrize("held", ["alone", "in_larger", "split"])
def test_gemm_offsets_are_expert_offsets_and_their_end(held):
    from moe_ep.compute import _gemm_offsets
    counts = torch.tensor([2, 0, 3, 1])
    offsets = torch.tensor([0, 2, 2, 5, 6])
    if held == "in_larger":  # the L + 1 elements inside a larger buffer: a view of them, not the buffer
        offsets = torch.tensor([9, 0, 2, 2, 5, 6, 9])[1:6]
    got = _gemm_offsets(_ht_expert_major(offsets, counts, held == "split"))
    assert torch.equal(got, offsets)
    # one buffer: a view of it (no copy), the buffer itself where the offsets were sliced from exactly it; apart:
    # made from the offsets and the last count
    assert (got.untyped_storage().data_ptr() == offsets.untyped_storage().data_ptr()) is (held != "split")
    assert (got is offsets) is (held == "alone")
    assert got.shape == (5,) and got.storage_offset() == offsets.storage_offset()
