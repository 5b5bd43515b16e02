"""Bad input to the NVFP4 and bridge launchers: one table, one row per case.

A row is ``(id, call, expected)``: ``call(dev)`` builds the bad input and calls the function; ``expected`` is
``Raises(type, fragment)`` (the named error, whose message names the argument) or ``Exactly(values)`` for the
cases whose defined answer is a result: ``call`` then returns a dict of tensors and ``values(dev)`` the dict they
must equal exactly (NaN where NaN is the answer). Cases that used to read or write out of bounds are proven with
sentinels, not assumed: inputs live inside larger buffers whose rows just past (and before) the logical ends hold
planted values that must never reach the output, and outputs live inside buffers filled with a sentinel that must
stay untouched around them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from moe_ep.errors import MoEEpInputError
from moe_ep.kernels.bridge import Route, permute_rows, route_experts, scatter_rows, unpermute_reduce
from moe_ep.kernels.fp8 import quantize_fp8
from moe_ep.kernels.nvfp4 import (NvFp4Tensor, dequantize_nvfp4, gather_quantize_nvfp4, nvfp4_global_scale,
                                  quantize_nvfp4, swizzle_scales, unswizzle_scales)

META = "meta"
E4M3_448 = 0x7E  # the E4M3 byte of 448.0: the block scale of a block whose amax is 6 at global scale 448


@dataclass
class Raises:
    exc: type
    fragment: str


@dataclass
class Exactly:
    values: callable  # dev -> {name: tensor}


# --- builders ------------------------------------------------------------------------------------------------

def q4(dev, rows=4, k=32, **kw):
    """A valid NvFp4Tensor [rows, k] to break one part of."""
    return quantize_nvfp4(torch.randn(rows, k, device=dev), **kw)


def parts(dev, rows=4, k=32, **over):
    """The parts of a valid [rows, k] NvFp4Tensor, with ``over`` replacing some, as NvFp4Tensor kwargs."""
    q = q4(dev, rows, k)
    p = dict(data=q.data, scales=q.scales, global_scale=q.global_scale, shape=q.shape, swizzled=False)
    p.update(over)
    return p


def route(dev, m=4, k=2, L=4):
    return route_experts(torch.randint(-1, L, (m, k), device=dev), L)


def idx(dev, m=4, k=2, L=4, dtype=torch.int64):
    return torch.randint(-1, L, (m, k), device=dev, dtype=dtype)


def fp8(values, dev):
    """float8_e4m3fn tensor from raw bytes (nested lists)."""
    return torch.tensor(values, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)


# --- the cases that have a defined result ------------------------------------------------------------------

def route_huge_int64_ids(dev):
    # ids of 2^31 and more, and ones whose low 32 bits are a local id (2^32 + 1 -> 1, -2^32 + 2 -> 2 if narrowed),
    # are "not here"; rows 0 and 4 of the buffer are planted expert-0 ids just before / past topk_idx
    buf = torch.zeros(5, 2, dtype=torch.int64, device=dev)
    buf[1:4] = torch.tensor([[2 ** 32 + 1, 1], [2 ** 31, -(2 ** 32) + 2], [2 ** 63 - 1, 3]])
    r = route_experts(buf[1:4], 4)
    return {"counts": r.counts, "offsets": r.offsets, "slot": r.slot, "row_of_slot": r.row_of_slot}


def route_huge_int64_ids_expected(dev):
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    return {"counts": t([0, 1, 0, 1]), "offsets": t([0, 0, 1, 1, 2]), "slot": t([[-1, 0], [-1, -1], [-1, 1]]),
            "row_of_slot": t([0, 2, -1, -1, -1, -1])}


def route_huge_valid_count(dev):
    # a count of 2^32 + 1 rows covers the whole group of 4 (narrowed to int32 it would be 1)
    r = route_experts(torch.arange(4, device=dev)[:, None], 4,
                      valid_rows=torch.tensor([2 ** 32 + 1], device=dev), rows_per_group=4)
    return {"counts": r.counts}


def gather_quantize_out_of_range(dev):
    # x = rows 1..2 of a buffer whose rows 0 and 3 are planted (6, 0, 6, 0, ...: codes 0x07); unchecked indices 2
    # (x's end) and -3 must give all-zero rows, never the planted rows' codes
    xb = torch.tensor([6.0, 0.0], device=dev).repeat(4, 8)
    xb[1], xb[2] = 6.0, -6.0
    q = gather_quantize_nvfp4(xb[1:3], torch.tensor([0, 2, -3, 1, 5], device=dev), 448.0, check_finite=False)
    return {"data": q.data, "scales": q.scales.view(torch.uint8)}


def gather_quantize_out_of_range_expected(dev):
    row = lambda b: [b] * 8  # noqa: E731
    return {"data": torch.tensor([row(0x77), row(0), row(0), row(0xFF), row(0)], dtype=torch.uint8, device=dev),
            "scales": torch.tensor([[E4M3_448], [0], [0], [E4M3_448], [0]], dtype=torch.uint8, device=dev)}


def permute_stale_route(dev):
    # a hand-made route whose row_of_slot points past x: the slot gets zeros, the planted rows (99) around x
    # never arrive, and the NaN rows around out stay NaN
    xb = torch.full((4, 8), 99.0, dtype=torch.bfloat16, device=dev)
    xb[1], xb[2] = 1.0, 2.0
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    r = Route(i32([2]), i32([0, 2]), i32([[1], [0]]), i32([2, 0]))
    ob = torch.full((4, 8), math.nan, dtype=torch.bfloat16, device=dev)
    permute_rows(xb[1:3], r, out=ob[1:3])
    return {"out_buffer": ob}


def permute_stale_route_expected(dev):
    ob = torch.full((4, 8), math.nan, dtype=torch.bfloat16, device=dev)
    ob[1], ob[2] = 0.0, 1.0
    return {"out_buffer": ob}


def scatter_slot_past_out(dev):
    # a hand-made slot past out's rows (and one below 0) writes nothing; the other pick lands, out's rest stays
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    x = torch.tensor([[1.0, 1.0], [2.0, 2.0]], device=dev)
    ob = torch.full((4, 2), 9.0, device=dev)
    scatter_rows(x, Route(None, None, i32([[3, -5], [0, 2]]), None), ob[:3])
    return {"out_buffer": ob}


def scatter_slot_past_out_expected(dev):
    return {"out_buffer": torch.tensor([[2.0, 2.0], [9.0, 9.0], [2.0, 2.0], [9.0, 9.0]], device=dev)}


def unpermute_short_y(dev):
    # 5 valid slots, y holds 3 (its buffer's rows 3.. are planted 1e6): rows reading slots 3 and 4 are NaN,
    # the planted values never arrive, and the sentinel rows around out are untouched
    r = route_experts(torch.tensor([[0, 1], [1, -1], [0, 0]], device=dev), 2)
    yb = torch.full((6, 4), 1e6, device=dev)
    yb[:3] = torch.tensor([1.0, 2.0, 3.0], device=dev)[:, None]
    ob = torch.full((5, 4), 12345.0, device=dev)
    unpermute_reduce(yb[:3], r, out=ob[1:4])
    return {"slot": r.slot, "out_buffer": ob}


def unpermute_short_y_expected(dev):
    ob = torch.full((5, 4), 12345.0, device=dev)
    ob[1:3] = math.nan
    ob[3] = 5.0
    return {"slot": torch.tensor([[0, 3], [4, -1], [1, 2]], dtype=torch.int32, device=dev), "out_buffer": ob}


def unpermute_noncontiguous_slot(dev):
    slot = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32, device=dev).T  # [[0, 1], [2, -1]], a view
    y = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]], device=dev)
    return {"out": unpermute_reduce(y, Route(None, None, slot, None), out_dtype=torch.float32)}


def quantize_zero_device_scale(dev):
    q = quantize_nvfp4(-torch.ones(2, 32, device=dev), torch.tensor(0.0, device=dev), check_finite=False)
    return {"data": q.data, "scales": q.scales.view(torch.uint8), "dequantized": dequantize_nvfp4(q, torch.float32)}


def quantize_zero_device_scale_expected(dev):
    return {"data": torch.zeros(2, 16, dtype=torch.uint8, device=dev),
            "scales": torch.zeros(2, 2, dtype=torch.uint8, device=dev),
            "dequantized": torch.full((2, 32), math.nan, device=dev)}


def quantize_bad_per_slice_scales(dev):
    gs = torch.tensor([448.0, -1.0, math.nan, math.inf], device=dev)
    q = quantize_nvfp4(torch.full((4, 1, 16), 6.0, device=dev), gs, check_finite=False)
    return {"data": q.data, "scales": q.scales.view(torch.uint8)}


def quantize_bad_per_slice_scales_expected(dev):
    data = torch.zeros(4, 1, 8, dtype=torch.uint8, device=dev)
    scales = torch.zeros(4, 1, 1, dtype=torch.uint8, device=dev)
    data[0], scales[0] = 0x77, E4M3_448
    return {"data": data, "scales": scales}


def nv_rows(dev, byte, scale_bytes, gs):
    """An NvFp4Tensor [len(gs), 16] of one code byte everywhere, the given scale bytes and global scales."""
    n = len(gs)
    return NvFp4Tensor(torch.full((n, 8), byte, dtype=torch.uint8, device=dev), fp8([[b] for b in scale_bytes], dev),
                       torch.tensor(gs, device=dev), torch.Size((n, 16)))


def dequantize_bad_row_scales(dev):
    q = nv_rows(dev, 0x77, [E4M3_448] * 5, [448.0, 0.0, -448.0, math.inf, math.nan])
    return {"out": dequantize_nvfp4(q, torch.float32)}


def dequantize_bad_row_scales_expected(dev):
    out = torch.full((5, 16), math.nan, device=dev)
    out[0] = 6.0
    return {"out": out}


def dequantize_signed_and_nan_block_scales(dev):
    # scale bytes quantize never writes (-448, NaN): dequantized as their E4M3 values, as the reference reads them
    return {"out": dequantize_nvfp4(nv_rows(dev, 0x22, [E4M3_448, 0xFE, 0x7F], [448.0] * 3), torch.float32)}


def dequantize_signed_and_nan_block_scales_expected(dev):
    return {"out": torch.tensor([1.0, -1.0, math.nan], device=dev)[:, None].expand(3, 16).contiguous()}


def dequantize_noncontiguous_data(dev):
    big = torch.full((2, 16), 0x77, dtype=torch.uint8, device=dev)
    big[:, :8] = 0x22
    q = NvFp4Tensor(big[:, :8], fp8([[E4M3_448]] * 2, dev), torch.tensor(448.0, device=dev), torch.Size((2, 16)))
    return {"out": dequantize_nvfp4(q, torch.float32)}


# --- the table ---------------------------------------------------------------------------------------------

I = MoEEpInputError  # noqa: E741
CASES = [
    # NvFp4Tensor: its parts must agree with its shape and with each other
    ("nvfp4_tensor_short_data", lambda d: NvFp4Tensor(**parts(d, data=q4(d, 2).data)), Raises(I, "NvFp4Tensor.data.shape")),
    ("nvfp4_tensor_short_scales", lambda d: NvFp4Tensor(**parts(d, scales=q4(d, 2).scales)),
     Raises(I, "NvFp4Tensor.scales.shape")),
    ("nvfp4_tensor_data_dtype", lambda d: NvFp4Tensor(**parts(d, data=q4(d).data.to(torch.int8))),
     Raises(I, "NvFp4Tensor.data.dtype")),
    ("nvfp4_tensor_scales_as_bytes", lambda d: NvFp4Tensor(**parts(d, scales=q4(d).scales.view(torch.uint8))),
     Raises(I, "NvFp4Tensor.scales.dtype")),
    ("nvfp4_tensor_gs_float64", lambda d: NvFp4Tensor(**parts(d, global_scale=torch.ones((), dtype=torch.float64))),
     Raises(I, "NvFp4Tensor.global_scale.dtype")),
    ("nvfp4_tensor_gs_count", lambda d: NvFp4Tensor(**parts(d, global_scale=torch.ones(3, device=d))),
     Raises(I, "NvFp4Tensor.global_scale.numel()")),
    ("nvfp4_tensor_mixed_devices", lambda d: NvFp4Tensor(**parts(d, global_scale=torch.ones((), device=META))),
     Raises(I, "NvFp4Tensor devices")),
    ("nvfp4_tensor_swizzled_flag_linear_scales", lambda d: NvFp4Tensor(**parts(d, swizzled=True)),
     Raises(I, "128x4 swizzled layout")),
    ("nvfp4_tensor_linear_flag_swizzled_scales", lambda d: NvFp4Tensor(**parts(d, scales=q4(d, swizzle=True).scales)),
     Raises(I, "linear layout")),
    ("nvfp4_tensor_k_not_16", lambda d: NvFp4Tensor(**parts(d, shape=torch.Size((4, 24)))), Raises(I, "NvFp4Tensor.shape")),
    ("nvfp4_tensor_shape_not_ints", lambda d: NvFp4Tensor(**parts(d, shape=("4", 32))), Raises(I, "NvFp4Tensor.shape")),
    ("nvfp4_tensor_data_a_list", lambda d: NvFp4Tensor(**parts(d, data=[0] * 64)), Raises(I, "type(NvFp4Tensor.data)")),
    ("nvfp4_tensor_swizzled_not_bool", lambda d: NvFp4Tensor(**parts(d, swizzled="no")), Raises(I, "NvFp4Tensor.swizzled")),
    # dequantize_nvfp4
    ("dequantize_data_replaced_by_longer", lambda d: dequantize_nvfp4(_replaced(q4(d, 2), data=q4(d, 8).data)),
     Raises(I, "q.data.shape")),
    ("dequantize_meta_parts", lambda d: dequantize_nvfp4(NvFp4Tensor(
        torch.empty(2, 16, dtype=torch.uint8, device=META), torch.empty(2, 2, dtype=torch.float8_e4m3fn, device=META),
        torch.empty((), device=META), torch.Size((2, 32)))), Raises(I, "q.data.device")),
    ("dequantize_dtype_a_string", lambda d: dequantize_nvfp4(q4(d), "bf16"), Raises(I, "dtype")),
    ("dequantize_not_nvfp4", lambda d: dequantize_nvfp4(torch.zeros(2, 16, dtype=torch.uint8, device=d)),
     Raises(I, "type(q)")),
    # quantize_nvfp4
    ("quantize_meta_x", lambda d: quantize_nvfp4(torch.empty(2, 32, device=META)), Raises(I, "x.device")),
    ("quantize_gs_zero_float", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), 0.0), Raises(I, "global_scale")),
    ("quantize_gs_nan_float", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), math.nan), Raises(I, "global_scale")),
    ("quantize_gs_minus_inf", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), -math.inf), Raises(I, "global_scale")),
    ("quantize_gs_bool", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), True), Raises(I, "type(global_scale)")),
    ("quantize_gs_int_tensor", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), torch.tensor(3, device=d)),
     Raises(I, "global_scale.dtype")),
    ("quantize_gs_tensor_negative_checked", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d),
                                                                     torch.tensor(-2.0, device=d)),
     Raises(I, "global_scale = ")),
    ("quantize_gs_meta", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), torch.ones((), device=META)),
     Raises(I, "global_scale.device")),
    ("quantize_swizzle_not_bool", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), swizzle="yes"),
     Raises(I, "swizzle")),
    ("quantize_check_finite_not_bool", lambda d: quantize_nvfp4(torch.randn(2, 32, device=d), check_finite=None),
     Raises(I, "check_finite")),
    # gather_quantize_nvfp4
    ("gather_row_index_2d", lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d),
                                                            torch.zeros(2, 2, dtype=torch.int64, device=d)),
     Raises(I, "row_index.shape")),
    ("gather_row_index_meta", lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d),
                                                              torch.zeros(2, dtype=torch.int64, device=META)),
     Raises(I, "row_index.device")),
    ("gather_row_index_list", lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d), [0, 1]),
     Raises(I, "type(row_index)")),
    ("gather_per_row_gs", lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d), torch.arange(4, device=d),
                                                          torch.ones(4, device=d)), Raises(I, "global_scale.shape")),
    # nvfp4_global_scale
    ("global_scale_per_slice_not_bool", lambda d: nvfp4_global_scale(torch.randn(2, 32, device=d), per_slice="yes"),
     Raises(I, "per_slice")),
    ("global_scale_int_x", lambda d: nvfp4_global_scale(torch.ones(2, 32, dtype=torch.int32, device=d)),
     Raises(I, "x.dtype")),
    # swizzle_scales / unswizzle_scales: linear vs swizzled misuse
    ("swizzle_bytes_not_fp8", lambda d: swizzle_scales(torch.zeros(4, 2, dtype=torch.uint8, device=d)),
     Raises(I, "scales.dtype")),
    ("swizzle_already_flat", lambda d: swizzle_scales(q4(d, swizzle=True).scales), Raises(I, "scales.dim()")),
    ("swizzle_a_list", lambda d: swizzle_scales([[0.0]]), Raises(I, "type(scales)")),
    ("unswizzle_linear_scales", lambda d: unswizzle_scales(q4(d).scales, 4, 2), Raises(I, "buf.shape[-1]")),
    ("unswizzle_wrong_rows", lambda d: unswizzle_scales(q4(d, swizzle=True).scales, 200, 2), Raises(I, "buf.shape[-1]")),
    ("unswizzle_rows_a_string", lambda d: unswizzle_scales(q4(d, swizzle=True).scales, "x", 2), Raises(I, "rows")),
    ("unswizzle_meta", lambda d: unswizzle_scales(torch.empty(512, dtype=torch.float8_e4m3fn, device=META), 4, 2),
     Raises(I, "buf.device")),
    # route_experts
    ("route_experts_float_count", lambda d: route_experts(idx(d), 2.5), Raises(I, "num_local_experts")),
    ("route_experts_bool_count", lambda d: route_experts(idx(d), True), Raises(I, "num_local_experts")),
    ("route_float_ids", lambda d: route_experts(idx(d).float(), 4), Raises(I, "topk_idx.dtype")),
    ("route_1d_ids", lambda d: route_experts(idx(d).reshape(-1), 4), Raises(I, "topk_idx.shape")),
    ("route_ids_a_list", lambda d: route_experts([[0, 1]], 4), Raises(I, "type(topk_idx)")),
    ("route_meta_ids", lambda d: route_experts(torch.zeros(4, 2, dtype=torch.int64, device=META), 4),
     Raises(I, "topk_idx.device")),
    ("route_rows_per_group_string", lambda d: route_experts(idx(d), 4, valid_rows=torch.ones(1, device=d).long(),
                                                            rows_per_group="x"), Raises(I, "rows_per_group")),
    ("route_valid_rows_short", lambda d: route_experts(idx(d, m=6), 4, valid_rows=torch.ones(2, dtype=torch.int32,
                                                                                             device=d), rows_per_group=2),
     Raises(I, "valid_rows.shape")),
    ("route_valid_rows_float", lambda d: route_experts(idx(d), 4, valid_rows=torch.ones(1, device=d), rows_per_group=4),
     Raises(I, "valid_rows.dtype")),
    ("route_valid_rows_meta", lambda d: route_experts(idx(d), 4, valid_rows=torch.ones(1, dtype=torch.int64, device=META),
                                                      rows_per_group=4), Raises(I, "valid_rows.device")),
    ("route_rows_per_group_alone", lambda d: route_experts(idx(d), 4, rows_per_group=2), Raises(I, "rows_per_group")),
    ("route_huge_int64_ids_not_here", route_huge_int64_ids, Exactly(route_huge_int64_ids_expected)),
    ("route_huge_valid_count_not_narrowed", route_huge_valid_count,
     Exactly(lambda d: {"counts": torch.ones(4, dtype=torch.int32, device=d)})),
    ("route_padded_rows_zero", lambda d: route_experts(idx(d), 4, padded_rows=0), Raises(I, "padded_rows")),
    ("route_padded_rows_past_int32", lambda d: route_experts(idx(d), 4, padded_rows=2 ** 29), Raises(I, "padded_rows")),
    ("route_padded_rows_bool", lambda d: route_experts(idx(d), 4, padded_rows=True), Raises(I, "padded_rows")),
    ("route_weights_wrong_shape", lambda d: route_experts(idx(d), 4, weights=torch.rand(4, 3, device=d)),
     Raises(I, "weights")),
    ("route_weights_int", lambda d: route_experts(idx(d), 4, weights=torch.ones(4, 2, dtype=torch.int32, device=d)),
     Raises(I, "weights")),
    ("route_weights_a_list", lambda d: route_experts(idx(d), 4, weights=[[1.0, 1.0]] * 4), Raises(I, "type(weights)")),
    # Route
    ("route_int_slot_weight", lambda d: Route(None, None, torch.zeros(2, 2, dtype=torch.int32, device=d), None,
                                              torch.zeros(4, dtype=torch.int32, device=d)),
     Raises(I, "route.slot_weight")),
    ("route_int64_slot", lambda d: Route(None, None, torch.zeros(2, 2, dtype=torch.int64, device=d), None),
     Raises(I, "route.slot")),
    ("route_row_of_slot_length", lambda d: Route(None, None, torch.zeros(2, 2, dtype=torch.int32, device=d),
                                                 torch.zeros(3, dtype=torch.int32, device=d)),
     Raises(I, "route.row_of_slot.shape")),
    ("route_offsets_length", lambda d: Route(torch.zeros(4, dtype=torch.int32, device=d),
                                             torch.zeros(4, dtype=torch.int32, device=d), None, None),
     Raises(I, "route.offsets.shape")),
    ("route_mixed_devices", lambda d: Route(torch.zeros(4, dtype=torch.int32, device=d),
                                            torch.zeros(5, dtype=torch.int32, device=META), None, None),
     Raises(I, "route devices")),
    # scatter_rows
    ("scatter_x_rows_not_the_routes", lambda d: scatter_rows(torch.randn(3, 8, device=d), route(d),
                                                             torch.empty(8, 8, device=d)), Raises(I, "x.shape[0]")),
    ("scatter_out_dtype", lambda d: scatter_rows(torch.randn(4, 8, device=d), route(d),
                                                 torch.empty(8, 8, dtype=torch.float16, device=d)), Raises(I, "out")),
    ("scatter_out_width", lambda d: scatter_rows(torch.randn(4, 8, device=d), route(d), torch.empty(8, 4, device=d)),
     Raises(I, "out")),
    ("scatter_out_not_contiguous", lambda d: scatter_rows(torch.randn(4, 8, device=d), route(d),
                                                          torch.empty(8, 8, device=d).T), Raises(I, "out")),
    ("scatter_out_missing", lambda d: scatter_rows(torch.randn(4, 8, device=d), route(d), None), Raises(I, "type(out)")),
    ("scatter_x_bool", lambda d: scatter_rows(torch.ones(4, 8, dtype=torch.bool, device=d), route(d),
                                              torch.empty(8, 8, dtype=torch.bool, device=d)), Raises(I, "x")),
    ("scatter_route_without_slot", lambda d: scatter_rows(torch.randn(4, 8, device=d), _replaced(route(d), slot=None),
                                                          torch.empty(8, 8, device=d)), Raises(I, "route.slot")),
    ("scatter_slot_past_out_writes_nothing", scatter_slot_past_out, Exactly(scatter_slot_past_out_expected)),
    # permute_rows
    ("permute_x_fewer_rows_than_route", lambda d: permute_rows(torch.randn(3, 8, device=d), route(d)),
     Raises(I, "x.shape[0]")),
    ("permute_meta_x", lambda d: permute_rows(torch.empty(4, 8, device=META), route(d)), Raises(I, "x.device")),
    ("permute_out_dtype", lambda d: permute_rows(torch.randn(4, 8, device=d), route(d),
                                                 out=torch.empty(8, 8, dtype=torch.float16, device=d)), Raises(I, "out")),
    ("permute_out_not_contiguous", lambda d: permute_rows(torch.randn(4, 8, device=d), route(d),
                                                          out=torch.empty(8, 8, device=d).T), Raises(I, "out")),
    ("permute_route_a_tuple", lambda d: permute_rows(torch.randn(4, 8, device=d), tuple(vars(route(d)).values())),
     Raises(I, "type(route)")),
    ("permute_route_without_rows", lambda d: permute_rows(torch.randn(4, 8, device=d), _replaced(route(d),
                                                                                                 row_of_slot=None)),
     Raises(I, "route.row_of_slot")),
    ("permute_nvfp4_and_quantize", lambda d: permute_rows(q4(d), route(d), quantize=True), Raises(I, "quantize")),
    ("permute_nvfp4_swizzled", lambda d: permute_rows(q4(d, swizzle=True), route(d)), Raises(I, "linear scales")),
    ("permute_nvfp4_fewer_rows", lambda d: permute_rows(q4(d, 3), route(d)), Raises(I, "x.shape[0]")),
    ("permute_fp8_weight_blocks", lambda d: permute_rows(quantize_fp8(torch.randn(4, 128, device=d), 128), route(d)),
     Raises(I, "block_rows 1")),
    ("permute_fp8_and_out", lambda d: permute_rows(quantize_fp8(torch.randn(4, 128, device=d), 1), route(d),
                                                   out=torch.empty(8, 128, device=d)), Raises(I, "Fp8Tensor x")),
    ("permute_stale_route_reads_nothing_past_x", permute_stale_route, Exactly(permute_stale_route_expected)),
    # unpermute_reduce
    ("unpermute_1d_y", lambda d: unpermute_reduce(torch.randn(64, device=d), route(d)), Raises(I, "y.shape")),
    ("unpermute_int_y", lambda d: unpermute_reduce(torch.ones(8, 4, dtype=torch.int32, device=d), route(d)),
     Raises(I, "y.dtype")),
    ("unpermute_weights_shape", lambda d: unpermute_reduce(torch.randn(8, 4, device=d), route(d),
                                                           torch.ones(4, 3, device=d)), Raises(I, "weights.shape")),
    ("unpermute_weights_meta", lambda d: unpermute_reduce(torch.randn(8, 4, device=d), route(d),
                                                          torch.ones(4, 2, device=META)), Raises(I, "weights")),
    ("unpermute_out_dtype_int", lambda d: unpermute_reduce(torch.randn(8, 4, device=d), route(d),
                                                           out_dtype=torch.int32), Raises(I, "out_dtype")),
    ("unpermute_short_y_gives_nan_rows", unpermute_short_y, Exactly(unpermute_short_y_expected)),
    ("unpermute_noncontiguous_slot", unpermute_noncontiguous_slot,
     Exactly(lambda d: {"out": torch.tensor([[3.0, 3.0], [4.0, 4.0]], device=d)})),
    # defined results of NVFP4
    ("gather_quantize_unchecked_index_reads_nothing_past_x", gather_quantize_out_of_range,
     Exactly(gather_quantize_out_of_range_expected)),
    ("quantize_zero_device_scale", quantize_zero_device_scale, Exactly(quantize_zero_device_scale_expected)),
    ("quantize_bad_per_slice_scales", quantize_bad_per_slice_scales, Exactly(quantize_bad_per_slice_scales_expected)),
    ("dequantize_bad_row_scales_nan", dequantize_bad_row_scales, Exactly(dequantize_bad_row_scales_expected)),
    ("dequantize_signed_and_nan_block_scales", dequantize_signed_and_nan_block_scales,
     Exactly(dequantize_signed_and_nan_block_scales_expected)),
    ("dequantize_noncontiguous_data", dequantize_noncontiguous_data,
     Exactly(lambda d: {"out": torch.ones(2, 16, device=d)})),
]


def _replaced(obj, **parts):
    """``obj`` with some attributes reassigned after it was made (a dataclass is not frozen)."""
    for k, v in parts.items():
        setattr(obj, k, v)
    return obj


def test_table_is_big_and_ids_unique():
    assert len(CASES) >= 35
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(dev, call, expected):
    if isinstance(expected, Raises):
        with pytest.raises(expected.exc) as info:
            call(dev)
        msg = str(info.value)
        assert expected.fragment in msg, msg
        assert "allowed" in msg, msg  # the message says what is allowed
        return
    got, want = call(dev), expected.values(dev)
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        if g.dtype.is_floating_point:
            assert torch.equal(torch.isnan(g), torch.isnan(w)), (name, g, w)
            assert torch.equal(torch.nan_to_num(g, nan=0.0), torch.nan_to_num(w, nan=0.0)), (name, g, w)
        else:
            assert torch.equal(g, w), (name, g, w)
