"""The checks of a routed MoE call's inputs, shared by ``MoEEpLayer.forward`` and ``fused_moe``.

:func:`check_routing_inputs` is cheap (shapes, dtypes, devices, autograd: no host sync) and always runs;
:func:`check_routing_values` reads the values (id ranges, duplicate ids in a row, finite weights, and finite tokens
where NVFP4 activations cannot carry NaN or Inf) at the cost of one host sync, and runs when validation is on.
Both raise :class:`~moe_ep.MoEEpInputError` naming the argument, its value and what is allowed.
"""

from __future__ import annotations

import torch

from .errors import MoEEpInputError, fail
from .weights import FLOAT_DTYPES, check_no_grad

IDX_DTYPES = (torch.int32, torch.int64)
"""The dtypes of ``topk_idx``."""


def check_routing_inputs(x, idx, w, *, hidden_size: int, top_k: int, device: torch.device,
                         max_tokens: int | None = None) -> None:
    """``x [B, H]`` bf16, ``idx [B, K]`` int32/int64, ``w [B, K]`` float32/bfloat16/float16, all on ``device``,
    none needing a gradient; ``B <= max_tokens`` when given."""
    for name, t in (("hidden_states", x), ("topk_idx", idx), ("topk_weights", w)):  # cheap when it passes
        if not isinstance(t, torch.Tensor):
            fail(f"type({name})", type(t).__name__, "a torch.Tensor")
        if t.dim() != 2:
            fail(f"{name}.shape", tuple(t.shape), "2-D")
        if t.device != device:
            fail(f"{name}.device", str(t.device), f"{device} (the weights' device)")
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):  # never drop a gradient silently
        check_no_grad("hidden_states", x)
        check_no_grad("topk_weights", w)
    B, K = x.shape[0], top_k
    if x.shape[1] != hidden_size:
        fail("hidden_states.shape", tuple(x.shape), f"[B, {hidden_size}]")
    if x.dtype != torch.bfloat16:
        fail("hidden_states.dtype", x.dtype, "torch.bfloat16")
    if max_tokens is not None and B > max_tokens:
        fail("hidden_states.shape[0] (tokens)", B, f"<= max_tokens_per_rank ({max_tokens})")
    if idx.shape[0] != B or idx.shape[1] != K:
        fail("topk_idx.shape", tuple(idx.shape), f"({B}, {K})")
    if idx.dtype not in IDX_DTYPES:
        fail("topk_idx.dtype", idx.dtype, "torch.int32, torch.int64")
    if w.shape[0] != B or w.shape[1] != K:
        fail("topk_weights.shape", tuple(w.shape), f"({B}, {K})")
    if w.dtype not in FLOAT_DTYPES:
        fail("topk_weights.dtype", w.dtype, "torch.float32, torch.bfloat16, torch.float16")


def check_routing_values(x, idx, w, num_experts: int, finite_tokens: bool) -> None:
    """Ids in ``[-1, num_experts)``, distinct ids per row (-1 may repeat), finite weights and, with
    ``finite_tokens``, finite hidden states: one host sync, the details read only on failure."""
    E = num_experts
    s = idx.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
    checks = [(idx < -1).any() | (idx >= E).any(), dup.any(), ~torch.isfinite(w).all()]
    if finite_tokens:
        checks.append(~torch.isfinite(x).all())
    bad = torch.stack(checks)
    if not bool(bad.any()):
        return
    if bool(bad[0]):
        lo, hi = int(idx.min()), int(idx.max())
        raise MoEEpInputError(f"topk_idx range = ({lo}, {hi}); allowed: ids in [-1, {E})")
    if bool(bad[1]):
        row = int(dup.nonzero()[0, 0])
        raise MoEEpInputError(f"topk_idx[{row}] = {idx[row].tolist()}; allowed: distinct expert ids "
                              "per row (-1 may repeat)")
    if bool(bad[2]):
        raise MoEEpInputError("topk_weights holds NaN or Inf; allowed: finite values")
    row = int((~torch.isfinite(x)).any(dim=1).nonzero()[0, 0])
    raise MoEEpInputError(f"hidden_states[{row}] holds NaN or Inf; allowed: finite values (NVFP4 and FP8 "
                          "activations have no NaN or Inf; with validate=False such a token comes out NaN with NVFP4, "
                          "unspecified with FP8, the others untouched)")
