"""A token payload's row parts: the per-row tensors that travel together, gathered, scattered and packed row by row.

A payload is bf16 rows ``[..., H]``, an :class:`NvFp4Tensor` with linear scales (codes, the scales' bytes, and the
global scales when there is one per row) or an :class:`Fp8Tensor` of activations (the codes' bytes, one fp32 scale
per row per 128 channels). Each part is ``[..., width]``, the payload's row dims in front, in a dtype the row
kernels copy (e4m3 as its uint8 bytes); what is shared by the rows (an NVFP4 tensor's one global scale) is no part
and stays with the payload, except where rows of several payloads meet in one buffer (a transport's: then it
comes as one per row). Code that moves rows (the transports' layouts and exchange, the bridge's permute, the
compute's flattening) does it once per part, one code path for every format.
"""

from __future__ import annotations

import torch

from .fp8 import Fp8Tensor
from .nvfp4_tensor import NvFp4Tensor


def row_parts(x, broadcast_shared: bool = False) -> tuple[torch.Tensor, ...]:
    """The per-row parts of payload ``x`` (a tensor is its own one part). ``broadcast_shared``: what the rows share
    comes as one part per row too, the parts :func:`row_part_specs` lists (rows bound for one buffer with rows of
    other payloads: a transport's)."""
    return (x,) if isinstance(x, torch.Tensor) else x.row_parts(broadcast_shared)


def with_row_parts(x, parts):
    """A payload of ``x``'s format whose rows are ``parts`` (as :func:`row_parts` gives them, of any rows); what
    ``x``'s rows share is kept."""
    return parts[0] if isinstance(x, torch.Tensor) else x.with_row_parts(parts)


def reshape_rows(x, rows: tuple):
    """Payload ``x`` with its row dims reshaped to ``rows`` (views where the strides allow)."""
    return with_row_parts(x, [p.reshape(*rows, p.shape[-1]) for p in row_parts(x)])


def payload_type(nvfp4: bool, fp8: bool) -> type:
    """The type of a payload of bf16 rows (``torch.Tensor``), NVFP4 or FP8 activations."""
    return NvFp4Tensor if nvfp4 else Fp8Tensor if fp8 else torch.Tensor


def row_part_specs(kind: type, hidden: int) -> tuple[tuple[int, torch.dtype], ...]:
    """(width, dtype) of each row part of a payload of type ``kind`` (:func:`payload_type`) with ``hidden`` channels
    (NVFP4: one global scale per row)."""
    return ((hidden, torch.bfloat16),) if kind is torch.Tensor else kind.row_part_specs(hidden)


def from_row_parts(kind: type, parts):
    """The payload of type ``kind`` whose rows are ``parts`` (all per row, as :func:`row_part_specs` says)."""
    return parts[0] if kind is torch.Tensor else kind.from_row_parts(parts)
