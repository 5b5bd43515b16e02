"""Plain-torch references. These are the definitions the Triton kernels are tested against.

NVFP4 (see DESIGN.md): FP4 E2M1 elements, two per byte (element 2i in the low nibble), one FP8 E4M3
scale per 16 consecutive elements of the last dim, one FP32 global scale per tensor (or per slice of the
leading dim, e.g. per expert). Every step below is a single IEEE fp32 operation, in this order, so a
kernel that does the same operations matches bit for bit.
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
    gs = GLOBAL_SCALE_NUMERATOR / amax
    return torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs))


def nvfp4_global_scale_ref(x: torch.Tensor, per_slice: bool = False) -> torch.Tensor:
    """The default global scale of x: one scalar, or one per ``x[i]`` when ``per_slice``."""
    a = x.abs()  # exact in x's dtype; max is one of its values
    if a.numel() == 0:
        amax = torch.zeros(a.shape[0] if per_slice else (), device=x.device)
    else:
        amax = a.flatten(1).amax(dim=1) if per_slice else a.amax()
    return global_scale_from_amax(amax)


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
    """Global scale broadcast to ``[lead, 1, 1]`` (one per slice) from a scalar or a ``[lead]`` tensor."""
    gs = gs.float().reshape(-1)
    if gs.numel() == 1:
        gs = gs.expand(lead)
    return gs.reshape(lead, 1, 1)


def quantize_nvfp4_ref(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Reference NVFP4 quantization of ``x [..., K]`` (K % 16 == 0).

    ``global_scale``: a scalar, or one per ``x[i]`` (shape ``[x.shape[0]]``); None computes the scalar
    ``2688 / amax(x)``. Returns ``(data uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale)``
    with the scales in the linear layout.
    """
    shape = x.shape
    k = shape[-1]
    if global_scale is None:
        global_scale = nvfp4_global_scale_ref(x)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    lead = shape[0] if (x.dim() > 1 and global_scale.numel() > 1) else 1
    xf = x.float().reshape(lead, -1, k // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = _per_row_global_scale(global_scale, lead, xf.shape[1]).unsqueeze(-1)  # [lead, 1, 1, 1]
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = ((amax / E2M1_MAX) * gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf = s.float()
    inv = torch.where(sf > 0, gs / sf, torch.zeros_like(sf))
    codes = e2m1_codes_ref(xf * inv).reshape(*shape[:-1], k)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return data, s.reshape(*shape[:-1], k // NVFP4_BLOCK), global_scale


def dequantize_nvfp4_ref(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference NVFP4 dequantization: ``(e2m1(q) * float(s)) / gs``, fp32, then cast to ``dtype``.

    ``scales`` in the linear layout ``[..., K/16]``; ``global_scale`` a scalar or one per ``data[i]``.
    """
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)
    k = codes.shape[-1]
    lead = data.shape[0] if (data.dim() > 1 and global_scale.numel() > 1) else 1
    vals = e2m1_values_ref(codes).reshape(lead, -1, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sf = scales.float().reshape(lead, -1, k // NVFP4_BLOCK, 1)
    gs = _per_row_global_scale(global_scale, lead, vals.shape[1]).unsqueeze(-1)
    return ((vals * sf) / gs).reshape(codes.shape).to(dtype)


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
