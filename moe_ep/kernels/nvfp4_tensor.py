"""NvFp4Tensor, the NVFP4 tensor type (packed E2M1 codes, E4M3 block scales, fp32 global scales), and the 128x4
scale swizzle: the data layout, without the quantize / dequantize kernels (``moe_ep.kernels.nvfp4``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import torch

from ..errors import check, fail

NVFP4_BLOCK = 16  # elements per E4M3 block scale


def swizzled_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded (rows, scale columns) of the 128x4 swizzled layout: rows to 128, columns to 4."""
    return -(-rows // 128) * 128, -(-scale_cols // 4) * 4


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


@dataclass
class NvFp4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape = [..., K]`` (K a positive multiple of 16).

    - ``data``: uint8 ``[..., K/2]``, element 2i in the low nibble, 2i+1 in the high nibble.
    - ``scales``: float8_e4m3fn, linear ``[..., K/16]``, or, when ``swizzled``, the 128x4 layout
      flattened per slice of ``shape[:-2]``: ``[*shape[:-2], Mp * Cp]`` (rows padded to 128, scale
      columns to 4, padding zero).
    - ``global_scale``: float32, one value (any shape of one element), ``[shape[0]]`` values (one per
      slice, e.g. per expert), or one per row (``prod(shape[:-1])`` values: received tokens keep their source
      rank's scale).
    Value of element i: ``e2m1(q_i) * float(s_block) / global_scale``.

    The parts are checked against each other (shapes, dtypes, one device) when the tensor is made, and again
    by every launcher that takes one (:meth:`check`): a mismatch raises :class:`MoEEpInputError` naming the part.
    Parts need not be contiguous (launchers copy those that are not).
    """

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    swizzled: bool = False

    def __post_init__(self):
        if not (isinstance(self.shape, (tuple, list)) and all(_is_int(d) and d >= 0 for d in self.shape)):
            fail("NvFp4Tensor.shape", self.shape, "a tuple or torch.Size of non-negative ints")
        self.shape = torch.Size(self.shape)
        self.check("NvFp4Tensor")

    def check(self, name: str = "q") -> None:
        """Raise :class:`MoEEpInputError` unless the parts agree with ``shape`` and with each other (no sync)."""
        data, scales, gs, shape = self.data, self.scales, self.global_scale, self.shape
        try:  # the common case in one expression: launchers call this every step
            K = shape[-1]
            ok = (data.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn and gs.dtype == torch.float32
                  and isinstance(shape, torch.Size) and K > 0 and K % NVFP4_BLOCK == 0 and self.swizzled in (False, True)
                  and data.shape[:-1] == shape[:-1] and data.shape[-1] == K // 2 and scales.shape == self._scales_shape()
                  and data.device == scales.device == gs.device)
            n = gs.numel()
            ok = ok and (n == 1 or n == math.prod(shape[:-1]) or (len(shape) > 1 and n == shape[0]))
        except (AttributeError, TypeError, IndexError):
            ok = False
        if not ok:
            self._explain(name)

    def _explain(self, name: str) -> None:
        """Raise the error naming the first part that does not agree."""
        data, scales, gs, shape = self.data, self.scales, self.global_scale, self.shape
        for part, t, dt in (("data", data, torch.uint8), ("scales", scales, torch.float8_e4m3fn),
                            ("global_scale", gs, torch.float32)):
            if not isinstance(t, torch.Tensor):
                fail(f"type({name}.{part})", type(t).__name__, f"a {dt} torch.Tensor")
            if t.dtype != dt:
                fail(f"{name}.{part}.dtype", t.dtype, str(dt))
        if not isinstance(self.swizzled, bool):
            fail(f"{name}.swizzled", self.swizzled, "True or False")
        if not (isinstance(shape, torch.Size) and len(shape) >= 1 and shape[-1] > 0 and shape[-1] % NVFP4_BLOCK == 0):
            fail(f"{name}.shape", tuple(shape) if isinstance(shape, tuple) else shape,
                 "a torch.Size [..., K] with K a positive multiple of 16")
        K = shape[-1]
        if data.shape != (*shape[:-1], K // 2):
            fail(f"{name}.data.shape", tuple(data.shape), f"{(*shape[:-1], K // 2)} (shape[:-1] + [K/2])")
        if scales.shape != self._scales_shape():
            fail(f"{name}.scales.shape", tuple(scales.shape), f"{tuple(self._scales_shape())} (the "
                 + ("128x4 swizzled layout [*shape[:-2], Mp*Cp]" if self.swizzled else "linear layout [..., K/16]")
                 + f" for shape {tuple(shape)}, swizzled={self.swizzled})")
        rows = math.prod(shape[:-1])
        n = gs.numel()
        if not (n == 1 or n == rows or (len(shape) > 1 and n == shape[0])):
            fail(f"{name}.global_scale.numel()", n, f"1, {shape[0]} (one per {name}[i]) or {rows} (one per row)"
                 if len(shape) > 1 else "1")
        fail(f"{name} devices (data, scales, global_scale)", (str(data.device), str(scales.device), str(gs.device)),
             "one device for all parts")

    def _scales_shape(self) -> tuple:
        shape, kc = self.shape, self.shape[-1] // NVFP4_BLOCK
        if not self.swizzled:
            return (*shape[:-1], kc)
        mp, cp = swizzled_scale_shape(shape[-2] if len(shape) >= 2 else 1, kc)
        return (*shape[:-2], mp * cp)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def row_parts(self, broadcast_shared: bool = False) -> tuple[torch.Tensor, ...]:
        """The per-row parts (``moe_ep.kernels.row_parts``), each ``[*shape[:-1], width]``: the codes uint8
        ``[..., K/2]``, the scales' bytes uint8 ``[..., K/16]`` and, when there is one per row (and more than one
        row), the global scales float32 ``[..., 1]``. A global scale the rows share (one value, or one per slice) is
        no row part (:meth:`with_row_parts` keeps it) unless ``broadcast_shared``: then it comes as one per row too
        (a stride-0 view), the parts :meth:`row_part_specs` lists, as rows bound for one buffer with rows of other
        tensors need. Linear scales only (a swizzled tile mixes 128 rows)."""
        if self.swizzled:
            fail("NvFp4Tensor.swizzled", True, "False (row parts need linear scales: a 128x4 tile mixes rows)")
        lead, gs = self.shape[:-1], self.global_scale
        parts = (self.data, self.scales.view(torch.uint8))
        n = gs.numel()
        if n == math.prod(lead) and (n > 1 or broadcast_shared):
            return parts + (gs.reshape(*lead, 1),)
        if not broadcast_shared:
            return parts
        ones = (1,) * len(lead)
        shared = gs.reshape(*ones, 1) if n == 1 else gs.reshape(lead[0], *ones[1:], 1)  # one per slice
        return parts + (shared.expand(*lead, 1),)

    @staticmethod
    def row_part_specs(hidden: int) -> tuple[tuple[int, torch.dtype], ...]:
        """(width, dtype) of each of :meth:`row_parts` for rows of ``hidden`` channels, global scales per row."""
        return (hidden // 2, torch.uint8), (hidden // NVFP4_BLOCK, torch.uint8), (1, torch.float32)

    @classmethod
    def from_row_parts(cls, parts, global_scale: torch.Tensor | None = None) -> NvFp4Tensor:
        """The tensor of row parts as :meth:`row_parts` gives them, of any rows: codes, scales and per-row global
        scales, or codes and scales with ``global_scale`` shared by the rows."""
        data, scales, *per_row = parts
        lead = data.shape[:-1]
        gs = per_row[0].reshape(lead) if per_row else global_scale
        return cls(data, scales.view(torch.float8_e4m3fn), gs, torch.Size((*lead, 2 * data.shape[-1])))

    def with_row_parts(self, parts) -> NvFp4Tensor:
        """This format with other rows (``parts`` as :meth:`row_parts` gives them); a shared global scale kept
        (one value as ``[1]``)."""
        gs = self.global_scale
        return self.from_row_parts(parts, None if len(parts) == 3 else gs if gs.dim() == 1 else gs.reshape(-1))

    def linear_scales(self) -> torch.Tensor:
        """The scales in the linear layout ``[..., K/16]`` (a copy when swizzled)."""
        if not self.swizzled:
            return self.scales
        rows = self.shape[-2] if len(self.shape) >= 2 else 1
        lin = unswizzle_scales(self.scales, rows, self.shape[-1] // NVFP4_BLOCK)
        return lin.reshape(*self.shape[:-1], self.shape[-1] // NVFP4_BLOCK)


def _swizzle_offsets(rows: int, scale_cols: int, device) -> torch.Tensor:
    """int64 ``[rows * scale_cols]``: where linear scale (m, c) lands in a 128x4-swizzled slice (``swizzled_offset``)."""
    cp = swizzled_scale_shape(rows, scale_cols)[1]
    m = torch.arange(rows, device=device)[:, None]
    c = torch.arange(scale_cols, device=device)[None, :]
    return (((m // 128) * (cp // 4) + c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4).reshape(-1)


def _check_scales_tensor(t, name: str) -> None:
    check(isinstance(t, torch.Tensor), f"type({name})", type(t).__name__, "a float8_e4m3fn torch.Tensor")
    check(t.dtype == torch.float8_e4m3fn, f"{name}.dtype", t.dtype, "torch.float8_e4m3fn")
    check(t.device.type != "meta", f"{name}.device", str(t.device), "a device holding data (not meta)")


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales float8_e4m3fn ``[..., M, C]`` (C = K/16) -> the 128x4 swizzled layout, flat ``[..., Mp * Cp]``
    (rows padded to 128, columns to 4, padding zero): scale (m, c) at
    ``((m // 128) * (Cp // 4) + c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4``, the layout
    CUTLASS and ``tl.dot_scaled`` read. Each slice of the leading dims is swizzled on its own."""
    _check_scales_tensor(scales, "scales")
    check(scales.dim() >= 2, "scales.dim()", scales.dim(), ">= 2 ([..., M, K/16]; a 1-D tensor is already flat)")
    *lead, m, c = scales.shape
    mp, cp = swizzled_scale_shape(m, c)
    out = torch.zeros(*lead, mp * cp, dtype=torch.uint8, device=scales.device)
    out.index_copy_(-1, _swizzle_offsets(m, c, scales.device), scales.contiguous().view(torch.uint8).reshape(*lead, m * c))
    return out.view(torch.float8_e4m3fn)


def unswizzle_scales(buf: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: float8_e4m3fn ``[..., Mp * Cp]`` -> linear ``[..., rows, scale_cols]``
    (``rows`` > 0, ``scale_cols`` > 0 the unpadded sizes; ``buf.shape[-1]`` must be their padded product)."""
    _check_scales_tensor(buf, "buf")
    check(buf.dim() >= 1, "buf.dim()", buf.dim(), ">= 1 ([..., Mp * Cp])")
    check(_is_int(rows) and rows > 0, "rows", rows, "a positive int")
    check(_is_int(scale_cols) and scale_cols > 0, "scale_cols", scale_cols, "a positive int")
    mp, cp = swizzled_scale_shape(rows, scale_cols)
    check(buf.shape[-1] == mp * cp, "buf.shape[-1]", buf.shape[-1],
          f"{mp * cp} (rows {rows} padded to {mp} x scale_cols {scale_cols} padded to {cp})")
    lin = buf.contiguous().view(torch.uint8).index_select(-1, _swizzle_offsets(rows, scale_cols, buf.device))
    return lin.reshape(*buf.shape[:-1], rows, scale_cols).view(torch.float8_e4m3fn)
