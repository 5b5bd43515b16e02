"""Bridge kernels (route histogram/offsets/slots, permute, unpermute-reduce) vs the torch references."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_ep.kernels import dequantize_nvfp4, gather_quantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from moe_ep.kernels.bridge import _launch_route, _route, permute_rows, route_experts, scatter_rows, unpermute_reduce
from moe_ep.kernels.kept_routes import KeptRoutes
from moe_ep.reference import (padded_slots_ref, permute_rows_ref, route_experts_ref, scatter_rows_ref,
                              slot_weights_ref, unpermute_reduce_ref)
from moe_ep.testing.strategies import Bounds, make_route, route_cases
from moe_ep.triton_runtime import device

ROUTE_BOUNDS = Bounds(rows=8, k16=4, n16=1, experts=8, top_k=4)  # M up to 24, as the bridge's cases need


def routes():
    """(topk_idx, L, valid_rows, rows_per_group) of the shared route cases (moe_ep.testing.strategies)."""
    def tensors(c):
        idx, valid = make_route(c)
        return idx, c["L"], valid, c["group"]
    return route_cases(ROUTE_BOUNDS).map(tensors)


@given(routes())
def test_route_matches_reference_exactly(case):
    dev = device()
    idx, L, valid, group = case
    idx = idx.to(dev)
    valid = valid.to(dev) if valid is not None else None
    r = route_experts(idx, L, valid_rows=valid, rows_per_group=group)
    counts, offsets, slot, row_of_slot = route_experts_ref(idx, L, valid, group)
    assert torch.equal(r.counts, counts)
    assert torch.equal(r.offsets, offsets)
    assert torch.equal(r.slot, slot)
    assert torch.equal(r.row_of_slot, row_of_slot)


@given(routes())
def test_route_in_many_chunks_matches_reference_exactly(case):
    """Chunks of 16 ids: the histogram / scan / placement launches, which real shapes take above 4096 ids."""
    import moe_ep.kernels.bridge as bridge
    old = bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH
    bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH = 16, 8
    try:
        test_route_matches_reference_exactly.hypothesis.inner_test(case)
    finally:
        bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH = old


def _few_chunks(test):
    """Run ``test`` with chunks of 16 ids: the histogram / scan / placement launches, which real shapes take above
    4096 ids."""
    import moe_ep.kernels.bridge as bridge
    old = bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH
    bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH = 16, 8
    try:
        test()
    finally:
        bridge._ROUTE_CHUNK, bridge._ROUTE_ONE_LAUNCH = old


@given(routes(), st.sampled_from([1, 2, 3, 24]), st.booleans(), st.sampled_from(["float32", "bfloat16"]))
def test_padded_route_and_slot_weights_match_reference(case, rows, chunks, wdtype):
    """route_experts(padded_rows=P): LL EXPERT_MAJOR's slots e * P + j, picks past P dropped (small P: drops happen),
    ragged counts and offsets as before; weights=: each valid slot's weight, padded or ragged."""
    dev = device()
    idx, L, valid, group = case
    M, K = idx.shape
    idx = idx.to(dev)
    valid = valid.to(dev) if valid is not None else None
    w = torch.rand(M, K, generator=torch.Generator().manual_seed(M * 7 + K)).to(getattr(torch, wdtype)).to(dev)

    def check():
        counts, offsets, slot, _ = route_experts_ref(idx, L, valid, group)
        p = route_experts(idx, L, valid_rows=valid, rows_per_group=group, padded_rows=rows, weights=w)
        assert p.row_of_slot is None
        assert torch.equal(p.counts, counts) and torch.equal(p.offsets, offsets)
        assert torch.equal(p.slot, padded_slots_ref(idx, L, rows, valid, group))
        filled, values = slot_weights_ref(p.slot, w, L * rows)
        assert p.slot_weight.shape == (L * rows,) and p.slot_weight.dtype == torch.float32
        assert torch.equal(p.slot_weight[filled], values[filled])
        r = route_experts(idx, L, valid_rows=valid, rows_per_group=group, weights=w)
        assert torch.equal(r.slot, slot)
        filled, values = slot_weights_ref(slot, w, M * K)
        assert torch.equal(r.slot_weight[filled], values[filled])
        wide = _route(idx.contiguous(), L, valid, group or 1, index_dtype=torch.int64)  # HT EXPERT_MAJOR's counters
        assert wide.counts.dtype == wide.offsets.dtype == torch.int64
        assert torch.equal(wide.counts, counts.long()) and torch.equal(wide.offsets, offsets.long())
        assert torch.equal(wide.slot, slot) and torch.equal(wide.row_of_slot, r.row_of_slot)
    _few_chunks(check) if chunks else check()


