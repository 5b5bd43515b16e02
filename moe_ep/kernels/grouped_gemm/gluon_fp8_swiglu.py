"""The GEMM1 epilogue of the Gluon FP8 grouped GEMM (``gluon_fp8.py``): SwiGLU of a tile's promoted gate and up sums,
quantized to FP8 per row per 128 channels.

A GEMM1 tile is 128 output channels, one scale block, computed in two passes of 64 (``gluon_fp8``'s ``SWIGLU``): a
pass's weight slot holds its 64 gate rows then their 64 up rows, so one wgmma of N 128 gives both, gate's sums in
the accumulator's first 64 columns and up's in the last. In the wgmma accumulator layout a thread holds column c
and column c + 64 of its rows, so splitting the two halves apart moves no data between threads.

The numbers are the tl FP8 GEMM1's (``kernels._finish_tile``, ``_store_fp8_rows``) operation for operation:
``h = g / (1 + exp(-g)) * u`` in fp32 (Triton's ``/`` and ``exp``, as there), then per row of the 128-channel block
``s = amax / 448`` (IEEE division), 1.0 for an all-zero block, codes ``e4m3_rne(h / s)`` saturating (IEEE division,
``cvt.rn.satfinite``): ``reference.swiglu_fp8_ref`` of the fp32 values. Channels past I hold other weight rows'
sums; they are zeroed before the amax and not stored.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def swiglu_pass(acc, c0, N, out_layout: gl.constexpr):
    """``silu(gate) * up`` of one pass's sums ``acc [R, 2H]`` (gate's H columns, then up's), ``[R, H]`` in
    ``out_layout`` (the wgmma layout of N H, the same registers: the conversion is asserted trivial); columns from
    ``c0`` (the pass's first output channel) at or past N are 0."""
    R: gl.constexpr = acc.shape[0]
    H: gl.constexpr = acc.shape[1] // 2
    g, u = gl.split(gl.permute(gl.reshape(acc, [R, 2, H]), (0, 2, 1)))
    h = gl.convert_layout(g / (1.0 + gl.exp(-g)) * u, out_layout, assert_trivial=True)
    cols = c0 + gl.arange(0, H, layout=gl.SliceLayout(0, out_layout))
    return gl.where((cols < N)[None, :], h, 0.0)


@gluon.jit
def _codes(h, s):
    """e4m3_rne(h / s) (s per row, IEEE division), saturating."""
    hb, sb = gl.broadcast(h, s[:, None])
    return gl.div_rn(hb, sb).to(gl.float8e4nv)


@gluon.jit
def store_fp8_block(h0, h1, out_ptr, os_ptr, row0, end, n0, N):
    """Store the two passes' SwiGLU values ``h0``, ``h1`` (``[R, 64]`` each: channels n0 .. n0 + 127, one scale
    block) of rows row0 .. row0 + R - 1 quantized: codes into out ``[M, N]`` (e4m3) and one fp32 scale per row into
    os ``[M, ceil(N / 128)]``, for the rows below ``end`` (the expert's) and the channels below N."""
    layout: gl.constexpr = h0.type.layout
    R: gl.constexpr = h0.shape[0]
    H: gl.constexpr = h0.shape[1]
    rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    rmask = rows < end
    amax = gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1))
    s = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, layout=amax.type.layout))
    s = gl.where(s > 0, s, 1.0)
    cols = n0 + gl.arange(0, H, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + rows[:, None].to(gl.int64) * N + cols[None, :]
    gl.store(ptrs, _codes(h0, s), mask=rmask[:, None] & (cols[None, :] < N))
    gl.store(ptrs + H, _codes(h1, s), mask=rmask[:, None] & (cols[None, :] + H < N))
    gl.store(os_ptr + rows.to(gl.int64) * gl.cdiv(N, 128) + n0 // 128, s, mask=rmask)
