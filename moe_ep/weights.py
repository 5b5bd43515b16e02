"""ExpertWeights: one rank's local expert weights, bf16 or quantized to NVFP4 or FP8 once at construction (or NVFP4 /
FP8 as a checkpoint ships them: :meth:`ExpertWeights.from_nvfp4`, :meth:`ExpertWeights.from_fp8_blocks`)."""

from __future__ import annotations

import math

import torch

from .checkpoints import load_nvfp4_projections
from .config import Format
from .errors import MoEEpConfigError, MoEEpInputError, check, fail
from .fp8_checkpoints import load_fp8_projections
from .kernels.fp8 import FP8_BLOCK, Fp8Tensor, dequantize_fp8, quantize_fp8
from .kernels.nvfp4 import NvFp4Tensor, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The float dtypes moe-ep takes, for expert weights and routing weights alike (float64: cast it yourself)."""
_BF16_MAX = torch.finfo(torch.bfloat16).max


def check_no_grad(name: str, t: torch.Tensor) -> None:
    """moe-ep is inference only: a tensor that would need a gradient is refused rather than silently cut off."""
    if t.requires_grad and torch.is_grad_enabled():
        fail(f"{name}.requires_grad", True, "False: moe-ep is inference only (no autograd); call it under "
             "torch.no_grad() / torch.inference_mode(), or pass .detach()")


class ExpertWeights:
    """Local SwiGLU expert weights: ``w13 [L, 2I, H]`` (gate rows then up rows) and ``w2 [L, H, I]``.

    ``weight_format`` BF16 keeps them as bf16 tensors; NVFP4 quantizes each once, here, with one global
    scale per expert (``quantize_nvfp4(w, nvfp4_global_scale(w, per_slice=True))``); the layer then reads
    only the packed codes. FP8 quantizes each once, here, per 128x128 block (``quantize_fp8(w, 128)``; w13's
    gate and up rows blocked apart, ``gate_up=True``: docs/DESIGN.md, FP8). ``w13``/``w2`` attributes hold what the
    grouped GEMM consumes (a bf16 tensor, an :class:`NvFp4Tensor` or an :class:`Fp8Tensor`).

    Both are float32, bfloat16 or float16 (float64 is refused, as for routing weights), finite, on a CPU or
    CUDA device, and need no gradient (inference only); for BF16 every value must fit bf16 (``|w| <=``
    ``torch.finfo(torch.bfloat16).max``; it would become Inf). Construction checks the values (host syncs:
    once, here).

    ``activation_global_scale``: the static NVFP4 activation scale a checkpoint ships (:meth:`from_nvfp4`),
    else None.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, weight_format: Format | str = Format.BF16):
        try:
            weight_format = Format(weight_format)
        except (ValueError, TypeError):
            raise MoEEpConfigError(f"weight_format = {weight_format!r}; allowed: 'bf16', 'nvfp4', 'fp8'") from None
        for name, w in (("w13", w13), ("w2", w2)):
            check(isinstance(w, torch.Tensor), f"type({name})", type(w).__name__, "a torch.Tensor")
            check(w.dim() == 3, f"{name}.shape", tuple(w.shape), "3-D ([L, 2I, H] / [L, H, I])")
            check(w.dtype in FLOAT_DTYPES, f"{name}.dtype", w.dtype, "torch.float32, torch.bfloat16, torch.float16")
            check(w.device.type in ("cpu", "cuda"), f"{name}.device", str(w.device), "a cpu or cuda device")
            check_no_grad(name, w)
        L, two_i, H = w13.shape
        check(two_i % 2 == 0, "w13.shape[1] (2I)", two_i, "even (gate rows then up rows)")
        check(tuple(w2.shape) == (L, H, two_i // 2), "w2.shape", tuple(w2.shape), f"({L}, {H}, {two_i // 2})")
        check(w2.device == w13.device, "w2.device", str(w2.device), str(w13.device))
        for name, w in (("w13", w13), ("w2", w2)):
            _check_values(name, w, weight_format)
        self.format = weight_format
        self.num_local_experts, self.hidden_size, self.intermediate_size = L, H, two_i // 2
        self.activation_global_scale = None
        if weight_format is Format.NVFP4:
            self.w13 = quantize_nvfp4(w13, nvfp4_global_scale(w13, per_slice=True))
            self.w2 = quantize_nvfp4(w2, nvfp4_global_scale(w2, per_slice=True))
        elif weight_format is Format.FP8:  # (finite: checked above)
            self.w13 = quantize_fp8(w13, FP8_BLOCK, check_finite=False, gate_up=True)
            self.w2 = quantize_fp8(w2, FP8_BLOCK, check_finite=False)
        else:
            self.w13 = w13.to(torch.bfloat16).contiguous()
            self.w2 = w2.to(torch.bfloat16).contiguous()

    @classmethod
    def from_global(cls, w13_all: torch.Tensor, w2_all: torch.Tensor, rank: int, world_size: int,
                    weight_format: Format | str = Format.BF16, device=None) -> "ExpertWeights":
        """Rank ``rank``'s shard (experts ``rank*L .. rank*L+L-1``) of all experts' ``[E, 2I, H]``/``[E, H, I]``."""
        for name, w in (("w13_all", w13_all), ("w2_all", w2_all)):
            check(isinstance(w, torch.Tensor) and w.dim() == 3, f"{name}.shape",
                  tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__, "a 3-D torch.Tensor")
        for name, v in (("rank", rank), ("world_size", world_size)):
            check(isinstance(v, int) and not isinstance(v, bool), f"type({name})", type(v).__name__, "int")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise MoEEpInputError(f"device = {device!r}; allowed: a torch.device or its name") from None
        E = w13_all.shape[0]
        if world_size <= 0 or E % world_size:
            raise MoEEpConfigError(f"num_experts = {E}; allowed: a multiple of the world size ({world_size})")
        if not 0 <= rank < world_size:
            raise MoEEpInputError(f"rank = {rank}; allowed: [0, {world_size})")
        L = E // world_size
        sl = slice(rank * L, (rank + 1) * L)
        dev = device if device is not None else w13_all.device
        return cls(w13_all[sl].to(dev), w2_all[sl].to(dev), weight_format)

    @classmethod
    def from_nvfp4(cls, gate, up, down, *, device=None) -> "ExpertWeights":
        """NVFP4 weights as a ModelOpt checkpoint ships them, kept as they are (no re-quantization).

        ``gate``, ``up``, ``down``: each a :class:`~moe_ep.checkpoints.NvFp4Projection` (or a mapping of its
        fields) of the ``L`` local experts stacked: ``weight`` uint8 ``[L, out, in/2]``, ``weight_scale``
        float8_e4m3fn ``[L, out, in/16]``, ``weight_scale_2`` float32 ``[L]``, ``input_scale`` float32 ``[L]``
        or None; gate/up ``[L, I, H/2]``, down ``[L, H, I/2]``
        (:func:`~moe_ep.checkpoints.nvfp4_experts_from_state_dict` collects them from a state dict). ``w13``
        holds gate rows then up rows with global scale ``1 / weight_scale_2`` per expert; gate's and up's
        ``weight_scale_2`` must be equal, or a power of two apart where shifting one side's block scales is exact
        (else :class:`MoEEpInputError` says what to do; see :mod:`moe_ep.checkpoints`). ``device``: where the
        weights go (default: where they are).

        ``activation_global_scale`` becomes ``1 / max(input_scale)`` over gate's and up's experts (None without
        input scales): pass it as ``EpConfig(activation_format='nvfp4', activation_global_scale=...)``. With
        several ranks every rank needs the same value, taken over *all* the layer's experts:
        :func:`~moe_ep.checkpoints.nvfp4_activation_global_scale`. Checks values (host syncs: once, here).
        """
        w13, w2, act = load_nvfp4_projections(gate, up, down, device)
        self = cls.__new__(cls)
        self.format = Format.NVFP4
        L, two_i, H = w13.shape
        self.num_local_experts, self.hidden_size, self.intermediate_size = L, H, two_i // 2
        self.w13, self.w2, self.activation_global_scale = w13, w2, act
        return self

    @classmethod
    def from_fp8_blocks(cls, w13, w2, w13_scale_inv, w2_scale_inv, *, device=None) -> "ExpertWeights":
        """FP8 block-scaled weights as a DeepSeek-V3 / Qwen3-FP8 checkpoint ships them, kept as they are (no
        re-quantization; :mod:`moe_ep.fp8_checkpoints`).

        ``w13``: float8_e4m3fn ``[L, 2I, H]`` (gate rows then up rows) or a pair ``(gate, up)`` of ``[L, I, H]``;
        ``w13_scale_inv``: the same kind, fp32 ``[L, 2 * ceil(I / 128), ceil(H / 128)]`` (gate's row blocks then
        up's) or a pair of ``[L, ceil(I / 128), ceil(H / 128)]`` (each projection's ``weight_scale_inv``, stacked
        over the local experts). ``w2``: ``[L, H, I]`` e4m3, ``w2_scale_inv`` ``[L, ceil(H / 128), ceil(I / 128)]``.
        Value: ``q * scale_inv`` per 128x128 block. ``device``: where the weights go (default: where they are).
        Bad shapes, dtypes or devices, NaN codes and non-finite scales raise :class:`MoEEpInputError` (host syncs:
        once, here)."""
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise MoEEpInputError(f"device = {device!r}; allowed: a torch.device or its name") from None
        self = cls.__new__(cls)
        self.w13, self.w2 = load_fp8_projections(w13, w2, w13_scale_inv, w2_scale_inv, device)
        self.format = Format.FP8
        L, two_i, H = self.w13.shape
        self.num_local_experts, self.hidden_size, self.intermediate_size = L, H, two_i // 2
        self.activation_global_scale = None
        return self

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the layer computes with, as fp32 (dequantized when NVFP4 or FP8): the reference's operands."""
        def f(w):
            if isinstance(w, NvFp4Tensor):
                return dequantize_nvfp4(w, torch.float32)
            if isinstance(w, Fp8Tensor):
                return dequantize_fp8(w, torch.float32)
            return w.float()
        return f(self.w13), f(self.w2)


def _check_values(name: str, w: torch.Tensor, weight_format: Format) -> None:
    """Finite, and within bf16's range when stored as bf16: one host sync, at construction."""
    if not w.numel():
        return
    amax = w.detach().abs().amax().float().item()
    if not math.isfinite(amax):
        raise MoEEpInputError(f"{name} holds NaN or Inf; allowed: finite values")
    if weight_format is Format.BF16 and amax > _BF16_MAX:
        raise MoEEpInputError(f"{name} max |value| = {amax:.4g}; allowed: <= {_BF16_MAX:.4g} (bf16's largest "
                              "finite value; larger ones would become Inf in bf16)")