@given(routes(), st.sampled_from([2, 24]), st.sampled_from(["bfloat16", "uint8", "float32"]))
def test_scatter_rows_matches_reference(case, rows, dtype):
    """Rows to their padded slots (LL EXPERT_MAJOR's tokens); rows of out no pick lands on keep their values."""
    dev = device()
    idx, L, valid, group = case
    M, K = idx.shape
    g = torch.Generator().manual_seed(M * 3 + K)
    if dtype == "uint8":
        x = torch.randint(0, 256, (M, 48), generator=g, dtype=torch.uint8)
        out = torch.full((L * rows, 48), 7, dtype=torch.uint8)
    else:
        x = torch.randn(M, 48, generator=g).to(getattr(torch, dtype))
        out = torch.full((L * rows, 48), float("nan"), dtype=x.dtype)
    x, out = x.to(dev), out.to(dev)
    r = route_experts(idx.to(dev), L, valid_rows=valid.to(dev) if valid is not None else None, rows_per_group=group,
                      padded_rows=rows)
    ref = scatter_rows_ref(x, r.slot, out)
    got = scatter_rows(x, r, out)
    assert got is out
    assert torch.equal(got, ref) if dtype == "uint8" else torch.equal(got.isnan(), ref.isnan()) and torch.equal(
        got.nan_to_num(), ref.nan_to_num())


@given(routes(), st.sampled_from([32, 64]), st.sampled_from(["normal", "zeros", "large"]))
def test_permute_and_unpermute_reduce(case, H, values):
    dev = device()
    idx, L, valid, group = case
    M, K = idx.shape
    g = torch.Generator().manual_seed(M * 31 + K)
    x = torch.randn(M, H, generator=g)
    x = {"normal": x, "zeros": torch.zeros_like(x), "large": x * 1e4}[values].bfloat16().to(dev)
    idx = idx.to(dev)
    valid = valid.to(dev) if valid is not None else None
    r = route_experts(idx, L, valid_rows=valid, rows_per_group=group)
    total = int(r.offsets[-1])
    p = permute_rows(x, r)
    assert p.shape == (M * K, H)
    assert torch.equal(p[:total], permute_rows_ref(x, r.row_of_slot, total))
    w = torch.rand(M, K, generator=g).to(dev)
    out = unpermute_reduce(p, r, w)
    ref = unpermute_reduce_ref(p, r.slot, w)
    assert out.dtype == torch.bfloat16 and out.shape == (M, H)
    assert torch.equal(out, ref.bfloat16())  # same fp32 order (k ascending), so bit equal
    assert torch.equal(unpermute_reduce(p, r, out_dtype=torch.float32), unpermute_reduce_ref(p, r.slot))


@given(routes())
def test_permute_quantize_matches_gather_then_quantize(case):
    dev = device()
    idx, L, valid, group = case
    M, K = idx.shape
    x = torch.randn(M, 64, generator=torch.Generator().manual_seed(M)).bfloat16().to(dev)
    r = route_experts(idx.to(dev), L, valid_rows=valid.to(dev) if valid is not None else None,
                      rows_per_group=group)
    q = permute_rows(x, r, quantize=True)
    total = int(r.offsets[-1])
    ref = gather_quantize_nvfp4(x, r.row_of_slot[:total].long(), q.global_scale)
    assert torch.equal(q.data[:total], ref.data)
    assert torch.equal(q.scales[:total].view(torch.uint8), ref.scales.view(torch.uint8))
    assert not q.data[total:].any()  # padding slots: all-zero rows
    if total:
        assert torch.isfinite(dequantize_nvfp4(q).float()).all()


@given(routes(), st.booleans())
def test_permute_nvfp4_rows_gathers_codes_scales_and_row_scales(case, per_row):
    """Received NVFP4 tokens are gathered as they are (no requantization), per-row global scales too."""
    dev = device()
    idx, L, valid, group = case
    M, K = idx.shape
    x = torch.randn(M, 64, generator=torch.Generator().manual_seed(M + 7)).bfloat16().to(dev) * 3
    q = quantize_nvfp4(x, nvfp4_global_scale(x, per_slice=True) if per_row and M else None)
    r = route_experts(idx.to(dev), L, valid_rows=valid.to(dev) if valid is not None else None,
                      rows_per_group=group)
    p = permute_rows(q, r)
    total = int(r.offsets[-1])
    src = r.row_of_slot[:total].long()
    assert p.shape == (M * K, 64) and not p.swizzled
    assert torch.equal(p.data[:total], q.data[src])
    assert torch.equal(p.scales[:total].view(torch.uint8), q.scales.view(torch.uint8)[src])
    if q.global_scale.numel() > 1:  # one per row (a single row's scale is a plain scalar)
        assert p.global_scale.shape == (M * K,) and torch.equal(p.global_scale[:total], q.global_scale[src])
    else:
        assert torch.equal(p.global_scale, q.global_scale.reshape(-1))


