"""FP8 block-scaled expert weights as a DeepSeek-V3 / Qwen3-FP8 checkpoint ships them, taken as they are: never
re-quantized.

Such a checkpoint (``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``) stores each
projection of each expert (an ``nn.Linear`` weight ``[out, in]``) as ``weight`` float8_e4m3fn ``[out, in]`` and
``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]`` (fp32; bf16 / fp16 are taken too, widened exactly), one
scale per 128x128 block in the dequantize-*multiply* convention: ``value = float(q) * scale_inv[r // 128, c // 128]``,
which is moe-ep's FP8 (``Fp8Tensor(block_rows=128)``) as it is.

gate_proj and up_proj become one ``w13`` (gate rows then up rows) whose scales are gate's row blocks then up's
(``Fp8Tensor.gate_up``): where I is not a multiple of 128 a 128-row block of the stacked rows would hold gate and up
rows under one scale, which the two shipped scales cannot be made into without re-quantizing.
"""

from __future__ import annotations

import torch

from .errors import MoEEpInputError, check, fail
from .kernels.fp8 import FP8_BLOCK, Fp8Tensor, fp8_scales_shape

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_fp8_projections(w13, w2, w13_scale_inv, w2_scale_inv, device=None) -> tuple[Fp8Tensor, Fp8Tensor]:
    """``(w13, w2)`` Fp8Tensors (``block_rows`` 128; w13 ``gate_up``) from a checkpoint's tensors of ``L`` experts.

    ``w13``: float8_e4m3fn ``[L, 2I, H]`` (gate rows then up rows), or a pair ``(gate, up)`` of ``[L, I, H]``;
    ``w13_scale_inv``: ``[L, 2 * ceil(I / 128), ceil(H / 128)]`` (gate's row blocks then up's), or a pair of
    ``[L, ceil(I / 128), ceil(H / 128)]``, the same kind as ``w13``. ``w2``: ``[L, H, I]``, ``w2_scale_inv``
    ``[L, ceil(H / 128), ceil(I / 128)]``. H and I multiples of 16 (the GEMMs' K), scales finite, codes not NaN
    (e4m3fn's 0x7F / 0xFF): host syncs, once, here. ``device``: where the weights go (default: where they are).
    Every mismatch raises :class:`MoEEpInputError` naming the argument.
    """
    pair = isinstance(w13, (tuple, list))
    if pair != isinstance(w13_scale_inv, (tuple, list)):
        fail("(type(w13), type(w13_scale_inv))", (type(w13).__name__, type(w13_scale_inv).__name__),
             "both a (gate, up) pair, or both stacked tensors")
    if pair:
        check(len(w13) == 2, "len(w13)", len(w13), "2 (gate, up)")
        check(len(w13_scale_inv) == 2, "len(w13_scale_inv)", len(w13_scale_inv), "2 (gate, up)")
        gate, up = (_data(t, f"w13[{i}]", device) for i, t in enumerate(w13))
        if gate.shape != up.shape:
            fail("w13[1].shape (up)", tuple(up.shape), f"{tuple(gate.shape)} (gate's)")
        gs, us = (_scales(t, f"w13_scale_inv[{i}]", gate.shape, False, gate.device, device)
                  for i, t in enumerate(w13_scale_inv))
        data13, scales13 = torch.cat([gate, up], dim=1), torch.cat([gs, us], dim=1)
    else:
        data13 = _data(w13, "w13", device)
        check(data13.shape[1] % 2 == 0, "w13.shape[1] (2I)", data13.shape[1], "even (gate rows then up rows)")
        scales13 = _scales(w13_scale_inv, "w13_scale_inv", data13.shape, True, data13.device, device)
    L, two_i, H = data13.shape
    data2 = _data(w2, "w2", device)
    if tuple(data2.shape) != (L, H, two_i // 2):
        fail("w2.shape", tuple(data2.shape), f"{(L, H, two_i // 2)} (from w13 {(L, two_i, H)})")
    scales2 = _scales(w2_scale_inv, "w2_scale_inv", data2.shape, False, data13.device, device)
    check(H % 16 == 0, "hidden size H", H, "a multiple of 16")
    check(two_i // 2 % 16 == 0, "intermediate size I", two_i // 2, "a multiple of 16")
    return Fp8Tensor(data13.contiguous(), scales13.contiguous(), FP8_BLOCK, True), \
        Fp8Tensor(data2.contiguous(), scales2.contiguous(), FP8_BLOCK)


def _data(t, name: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"type({name})", type(t).__name__, "a float8_e4m3fn torch.Tensor")
    if t.dtype != torch.float8_e4m3fn:
        fail(f"{name}.dtype", t.dtype, "torch.float8_e4m3fn (a checkpoint's FP8 weight as shipped)")
    if t.dim() != 3:
        fail(f"{name}.shape", tuple(t.shape), "[L, rows, cols] (the local experts stacked)")
    t = t.detach().to(device) if device is not None else t.detach()
    if t.numel() and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise MoEEpInputError(f"{name} holds NaN codes (0x7F / 0xFF); allowed: finite e4m3 values")
    return t


def _scales(t, name: str, data_shape, gate_up: bool, data_device, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"type({name})", type(t).__name__, "a float32 torch.Tensor (weight_scale_inv)")
    if t.dtype not in SCALE_DTYPES:
        fail(f"{name}.dtype", t.dtype, "torch.float32 (or bfloat16 / float16, widened exactly)")
    want = fp8_scales_shape(tuple(data_shape), FP8_BLOCK, gate_up)
    if tuple(t.shape) != want:
        layout = "gate's row blocks then up's" if gate_up else "one per 128x128 block"
        fail(f"{name}.shape", tuple(t.shape), f"{want} ({layout} of {tuple(data_shape)})")
    t = t.detach().to(device) if device is not None else t.detach()
    if t.device != data_device:
        fail(f"{name}.device", str(t.device), f"{data_device} (the weights')")
    t = t.float()
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise MoEEpInputError(f"{name} holds NaN or Inf; allowed: finite scales")
    return t
