"""Plain-torch references. These are the definitions the Triton kernels are tested against.

NVFP4 (see DESIGN.md): FP4 E2M1 elements, two per byte (element 2i in the low nibble), one FP8 E4M3
scale per 16 consecutive elements of the last dim, one FP32 global scale per tensor (or per slice of the
leading dim, e.g. per expert). Every step below is a single IEEE fp32 operation, in this order, so a
kernel that does the same operations matches bit for bit. A global scale that is not positive and finite
(0, negative, NaN, Inf) is defined too: its rows quantize to codes 0 with scale 0, and dequantize to NaN.

This module stands alone (it imports only torch): the kernels do not use it, tests and ``moe-ep fuzz`` compare
the kernels with it.
"""

from __future__ import annotations

import torch

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: gs = 2688 / amax maps amax onto the top of both grids
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``2688 / amax`` in fp32; 1.0 where amax is 0 (an all-zero tensor) or the quotient overflows."""
    amax = amax.float()
    # tensor / tensor: torch's CUDA kernel turns division by a Python scalar into a reciprocal multiply,
    # which is not the IEEE division the kernels (div_rn) and this definition use
    gs = torch.full_like(amax, GLOBAL_SCALE_NUMERATOR) / amax
    return torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs))


def nvfp4_global_scale_ref(x: torch.Tensor, per_slice: bool = False) -> torch.Tensor:
    """The default global scale of x: one scalar, or one per ``x[i]`` when ``per_slice``."""
    a = x.abs()  # exact in x's dtype; max is one of its values
    if a.numel() == 0:
        amax = torch.zeros(a.shape[0] if per_slice else (), device=x.device)
    else:
        amax = a.flatten(1).amax(dim=1) if per_slice else a.amax()
    return global_scale_from_amax(amax)


def nvfp4_row_global_scale_ref(x: torch.Tensor) -> torch.Tensor:
    """One global scale per row of ``x [..., K]`` (``x.shape[:-1]``): ``2688 / amax(row)``, 1.0 for an all-zero
    row, NaN for a row holding NaN or Inf (a bad scale: the row quantizes to codes 0 and dequantizes to NaN)."""
    amax = x.abs().amax(dim=-1) if x.numel() else torch.zeros(x.shape[:-1], device=x.device)
    gs = global_scale_from_amax(amax)
    return torch.where(torch.isfinite(amax.float()), gs, torch.full_like(gs, float("nan")))


def e2m1_codes_ref(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E2M1 value (ties to even, saturating at +-6); 4-bit codes.

    The sign bit is the sign bit of v (so -0.0 and tiny negatives give 0x8). NaN gives magnitude 0.
    """
    a = v.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0))
    return mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_values_ref(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _per_row_global_scale(gs: torch.Tensor, lead: int, rows: int) -> torch.Tensor:
    """Global scale broadcast to ``[lead, 1, 1]`` (one per group of rows) from a scalar or ``lead`` values."""
    gs = gs.float().reshape(-1)
    if gs.numel() == 0:  # no rows: one scale per row is no scale
        gs = torch.ones(1, device=gs.device)
    if gs.numel() == 1:
        gs = gs.expand(lead)
    return gs.reshape(lead, 1, 1)


def _scale_groups(x: torch.Tensor, global_scale: torch.Tensor) -> int:
    """How many global scales x's rows use: 1, or n > 1 where scale i covers the i-th of n equal runs of
    consecutive rows (n = x.shape[0]: one per expert of ``[G, N, K]``; n = all rows: one per row, as
    received NVFP4 tokens carry their source rank's scale)."""
    return global_scale.numel() if x.dim() > 1 and global_scale.numel() > 1 else 1


def quantize_nvfp4_ref(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Reference NVFP4 quantization of ``x [..., K]`` (K % 16 == 0).

    ``global_scale``: a scalar, one per ``x[i]`` (shape ``[x.shape[0]]``) or one per row (see
    ``_scale_groups``); None computes the scalar
    ``2688 / amax(x)``. Returns ``(data uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale)``
    with the scales in the linear layout.
    """
    shape = x.shape
    k = shape[-1]
    if global_scale is None:
        global_scale = nvfp4_global_scale_ref(x)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    lead = _scale_groups(x, global_scale)
    xf = x.float().reshape(lead, -1, k // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = _per_row_global_scale(global_scale, lead, xf.shape[1]).unsqueeze(-1)  # [lead, 1, 1, 1]
    amax = xf.abs().amax(dim=-1, keepdim=True)
    ok = (gs > 0) & torch.isfinite(gs)  # a bad global scale: codes 0 and scale 0
    y = ((amax / torch.full_like(amax, E2M1_MAX)) * gs).clamp(max=E4M3_MAX)
    s = torch.where(ok, y, torch.zeros_like(y)).to(torch.float8_e4m3fn)
    sf = s.float()
    inv = torch.where(sf > 0, gs / sf, torch.zeros_like(sf))
    codes = torch.where(ok, e2m1_codes_ref(xf * inv), xf.new_zeros((), dtype=torch.uint8)).reshape(*shape[:-1], k)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return data, s.reshape(*shape[:-1], k // NVFP4_BLOCK), global_scale


def dequantize_nvfp4_ref(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference NVFP4 dequantization: ``(e2m1(q) * float(s)) / gs``, fp32, then cast to ``dtype``.

    ``scales`` in the linear layout ``[..., K/16]``; ``global_scale`` a scalar, one per ``data[i]`` or one
    per row. Rows whose global scale is not positive and finite are NaN.
    """
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)
    k = codes.shape[-1]
    lead = _scale_groups(data, global_scale)
    vals = e2m1_values_ref(codes).reshape(lead, -1, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sf = scales.float().reshape(lead, -1, k // NVFP4_BLOCK, 1)
    gs = _per_row_global_scale(global_scale, lead, vals.shape[1]).unsqueeze(-1)
    ok = (gs > 0) & torch.isfinite(gs)
    out = torch.where(ok, (vals * sf) / gs, vals.new_full((), float("nan")))
    return out.reshape(codes.shape).to(dtype)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_BLOCK = 128  # FP8 scale blocks: 128 columns, and 128 rows for weights (1 for activations)


def quantize_fp8_ref(x: torch.Tensor, block_rows: int, gate_up: bool = False):
    """Reference FP8 block quantization of ``x [..., R, K]`` (``block_rows`` 1: per row per 128 columns, as
    activations; 128: per 128x128 block, as weights; blocks never cross the leading dims).

    Per block: ``s = amax(|x|) / 448`` in fp32 (1.0 where that is 0: an all-zero block has codes 0), then
    ``q = e4m3_rne(clamp(x / s, -448, 448))``. Returns ``(q float8_e4m3fn [..., R, K], s float32
    [..., ceil(R / block_rows), ceil(K / 128)])``. Dequantize: ``q * s``.
    ``gate_up`` (an FP8 w13 ``[..., 2I, K]``): gate's and up's rows are blocked apart, each as above, and the scales
    are gate's row blocks then up's (``[..., 2 * ceil(I / block_rows), ceil(K / 128)]``).
    """
    if gate_up:
        half = x.shape[-2] // 2
        (qg, sg), (qu, su) = quantize_fp8_ref(x[..., :half, :], block_rows), quantize_fp8_ref(x[..., half:, :],
                                                                                             block_rows)
        return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)
    *lead, R, K = x.shape
    br, bc = block_rows, FP8_BLOCK
    nr, nc = -(-R // br), -(-K // bc)
    xf = torch.zeros(*lead, nr * br, nc * bc, dtype=torch.float32, device=x.device)
    xf[..., :R, :K] = x.float()
    blocks = xf.reshape(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nr, nc]: zero padding cannot raise it
    s = amax / torch.full_like(amax, FP8_MAX)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (blocks / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, nr * br, nc * bc)[..., :R, :K].contiguous(), s


def dequantize_fp8_ref(q: torch.Tensor, s: torch.Tensor, block_rows: int, gate_up: bool = False) -> torch.Tensor:
    """``q * s`` in fp32, each scale over its block (see :func:`quantize_fp8_ref`)."""
    if gate_up:
        half, blocks = q.shape[-2] // 2, s.shape[-2] // 2
        return torch.cat([dequantize_fp8_ref(q[..., :half, :], s[..., :blocks, :], block_rows),
                          dequantize_fp8_ref(q[..., half:, :], s[..., blocks:, :], block_rows)], dim=-2)
    *lead, R, K = q.shape
    s_full = s.repeat_interleave(block_rows, dim=-2)[..., :R, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :K]
    return q.float() * s_full


def swizzled_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded (rows, scale columns) of the 128x4 swizzled layout: rows to 128, columns to 4."""
    return -(-rows // 128) * 128, -(-scale_cols // 4) * 4


def swizzle_scales_ref(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales ``[..., M, C]`` -> the 128x4 swizzled layout, flat ``[..., Mp * Cp]`` (zero padded).

    Element (m, c) lands at ``((m // 128) * (Cp // 4) + c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4
    + c % 4``: the layout CUTLASS and ``tl.dot_scaled`` read. Each slice of the leading dims is swizzled
    on its own.
    """
    *lead, m, c = scales.shape
    mp, cp = swizzled_scale_shape(m, c)
    padded = torch.zeros(*lead, mp, cp, dtype=scales.dtype, device=scales.device)
    padded[..., :m, :c] = scales
    u = padded.view(torch.uint8).reshape(*lead, mp // 128, 4, 32, cp // 4, 4)
    nl = len(lead)
    perm = list(range(nl)) + [nl + i for i in (0, 3, 2, 1, 4)]
    return u.permute(*perm).reshape(*lead, mp * cp).view(scales.dtype)


def unswizzle_scales_ref(buf: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales_ref`: flat ``[..., Mp * Cp]`` -> linear ``[..., rows, scale_cols]``."""
    *lead, _ = buf.shape
    mp, cp = swizzled_scale_shape(rows, scale_cols)
    u = buf.view(torch.uint8).reshape(*lead, mp // 128, cp // 4, 32, 4, 4)
    nl = len(lead)
    perm = list(range(nl)) + [nl + i for i in (0, 3, 2, 1, 4)]
    lin = u.permute(*perm).reshape(*lead, mp, cp)
    return lin[..., :rows, :scale_cols].contiguous().view(buf.dtype)


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, *, counts: torch.Tensor | None = None,
                     offsets: torch.Tensor | None = None, swiglu: bool = False,
                     row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference grouped GEMM ``y_g = x_g @ w_g^T`` in fp32, for dense (dequantized) operands.

    masked: ``x [G, M, K]`` with ``counts [G]``: rows ``>= counts[g]`` of group g are left 0.
    ragged: ``x [S, K]`` with ``offsets [G+1]``: rows ``offsets[g]:offsets[g+1]`` belong to group g.
    ``w [G, N, K]``. ``swiglu``: ``N = 2I`` (gate rows then up rows) and the result is
    ``silu(gate) * up``, ``[*, I]``. ``row_scale``: one factor per row of x (``[G, M]`` or ``[S]``),
    applied to the output row.
    """
    xf, wf = x.float(), w.float()
    if counts is not None:
        out_rows = xf @ wf.transpose(1, 2)  # [G, M, N]
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < counts.to(x.device)[:, None]
    else:
        out_rows = torch.zeros(x.shape[0], w.shape[1], device=x.device)
        off = offsets.tolist()
        for g in range(w.shape[0]):
            out_rows[off[g]:off[g + 1]] = xf[off[g]:off[g + 1]] @ wf[g].T
        valid = None
    if swiglu:
        n = out_rows.shape[-1] // 2
        gate, up = out_rows[..., :n], out_rows[..., n:]
        out_rows = torch.nn.functional.silu(gate) * up
    if row_scale is not None:
        out_rows = out_rows * row_scale.float().unsqueeze(-1)
    if valid is not None:
        out_rows = out_rows * valid.unsqueeze(-1)
    return out_rows


def expert_mlp_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, counts: torch.Tensor | None = None,
                   offsets: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference expert MLP ``(silu(x W1^T) * (x W3^T)) W2^T`` per group, fp32, dense operands.

    ``w13 [G, 2I, H]`` (gate rows then up rows), ``w2 [G, H, I]``; layouts and ``row_scale`` as in
    :func:`grouped_gemm_ref` (the row scale is applied to the output of the second GEMM).
    """
    h = grouped_gemm_ref(x, w13, counts=counts, offsets=offsets, swiglu=True)
    return grouped_gemm_ref(h, w2, counts=counts, offsets=offsets, row_scale=row_scale)


def swiglu_fp8_ref(h: torch.Tensor):
    """The FP8 output of an FP8 expert MLP's GEMM1: the fp32 SwiGLU values ``h [..., I]`` (not rounded to bf16
    first) quantized per row per 128 columns, as activations (:func:`quantize_fp8_ref` with ``block_rows`` 1).
    Returns ``(q float8_e4m3fn [..., I], s float32 [..., ceil(I / 128)])``."""
    return quantize_fp8_ref(h.float(), 1)


def expert_mlp_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, counts: torch.Tensor | None = None,
                       offsets: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference FP8 expert MLP on dense (dequantized) FP8 operands ``x``, ``w13``, ``w2``: as
    :func:`expert_mlp_ref`, but GEMM1's fp32 SwiGLU result is quantized to FP8 (:func:`swiglu_fp8_ref`) and GEMM2
    multiplies its dequantized values."""
    h = grouped_gemm_ref(x, w13, counts=counts, offsets=offsets, swiglu=True)
    q, s = swiglu_fp8_ref(h)
    return grouped_gemm_ref(dequantize_fp8_ref(q, s, 1), w2, counts=counts, offsets=offsets, row_scale=row_scale)


# --- the layout bridge (moe_ep.kernels.bridge) and the dense MoE ---------------------------------------


def route_experts_ref(topk_idx: torch.Tensor, num_local_experts: int, valid_rows: torch.Tensor | None = None,
                      rows_per_group: int | None = None):
    """Reference of ``bridge.route_experts``: ``(counts [L], offsets [L+1], slot [M, K], row_of_slot [M*K])``,
    int32. A pick is valid when its id is in ``[0, L)`` and its row is within its group's ``valid_rows``
    count; within an expert, slots follow ascending ``(row, k)``; invalid picks get slot -1 and slots past
    ``offsets[L]`` get row -1.
    """
    M, K = topk_idx.shape
    L = num_local_experts
    ids = topk_idx.long().cpu().clone()
    ok = (ids >= 0) & (ids < L)
    if valid_rows is not None:
        r = torch.arange(M)
        ok &= (r % rows_per_group < valid_rows.long().cpu()[r // rows_per_group])[:, None]
    ids[~ok] = -1
    counts = torch.tensor([int((ids == e).sum()) for e in range(L)], dtype=torch.int64)
    offsets = torch.zeros(L + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    slot = torch.full((M, K), -1, dtype=torch.int64)
    row_of_slot = torch.full((M * K,), -1, dtype=torch.int64)
    nxt = offsets[:-1].clone()
    for row in range(M):
        for k in range(K):
            e = int(ids[row, k])
            if e >= 0:
                slot[row, k] = nxt[e]
                row_of_slot[nxt[e]] = row
                nxt[e] += 1
    dev = topk_idx.device
    return tuple(t.to(torch.int32).to(dev) for t in (counts, offsets, slot, row_of_slot))


def padded_slots_ref(topk_idx: torch.Tensor, num_local_experts: int, padded_rows: int,
                     valid_rows: torch.Tensor | None = None, rows_per_group: int | None = None) -> torch.Tensor:
    """Reference of ``route_experts(..., padded_rows=P)``'s slots ``[M, K]`` int32: the j-th valid pick of expert e
    (ascending ``(row, k)``, as :func:`route_experts_ref` orders them) at ``e * P + j``; -1 when the pick is not
    here or ``j >= P``."""
    _, offsets, slot, _ = route_experts_ref(topk_idx, num_local_experts, valid_rows, rows_per_group)
    s, off, ids = slot.long().cpu(), offsets.long().cpu(), topk_idx.long().cpu()
    out = torch.full(s.shape, -1, dtype=torch.int64)
    for (m, k) in (s >= 0).nonzero().tolist():
        e = int(ids[m, k])
        j = int(s[m, k]) - int(off[e])
        if j < padded_rows:
            out[m, k] = e * padded_rows + j
    return out.to(torch.int32).to(topk_idx.device)


def slot_weights_ref(slot: torch.Tensor, weights: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``route_experts(..., weights=w)``'s ``slot_weight``: ``(filled [n_slots] bool, values [n_slots]
    fp32)``, ``values[slot[m, k]] = float(w[m, k])`` for every valid slot (the rest are not written)."""
    s, w = slot.long().cpu().reshape(-1), weights.float().cpu().reshape(-1)
    filled = torch.zeros(n_slots, dtype=torch.bool)
    values = torch.zeros(n_slots, dtype=torch.float32)
    ok = s >= 0
    filled[s[ok]] = True
    values[s[ok]] = w[ok]
    return filled.to(slot.device), values.to(slot.device)


def scatter_rows_ref(x: torch.Tensor, slot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference of ``bridge.scatter_rows``: a copy of ``out`` with ``out[slot[m, k]] = x[m]`` for every slot in
    ``[0, out.shape[0])`` (slots distinct)."""
    res = out.clone()
    s = slot.long()
    for m, k in ((s >= 0) & (s < out.shape[0])).nonzero().tolist():
        res[s[m, k]] = x[m]
    return res


def permute_rows_ref(x: torch.Tensor, row_of_slot: torch.Tensor, total: int) -> torch.Tensor:
    """Reference gather: the first ``total`` rows of ``x[row_of_slot]``."""
    return x[row_of_slot[:total].long()]


def unpermute_reduce_ref(y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``out[row] = sum_k w[row, k] * y[slot[row, k]]`` in fp32 (slot -1 skipped), ``[M, H]``."""
    M, K = slot.shape
    out = torch.zeros(M, y.shape[-1], dtype=torch.float32, device=y.device)
    for k in range(K):
        s = slot[:, k].long()
        hit = s >= 0
        v = y.float()[s.clamp(min=0)]
        if weights is not None:
            v = v * weights[:, k].float()[:, None]
        out += torch.where(hit[:, None], v, torch.zeros_like(v))  # a skipped pick adds +0 (even over NaN)
    return out


def moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """Dense single-process MoE in fp32: ``out[b] = sum_k w[b, k] * expert_{idx[b, k]}(x[b])`` (id -1 skipped).

    ``x [B, H]``, ``topk_idx [B, K]`` global ids, ``topk_weights [B, K]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``
    dense (dequantize NVFP4 weights first). Returns fp32 ``[B, H]``.
    """
    xf = x.float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    n = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        rows, ks = (topk_idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = xf[rows] @ w13[e].float().T
        y = (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ w2[e].float().T
        out.index_add_(0, rows, y * topk_weights[rows, ks].float()[:, None])
    return out