def _check_route_and_zeroed_counters(case, kept: bool):
    """A route with chain counters (the bridged compute's: made by ``_route``, or kept by a ``KeptRoutes`` and launched
    into twice) has the reference's counts, offsets and slots, and its launch zeroes the counters (set to garbage
    before it)."""
    dev = device()
    idx, L, valid, group = case
    idx = idx.to(dev).contiguous()
    valid = valid.to(dev) if valid is not None else None
    counts, offsets, slot, row_of_slot = route_experts_ref(idx, L, valid, group)
    if kept:
        routes = KeptRoutes(idx.numel() + 5, L, dev)
        r = routes.route(idx)
        if r is None:  # no picks: nothing kept, the caller allocates its route
            assert idx.numel() == 0
            return
        assert routes.route(idx) is r  # one route per shape of ids, made once
        launches = 2  # the second launch over the first one's values
    else:
        r, launches = _route(idx, L, valid, group or 1, chain_ready=True), 1
        if idx.numel() == 0:
            return
    for _ in range(launches):
        r.chain_ready.fill_(7)
        _launch_route(idx, valid, group or 1, L, r, scratch=routes.scratch if kept else None)
        assert torch.equal(r.chain_ready, torch.zeros(L, dtype=torch.int32, device=dev))
        assert torch.equal(r.counts, counts)
        assert torch.equal(r.offsets, offsets)
        assert torch.equal(r.slot, slot)
        assert torch.equal(r.row_of_slot, row_of_slot)


@given(routes(), st.booleans(), st.booleans())
def test_route_zeroes_chain_counters_and_kept_routes_match_reference(case, kept, chunks):
    if chunks:
        _few_chunks(lambda: _check_route_and_zeroed_counters(case, kept))
    else:
        _check_route_and_zeroed_counters(case, kept)


def test_kept_routes_are_views_of_one_allocation(dev):
    """Routes of several shapes share one allocation made at the first route (no torch op later); more picks than
    the capacity, or none, get no kept route."""
    routes = KeptRoutes(24, 3, dev)
    a = routes.route(torch.zeros(4, 2, dtype=torch.int32, device=dev))
    b = routes.route(torch.zeros(2, 3, 4, dtype=torch.int32, device=dev))
    assert a.slot.shape == (4, 2) and b.slot.shape == (6, 4) and b.row_of_slot.shape == (24,)
    assert a.slot.data_ptr() == b.slot.data_ptr() and a.counts is b.counts and a.chain_ready is b.chain_ready
    assert routes.route(torch.zeros(5, 5, dtype=torch.int32, device=dev)) is None
    assert routes.route(torch.zeros(0, 2, dtype=torch.int32, device=dev)) is None


def test_route_is_deterministic_and_ordered(dev):
    idx = torch.tensor([[2, 0], [0, 2], [2, -1], [1, 0]], device=dev)
    r = route_experts(idx, 3)
    assert r.counts.tolist() == [3, 1, 3]
    assert r.offsets.tolist() == [0, 3, 4, 7]
    assert r.slot.tolist() == [[4, 0], [1, 5], [6, -1], [3, 2]]
    assert r.row_of_slot.tolist() == [0, 1, 3, 3, 0, 1, 2, -1]


@pytest.mark.gpu
def test_bridge_no_host_sync_under_graph_capture():
    dev = torch.device("cuda")
    idx = torch.randint(-1, 8, (64, 4), device=dev, dtype=torch.int32)
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    w = torch.rand(64, 4, device=dev)
    r = route_experts(idx, 8)  # warm up (autotune) outside the capture
    unpermute_reduce(permute_rows(x, r), r, w, out_dtype=torch.float32)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r2 = route_experts(idx, 8)
        out = unpermute_reduce(permute_rows(x, r2), r2, w, out_dtype=torch.float32)
    g.replay()
    torch.cuda.synchronize()
    ref = unpermute_reduce_ref(permute_rows_ref(x, r.row_of_slot, int(r.offsets[-1])), r.slot, w)
    # fp32 sums: the kernel's fused multiply-adds round differently from the reference's multiply then add
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
